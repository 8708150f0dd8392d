"""The official ``tinker`` SDK (0.38.0), unmodified, against a real opentinker-server on
127.0.0.1: LoRA training on the tiny model, sampling from the trained weights, the RL losses
against hand-computed sums, save/load state, two users at once, refusals of bad input."""

from __future__ import annotations

import concurrent.futures
import math
import os
import re
import time

import httpx
import numpy as np
import pytest

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402
from tinker.proto.request_conv import forward_backward_request_to_proto  # noqa: E402

os.environ.setdefault("TINKER_TELEMETRY", "0")
TINY = "opentinker-tiny-arith"
# "12+7=" and its answer in the tiny model's vocabulary would do; any ids below its 2000 work.
TOKENS = [1, 5, 9, 12, 40, 41, 42, 43, 17, 99, 310, 7]


def datum(tokens=TOKENS, **inputs) -> types.Datum:
    """Next-token datum: input = tokens[:-1], targets = tokens[1:], plus extra per-token inputs."""
    n = len(tokens) - 1
    loss_inputs = {"target_tokens": list(tokens[1:]), "weights": [1.0] * n} if not inputs else {
        "target_tokens": list(tokens[1:]), **inputs}
    return types.Datum(model_input=types.ModelInput.from_ints(list(tokens[:-1])), loss_fn_inputs=loss_inputs)


class Session:
    """A ServiceClient of one user, finished at the end of the test (which unloads its models)."""

    def __init__(self, server, key: str):
        self.client = tinker.ServiceClient(base_url=server.url, api_key="tml-" + key)
        self.rest = tinker.RestClient(base_url=server.url, api_key="tml-" + key)

    def lora(self, rank: int = 8, seed: int = 0):
        return self.client.create_lora_training_client(base_model=TINY, rank=rank, seed=seed).result()

    def close(self):
        self.client.close("success").result()


@pytest.fixture
def session(server, keys):
    opened = []

    def open_(user: str = "alice") -> Session:
        opened.append(Session(server, keys[user]))
        return opened[-1]

    yield open_
    for s in opened:
        s.close()


def logprobs_of(training_client, d: types.Datum) -> np.ndarray:
    out = training_client.forward([d], "cross_entropy").result()
    return np.asarray(out.loss_fn_outputs[0]["logprobs"].tolist())


def adam(lr: float = 2e-3) -> types.AdamParams:
    return types.AdamParams(learning_rate=lr)


def test_lora_cross_entropy_lowers_the_loss_and_the_sampler_has_the_trained_weights(session):
    tc = session().lora()
    losses = []
    for _ in range(5):
        result = tc.forward_backward([datum()], "cross_entropy").result()
        losses.append(result.metrics["loss:sum"])
        tc.optim_step(adam()).result()
    assert all(b < a for a, b in zip(losses, losses[1:])), losses
    assert losses[-1] < 0.8 * losses[0]

    # Sampling from the saved weights: the sampled tokens' logprobs are the trained model's.
    sampler = tc.save_weights_and_get_sampling_client().result()
    prompt = TOKENS[:4]
    sample = sampler.sample(prompt=types.ModelInput.from_ints(prompt), num_samples=2,
                            sampling_params=types.SamplingParams(max_tokens=6, temperature=1.0, seed=3)).result()
    assert len(sample.sequences) == 2
    for sequence in sample.sequences:
        assert len(sequence.tokens) == len(sequence.logprobs) > 0
        full = prompt + list(sequence.tokens)
        trained = logprobs_of(tc, datum(full))[len(prompt) - 1:]
        np.testing.assert_allclose(sequence.logprobs, trained, atol=2e-4)
    # ...and not the base model's.
    base = session().client.create_sampling_client(base_model=TINY).result()
    base_lp = base.compute_logprobs(types.ModelInput.from_ints(TOKENS)).result()
    trained_lp = sampler.compute_logprobs(types.ModelInput.from_ints(TOKENS)).result()
    assert base_lp[0] is None and trained_lp[0] is None
    np.testing.assert_allclose(trained_lp[1:], logprobs_of(tc, datum()), atol=2e-4)
    assert sum(trained_lp[1:]) > sum(base_lp[1:]) + 1.0  # training raised this sequence's likelihood


def _rl_datum(current: np.ndarray, shift: float, advantages: list[float]) -> tuple[types.Datum, np.ndarray]:
    """A datum whose sampler logprobs are the current ones moved by ``shift`` per token."""
    rng = np.random.default_rng(0)
    sampler_lp = current + shift * rng.standard_normal(current.shape)
    d = datum(logprobs=sampler_lp.astype(np.float32).tolist(), advantages=advantages)
    return d, sampler_lp


def test_rl_losses_equal_hand_computed_sums(session):
    tc = session().lora()
    current = logprobs_of(tc, datum())
    n = len(current)
    advantages = [(-1.0) ** i * (0.5 + 0.1 * i) for i in range(n)]
    a = np.asarray(advantages)
    d, q = _rl_datum(current, 0.3, advantages)
    ratio = np.exp(current - q)

    results = {}
    for loss, config in [("importance_sampling", None), ("ppo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}),
                         ("cispo", None), ("ppo", None)]:
        out = tc.forward([d], loss, loss_fn_config=config).result()  # forward only: weights stay put
        results[(loss, bool(config))] = out.metrics["loss:sum"]
        np.testing.assert_allclose(out.loss_fn_outputs[0]["logprobs"].tolist(), current, atol=1e-5)
    assert results[("importance_sampling", False)] == pytest.approx(-(ratio * a).sum(), rel=1e-4)
    for (low, high), key in [((0.9, 1.1), ("ppo", True)), ((0.8, 1.2), ("ppo", False))]:
        expected = -np.minimum(ratio * a, np.clip(ratio, low, high) * a).sum()
        assert results[key] == pytest.approx(expected, rel=1e-4)
    expected_cispo = -(np.clip(ratio, 0.8, 1.2) * current * a).sum()
    assert results[("cispo", False)] == pytest.approx(expected_cispo, rel=1e-4)

    # The same loss through forward_backward, then a step: the weights move.
    fb = tc.forward_backward([d], "importance_sampling").result()
    assert fb.metrics["loss:sum"] == pytest.approx(results[("importance_sampling", False)], rel=1e-4)
    tc.optim_step(adam(1e-2)).result()
    assert np.abs(logprobs_of(tc, datum()) - current).max() > 1e-4


def test_dro_gspo_and_stable_reinforce_as_the_cookbook_sends_them(session):
    """The losses SDK 0.36 added, each against its sum by hand (forward only), then one step
    each; stable_reinforce on a sample drawn with record_stability_info and a datum with the
    provenance spans the cookbook's rl_loop attaches."""
    tc = session().lora()
    current = logprobs_of(tc, datum())
    n = len(current)
    prompt_len = 4  # the first 3 positions are "prompt": logprobs and advantages 0, as the cookbook pads
    advantages = [0.0] * (prompt_len - 1) + [(-1.0) ** i * (0.5 + 0.1 * i) for i in range(n - prompt_len + 1)]
    a = np.asarray(advantages)
    rng = np.random.default_rng(1)
    q = np.where(a != 0, current + 0.4 * rng.standard_normal(n), 0.0)
    marked = (a != 0).astype(np.float32)
    rl = dict(logprobs=q.astype(np.float32).tolist(), advantages=advantages)
    cases = {
        "dro": (datum(**rl), {"beta": 0.2}),
        "gspo": (datum(**rl, sequence_ratio_mask=marked.tolist()), None),
        "stable_reinforce": (datum(**rl), None),
    }
    q = np.asarray(rl["logprobs"], dtype=np.float64)  # what the server got (float32)
    ratio = np.exp(current - q)
    s = np.exp(((current - q) * marked).sum() / marked.sum())
    expected = {
        "dro": -(current * a - 0.1 * (current - q) ** 2).sum(),  # beta 0.2: the prompt's logp^2 counts too
        "gspo": -np.minimum(s * a, np.clip(s, 0.8, 1.2) * a).sum(),
        "stable_reinforce": -(np.minimum(ratio, 2.0) * current * a).sum(),
    }
    for loss, (d, config) in cases.items():
        out = tc.forward([d], loss, loss_fn_config=config).result()
        assert out.metrics["loss:sum"] == pytest.approx(expected[loss], rel=1e-4), loss
        np.testing.assert_allclose(out.loss_fn_outputs[0]["logprobs"].tolist(), current, atol=1e-5)
    with pytest.raises(Exception, match="'gspo' needs loss_fn_inputs 'sequence_ratio_mask'"):
        tc.forward_backward([datum(**rl)], "gspo").result()
    for loss, (d, config) in cases.items():
        tc.forward_backward([d], loss, loss_fn_config=config).result()
        tc.optim_step(adam(1e-2)).result()
    assert np.abs(logprobs_of(tc, datum()) - current).max() > 1e-4

    # As the cookbook's RL loop does it: sample with record_stability_info, then name the
    # sequence behind every position in the datum's provenance.
    sampler = tc.save_weights_and_get_sampling_client(record_stability_info=True).result()
    (seq,) = sampler.sample(prompt=types.ModelInput.from_ints(TOKENS[:prompt_len]), num_samples=1,
                            sampling_params=types.SamplingParams(max_tokens=5, temperature=1.0, seed=2)).result().sequences
    assert seq.sequence_id and len(seq.tokens) == len(seq.logprobs) > 0
    ob, k = prompt_len - 1, len(seq.tokens)
    sampled = datum(TOKENS[:prompt_len] + list(seq.tokens), logprobs=[0.0] * ob + list(seq.logprobs),
                    advantages=[0.0] * ob + [1.0] * k).with_provenance(
        model_input=[types.PromptProvenanceSpan(sequence_id=seq.sequence_id, length=prompt_len),
                     types.SampledProvenanceSpan(sequence_id=seq.sequence_id, length=k - 1)],
        loss_fn_inputs=[types.PromptProvenanceSpan(sequence_id=seq.sequence_id, offset=1, length=ob),
                        types.SampledProvenanceSpan(sequence_id=seq.sequence_id, length=k)])
    out = tc.forward_backward([sampled], "stable_reinforce").result()
    # On-policy (the sampler has these weights): weight 1 on every sampled token, loss -sum(logp).
    assert out.metrics["loss:sum"] == pytest.approx(-sum(seq.logprobs), rel=1e-3)
    tc.optim_step(adam()).result()


def test_save_state_then_load_with_optimizer_continues_exactly(session):
    s = session()
    tc = s.lora(seed=1)
    batch = [datum()]
    for _ in range(2):
        tc.forward_backward(batch, "cross_entropy").result()
        tc.optim_step(adam()).result()
    path = tc.save_state("mid").result().path
    assert path.startswith("tinker://") and path.endswith("/weights/mid")
    tc.forward_backward(batch, "cross_entropy").result()
    tc.optim_step(adam()).result()
    uninterrupted = logprobs_of(tc, datum(TOKENS[::-1]))

    resumed = s.client.create_training_client_from_state_with_optimizer(path).result()
    resumed.forward_backward(batch, "cross_entropy").result()
    resumed.optim_step(adam()).result()
    np.testing.assert_allclose(logprobs_of(resumed, datum(TOKENS[::-1])), uninterrupted, atol=1e-6)

    # Without the optimizer state Adam starts over: the same step lands elsewhere.
    fresh = s.client.create_training_client_from_state(path).result()
    fresh.forward_backward(batch, "cross_entropy").result()
    fresh.optim_step(adam()).result()
    assert np.abs(logprobs_of(fresh, datum(TOKENS[::-1])) - uninterrupted).max() > 1e-4

    run = s.rest.get_training_run_by_tinker_path(path).result()
    assert run.is_lora and run.lora_rank == 8 and run.base_model == TINY
    assert run.last_checkpoint.tinker_path == path


def _raw(server, key: str) -> httpx.Client:
    return httpx.Client(base_url=server.url + "/api/v1", headers={"X-API-Key": "tml-" + key}, timeout=60,
                        trust_env=False)


def test_two_users_at_once_are_isolated(server, keys, session):
    alice, bob = session("alice"), session("bob")

    def train(s: Session, tokens: list[int]):
        tc = s.lora()
        for _ in range(2):
            tc.forward_backward([datum(tokens)], "cross_entropy").result()
            tc.optim_step(adam()).result()
        return tc, tc.save_state("mine").result().path

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        (a_tc, a_path), (b_tc, b_path) = pool.map(train, [alice, bob], [TOKENS, TOKENS[::-1]])
    assert a_path != b_path
    a_model = a_tc.model_id
    with _raw(server, keys["bob"]) as raw:
        assert raw.post("/get_info", json={"model_id": a_model}).status_code == 404
        assert raw.get(f"/training_runs/{a_model}").status_code == 404
        assert raw.post("/weights_info", json={"tinker_path": a_path}).status_code == 404
        answer = raw.post("/optim_step", json={"model_id": a_model, "seq_id": 99, "adam_params": {"learning_rate": 1.0}})
        assert answer.status_code == 404
        own = raw.get("/training_runs").json()["training_runs"]
        assert {r["training_run_id"] for r in own} >= {b_tc.model_id} and a_model not in {
            r["training_run_id"] for r in own}
    with pytest.raises(Exception, match="not found"):
        bob.client.create_training_client_from_state(a_path).result()
    # Alice's model was never touched by bob's attempts: one more step works as usual.
    assert a_tc.forward_backward([datum()], "cross_entropy").result().metrics["loss:sum"] > 0


def _proto_body(model_id: str, seq_id: int, data: list[types.Datum], loss: str = "cross_entropy") -> bytes:
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=data, loss_fn=loss), model_id=model_id, seq_id=seq_id)
    return forward_backward_request_to_proto(request).SerializeToString()


def _result(raw: httpx.Client, request_id: str) -> httpx.Response:
    while True:
        answer = raw.post("/retrieve_future", json={"request_id": request_id})
        if answer.headers["content-type"].startswith("application/json") and answer.json().get("type") == "try_again":
            continue
        return answer


PROTO = {"Content-Type": "application/x-protobuf"}


def test_bad_input_is_a_user_error_and_the_model_keeps_working(server, keys, session):
    s = session()
    with pytest.raises(Exception, match="not served here"):
        s.client.create_lora_training_client(base_model="no-such-model", rank=4).result()
    tc = s.lora()
    with pytest.raises(Exception, match="not supported.*cross_entropy"):
        tc.forward_backward([datum()], "custom").result()
    with pytest.raises(Exception, match="needs loss_fn_inputs 'logprobs', 'advantages'"):
        tc.forward_backward([datum()], "importance_sampling").result()
    with pytest.raises(Exception, match="past the model's vocabulary"):
        tc.forward_backward([datum([1, 2, 10**6])], "cross_entropy").result()

    model = tc.model_id
    with _raw(server, keys["alice"]) as raw:
        answer = raw.post("/forward_backward", content=b"\x08\xff\xff\xff garbage", headers=PROTO)
        assert answer.status_code == 400 and "not a ForwardBackwardRequest protobuf" in answer.json()["error"]
        body = bytearray(_proto_body(model, 50, [datum()]))
        bad_dtype = types.Datum(model_input=types.ModelInput.from_ints([1, 2, 3]),
                                loss_fn_inputs={"target_tokens": types.TensorData(data=[2.0, 3.0, 4.0], dtype="float32"),
                                                "weights": [1.0, 1.0, 1.0]})
        answer = raw.post("/forward_backward", content=_proto_body(model, 51, [bad_dtype]), headers=PROTO)
        assert answer.status_code == 400 and "target_tokens" in answer.json()["error"] and "int64" in answer.json()["error"]
        short = datum(weights=[1.0], target_tokens=TOKENS[1:])
        answer = raw.post("/forward_backward", content=_proto_body(model, 52, [short]), headers=PROTO)
        assert answer.status_code == 400 and "shape [1], expected [11]" in answer.json()["error"]
        answer = raw.post("/asample", json={"sampling_session_id": "nope", "prompt": {"chunks": []},
                                             "sampling_params": {}})
        assert answer.status_code == 422
        assert body  # the well-formed body of seq 50 was never sent: the model must not wait for it
    # After all of that (and the numbers the refused requests used), training goes on.
    before = tc.forward_backward([datum()], "cross_entropy").result().metrics["loss:sum"]
    tc.optim_step(adam()).result()
    assert tc.forward_backward([datum()], "cross_entropy").result().metrics["loss:sum"] < before


def test_requests_run_in_seq_id_order_and_a_resent_request_gets_its_first_future(server, keys, session):
    tc = session().lora()
    model = tc.model_id
    with _raw(server, keys["alice"]) as raw:
        # optim_step (seq 2) arrives before the forward_backward (seq 1) whose gradient it applies.
        step = raw.post("/optim_step", json={"model_id": model, "seq_id": 2, "type": "optim_step",
                                             "adam_params": {"learning_rate": 1e-3}}).json()
        first = raw.post("/forward_backward", content=_proto_body(model, 1, [datum()]), headers=PROTO).json()
        again = raw.post("/forward_backward", content=_proto_body(model, 1, [datum()]), headers=PROTO).json()
        assert again["request_id"] == first["request_id"]
        assert _result(raw, first["request_id"]).headers["content-type"] == "application/x-protobuf"
        metrics = _result(raw, step["request_id"]).json()["metrics"]
        assert metrics["grad_norm:mean"] > 0  # the gradient was there: seq 1 ran first


LONG = [1 + (7 * i) % 900 for i in range(257)]  # a datum of 256 tokens: 16 of them take the worker a while


def test_a_models_next_request_reaches_the_worker_while_the_previous_one_runs(server, keys, session, monkeypatch):
    from opentinker.server.tinker.workers import SharedBase

    tc = session().lora()
    before = logprobs_of(tc, datum())
    cycles_out = []  # at each cycle sent to the shared worker: how many were out already
    send = SharedBase._send

    def spy(self, requests):
        cycles_out.append((len(self._cycles), [r.item[0] if not r.is_call else "forward_backward" for r in requests]))
        return send(self, requests)

    monkeypatch.setattr(SharedBase, "_send", spy)
    forward_backward = tc.forward_backward([datum(LONG)] * 16, "cross_entropy")  # sent before waiting
    step = tc.optim_step(adam())
    forward_backward.result()
    assert step.result().metrics["grad_norm:mean"] > 0  # it ran after the gradient was there
    # The optim_step went out while the forward_backward still ran (its last chunk: 16 rows of
    # 257 positions, 3 rows to a cycle's share of 1,024 padded tokens, are 6 chunks), and the
    # worker kept the order.
    assert cycles_out[:-1] == [(0, ["forward_backward"])] + [(1, ["forward_backward"])] * (len(cycles_out) - 2)
    assert cycles_out[-1] == (1, ["optim_step"]) and len(cycles_out) == 7
    assert np.abs(logprobs_of(tc, datum()) - before).max() > 1e-4


def test_unloading_a_model_fails_the_request_it_is_running(server, keys, session):
    tc = session().lora()
    slot = server.app.state.tinker.host.slot(tc.model_id)
    with _raw(server, keys["alice"]) as raw:
        sent = raw.post("/forward_backward", content=_proto_body(tc.model_id, 1, [datum(LONG)] * 16),
                        headers=PROTO).json()
        while not slot.handed_over:  # with the worker
            time.sleep(0.001)
        assert raw.post("/unload_model", json={"model_id": tc.model_id}).status_code == 200
        failed = _result(raw, sent["request_id"]).json()
    assert failed["category"] == "server" and set(failed) == {"error", "category"}
    assert re.fullmatch(r"the model was unloaded \(error id [0-9a-f]{12}\)", failed["error"]), failed


def test_sampling_stops_seeds_and_prompt_logprobs(session):
    sampler = session().client.create_sampling_client(base_model=TINY).result()
    prompt = types.ModelInput.from_ints(TOKENS[:5])

    def sample(**params):
        n = params.pop("num_samples", 1)
        return sampler.sample(prompt=prompt, num_samples=n, sampling_params=types.SamplingParams(**params)).result()

    free = sample(max_tokens=12, temperature=1.0, seed=5, stop=[])
    assert len(free.sequences[0].tokens) == 12 and free.sequences[0].stop_reason == "length"
    assert sample(max_tokens=12, temperature=1.0, seed=5, stop=[]).sequences[0].tokens == free.sequences[0].tokens
    tokens = free.sequences[0].tokens
    first_new = next(i for i in range(1, len(tokens)) if tokens[i] not in tokens[:i])  # a token not seen before
    stopped = sample(max_tokens=12, temperature=1.0, seed=5, stop=[tokens[first_new]]).sequences[0]
    assert stopped.tokens == tokens[:first_new + 1] and stopped.stop_reason == "stop"
    two = sample(max_tokens=12, temperature=1.0, seed=5, stop=[], num_samples=2)
    assert two.sequences[0].tokens != two.sequences[1].tokens  # seeded samples of one request differ

    from transformers import AutoTokenizer

    from opentinker.tiny import ensure_tiny_model

    tokenizer = AutoTokenizer.from_pretrained(str(ensure_tiny_model()))
    text = tokenizer.decode(free.sequences[0].tokens)
    needle = text[len(text) // 2:len(text) // 2 + 2]
    by_text = sample(max_tokens=12, temperature=1.0, seed=5, stop=[needle]).sequences[0]
    assert needle in tokenizer.decode(by_text.tokens) and by_text.stop_reason == "stop"
    assert len(by_text.tokens) < 12

    scored = sampler.sample(prompt=prompt, num_samples=1, sampling_params=types.SamplingParams(max_tokens=1),
                            include_prompt_logprobs=True, topk_prompt_logprobs=3).result()
    assert scored.prompt_logprobs[0] is None and all(isinstance(v, float) for v in scored.prompt_logprobs[1:])
    top = scored.topk_prompt_logprobs
    assert top[0] in (None, []) and len(top[1]) == 3
    assert max(lp for _, lp in top[1]) >= scored.prompt_logprobs[1] - 1e-5
    assert math.isclose(sampler.compute_logprobs(prompt).result()[2], scored.prompt_logprobs[2], abs_tol=1e-5)


def test_futures_and_checkpoints_survive_a_restart(tmp_path, start_server, keys, helpers):
    key = helpers.make_user(tmp_path, "carol")
    first = start_server(tmp_path)
    s = Session(first, key)
    tc = s.lora()
    with _raw(first, key) as raw:
        done = raw.post("/asample", json={"base_model": TINY, "num_samples": 1, "prompt": {"chunks": [
            {"type": "encoded_text", "tokens": TOKENS[:4]}]}, "sampling_params": {"max_tokens": 3, "seed": 1}}).json()
        assert len(done["sample_sequence_ids"]) == 1
        result = _result(raw, done["request_id"]).content
    tc.forward_backward([datum()], "cross_entropy").result()
    tc.optim_step(adam()).result()
    path = tc.save_state("before-restart").result().path
    trained = logprobs_of(tc, datum())
    first.stop()

    second = start_server(tmp_path)
    with _raw(second, key) as raw:
        assert _result(raw, done["request_id"]).content == result  # the finished future is still there
        lost = raw.post("/forward_backward", content=_proto_body(tc.model_id, 9, [datum()]), headers=PROTO)
        assert lost.status_code == 400 and "load it again from a checkpoint" in lost.json()["error"]
    again = Session(second, key)
    try:
        restored = again.client.create_training_client_from_state(path).result()
        np.testing.assert_allclose(logprobs_of(restored, datum()), trained, atol=1e-6)
    finally:
        again.close()


def test_every_tinker_route_but_health_needs_a_key(server, keys):
    from opentinker.server.tinker.routes import api_routes

    routes = [(method, route.path) for route in api_routes() for method in route.methods]
    assert len(routes) > 30
    with httpx.Client(base_url=server.url, timeout=30, trust_env=False) as raw:
        for method, path in routes:
            url = path.replace("{checkpoint_id:path}", "weights/x").replace("{", "").replace("}", "")
            for headers in ({}, {"X-API-Key": "tml-" + keys["revoked"]}, {"X-API-Key": "tml-ot-made-up"}):
                answer = raw.request(method, url, headers=headers, json={})
                expected = 200 if path in ("/api/v1/healthz", "/api/v1/openapi.json") else 401
                assert answer.status_code == expected, (method, path, headers, answer.text)


def test_a_model_without_lora_config_is_fully_fine_tuned(server, keys):
    with _raw(server, keys["alice"]) as raw:
        session_id = raw.post("/create_session", json={"tags": [], "sdk_version": "raw"}).json()["session_id"]
        try:
            created = raw.post("/create_model", json={"session_id": session_id, "model_seq_id": 0,
                                                      "base_model": TINY}).json()
            model = _result(raw, created["request_id"]).json()["model_id"]
            info = raw.post("/get_info", json={"model_id": model}).json()
            assert info["is_lora"] is False and info["model_data"]["model_name"] == TINY
            first = raw.post("/forward_backward", content=_proto_body(model, 1, [datum()]), headers=PROTO).json()
            step = raw.post("/optim_step", json={"model_id": model, "seq_id": 2,
                                                 "adam_params": {"learning_rate": 1e-3}}).json()
            again = raw.post("/forward_backward", content=_proto_body(model, 3, [datum()]), headers=PROTO).json()
            from tinker.proto.response_conv import deserialize_forward_backward_output as read

            before = read(_result(raw, first["request_id"]).content).metrics["loss:sum"]
            assert _result(raw, step["request_id"]).json()["metrics"]["grad_norm:mean"] > 0
            assert read(_result(raw, again["request_id"]).content).metrics["loss:sum"] < before
        finally:
            assert raw.post(f"/sessions/{session_id}/finish", json={"reason": {"type": "success"}}).status_code == 204
        assert raw.post("/session_heartbeat", json={"session_id": session_id}).status_code == 410


def test_the_sdk_sends_forward_backward_bodies_zstd_compressed(session, monkeypatch):
    from opentinker.server.tinker.routes import training as routes

    encodings = []
    decompress = routes._decompressed

    def spy(encoding, body, limit):
        encodings.append(encoding)
        return decompress(encoding, body, limit)

    monkeypatch.setattr(routes, "_decompressed", spy)
    tc = session().lora()
    before = tc.forward([datum()], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
    tc.forward_backward([datum()] * 3, "cross_entropy").result()
    assert encodings == ["zstd", "zstd"]  # the server's client_config turned proto_compress_fwdbwd on
    assert len(before) == len(TOKENS) - 1


def test_the_sdk_learns_of_finished_samples_from_one_poll_per_session(server, keys, session, monkeypatch):
    feeds = server.app.state.tinker.completions
    polls = []
    poll = feeds.poll

    async def spy(user_id, session_id, clone, prev_cursor, timeout_s):
        polls.append((session_id, clone, prev_cursor))
        return await poll(user_id, session_id, clone, prev_cursor, timeout_s)

    monkeypatch.setattr(feeds, "poll", spy)
    sampler = session().client.create_sampling_client(base_model=TINY).result()
    futures = [sampler.sample(prompt=types.ModelInput.from_ints(TOKENS[:4]), num_samples=2,
                              sampling_params=types.SamplingParams(max_tokens=4, seed=i)) for i in range(12)]
    results = [future.result() for future in futures]
    # Four tokens each, or fewer ending at the end-of-sequence token (which the tiny model, as
    # built on a given machine, may sample early: its SFT is not bit-reproducible across machines).
    assert all(len(r.sequences) == 2 for r in results)
    assert all(len(s.tokens) == 4 or (0 < len(s.tokens) < 4 and s.stop_reason == "stop")
               for r in results for s in r.sequences)
    # The session poller (client_config sample_use_retrieve_futures) asked, for one session,
    # with a cursor that moves on.
    assert polls and len({p[0] for p in polls}) == 1 and {p[1] for p in polls} == {0}
    assert max(p[2] for p in polls) > 0
    # Another user's session is not theirs to poll.
    target = {"type": "sampling_session", "sampling_session_id": sampler._sampling_session_id}
    with _raw(server, keys["bob"]) as raw:
        assert raw.post("/retrieve_futures", json={"target": target, "timeout": 0}).status_code == 404
