"""A large dataset upload is read, decoded, validated and stored off the event loop: other
requests are answered while it is processed (a real server on 127.0.0.1)."""

from __future__ import annotations

import hashlib
import json
import threading
import time

from opentinker.environments.arithmetic import make_problems
from opentinker.server import large_json
from opentinker.server.store import Store, spec_digest

CHUNK = 1 << 20


def dataset_json(mib: float) -> tuple[bytes, int, dict]:
    """A job body of about ``mib`` MiB whose rows each carry 60 small objects (which training
    ignores): the costly kind to decode, while the per-row checks stay few. Made as text, so
    the test's own process (which the server shares) holds no copy of the rows as objects.
    Returns the body, its number of rows and its last row."""
    problems = [p.as_row() for p in make_problems(1000, seed=11)]
    row_size = len(json.dumps({**problems[0], "extra_info": {"steps": [{"k": j} for j in range(60)], "i": 0}}))
    count = int(mib * 2**20 / row_size)
    rows = [json.dumps({**problems[i % len(problems)], "extra_info": {"steps": [{"k": j} for j in range(60)], "i": i}})
            for i in range(count)]
    body = '{"name": "big-upload", "config": {"trainer.total_training_steps": 1}, "dataset": [' + ", ".join(rows) + "]}"
    return body.encode(), count, json.loads(rows[-1])


def test_large_json_writes_what_json_writes():
    value = {"b": [1, 2.5, None, {"z": "é", "a": [True, "\ud7ff"]}], "a": {"y": [], "x": {}}, "c": "text", "d": []}
    for options in ({}, {"sort_keys": True, "separators": (",", ":")}):
        assert "".join(large_json.dumps_chunks(value, **options)) == json.dumps(value, **options)
    assert large_json.loads(json.dumps(value).encode()) == value
    # The idempotency digest is the one stored by earlier servers (one json.dumps of the body).
    earlier = hashlib.sha256(json.dumps(value, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    assert spec_digest(value) == earlier


def send_while_polling_health(live, key: str, path: str, body: bytes) -> tuple:
    """POSTs ``body`` to ``path`` in 1 MiB chunks while another connection asks ``/v1/health``
    back to back. Returns the answer, the seconds from sending to the answer, and the longest
    health request; asserts health requests sent after the whole body were answered before it
    (so the server was not stuck on it)."""
    sent = threading.Event()  # the last byte of the body has been handed to the connection

    def chunks():
        for start in range(0, len(body), CHUNK):
            yield body[start:start + CHUNK]
        sent.set()

    upload: dict = {}

    def send() -> None:
        with live.client(key) as client:
            started = time.monotonic()
            upload["response"] = client.post(path, content=chunks(), headers={"Content-Type": "application/json"},
                                             timeout=300)
            upload["started"], upload["ended"] = started, time.monotonic()

    health: list[tuple[float, float, bool]] = []  # (asked, answered, asked after the whole body was sent)
    thread = threading.Thread(target=send)
    with live.client() as anonymous:
        thread.start()
        while thread.is_alive():
            after_body, asked = sent.is_set(), time.monotonic()
            assert anonymous.get("/v1/health").status_code == 200
            health.append((asked, time.monotonic(), after_body))
    thread.join()
    during = [(asked, answered) for asked, answered, after_body in health if after_body and answered < upload["ended"]]
    assert during, "no health request was answered while the upload was processed"
    processing = upload["ended"] - upload["started"]
    longest = max(answered - asked for asked, answered, _ in health)
    print(f"{path}: {len(body) / 2**20:.1f} MiB in {processing:.2f} s; {len(health)} health requests meanwhile "
          f"({len(during)} after the body), longest {longest * 1000:.0f} ms")
    return upload["response"], processing, longest


def test_other_requests_are_answered_while_a_large_dataset_is_processed(start_server, tmp_path, helpers):
    live = start_server(tmp_path)
    key = helpers.make_user(tmp_path, "uploader")
    body, count, last_row = dataset_json(21)
    assert len(body) > 20 * 2**20
    response, processing, longest = send_while_polling_health(live, key, "/v1/jobs", body)
    assert response.status_code == 201, response.text[:500]
    # The event loop's longest stall, seen from outside: much shorter than the processing
    # (on the loop, decoding and validating alone stalled it for most of it).
    assert longest < processing / 5, (longest, processing)

    job_id = response.json()["job_id"]
    helpers.wait_status(live.client(key), job_id, "completed")
    store = Store(tmp_path / "opentinker.db")
    try:
        stored = store.job_data(job_id)["dataset"]
        assert len(stored) == count and stored[-1] == last_row
    finally:
        store.close()


def test_a_large_step_push_is_read_off_the_loop(start_server, tmp_path, helpers):
    """A client-mode step of 4,096 rows (about 15 MiB, each row's extra_info heavy) is decoded
    and validated in a worker thread: health is answered meanwhile, and the push's own answer
    (409: step 1 comes first) is given only after the whole body was checked."""
    live = start_server(tmp_path)
    key = helpers.make_user(tmp_path, "pusher")
    job_id = helpers.create_job(live.client(key), "big step", mode="client", steps=3)
    row = json.dumps({"prompt": [{"role": "user", "content": "1+1="}], "reward_model": {"ground_truth": "2"},
                      "extra_info": {"steps": [{"k": j} for j in range(320)]}})
    body = ('{"step": 2, "rows": [' + ", ".join([row] * 4096) + "]}").encode()
    assert len(body) > 15 * 2**20
    response, processing, longest = send_while_polling_health(live, key, f"/v1/jobs/{job_id}/steps", body)
    assert response.status_code == 409 and "expected step 1" in response.json()["error"], response.text[:300]
    assert longest < processing / 5, (longest, processing)
    with live.client(key) as client:
        assert client.post(f"/v1/jobs/{job_id}/steps", content=b'{"step": 1,',
                           headers={"Content-Type": "application/json"}).status_code == 422
        client.post(f"/v1/jobs/{job_id}/cancel")


def test_a_job_body_read_off_the_loop_is_refused_as_fastapi_would(alice):
    def refusal(**request) -> str:
        response = alice.post("/v1/jobs", **request)
        assert response.status_code == 422, response.text
        return response.json()["error"]

    assert refusal(content=b'{"name": "x",', headers={"Content-Type": "application/json"}) == (
        "body[13]: JSON decode error")
    assert refusal(content=b"") == "body: Field required"
    assert refusal(content=b"\xff\xfe{", headers={"Content-Type": "application/json"}).startswith(
        "request body: not valid JSON")
    assert refusal(content=b'{"name": "x"}', headers={"Content-Type": "text/plain"}).startswith("body: Input should be")
    assert refusal(json={"dataset": [{"prompt": "p"}, 7]}) == "body.dataset[1]: Input should be a valid dictionary"
    assert refusal(json={"mode": "server", "surprise": 1}) == "body.surprise: Extra inputs are not permitted"
