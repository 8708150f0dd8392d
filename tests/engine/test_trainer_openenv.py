"""The trainer on an OpenEnv server (openenv's own app, a process of the OpenEnv venv): the
arithmetic env's reward rises and no episode fails."""

from __future__ import annotations

import time

import pytest

from opentinker.config import make_config
from opentinker.engine.ppo.trainer import RLTrainer
from opentinker.environments.openenv_interaction import OpenEnvInteraction

from ..environments.openenv_server import running_openenv_server


@pytest.mark.slow
def test_grpo_on_an_openenv_server_raises_reward(tiny_model_dir, tmp_path):
    rows = [{"extra_info": {"interaction_kwargs": {"name": "arith"}}} for _ in range(512)]  # data-free
    with running_openenv_server(tmp_path, max_concurrent_envs=16) as live:
        interaction = OpenEnvInteraction({"name": "arith", "env_endpoint": live.url, "reset_kwargs": {"max_tries": 1}})
        start = time.perf_counter()
        with RLTrainer(
            make_config(["trainer.progress_bar=false", "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=1",
                         "data.max_response_length=16", "trainer.total_training_steps=40", "trainer.test_freq=-1",
                         "actor_rollout_ref.actor.optim.lr=3e-5", "actor_rollout_ref.actor.use_kl_loss=true",
                         "trainer.seed=0"]),
            train_rows=rows, interactions={"arith": interaction},
        ) as trainer:
            history = trainer.fit()
        took = time.perf_counter() - start
        stats = live.wait_idle()
    rewards = [m["env/arith/reward_mean"] for m in history]
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    print(f"OpenEnv env reward first 10 steps {first:.3f} -> last 10 {last:.3f} in {took:.0f}s; "
          f"{stats['created']} env sessions, at most {stats['peak']} at once; "
          f"{interaction.capacity_refusals} capacity refusals")
    assert len(history) == 40
    assert all(m["env/arith/env_errors"] == 0 for m in history)
    assert last >= first + 0.03  # +0.09 to +0.14 over trainer seeds 0-3 here
    assert stats["live"] == 0 and stats["created"] == 40 * 64  # every episode had its session, and closed it
