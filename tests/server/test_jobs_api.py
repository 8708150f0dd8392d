"""Jobs through the HTTP API of a live server, run by the stand-in runner as real Ray actors."""

from __future__ import annotations

import io
import tarfile
import time

import pytest
import ray

from opentinker.protocol import Event, JobInfo
from opentinker.server.jobs import actor_name


def test_server_job_streams_events_to_completion(server, alice, helpers):
    job_id = helpers.create_job(alice, "quick", steps=3)
    with alice.stream("GET", f"/v1/jobs/{job_id}/events") as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        sse = list(helpers.iter_sse(response))  # ends by itself after the final status
    events = [Event.model_validate_json(e["data"]) for e in sse]
    assert [int(e["id"]) for e in sse] == [e.id for e in events] == list(range(1, len(events) + 1))
    assert all(e["event"] == ev.type for e, ev in zip(sse, events))
    statuses = [e.data["status"] for e in events if e.type == "status"]
    assert statuses == ["queued", "running", "completed"]
    assert events[-1].type == "status"
    assert [e.data["step"] for e in events if e.type == "progress"] == [1, 2, 3]
    metrics = [e for e in events if e.type == "metrics"]
    assert metrics[-1].data["metrics"]["reward"] == 1.0
    assert metrics[-1].data["metrics"]["kl"] is None  # NaN is not JSON: sent as null
    checkpoint = next(e for e in events if e.type == "checkpoint")
    assert checkpoint.data == {"step": 3, "name": "global_step_3"}  # the server path stays private

    info = JobInfo.model_validate(alice.get(f"/v1/jobs/{job_id}").json())
    assert (info.status.value, info.step, info.total_steps, info.error) == ("completed", 3, 3, None)
    assert info.config["trainer.total_training_steps"] == 3
    assert job_id in [j["job_id"] for j in alice.get("/v1/jobs").json()["jobs"]]
    helpers.wait_for(lambda: job_id not in server.manager.active_job_ids(), 10, "the actor to be released")
    assert alice.get(f"/v1/jobs/{job_id}/events", params={"stream": "false"}).json()["events"] == [
        e.model_dump(mode="json") for e in events
    ]


def test_checkpoint_list_and_download(server, alice, helpers):
    job_id = helpers.create_job(alice, "ckpt", steps=2)
    helpers.wait_status(alice, job_id, "completed")
    listed = alice.get(f"/v1/jobs/{job_id}/checkpoints").json()["checkpoints"]
    assert [(c["name"], c["step"]) for c in listed] == [("global_step_2", 2)]

    response = alice.get(f"/v1/jobs/{job_id}/checkpoints/global_step_2/download")
    assert response.status_code == 200
    assert response.headers["content-type"] == "application/gzip"
    with tarfile.open(fileobj=io.BytesIO(response.content), mode="r:gz") as archive:
        members = {m.name: m for m in archive.getmembers()}
        assert sorted(n for n, m in members.items() if m.isfile()) == [
            "global_step_2/config.json",
            "global_step_2/model.safetensors",
            "global_step_2/tokenizer/tokenizer.json",
        ]
        folder = server.settings.job_dir(job_id) / "checkpoints" / "global_step_2"
        for name in ("config.json", "model.safetensors"):
            assert archive.extractfile(f"global_step_2/{name}").read() == (folder / name).read_bytes()

    assert alice.get(f"/v1/jobs/{job_id}/checkpoints/global_step_9/download").status_code == 404
    bad = alice.get(f"/v1/jobs/{job_id}/checkpoints/..global/download")
    assert bad.status_code == 422 and "path.name" in bad.json()["error"]
    traversal = alice.get(f"/v1/jobs/{job_id}/checkpoints/..%2F..%2F..%2Fopentinker.db/download")
    assert traversal.status_code in (404, 422)
    assert alice.post(f"/v1/jobs/{job_id}/checkpoints").status_code == 409  # finished


def test_resume_with_last_event_id_loses_and_repeats_nothing(alice, helpers):
    job_id = helpers.create_job(alice, "medium resume", steps=6)
    with alice.stream("GET", f"/v1/jobs/{job_id}/events") as response:
        first = []
        for event in helpers.iter_sse(response):
            first.append(event)
            if len(first) == 3:
                break  # drop the connection mid-job
    last_id = first[-1]["id"]
    with alice.stream("GET", f"/v1/jobs/{job_id}/events", headers={"Last-Event-ID": last_id}) as response:
        rest = list(helpers.iter_sse(response))
    ids = [int(e["id"]) for e in first + rest]
    assert ids == list(range(1, len(ids) + 1))
    assert [e["id"] for e in first + rest] == [str(e["id"]) for e in helpers.all_events(alice, job_id)]
    assert Event.model_validate_json(rest[-1]["data"]).data["status"] == "completed"

    # ?after=N does the same; after the final event, the stream ends at once.
    with alice.stream("GET", f"/v1/jobs/{job_id}/events", params={"after": 4}) as response:
        assert [int(e["id"]) for e in helpers.iter_sse(response)] == ids[4:]
    with alice.stream("GET", f"/v1/jobs/{job_id}/events", params={"after": ids[-1]}) as response:
        assert list(helpers.iter_sse(response)) == []
    bad = alice.get(f"/v1/jobs/{job_id}/events", headers={"Last-Event-ID": "x"})
    assert bad.status_code == 422 and "Last-Event-ID" in bad.json()["error"]


def test_cancel_marks_cancelled_and_frees_the_actor(server, alice, helpers):
    job_id = helpers.create_job(alice, "slow cancel", steps=1000)
    helpers.wait_for(lambda: any(e["type"] == "progress" for e in helpers.all_events(alice, job_id)), 30, "a step")
    assert ray.get_actor(actor_name(job_id), namespace=server.manager.namespace) is not None

    # A checkpoint asked for mid-run is saved at the end of the current step.
    assert alice.post(f"/v1/jobs/{job_id}/checkpoints").status_code == 202
    helpers.wait_for(lambda: alice.get(f"/v1/jobs/{job_id}/checkpoints").json()["checkpoints"], 30, "checkpoint")

    cancelled = alice.post(f"/v1/jobs/{job_id}/cancel")
    assert cancelled.status_code == 200
    assert cancelled.json()["status"] == "cancelled"  # at once, not after the step
    again = alice.post(f"/v1/jobs/{job_id}/cancel").json()
    assert again["status"] == "cancelled" and again["updated_at"] == cancelled.json()["updated_at"]

    helpers.wait_for(lambda: job_id not in server.manager.active_job_ids(), 15, "the manager to drop the job")

    def actor_gone():
        try:
            ray.get_actor(actor_name(job_id), namespace=server.manager.namespace)
        except ValueError:
            return True
        return False

    helpers.wait_for(actor_gone, 15, "the actor to die")
    with alice.stream("GET", f"/v1/jobs/{job_id}/events") as response:
        statuses = [Event.model_validate_json(e["data"]).data.get("status") for e in helpers.iter_sse(response)]
    assert "cancelled" in statuses
    assert statuses.count("cancelled") == 1
    assert helpers.job_status(alice, job_id) == "cancelled"


def test_client_mode_steps_are_idempotent_ordered_and_bounded(server, alice, helpers):
    job_id = helpers.create_job(alice, "hold", mode="client", steps=10)
    row = {"prompt": [{"role": "user", "content": "1+1="}], "reward_model": {"ground_truth": "2"}}
    url = f"/v1/jobs/{job_id}/steps"

    early = alice.post(url, json={"step": 2, "rows": [row]})
    assert early.status_code == 409 and "expected step 1" in early.json()["error"]

    first = alice.post(url, json={"step": 1, "rows": [row]}, headers={"Idempotency-Key": "k-1"})
    assert first.status_code == 202, first.text
    assert first.json() == {"step": 1, "queued": 1, "duplicate": False}
    same_step = alice.post(url, json={"step": 1, "rows": [row, row]})
    assert same_step.status_code == 200 and same_step.json() == {"step": 1, "queued": 1, "duplicate": True}
    same_key = alice.post(url, json={"step": 1, "rows": [row]}, headers={"Idempotency-Key": "k-1"})
    assert same_key.json()["duplicate"] is True
    reused_key = alice.post(url, json={"step": 2, "rows": [row]}, headers={"Idempotency-Key": "k-1"})
    assert reused_key.status_code == 409 and "step 1" in reused_key.json()["error"]

    malformed = alice.post(url, json={"step": 2, "rows": [row, {"question": "no prompt here"}]})
    assert malformed.status_code == 400 and "rows[1]" in malformed.json()["error"]
    not_a_dict = alice.post(url, json={"step": 2, "rows": [row, 7]})
    assert not_a_dict.status_code == 422 and "body.rows[1]" in not_a_dict.json()["error"]
    rejected = alice.post(url, json={"step": 2, "rows": [{**row, "reject": True}]})
    assert rejected.status_code == 400 and "rejects step 2" in rejected.json()["error"]
    assert helpers.job_status(alice, job_id) == "running"  # none of that hurt the job

    data_free = {"extra_info": {"interaction_kwargs": {"name": "game", "seed": 3}}}
    no_env = alice.post(url, json={"step": 2, "rows": [data_free]})  # the job has no interactions
    assert no_env.status_code == 400 and "rows[0]: needs a 'prompt'" in no_env.json()["error"]
    second = alice.post(url, json={"step": 2, "rows": [row]})
    assert second.status_code == 202 and second.json()["queued"] == 2
    full = alice.post(url, json={"step": 3, "rows": [row]})
    assert full.status_code == 429
    assert full.headers["Retry-After"].isdigit()
    assert "limit 2" in full.json()["error"]

    def received():
        logs = [e["data"]["message"] for e in helpers.all_events(alice, job_id) if e["type"] == "log"]
        return [m for m in logs if m.startswith("received")]

    helpers.wait_for(lambda: len(received()) >= 2, 10, "both batches to be logged")
    assert received() == ["received step 1", "received step 2"]  # each forwarded once
    assert alice.post(f"/v1/jobs/{job_id}/cancel").json()["status"] == "cancelled"
    after = alice.post(url, json={"step": 3, "rows": [row]})
    assert after.status_code == 409 and "cancelled" in after.json()["error"]


def test_client_mode_job_trains_pushed_steps(alice, helpers):
    job_id = helpers.create_job(alice, "client quick", mode="client", steps=2)
    row = {"prompt": [{"role": "user", "content": "2+2="}], "reward_model": {"ground_truth": "4"}}
    for step in (1, 2):
        response = alice.post(f"/v1/jobs/{job_id}/steps", json={"step": step, "rows": [row]})
        assert response.status_code in (202, 429), response.text
        while response.status_code == 429:
            response = alice.post(f"/v1/jobs/{job_id}/steps", json={"step": step, "rows": [row]})
    info = helpers.wait_status(alice, job_id, "completed")
    assert info["step"] == 2
    late = alice.post(f"/v1/jobs/{job_id}/steps", json={"step": 3, "rows": [row]})
    assert late.status_code == 409


def test_server_mode_job_takes_no_steps(alice, helpers):
    job_id = helpers.create_job(alice, "quick no-steps", steps=1)
    response = alice.post(f"/v1/jobs/{job_id}/steps", json={"step": 1, "rows": [{"prompt": []}]})
    assert response.status_code == 409 and "server mode" in response.json()["error"]
    helpers.wait_status(alice, job_id, "completed")


@pytest.mark.parametrize(
    "name, expected",
    [
        ("raise", "RuntimeError: the stand-in runner failed at step 2"),
        ("crash", "runner process died"),
        ("bad-init", "refused to start"),
    ],
)
def test_runner_failures_fail_the_job_with_the_reason(server, alice, helpers, name, expected):
    job_id = helpers.create_job(alice, name, steps=5)
    info = helpers.wait_status(alice, job_id, "failed")
    assert expected in info["error"]
    events = helpers.all_events(alice, job_id)
    assert events[-1]["type"] == "status" and events[-1]["data"]["status"] == "failed"
    assert expected in events[-1]["data"]["reason"]
    helpers.wait_for(lambda: job_id not in server.manager.active_job_ids(), 10, "the manager to drop the job")


def test_a_job_ray_cannot_place_stays_queued_and_cancels_at_once(server, alice, helpers):
    job_id = helpers.create_job(alice, "hold needs-gpu", mode="client", steps=3)
    time.sleep(0.5)
    assert helpers.job_status(alice, job_id) == "queued"
    row = {"prompt": [{"role": "user", "content": "hi"}], "reward_model": {"ground_truth": "1"}}
    busy = alice.post(f"/v1/jobs/{job_id}/steps", json={"step": 1, "rows": [row]})
    assert busy.status_code == 503 and "Retry-After" in busy.headers, busy.text
    assert alice.post(f"/v1/jobs/{job_id}/checkpoints").status_code == 503

    assert alice.post(f"/v1/jobs/{job_id}/cancel").json()["status"] == "cancelled"
    helpers.wait_for(lambda: job_id not in server.manager.active_job_ids(), 10, "the manager to drop the job")
    statuses = [e["data"]["status"] for e in helpers.all_events(alice, job_id) if e["type"] == "status"]
    assert statuses == ["queued", "cancelled"]
    assert alice.post(f"/v1/jobs/{job_id}/steps", json={"step": 1, "rows": [row]}).status_code == 409


def test_idle_event_streams_send_keep_alive_comments(start_server, tmp_path, helpers):
    key = helpers.make_user(tmp_path, "frank")
    live = start_server(tmp_path, keepalive_s=0.2)
    with live.client(key) as client:
        job_id = helpers.create_job(client, "hold keep-alive", mode="client", steps=3)
        with client.stream("GET", f"/v1/jobs/{job_id}/events", params={"after": 2}) as response:
            lines = []
            for line in response.iter_lines():
                lines.append(line)
                if line == ": keep-alive":
                    break
        assert ": keep-alive" in lines
        client.post(f"/v1/jobs/{job_id}/cancel")


def test_a_retried_create_with_the_same_idempotency_key_makes_one_job(alice, bob, helpers):
    body = {"name": "quick retried", "config": {"trainer.total_training_steps": 1}}
    first = alice.post("/v1/jobs", json=body, headers={"Idempotency-Key": "create-1"})
    again = alice.post("/v1/jobs", json=body, headers={"Idempotency-Key": "create-1"})
    assert (first.status_code, again.status_code) == (201, 200)
    assert again.json() == first.json()
    other = alice.post("/v1/jobs", json={**body, "name": "something else"}, headers={"Idempotency-Key": "create-1"})
    assert other.status_code == 409 and first.json()["job_id"] in other.json()["error"]
    mine = bob.post("/v1/jobs", json=body, headers={"Idempotency-Key": "create-1"})  # keys are per user
    assert mine.status_code == 201 and mine.json() != first.json()
    names = [j["name"] for j in alice.get("/v1/jobs").json()["jobs"]]
    assert names.count("quick retried") == 1
    helpers.wait_status(alice, first.json()["job_id"], "completed")
    helpers.wait_status(bob, mine.json()["job_id"], "completed")


def test_fsdp_jobs_the_cluster_cannot_place_are_refused_at_creation(alice):
    config = {"actor_rollout_ref.actor.strategy": "fsdp", "trainer.device": "cpu", "trainer.n_gpus_per_node": 64}
    response = alice.post("/v1/jobs", json={"config": config})
    assert response.status_code == 400, response.text
    assert response.json()["error"] == (
        "actor_rollout_ref.actor.strategy=fsdp with trainer.nnodes x trainer.n_gpus_per_node = 64 ranks needs "
        "64 CPU in this server's Ray cluster, which has 4")
    gpu = {**config, "trainer.device": "cuda", "trainer.n_gpus_per_node": 2}
    assert "needs 2 GPU in this server's Ray cluster, which has 0" in alice.post("/v1/jobs", json={"config": gpu}).text
    # Enough CPUs, but the test session's Ray is one node: two nodes of one rank each cannot be.
    nodes = {**config, "trainer.nnodes": 2, "trainer.n_gpus_per_node": 1}
    response = alice.post("/v1/jobs", json={"config": nodes})
    assert response.status_code == 400, response.text
    assert response.json()["error"] == (
        "trainer.nnodes=2 spreads the FSDP ranks over 2 distinct nodes, 1 on each, which needs 2 nodes with 1 CPU "
        "each in this server's Ray cluster; it has 1")


def test_a_stopped_job_resumes_from_its_last_checkpoint(alice, server, helpers):
    job_id = helpers.create_job(alice, "slow", steps=40)
    helpers.wait_for(lambda: helpers.job_status(alice, job_id) == "running", 30, "the job to run")
    early = alice.post(f"/v1/jobs/{job_id}/resume")
    assert early.status_code == 409 and "only a stopped job" in early.json()["error"]
    alice.post(f"/v1/jobs/{job_id}/checkpoints")
    helpers.wait_for(lambda: alice.get(f"/v1/jobs/{job_id}/checkpoints").json()["checkpoints"], 30, "a checkpoint")
    checkpoint = alice.get(f"/v1/jobs/{job_id}/checkpoints").json()["checkpoints"][0]["step"]
    alice.post(f"/v1/jobs/{job_id}/cancel")
    # Until its runner has finished the step, a resume would be undone by the cancel's end.
    stopping = alice.post(f"/v1/jobs/{job_id}/resume")
    assert stopping.status_code == 409 and "still stopping" in stopping.json()["error"], stopping.text
    helpers.wait_for(lambda: job_id not in server.manager.active_job_ids(), 30, "the runner to stop")
    stopped_at = alice.get(f"/v1/jobs/{job_id}").json()["step"]
    resumed = alice.post(f"/v1/jobs/{job_id}/resume")
    assert resumed.status_code == 202 and resumed.json()["status"] == "queued"
    helpers.wait_for(lambda: any(e["type"] == "progress" and e["data"]["step"] > stopped_at
                                 for e in helpers.all_events(alice, job_id)), 30, "steps after the resume")
    events = helpers.all_events(alice, job_id)
    statuses = [e["data"]["status"] for e in events if e["type"] == "status"]
    assert statuses[:3] == ["queued", "running", "cancelled"] and statuses[3:5] == ["queued", "running"]
    logs = [e["data"]["message"] for e in events if e["type"] == "log"]
    assert any(m.startswith(f"resuming from checkpoint global_step_{checkpoint}") for m in logs)
    cancelled_at = next(i for i, e in enumerate(events) if e["type"] == "status" and e["data"]["status"] == "cancelled")
    after = [e["data"]["step"] for e in events[cancelled_at:] if e["type"] == "progress"]
    assert after[0] == checkpoint + 1  # the resumed runner continues after the checkpoint
    alice.post(f"/v1/jobs/{job_id}/cancel")
    done = helpers.create_job(alice, "quick", steps=1)
    helpers.wait_status(alice, done, "completed")
    refused = alice.post(f"/v1/jobs/{done}/resume")
    assert refused.status_code == 409 and "is completed" in refused.json()["error"]
    nothing = helpers.create_job(alice, "hold", mode="client", steps=3)
    alice.post(f"/v1/jobs/{nothing}/cancel")
    assert "no checkpoint to resume from" in alice.post(f"/v1/jobs/{nothing}/resume").json()["error"]


def test_a_resumed_client_mode_job_gets_its_later_batches_again(alice, server, helpers):
    job_id = helpers.create_job(alice, "hold", mode="client", steps=5)
    row = {"prompt": [{"role": "user", "content": "1+1="}], "reward_model": {"ground_truth": "2"}}
    helpers.wait_status(alice, job_id, "running")
    store = server.app.state.store
    for step in (1, 2):  # the stand-in "hold" never trains: fake its progress and a checkpoint at step 1
        assert alice.post(f"/v1/jobs/{job_id}/steps", json={"step": step, "rows": [row]}).status_code == 202
    store.append_runner_events(job_id, [{"type": "progress", "data": {"step": 1, "total_steps": 5}},
                                        {"type": "checkpoint", "data": {"step": 1, "name": "global_step_1",
                                                                        "path": "/nowhere"}}])
    alice.post(f"/v1/jobs/{job_id}/cancel")
    helpers.wait_for(lambda: job_id not in server.manager.active_job_ids(), 30, "the runner to stop")
    assert alice.post(f"/v1/jobs/{job_id}/resume").status_code == 202

    def received_again():
        events = helpers.all_events(alice, job_id)
        resumed_at = next((i for i, e in enumerate(events) if e["type"] == "log"
                           and e["data"]["message"].startswith("resuming from checkpoint global_step_1")), None)
        return resumed_at is not None and [e["data"]["message"] for e in events[resumed_at:]
                                           if e["type"] == "log" and e["data"]["message"].startswith("received")]

    assert helpers.wait_for(received_again, 30, "the batch after the checkpoint") == ["received step 2"]
    alice.post(f"/v1/jobs/{job_id}/cancel")
