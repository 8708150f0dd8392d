"""The trainer running agent loops against real env servers on 127.0.0.1."""

from __future__ import annotations

import httpx
import pytest

from opentinker.config import make_config
from opentinker.engine.trainer import RLTrainer
from opentinker.environments.games import ArithmeticEnv, GuessNumberEnv
from opentinker.environments.gym_interaction import GymEnvironmentInteraction
from opentinker.environments.server import running_env_server


def data_free_rows(count: int, name: str) -> list[dict]:
    """Rows with no prompt: the environment's reset observation opens each chat."""
    return [{"extra_info": {"interaction_kwargs": {"name": name}}} for _ in range(count)]


class FlakyArithmeticEnv(ArithmeticEnv):
    """Crashes on a third of the problems (by their first operand)."""

    def step(self, action):
        if self.problem.a % 3 == 0:
            raise RuntimeError("flaky simulator")
        return super().step(action)


BASE = ["trainer.progress_bar=false", "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=1",
        "data.max_response_length=16"]


def test_training_goes_on_when_the_env_server_fails(tiny_model_dir):
    with running_env_server(FlakyArithmeticEnv) as urls:
        interaction = GymEnvironmentInteraction({"env_endpoint": urls[0], "retries": 0})
        trainer = RLTrainer(
            make_config([*BASE, "trainer.total_training_steps=2", "trainer.test_freq=-1"]),
            train_rows=data_free_rows(64, "flaky"), interactions={"flaky": interaction},
        )
        history = trainer.fit()
        live = httpx.get(f"{urls[0]}/health").json()["instances"]
    errors = sum(m["env/flaky/env_errors"] for m in history)
    assert errors > 0  # some problems crashed the env ...
    assert all(m["actor/optimizer_steps"] == 1 for m in history)  # ... and every step still trained
    assert all(0 < m["env/flaky/stop/env_error"] < 1 for m in history)
    assert all("env/flaky/env_latency_s" in m and "env/flaky/turns_mean" in m for m in history)
    assert live == 0  # every instance was finalized


def test_guess_the_number_runs_multi_turn_episodes(tiny_model_dir):
    with running_env_server(GuessNumberEnv) as urls:
        interaction = GymEnvironmentInteraction({"env_endpoint": urls[0]})
        trainer = RLTrainer(
            make_config(["trainer.progress_bar=false", "trainer.total_training_steps=1", "trainer.test_freq=-1",
                         "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=4",
                         "data.max_response_length=128", "data.train_batch_size=2",
                         "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.rollout.n=4"]),
            train_rows=data_free_rows(8, "guess"), interactions={"guess": interaction},
        )
        metrics = trainer.fit()[-1]
        batch_sizes = trainer.agent_loops.batcher.batch_sizes
    assert max(batch_sizes) > 1  # concurrent agent loops shared generate calls
    assert metrics["env/guess/samples"] == 8
    assert metrics["env/guess/turns_mean"] > 1  # the env answered and the model guessed again
    assert metrics["env/guess/env_errors"] == 0


@pytest.mark.slow
def test_grpo_through_the_http_env_server_raises_reward(tiny_model_dir):
    """Arithmetic served over HTTP (data-free rows, reward from the env): reward rises."""
    with running_env_server(ArithmeticEnv) as urls:
        interaction = GymEnvironmentInteraction({"env_endpoint": urls[0]})
        trainer = RLTrainer(
            make_config([*BASE, "trainer.total_training_steps=40", "trainer.test_freq=40",
                         "actor_rollout_ref.actor.optim.lr=3e-5", "actor_rollout_ref.actor.use_kl_loss=true",
                         "data.val_batch_size=128", "trainer.seed=0"]),
            train_rows=data_free_rows(512, "arithmetic"), val_rows=data_free_rows(128, "arithmetic"),
            interactions={"arithmetic": interaction},
        )
        history = trainer.fit()
    before, after = history[0]["val/accuracy"], history[-1]["val/accuracy"]
    rewards = [m["env/arithmetic/reward_mean"] for m in history if "env/arithmetic/reward_mean" in m]
    print(f"env reward first 10 steps {sum(rewards[:10]) / 10:.3f} -> last 10 {sum(rewards[-10:]) / 10:.3f}; "
          f"held-out greedy {before:.3f} -> {after:.3f}")
    assert after >= before + 0.1
    assert sum(rewards[-10:]) > sum(rewards[:10])
