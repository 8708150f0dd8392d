"""JobHandle against the protocol test server: event stream, wait, checkpoints, step pushing."""

from __future__ import annotations

import io
import json
import tarfile
import time
from pathlib import Path

import httpx
import pytest

from opentinker.client import (
    ConflictError,
    JobFailedError,
    JobTimeoutError,
    NotFoundError,
    RateLimitError,
    UnsafeArchiveError,
)
from opentinker.client import event_stream
from opentinker.client import JobHandle, OpenTinkerClient
from opentinker.client.checkpoint_archive import extract_tar_safely
from opentinker.protocol import CheckpointInfo, JobCreate, JobStatus

ROW = {"prompt": [{"role": "user", "content": "What is 2 + 3?"}]}


def _finished_job(client, proto, steps=3, **kw):
    job = client.create_job(JobCreate(config={"trainer.total_training_steps": steps}, **kw))
    info = job.wait(progress=False, timeout=20)
    return job, info


def test_sse_stream_handles_comments_multiline_data_and_cut_events():
    """The client's reading of a stream (httpx-sse underneath): comments are skipped, data
    lines are joined, a bare id/retry is no event, and an event cut off by the connection
    (no blank line yet) is discarded, so a reconnect picks it up again."""
    event = {"id": 1, "job_id": "j", "type": "log", "data": {"message": "hi"}, "created_at": 0.0}
    data = "".join(f"data: {line}\n" for line in json.dumps(event, indent=1).splitlines())
    body = (f": hello\n\nid: 1\nevent: log\n{data}\n"
            'retry: 50\nid: 2\n\nid: 3\ndata: {"id": 3, "cut')
    transport = httpx.MockTransport(
        lambda request: httpx.Response(200, headers={"content-type": "text/event-stream"}, text=body)
    )
    with OpenTinkerClient("http://opentinker.test", "k") as client:
        client._http = httpx.Client(transport=transport)
        events = list(event_stream._connect(JobHandle(client, "j"), 0, read_timeout=5))
    assert [e.model_dump() for e in events] == [event]  # the last event never got its blank line


def test_stream_yields_every_event_once_in_order(client, proto):
    job = client.create_job(JobCreate(config={"trainer.total_training_steps": 4}))
    events = list(job.stream())
    assert [e.id for e in events] == list(range(1, len(events) + 1))
    assert events[-1].type == "status" and events[-1].data["status"] == "completed"
    assert [e.data["step"] for e in events if e.type == "progress"] == [1, 2, 3, 4]
    assert len(proto.state.sse_connections) == 1


@pytest.mark.parametrize("abort", [False, True], ids=["clean-end", "broken-connection"])
def test_stream_reconnects_with_last_event_id_and_loses_nothing(client, proto, abort):
    proto.state.sse_drop_after = 2
    proto.state.sse_abort = abort
    job = client.create_job(JobCreate(config={"trainer.total_training_steps": 5}))
    events = list(job.stream())
    ids = [e.id for e in events]
    all_ids = [e.id for e in proto.state.jobs[job.job_id].events]
    assert ids == all_ids  # nothing lost, nothing repeated
    assert events[-1].data["status"] == "completed"
    connections = proto.state.sse_connections
    assert len(connections) >= len(all_ids) // 2
    assert connections[0] is None
    # each reconnect resumed after the last event this client had seen
    resumed = [int(c) for c in connections[1:]]
    assert resumed == sorted(resumed) and set(resumed) <= set(all_ids)


def test_stream_resumes_after_a_given_id(client, proto):
    job, _ = _finished_job(client, proto)
    everything = job.events()
    tail = list(job.stream(after=everything[-3].id))
    assert [e.id for e in tail] == [e.id for e in everything[-2:]]
    assert list(job.stream(after=everything[-1].id)) == []  # past the end of a finished job


def test_wait_shows_progress_with_reward_and_kl(client, proto, capsys):
    job = client.create_job(JobCreate(name="bar", config={"trainer.total_training_steps": 4}))
    info = job.wait(timeout=20)
    assert info.status == JobStatus.COMPLETED and info.step == 4
    err = capsys.readouterr().err
    assert "4/4" in err
    assert "reward=1" in err and "kl=0.004" in err
    # The job's log lines show above the bar: what it is doing before its first step.
    assert "[bar] loading model sim" in err and "[bar] model sim loaded; training 4 steps" in err


def test_wait_raises_the_servers_error_when_the_job_fails(client, proto):
    job = client.create_job(JobCreate(name=proto.fail_job_name, config={"trainer.total_training_steps": 5}))
    with pytest.raises(JobFailedError) as info:
        job.wait(progress=False, timeout=20)
    assert proto.fail_message in str(info.value)
    assert info.value.info.status == JobStatus.FAILED


def test_wait_times_out_while_the_job_keeps_running(client, proto):
    proto.state.hold.clear()  # the job stays queued
    job = client.create_job(JobCreate())
    start = time.monotonic()
    with pytest.raises(JobTimeoutError):
        job.wait(timeout=0.3, progress=False)
    assert time.monotonic() - start < 3
    assert job.info().status == JobStatus.QUEUED
    proto.state.hold.set()


def test_metrics_and_events_without_streaming(client, proto):
    job, _ = _finished_job(client, proto, steps=3)
    metrics = job.metrics()
    assert [m["step"] for m in metrics] == [1, 2, 3]
    assert metrics[-1]["metrics"]["reward/mean"] == 1.0
    assert all(e.job_id == job.job_id for e in job.events())


def test_cancel_is_safe_to_repeat(client, proto):
    proto.state.hold.clear()
    job = client.create_job(JobCreate())
    assert job.cancel().status == JobStatus.CANCELLED
    assert job.cancel().status == JobStatus.CANCELLED
    proto.state.hold.set()
    assert job.wait(progress=False, timeout=10).status == JobStatus.CANCELLED  # cancelled is not an error
    done, _ = _finished_job(client, proto)
    assert done.cancel().status == JobStatus.COMPLETED  # the server's 409 becomes the final info


def test_checkpoint_save_list_and_download(client, proto, tmp_path):
    job = client.create_job(JobCreate(config={"trainer.total_training_steps": 3}))
    job.save_checkpoint()
    job.wait(progress=False, timeout=20)
    checkpoints = job.checkpoints()
    assert len(checkpoints) == 1 and checkpoints[0].name.startswith("global_step_")
    dest = job.download_checkpoint(dest=tmp_path / "ckpt")
    assert dest == tmp_path / "ckpt"
    assert (dest / "config.json").is_file() and (dest / "tokenizer" / "tokenizer.json").is_file()
    assert checkpoints[0].name in (dest / "config.json").read_text()
    with pytest.raises(NotFoundError):
        job.download_checkpoint("global_step_999", tmp_path / "x")


def test_download_without_checkpoints_is_not_found(client, proto, tmp_path):
    job, _ = _finished_job(client, proto)
    with pytest.raises(NotFoundError, match="no checkpoints"):
        job.download_checkpoint(dest=tmp_path)


def _tar(build) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        build(tar)
    return buffer.getvalue()


def _file(tar, name, content=b"x"):
    member = tarfile.TarInfo(name)
    member.size = len(content)
    tar.addfile(member, io.BytesIO(content))


def _link(tar, name, target, kind=tarfile.SYMTYPE):
    member = tarfile.TarInfo(name)
    member.type = kind
    member.linkname = target
    tar.addfile(member)


EVIL = {
    "dotdot": lambda t: (_file(t, "config.json"), _file(t, "../escaped.txt")),
    "nested-dotdot": lambda t: _file(t, "a/../../escaped.txt"),
    "absolute": lambda t: _file(t, "/tmp/opentinker-escaped.txt"),
    "symlink-out": lambda t: _link(t, "weights", "../../etc"),
    "absolute-symlink": lambda t: _link(t, "weights", "/etc/passwd"),
    "hardlink-out": lambda t: _link(t, "weights", "../escaped.txt", tarfile.LNKTYPE),
}


@pytest.mark.parametrize("kind", sorted(EVIL))
def test_download_rejects_members_escaping_the_destination(client, proto, tmp_path, kind):
    job, _ = _finished_job(client, proto)
    sim = proto.state.jobs[job.job_id]
    sim.checkpoints.append(CheckpointInfo(name="evil", step=3, created_at=time.time()))
    proto.state.archives[(job.job_id, "evil")] = _tar(EVIL[kind])
    dest = tmp_path / "out" / "ckpt"
    with pytest.raises(UnsafeArchiveError):
        job.download_checkpoint("evil", dest)
    assert not (tmp_path / "out" / "escaped.txt").exists()
    assert not Path("/tmp/opentinker-escaped.txt").exists()
    assert not (tmp_path / "out").exists()  # nothing was written, not even the destination folder


def test_extract_refuses_even_links_that_stay_inside(tmp_path):
    archive = tmp_path / "ok.tar.gz"
    archive.write_bytes(_tar(lambda t: (_file(t, "a/real.bin", b"123"), _link(t, "a/alias.bin", "real.bin"))))
    with pytest.raises(UnsafeArchiveError, match="'a/alias.bin' is a symbolic link"):
        extract_tar_safely(archive, tmp_path / "dest")  # a checkpoint holds only files and folders
    assert not (tmp_path / "dest").exists()


def test_push_step_waits_out_429_and_keeps_its_key(client, proto):
    proto.state.hold.clear()  # the job does not consume batches yet, so the queue fills up
    proto.state.queue_limit = 1
    proto.state.retry_after = "0.05"
    job = client.create_job(JobCreate(mode="client", config={"trainer.total_training_steps": 3}))
    assert job.push_step(1, [ROW]).queued == 1
    with pytest.raises(RateLimitError) as info:
        job.push_step(2, [ROW], timeout=0.01)  # the queue is full and we will not wait
    assert info.value.retry_after == 0.05
    proto.state.hold.set()  # now the job consumes step 1 and frees a slot
    accepted = job.push_step(2, [ROW], idempotency_key="step-2-key")
    assert accepted.step == 2 and not accepted.duplicate
    pushes = [r for r in proto.state.posts(f"/v1/jobs/{job.job_id}/steps") if r.headers["idempotency-key"] == "step-2-key"]
    assert len(pushes) >= 1 and proto.state.rate_limited >= 1
    # a re-send of the same step (the answer was lost) is answered as a duplicate
    assert job.push_step(2, [ROW], idempotency_key="step-2-key").duplicate
    with pytest.raises(ConflictError, match="expected step 3"):
        job.push_step(4, [ROW])
    job.push_step(3, [ROW])
    assert job.wait(progress=False, timeout=20).status == JobStatus.COMPLETED
    assert proto.state.jobs[job.job_id].rows_consumed == [[ROW], [ROW], [ROW]]


def test_push_step_retries_429_until_accepted(client, proto):
    proto.state.hold.clear()
    proto.state.queue_limit = 1
    job = client.create_job(JobCreate(mode="client", config={"trainer.total_training_steps": 2}))
    job.push_step(1, [ROW])
    import threading

    threading.Timer(0.2, proto.state.hold.set).start()
    start = time.monotonic()
    assert job.push_step(2, [ROW]).step == 2
    assert time.monotonic() - start >= 0.15
    keys = {r.headers["idempotency-key"] for r in proto.state.posts(f"/v1/jobs/{job.job_id}/steps")[1:]}
    assert len(keys) == 1 and proto.state.rate_limited >= 2


def test_wandb_is_optional_and_gets_every_metrics_event(client, proto, monkeypatch):
    import sys
    import types

    monkeypatch.setitem(sys.modules, "wandb", None)  # not installed
    job = client.create_job(JobCreate(config={"trainer.total_training_steps": 2}))
    with pytest.warns(UserWarning, match="wandb is not installed"):
        assert job.wait(progress=False, timeout=20, wandb_project="proj").status == JobStatus.COMPLETED

    logged, inits = [], []

    class Run:
        def log(self, metrics, step=None):
            logged.append((step, metrics))

        def finish(self):
            logged.append("finished")

    fake = types.ModuleType("wandb")
    fake.init = lambda **kw: inits.append(kw) or Run()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    job = client.create_job(JobCreate(name="w", config={"trainer.total_training_steps": 2}))
    job.wait(progress=False, timeout=20, wandb_project="proj")
    assert inits[0]["project"] == "proj" and inits[0]["name"] == "w"
    assert [step for step, _ in logged[:-1]] == [1, 2] and logged[-1] == "finished"
    assert logged[1][1]["reward/mean"] == 1.0


def test_download_returns_the_archives_single_top_level_folder(client, proto, tmp_path):
    job, _ = _finished_job(client, proto)
    proto.state.jobs[job.job_id].checkpoints.append(CheckpointInfo(name="global_step_3", step=3, created_at=time.time()))
    proto.state.archives[(job.job_id, "global_step_3")] = proto.archive(
        {"global_step_3/config.json": b"{}", "global_step_3/tokenizer/tokenizer.json": b"{}"}
    )
    folder = job.download_checkpoint(dest=tmp_path / "dl")  # the latest
    assert folder == tmp_path / "dl" / "global_step_3"
    assert (folder / "config.json").is_file()
