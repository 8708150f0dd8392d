"""The job runner the server puts in a Ray actor, driven in-process here (Ray: tests/server)."""

from __future__ import annotations

import threading
from pathlib import Path

from opentinker.environments.arithmetic import make_problems
from opentinker.server.policy import JobPolicy, parse_served_models
from opentinker.server.runner import JobRunner

FAST = {"trainer.total_training_steps": 2, "trainer.test_freq": -1, "data.train_batch_size": 2,
        "actor_rollout_ref.actor.ppo_mini_batch_size": 2, "actor_rollout_ref.rollout.n": 4}


def rows(count: int, seed: int = 5) -> list[dict]:
    return [p.as_row() for p in make_problems(count, seed)]


def test_server_mode_runs_to_the_end_with_events_and_checkpoints(tiny_model_dir, tmp_path):
    runner = JobRunner("job", {"mode": "server", "dataset": rows(16), "config": {**FAST, "trainer.save_freq": 1}},
                       str(tmp_path))
    outcome = runner.run()
    events = runner.drain_events()
    assert outcome == {"status": "completed", "error": None, "step": 2}
    kinds = [e["type"] for e in events]
    assert kinds == ["log", "log", "metrics", "progress", "checkpoint", "metrics", "progress", "checkpoint"]
    assert [e["data"]["message"] for e in events[:2]] == ["loading model opentinker-tiny-arith",
                                                          "model opentinker-tiny-arith loaded; training 2 steps"]
    checkpoints = [e["data"] for e in events if e["type"] == "checkpoint"]
    assert [c["name"] for c in checkpoints] == ["global_step_1", "global_step_2"]
    assert (Path(checkpoints[-1]["path"]) / "config.json").exists()
    assert all(isinstance(e["data"]["metrics"]["reward/mean"], float) for e in events if e["type"] == "metrics")
    assert runner.drain_events() == []  # drained once


def test_client_mode_trains_pushed_batches_in_step_order(tiny_model_dir, tmp_path):
    runner = JobRunner("job", {"mode": "client", "config": FAST}, str(tmp_path))
    runner.push_batch(2, rows(2, seed=8))  # arrives first, trained second
    runner.push_batch(1, rows(2, seed=7))
    assert runner.queued() == 2
    assert runner.run()["status"] == "completed"
    steps = [e["data"]["step"] for e in runner.drain_events() if e["type"] == "progress"]
    assert steps == [1, 2] and runner.queued() == 0


def test_cancel_while_waiting_for_a_batch(tiny_model_dir, tmp_path):
    runner = JobRunner("job", {"mode": "client", "config": FAST}, str(tmp_path))
    outcome = {}
    thread = threading.Thread(target=lambda: outcome.update(runner.run()))
    thread.start()
    runner.push_batch(1, rows(2))
    while not any(e["type"] == "progress" for e in runner._events):
        thread.join(timeout=0.1)
    runner.cancel()
    thread.join(timeout=60)
    assert outcome == {"status": "cancelled", "error": None, "step": 1}


def test_a_failing_job_reports_why_with_an_error_id(tmp_path):
    # A served model whose folder the operator got wrong: the job fails and says so.
    policy = JobPolicy(models=parse_served_models([f"broken={tmp_path / 'nope'}"]))
    runner = JobRunner("job", {"mode": "server", "config": {"actor_rollout_ref.model.path": "broken"}},
                       str(tmp_path), policy)
    outcome = runner.run()
    loading, event = runner.drain_events()
    assert loading["data"]["message"] == "loading model broken"  # the served name, not the folder
    error_id = event["data"]["error_id"]
    assert outcome["status"] == "failed" and "does not exist" in outcome["error"]
    assert outcome["error"].endswith(f"(error id {error_id})")
    # The trace goes to the JobManager, which logs it and publishes only the message and id
    # (tests/server/test_operator_tooling.py checks what a user sees).
    assert event["type"] == "error" and set(event["data"]) == {"message", "error_id", "traceback"}
    assert event["data"]["traceback"].startswith("Traceback (most recent call last)")


def test_the_runner_applies_the_policy_again(tmp_path):
    folder = str(tmp_path / "someone-elses-checkpoint")
    outcome = JobRunner("job", {"mode": "server", "config": {"actor_rollout_ref.model.path": folder}},
                        str(tmp_path)).run()
    assert outcome["status"] == "failed"
    assert outcome["error"].startswith("PolicyError: actor_rollout_ref.model.path: ")
    assert "is not a model served here" in outcome["error"]


def test_interaction_class_paths_go_through_the_allowlist(tmp_path):
    spec = {"mode": "server", "config": FAST,
            "interactions": [{"name": "evil", "class_path": "subprocess.Popen", "config": {}}]}
    outcome = JobRunner("job", spec, str(tmp_path)).run()
    assert outcome["status"] == "failed" and "subprocess.Popen" in outcome["error"]


def test_gpu_jobs_reserve_gpus_for_their_actor():
    assert JobRunner.ray_actor_options({"config": {"trainer.n_gpus_per_node": 1}}) == {"num_gpus": 1}
    assert JobRunner.ray_actor_options({"config": {}}) == {}
    fsdp = {"actor_rollout_ref.actor.strategy": "fsdp", "trainer.n_gpus_per_node": 2}
    assert JobRunner.ray_actor_options({"config": fsdp}) == {}  # its ranks reserve the GPUs


def test_an_env_answering_500_skips_steps_with_events_then_fails_naming_the_endpoint(tiny_model_dir, tmp_path):
    """The audit's held-out run: an env whose /reset answers 500 failed the job at step 0 with
    ``IndexError: max(): Expected reduction dim 1 to have non-zero size.`` (An env server that
    cannot be reached is waited for instead: tests/engine/test_trainer_env_outage.py.)"""
    from opentinker.environments.endpoints import EndpointPolicy
    from opentinker.environments.games import ArithmeticEnv
    from opentinker.environments.server import running_env_server

    class DownEnv(ArithmeticEnv):
        def reset(self, seed=None, **kwargs):
            raise RuntimeError("the simulator is down")

    policy = JobPolicy(endpoint_policy=EndpointPolicy.from_strings(["127.0.0.1"]))
    with running_env_server(DownEnv) as (url,):
        spec = {"mode": "server", "config": {**FAST, "trainer.total_training_steps": 10,
                                            "trainer.max_consecutive_empty_steps": 3},
                "dataset": [{"extra_info": {"interaction_kwargs": {"name": "arith"}}}] * 4,
                "interactions": [{"name": "arith", "class_path": "gym", "config": {"env_endpoint": url}}]}
        runner = JobRunner("job-outage", spec, str(tmp_path), policy)
        outcome = runner.run()
    events = runner.drain_events()
    warnings = [e["data"]["message"] for e in events if e["type"] == "log" and e["data"].get("level") == "warning"
                and "skipped" in e["data"]["message"]]  # (each step also says its 4 episodes were env errors)
    assert [w.split(":")[0] for w in warnings] == ["step 1 skipped", "step 2 skipped"]
    assert all(url in w and "the simulator is down" in w for w in warnings)
    skipped = [e["data"]["metrics"]["train/skipped"] for e in events if e["type"] == "metrics"]
    assert skipped == [1.0, 1.0] and all("skip_reason" not in e["data"]["metrics"] for e in events
                                         if e["type"] == "metrics")
    assert outcome["status"] == "failed" and outcome["step"] == 2
    assert outcome["error"].startswith("EnvironmentUnavailableError: 3 training steps in a row had nothing to train on")
    assert url in outcome["error"] and "IndexError" not in outcome["error"]


def test_the_runner_checks_env_endpoints_against_the_operators_hosts(tmp_path):
    spec = {"mode": "server", "config": FAST, "dataset": [{"extra_info": {"interaction_kwargs": {}}}] * 2,
            "interactions": [{"name": "g", "class_path": "gym", "config": {"env_endpoint": "http://10.1.2.3:80"}}]}
    outcome = JobRunner("job", spec, str(tmp_path)).run()  # the default policy allows no env host
    assert outcome["status"] == "failed"
    assert "env_endpoint http://10.1.2.3:80: this server allows no environment servers" in outcome["error"]
