"""Creativity training in the trainer: judge labels, fallbacks and pass@k validation."""

from __future__ import annotations

import socket

import pytest

from opentinker.config import make_config
from opentinker.creativity import make_judge
from opentinker.engine.ppo.step_metrics import pass_at_k
from opentinker.engine.ppo.trainer import RLTrainer

FAST = ["data.train_batch_size=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.rollout.n=8",
        "data.val_batch_size=8", "trainer.progress_bar=false", "trainer.test_freq=-1"]


def test_pass_at_k_matches_hand_values():
    assert pass_at_k(8, 2, 1) == pytest.approx(0.25)
    assert pass_at_k(8, 2, 2) == pytest.approx(1 - 15 / 28)  # 1 - C(6,2)/C(8,2)
    assert pass_at_k(8, 0, 8) == 0.0 and pass_at_k(8, 1, 8) == 1.0 and pass_at_k(8, 7, 2) == 1.0


def test_validation_reports_pass_at_k_up_to_val_n(tiny_model_dir):
    trainer = RLTrainer(make_config([*FAST, "actor_rollout_ref.rollout.val_n=4",
                                     "actor_rollout_ref.rollout.val_temperature=1.0"]))
    metrics = trainer.validate()
    assert set(metrics) == {"val/accuracy", "val/reward_mean", "val/excluded", "val/pass@1", "val/pass@2", "val/pass@4"}
    assert metrics["val/excluded"] == 0  # single-turn samples are never excluded
    assert metrics["val/pass@1"] == pytest.approx(metrics["val/accuracy"])
    assert metrics["val/pass@1"] <= metrics["val/pass@2"] <= metrics["val/pass@4"]


@pytest.mark.parametrize("classify_only_correct", [True, False])
def test_weighted_grpo_with_the_lexical_judge(tiny_model_dir, classify_only_correct):
    trainer = RLTrainer(make_config([
        *FAST, "algorithm.adv_estimator=grpo_weighted_mul", "algorithm.enable_solution_classification=true",
        "algorithm.judge.kind=lexical", f"algorithm.classify_only_correct={str(classify_only_correct).lower()}",
    ]))
    metrics = trainer.step()
    assert metrics["creativity/judge_fallbacks"] == 0
    assert "creativity/weight_mean" in metrics and "judge/groups" in metrics
    correct_fraction = (metrics["reward/mean"] if classify_only_correct else 1.0)  # rewards are 0/1
    assert metrics["creativity/classified_fraction"] == pytest.approx(correct_fraction)
    if metrics["creativity/classified_fraction"] > 0:
        assert metrics["creativity/distinct_strategies_mean"] > 0  # prompts with no correct answer count 0


def test_an_unreachable_judge_falls_back_to_weight_one_and_training_goes_on(tiny_model_dir):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{sock.getsockname()[1]}/v1"
    judge = make_judge("openai", api_key="unused", base_url=dead, max_retries=0, timeout_s=2)
    trainer = RLTrainer(make_config([*FAST, "algorithm.adv_estimator=grpo_weighted_mul",
                                     "algorithm.classify_only_correct=false"]), strategy_judge=judge)
    metrics = trainer.step()
    assert metrics["creativity/judge_fallbacks"] == 2  # both prompts of the batch
    assert metrics["creativity/classified_fraction"] == 0
    assert metrics["creativity/weight_mean"] == 1.0  # mul is then plain GRPO
    assert metrics["actor/optimizer_steps"] == 1


@pytest.mark.slow
def test_creativity_train_script_runs_to_the_end(tiny_model_dir, tmp_path):
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "examples" / "creativity" / "creativity_train.sh"
    result = subprocess.run(["bash", str(script), "trainer.progress_bar=false", "data.val_batch_size=8"],
                            cwd=tmp_path, capture_output=True, text=True, timeout=600,
                            env={**os.environ, "PYTHON": sys.executable, "STEPS": "2"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "ckpt" / "creativity-grpo_weighted_mul" / "actor" / "config.json").exists()
    assert "val/pass@8" in result.stdout
