"""What survives a restart, the admin CLI, how keys are kept, and `serve` as a real process."""

from __future__ import annotations

import os
import re
import sqlite3
import subprocess
import sys
import time

import httpx
import pytest
import ray

from opentinker.server import auth
from opentinker.server.jobs import actor_name
from opentinker.server.store import Store


def test_restart_keeps_finished_jobs_and_interrupts_running_ones(start_server, tmp_path, helpers):
    key = helpers.make_user(tmp_path, "carol")
    first = start_server(tmp_path)
    with first.client(key) as client:
        done = helpers.create_job(client, "quick", steps=2)
        helpers.wait_status(client, done, "completed")
        running = helpers.create_job(client, "slow", steps=1000)
        helpers.wait_status(client, running, "running")
        done_events = helpers.all_events(client, done)
        done_checkpoints = client.get(f"/v1/jobs/{done}/checkpoints").json()
    first.stop()  # its lifespan kills the actors, as a crash of the process would
    try:
        ray.get_actor(actor_name(running), namespace=first.manager.namespace)
        raise AssertionError("the running job's actor outlived its server")
    except ValueError:
        pass

    second = start_server(tmp_path)
    with second.client(key) as client:
        jobs = {job["job_id"]: job for job in client.get("/v1/jobs").json()["jobs"]}
        assert jobs[done]["status"] == "completed" and jobs[done]["step"] == 2
        assert helpers.all_events(client, done) == done_events
        assert client.get(f"/v1/jobs/{done}/checkpoints").json() == done_checkpoints
        download = client.get(f"/v1/jobs/{done}/checkpoints/global_step_2/download")
        assert download.status_code == 200 and download.content[:2] == b"\x1f\x8b"

        interrupted = jobs[running]
        assert interrupted["status"] == "interrupted"
        assert re.fullmatch(
            r"the server stopped while this job was running \(restarted at \d{4}-\d\d-\d\dT[\d:]+\+00:00\)",
            interrupted["error"],
        ), interrupted["error"]
        last = helpers.all_events(client, running)[-1]
        assert last["type"] == "status"
        assert last["data"] == {"status": "interrupted", "reason": interrupted["error"]}
        with client.stream("GET", f"/v1/jobs/{running}/events") as response:
            assert list(helpers.iter_sse(response))[-1]["event"] == "status"  # and the stream ended
        assert client.post(f"/v1/jobs/{running}/cancel").json()["status"] == "interrupted"
        assert client.post(f"/v1/jobs/{running}/checkpoints").status_code == 409
        assert second.manager.active_job_ids() == []


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "opentinker.server.cli", *args], capture_output=True, text=True, timeout=60
    )


def test_admin_cli_creates_users_and_keys_that_are_stored_hashed(tmp_path):
    data = str(tmp_path)
    created = _cli("admin", "create-user", "dave", "--data-dir", data)
    assert created.returncode == 0, created.stderr
    duplicate = _cli("admin", "create-user", "dave", "--data-dir", data)
    assert duplicate.returncode == 2 and "already exists" in duplicate.stderr

    issued = _cli("admin", "create-key", "dave", "--data-dir", data)
    assert issued.returncode == 0, issued.stderr
    assert "will not be shown again" in issued.stdout
    key = issued.stdout.strip().splitlines()[-1]
    assert re.fullmatch(r"ot-[A-Za-z0-9_-]{43}", key)

    unknown = _cli("admin", "create-key", "nobody", "--data-dir", data)
    assert unknown.returncode == 2 and "no user named 'nobody'" in unknown.stderr
    listed = _cli("admin", "list-users", "--data-dir", data)
    assert listed.returncode == 0 and "dave\t1 active key(s)" in listed.stdout

    store = Store(tmp_path / "opentinker.db")
    try:
        assert auth.authenticate(store, key).name == "dave"
        assert auth.authenticate(store, key[:-1] + ("A" if key[-1] != "A" else "B")) is None
        (stored_hash, prefix), = store._query("SELECT key_hash, prefix FROM api_keys")
    finally:
        store.close()
    assert stored_hash == auth.hash_key(key) and prefix == key[:8]
    # Neither the database nor its write-ahead log holds the key itself.
    for path in tmp_path.glob("opentinker.db*"):
        raw = path.read_bytes()
        assert key.encode() not in raw and key[8:].encode() not in raw, path
    with sqlite3.connect(tmp_path / "opentinker.db") as conn:
        dump = "\n".join(conn.iterdump())
    assert key not in dump and auth.hash_key(key) in dump


def test_admin_cli_lists_and_revokes_keys_and_both_apis_refuse_a_revoked_key(start_server, tmp_path, helpers):
    live = start_server(tmp_path)
    data = str(tmp_path)
    leaked = helpers.make_user(tmp_path, "fay")
    kept = _cli("admin", "create-key", "fay", "--data-dir", data).stdout.strip().splitlines()[-1]
    with live.client(leaked) as client:
        assert client.get("/v1/jobs").status_code == 200
    assert httpx.get(live.url + "/api/v1/sessions", headers={"X-API-Key": "tml-" + leaked}).status_code == 200

    listed = _cli("admin", "list-keys", "--user", "fay", "--data-dir", data)
    assert listed.returncode == 0, listed.stderr
    rows = [line.split("\t") for line in listed.stdout.strip().splitlines()[1:]]
    assert [(row[1], row[2], row[4]) for row in rows] == [("fay", leaked[:8] + "...", "active"),
                                                          ("fay", kept[:8] + "...", "active")]
    assert leaked not in listed.stdout and kept not in listed.stdout  # only the first characters
    revoked = _cli("admin", "revoke-key", rows[0][0], "--data-dir", data)  # by id, as an operator would
    assert revoked.returncode == 0 and "refused from now on" in revoked.stdout
    again = _cli("admin", "revoke-key", rows[0][0], "--data-dir", data)
    assert again.returncode == 2 and "no active API key with key id" in again.stderr
    assert _cli("admin", "list-keys", "--data-dir", data).stdout.count("\trevoked") == 1

    # The running server refuses it at once, on both APIs; the other key still works.
    with live.client(leaked) as client:
        assert client.get("/v1/jobs").status_code == 401
    assert httpx.get(live.url + "/api/v1/sessions", headers={"X-API-Key": "tml-" + leaked}).status_code == 401
    with live.client(kept) as client:
        assert client.get("/v1/jobs").status_code == 200
    by_key = _cli("admin", "revoke-key", "tml-" + kept, "--data-dir", data)  # by the key itself, as the SDK sends it
    assert by_key.returncode == 0 and kept not in by_key.stdout
    with live.client(kept) as client:
        assert client.get("/v1/jobs").status_code == 401


def test_serve_runs_as_a_process_on_loopback(ray_cluster, tmp_path):
    with __import__("socket").socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    key = _cli("admin", "create-user", "erin", "--data-dir", str(tmp_path))
    assert key.returncode == 0
    key = _cli("admin", "create-key", "erin", "--data-dir", str(tmp_path)).stdout.strip().splitlines()[-1]
    command = [
        sys.executable, "-m", "opentinker.server.cli", "serve", "--port", str(port), "--data-dir", str(tmp_path),
        "--ray-address", ray_cluster, "--log-level", "info",
    ]  # fmt: skip
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env={**os.environ, "PYTHONUNBUFFERED": "1"})  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        with httpx.Client(base_url=url, trust_env=False, timeout=5) as client:
            while True:
                try:
                    if client.get("/v1/health").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                assert process.poll() is None, process.stdout.read()
                assert time.monotonic() < deadline, "the server did not answer in 60 s"
                time.sleep(0.2)
            assert client.get("/v1/jobs").status_code == 401
            assert client.get("/v1/version", headers={"Authorization": f"Bearer {key}"}).json()["user"] == "erin"
            assert client.get("/docs").status_code == 200
    finally:
        process.terminate()
        output, _ = process.communicate(timeout=30)
    assert f"listening on {url}" in output
    assert "Application shutdown complete" in output  # SIGTERM ran the lifespan's shutdown
    assert process.returncode in (0, -15), output  # uvicorn re-raises the signal it caught


def test_restart_keeps_what_is_shared_metered_and_audited(start_server, tmp_path, helpers):
    """Published checkpoints, projects, usage, the audit log and the signing keys live in the
    store: after a restart another user still loads the published checkpoint, the owner's
    usage and audit entries are all there, and a download link signed before still works."""
    tinker = pytest.importorskip("tinker")
    from tinker import types

    os.environ.setdefault("TINKER_TELEMETRY", "0")
    owner_key, reader_key = helpers.make_user(tmp_path, "olga"), helpers.make_user(tmp_path, "rita")
    tokens = [1, 5, 9, 12, 40, 41]
    datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)})
    first = start_server(tmp_path)
    service = tinker.ServiceClient(project_id="keep", base_url=first.url, api_key="tml-" + owner_key)
    training = service.create_lora_training_client(base_model="opentinker-tiny-arith", rank=4).result()
    for _ in range(2):
        training.forward_backward([datum], "cross_entropy").result()
    sampler_path = training.save_weights_for_sampler("shared").result().path
    external = training.save_weights_external("export").result().path
    rest = tinker.RestClient(base_url=first.url, api_key="tml-" + owner_key)
    rest.publish_checkpoint_from_tinker_path(sampler_path).result()
    links = rest.get_external_weights_urls(external).result().urls
    session_id = service.holder.get_session_id()
    admin = tinker.AdminClient(base_url=first.url, api_key="tml-" + owner_key)  # olga's own entries and usage
    audit_before = [(e.event, e.timestamp) for e in admin.get_audit_log().result().entries]
    service.close("success").result()
    first.stop()

    second = start_server(tmp_path)
    rest = tinker.RestClient(base_url=second.url, api_key="tml-" + owner_key)
    admin = tinker.AdminClient(base_url=second.url, api_key="tml-" + owner_key)
    assert [(e.event, e.timestamp) for e in admin.get_audit_log().result().entries][:len(audit_before)] == audit_before
    hour = lambda offset: time.strftime("%Y-%m-%dT%H:00:00Z", time.gmtime(time.time() + offset))  # noqa: E731
    usage = admin.get_billing_usage(hour(-7200), hour(3600)).result()
    trained = sum(e.event_info.token_count for e in usage.data if e.event_info.type == "training")
    assert trained == 2 * (len(tokens) - 1)
    [found] = rest.search_sessions(types.SessionSearchRequest(session_id=session_id)).result().sessions
    assert found.project_id == "keep"
    assert [c.public for c in rest.list_checkpoints(training.model_id).result().checkpoints
            if c.tinker_path == sampler_path] == [True]
    reader = tinker.ServiceClient(base_url=second.url, api_key="tml-" + reader_key)
    sampled = reader.create_sampling_client(model_path=sampler_path).result().sample(
        types.ModelInput.from_ints(tokens[:3]), 1, types.SamplingParams(max_tokens=2, seed=0)).result()
    assert len(sampled.sequences[0].tokens) == 2
    reader.close("success").result()
    for link in links.values():  # signed by the first process, under the key kept in the store
        link = link.replace(first.url, second.url)
        assert httpx.get(link, timeout=30, trust_env=False).status_code == 200, link
