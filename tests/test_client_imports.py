"""The client side must import on a laptop with no torch, transformers or ray."""

import subprocess
import sys
import textwrap

HEAVY = ("torch", "transformers", "ray", "vllm")

BLOCKER = textwrap.dedent(
    f"""
    import sys
    class Block:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in {HEAVY!r}:
                raise ImportError("blocked heavy import: " + name)
    sys.meta_path.insert(0, Block())
    """
)


def run_without_heavy_packages(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", BLOCKER + code], capture_output=True, text=True, timeout=60)


def test_client_modules_import_without_torch():
    result = run_without_heavy_packages(
        "import opentinker, opentinker.config, opentinker.environments.arithmetic\n"
        "from opentinker.config import make_config\n"
        "make_config(['algorithm.adv_estimator=rloo'])\n"
        "print('ok', opentinker.__version__)"
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("ok")


def test_blocker_really_blocks_torch():
    # Guards the guard: if the blocker silently stopped working, the test above would prove nothing.
    result = run_without_heavy_packages("import opentinker.engine.batch")
    assert result.returncode != 0
    assert "blocked heavy import: torch" in result.stderr
