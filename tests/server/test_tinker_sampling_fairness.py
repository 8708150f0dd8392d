"""The sampler under a hostile user (issue 18, item 2), through a real server: one user's huge
sampling calls neither starve another user's small one nor grow the sampler's memory, and past
the per-user budget of pending sampled tokens a call is refused with 429 + Retry-After."""

from __future__ import annotations

import time

import httpx
import pytest

pytest.importorskip("tinker")

TINY = "opentinker-tiny-arith"
PROMPT = [1, 5, 9, 12, 40, 41, 42, 43]  # 8 tokens: + 1,000 new ones fits the tiny model's 1,024


def sample_body(num_samples: int, max_tokens: int, **params) -> dict:
    return {"base_model": TINY, "num_samples": num_samples,
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": PROMPT}]},
            "sampling_params": {"max_tokens": max_tokens, "temperature": 1.0, **params}}


def tinker_client(server, key: str) -> httpx.Client:
    return httpx.Client(base_url=server.url + "/api/v1", headers={"X-API-Key": "tml-" + key}, timeout=60,
                        trust_env=False)


def future_state(client: httpx.Client, request_id: str, wait: bool = True) -> str:
    """'pending', 'done' or 'failed' (long-polls when ``wait``)."""
    response = client.post("/retrieve_future", json={"request_id": request_id})
    assert response.status_code == 200, response.text
    if response.headers["content-type"].startswith("application/json"):
        body = response.json()
        if body.get("type") == "try_again":
            return "pending"
        if "error" in body:
            return "failed"
    return "done"


def kv_bytes_per_token(model_dir) -> int:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * config.num_hidden_layers * heads * head_dim * 4  # keys and values, float32


def test_a_hostile_sampler_user_neither_starves_others_nor_grows_memory(start_server, tmp_path, helpers,
                                                                         tiny_model_dir):
    live = start_server(tmp_path / "data", tinker_long_poll_s=0.5)
    alice_key = helpers.make_user(tmp_path / "data", "alice")
    bob_key = helpers.make_user(tmp_path / "data", "bob")
    with tinker_client(live, alice_key) as alice, tinker_client(live, bob_key) as bob:
        # Bob's 2-token request alone (after a first one that starts the sampler).
        for _ in range(2):
            started = time.monotonic()
            first = bob.post("/asample", json=sample_body(1, 2)).json()["request_id"]
            while future_state(bob, first) == "pending":
                pass
            unloaded_s = time.monotonic() - started
        import ray

        sampler = live.app.state.tinker.host.started_samplers()[TINY]
        rss_before = ray.get(sampler.stats.remote())["rss_bytes"]

        # The audit's request: two calls of 512 samples x 1,000 tokens (stop=[]: no early end).
        hostile = alice.post("/asample", json=sample_body(512, 1000, stop=[]))
        assert hostile.status_code == 200, hostile.text
        second = alice.post("/asample", json=sample_body(512, 1000, stop=[]))
        assert second.status_code == 429 and second.headers["retry-after"] == "1"
        assert "per-user budget of 524,288" in second.json()["error"]
        # One call past the whole budget could never run: the user's error, not a retry.
        huge = alice.post("/asample", json=sample_body(1024, 1000, stop=[]))
        assert huge.status_code == 400 and "split it" in huge.json()["error"]

        helpers.wait_for(lambda: ray.get(sampler.stats.remote())["decode_steps"] > 20, 120, "the hostile call to run")
        started = time.monotonic()
        small = bob.post("/asample", json=sample_body(1, 2)).json()["request_id"]
        while future_state(bob, small) == "pending":
            pass
        loaded_s = time.monotonic() - started
        assert future_state(alice, hostile.json()["request_id"], wait=False) == "pending"  # still decoding
        stats = ray.get(sampler.stats.remote())
        print(f"bob's 2-token request: {unloaded_s:.3f} s alone, {loaded_s:.3f} s beside 512x1000 tokens; "
              f"sampler {stats}")
        # Memory is bounded by the caps, not by the 512 samples queued: a forward pass holds
        # 16,384 tokens of prompt + max_tokens (16 of these rows); the growth is within two
        # copies of that (a join builds the new cache beside the old), far below 512 rows' worth.
        rows = 16_384 // (len(PROMPT) + 1000)
        assert stats["live_rows"] <= rows and stats["waiting_samples"] >= 512 - rows
        row_bytes = (len(PROMPT) + 1000) * kv_bytes_per_token(tiny_model_dir)
        growth = stats["rss_bytes"] - rss_before
        print(f"sampler RSS +{growth / 2**20:.0f} MiB; one row's cache {row_bytes / 2**20:.1f} MiB")
        assert growth < 2 * rows * row_bytes + 64 * 2**20 < 512 * row_bytes / 4
