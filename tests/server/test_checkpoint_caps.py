"""Checkpoint bytes on disk are bounded server-wide and per user (the audit wrote 301 checkpoints,
2.2 GB, in 30 s), on live servers on 127.0.0.1 with real SQLite:

- the cap on all users' checkpoints (``--max-checkpoint-gb``) holds for two users' RL jobs
  together, and across the two APIs (an RL job's checkpoints count against a Tinker save and
  a Tinker snapshot against a job's checkpoint);
- each user's bound on their jobs' checkpoints (``--max-job-checkpoint-gb``);
- a checkpoint past a bound is either never written (the runner was told before) or deleted
  once measured; the job goes on and a warning event names the flag.

The stand-in runner (conftest) writes a checkpoint of a known size at a job's last step; the
real JobRunner's is checked too.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import httpx
import pytest

from opentinker.server import auth
from opentinker.server.checkpoint_caps import JobCheckpointCaps, folder_bytes
from opentinker.server.settings import ServerSettings
from opentinker.server.store import Store

from .test_tinker_quotas import _model, _result, _session
from .test_tinker_quotas import _raw as _tinker_client

GiB = 2**30
# What the stand-in runner writes at step 3 (conftest: StandInRunner._save).
STAND_IN_BYTES = len('{"model_type": "stand-in", "step": 3}') + 3000 + len("{}")
SMALL = {"data.train_batch_size": 2, "actor_rollout_ref.actor.ppo_mini_batch_size": 2,
         "actor_rollout_ref.rollout.n": 4, "trainer.test_freq": -1}


def finished(client: httpx.Client, helpers, name: str, **body) -> str:
    """A job (3 stand-in steps unless ``body`` says otherwise), run to its end."""
    job_id = helpers.create_job(client, name, **body)
    info = helpers.wait_status(client, job_id, "completed", "failed", timeout=300)
    assert info["status"] == "completed", info
    return job_id


def kept(client: httpx.Client, job_id: str) -> list[str]:
    return [c["name"] for c in client.get(f"/v1/jobs/{job_id}/checkpoints").json()["checkpoints"]]


def warnings(client: httpx.Client, helpers, job_id: str) -> list[str]:
    return [e["data"]["message"] for e in helpers.all_events(client, job_id)
            if e["type"] == "log" and e["data"].get("level") == "warning"]


def job_checkpoints_on_disk(data_dir: Path) -> int:
    return sum(folder_bytes(folder) for folder in (data_dir / "jobs").glob("*/checkpoints/global_step_*"))


def test_the_server_cap_holds_for_two_users_jobs_together(start_server, tmp_path, helpers):
    cap = 2 * STAND_IN_BYTES + STAND_IN_BYTES // 2
    flag = f"--max-checkpoint-gb {cap / GiB:g}"
    live = start_server(tmp_path, max_checkpoint_gb=cap / GiB)
    with live.client(helpers.make_user(tmp_path, "alice")) as alice, \
            live.client(helpers.make_user(tmp_path, "bob")) as bob:
        first, second = finished(alice, helpers, "first"), finished(bob, helpers, "second")
        assert kept(alice, first) == kept(bob, second) == ["global_step_3"]
        assert job_checkpoints_on_disk(tmp_path) == 2 * STAND_IN_BYTES

        # Room for half a checkpoint is left, whoever asks: written, measured, deleted.
        for client, name in ((alice, "third"), (bob, "fourth")):
            over = finished(client, helpers, name)
            assert client.get(f"/v1/jobs/{over}").json()["step"] == 3  # every step trained
            assert kept(client, over) == []
            [warning] = warnings(client, helpers, over)
            assert warning.startswith("checkpoint global_step_3 (step 3) was not kept: this checkpoint took 2.97 KiB")
            assert flag in warning and "it was not kept" in warning, warning
            assert not (tmp_path / "jobs" / over / "checkpoints" / "global_step_3").exists()
        assert job_checkpoints_on_disk(tmp_path) == 2 * STAND_IN_BYTES <= cap
        assert live.app.state.store.all_checkpoint_bytes() == 2 * STAND_IN_BYTES


def test_a_users_quota_for_job_checkpoints_is_theirs_and_a_full_one_writes_none(start_server, tmp_path, helpers):
    live = start_server(tmp_path, max_job_checkpoint_gb=STAND_IN_BYTES / GiB)
    flag = f"--max-job-checkpoint-gb {STAND_IN_BYTES / GiB:g}"
    with live.client(helpers.make_user(tmp_path, "alice")) as alice, \
            live.client(helpers.make_user(tmp_path, "bob")) as bob:
        first = finished(alice, helpers, "first")
        assert kept(alice, first) == ["global_step_3"]

        # Alice's quota is full: her next job is told before it starts, and writes nothing.
        full = finished(alice, helpers, "full")
        assert alice.get(f"/v1/jobs/{full}").json()["step"] == 3
        assert kept(alice, full) == []
        [warning] = warnings(alice, helpers, full)
        assert warning == (f"checkpoint global_step_3 was not saved: your jobs' checkpoints take 2.97 KiB on disk: "
                           f"over this server's quota per user for jobs' checkpoints of 2.97 KiB ({flag}); the job "
                           "goes on without it")
        assert not (tmp_path / "jobs" / full / "checkpoints").exists()

        # Bob's quota is his own.
        bobs = finished(bob, helpers, "bobs")
        assert kept(bob, bobs) == ["global_step_3"] and warnings(bob, helpers, bobs) == []
        assert job_checkpoints_on_disk(tmp_path) == 2 * STAND_IN_BYTES


def test_tinker_and_job_checkpoints_share_the_server_cap(start_server, tmp_path, helpers):
    pytest.importorskip("tinker")
    cap = 2 * STAND_IN_BYTES + STAND_IN_BYTES // 2
    live = start_server(tmp_path, max_checkpoint_gb=cap / GiB)
    svc = live.app.state.tinker
    with live.client(helpers.make_user(tmp_path, "alice")) as alice, \
            _tinker_client(live.url, helpers.make_user(tmp_path, "bob")) as bob:
        job = finished(alice, helpers, "first")
        assert kept(alice, job) == ["global_step_3"]

        model_id = _model(bob, _session(bob))
        estimate = svc.checkpoint_estimate(svc.state.model(model_id), "sampler_weights")
        assert estimate > cap
        alone = bob.post("/save_weights_for_sampler", json={"model_id": model_id, "path": "alone"})
        assert alone.status_code == 400, alone.text
        assert "more than this server's whole cap on all users' checkpoints" in alone.json()["error"]
        assert f"--max-checkpoint-gb {cap / GiB:g}" in alone.json()["error"]

        # With room for bob's snapshot but not beside alice's job checkpoint: 429 naming the flag.
        svc.server_cap.max_bytes = estimate + STAND_IN_BYTES - 1
        full = bob.post("/save_weights_for_sampler", json={"model_id": model_id, "path": "full"})
        assert full.status_code == 429 and full.headers["retry-after"], full.text
        assert "the checkpoints on this server (all users') take 2.97 KiB on disk" in full.json()["error"]
        assert f"--max-checkpoint-gb {svc.server_cap.max_bytes / GiB:g}" in full.json()["error"]

        svc.server_cap.max_bytes = 10 * GiB
        saved = bob.post("/save_weights_for_sampler", json={"model_id": model_id, "path": "saved"})
        assert saved.status_code == 200 and "path" in _result(bob, saved.json()["request_id"]).json()
        snapshot = bob.get("/checkpoints").json()["checkpoints"][0]["size_bytes"]
        assert live.app.state.store.all_checkpoint_bytes() == STAND_IN_BYTES + snapshot > cap

        # Bob's snapshot now fills the jobs' cap (--max-checkpoint-gb): alice's next job writes none.
        after = finished(alice, helpers, "after")
        assert kept(alice, after) == []
        [warning] = warnings(alice, helpers, after)
        assert warning.startswith("checkpoint global_step_3 was not saved: the checkpoints on this server (all users')")
        assert f"--max-checkpoint-gb {cap / GiB:g}" in warning


def test_the_real_runner_writes_no_checkpoint_past_the_quota(ray_cluster, tmp_path, helpers):
    live = helpers.LiveServer(helpers.test_settings(tmp_path), runner_cls=None).start()
    try:
        with live.client(helpers.make_user(tmp_path, "erin")) as erin:
            config = {**SMALL, "trainer.total_training_steps": 1}
            first = finished(erin, helpers, "first", steps=1, config=config)
            assert kept(erin, first) == ["global_step_1"]
            size = live.app.state.store.get_checkpoint(first, "global_step_1").size_bytes
            folder = tmp_path / "jobs" / first / "checkpoints" / "global_step_1"
            assert size == folder_bytes(folder) > folder_bytes(folder / "actor")  # the whole checkpoint, state too

            live.manager.checkpoints.per_user.max_bytes = size  # full now
            second = finished(erin, helpers, "second", steps=1, config=config)
            assert kept(erin, second) == [] and erin.get(f"/v1/jobs/{second}").json()["step"] == 1
            assert not (tmp_path / "jobs" / second / "checkpoints" / "global_step_1").exists()
            refused = [w for w in warnings(erin, helpers, second) if "checkpoint global_step_1" in w]
            assert refused and refused[0].startswith("checkpoint global_step_1 was not saved: your jobs' checkpoints")
            assert f"--max-job-checkpoint-gb {size / GiB:g}" in refused[0]
    finally:
        live.stop()


def test_the_operators_flags_set_the_bounds_and_must_be_positive(tmp_path):
    from opentinker.server.cli import build_parser

    args = build_parser().parse_args(["serve", "--max-checkpoint-gb", "3", "--max-job-checkpoint-gb", "1.5"])
    assert (args.max_checkpoint_gb, args.max_job_checkpoint_gb) == (3.0, 1.5)
    defaults = build_parser().parse_args(["serve"])
    assert (defaults.max_checkpoint_gb, defaults.max_job_checkpoint_gb) == (200.0, 50.0)
    caps = JobCheckpointCaps(None, ServerSettings(data_dir=tmp_path, max_checkpoint_gb=3, max_job_checkpoint_gb=1.5))
    assert (caps.server.max_bytes, caps.per_user.max_bytes) == (3 * GiB, int(1.5 * GiB))
    for name in ("max_checkpoint_gb", "max_job_checkpoint_gb"):
        with pytest.raises(ValueError, match=f"^{name} must be > 0"):
            ServerSettings(data_dir=tmp_path, **{name: 0})


def test_job_checkpoints_are_measured_again_when_the_server_starts(tmp_path):
    store = Store(tmp_path / "opentinker.db")
    store._conn.execute("ALTER TABLE checkpoints DROP COLUMN size_bytes")  # a store made before sizes
    store.close()
    store = Store(tmp_path / "opentinker.db")  # the column comes back, empty
    user = auth.create_user(store, "carol")
    store.create_job("j1", user, name=None, mode="server", spec={}, config={}, total_steps=3)
    settings = ServerSettings(data_dir=tmp_path)
    folder = settings.job_checkpoint_dir("j1", "global_step_3")
    folder.mkdir(parents=True)
    (folder / "weights").write_bytes(os.urandom(1234))
    store.append_runner_events("j1", [{"type": "checkpoint",
                                       "data": {"step": 3, "name": "global_step_3", "path": str(folder)}}])
    assert store.get_checkpoint("j1", "global_step_3").size_bytes is None  # indexed before sizes were
    JobCheckpointCaps(store, settings).measure_on_disk()
    assert store.get_checkpoint("j1", "global_step_3").size_bytes == 1234 == store.checkpoint_bytes(user.id)
    (folder / "weights").unlink()  # the operator frees room
    JobCheckpointCaps(store, settings).measure_on_disk()
    assert store.checkpoint_bytes(user.id) == 0 == store.all_checkpoint_bytes()
    store.close()
