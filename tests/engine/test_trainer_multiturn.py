"""The trainer running agent loops against real env servers on 127.0.0.1."""

from __future__ import annotations

import httpx
import torch
import pytest

from opentinker.config import make_config
from opentinker.engine.ppo.trainer import RLTrainer
from opentinker.environments.games import ArithmeticEnv, GuessNumberEnv
from opentinker.environments.gym_interaction import GymEnvironmentInteraction
from opentinker.environments.server import running_env_server

from .test_trainer_env_outage import free_port, kill, start_env_server


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


def spy_on_advantages(trainer: RLTrainer) -> list:
    """Record the rollout each step computes advantages on (the real method still runs)."""
    seen = []
    real = trainer.advantages.compute

    def compute_advantages(batch, rollout):
        seen.append((len(batch), list(rollout.trajectories)))
        return real(batch, rollout)

    trainer.advantages.compute = compute_advantages
    return seen


def test_training_goes_on_when_the_env_server_fails(tiny_model_dir):
    with running_env_server(FlakyArithmeticEnv) as urls:
        interaction = GymEnvironmentInteraction({"env_endpoint": urls[0], "retries": 0})
        with RLTrainer(
            make_config([*BASE, "trainer.total_training_steps=2", "trainer.test_freq=-1"]),
            train_rows=data_free_rows(64, "flaky"), interactions={"flaky": interaction},
        ) as trainer:
            seen = spy_on_advantages(trainer)
            history = trainer.fit()
            live = httpx.get(f"{urls[0]}/health").json()["instances"]
    errors = sum(m["env/flaky/env_errors"] for m in history)
    assert errors > 0  # some problems crashed the env ...
    assert all(m["actor/optimizer_steps"] == 1 for m in history)  # ... and every step still trained
    assert all(m["train/skipped"] == 0.0 and m["train/skipped_total"] == 0.0 for m in history)
    assert all(0 < m["env/flaky/stop/env_error"] < 1 for m in history)
    assert all("env/flaky/env_latency_s" in m and "env/flaky/turns_mean" in m for m in history)
    # env_error_reward is None by default: the failed samples are left out of the loss and of
    # the group statistics (removed before advantages), and counted
    for metrics, (batch_size, trajectories) in zip(history, seen):
        assert metrics["rollout/excluded_trajectories"] == metrics["env/flaky/env_errors"] > 0
        assert metrics["env/flaky/excluded"] == metrics["env/flaky/env_errors"]
        assert batch_size == len(trajectories) == metrics["env/flaky/samples"] - metrics["env/flaky/env_errors"]
        assert not any(t.stop_reason == "env_error" or t.excluded for t in trajectories)
    assert live == 0  # every instance was finalized


def test_a_numeric_env_error_reward_keeps_failed_samples_with_that_reward(tiny_model_dir):
    with running_env_server(FlakyArithmeticEnv) as urls:
        with RLTrainer(
            make_config([*BASE, "trainer.total_training_steps=1", "trainer.test_freq=-1",
                         "actor_rollout_ref.rollout.multi_turn.env_error_reward=-0.5"]),
            train_rows=data_free_rows(64, "flaky"),
            interactions={"flaky": GymEnvironmentInteraction({"env_endpoint": urls[0], "retries": 0})},
        ) as trainer:
            seen = spy_on_advantages(trainer)
            metrics = trainer.fit()[-1]
    (batch_size, trajectories), = seen
    failed = [t for t in trajectories if t.stop_reason == "env_error"]
    assert len(failed) == metrics["env/flaky/env_errors"] > 0  # in the batch, with the configured reward
    assert all(t.reward == -0.5 and not t.excluded for t in failed)
    assert batch_size == metrics["env/flaky/samples"] and metrics["rollout/excluded_trajectories"] == 0


def test_validation_leaves_failed_samples_out_and_counts_them(tiny_model_dir):
    with running_env_server(FlakyArithmeticEnv) as urls:
        with RLTrainer(
            make_config([*BASE, "trainer.total_training_steps=1", "data.val_batch_size=32"]),
            train_rows=data_free_rows(8, "flaky"), val_rows=data_free_rows(32, "flaky"),
            interactions={"flaky": GymEnvironmentInteraction({"env_endpoint": urls[0], "retries": 0})},
        ) as trainer:
            rollouts = []
            real_generate = trainer.generate

            def generate(*args, **kwargs):  # records the validation rollout; the real method runs
                rollouts.append(real_generate(*args, **kwargs))
                return rollouts[-1]

            trainer.generate = generate
            metrics = trainer.validate()
    kept = [t.reward for t in rollouts[0].trajectories if not t.excluded]
    excluded = len(rollouts[0].trajectories) - len(kept)
    assert 0 < excluded < 32
    assert metrics == {"val/excluded": excluded, "val/accuracy": sum(r > 0 for r in kept) / len(kept),
                       "val/reward_mean": sum(kept) / len(kept)}


class TooLongPromptEnv(ArithmeticEnv):
    """Half of its problems come with a wordy preamble that no prompt budget has room for."""

    def reset(self, seed=None, **kwargs):
        first = super().reset(seed=seed, **kwargs)
        if seed is not None and seed % 2:
            first["observation"] = "Please read carefully. " * 100 + first["observation"]
        return first


def test_env_prompts_longer_than_max_prompt_length_are_left_out(tiny_model_dir):
    with running_env_server(TooLongPromptEnv) as urls:
        with RLTrainer(
            make_config([*BASE, "trainer.total_training_steps=1", "trainer.test_freq=-1", "data.max_prompt_length=128",
                         "data.train_batch_size=8", "actor_rollout_ref.rollout.n=2",
                         "actor_rollout_ref.actor.ppo_mini_batch_size=8"]),
            train_rows=data_free_rows(8, "wordy"),
            interactions={"wordy": GymEnvironmentInteraction({"env_endpoint": urls[0]})},
        ) as trainer:
            seen = spy_on_advantages(trainer)
            metrics = trainer.fit()[-1]
    too_long = metrics["env/wordy/prompt_too_long"]
    assert 0 < too_long < 16 and too_long % 2 == 0  # the n samples of a prompt share its seed
    assert metrics["env/wordy/stop/prompt_too_long"] == too_long / 16
    assert metrics["rollout/excluded_trajectories"] == too_long == metrics["env/wordy/excluded"]
    (batch_size, trajectories), = seen
    assert batch_size == 16 - too_long and all(len(t.prompt_ids) <= 128 for t in trajectories)


def test_guess_the_number_runs_multi_turn_episodes(tiny_model_dir):
    with running_env_server(GuessNumberEnv) as urls:
        interaction = GymEnvironmentInteraction({"env_endpoint": urls[0]})
        with RLTrainer(
            make_config(["trainer.progress_bar=false", "trainer.total_training_steps=1", "trainer.test_freq=-1",
                         "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=4",
                         "data.max_response_length=128", "data.train_batch_size=2",
                         "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.rollout.n=4"]),
            train_rows=data_free_rows(8, "guess"), interactions={"guess": interaction},
        ) as trainer:
            metrics = trainer.fit()[-1]
            batch_sizes = trainer.agent_loops.requests.batch_sizes
    assert max(batch_sizes) > 1  # concurrent agent loops shared generate calls
    assert metrics["env/guess/samples"] == 8
    assert metrics["env/guess/turns_mean"] > 1  # the env answered and the model guessed again
    assert metrics["env/guess/env_errors"] == 0


@pytest.mark.slow
def test_grpo_through_the_http_env_server_raises_reward(tiny_model_dir):
    """Arithmetic served over HTTP (data-free rows, reward from the env): reward rises. The env
    server is a process of its own, as in a deployment (in threads of this process it would
    take the trainer's GIL)."""
    port = free_port()
    server = start_env_server(port)
    try:
        interaction = GymEnvironmentInteraction({"env_endpoint": f"http://127.0.0.1:{port}"})
        with RLTrainer(
            make_config([*BASE, "trainer.total_training_steps=40", "trainer.test_freq=40",
                         "actor_rollout_ref.actor.optim.lr=3e-5", "actor_rollout_ref.actor.use_kl_loss=true",
                         "data.val_batch_size=128", "trainer.seed=0"]),
            train_rows=data_free_rows(512, "arithmetic"), val_rows=data_free_rows(128, "arithmetic"),
            interactions={"arithmetic": interaction},
        ) as trainer:
            history = trainer.fit()
    finally:
        kill(server)
    before, after = history[0]["val/accuracy"], history[-1]["val/accuracy"]
    rewards = [m["env/arithmetic/reward_mean"] for m in history if "env/arithmetic/reward_mean" in m]
    print(f"env reward first 10 steps {sum(rewards[:10]) / 10:.3f} -> last 10 {sum(rewards[-10:]) / 10:.3f}; "
          f"held-out greedy {before:.3f} -> {after:.3f}")
    assert after >= before + 0.1
    assert sum(rewards[-10:]) > sum(rewards[:10])


def test_ppo_with_gae_trains_a_critic_on_multi_turn_episodes(tiny_model_dir):
    """GAE over the model's tokens only: the env's tokens inside a response get no advantage and
    no return, and the critic trains on the rest."""
    with running_env_server(GuessNumberEnv) as urls:
        interaction = GymEnvironmentInteraction({"env_endpoint": urls[0]})
        trainer = RLTrainer(
            make_config(["trainer.progress_bar=false", "trainer.total_training_steps=2", "trainer.test_freq=-1",
                         "algorithm.adv_estimator=gae", "algorithm.lam=0.95", "critic.optim.lr=1e-3",
                         "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=4",
                         "data.max_response_length=128", "data.train_batch_size=2",
                         "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.rollout.n=4"]),
            train_rows=data_free_rows(8, "guess"), interactions={"guess": interaction},
        )
        batches = []
        real = trainer.advantages.compute

        def compute_advantages(batch, rollout):
            out = real(batch, rollout)
            batches.append(batch)
            return out

        trainer.advantages.compute = compute_advantages
        history = trainer.fit()
        trainer.close()
    mask = torch.cat([b.response_mask.flatten() for b in batches])
    # Some response has an env turn (mask 0) before a later model turn (mask 1).
    assert any(((b.response_mask[:, :-1] == 0) & (b.response_mask[:, 1:] == 1)).any() for b in batches)
    for name in ("advantages", "returns"):
        values = torch.cat([b.tensors[name].flatten() for b in batches])
        assert not values[mask == 0].any() and values[mask == 1].abs().sum() > 0
    assert all(m["critic/optimizer_steps"] == 1 and m["actor/optimizer_steps"] == 1 for m in history)
