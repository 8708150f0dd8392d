"""The audit's findings about jobs as a whole: datasets kept apart from job metadata (6),
quotas and the client-mode idle timeout (7), and the final status event staying last (15)."""

from __future__ import annotations

import json
import sqlite3

from opentinker.server.store import Store

ROW = {"prompt": [{"role": "user", "content": "What is 1 + 1?"}], "reward_model": {"ground_truth": "2"}}


# 6 ------------------------------------------------------------------------------------


def test_6_datasets_live_apart_from_job_metadata(alice, server, helpers):
    rows = [{**ROW, "extra_info": {"pad": "x" * 2000, "i": i}} for i in range(500)]  # ~1 MB
    job_id = helpers.create_job(alice, "quick", steps=1, dataset=rows, config={"trainer.total_training_steps": 1})
    store = server.app.state.store
    record = store.get_job(job_id)
    assert "dataset" not in record.spec and "val_dataset" not in record.spec
    assert store.job_data(job_id)["dataset"] == rows
    (spec_bytes,) = store._query("SELECT length(spec_json) FROM jobs WHERE job_id = ?", (job_id,))[0]
    assert spec_bytes < 2000  # reading or listing jobs never touches the rows
    info = alice.get(f"/v1/jobs/{job_id}")
    assert info.status_code == 200 and len(info.content) < 20_000  # the resolved config (~5 kB), not the ~1 MB of rows
    helpers.wait_status(alice, job_id, "completed")
    starts = [e for e in helpers.all_events(alice, job_id) if e["type"] == "log" and "starts" in e["data"]["message"]]
    assert starts[0]["data"]["dataset_rows"] == 500  # the runner still got every row


def test_6_an_old_store_has_its_datasets_moved_out_once(tmp_path):
    path = tmp_path / "opentinker.db"
    store = Store(path)
    user = store.create_user("old")
    job, _, _ = store.create_job("a" * 32, user, name=None, mode="server",
                                 spec={"mode": "server", "dataset": [ROW]}, config={}, total_steps=1)
    store.close()
    with sqlite3.connect(path) as conn:  # what a store written before job_data looked like
        conn.execute("UPDATE jobs SET spec_json = ?, spec_sha256 = NULL",
                     (json.dumps({"mode": "server", "dataset": [ROW], "val_dataset": None}),))
        conn.execute("DELETE FROM job_data")
    reopened = Store(path)
    try:
        assert "dataset" not in reopened.get_job(job.job_id).spec
        assert reopened.job_data(job.job_id) == {"dataset": [ROW], "val_dataset": None}
    finally:
        reopened.close()


# 7 ------------------------------------------------------------------------------------


def test_7_quotas_queue_then_refuse_with_429(start_server, tmp_path, helpers):
    live = start_server(tmp_path, max_running_jobs_per_user=1, max_queued_jobs_per_user=1)
    key, other = helpers.make_user(tmp_path, "grace"), helpers.make_user(tmp_path, "heidi")
    with live.client(key) as client, live.client(other) as neighbour:
        first = helpers.create_job(client, "hold", mode="client", steps=3)
        helpers.wait_status(client, first, "running")
        second = helpers.create_job(client, "hold", mode="client", steps=3)
        refused = client.post("/v1/jobs", json={"name": "third", "mode": "client"})
        assert refused.status_code == 429, refused.text
        assert refused.headers["Retry-After"].isdigit()
        assert refused.json()["error"].startswith(
            "you have 2 unfinished jobs (running or queued), the most this server allows per user (1 running + 1 queued)"
        )
        assert helpers.job_status(client, second) == "queued"  # waits for the slot, not for Ray
        helpers.wait_status(neighbour, helpers.create_job(neighbour, "hold", mode="client", steps=3), "running")
        client.post(f"/v1/jobs/{first}/cancel")
        helpers.wait_status(client, second, "running")  # the freed slot went to the queued job
        assert client.post("/v1/jobs", json={"name": "third", "mode": "client"}).status_code == 201


def test_7_queued_jobs_survive_a_restart(start_server, tmp_path, helpers):
    key = helpers.make_user(tmp_path, "ivan")
    first = start_server(tmp_path, max_running_jobs_per_user=1)
    with first.client(key) as client:
        running = helpers.create_job(client, "hold", mode="client", steps=3)
        helpers.wait_status(client, running, "running")
        waiting = helpers.create_job(client, "hold", mode="client", steps=3)
    first.stop()
    second = start_server(tmp_path, max_running_jobs_per_user=1)
    with second.client(key) as client:
        assert helpers.job_status(client, running) == "interrupted"
        helpers.wait_status(client, waiting, "running")
        client.post(f"/v1/jobs/{waiting}/cancel")


def test_7_idle_client_mode_jobs_are_stopped(start_server, tmp_path, helpers):
    live = start_server(tmp_path, client_idle_timeout_s=2.0)
    live.app.state.tokenizers.get(None)  # loaded once up front: the first push is not slowed by it
    key = helpers.make_user(tmp_path, "judy")
    with live.client(key) as client:
        never_pushed = helpers.create_job(client, "quick", mode="client", steps=3)
        pushed_once = helpers.create_job(client, "quick", mode="client", steps=3)
        # 503 while the runner is still starting (a loaded machine): "retry", as a client does (the same step is a no-op)
        helpers.wait_for(lambda: client.post(f"/v1/jobs/{pushed_once}/steps",
                                             json={"step": 1, "rows": [ROW]}).status_code in (200, 202),
                         60, "step 1 to be accepted")
        for job_id in (never_pushed, pushed_once):
            info = helpers.wait_status(client, job_id, "cancelled", timeout=30)
            # The status changes at once; its event follows the runner's last events.
            def final_event_stored(job_id=job_id):
                events = helpers.all_events(client, job_id)
                return events if events[-1]["data"].get("status") == "cancelled" else None

            events = helpers.wait_for(final_event_stored, 30, "the final status event")
            final = events[-1]
            assert final["type"] == "status" and final["data"]["status"] == "cancelled", events
            assert "with no step to train" in final["data"]["reason"]
            assert "--client-idle-timeout" in final["data"]["reason"]
            assert info["step"] == (1 if job_id == pushed_once else 0)  # the pushed step was trained first


# 15 -----------------------------------------------------------------------------------


def test_15_the_final_status_event_is_always_last(alice, server, helpers):
    job_id = helpers.create_job(alice, "slow", steps=50)
    helpers.wait_for(lambda: any(e["type"] == "progress" for e in helpers.all_events(alice, job_id)), 30, "a step")
    assert alice.post(f"/v1/jobs/{job_id}/cancel").json()["status"] == "cancelled"  # at once
    helpers.wait_for(lambda: job_id not in server.manager.active_job_ids(), 30, "the runner to stop")
    events = helpers.all_events(alice, job_id)
    statuses = [i for i, e in enumerate(events) if e["type"] == "status"]
    assert events[-1]["type"] == "status" and events[-1]["data"] == {"status": "cancelled",
                                                                     "reason": "cancelled by the user"}
    assert statuses[-1] == len(events) - 1 and [events[i]["data"]["status"] for i in statuses] == [
        "queued", "running", "cancelled"]
    # The step that was running when the cancel came still reported, before the final event.
    progress = [e["data"]["step"] for e in events if e["type"] == "progress"]
    metrics = [e["data"]["step"] for e in events if e["type"] == "metrics"]
    assert progress and progress == metrics
    with alice.stream("GET", f"/v1/jobs/{job_id}/events") as response:
        streamed = list(helpers.iter_sse(response))
    assert [int(e["id"]) for e in streamed] == [e["id"] for e in events]  # and the stream ended
    assert server.app.state.store.append_event(job_id, "log", {"message": "late"}) is None
    assert helpers.all_events(alice, job_id)[-1] == events[-1]
