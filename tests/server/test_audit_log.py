"""The audit log on a real server on 127.0.0.1: what the official ``tinker`` SDK reads with
``get_audit_log`` (a user their own entries, an admin everyone's), the OpenTinker API's
``GET /v1/audit`` (paging, filters), refused keys, another user's job, the RL job events, the
``admin audit`` / ``admin set-admin`` commands, and the table's bounds."""

from __future__ import annotations

import asyncio
import datetime as dt
import os
import time

import pytest

tinker = pytest.importorskip("tinker")

from opentinker.server import cli  # noqa: E402
from opentinker.server.accounting import AuditLog  # noqa: E402
from opentinker.server.audit_hooks import RefusedKeys  # noqa: E402
from opentinker.server.store import Store  # noqa: E402

os.environ.setdefault("TINKER_TELEMETRY", "0")
TINY = "opentinker-tiny-arith"


@pytest.fixture(scope="module")
def audited(ray_cluster, tmp_path_factory, helpers):
    """A server of its own (refused keys are counted per address and minute), with users ann
    and ben and an admin, root."""
    data = tmp_path_factory.mktemp("audit-data")
    keys = {name: helpers.make_user(data, name) for name in ("ann", "ben", "root")}
    store = Store(data / "opentinker.db")
    store.set_admin("root", True)
    store.close()
    live = helpers.LiveServer(helpers.test_settings(data)).start()
    live.data_dir, live.keys = data, keys
    yield live
    live.stop()


def _rest(live, user: str):
    return tinker.RestClient(base_url=live.url, api_key="tml-" + live.keys[user])


def _sdk_log(live, user: str, **kwargs):
    with pytest.warns(FutureWarning):  # RestClient.get_audit_log is deprecated for AdminClient's
        return _rest(live, user).get_audit_log(**kwargs).result()


def _v1(live, caller: str, **params) -> dict:
    with live.client(live.keys[caller]) as client:
        answer = client.get("/v1/audit", params=params)
    assert answer.status_code == 200, answer.text
    return answer.json()


def test_the_sdk_reads_its_own_model_and_checkpoint_entries_and_an_admin_reads_everyones(audited):
    made = {}
    for user in ("ann", "ben"):
        service = tinker.ServiceClient(base_url=audited.url, api_key="tml-" + audited.keys[user])
        training = service.create_lora_training_client(base_model=TINY, rank=4).result()
        path = training.save_state(f"{user}-state").result().path
        made[user] = (training.model_id, path)
        service.close("success").result()

    log = _sdk_log(audited, "ann")
    assert [e.timestamp for e in log.entries] == sorted(e.timestamp for e in log.entries)
    created = [e for e in log.entries if e.event == "model_create"]
    assert [e.model_id for e in created] == [made["ann"][0]]
    assert created[0].event_details["base_model"] == TINY and created[0].event_details["lora_rank"] == 4
    assert created[0].event_details["user"] == "ann"
    assert created[0].event_details["key"] == audited.keys["ann"][:8]  # the key's display prefix, never the key
    saved = [e for e in log.entries if e.event == "checkpoint_create"]
    assert [e.tinker_path for e in saved] == [made["ann"][1]]
    assert "key_use" in {e.event for e in log.entries}
    assert not {"session_create", "session_end"} & {e.event for e in log.entries}  # sessions: search_sessions
    assert all(e.event_details["user"] == "ann" for e in log.entries)  # nothing of ben's
    assert made["ben"][0] not in str(log.entries)

    # The SDK's event_type picks by resource; a day without entries is empty.
    only_checkpoints = _sdk_log(audited, "ann", event_type="checkpoints")
    assert {e.event for e in only_checkpoints.entries} == {"checkpoint_create"}
    assert _sdk_log(audited, "ann", day=dt.date(2020, 1, 1)).entries == []

    everyone = asyncio.run(_admin_log_async(audited))
    models = {e.model_id for e in everyone.entries if e.event == "model_create"}
    assert {made["ann"][0], made["ben"][0]} <= models
    paths = {e.tinker_path for e in everyone.entries if e.event == "checkpoint_create"}
    assert {made["ann"][1], made["ben"][1]} <= paths


async def _admin_log_async(live):
    with pytest.warns(FutureWarning):
        return await _rest(live, "root").get_audit_log_async()


def test_a_wrong_key_leaves_one_key_refused_entry_a_minute_that_only_an_admin_reads(audited):
    with audited.client() as raw:
        for _ in range(3):
            assert raw.get("/api/v1/training_runs", headers={"X-API-Key": "tml-ot-wrong"}).status_code == 401
        assert raw.get("/v1/jobs", headers={"Authorization": "Bearer ot-also-wrong"}).status_code == 401
    refused = [e for e in _v1(audited, "root", event="key_refused")["entries"]]
    assert len(refused) == 1, refused  # the first of the minute from 127.0.0.1; the rest counted in the next
    assert refused[0]["user"] is None and refused[0]["address"] == "127.0.0.1"
    assert refused[0]["details"]["path"] == "/api/v1/training_runs"
    assert "ot-wrong" not in str(refused)
    sdk = _sdk_log(audited, "root", event_type="organizations")
    assert "key_refused" in {e.event for e in sdk.entries}
    assert not [e for e in _v1(audited, "ann", event="key_refused")["entries"]]
    assert "key_refused" not in {e.event for e in _sdk_log(audited, "ann").entries}

    clock = [0.0]
    limit = RefusedKeys(window_s=60, max_addresses=2, clock=lambda: clock[0])
    assert limit.admit("a") == 0 and limit.admit("a") is None and limit.admit("a") is None
    clock[0] = 61
    assert limit.admit("a") == 2  # the next minute's entry counts the ones left out
    limit.admit("b"), limit.admit("c")
    assert len(limit._seen) == 2  # bounded: the least recently refused address is dropped


def test_another_users_job_is_a_404_and_an_access_denied_entry_for_its_owner(audited, helpers):
    with audited.client(audited.keys["ann"]) as ann, audited.client(audited.keys["ben"]) as ben:
        job = helpers.create_job(ann, "quick", steps=2)
        for path in (f"/v1/jobs/{job}", f"/v1/jobs/{job}/checkpoints", f"/v1/jobs/{job}/cancel"):
            answer = ben.post(path) if path.endswith("cancel") else ben.get(path)
            assert answer.status_code == 404, answer.text
            missing = ben.post("/v1/jobs/" + "0" * 32 + "/cancel") if path.endswith("cancel") else \
                ben.get(path.replace(job, "0" * 32))
            assert answer.json()["error"] == missing.json()["error"].replace("0" * 32, job)
        helpers.wait_status(ann, job, "completed")
        download = ann.get(f"/v1/jobs/{job}/checkpoints/global_step_2/download")
        assert download.status_code == 200

    denied = _v1(audited, "ann", event="access_denied")["entries"]
    assert len(denied) == 3 and {e["details"]["resource"] for e in denied} == {f"job:{job}"}
    assert {e["details"]["asker"] for e in denied} == {"ben"} and {e["user"] for e in denied} == {"ann"}
    assert not _v1(audited, "ben", event="access_denied")["entries"]  # the asker learns nothing from it
    assert {(e["key"], e["address"]) for e in denied} == {(None, None)}  # the asker's key and address: admins only
    seen_by_admin = _v1(audited, "root", event="access_denied", user="ann")["entries"]
    assert len(seen_by_admin) == 3
    assert {e["key"] for e in seen_by_admin} == {audited.keys["ben"][:8]} and None not in {e["address"] for e in seen_by_admin}

    ann_log = _v1(audited, "ann", event=["job_create", "checkpoint_create", "checkpoint_download"])["entries"]
    events = {(e["event"], e["details"].get("job_id"), e["details"].get("name")) for e in ann_log}
    assert ("job_create", job, "quick") in events
    assert ("checkpoint_create", job, "global_step_2") in events  # the kept checkpoint the runner wrote
    assert ("checkpoint_download", job, "global_step_2") in events


def test_job_create_and_cancel_are_recorded_and_v1_audit_pages(audited, helpers):
    with audited.client(audited.keys["ben"]) as ben:
        job = helpers.create_job(ben, "slow", steps=1000)
        helpers.wait_status(ben, job, "running")
        assert ben.post(f"/v1/jobs/{job}/cancel").status_code == 200
        helpers.wait_status(ben, job, "cancelled")
        mine = ben.get("/v1/audit", params={"event": ["job_create", "job_cancel"]}).json()["entries"]
        assert [(e["event"], e["details"]["job_id"]) for e in mine[:2]] == [("job_cancel", job), ("job_create", job)]
        assert mine[0]["key"] == audited.keys["ben"][:8] and mine[0]["address"] == "127.0.0.1"

        # Pages of one, newest first, until the last.
        seen, before = [], None
        while True:
            page = ben.get("/v1/audit", params={"limit": 1, **({"before_id": before} if before else {})}).json()
            seen += page["entries"]
            before = page["next_before_id"]
            if before is None:
                break
        everything = ben.get("/v1/audit", params={"limit": 1000}).json()
        assert seen == everything["entries"] and everything["next_before_id"] is None
        assert [e["id"] for e in seen] == sorted((e["id"] for e in seen), reverse=True)

        today = dt.datetime.now(dt.timezone.utc).date().isoformat()
        assert ben.get("/v1/audit", params={"day": today}).json()["entries"] == [
            e for e in everything["entries"] if e["time"].startswith(today)]
        assert ben.get("/v1/audit", params={"since": "2020-01-01T00:00:00", "until": "2020-01-02T00:00:00"}
                       ).json()["entries"] == []
        both = ben.get("/v1/audit", params={"day": today, "since": "2020-01-01T00:00:00"})
        assert both.status_code == 400 and "day" in both.json()["error"]
        assert ben.get("/v1/audit", params={"limit": 1001}).status_code == 422
        assert ben.get("/v1/audit", params={"user": "ann"}).status_code == 404  # not an admin
        assert ben.get("/v1/audit", headers={"Authorization": "Bearer ot-nope"}).status_code == 401


def test_admin_audit_prints_entries_and_set_admin_toggles(audited, capsys, helpers):
    data = ["--data-dir", str(audited.data_dir)]
    with audited.client(audited.keys["ben"]) as ben:
        helpers.create_job(ben, "quick", steps=1)
    assert cli.main(["admin", "audit", "--user", "ben", "--event", "job_create", "--limit", "5", *data]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].split() == ["time", "(UTC)", "event", "user", "key", "address", "details"]
    assert printed[1].split()[2:5] == ["job_create", "ben", audited.keys["ben"][:8]]
    assert all("job_create" in line for line in printed[1:])
    assert cli.main(["admin", "audit", "--since", "1", *data]) == 0
    newest_first = [line[:19] for line in capsys.readouterr().out.splitlines()[1:] if line[:2] == "20"]
    assert newest_first == sorted(newest_first, reverse=True) and newest_first
    assert cli.main(["admin", "audit", "--day", "2020-01-01", *data]) == 0
    assert capsys.readouterr().out.strip() == "no audit entries match"
    assert cli.main(["admin", "audit", "--user", "nobody", *data]) == 2

    def ben_reads_others() -> bool:
        return any(e["user"] not in ("ben", None) for e in _v1(audited, "ben", limit=1000)["entries"])

    assert not ben_reads_others()
    assert cli.main(["admin", "set-admin", "ben", *data]) == 0
    assert ben_reads_others()  # read from the store on each request: no restart
    assert cli.main(["admin", "list-users", *data]) == 0
    assert "ben\t1 active key(s)\tadmin" in capsys.readouterr().out
    assert cli.main(["admin", "set-admin", "ben", "--off", *data]) == 0
    assert not ben_reads_others()
    assert cli.main(["admin", "set-admin", "nobody", *data]) == 2
    assert cli.main(["admin", "create-user", "dora", "--admin", *data]) == 0
    toggles = _v1(audited, "root", event="user_admin_set", limit=10)["entries"]
    assert [(e["user"], e["details"]["admin"]) for e in toggles[:3]] == [("dora", True), ("ben", False),
                                                                         ("ben", True)]


def test_the_table_is_bounded_by_size_and_age(tmp_path):
    store = Store(tmp_path / "bounded.db")
    try:
        log = AuditLog(store, retention_days=90, max_entries=5)
        for i in range(300):  # pruned every 256 writes
            log.record("job_create", user_id=1, user_name="x", n=i)
        kept = log.entries(user_id=None, limit=1000)
        assert len(kept) == 5 + (300 - 256)
        log.prune()
        assert [e.details["n"] for e in log.entries(user_id=None, limit=1000)] == [299, 298, 297, 296, 295]
        log.record("job_create", user_id=1, details="x" * 5000)
        assert "truncated" in log.entries(user_id=None, limit=1)[0].details  # a record, not a payload store
        aged = AuditLog(store, retention_days=1 / 86400)  # a second
        time.sleep(1.1)
        aged.prune()
        assert aged.entries(user_id=None) == []
    finally:
        store.close()
