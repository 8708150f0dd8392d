"""The Tinker API under hostile clients (issue 18): each audit request, sent as it was to a
real server on 127.0.0.1 with real model actors, is refused at submit with a 4xx naming what
is wrong, and the server's memory (this process: the servers run in a thread here) stays put.

- tensors: a sparse or oversized ``weights`` never makes the server allocate its claimed
  shape, and a body of millions of tiny messages is refused before it is parsed;
- datums past the model's context are refused at submit and, behind that, in the worker;
- sessions, their tags and metadata, and samplers are bounded; listing them is paginated;
- seq ids far ahead (or behind) are refused; queues of waiting requests are capped (429);
- the server admits models up to its own cap and memory budget, whoever asks (429);
- edge values (negative shapes, seq ids past int64) are 4xx and the connection stays usable.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

tinker = pytest.importorskip("tinker")
psutil = pytest.importorskip("psutil")

from opentinker.server.tinker import wire  # noqa: E402

pb = wire.pb
TINY = "opentinker-tiny-arith"
PROTO = {"Content-Type": "application/x-protobuf"}
MiB = 2**20
RSS_BOUND = 50 * MiB


@contextlib.contextmanager
def peak_rss_growth() -> Iterator[list[int]]:
    """``[growth]``: the most this process's resident memory rose above its level at entry
    while the block ran (sampled every 2 ms), in bytes."""
    process = psutil.Process()
    start = process.memory_info().rss
    peak = [start]
    done = threading.Event()

    def watch():
        while not done.is_set():
            peak[0] = max(peak[0], process.memory_info().rss)
            time.sleep(0.002)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    result = [0]
    try:
        yield result
    finally:
        done.set()
        watcher.join()
        result[0] = max(peak[0], process.memory_info().rss) - start


def _raw(url: str, key: str) -> httpx.Client:
    return httpx.Client(base_url=url + "/api/v1", headers={"X-API-Key": "tml-" + key}, timeout=120,
                        trust_env=False)


def _many(send, count: int) -> list[httpx.Response]:
    """``send(i)`` for i < count, 16 at a time (each round trip here waits ~40 ms on the network)."""
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        return list(pool.map(send, range(count)))


def _result(raw: httpx.Client, request_id: str, timeout: float = 300) -> httpx.Response:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        answer = raw.post("/retrieve_future", json={"request_id": request_id})
        if not (answer.headers["content-type"].startswith("application/json") and answer.json().get("type") == "try_again"):
            return answer
    raise TimeoutError(f"future {request_id} did not finish in {timeout} s")


def _session(raw: httpx.Client) -> str:
    answer = raw.post("/create_session", json={"tags": [], "sdk_version": "raw"})
    assert answer.status_code == 200, answer.text
    return answer.json()["session_id"]


def _create_model(raw: httpx.Client, session_id: str, seq: int = 0, lora: bool = True) -> httpx.Response:
    body = {"session_id": session_id, "model_seq_id": seq, "base_model": TINY}
    if lora:
        body["lora_config"] = {"rank": 4}
    return raw.post("/create_model", json=body)


def _ready_model(raw: httpx.Client, session_id: str, seq: int = 0) -> str:
    created = _create_model(raw, session_id, seq)
    assert created.status_code == 200, created.text
    answer = _result(raw, created.json()["request_id"])
    assert answer.status_code == 200 and "model_id" in answer.json(), answer.text
    return answer.json()["model_id"]


def _datum(message: pb.ForwardBackwardRequest, tokens: int) -> pb.Datum:
    """A cross-entropy datum of ``tokens`` input tokens (ids 1..) with next-token targets."""
    datum = message.data.add()
    ids = np.arange(1, tokens + 2, dtype=np.int64) % 1000 + 1
    datum.model_input.add().encoded_text.tokens = ids[:-1].astype(np.int32).tobytes()
    datum.loss_fn_inputs["target_tokens"].CopyFrom(pb.Tensor(dense=ids[1:].tobytes(), dtype=pb.DTYPE_INT64,
                                                             shape=[tokens]))
    return datum


def _fb_body(model_id: str, seq_id: int, tokens: int = 5, weights: pb.Tensor | None = None) -> bytes:
    message = pb.ForwardBackwardRequest(model_id=model_id, seq_id=seq_id, loss_fn="cross_entropy")
    datum = _datum(message, tokens)
    datum.loss_fn_inputs["weights"].CopyFrom(weights if weights is not None else pb.Tensor(
        dense=np.ones(tokens, np.float32).tobytes(), dtype=pb.DTYPE_FLOAT32, shape=[tokens]))
    return message.SerializeToString()


def _sparse_weights(shape: list[int], body_mib: float = 6) -> pb.Tensor:
    """The audit's tensor: float32 sparse CSR, one row holding about ``body_mib`` MiB of entries."""
    count = int(body_mib * MiB) // 12  # 4 bytes of value + 8 of column index each
    return pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=shape, sparse_csr=pb.SparseCsr(
        values=np.ones(count, np.float32).tobytes(), crow_indices=np.array([0, count], np.int64).tobytes(),
        col_indices=np.arange(count, dtype=np.int64).tobytes()))


@pytest.fixture(scope="module")
def tiny_lora(server, keys) -> Iterator[str]:
    """A LoRA model of alice's on the shared server (its session finished at the end)."""
    with _raw(server.url, keys["alice"]) as raw:
        session_id = _session(raw)
        try:
            yield _ready_model(raw, session_id)
        finally:
            raw.post(f"/sessions/{session_id}/finish", json={"reason": {"type": "success"}})


def _store_bytes(data_dir: Path) -> int:
    """The SQLite store on disk: the file and its write-ahead log."""
    return sum(path.stat().st_size for path in data_dir.glob("opentinker.db*"))


def _next_seq(server, model_id: str) -> int:
    return server.app.state.tinker.host.slot(model_id).next_seq


# -- 1. tensors -------------------------------------------------------------------------------


def test_sparse_and_oversized_tensors_are_refused_before_anything_is_allocated(server, keys, tiny_lora):
    sparse = "data[0].loss_fn_inputs['weights']: a sparse (CSR) tensor is not accepted"
    cases = [  # (body, what the 400 says)
        (_fb_body(tiny_lora, 1, weights=_sparse_weights([1, 536870912])), sparse),  # 2 GiB once dense
        (_fb_body(tiny_lora, 1, weights=_sparse_weights([1, 2**33])), sparse),  # 32 GiB: was a MemoryError (500)
        (_fb_body(tiny_lora, 1, weights=pb.Tensor(dense=np.ones(5, np.float32).tobytes(), dtype=pb.DTYPE_FLOAT32,
                                                  shape=[1, 536870912])),
         "data[0].loss_fn_inputs['weights']: shape [1, 536870912], expected [5] (one value per model input token)"),
        # 8 MiB of empty datums: about 230 MB once parsed, were it parsed.
        (pb.ForwardBackwardRequest(model_id=tiny_lora, seq_id=1, loss_fn="cross_entropy").SerializeToString()
         + b"\x1a\x00" * (4 * MiB), "forward_backward: the body is not a ForwardBackwardRequest protobuf "
                                    "(the body holds more than 262144 fields, messages and repeated values)"),
    ]
    growths = []
    with _raw(server.url, keys["alice"]) as raw:
        raw.post("/forward_backward", content=b"\xff" * MiB, headers=PROTO)  # the first read's buffers
        for body, message in cases:
            with peak_rss_growth() as growth:
                answer = raw.post("/forward_backward", content=body, headers=PROTO)
            assert answer.status_code == 400, answer.text
            assert answer.json()["error"].startswith(message), answer.text
            growths.append(growth[0])
    # What remains is the body itself, held by both the client and the server (this process).
    print("peak RSS growth per request (MiB):", [round(g / MiB, 1) for g in growths],
          "bodies (MiB):", [round(len(body) / MiB, 1) for body, _ in cases])
    assert max(growths) < RSS_BOUND
    assert server.app.state.tinker.host.slot(tiny_lora).pending == 0


def test_zstd_bodies_small_and_large_are_read_and_a_zstd_bomb_is_refused_at_the_limit(server, keys, tiny_lora):
    import zstandard

    compress = zstandard.ZstdCompressor().compress
    zstd = {**PROTO, "Content-Encoding": "zstd"}
    limit = server.app.state.settings.max_body_bytes
    with _raw(server.url, keys["alice"]) as raw:
        seq = _next_seq(server, tiny_lora)
        small = _fb_body(tiny_lora, seq)  # read on the event loop
        large = pb.ForwardBackwardRequest.FromString(_fb_body(tiny_lora, seq + 1, tokens=1000))
        large.data.extend([large.data[0]] * 3)  # 4 x 16 kB once decompressed: read off the loop
        assert len(small) < 32 * 1024 < len(large.SerializeToString()) < limit
        for body in (small, large.SerializeToString()):
            sent = raw.post("/forward_backward", content=compress(body), headers=zstd)
            assert sent.status_code == 200, sent.text
            done = _result(raw, sent.json()["request_id"])
            assert done.headers["content-type"] == "application/x-protobuf", done.text

        compressor = zstandard.ZstdCompressor().compressobj()  # 8 x the limit of zeros, in a few kB
        bomb_body = b"".join(compressor.compress(bytes(MiB)) for _ in range(8 * limit // MiB)) + compressor.flush()
        with peak_rss_growth() as growth:
            bomb = raw.post("/forward_backward", content=bomb_body, headers=zstd)
        assert bomb.status_code == 413, bomb.text
        assert bomb.json()["error"] == f"the decompressed body is over {limit} bytes"
        assert growth[0] < limit + RSS_BOUND  # read up to the limit, not the 8 x limit it holds
        garbled = raw.post("/forward_backward", content=b"not zstd at all", headers=zstd)
        assert garbled.status_code == 400 and "the body is not valid zstd" in garbled.json()["error"], garbled.text
    assert server.app.state.tinker.host.slot(tiny_lora).pending == 0


# -- 2. datums past the context -----------------------------------------------------------------


def test_a_datum_longer_than_the_context_is_refused_at_submit_and_in_the_worker(server, keys, tiny_lora,
                                                                               monkeypatch):
    long_datum = _fb_body(tiny_lora, 1, tokens=4000)
    with _raw(server.url, keys["alice"]) as raw:
        answer = raw.post("/forward_backward", content=long_datum, headers=PROTO)
        assert answer.status_code == 400, answer.text
        assert answer.json()["error"] == ("data[0]: 4000 model input tokens (plus the last target: 4001 positions) "
                                          "are more than the model's context of 1024 tokens; at most 1023 input "
                                          "tokens")
        # The longest datum that fits is taken.
        seq = _next_seq(server, tiny_lora)
        fits = raw.post("/forward_backward", content=_fb_body(tiny_lora, seq, tokens=1023), headers=PROTO)
        assert fits.status_code == 200, fits.text
        assert _result(raw, fits.json()["request_id"]).headers["content-type"] == "application/x-protobuf"

        # Were the API unable to tell the context, the worker refuses it: a user error of the future.
        monkeypatch.setattr(server.app.state.tinker, "context_length", lambda base_model: None)
        sent = raw.post("/forward_backward", content=_fb_body(tiny_lora, seq + 1, tokens=4000), headers=PROTO)
        assert sent.status_code == 200, sent.text
        failed = _result(raw, sent.json()["request_id"]).json()
        assert failed["category"] == "user"
        assert failed["error"].startswith("data[0]: 4000 model input tokens (plus the last target: 4001 positions) "
                                          "are more than the model's context of 1024 tokens")


# -- 3. sessions, their tags and metadata, samplers ----------------------------------------------


def test_sessions_tags_metadata_and_samplers_are_bounded_and_listed_by_page(start_server, tmp_path, helpers):
    live = start_server(tmp_path)
    key = helpers.make_user(tmp_path, "carol")
    big = "x" * (5 * MiB)
    with _raw(live.url, key) as raw:
        size_before = _store_bytes(tmp_path)
        # The audit: 10 sessions with 5 MiB of tags or metadata...
        for index in range(10):
            body = {"tags": [big]} if index % 2 else {"tags": [], "user_metadata": {"notes": big}}
            answer = raw.post("/create_session", json=body)
            assert answer.status_code == 422, answer.text
            assert answer.json()["error"].startswith("body.tags[0]: String should have at most 256 characters"
                                                     if index % 2 else "body.user_metadata: Value error, at most "
                                                     "4096 bytes as JSON")
        answer = raw.post("/create_session", json={"tags": ["t"] * 65})
        assert answer.status_code == 422 and "body.tags: List should have at most 64 items" in answer.json()["error"]
        # ... and 2,000 more: the 32 a user may hold open are made, the rest refused at once.
        statuses = [a.status_code for a in _many(lambda _: raw.post("/create_session", json={"tags": ["audit"]}),
                                                   2000)]
        assert statuses.count(200) == 32 and statuses.count(400) == 1968
        refused = raw.post("/create_session", json={"tags": []}).json()["error"]
        assert refused.startswith("you have 32 active sessions, the most this server allows per user")
        assert _store_bytes(tmp_path) - size_before < MiB

        # Listing is paginated, newest first; the SDK reads the page.
        first = raw.get("/sessions", params={"limit": 5}).json()
        assert len(first["sessions"]) == 5 and first["cursor"] == {"offset": 0, "limit": 5, "total_count": 32}
        assert raw.get("/sessions", params={"limit": 1001}).status_code == 422
        rest = tinker.RestClient(base_url=live.url, api_key="tml-" + key)
        page = rest.list_sessions(limit=5, offset=5).result()
        assert len(page.sessions) == 5 and not set(page.sessions) & set(first["sessions"])

        # user_metadata is bounded on models and checkpoints too (refused before anything starts).
        session_id = first["sessions"][0]
        fat = {"k": "v" * 5000}
        for path, body in [("/create_model", {"session_id": session_id, "model_seq_id": 0, "base_model": TINY}),
                           ("/save_weights", {"model_id": f"{session_id}:train:0", "path": "c", "seq_id": 1}),
                           ("/load_weights", {"session_id": session_id, "model_seq_id": 0, "path": "tinker://a/weights/c"})]:
            answer = raw.post(path, json={**body, "user_metadata": fat})
            assert answer.status_code == 422 and "body.user_metadata" in answer.json()["error"], (path, answer.text)

        # Samplers: a session keeps its newest ones (an RL loop makes one every step).
        def sampler(session: str, seq: int) -> str:
            answer = raw.post("/create_sampling_session", json={"session_id": session, "base_model": TINY,
                                                                 "sampling_session_seq_id": seq})
            assert answer.status_code == 200, answer.text
            return answer.json()["sampling_session_id"]

        state = live.app.state.tinker.state
        state.samplers_per_session = 3
        samplers = [sampler(session_id, seq) for seq in range(5)]
        assert raw.get(f"/sessions/{session_id}").json()["sampler_ids"] == samplers[2:]
        assert raw.get(f"/samplers/{samplers[0]}").status_code == 404
        oldest = raw.get("/sessions", params={"limit": 1, "offset": 31}).json()["sessions"][0]
        old_sampler = sampler(oldest, 0)

        # Ended sessions beyond the newest kept ones are forgotten, with their samplers.
        state.keep_ended_sessions = 4
        for ended in raw.get("/sessions", params={"limit": 1000}).json()["sessions"]:
            assert raw.post(f"/sessions/{ended}/finish", json={}).status_code == 204
        for _ in range(3):
            _session(raw)
        assert raw.get("/sessions").json()["cursor"]["total_count"] == 3 + 4
        assert live.app.state.store.query("SELECT COUNT(*) AS n FROM tinker_sessions")[0]["n"] == 3 + 4
        assert raw.get(f"/samplers/{old_sampler}").status_code == 404
        assert raw.get(f"/samplers/{samplers[-1]}").status_code == 200  # a kept session's


# -- 4. seq ids and queues ------------------------------------------------------------------------


def _optim(raw: httpx.Client, model_id: str, seq_id: int, **extra) -> httpx.Response:
    return raw.post("/optim_step", json={"model_id": model_id, "seq_id": seq_id, "type": "optim_step",
                                         "adam_params": {"learning_rate": 0.0}, **extra})


def test_seq_ids_far_ahead_or_behind_are_refused_and_queues_are_capped(server, keys, tiny_lora, monkeypatch):
    svc = server.app.state.tinker
    slot = svc.host.slot(tiny_lora)
    with _raw(server.url, keys["alice"]) as raw:
        # The audit: 3,000 optim_steps numbered 1,000,000 + i would wait for the model's life.
        with peak_rss_growth() as growth:
            answers = _many(lambda i: _optim(raw, tiny_lora, 1_000_000 + i), 3000)
        assert {a.status_code for a in answers} == {400}
        assert answers[0].json()["error"].startswith(f"seq_id 1000000 is too far ahead: model {tiny_lora} runs")
        assert slot.pending == 0 and svc.futures.pending_count(slot.user_id, "OptimStep") == 0
        print(f"peak RSS growth over 3,000 far-ahead optim_steps: {growth[0] / MiB:.1f} MiB")

        # A full queue answers 429 with Retry-After; a re-sent request still gets its future, and
        # the number the queue waits for is always taken.
        monkeypatch.setattr(svc.settings, "max_queued_per_model", 3)
        n = slot.next_seq
        waiting = [_optim(raw, tiny_lora, n + i) for i in (1, 2, 3)]  # wait for n
        assert [a.status_code for a in waiting] == [200, 200, 200]
        full = _optim(raw, tiny_lora, n + 4)
        assert full.status_code == 429 and full.headers["retry-after"] == "1"
        assert f"model {tiny_lora} has 3 requests waiting or running" in full.json()["error"]
        assert _optim(raw, tiny_lora, n + 1).json()["request_id"] == waiting[0].json()["request_id"]
        first = _optim(raw, tiny_lora, n)
        assert first.status_code == 200
        for answer in [first, *waiting]:
            assert "metrics" in _result(raw, answer.json()["request_id"]).json()
        assert _optim(raw, tiny_lora, n + 4).status_code == 200  # the SDK's retry of the 429

        # The same per user, over all of the user's models.
        monkeypatch.setattr(svc.settings, "max_queued_per_model", 256)
        monkeypatch.setattr(svc.settings, "max_queued_per_user", 2)
        assert _result(raw, _optim(raw, tiny_lora, n + 4).json()["request_id"]).status_code == 200
        n = slot.next_seq
        assert [_optim(raw, tiny_lora, n + i).status_code for i in (1, 2)] == [200, 200]
        over = _optim(raw, tiny_lora, n + 3)
        assert over.status_code == 429 and "the most this server queues per user" in over.json()["error"]
        assert _optim(raw, tiny_lora, n).status_code == 200
        monkeypatch.setattr(svc.settings, "max_queued_per_user", 1024)

        # A number refused at submit is passed over; sent again once the model has gone past it,
        # it is refused (it would run out of order), while an old number gets its first future.
        n = n + 3
        bad = _optim(raw, tiny_lora, n, adam_params=None, optimizer_params={"type": "dimuon"})
        assert bad.status_code == 400
        after = _optim(raw, tiny_lora, n + 1)
        _result(raw, after.json()["request_id"])
        late = _optim(raw, tiny_lora, n)
        assert late.status_code == 400 and late.json()["error"].startswith(f"seq_id {n} is behind model")
        assert _optim(raw, tiny_lora, n + 1).json()["request_id"] == after.json()["request_id"]
        assert slot.pending == 0


# -- 5. server-wide admission ---------------------------------------------------------------------


def test_the_server_admits_models_up_to_its_cap_and_memory_budget_whoever_asks(start_server, tmp_path, helpers):
    from opentinker.tiny import tiny_model_dir

    from opentinker.server.policy import ServedModel
    from opentinker.server.tinker.model_facts import estimated_adapter_bytes, read_model_facts

    weights = (tiny_model_dir() / "model.safetensors").stat().st_size
    adapter = estimated_adapter_bytes(read_model_facts(ServedModel(TINY, None)), 4)
    assert 0 < adapter < weights / 4
    # LoRA models share one copy of the base (1.25 x the weights, held once) and each adds its
    # adapter and optimizer state: room for the base and two rank-4 adapters, not three, and
    # never a fully fine-tuned model (4 x the weights); beside the sampler's adapter cache (1 MiB
    # for the one served model), which the budget keeps.
    live = start_server(tmp_path, tinker_max_models=3, tinker_sampler_adapter_cache_mb=1,
                        tinker_memory_gb=(1.25 * weights + 2.5 * adapter + 2**20) / 2**30)
    carol_key, dave_key = helpers.make_user(tmp_path, "carol"), helpers.make_user(tmp_path, "dave")
    svc = live.app.state.tinker
    with _raw(live.url, carol_key) as carol, _raw(live.url, dave_key) as dave, peak_rss_growth() as growth:
        carol_session, dave_session = _session(carol), _session(dave)
        first = _create_model(carol, carol_session, 0)
        second = _create_model(dave, dave_session, 0)
        assert first.status_code == second.status_code == 200

        full_ft = _create_model(dave, dave_session, 1, lora=False)
        assert full_ft.status_code == 400
        assert "more than this server's whole Tinker memory budget" in full_ft.json()["error"]
        for raw, session_id in ((carol, carol_session), (dave, dave_session)):
            refused = _create_model(raw, session_id, 2)
            assert refused.status_code == 429 and refused.headers["retry-after"] == "10"
            assert refused.json()["error"].startswith("the server's memory for Tinker models is full")

        # The count cap, whoever asks.
        svc.settings.memory_budget_bytes = None
        svc.settings.max_models = 2
        for raw, session_id in ((carol, carol_session), (dave, dave_session)):
            refused = _create_model(raw, session_id, 2)
            assert refused.status_code == 429
            assert refused.json()["error"].startswith("the server is full: 2 Tinker models in use")

        # Once a model is unloaded the next one is admitted (and comes up).
        first_model = _result(carol, first.json()["request_id"]).json()["model_id"]
        assert carol.post("/unload_model", json={"model_id": first_model}).status_code == 200
        admitted = _create_model(dave, dave_session, 2)
        assert admitted.status_code == 200, admitted.text
        assert "model_id" in _result(dave, admitted.json()["request_id"]).json()
        assert "model_id" in _result(dave, second.json()["request_id"]).json()
        assert len(svc.host.live_models()) == 2
        for raw, session_id in ((carol, carol_session), (dave, dave_session)):
            assert raw.post(f"/sessions/{session_id}/finish", json={}).status_code == 204
    print(f"peak RSS growth of the API while admitting and refusing models: {growth[0] / MiB:.1f} MiB")
    assert growth[0] < RSS_BOUND


# -- 6. edge values -----------------------------------------------------------------------------


def test_edge_values_are_4xx_naming_the_field_and_the_connection_stays_usable(server, keys, tiny_lora):
    negative_sparse = _fb_body(tiny_lora, 1, weights=_sparse_weights([-1, -5], body_mib=0.01))
    negative_dense = _fb_body(tiny_lora, 1, weights=pb.Tensor(dense=np.ones(4, np.float32).tobytes(),
                                                              dtype=pb.DTYPE_FLOAT32, shape=[-2, -2]))
    negative_seq = _fb_body(tiny_lora, -1)
    with _raw(server.url, keys["alice"]) as raw, peak_rss_growth() as growth:
        cases = [
            (raw.post("/forward_backward", content=negative_sparse, headers=PROTO), 400,
             "data[0].loss_fn_inputs['weights']: a sparse (CSR) tensor is not accepted"),
            (raw.post("/forward_backward", content=negative_dense, headers=PROTO), 400,
             "data[0].loss_fn_inputs['weights']: shape [-2, -2] has a negative dimension; expected [5]"),
            (raw.post("/forward_backward", content=negative_seq, headers=PROTO), 400,
             "forward_backward: seq_id -1 is negative"),
            (_optim(raw, tiny_lora, 2**63), 422, "body: seq_id: 9223372036854775808 is out of range"),
            (_optim(raw, tiny_lora, 2**64 + 5), 422, "body: seq_id: 18446744073709551621 is out of range"),
            (_optim(raw, tiny_lora, 2**63 - 1), 400, f"seq_id {2**63 - 1} is too far ahead"),
            (raw.post("/save_weights", json={"model_id": tiny_lora, "path": "x", "seq_id": 1,
                                             "ttl_seconds": 2**62}), 422,
             "body.ttl_seconds: Input should be less than or equal to 3153600000"),
            (raw.post("/create_model", json={"session_id": "s", "model_seq_id": 2**63, "base_model": TINY}), 422,
             "body: model_seq_id: 9223372036854775808 is out of range"),
        ]
        for answer, status, message in cases:
            assert answer.status_code == status, answer.text
            assert answer.json()["error"].startswith(message), answer.text
            # The same keep-alive connection answers the next request.
            assert raw.post("/get_info", json={"model_id": tiny_lora}).status_code == 200
    assert growth[0] < RSS_BOUND
