"""The shared LoRA worker is as safe between users as a worker per user (issue 32, items 2-4),
through the official ``tinker`` SDK and raw requests against a real server, with the audit's
requests:

- one user unloading the worker's first adapter leaves another user's model training, exactly
  as it trains alone;
- a ``forward_backward`` of 128 one-token datums and one 1,023-token datum runs in passes
  bounded by padded tokens, not as 129 rows padded to 1,024;
- a user's small request is served while another's big one is still running (it is cut into
  chunks over several cycles), and the chunked request trains exactly as its rows sent apart.
"""

from __future__ import annotations

import os
import time

import httpx
import numpy as np
import pytest

tinker = pytest.importorskip("tinker")
ray = pytest.importorskip("ray")
from tinker import types  # noqa: E402

os.environ.setdefault("TINKER_TELEMETRY", "0")
TINY = "opentinker-tiny-arith"
ADAM = types.AdamParams(learning_rate=5e-3)
GiB = 2**30


def datum(tokens: list[int]) -> types.Datum:
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)})


def rows(seed: int, lengths: list[int]) -> list[types.Datum]:
    rng = np.random.default_rng(seed)
    return [datum(rng.integers(3, 1000, size=n + 1).tolist()) for n in lengths]


PROBE = datum(list(range(10, 30)))


def steps(client, count: int, seed: int) -> list[float]:
    losses = []
    for step in range(count):
        losses.append(client.forward_backward(rows(seed + step, [6, 11]), "cross_entropy").result().metrics["loss:sum"])
        client.optim_step(ADAM).result()
    return losses


def probe(client) -> np.ndarray:
    return np.array(client.forward([PROBE], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist())


def base_stats(server) -> dict:
    [base] = server.app.state.tinker.host.shared_bases()
    return ray.get(base.actor.stats.remote())


def test_unloading_the_workers_first_adapter_leaves_another_users_model_training_as_alone(server, keys):
    # The audit: user 1 creates A (the worker's first adapter), user 2 creates B, user 1
    # creates C; user 1 unloads A; user 2's next forward_backward failed ("element 0 of tensors
    # does not require grad") or, batched with a healthy model, trained nothing.
    alice = tinker.ServiceClient(base_url=server.url, api_key="tml-" + keys["alice"])
    bob = tinker.ServiceClient(base_url=server.url, api_key="tml-" + keys["bob"])
    a = alice.create_lora_training_client(base_model=TINY, rank=4, seed=1).result()
    b = bob.create_lora_training_client(base_model=TINY, rank=4, seed=2).result()
    c = alice.create_lora_training_client(base_model=TINY, rank=8, seed=3).result()
    with httpx.Client(base_url=server.url + "/api/v1", headers={"X-API-Key": "tml-" + keys["alice"]}) as raw:
        assert raw.post("/unload_model", json={"model_id": a.model_id}).status_code == 200
    shared = steps(b, 3, seed=10)
    assert steps(c, 1, seed=20)[0] > 0  # alice's other model trains too
    b_probe = probe(b)
    alice.close("success").result()
    bob.close("success").result()

    again = tinker.ServiceClient(base_url=server.url, api_key="tml-" + keys["bob"])
    alone_client = again.create_lora_training_client(base_model=TINY, rank=4, seed=2).result()
    alone = steps(alone_client, 3, seed=10)
    assert shared[0] != shared[-1]  # it trains: the loss moves (the audit: grad_norm 0, loss unchanged)
    np.testing.assert_allclose(shared, alone, rtol=1e-5)
    np.testing.assert_allclose(b_probe, probe(alone_client), atol=1e-5)
    again.close("success").result()


def test_a_mixed_length_request_runs_in_passes_bounded_by_padded_tokens(server, keys):
    # The audit: 128 one-token datums and one 1,023-token datum (25 KB) padded to 129 x 1,024
    # positions took the worker from 0.7 to 15.5 GB and 198 s.
    service = tinker.ServiceClient(base_url=server.url, api_key="tml-" + keys["bob"])
    client = service.create_lora_training_client(base_model=TINY, rank=8, seed=1).result()
    data = rows(1, [1] * 64 + [1023] + [1] * 64)
    before = base_stats(server)
    out = client.forward_backward(data, "cross_entropy").result()
    after = base_stats(server)
    assert [len(o["logprobs"].tolist()) for o in out.loss_fn_outputs] == [1] * 64 + [1023] + [1] * 64
    assert out.metrics["loss:sum"] > 0
    limits = server.app.state.tinker.host.settings.pass_limits
    # No pass held more than the limits (the long row alone: 1,024 positions) ...
    assert after["largest_pass"][0] <= max(limits.tokens, 1024)
    assert after["largest_pass"][1] <= max(limits.attention, 1024 ** 2)
    # ... nor anything like 129 x 1,024 padded tokens (~20 GB at ~155 KB a token).
    print(f"worker peak RSS {before['peak_rss_bytes'] / GiB:.2f} -> {after['peak_rss_bytes'] / GiB:.2f} GiB")
    assert after["peak_rss_bytes"] - before["peak_rss_bytes"] < GiB
    assert client.optim_step(ADAM).result().metrics["grad_norm:mean"] > 0
    service.close("success").result()


def test_a_small_request_is_served_while_a_big_one_runs_in_chunks_that_train_as_its_rows_apart(
        start_server, tmp_path, helpers):
    # The audit: user 2's 0.28 s request waited 175 s behind user 1's one legal 256 x 512-token
    # forward_backward. Here a share of a cycle is 64 padded tokens, so 64 rows of 32 tokens
    # are 32 chunks.
    keys = {user: helpers.make_user(tmp_path, user) for user in ("carol", "dave")}
    live = start_server(tmp_path, tinker_cycle_tokens=64)
    carol = tinker.ServiceClient(base_url=live.url, api_key="tml-" + keys["carol"])
    dave = tinker.ServiceClient(base_url=live.url, api_key="tml-" + keys["dave"])
    big_client, apart_client = (carol.create_lora_training_client(base_model=TINY, rank=4, seed=5).result()
                                for _ in range(2))
    small_client = dave.create_lora_training_client(base_model=TINY, rank=4, seed=6).result()
    big_data = rows(3, [31] * 64)

    host = live.app.state.tinker.host
    [base] = host.shared_bases()
    big = big_client.forward_backward(big_data, "cross_entropy")
    deadline = time.monotonic() + 60
    while not any(w.model_id == big_client.model_id for w in base._waiting):  # its chunks wait for cycles
        assert time.monotonic() < deadline
        time.sleep(0.01)
    small = small_client.forward_backward(rows(4, [6, 6]), "cross_entropy").result()
    # Dave's request is done; carol's chunks are still being served, a share per cycle.
    assert host.slot(big_client.model_id).handed_over
    assert any(w.model_id == big_client.model_id for w in base._waiting)
    assert small.metrics["loss:sum"] > 0
    big = big.result()

    # The same rows sent as 32 requests of 2 rows (one share each: not cut) before one optim_step.
    apart = [apart_client.forward_backward(big_data[i:i + 2], "cross_entropy").result() for i in range(0, 64, 2)]
    assert big.metrics["loss:sum"] == pytest.approx(sum(a.metrics["loss:sum"] for a in apart), rel=1e-5)
    got = [o["logprobs"].tolist() for o in big.loss_fn_outputs]
    expected = [o["logprobs"].tolist() for a in apart for o in a.loss_fn_outputs]
    np.testing.assert_allclose(np.concatenate(got), np.concatenate(expected), atol=1e-5)
    for client in (big_client, apart_client):
        client.optim_step(ADAM).result()
    np.testing.assert_allclose(probe(big_client), probe(apart_client), atol=1e-5)
    carol.close("success").result()
    dave.close("success").result()


def test_an_idle_lora_model_waits_instead_of_refusing_the_users_next_script(start_server, tmp_path, helpers):
    # The audit: an SDK process that exits leaves its session and models live for the session
    # timeout (the SDK does not end it), so back-to-back scripts hit the per-user model cap.
    key = helpers.make_user(tmp_path, "erin")
    live = start_server(tmp_path, tinker_max_models_per_user=1, tinker_idle_model_s=1.0,
                        tinker_max_idle_models_per_user=1)
    first_script = tinker.ServiceClient(base_url=live.url, api_key="tml-" + key)
    first = first_script.create_lora_training_client(base_model=TINY, rank=4, seed=1).result()
    steps(first, 1, seed=1)
    first_probe = probe(first)
    second_script = tinker.ServiceClient(base_url=live.url, api_key="tml-" + key)
    with pytest.raises(Exception, match="models in use"):  # still in use a moment ago
        second_script.create_lora_training_client(base_model=TINY, rank=4, seed=2).result()
    time.sleep(1.5)
    second = second_script.create_lora_training_client(base_model=TINY, rank=4, seed=2).result()
    assert steps(second, 1, seed=2)[0] > 0
    time.sleep(1.5)  # both idle now: one idle model is all this user may keep
    with pytest.raises(Exception, match="idle LoRA models"):
        second_script.create_lora_training_client(base_model=TINY, rank=4, seed=3).result()
    # The idle model comes back on its next request as it was, and trains on.
    np.testing.assert_array_equal(probe(first), first_probe)
    assert steps(first, 1, seed=2)[0] > 0
    first_script.close("success").result()
    second_script.close("success").result()
