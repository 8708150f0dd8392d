"""Environment failures do not kill a training job.

- An env server that cannot be reached (killed, restarting) is waited for: the step is redone
  once its /health answers, for up to ``trainer.env_outage_timeout_s``; no step is skipped.
- An env server that answers, but with errors of its own (HTTP 500), gets its steps skipped and
  counted; ``trainer.max_consecutive_empty_steps`` of them in a row fail the job.

Real env servers on 127.0.0.1 (in-process ones, and ``python -m opentinker.environments.games``
processes that are SIGKILLed and started again on the same port) and the real tiny model.
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from opentinker.config import make_config
from opentinker.engine.ppo.env_outage import EnvOutage
from opentinker.engine.ppo.trainer import EnvironmentUnavailableError, RLTrainer
from opentinker.environments.endpoints import EndpointPolicy
from opentinker.environments.games import ArithmeticEnv
from opentinker.environments.env_routing import check_endpoint
from opentinker.environments.gym_interaction import GymEnvironmentInteraction
from opentinker.environments.interaction import EnvironmentServerError
from opentinker.environments.server import running_env_server
from opentinker.server.policy import JobPolicy
from opentinker.server.runner import JobRunner

from ..tcp_proxy import TcpProxy

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
        with RLTrainer(
            make_config([*SMALL, "trainer.total_training_steps=10", "trainer.max_consecutive_empty_steps=3"]),
            train_rows=data_free_rows(8),
            interactions={"arith": GymEnvironmentInteraction({"env_endpoint": url, "retries": 0})},
        ) as trainer:
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
        with RLTrainer(
            make_config([*SMALL, "data.val_batch_size=4", "actor_rollout_ref.rollout.val_n=2",
                         "actor_rollout_ref.rollout.val_temperature=1.0"]),
            train_rows=data_free_rows(8), val_rows=data_free_rows(4),
            interactions={"arith": GymEnvironmentInteraction({"env_endpoint": url, "retries": 0})},
        ) as trainer:
            assert trainer.validate() == {"val/excluded": 8.0}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_env_server(port: int) -> subprocess.Popen:
    """``python -m opentinker.environments.games arithmetic`` on ``port``, once /health answers."""
    process = subprocess.Popen([sys.executable, "-m", "opentinker.environments.games", "arithmetic", "--port", str(port)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1, trust_env=False).status_code == 200:
                return process
        except httpx.TransportError:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise RuntimeError(f"the env server on port {port} did not start (exit code {process.poll()})")
        time.sleep(0.1)


def kill(process: subprocess.Popen) -> None:
    process.send_signal(signal.SIGKILL)  # no graceful shutdown: connections just break
    process.wait(timeout=30)


OUTAGE_S = 10  # how long the env server stays down (then its start-up, about 1 s, on top)


def test_a_killed_env_server_is_waited_for_and_no_step_is_lost(tiny_model_dir):
    """The issue's run, shortened: the env server is SIGKILLed after step 2 of 6 and started
    again on the same port 10 s later (the issue had 25 s). Step 3 waits and is redone: with
    the backoff's probes at 0.5, 1.5, 3.5, 7.5 and 15.5 s it waits about 15.5 s, so this test
    takes that long on top of training. All 6 steps train, none is skipped, and the wait is
    reported when it begins and when it ends."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    servers = [start_env_server(port)]
    restart = threading.Timer(OUTAGE_S, lambda: servers.append(start_env_server(port)))
    try:
        with RLTrainer(
            make_config([*SMALL, "trainer.total_training_steps=6"]),
            train_rows=data_free_rows(12),
            interactions={"arith": GymEnvironmentInteraction({"env_endpoint": url})},
        ) as trainer:
            warnings: list[str] = []
            trainer.on_warning = warnings.append

            def on_step(step, metrics):
                if step == 2:
                    kill(servers[0])
                    restart.start()

            history = trainer.fit(on_step=on_step)
    finally:
        restart.cancel()  # not yet started when the run failed early
        if restart.is_alive():
            restart.join()
        for server in servers:
            kill(server)
    warnings = [w for w in warnings if "env server(s)" in w]  # the outage's (not, e.g., "every reward is 0")
    assert [m["step"] for m in history] == [1, 2, 3, 4, 5, 6] and trainer.global_step == 6
    for metrics in history:  # every step trained, none skipped
        assert metrics["train/skipped"] == 0.0 and metrics["train/skipped_total"] == 0.0
        assert metrics["actor/optimizer_steps"] == 1 and metrics["env/arith/env_errors"] == 0
    waited = history[2]["train/env_outage_wait_s"]
    assert OUTAGE_S - 1 < waited < OUTAGE_S + 30 and history[2]["train/env_outage_retries"] == 1
    assert [m["train/env_outage_wait_s"] for i, m in enumerate(history) if i != 2] == [0.0] * 5
    assert warnings[0].startswith(f"step 3: 4 of 4 episodes could not reach env server(s) {url} (interaction "
                                  "'arith'); the step is not trained on the rest but redone whole as soon as their "
                                  "/health answers; the job "
                                  "fails in 300 s otherwise (trainer.env_outage_timeout_s=300); last error: "
                                  f"environment server {url}/reset failed: ClientConnectorError")
    # at most one "still waiting" per 10 s (none, unless a slow restart missed the 15.5 s probe)
    assert len(warnings) - 2 <= waited // 10
    assert all(w.startswith(f"step 3: still waiting for env server(s) {url} (interaction 'arith') after ")
               for w in warnings[1:-1])
    assert warnings[-1].startswith(f"step 3: env server(s) {url} (interaction 'arith') answered again after ")
    assert warnings[-1].endswith("s; the step was redone (try 2) and nothing was skipped")


def test_the_wait_backs_off_warns_every_10_s_and_gives_up_naming_the_timeout():
    """:class:`EnvOutage` on a virtual clock (a minute of outage in no time), probing /health
    of a real port nobody listens on: the backoff, how often it warns, the error at the end."""
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    now, probed_at, warnings = [0.0], [], []

    def sleep(seconds):
        now[0] += seconds

    def probe(urls):
        probed_at.append(now[0])
        return {url: health_error(url) for url in urls}

    outage = EnvOutage(7, 60, probe, warnings.append, clock=lambda: now[0], sleep=sleep)
    with pytest.raises(EnvironmentUnavailableError) as err:
        outage.wait({url: f"{url} (interaction 'arith')"}, "the first error", 4, 4)
    # 0.5 s doubling to 10 s between probes; the last sleep ends at the timeout
    assert probed_at == pytest.approx([0.5, 1.5, 3.5, 7.5, 15.5, 25.5, 35.5, 45.5, 55.5, 60])
    assert warnings[0].startswith(f"step 7: 4 of 4 episodes could not reach env server(s) {url} (interaction 'arith')")
    assert warnings[0].endswith("the job fails in 60 s otherwise (trainer.env_outage_timeout_s=60); "
                                "last error: the first error")
    # then at most one per 10 s, with the last probe's error
    assert [w.split(" after ")[1].split(";")[0] for w in warnings[1:]] == ["16 s", "26 s", "36 s", "46 s", "56 s"]
    assert all(w.startswith(f"step 7: still waiting for env server(s) {url} (interaction 'arith') after ")
               and f"last error: environment server {url}/health failed: unreachable (ClientConnectorError" in w
               for w in warnings[1:])
    assert str(err.value).startswith(f"step 7: env server(s) {url} (interaction 'arith') still unreachable after "
                                     "60.0 s (trainer.env_outage_timeout_s=60; the step was tried 1 time(s) and "
                                     f"not trained); last error: environment server {url}/health failed: unreachable")


def health_error(url: str) -> str | None:
    """What the trainer's probe says of ``url``: None when /health answers, else the error."""
    try:
        asyncio.run(check_endpoint(url, timeout_s=1.0))
    except EnvironmentServerError as error:
        return str(error)
    return None


def outage_job(url: str, config: dict, job_dir) -> JobRunner:
    policy = JobPolicy(endpoint_policy=EndpointPolicy.from_strings(["127.0.0.1"]))
    spec = {"mode": "server", "config": {"trainer.test_freq": -1, "data.train_batch_size": 2,
                                         "actor_rollout_ref.actor.ppo_mini_batch_size": 2,
                                         "actor_rollout_ref.rollout.n": 2, "data.max_response_length": 16,
                                         "trainer.total_training_steps": 3, **config},
            "dataset": data_free_rows(6),
            "interactions": [{"name": "arith", "class_path": "gym", "config": {"env_endpoint": url, "retries": 0}}]}
    return JobRunner("job-outage", spec, str(job_dir), policy)


def warning_events(events: list[dict]) -> list[str]:
    return [e["data"]["message"] for e in events if e["type"] == "log" and e["data"].get("level") == "warning"]


def test_a_job_whose_env_server_never_comes_back_fails_when_the_timeout_is_up(tiny_model_dir, tmp_path):
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there, and nothing will
    runner = outage_job(url, {"trainer.env_outage_timeout_s": 2}, tmp_path)
    started = time.monotonic()
    outcome = runner.run()
    events = runner.drain_events()
    assert outcome["status"] == "failed" and outcome["step"] == 0  # step 1 was never trained, nor skipped
    # The wait is measured after the last try, which a loaded machine can stretch past the timeout.
    waited = re.match(re.escape(f"EnvironmentUnavailableError: step 1: env server(s) {url} (interaction 'arith') "
                                "still unreachable after ") + r"(\d+\.\d) s \(trainer\.env_outage_timeout_s=2; ",
                      outcome["error"])
    assert waited and float(waited.group(1)) >= 2.0, outcome["error"]
    assert "last error: environment server " in outcome["error"] and "ClientConnectorError" in outcome["error"]
    warnings = warning_events(events)
    assert len(warnings) == 1 and warnings[0].startswith(f"step 1: 4 of 4 episodes could not reach env server(s) {url} ")
    assert "the job fails in 2 s otherwise (trainer.env_outage_timeout_s=2)" in warnings[0]
    assert [e["type"] for e in events if e["type"] in ("metrics", "progress", "error")] == ["error"]
    assert time.monotonic() - started < 120


def test_a_cancel_ends_the_wait_for_an_env_server(tiny_model_dir, tmp_path):
    url = f"http://127.0.0.1:{free_port()}"
    runner = outage_job(url, {}, tmp_path)  # the default: waits up to 300 s
    outcome = {}
    thread = threading.Thread(target=lambda: outcome.update(runner.run()))
    thread.start()
    while not any(e["type"] == "log" and e["data"].get("level") == "warning" for e in list(runner._events)):
        assert thread.is_alive()
        time.sleep(0.1)
    runner.cancel()
    cancelled = time.monotonic()
    thread.join(timeout=60)
    assert outcome == {"status": "cancelled", "error": None, "step": 0}
    assert time.monotonic() - cancelled < 5  # within a sleep slice or a probe, not the 300 s


def test_a_step_that_lost_some_episodes_to_an_outage_is_redone_whole_not_trained_on_the_rest(tiny_model_dir):
    """Two env shards; the way to one of them is cut during step 2 (a proxy that refuses, as a
    dropped relay or a network fault would): its episodes fail, the other shard's succeed. Step 2 is
    not trained on the survivors (the quick successes, a biased sample) but redone whole once the
    way is back: every step trains all 8 samples, no env error, one retry; the cut episodes'
    finalize reaches the env afterwards, so no instance is left open."""
    with running_env_server(ArithmeticEnv, num_shards=2) as (near, far):
        with TcpProxy(int(far.rsplit(":", 1)[1])) as proxy:
            reopen = threading.Timer(3.0, proxy.accept)
            config = make_config([*SMALL, "trainer.total_training_steps=3", "data.train_batch_size=4"])
            interaction = GymEnvironmentInteraction({"env_endpoint": near, "env_shards": [near, proxy.url],
                                                     "retries": 0})
            try:
                with RLTrainer(config, train_rows=data_free_rows(12), interactions={"arith": interaction}) as trainer:
                    warnings: list[str] = []
                    trainer.on_warning = warnings.append

                    def on_step(step, metrics):
                        if step == 1:
                            proxy.refuse()
                            reopen.start()

                    history = trainer.fit(on_step=on_step)
            finally:
                reopen.cancel()
            live = [httpx.get(f"{url}/health", trust_env=False).json()["instances"] for url in (near, far)]
    assert [m["step"] for m in history] == [1, 2, 3]
    for metrics in history:
        assert metrics["env/arith/samples"] == 8 and metrics["env/arith/env_errors"] == 0
        assert metrics["rollout/excluded_trajectories"] == 0 and metrics["train/skipped"] == 0.0
    assert history[1]["train/env_outage_retries"] == 1
    cut = [w for w in warnings if "could not reach env server(s)" in w]
    assert len(cut) == 1 and re.match(r"step 2: [1-7] of 8 episodes could not reach env server\(s\) "
                                      + re.escape(proxy.url), cut[0])  # some, not all: the rest succeeded
    assert any("answered again" in w and "the step was redone (try 2)" in w for w in warnings)
    assert live == [0, 0]


def test_env_instances_a_killed_process_left_open_are_finalized_by_the_next_one(tiny_model_dir, tmp_path):
    """The run's folder journals the instances of the step in flight: a process killed mid-step
    leaves their ids there, and the next process of the run finalizes them before its first step."""
    from opentinker.engine.ppo.env_instances import EnvInstanceJournal

    with running_env_server(ArithmeticEnv) as (url,):
        left = [f"orphan-{i}" for i in range(3)]
        for iid in left:  # what the killed process had reset and not finalized
            assert httpx.post(f"{url}/reset", json={"instance_id": iid}, trust_env=False).status_code == 200
        assert httpx.get(f"{url}/health", trust_env=False).json()["instances"] == 3
        EnvInstanceJournal.in_folder(tmp_path).write({"arith": left})
        config = make_config([*SMALL, "trainer.total_training_steps=1", f"trainer.default_local_dir={tmp_path}"])
        with RLTrainer(config, train_rows=data_free_rows(4),
                       interactions={"arith": GymEnvironmentInteraction({"env_endpoint": url})}) as trainer:
            trainer.fit()
        health = httpx.get(f"{url}/health", trust_env=False).json()
    assert health["instances"] == 0
    assert health["jobs"]["default"]["finalized"] == 3 + 4  # the orphans, then the step's own episodes
    assert not (tmp_path / "env_instances.json").exists()  # nothing left open: nothing kept


def test_every_episode_in_flight_is_in_the_journal_while_it_runs(tiny_model_dir, tmp_path):
    """What a crash mid-step would leave: while a step's episodes reset at the env, all their
    instance ids are in the run's journal (the step's 8, not one per interaction); after it, none."""
    journal = tmp_path / "env_instances.json"
    journaled: list[int] = []

    class Recording(ArithmeticEnv):
        def reset(self, seed=None, **kwargs):
            journaled.append(len(json.loads(journal.read_text())["interactions"]["arith"]) if journal.exists() else 0)
            return super().reset(seed=seed)

    with running_env_server(Recording) as (url,):
        config = make_config([*SMALL, "trainer.total_training_steps=2", "data.train_batch_size=4",
                              f"trainer.default_local_dir={tmp_path}"])
        with RLTrainer(config, train_rows=data_free_rows(8),
                       interactions={"arith": GymEnvironmentInteraction({"env_endpoint": url})}) as trainer:
            trainer.fit()
    assert journaled == [8] * 16  # every reset saw its step's 8 ids kept
    assert not journal.exists()


def test_a_relay_that_connects_ends_the_wait_at_once():
    """:class:`EnvOutage` on a virtual clock: the wait for a dropped client relay sleeps through its
    wake function (the hub's wait_attached); when the relay connects, the servers are probed at once,
    not at the next backoff step (7.5 s here)."""
    now, probed_at = [0.0], []
    attached_at = 4.2

    def wake(seconds):  # the hub: blocks up to ``seconds``, True once a client attaches
        if now[0] + seconds >= attached_at:
            now[0] = max(now[0], attached_at)
            return True
        now[0] += seconds
        return False

    def probe(urls):
        probed_at.append(now[0])
        return {url: None if now[0] >= attached_at else "not connected" for url in urls}

    outage = EnvOutage(3, 60, probe, lambda message: None, clock=lambda: now[0], sleep=None, wake=wake)
    outage.wait({"http://127.0.0.1:9": "client:http://127.0.0.1:9 (interaction 'arith')"}, "no client", 8, 8)
    assert probed_at == pytest.approx([0.5, 1.5, 3.5, 4.2])  # the backoff's probes, then the attach's
