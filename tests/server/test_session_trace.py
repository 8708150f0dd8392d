"""``RestClient.export_session_trace`` through the official ``tinker`` SDK against a real
server on 127.0.0.1: a session's calls come back, in order, as Chrome trace-event JSON behind
a signed link that needs no key and refuses an altered or expired one; another user cannot
export it (404, and the owner's audit log says who asked); an admin can. And the trace
table's bounds."""

from __future__ import annotations

import asyncio
import os
import time

import httpx
import pytest

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

from opentinker.server.store import Store  # noqa: E402
from opentinker.server.tinker.state import TinkerState  # noqa: E402
from opentinker.server.tinker.traces import TraceLog, TraceRow, chrome_trace  # noqa: E402

os.environ.setdefault("TINKER_TELEMETRY", "0")
TINY = "opentinker-tiny-arith"
TOKENS = [1, 5, 9, 12, 40, 41, 42, 43, 17, 99, 310, 7]


def _datum() -> types.Datum:
    return types.Datum(model_input=types.ModelInput.from_ints(TOKENS[:-1]),
                       loss_fn_inputs={"target_tokens": TOKENS[1:], "weights": [1.0] * (len(TOKENS) - 1)})


def _get(url: str, **kwargs) -> httpx.Response:
    return httpx.get(url, timeout=30, trust_env=False, **kwargs)


def test_a_sessions_calls_export_in_order_behind_a_signed_link(server, keys, data_dir, helpers):
    service = tinker.ServiceClient(base_url=server.url, api_key="tml-" + keys["alice"])
    training = service.create_lora_training_client(base_model=TINY, rank=4).result()
    for _ in range(2):
        training.forward_backward([_datum()], "cross_entropy").result()
        training.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    sampler = training.save_weights_and_get_sampling_client().result()
    sampler.sample(prompt=types.ModelInput.from_ints(TOKENS[:4]), num_samples=2,
                   sampling_params=types.SamplingParams(max_tokens=4, seed=1)).result()
    session_id = training.model_id.split(":train:")[0]

    rest = tinker.RestClient(base_url=server.url, api_key="tml-" + keys["alice"])
    url = rest.export_session_trace(session_id).result()
    answer = _get(url)  # no key: the signature is the permission
    assert answer.status_code == 200, answer.text
    trace = answer.json()
    calls = [event for event in trace["traceEvents"] if event["ph"] == "X"]
    assert [event["name"] for event in calls] == ["create_model", "forward_backward", "optim_step",
                                                  "forward_backward", "optim_step", "save_weights_for_sampler",
                                                  "sample"]
    assert all(event["dur"] >= 0 and event["args"]["status"] == "done" for event in calls)
    tracks = {event["tid"]: event["args"]["name"] for event in trace["traceEvents"] if event["name"] == "thread_name"}
    training_calls = [event for event in calls if event["name"] != "sample"]
    assert {event["tid"] for event in training_calls} == {1} and tracks[1] == f"model {training.model_id}"
    assert tracks[calls[-1]["tid"]] == "sampling"
    for before, after in zip(training_calls, training_calls[1:]):  # one after another on the model's track
        assert before["ts"] + before["dur"] <= after["ts"]
    assert calls[1]["args"]["datums"] == 1 and calls[1]["args"]["tokens"] == len(TOKENS) - 1
    assert calls[-1]["args"]["prompt_tokens"] == 4 and calls[-1]["args"]["num_samples"] == 2
    assert calls[-1]["ts"] >= calls[-2]["ts"] + calls[-2]["dur"]  # sampled from the snapshot once it was saved

    # The deprecated async spelling gives a link of its own to the same trace.
    async def export_async() -> str:
        with pytest.warns(FutureWarning):
            return await rest.export_session_trace_async(session_id)

    assert _get(asyncio.run(export_async())).json()["traceEvents"] == trace["traceEvents"]

    # Altered (path, expiry or signature) or expired: 403, saying which; unsigned: 401.
    path, query = url.split("?")
    expires, signature = (part.split("=")[1] for part in query.split("&"))
    altered = [f"{path}?expires={int(expires) + 3600}&signature={signature}",
               f"{path}?expires={expires}&signature={signature[:-1]}{'0' if signature[-1] != '0' else '1'}",
               url.replace(session_id, "0" * len(session_id))]
    for link in altered:
        refused = _get(link)
        assert refused.status_code == 403 and "link" in refused.json()["error"], (link, refused.text)
    unsigned = _get(path)
    assert unsigned.status_code == 401 and "signed link" in unsigned.json()["error"], unsigned.text
    svc = server.app.state.tinker
    stale, _ = svc.signer.sign(f"/api/v1/session_traces/{session_id}", 60, now=time.time() - 3600)
    expired = _get(server.url + stale)
    assert expired.status_code == 403 and "expired" in expired.json()["error"]
    service.close("success").result()


def test_another_user_cannot_export_a_session_and_an_admin_can(server, keys, data_dir, helpers):
    service = tinker.ServiceClient(base_url=server.url, api_key="tml-" + keys["alice"])
    training = service.create_lora_training_client(base_model=TINY, rank=4).result()
    session_id = training.model_id.split(":train:")[0]
    with httpx.Client(base_url=server.url, timeout=30, trust_env=False) as raw:
        def export(key: str, session: str = session_id) -> httpx.Response:
            return raw.get(f"/api/v1/sessions/{session}/trace_export", headers={"X-API-Key": "tml-" + key})

        theirs, missing = export(keys["bob"]), export(keys["bob"], "f" * 32)
        assert theirs.status_code == missing.status_code == 404
        assert theirs.json()["error"] == missing.json()["error"].replace("f" * 32, session_id)
        with pytest.raises(tinker.NotFoundError):
            tinker.RestClient(base_url=server.url, api_key="tml-" + keys["bob"]).export_session_trace(
                session_id).result()

        with pytest.warns(FutureWarning):
            log = tinker.RestClient(base_url=server.url, api_key="tml-" + keys["alice"]).get_audit_log().result()
        denied = [e for e in log.entries if e.event == "access_denied"
                  and e.event_details.get("resource") == f"session:{session_id}"]
        assert len(denied) == 2 and {e.event_details["asker"] for e in denied} == {"bob"}
        assert {e.event_details["action"] for e in denied} == {"trace_export"}

        admin = helpers.make_user(data_dir, "trace-admin")
        store = Store(data_dir / "opentinker.db")
        store.set_admin("trace-admin", True)
        store.close()
        ready = export(admin)
        assert ready.status_code == 200 and ready.json()["status"] == "ready"
        names = [e["name"] for e in _get(ready.json()["url"]).json()["traceEvents"] if e["ph"] == "X"]
        assert names == ["create_model"]
    service.close("success").result()


def test_the_trace_table_is_bounded_and_forgets_forgotten_sessions(tmp_path):
    store = Store(tmp_path / "traces.db")
    try:
        state = TinkerState(store, keep_ended_sessions=1)
        store.create_user("u")  # id 1
        traces = TraceLog(store, max_per_session=3, max_rows=4)
        for session in ("s1", "s2"):
            state.create_session(session, 1, [], {})
        for i in range(5):
            with store.transaction() as conn:
                traces.submitted(conn, f"r{i}", "s1", 1, "OptimStep", "s1:train:0", float(i))
        assert [row.request_id for row in traces.rows("s1")] == ["r2", "r3", "r4"]  # the newest 3 of s1
        with store.transaction() as conn:
            traces.submitted(conn, "q0", "s2", 1, "Sample", None, 10.0)
            traces.submitted(conn, "q1", "s2", 1, "Sample", None, 11.0)
        traces.forget_orphans(every_s=0)
        assert len(traces.rows("s1") + traces.rows("s2")) == 4  # the newest 4 over all sessions
        state.end_session("s1", "finished")
        state.end_session("s2", "finished")
        state.create_session("s3", 1, [], {})  # keeps 1 ended session: s1 is forgotten
        traces.forget_orphans(every_s=0)
        assert traces.rows("s1") == [] and [row.request_id for row in traces.rows("s2")] == ["q0", "q1"]
    finally:
        store.close()


def test_overlapping_samples_take_lanes_and_a_models_calls_never_overlap():
    rows = [TraceRow("a", "s", "ForwardBackward", "m", 0.0, 0.0, 2.0, "done", {}),
            TraceRow("b", "s", "OptimStep", "m", 0.5, 1.0, 3.0, "done", {}),  # handed over while "a" ran
            TraceRow("c", "s", "Sample", None, 0.0, 0.0, 2.0, "done", {}),
            TraceRow("d", "s", "Sample", None, 1.0, 1.0, 1.5, "failed", {}),
            TraceRow("e", "s", "Sample", None, 2.5, None, None, "pending", {})]
    events = [e for e in chrome_trace("s", rows, now=4.0)["traceEvents"] if e["ph"] == "X"]
    assert [(e["name"], e["tid"], e["ts"], e["dur"]) for e in events] == [
        ("forward_backward", 1, 0, 2_000_000), ("optim_step", 1, 2_000_000, 1_000_000),
        ("sample", 1000, 0, 2_000_000), ("sample", 1001, 1_000_000, 500_000), ("sample", 1000, 2_500_000, 1_500_000)]
    assert events[1]["args"]["queued_ms"] == 1500.0 and events[4]["args"]["status"] == "pending"
