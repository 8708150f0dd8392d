"""Resume: a run stopped hard after step 3 and resumed with trainer.resume_mode=auto ends at
step 6 exactly where an unbroken 6-step run does (metrics and weights), also with pictures."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch

from opentinker.config import ConfigError, make_config
from opentinker.engine.model_loading import load_causal_lm
from opentinker.engine.ppo.checkpoints import find_checkpoint

pytestmark = pytest.mark.heavy  # minutes: scheduled first (tests/conftest.py)

CONFIG = [
    "data.train_batch_size=2", "actor_rollout_ref.actor.ppo_mini_batch_size=1", "actor_rollout_ref.rollout.n=4",
    "actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.actor.optim.lr=1e-4",
    "actor_rollout_ref.actor.optim.warmup_style=cosine", "actor_rollout_ref.actor.optim.lr_warmup_steps=2",
    "trainer.total_training_steps=6", "trainer.save_freq=3", "trainer.test_freq=-1", "trainer.progress_bar=false",
]
RUN = textwrap.dedent("""
    import json, os, sys
    from opentinker.config import make_config
    from opentinker.engine.ppo.trainer import RLTrainer
    overrides, out, stop_after = json.loads(sys.argv[1]), sys.argv[2], int(sys.argv[3])

    def on_step(step, metrics):
        with open(out, "a") as f:
            f.write(json.dumps({k: v for k, v in metrics.items() if isinstance(v, (int, float))}) + "\\n")
        if step == stop_after:
            os._exit(9)  # killed: no cleanup, no later steps

    RLTrainer(make_config(overrides)).fit(on_step=on_step)
""")


def start(overrides: list[str], out, stop_after: int = -1) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", RUN, json.dumps(overrides), str(out), str(stop_after)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def run(overrides: list[str], out, stop_after: int = -1) -> int:
    process = start(overrides, out, stop_after)
    try:
        return process.wait(timeout=600)
    finally:
        process.kill()  # only where the wait timed out; a no-op for a finished process


@pytest.mark.parametrize("backend", [
    [],
    ["actor_rollout_ref.actor.strategy=fsdp", "trainer.device=cpu", "trainer.n_gpus_per_node=2"],
    # Pictures: the tiny VLM on digit sums (the prompts' pixels are made again after the resume).
    ["actor_rollout_ref.model.path=tiny-vlm", "data.task=digit_sum", "data.max_response_length=8"],
], ids=["local", "fsdp-2-ranks", "vlm"])
def test_a_killed_run_resumes_exactly(tiny_model_dir, tmp_path, backend):
    straight, broken = tmp_path / "straight", tmp_path / "broken"
    config = [*CONFIG, *backend]
    # The unbroken run and the one killed after step 3 do not depend on each other: both at once.
    # Much of each is start-up (imports, with FSDP its own Ray and ranks) that overlaps well: on two
    # cores two FSDP runs took 44 s together against 62 s one after the other.
    runs = [start([*config, f"trainer.default_local_dir={straight}"], tmp_path / "a.jsonl"),
            start([*config, f"trainer.default_local_dir={broken}"], tmp_path / "b.jsonl", stop_after=3)]
    try:
        assert [process.wait(timeout=600) for process in runs] == [0, 9]
    finally:
        for process in runs:
            process.kill()  # only where a wait timed out; a no-op for a finished process
    assert (broken / "latest_checkpointed_iteration.txt").read_text() == "3"
    assert run([*config, f"trainer.default_local_dir={broken}", "trainer.resume_mode=auto"], tmp_path / "b.jsonl") == 0
    a = [json.loads(line) for line in (tmp_path / "a.jsonl").read_text().splitlines()]
    b = [json.loads(line) for line in (tmp_path / "b.jsonl").read_text().splitlines()]
    assert [m["step"] for m in b] == [1, 2, 3, 4, 5, 6]  # no step twice, none missing
    for key in ("reward/mean", "actor/pg_loss", "actor/grad_norm", "actor/kl", "actor/lr"):
        assert b[-1][key] == pytest.approx(a[-1][key], abs=1e-6), key
    final = [load_causal_lm(str(folder / "global_step_6" / "actor")).state_dict() for folder in (straight, broken)]
    for name, tensor in final[0].items():
        assert torch.allclose(final[1][name], tensor, atol=1e-6), name


def test_resume_mode_disable_and_bad_paths(tmp_path):
    assert find_checkpoint("disable", str(tmp_path)) is None
    assert find_checkpoint("auto", str(tmp_path)) is None  # a fresh run
    assert find_checkpoint("auto", None) is None
    with pytest.raises(ConfigError, match="is not a complete checkpoint"):
        find_checkpoint(str(tmp_path / "global_step_3"), str(tmp_path))
    assert make_config(["trainer.resume_mode=disable"]).trainer.resume_mode == "disable"
