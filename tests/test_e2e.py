"""End to end: a real `opentinker-server` process (Ray actor, real trainer, tiny model) and
the real thin client, over 127.0.0.1."""

from __future__ import annotations

import itertools
import time

import pytest

from opentinker import GenericEnvironment, OpenTinkerClient
from opentinker.client.errors import ValidationError
from opentinker.client.local_server import local_server
from opentinker.environments.arithmetic import make_problems
from opentinker.protocol import JobCreate, JobStatus

pytestmark = pytest.mark.heavy  # minutes: scheduled first (tests/conftest.py)

SMALL = {"data.train_batch_size": 2, "actor_rollout_ref.actor.ppo_mini_batch_size": 2,
         "actor_rollout_ref.rollout.n": 4, "trainer.test_freq": -1}


def rows(count: int, seed: int = 1) -> list[dict]:
    return [p.as_row() for p in make_problems(count, seed)]


def client_mode_job(client, steps: int):
    """A client-mode job whose batches this test pushes by hand (no background pusher)."""
    return client.create_job(JobCreate(mode="client", config={**SMALL, "trainer.total_training_steps": steps}))


def wait_for(predicate, timeout_s: float = 120.0, what: str = "condition"):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    with local_server(tmp_path_factory.mktemp("server")) as (url, key):
        yield url, key


@pytest.fixture
def client(server):
    with OpenTinkerClient(*server) as client:
        yield client


def test_create_stream_complete_and_download(client, tmp_path):
    env = GenericEnvironment({**SMALL, "trainer.save_freq": 1}, dataset=rows(16))
    job = client.submit(env, steps=3)
    events = list(job.stream())
    assert [e.id for e in events] == list(range(1, len(events) + 1))  # gap-free, in order
    assert events[-1].type == "status" and events[-1].data["status"] == "completed"
    assert [e.data["step"] for e in events if e.type == "progress"] == [1, 2, 3]
    assert [c.name for c in job.checkpoints()] == ["global_step_1", "global_step_2", "global_step_3"]
    folder = job.download_checkpoint(dest=tmp_path)
    assert (folder / "config.json").exists() and (folder / "model.safetensors").exists()
    assert len(job.metrics()) == 3 and all("reward/mean" in m["metrics"] for m in job.metrics())


def test_an_asynchronous_job_trains_off_policy_through_the_server(client):
    """async_training through the service: the job's rollouts run ahead in their own Ray actor;
    its metrics say how stale each step's samples were. A client-mode job cannot (400)."""
    env = GenericEnvironment({**SMALL, "async_training.max_staleness": 1,
                              "algorithm.rollout_correction.rollout_is": "token"}, dataset=rows(16))
    job = client.submit(env, steps=3)
    events = list(job.stream())
    assert events[-1].data["status"] == "completed", events[-1].data
    metrics = [m["metrics"] for m in job.metrics()]
    assert [m["staleness/max"] for m in metrics] == [0.0, 1.0, 1.0]
    assert all(m["rollout_corr/rollout_is_eff_sample_size"] > 0 for m in metrics)
    with pytest.raises(ValidationError, match="max_staleness") as refused:
        client.create_job(JobCreate(mode="client", config={**SMALL, "async_training.max_staleness": 1}))
    assert refused.value.status_code == 400
    assert refused.value.detail["field"] == "config.async_training.max_staleness"


def test_reattach_with_last_event_id_loses_nothing(client):
    job = client.submit(GenericEnvironment(SMALL, dataset=rows(16)), steps=3)
    first = list(itertools.islice(job.stream(), 3))  # "disconnect" after three events
    rest = list(job.stream(after=first[-1].id))  # re-attach from the last seen id
    everything = job.events()
    assert [e.id for e in first + rest] == [e.id for e in everything]
    assert rest[-1].data["status"] == "completed"


def test_a_repeated_step_push_is_trained_once(client):
    handle = client_mode_job(client, steps=2)
    batch = rows(2, seed=9)
    first = handle.push_step(1, batch, idempotency_key="step-one")
    again = handle.push_step(1, batch, idempotency_key="step-one")
    same_step = handle.push_step(1, batch)
    assert not first.duplicate and again.duplicate and same_step.duplicate
    handle.push_step(2, rows(2, seed=10))
    info = handle.wait(progress=False)
    assert info.status is JobStatus.COMPLETED and info.step == 2
    assert [e.data["step"] for e in handle.events() if e.type == "progress"] == [1, 2]


def test_cancel_frees_the_jobs_resources(client):
    # Each job's actor holds a CPU of this 2-CPU Ray; if cancel leaked them, later jobs would never start.
    for _ in range(3):
        job = client_mode_job(client, steps=50)
        job.push_step(1, rows(2))
        wait_for(lambda: any(e.type == "progress" for e in job.events()), what="the first step")
        assert job.cancel().status is JobStatus.CANCELLED
    last = client.submit(GenericEnvironment(SMALL, dataset=rows(16)), steps=1)
    assert last.wait(progress=False, timeout=180).status is JobStatus.COMPLETED


def test_server_restart_keeps_finished_jobs_and_interrupts_running_ones(tiny_model_dir, tmp_path):
    data = tmp_path / "server"
    with local_server(data) as (url, key), OpenTinkerClient(url, key) as client:
        done = client.submit(GenericEnvironment(SMALL, dataset=rows(16)), steps=1)
        assert done.wait(progress=False).status is JobStatus.COMPLETED
        running = client_mode_job(client, steps=5)
        running.push_step(1, rows(2))
        wait_for(lambda: running.info().status is JobStatus.RUNNING, what="the job to run")
        done_events = [e.id for e in done.events()]
    with local_server(data) as (url, key), OpenTinkerClient(url, key) as client:
        jobs = {j.job_id: j for j in client.list_jobs()}
        assert jobs[done.job_id].status is JobStatus.COMPLETED
        assert [e.id for e in client.job(done.job_id).events()] == done_events
        assert [c.name for c in client.job(done.job_id).checkpoints()] == ["global_step_1"]
        interrupted = jobs[running.job_id]
        assert interrupted.status is JobStatus.INTERRUPTED
        assert "server stopped" in interrupted.error


def test_setup_fails_at_once_naming_an_unreachable_env_endpoint(client):
    import socket

    from opentinker import InteractionSpec
    from opentinker.client.errors import EnvironmentSetupError

    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        dead_url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    env = GenericEnvironment(SMALL, [InteractionSpec(name="guess", class_path="gym", config={"env_endpoint": dead_url})],
                             data_generator=lambda i: {"extra_info": {"interaction_kwargs": {"name": "guess"}}})
    started = time.monotonic()
    with pytest.raises(EnvironmentSetupError, match=dead_url):
        env.setup(client)
    assert time.monotonic() - started < 30
    bad_class = GenericEnvironment(SMALL, [InteractionSpec(name="x", class_path="os.system")], dataset=rows(4))
    with pytest.raises(EnvironmentSetupError, match="opentinker.environments.gym_interaction.GymEnvironmentInteraction"):
        bad_class.setup(client)


def test_models_lists_what_jobs_may_train(client, server, capsys, monkeypatch):
    from opentinker.client.cli import main

    listed = client.models()
    assert [(m.name, m.default) for m in listed.models] == [("opentinker-tiny-arith", True)]
    assert listed.judge_models == []
    monkeypatch.setenv("OPENTINKER_BASE_URL", server[0])
    monkeypatch.setenv("OPENTINKER_API_KEY", server[1])
    assert main(["models"]) == 0
    assert capsys.readouterr().out.split() == ["MODEL", "opentinker-tiny-arith", "default"]


def test_serve_reads_no_proxy_headers_by_default(server):
    """`opentinker-server serve` as it starts by default: a local caller rotating spoofed
    X-Forwarded-For addresses still meets the failed-key limit (20 a minute), while the right
    key is accepted (uvicorn's own default would trust the header from 127.0.0.1)."""
    import httpx

    url, key = server
    wrong = "ot-" + "w" * 43
    with httpx.Client(base_url=url, transport=httpx.HTTPTransport(local_address="127.0.0.1"), timeout=30,
                      trust_env=False) as raw:
        statuses = [raw.get("/v1/jobs", headers={"Authorization": f"Bearer {wrong}",
                                                 "X-Forwarded-For": f"203.0.113.{i}"}).status_code
                    for i in range(25)]
        assert statuses == [401] * 20 + [429] * 5
        assert raw.get("/v1/jobs", headers={"Authorization": f"Bearer {key}"}).status_code == 200
