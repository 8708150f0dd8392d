"""Quotas where a Tinker user could fill the machine, and snapshots by content (issue 32, parts
5 and 6), each with the audit's request against a real server on 127.0.0.1 with real model
and sampler actors:

- checkpoints per user, by count and by bytes on disk (ephemeral snapshots included), checked
  at submit by an estimate and again once written; a TTL past the operator's maximum;
- the sampler's LoRA adapter cache, bounded in bytes and reserved in the memory admission;
- LoRA rank capped per model;
- a sampler snapshot deleted and saved again under its name serves the new weights, and
  ``overwrite: true`` replaces a named one.
"""

from __future__ import annotations

import concurrent.futures
import os
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

os.environ.setdefault("TINKER_TELEMETRY", "0")
TINY = "opentinker-tiny-arith"
HUNDRED_YEARS = 100 * 365 * 86400
MiB = 2**20


def _raw(url: str, key: str) -> httpx.Client:
    return httpx.Client(base_url=url + "/api/v1", headers={"X-API-Key": "tml-" + key}, timeout=120,
                        trust_env=False)


def _result(raw: httpx.Client, request_id: str, timeout: float = 300) -> httpx.Response:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        answer = raw.post("/retrieve_future", json={"request_id": request_id})
        if not (answer.headers["content-type"].startswith("application/json")
                and answer.json().get("type") == "try_again"):
            return answer
    raise TimeoutError(f"future {request_id} did not finish in {timeout} s")


def _session(raw: httpx.Client) -> str:
    answer = raw.post("/create_session", json={"tags": [], "sdk_version": "raw"})
    assert answer.status_code == 200, answer.text
    return answer.json()["session_id"]


def _model(raw: httpx.Client, session_id: str, seq: int = 0, rank: int | None = 4) -> str:
    body = {"session_id": session_id, "model_seq_id": seq, "base_model": TINY}
    if rank is not None:
        body["lora_config"] = {"rank": rank}
    created = raw.post("/create_model", json=body)
    assert created.status_code == 200, created.text
    answer = _result(raw, created.json()["request_id"])
    assert "model_id" in answer.json(), answer.text
    return answer.json()["model_id"]


def _save_sampler(raw: httpx.Client, model_id: str, name: str | None, **extra) -> httpx.Response:
    body = {"model_id": model_id, "path": name, **extra}
    return raw.post("/save_weights_for_sampler", json=body)


def _saved(raw: httpx.Client, answer: httpx.Response) -> dict:
    assert answer.status_code == 200, answer.text
    return _result(raw, answer.json()["request_id"]).json()


def _user_bytes_on_disk(data_dir: Path) -> int:
    return sum(f.stat().st_size for f in (data_dir / "tinker").rglob("*") if f.is_file() and "offload" not in f.parts)


def _checkpoints(raw: httpx.Client) -> list[dict]:
    return raw.get("/checkpoints").json()["checkpoints"]


def _delete_all(raw: httpx.Client) -> None:
    for checkpoint in _checkpoints(raw):
        run, kind, name = checkpoint["tinker_path"].removeprefix("tinker://").split("/")
        assert raw.delete(f"/training_runs/{run}/checkpoints/{kind}/{name}").status_code == 204


# -- 1. checkpoints: count, bytes, TTL -------------------------------------------------------------


def test_a_users_checkpoints_are_bounded_in_count_and_bytes_and_a_ttl_past_the_maximum_is_refused(
        start_server, tmp_path, helpers):
    live = start_server(tmp_path, tinker_max_checkpoints=4)
    svc = live.app.state.tinker
    key = helpers.make_user(tmp_path, "carol")
    with _raw(live.url, key) as raw:
        session_id = _session(raw)
        model_id = _model(raw, session_id)

        # The audit's TTL: 100 years.
        refused = _save_sampler(raw, model_id, "forever", ttl_seconds=HUNDRED_YEARS)
        assert refused.status_code == 400
        assert "--tinker-max-checkpoint-ttl 315360000" in refused.json()["error"], refused.text
        assert _checkpoints(raw) == []

        # The audit's burst: many saves at once, each with a long TTL (within the maximum).
        def save(index: int) -> httpx.Response:
            return _save_sampler(raw, model_id, f"burst-{index}", ttl_seconds=10 * 365 * 86400)

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(save, range(24)))
        accepted = [a for a in answers if a.status_code == 200]
        over = [a for a in answers if a.status_code == 429]
        assert len(accepted) == 4 and len(over) == 20, [a.status_code for a in answers]
        assert "--tinker-max-checkpoints 4" in over[0].json()["error"] and over[0].headers["retry-after"]
        for answer in accepted:
            assert "path" in _saved(raw, answer)
        assert len(_checkpoints(raw)) == 4
        # Ephemeral snapshots count too.
        ephemeral = _save_sampler(raw, model_id, None, sampling_session_seq_id=1)
        assert ephemeral.status_code == 429 and "--tinker-max-checkpoints 4" in ephemeral.json()["error"]

        # Bytes on disk: once a snapshot of this model has landed, the next is estimated at its size.
        _delete_all(raw)
        svc.checkpoint_quota.max_count = 1000
        first = _saved(raw, _save_sampler(raw, model_id, "first"))
        size = next(c["size_bytes"] for c in _checkpoints(raw) if c["tinker_path"] == first["path"])
        assert size == _user_bytes_on_disk(tmp_path) > 100_000  # measured on disk
        svc.checkpoint_quota.max_bytes = int(2.5 * size)
        flag = f"--tinker-max-checkpoint-gb {svc.checkpoint_quota.max_bytes / 2**30:g}"
        assert "path" in _saved(raw, _save_sampler(raw, model_id, "second"))
        full = _save_sampler(raw, model_id, "third")
        assert full.status_code == 429 and flag in full.json()["error"], full.text
        assert _user_bytes_on_disk(tmp_path) == 2 * size <= svc.checkpoint_quota.max_bytes
        svc.checkpoint_quota.max_bytes = size - 1
        alone = _save_sampler(raw, model_id, "third")
        assert alone.status_code == 400 and "more than this server's whole checkpoint quota" in alone.json()["error"]

        # Checked again once written: a fully fine-tuned model's first snapshot is estimated by
        # its weight files, and the file it writes is a little larger.
        _delete_all(raw)
        svc.checkpoint_quota.max_bytes = 10**9
        full_ft = _model(raw, session_id, 1, rank=None)
        written = _saved(raw, _save_sampler(raw, full_ft, "full"))
        actual = next(c["size_bytes"] for c in _checkpoints(raw) if c["tinker_path"] == written["path"])
        model = svc.state.model(full_ft)
        _delete_all(raw)
        estimate = svc.checkpoint_estimate(model, "sampler_weights")
        assert estimate < actual
        svc.checkpoint_quota.max_bytes = (estimate + actual) // 2
        late = _save_sampler(raw, full_ft, "full")
        assert late.status_code == 200, late.text  # fits by its estimate
        failed = _result(raw, late.json()["request_id"]).json()
        assert failed["category"] == "user" and "it was not kept" in failed["error"]
        assert "--tinker-max-checkpoint-gb" in failed["error"]
        assert _checkpoints(raw) == [] and _user_bytes_on_disk(tmp_path) == 0
        assert raw.post(f"/sessions/{session_id}/finish", json={}).status_code == 204


# -- 2. LoRA rank ------------------------------------------------------------------------------


def test_a_lora_rank_past_the_cap_is_refused_naming_the_flag(server, keys):
    with _raw(server.url, keys["alice"]) as raw:
        session_id = _session(raw)
        refused = raw.post("/create_model", json={"session_id": session_id, "model_seq_id": 0, "base_model": TINY,
                                                  "lora_config": {"rank": 1024}})
        assert refused.status_code == 400
        assert "LoRA rank 1024" in refused.json()["error"] and "--tinker-max-lora-rank 128" in refused.json()["error"]
        assert raw.post(f"/sessions/{session_id}/finish", json={}).status_code == 204
    service = tinker.ServiceClient(base_url=server.url, api_key="tml-" + keys["alice"])
    with pytest.raises(Exception, match="--tinker-max-lora-rank 128"):
        service.create_lora_training_client(base_model=TINY, rank=1024).result()
    service.close("success").result()


# -- 3. the sampler's adapter cache ------------------------------------------------------------------


def test_the_samplers_adapter_cache_is_bounded_in_bytes_and_reserved_in_the_memory_admission(
        start_server, tmp_path, helpers):
    import ray

    live = start_server(tmp_path, tinker_sampler_adapter_cache_mb=16)
    svc = live.app.state.tinker
    key = helpers.make_user(tmp_path, "dave")
    with _raw(live.url, key) as raw:
        session_id = _session(raw)
        model_id = _model(raw, session_id, rank=128)  # the largest rank allowed
        paths = [_saved(raw, _save_sampler(raw, model_id, f"s{index}"))["path"] for index in range(24)]
        adapter = next(c["size_bytes"] for c in _checkpoints(raw))
        assert adapter > 6 * MiB  # 24 of them: ~170 MB if all stayed loaded

        base = raw.post("/asample", json={"base_model": TINY, "prompt": {"chunks": [
            {"type": "encoded_text", "tokens": [5, 9, 12]}]}, "num_samples": 1,
            "sampling_params": {"max_tokens": 2, "seed": 1}})
        assert _result(raw, base.json()["request_id"]).status_code == 200
        sampler = svc.host.started_samplers()[TINY]
        rss_before = ray.get(sampler.stats.remote())["rss_bytes"]

        def sample(path: str) -> httpx.Response:  # the audit's: every snapshot at once
            answer = raw.post("/asample", json={"model_path": path, "prompt": {"chunks": [
                {"type": "encoded_text", "tokens": [5, 9, 12]}]}, "num_samples": 1,
                "sampling_params": {"max_tokens": 2, "seed": 1}})
            assert answer.status_code == 200, answer.text
            return _result(raw, answer.json()["request_id"])

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            results = list(pool.map(sample, paths))
        assert all(r.status_code == 200 and r.headers["content-type"] == "application/x-protobuf" for r in results)
        stats = ray.get(sampler.stats.remote())
        cache = stats["adapter_cache"]
        growth = stats["rss_bytes"] - rss_before
        print(f"sampler adapter cache after 24 rank-128 snapshots: {cache}; RSS growth {growth / MiB:.1f} MiB")
        assert cache["max_bytes"] == 16 * MiB and 0 < cache["bytes"] <= cache["peak_bytes"] <= 16 * MiB
        assert cache["adapters"] == 2 and cache["held"] == 0
        assert growth < 12 * adapter  # unbounded, the 24 adapters alone would add 24 x

        # The cache's budget is reserved in the admission, for every served model's sampler.
        reserve = svc.sampler_memory_reserve()
        assert reserve == 16 * MiB * len(svc.policy.models)
        used = sum(slot.memory_bytes for slot in svc.host.live_models()) + svc.host.base_memory_bytes()
        svc.settings.memory_budget_bytes = used + reserve  # full only because of the reserve
        refused = raw.post("/create_model", json={"session_id": session_id, "model_seq_id": 1, "base_model": TINY,
                                                  "lora_config": {"rank": 4}})
        assert refused.status_code == 429
        assert "--tinker-sampler-adapter-cache-mb 16" in refused.json()["error"], refused.text
        assert raw.post(f"/sessions/{session_id}/finish", json={}).status_code == 204


# -- 4. snapshots by content -------------------------------------------------------------------------


PROMPT = [5, 9, 12, 40, 41, 7, 8]


def _train_step(tc, step: int) -> None:
    tokens = [3 + (11 * step + 5 * i) % 400 for i in range(12)]
    batch = [types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                         loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)})]
    tc.forward_backward(batch, "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=5e-2)).result()


def _trained_logprobs(tc) -> np.ndarray:
    probe = types.Datum(model_input=types.ModelInput.from_ints(PROMPT[:-1]),
                        loss_fn_inputs={"target_tokens": PROMPT[1:], "weights": [1.0] * (len(PROMPT) - 1)})
    return np.asarray(tc.forward([probe], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist())


def _sampled_logprobs(service, path: str) -> np.ndarray:
    sampler = service.create_sampling_client(model_path=path).result()
    return np.asarray(sampler.compute_logprobs(types.ModelInput.from_ints(PROMPT)).result()[1:], dtype=float)


def test_a_snapshot_saved_again_under_a_deleted_name_serves_the_new_weights_and_overwrite_works(server, keys,
                                                                                                helpers):
    import ray

    service = tinker.ServiceClient(base_url=server.url, api_key="tml-" + keys["bob"])
    rest = tinker.RestClient(base_url=server.url, api_key="tml-" + keys["bob"])
    tc = service.create_lora_training_client(base_model=TINY, rank=8, seed=3).result()
    _train_step(tc, 0)

    # The audit's sequence: save "a", sample, delete it, train a step, save "a" again, sample.
    first_path = tc.save_weights_for_sampler("a").result().path
    first = _sampled_logprobs(service, first_path)
    np.testing.assert_allclose(first, _trained_logprobs(tc), atol=2e-4)
    sampler = server.app.state.tinker.host.started_samplers()[TINY]
    held_before = ray.get(sampler.stats.remote())["adapter_cache"]["adapters"]
    rest.delete_checkpoint_from_tinker_path(first_path).result()
    helpers.wait_for(lambda: ray.get(sampler.stats.remote())["adapter_cache"]["adapters"] == held_before - 1,
                     10, "the deleted snapshot's adapter to leave the sampler's cache")
    _train_step(tc, 1)
    second_path = tc.save_weights_for_sampler("a").result().path
    assert second_path == first_path
    second = _sampled_logprobs(service, second_path)
    assert np.abs(second - first).max() > 1e-3  # not the deleted weights
    np.testing.assert_allclose(second, _trained_logprobs(tc), atol=2e-4)  # the new ones

    # overwrite: true on a named sampler save (the SDK has no such argument: the raw request).
    _train_step(tc, 2)
    with _raw(server.url, keys["bob"]) as raw:
        taken = _save_sampler(raw, tc.model_id, "a")
        assert taken.status_code == 400 and "overwrite: true" in taken.json()["error"]
        replaced = _saved(raw, _save_sampler(raw, tc.model_id, "a", overwrite=True))
        assert replaced["path"] == first_path
        assert [c["tinker_path"] for c in _checkpoints(raw)].count(first_path) == 1
    third = _sampled_logprobs(service, first_path)
    assert np.abs(third - second).max() > 1e-3
    np.testing.assert_allclose(third, _trained_logprobs(tc), atol=2e-4)
    # One folder per name is left: the replaced write's folder is gone.
    run, kind, name = first_path.removeprefix("tinker://").split("/")
    folders = list((server.app.state.tinker.root / run.replace(":", "_") / kind).glob(f"{name}@*"))
    assert len(folders) == 1
    service.close("success").result()
