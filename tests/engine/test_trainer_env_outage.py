"""Environment outages do not kill a training job: steps with nothing to train on are skipped
and counted, and only a run of them fails the job, with an error naming the env server.

Real env servers on 127.0.0.1 (one that answers 500 on /reset, one stopped and started again
on the same port) and the real tiny model.
"""

from __future__ import annotations

import pytest

from opentinker.config import make_config
from opentinker.engine.trainer import EnvironmentUnavailableError, RLTrainer
from opentinker.environments.games import ArithmeticEnv
from opentinker.environments.gym_interaction import GymEnvironmentInteraction
from opentinker.environments.server import running_env_server

SMALL = [
    "trainer.progress_bar=false", "trainer.test_freq=-1", "data.max_response_length=16",
    "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=1", "data.train_batch_size=2",
    "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.rollout.n=2",
]


def data_free_rows(count: int) -> list[dict]:
    return [{"extra_info": {"interaction_kwargs": {"name": "arith"}}} for _ in range(count)]


class DownEnv(ArithmeticEnv):
    """An env server whose every /reset answers 500."""

    def reset(self, seed=None, **kwargs):
        raise RuntimeError("the simulator is down")


class RecordingRun:
    """Stands in for a wandb run: keeps what ``log`` was given."""

    def __init__(self):
        self.logged: list[dict] = []

    def log(self, values, step):
        self.logged.append(values)

    def finish(self):
        pass


def test_an_env_answering_500_skips_steps_then_fails_with_a_clear_error(tiny_model_dir, capsys):
    with running_env_server(DownEnv) as (url,):
        trainer = RLTrainer(
            make_config([*SMALL, "trainer.total_training_steps=10", "trainer.max_consecutive_empty_steps=3"]),
            train_rows=data_free_rows(8),
            interactions={"arith": GymEnvironmentInteraction({"env_endpoint": url, "retries": 0})},
        )
        trainer.wandb_run = RecordingRun()
        steps = []
        with pytest.raises(EnvironmentUnavailableError) as err:
            trainer.fit(on_step=lambda step, metrics: steps.append((step, metrics)))
    last_error = f"environment server {url}/reset failed: HTTP 500: RuntimeError: the simulator is down"
    # the job kept going for max - 1 = 2 steps, each counted as a step ...
    assert [step for step, _ in steps] == [1, 2] and trainer.global_step == 2
    for count, (_, metrics) in enumerate(steps, start=1):
        assert metrics["train/skipped"] == 1.0 and metrics["train/skipped_total"] == count
        assert metrics["rollout/excluded_trajectories"] == 4 and metrics["env/arith/env_errors"] == 4
        assert metrics["skip_reason"] == (
            f"none of 4 samples had anything to train on (env_error x4); "
            f"env endpoint(s): {url} (interaction 'arith'); last error: {last_error}"
        )
        assert "reward/mean" not in metrics and "actor/optimizer_steps" not in metrics  # nothing trained
    # ... then failed naming the endpoint and its last error, not with an IndexError
    message = str(err.value)
    assert message.startswith("3 training steps in a row had nothing to train on "
                              "(trainer.max_consecutive_empty_steps=3): ")
    assert f"env endpoint(s): {url} (interaction 'arith')" in message and message.endswith(last_error)
    assert isinstance(err.value, RuntimeError)
    # fit() printed why each step was skipped, and logged only numbers
    printed = capsys.readouterr().out
    assert printed.count("skipped, nothing to train on: none of 4 samples") == 2
    assert len(trainer.wandb_run.logged) == 2
    assert all("skip_reason" not in logged and logged["train/skipped"] == 1.0 for logged in trainer.wandb_run.logged)


def test_validation_with_every_sample_failed_reports_only_the_count(tiny_model_dir):
    with running_env_server(DownEnv) as (url,):
        trainer = RLTrainer(
            make_config([*SMALL, "data.val_batch_size=4", "actor_rollout_ref.rollout.val_n=2",
                         "actor_rollout_ref.rollout.val_temperature=1.0"]),
            train_rows=data_free_rows(8), val_rows=data_free_rows(4),
            interactions={"arith": GymEnvironmentInteraction({"env_endpoint": url, "retries": 0})},
        )
        assert trainer.validate() == {"val/excluded": 8.0}


def test_training_continues_when_a_stopped_env_server_comes_back(tiny_model_dir):
    with running_env_server(ArithmeticEnv) as (url,):
        trainer = RLTrainer(
            make_config([*SMALL, "trainer.total_training_steps=4"]),
            train_rows=data_free_rows(8),
            interactions={"arith": GymEnvironmentInteraction({"env_endpoint": url, "retries": 0})},
        )
        first = trainer.train_step()
    port = int(url.rsplit(":", 1)[1])
    stopped = trainer.train_step()  # nothing listens on the port now
    with running_env_server(ArithmeticEnv, port=port) as (again,):
        assert again == url
        resumed = [trainer.train_step(), trainer.train_step()]
    assert first["train/skipped"] == 0.0 and first["actor/optimizer_steps"] == 1
    assert stopped["train/skipped"] == 1.0 and stopped["train/skipped_total"] == 1.0 and stopped["step"] == 2
    assert f"env endpoint(s): {url} (interaction 'arith')" in stopped["skip_reason"]
    assert "ConnectError" in stopped["skip_reason"]
    for metrics in resumed:  # trained again; the skipped step stays counted
        assert metrics["train/skipped"] == 0.0 and metrics["train/skipped_total"] == 1.0
        assert metrics["actor/optimizer_steps"] == 1 and metrics["env/arith/env_errors"] == 0
    assert [m["step"] for m in (first, stopped, *resumed)] == [1, 2, 3, 4] and trainer.global_step == 4
