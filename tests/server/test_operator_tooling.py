"""Operator tooling on a real server on 127.0.0.1: revoking every key of a user with the admin
CLI, when keys were last used, the limit on wrong keys per client address, and job errors
that users can quote (an id) without seeing the server's traces or paths."""

from __future__ import annotations

import json
import re
import sqlite3

import httpx
import pytest

from opentinker.client import cli as client_cli
from opentinker.server import cli
from opentinker.server.auth import FailedAuthLimiter
from opentinker.server.settings import ServerSettings
from opentinker.server.store import Store

DASHBOARD = {"X-OpenTinker-Dashboard": "1"}


def admin(capsys, *args: str) -> tuple[int, str, str]:
    """``opentinker-server admin ...`` through the CLI's entry point: (exit code, stdout, stderr)."""
    code = cli.main(["admin", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


def from_address(address: str, **kwargs) -> httpx.Client:
    """A client whose connections come from ``address`` (any 127.x.y.z is this machine)."""
    return httpx.Client(transport=httpx.HTTPTransport(local_address=address), timeout=30, trust_env=False, **kwargs)


def test_revoking_every_key_of_a_user_and_when_keys_were_last_used(start_server, tmp_path, capsys):
    live = start_server(tmp_path)
    data = ["--data-dir", str(tmp_path)]
    assert admin(capsys, "create-user", "gus", *data)[0] == 0
    keys = {}
    for _ in range(2):
        code, out, _ = admin(capsys, "create-key", "gus", *data)
        key_id = re.search(r"API key id (\d+) for 'gus'", out).group(1)
        keys[key_id] = out.strip().splitlines()[-1]
    (used_id, used), (idle_id, idle) = keys.items()
    with live.client(used) as client:
        assert client.get("/v1/jobs").status_code == 200
    with httpx.Client(base_url=live.url, trust_env=False) as browser:  # the dashboard's login, with the other key
        assert browser.post("/v1/session", json={"api_key": idle}, headers=DASHBOARD).status_code == 204
        assert browser.get("/v1/jobs").status_code == 200

        code, out, _ = admin(capsys, "list-keys", "--user", "gus", *data)
        rows = {row[0]: row for row in (line.split("\t") for line in out.strip().splitlines()[1:])}
        assert code == 0 and set(rows) == {used_id, idle_id}
        assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d", rows[used_id][5])  # last used (UTC)
        assert rows[idle_id][5] != "never"  # the dashboard login used it
        assert used not in out and idle not in out

        code, out, _ = admin(capsys, "revoke-key", "--user", "gus", *data)
        assert code == 0 and f"revoked 2 key(s) of 'gus' (id {used_id}, {idle_id})" in out
        # Refused at once: both APIs and the dashboard session opened with the other key.
        assert browser.get("/v1/jobs").status_code == 401
    with live.client(used) as client:
        assert client.get("/v1/jobs").status_code == 401
    assert httpx.get(live.url + "/api/v1/sessions", headers={"X-API-Key": "tml-" + idle}).status_code == 401
    code, _, err = admin(capsys, "revoke-key", "--user", "gus", *data)
    assert code == 2 and "'gus' has no active API key" in err
    code, _, err = admin(capsys, "revoke-key", "--user", "nobody", *data)
    assert code == 2 and "no user 'nobody'" in err
    code, out, _ = admin(capsys, "list-keys", *data)
    assert out.count("\trevoked\t") == 2


def test_a_store_made_before_last_used_was_kept_gets_the_column(tmp_path, capsys):
    code, out, _ = admin(capsys, "create-user", "hal", "--data-dir", str(tmp_path))
    admin(capsys, "create-key", "hal", "--data-dir", str(tmp_path))
    with sqlite3.connect(tmp_path / "opentinker.db") as db:  # as an older server left it
        db.execute("ALTER TABLE api_keys DROP COLUMN last_used_at")
    store = Store(tmp_path / "opentinker.db")
    try:
        (key,) = store.list_api_keys()
        assert key.user_name == "hal" and key.last_used_at is None and not key.revoked
    finally:
        store.close()
    code, out, _ = admin(capsys, "list-keys", "--data-dir", str(tmp_path))
    assert code == 0 and out.strip().splitlines()[-1].endswith("\tactive\tnever")


def test_wrong_keys_past_the_limit_get_429_and_a_right_key_still_works(start_server, tmp_path, helpers):
    limit = ServerSettings().auth_failures_per_minute  # the default: 20 a minute
    live = start_server(tmp_path, auth_failures_per_minute=limit)
    key = helpers.make_user(tmp_path, "ivy")
    wrong = "ot-" + "w" * 43
    with from_address("127.0.0.1", base_url=live.url) as client:
        attempts = [
            lambda: client.get("/v1/jobs", headers={"Authorization": f"Bearer {wrong}"}),
            lambda: client.get("/api/v1/sessions", headers={"X-API-Key": "tml-" + wrong}),
            lambda: client.post("/v1/session", json={"api_key": wrong}, headers=DASHBOARD),
        ]
        answers = [attempts[i % 3]().status_code for i in range(limit)]
        assert answers == [401] * limit
        for attempt in attempts:  # past the limit, on every way in
            refused = attempt()
            assert refused.status_code == 429, refused.text
            assert 1 <= int(refused.headers["Retry-After"]) <= 60
            assert "too many wrong API keys" in refused.json()["error"]
        # A right key from the same address is still accepted, on both APIs.
        assert client.get("/v1/jobs", headers={"Authorization": f"Bearer {key}"}).status_code == 200
        assert client.get("/api/v1/sessions", headers={"X-API-Key": "tml-" + key}).status_code == 200
    with from_address("127.0.0.2", base_url=live.url) as other:  # another address is not limited
        assert other.get("/v1/jobs", headers={"Authorization": f"Bearer {wrong}"}).status_code == 401
    with from_address("127.0.0.3", base_url=live.url) as keyless:  # a missing key is no wrong key
        assert all(keyless.get("/v1/jobs").status_code == 401 for _ in range(limit + 5))
        assert keyless.get("/v1/jobs", headers={"Authorization": f"Bearer {wrong}"}).status_code == 401
    assert len(live.app.state.auth_limiter) == 3  # the addresses that sent wrong keys


def test_the_failed_key_table_is_bounded_and_windows_end():
    now = [0.0]
    limiter = FailedAuthLimiter(2, window_s=60, max_addresses=3, clock=lambda: now[0])
    assert [limiter.failed("a") for _ in range(3)] == [None, None, 60.0]
    now[0] = 45.0
    assert limiter.failed("a") == 15.0  # the window started at the first failure
    for address in ("b", "c", "d", "e"):
        limiter.failed(address)
    assert len(limiter) == 3  # "a" and "b", the least recently failing, were dropped
    assert [limiter.failed("a") for _ in range(2)] == [None, None]  # so "a" starts again
    now[0] = 200.0
    assert [limiter.failed("e") for _ in range(3)] == [None, None, 60.0]  # a new window
    for i in range(20_000):
        limiter.failed(f"10.0.{i // 256}.{i % 256}")
    assert len(limiter) == 3


@pytest.mark.timeout(300)
def test_a_failed_jobs_error_has_an_id_and_no_trace_or_server_path(ray_cluster, tmp_path, helpers, caplog, capsys):
    # A served model whose folder (inside the data folder) the operator got wrong: the real
    # runner fails with an exception naming that folder.
    missing = tmp_path / "models" / "nope"
    settings = helpers.test_settings(tmp_path, models=[f"broken={missing}"])
    live = helpers.LiveServer(settings, runner_cls=None).start()
    try:
        key = helpers.make_user(tmp_path, "jan")
        with caplog.at_level("ERROR", logger="opentinker.server.jobs"), live.client(key) as client:
            job_id = helpers.create_job(client, "broken", config={"actor_rollout_ref.model.path": "broken",
                                                                  "trainer.total_training_steps": 1})
            info = helpers.wait_status(client, job_id, "failed", timeout=120)
            (error,) = [e for e in helpers.all_events(client, job_id) if e["type"] == "error"]
        capsys.readouterr()
        assert client_cli.main(["--base-url", live.url, "--api-key", key, "jobs", "logs", job_id]) == 0
        shown = capsys.readouterr().out
    finally:
        live.stop()
    assert set(error["data"]) == {"message", "error_id"}
    error_id = error["data"]["error_id"]
    assert re.fullmatch(r"[0-9a-f]{12}", error_id)
    assert "<model broken>" in error["data"]["message"]  # the served name, not the folder
    assert info["error"] == f"{error['data']['message']} (error id {error_id})"
    for published in (json.dumps(error), json.dumps(info)):
        assert "Traceback" not in published and ".py" not in published and str(tmp_path) not in published
    # The server's log has the trace under that id, for the operator.
    (record,) = [r for r in caplog.records if error_id in r.getMessage()]
    assert record.name == "opentinker.server.jobs" and job_id in record.getMessage()
    assert "Traceback (most recent call last)" in record.getMessage() and ".py" in record.getMessage()
    # What the client's CLI shows: the message and the id to quote.
    assert f"(error id {error_id})" in shown
