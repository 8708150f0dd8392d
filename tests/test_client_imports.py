"""The client side must import on a laptop with no torch, transformers or ray."""


def test_client_modules_import_without_torch(run_without_heavy_packages):
    result = run_without_heavy_packages(
        "import opentinker, opentinker.config, opentinker.environments.arithmetic\n"
        "from opentinker.config import make_config\n"
        "make_config(['algorithm.adv_estimator=rloo'])\n"
        "print('ok', opentinker.__version__)"
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("ok")


def test_blocker_really_blocks_torch(run_without_heavy_packages):
    # Guards the guard: if the blocker silently stopped working, the test above would prove nothing.
    result = run_without_heavy_packages("import opentinker.engine.batch")
    assert result.returncode != 0
    assert "blocked heavy import: torch" in result.stderr
