"""Shared fixtures. The embedded tiny model is built once per machine into the user cache."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

HEAVY_PACKAGES = ("torch", "transformers", "ray", "vllm", "aiohttp")  # none in the thin client
_HEAVY_IMPORT_BLOCKER = textwrap.dedent(
    f"""
    import sys
    class Block:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in {HEAVY_PACKAGES!r}:
                raise ImportError("blocked heavy import: " + name)
    sys.meta_path.insert(0, Block())
    """
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The files with a test marked ``heavy`` (minutes each) go first. The xdist workers
    (``--dist loadfile``) take files in this order, so the long ones start early and the two
    workers end together instead of one running the last long file alone."""
    heavy = {item.path for item in items if item.get_closest_marker("heavy")}
    items.sort(key=lambda item: item.path not in heavy)  # stable: each file's tests keep their order


@pytest.fixture(autouse=True)
def tinker_sessions_end_with_their_test(monkeypatch):
    """Every ``tinker.ServiceClient`` a test makes is closed when the test ends. An open one
    keeps a heartbeat thread that logs a warning every 10 s, for the rest of the run, once its
    server is gone. Only where the test module already imported the SDK."""
    tinker = sys.modules.get("tinker")
    if tinker is None:
        yield
        return
    opened = []
    original_init = tinker.ServiceClient.__init__

    def recording_init(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        opened.append(self)

    monkeypatch.setattr(tinker.ServiceClient, "__init__", recording_init)
    yield
    for service in opened:
        service.close("interrupted")  # not awaited: its server may already have stopped


@pytest.fixture
def run_without_heavy_packages():
    """``run(code) -> CompletedProcess``: Python code in a subprocess where importing torch,
    transformers, ray, vllm or aiohttp fails, as on a laptop with only the thin client."""

    def run(code: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", _HEAVY_IMPORT_BLOCKER + textwrap.dedent(code)],
                              capture_output=True, text=True, timeout=60)

    return run


@pytest.fixture(scope="session")
def tiny_model_dir():
    from opentinker.tiny import ensure_tiny_model

    return ensure_tiny_model()


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_dir):
    from opentinker.engine.model_loading import load_tokenizer

    return load_tokenizer(str(tiny_model_dir))


@pytest.fixture
def tiny_model(tiny_model_dir):
    """A fresh copy per test, so tests that train never leak weights into each other."""
    from opentinker.engine.model_loading import load_causal_lm

    return load_causal_lm(str(tiny_model_dir)).eval()


@pytest.fixture
def arithmetic_prompt_ids(tiny_tokenizer):
    from opentinker.engine.data import chat_prompt_ids
    from opentinker.environments.arithmetic import make_problems

    return [chat_prompt_ids(tiny_tokenizer, p.messages()) for p in make_problems(6, seed=11)]


@pytest.fixture
def make_backend(tiny_model_dir, tiny_tokenizer):
    """``make_backend(*overrides)``: the configured training backend on a fresh copy of the tiny model (on CPU)."""
    from opentinker.config import make_config
    from opentinker.engine.backend import BackendSpec
    from opentinker.engine.backend import make_backend as build

    def make(*overrides: str):
        cfg = make_config(["trainer.device=cpu", *overrides])
        return build(BackendSpec.from_config(cfg, str(tiny_model_dir), tiny_tokenizer.pad_token_id))

    return make


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray for the whole test session (FSDP ranks, server job actors); its address."""
    ray = pytest.importorskip("ray")
    # Logical CPUs: FSDP placement groups reserve one per rank while job actors hold none.
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, namespace="opentinker-tests")
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()


def _start_heldout_run(folder, *overrides: str, lr: float = 3e-5):
    """Start the run of ``heldout_run`` in the background (its metrics and stderr go to
    ``folder``); returns ``wait(timeout=600) -> metrics history``, which fails with the run's
    stderr if it fails and kills it if it is still running when ``wait`` returns or raises."""
    import json
    from pathlib import Path

    folder = Path(folder)
    metrics_file, stderr_file = folder / "metrics.jsonl", folder / "stderr.txt"
    with open(stderr_file, "w") as stderr:
        process = subprocess.Popen(
            [sys.executable, "-m", "opentinker.engine.ppo.cli",
             "trainer.total_training_steps=60", "trainer.test_freq=60", "data.val_batch_size=200",
             f"actor_rollout_ref.actor.optim.lr={lr}", "actor_rollout_ref.actor.use_kl_loss=true",
             "trainer.seed=0", "trainer.progress_bar=false", f"--metrics-out={metrics_file}", *overrides],
            stdout=subprocess.DEVNULL, stderr=stderr,
        )

    def wait(timeout: int = 600) -> list[dict]:
        try:
            returncode = process.wait(timeout=timeout)
        finally:
            process.kill()  # only where the wait timed out or was interrupted
        assert returncode == 0, stderr_file.read_text()[-3000:]
        return [json.loads(line) for line in metrics_file.read_text().splitlines()]

    wait.process = process
    return wait


@pytest.fixture
def heldout_run(tmp_path):
    """``run(*overrides, lr=3e-5, timeout=600) -> metrics history``: a seeded 60-step GRPO run of
    ``opentinker-train`` on the warm tiny model (KL loss on, held-out accuracy at steps 0 and
    60) in a subprocess; fails with its stderr if it fails."""

    def run(*overrides: str, lr: float = 3e-5, timeout: int = 600) -> list[dict]:
        return _start_heldout_run(tmp_path, *overrides, lr=lr)(timeout)

    return run


@pytest.fixture(scope="session")
def start_heldout_run():
    """``start(folder, *overrides, lr=3e-5) -> wait(timeout=600) -> metrics history``: the run of
    ``heldout_run`` started in the background, so that a module can run several at once."""
    return _start_heldout_run
