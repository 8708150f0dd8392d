"""A job's client follows the job, not one stream: ``wait()``, ``stream()`` and `jobs logs -f`
go on past a stop that was resumed (``jobs resume``), and end only at the job's real end.
A real server (the stand-in runner: a real Ray actor whose steps are sleeps) and the real client."""

from __future__ import annotations

import subprocess
import sys
import threading

from opentinker import OpenTinkerClient
from opentinker.client.cli import format_job
from opentinker.client.errors import JobFailedError
from opentinker.client.progress import EnvTotals
from opentinker.protocol import JobInfo, JobStatus


def _stopped_with_a_checkpoint(live, key, helpers, name: str, steps: int) -> str:
    """A job cancelled after a checkpoint at step >= 2, its events ending with 'cancelled'."""
    with live.client(key) as raw:
        job_id = helpers.create_job(raw, name, steps=steps)
        helpers.wait_for(lambda: raw.get(f"/v1/jobs/{job_id}").json()["step"] >= 2, what="step 2")
        assert raw.post(f"/v1/jobs/{job_id}/checkpoints").status_code == 202
        helpers.wait_for(lambda: raw.get(f"/v1/jobs/{job_id}/checkpoints").json()["checkpoints"], what="a checkpoint")
        raw.post(f"/v1/jobs/{job_id}/cancel")
        helpers.wait_for(lambda: helpers.all_events(raw, job_id)[-1]["data"].get("status") == "cancelled",
                         what="the final cancelled event")
    return job_id


def test_wait_and_stream_follow_a_resumed_job_past_its_earlier_end(start_server, tmp_path, helpers):
    """The issue's case: after `jobs resume`, wait() returned 'queued' at once (the stream ended on the
    old final event). Now it follows the resumed job to completion; the stream from the start has
    both ends in it and stops only at the last."""
    live = start_server(tmp_path)
    key = helpers.make_user(tmp_path, "erin")
    job_id = _stopped_with_a_checkpoint(live, key, helpers, "medium-resumed", steps=12)
    with OpenTinkerClient(live.url, key) as client:
        handle = client.job(job_id)
        assert handle.info().final_event_id is not None  # cancelled: its end, for now
        resumed = handle.resume()
        assert resumed.status is JobStatus.QUEUED and resumed.final_event_id is None
        info = handle.wait(progress=False)
        assert info.status is JobStatus.COMPLETED and info.step == 12
        statuses = [e.data["status"] for e in handle.stream() if e.type == "status"]
        assert statuses[-1] == "completed" and "cancelled" in statuses[:-1] and "queued" in statuses
        assert handle.info().final_event_id == handle.events()[-1].id


def test_jobs_logs_follow_goes_on_past_a_resumed_stop(start_server, tmp_path, helpers):
    """`opentinker jobs logs -f` started on a stopped job keeps printing once it is resumed, and ends
    with the completed status."""
    live = start_server(tmp_path)
    key = helpers.make_user(tmp_path, "finn")
    job_id = _stopped_with_a_checkpoint(live, key, helpers, "medium-logs", steps=10)
    logs = subprocess.Popen([sys.executable, "-m", "opentinker.client.cli", "--base-url", live.url, "--api-key", key,
                             "jobs", "logs", job_id, "-f"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        with live.client(key) as raw:
            helpers.wait_for(lambda: raw.post(f"/v1/jobs/{job_id}/resume").status_code == 202, what="the resume")
        out, err = logs.communicate(timeout=120)
    finally:
        logs.kill()
    assert logs.returncode == 0, err
    lines = [line for line in out.splitlines() if " status " in line]
    assert "cancelled" in lines[0] or any("cancelled" in line for line in lines)
    assert lines[-1].split("status", 1)[1].strip().startswith("completed")


def test_wait_raises_only_when_the_job_really_ends(start_server, tmp_path, helpers):
    """A job that fails is raised for; the same job resumed and followed again completes."""
    live = start_server(tmp_path)
    key = helpers.make_user(tmp_path, "gail")
    job_id = _stopped_with_a_checkpoint(live, key, helpers, "medium-again", steps=8)
    with OpenTinkerClient(live.url, key) as client:
        handle = client.job(job_id)
        done = threading.Event()
        outcome: dict = {}

        def follow():
            try:
                outcome["info"] = handle.wait(progress=False)
            except JobFailedError as error:  # pragma: no cover - the failure this test guards against
                outcome["error"] = error
            done.set()

        handle.resume()
        follower = threading.Thread(target=follow)
        follower.start()
        follower.join(timeout=120)
    assert done.is_set() and "error" not in outcome
    assert outcome["info"].status is JobStatus.COMPLETED and outcome["info"].step == 8


def test_jobs_show_says_what_the_envs_cost_and_no_relay_wait_once_finished():
    """`jobs show` sums the env errors, redone steps and env waits of the metrics, and says a
    finished relayed job's env calls no longer wait."""
    totals = EnvTotals()
    for metrics in ({"env/arith/env_errors": 2, "train/env_outage_retries": 0.0, "train/env_outage_wait_s": 0.0},
                    {"env/arith/env_errors": 1, "env/maze/env_errors": 1, "train/env_outage_retries": 1.0,
                     "train/env_outage_wait_s": 12.4}):
        totals.add(metrics)
    assert (totals.env_errors, totals.redone, totals.postfix()) == (4, 1, {"env_err": 4, "redone": 1,
                                                                          "env_wait": "12s"})
    info = JobInfo.model_validate({
        "job_id": "j1", "name": None, "mode": "server", "status": "completed", "created_at": 0.0,
        "updated_at": 0.0, "total_steps": 3, "step": 3, "final_event_id": 9,
        "relay": {"interactions": ["arith"], "connected": False}})
    shown = format_job(info, totals)
    assert "relay    not needed (the job is completed); interactions: arith" in shown
    assert ("envs     4 episode(s) ended in an error of the env's own; 1 step(s) redone after an env outage; "
            "12 s waiting for envs") in shown
    assert "its env calls wait" not in shown
