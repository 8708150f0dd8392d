"""``trainer.logger=['console','wandb']``: a real (offline) wandb run gets every numeric metric
of every step, at its step number. The run folder's ``.wandb`` log is read back with wandb's
own reader (``wandb leet inspect --json``)."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

wandb = pytest.importorskip("wandb")

from opentinker.config import make_config  # noqa: E402
from opentinker.engine.ppo.trainer import RLTrainer  # noqa: E402

FAST = [
    "data.train_batch_size=2",
    "actor_rollout_ref.actor.ppo_mini_batch_size=2",
    "actor_rollout_ref.rollout.n=2",
    "data.val_batch_size=4",
    "trainer.progress_bar=false",
]


def read_history(wandb_file) -> dict[int, dict]:
    """step -> the metrics wandb stored for it (its own ``_``-prefixed keys left out)."""
    result = subprocess.run(
        [sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(wandb_file)],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    history: dict[int, dict] = {}
    for line in result.stdout.splitlines():
        record = json.loads(line)
        if record.get("type") == "history":
            item = record["history"]["item"]
            step = item["_step"]
            assert record["history"].get("step", {}).get("num", 0) == step
            history.setdefault(step, {}).update({k: v for k, v in item.items() if not k.startswith("_")})
    return history


def same(logged, value) -> bool:
    if isinstance(value, float) and math.isnan(value):
        return logged == "NaN"
    return logged == pytest.approx(value, rel=1e-6, abs=1e-9)


def test_every_metric_of_every_step_lands_in_the_offline_run(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_RUN_ID", raising=False)
    trainer = RLTrainer(make_config([
        *FAST,
        "trainer.total_training_steps=2",
        "trainer.test_freq=1",  # validation metrics at step 0 (before training) and at each step
        "trainer.logger=['console','wandb']",
        "trainer.experiment_name=wandb-test",
    ]))
    try:
        history = trainer.fit()
    finally:
        trainer.close()  # finishes the wandb run: the log is complete on disk

    (run_dir,) = (tmp_path / "wandb").glob("offline-run-*")
    (wandb_file,) = run_dir.glob("run-*.wandb")
    logged = read_history(wandb_file)

    assert [entry["step"] for entry in history] == [0, 1, 2]
    assert sorted(logged) == [0, 1, 2]
    for entry in history:
        step = entry["step"]
        numeric = {k: v for k, v in entry.items() if isinstance(v, (int, float))}
        assert "val/accuracy" in numeric and (step == 0 or "reward/mean" in numeric)
        missing = sorted(set(numeric) - set(logged[step]))
        assert not missing, f"step {step}: not logged: {missing}"
        wrong = {k: (logged[step][k], v) for k, v in numeric.items() if not same(logged[step][k], v)}
        assert not wrong, f"step {step}: logged differently: {wrong}"
        assert set(logged[step]) == set(numeric)  # strings (checkpoint, skip_reason) stay out
