"""Revoking a key cuts what is open under it (issue 32, part 7): the audit's event stream of a
running job kept delivering after `opentinker-server admin revoke-key` (17 events in 40 s) and
a Tinker long poll ran on. Here, against a real server on 127.0.0.1 and the real CLI, the
event stream (bearer key and dashboard cookie) and both Tinker long polls end within seconds
of the revocation while the job keeps running, and a stream of the same job under another key
goes on."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import httpx
import pytest

tinker = pytest.importorskip("tinker")

os.environ.setdefault("TINKER_TELEMETRY", "0")
TINY = "opentinker-tiny-arith"
CUT_WITHIN_S = 10.0  # the server checks every 2 s; the rest is slack for a loaded machine


class Reader(threading.Thread):
    """Reads one long response in the background: an SSE stream (``sse=True``: the arrival
    time of each event) or a long poll's answer; ``ended_at`` when it finished."""

    def __init__(self, send, sse: bool, helpers=None):
        super().__init__(daemon=True)
        self.send, self.sse, self.helpers = send, sse, helpers
        self.events: list[tuple[float, dict]] = []
        self.status: int | None = None
        self.answer: dict | None = None
        self.ended_at: float | None = None
        self.error: BaseException | None = None
        self.opened = threading.Event()

    def run(self):
        try:
            with self.send() as response:
                self.status = response.status_code
                self.opened.set()
                if self.sse:
                    for event in self.helpers.iter_sse(response):
                        self.events.append((time.monotonic(), event))
                else:
                    self.answer = response.read() and response.json()
        except BaseException as error:  # noqa: BLE001 - reported by the test
            self.error = error
        finally:
            self.ended_at = time.monotonic()
            self.opened.set()


def _revoke(data_dir, key: str) -> float:
    """Revoke ``key`` with the operator's CLI (another process on the same SQLite file); when it returned."""
    done = subprocess.run([sys.executable, "-m", "opentinker.server.cli", "admin", "revoke-key", "tml-" + key,
                           "--data-dir", str(data_dir)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return time.monotonic()


def _new_key(data_dir, user: str) -> str:
    done = subprocess.run([sys.executable, "-m", "opentinker.server.cli", "admin", "create-key", user,
                           "--data-dir", str(data_dir)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().splitlines()[-1]


def test_revoking_a_key_ends_its_event_streams_and_long_polls_within_seconds(server, data_dir, helpers,
                                                                            monkeypatch):
    svc = server.app.state.tinker
    # A hole in a model's seq_ids is waited for this long: a request behind it stays pending,
    # so a long poll on it is held for the whole --tinker-long-poll (25 s).
    monkeypatch.setattr(svc.host.settings, "gap_s", 120.0)
    monkeypatch.setattr(svc.settings, "long_poll_s", 44.0)  # the most under the SDK's 45 s: held throughout
    key = helpers.make_user(data_dir, "revokee")
    other_key = _new_key(data_dir, "revokee")  # the same user's second key, not revoked

    # A job with steady events (a step every 0.5 s for 100 s), the audit's case.
    with server.client(key) as client:
        job_id = helpers.create_job(client, "slow-revocation", steps=200)
        helpers.wait_status(client, job_id, "running")
        login = client.post("/v1/session", json={"api_key": key}, headers={"X-OpenTinker-Dashboard": "1"})
        assert login.status_code == 204, login.text
        cookie = login.cookies["ot_session"]

    # The Tinker side: a model, a request behind a hole in its seq_ids, a sampling session.
    service = tinker.ServiceClient(base_url=server.url, api_key="tml-" + key)
    training = service.create_lora_training_client(base_model=TINY, rank=4).result()
    sampler = service.create_sampling_client(base_model=TINY).result()
    slot = svc.host.slot(training.model_id)
    raw = httpx.Client(base_url=server.url + "/api/v1", headers={"X-API-Key": "tml-" + key}, timeout=60,
                       trust_env=False)
    behind_hole = raw.post("/optim_step", json={"model_id": training.model_id, "seq_id": slot.next_seq + 1,
                                                "adam_params": {"learning_rate": 0.0}})
    assert behind_hole.status_code == 200, behind_hole.text
    request_id = behind_hole.json()["request_id"]

    events_url = f"{server.url}/v1/jobs/{job_id}/events"
    long_timeout = httpx.Timeout(60.0)
    bearer = Reader(lambda: httpx.stream("GET", events_url, headers={"Authorization": f"Bearer {key}"},
                                         timeout=long_timeout, trust_env=False), sse=True, helpers=helpers)
    dashboard = Reader(lambda: httpx.stream("GET", events_url, cookies={"ot_session": cookie},
                                            timeout=long_timeout, trust_env=False), sse=True, helpers=helpers)
    kept = Reader(lambda: httpx.stream("GET", events_url, headers={"Authorization": f"Bearer {other_key}"},
                                       timeout=long_timeout, trust_env=False), sse=True, helpers=helpers)
    future_poll = Reader(lambda: raw.stream("POST", "/retrieve_future", json={"request_id": request_id}), sse=False)
    target = {"type": "sampling_session", "sampling_session_id": sampler._sampling_session_id}
    session_poll = Reader(lambda: raw.stream("POST", "/retrieve_futures", json={"target": target, "timeout": 44}),
                          sse=False)
    readers = [bearer, dashboard, kept, future_poll, session_poll]
    try:
        for reader in readers:
            reader.start()
        for reader in (bearer, dashboard, kept):  # a long poll's status comes with its answer
            assert reader.opened.wait(30) and reader.status == 200, (reader.status, reader.error)
        helpers.wait_for(lambda: all(len(r.events) >= 3 for r in (bearer, dashboard, kept)), 30,
                         "events on the three streams")
        # Both long polls are held (the server watches the key for them and the stream).
        watched = server.app.state.credential_watch._watched
        helpers.wait_for(lambda: sum(entry[0] for c, entry in watched.items() if c.kind == "key") == 4, 30,
                         "the two long polls to be held")
        time.sleep(1.0)
        early = [(r.status, r.answer, r.error, len(r.events)) for r in readers if r.ended_at is not None]
        assert not early, f"ended before the key was revoked: {early}"

        revoked_at = _revoke(data_dir, key)
        for reader in (bearer, dashboard, future_poll, session_poll):
            reader.join(CUT_WITHIN_S)
        cut = {name: None if r.ended_at is None else round(r.ended_at - revoked_at, 2) for name, r in
               {"bearer": bearer, "dashboard": dashboard, "retrieve_future": future_poll,
                "retrieve_futures": session_poll}.items()}
        print("ended this many seconds after the revocation:", cut)
        assert all(v is not None and v < CUT_WITHIN_S for v in cut.values()), cut
        assert server.app.state.store.get_job(job_id).status == "running"  # the job did not end them

        for stream in (bearer, dashboard):
            assert stream.error is None, stream.error  # a clean end of the stream, not a broken connection
            assert [e for e in stream.events if e[0] > stream.ended_at] == []
            assert not any(e[1]["event"] == "status" and '"completed"' in e[1]["data"] for e in stream.events)
        for poll in (future_poll, session_poll):
            assert poll.error is None, poll.error
            assert poll.answer["error"].startswith("the API key was revoked"), poll.answer
        # Reconnecting with the revoked key, or its dashboard session, is refused.
        resumed = httpx.get(events_url, headers={"Authorization": f"Bearer {key}"}, trust_env=False)
        assert resumed.status_code == 401 and resumed.json()["error"].startswith("invalid or revoked API key")
        assert httpx.get(events_url, cookies={"ot_session": cookie}, trust_env=False).status_code == 401
        assert raw.post("/retrieve_future", json={"request_id": request_id}).status_code == 401

        # The same job's stream under the user's other key goes on delivering.
        seen = len(kept.events)
        helpers.wait_for(lambda: len(kept.events) >= seen + 2, 30, "more events on the unrevoked key's stream")
        assert kept.ended_at is None
    finally:
        with server.client(other_key) as client:
            client.post(f"/v1/jobs/{job_id}/cancel")
        raw.close()
        for reader in readers:
            reader.join(60)
        with httpx.Client(base_url=server.url + "/api/v1", headers={"X-API-Key": "tml-" + other_key},
                          trust_env=False) as owner:
            owner.post("/unload_model", json={"model_id": training.model_id})
    # Every stream and poll let go of what it held: nothing is left watched.
    helpers.wait_for(lambda: not server.app.state.credential_watch._watched, 15, "the watch to be empty")
