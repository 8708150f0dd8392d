"""``topk_sample_logprobs`` and ``prompt_alt_tokens_k`` through the official ``tinker`` SDK
(0.38.0), unmodified, against a real server on 127.0.0.1: the top-k of every sampled token and
the draws at every prompt position agree with a direct transformers forward pass of the tiny
model (at the request's temperature, as the sequences' own logprobs are), a LoRA sampler's with
its own prompt scoring, seeds repeat draws, the draws follow the model's probabilities, the
tiny VLM's prompts with pictures work alike, and out-of-bounds values are refused by name."""

from __future__ import annotations

import os

import httpx
import numpy as np
import pytest

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402
from tinker.proto.response_conv import deserialize_sample_response  # noqa: E402

from opentinker.server.tinker import schemas, wire  # noqa: E402

os.environ.setdefault("TINKER_TELEMETRY", "0")
TINY = "opentinker-tiny-arith"
TOKENS = [1, 5, 9, 12, 40, 41, 42, 43, 17, 99, 310, 7]
EMPTY = -99999.0


@pytest.fixture(scope="module")
def model():
    """The tiny model the server samples from, loaded here for the reference forward passes."""
    import torch
    from transformers import AutoModelForCausalLM

    from opentinker.tiny import ensure_tiny_model

    # Never torch.set_grad_enabled(False) here: it is the process's, and later tests in the
    # same xdist worker train (their backward found no graph).
    return AutoModelForCausalLM.from_pretrained(str(ensure_tiny_model()), dtype=torch.float32).eval()


def reference_logprobs(model, tokens: list[int], temperature: float) -> np.ndarray:
    """[len(tokens), vocab]: row i is the log-softmax, at ``temperature``, of the token after tokens[:i+1]."""
    import torch

    with torch.no_grad():
        logits = model(input_ids=torch.tensor([tokens])).logits[0].float()
    return torch.log_softmax(logits / (temperature or 1.0), dim=-1).numpy()


@pytest.fixture
def service(server, keys):
    client = tinker.ServiceClient(base_url=server.url, api_key="tml-" + keys["alice"])
    yield client
    client.close("success").result()


def test_the_sdk_reads_back_what_the_server_encodes():
    ids = np.array([[7, 3], [2, 0]], np.int32)
    logprobs = np.array([[-0.1, -2.5], [-0.01, EMPTY]], np.float32)
    alt = (np.array([[4, 4, 9]], np.int64), np.array([[-0.5, -0.5, -1.5]], np.float32))
    sample = deserialize_sample_response(wire.encode_sample_response(
        [wire.SampledSequence([7, 2], [-0.1, -0.01], "stop", (ids, logprobs))], prompt_alt=alt))
    (sequence,) = sample.sequences
    assert sequence.topk_logprobs == [[(7, pytest.approx(-0.1)), (3, -2.5)], [(2, pytest.approx(-0.01))]]
    assert sample.prompt_alt_tokens.tokens.shape == [1, 3]
    assert sample.prompt_alt_tokens.tokens.to_numpy().tolist() == [[4, 4, 9]]
    np.testing.assert_allclose(sample.prompt_alt_tokens.logprobs.to_numpy(), [[-0.5, -0.5, -1.5]])


@pytest.mark.parametrize("temperature", [0.7, 0.0])
def test_topk_of_sampled_tokens_are_the_models_at_the_sampling_temperature(service, model, temperature):
    sampler = service.create_sampling_client(base_model=TINY).result()
    prompt = TOKENS[:4]
    k = 6
    result = sampler.sample(prompt=types.ModelInput.from_ints(prompt), num_samples=3, topk_sample_logprobs=k,
                            sampling_params=types.SamplingParams(max_tokens=8, temperature=temperature, seed=11,
                                                                 stop=[])).result()
    for sequence in result.sequences:
        tokens, top = list(sequence.tokens), sequence.topk_logprobs
        assert len(top) == len(tokens) == len(sequence.logprobs) == 8
        reference = reference_logprobs(model, prompt + tokens, temperature)[len(prompt) - 1:-1]
        for position, (token, logprob, row) in enumerate(zip(tokens, sequence.logprobs, top)):
            ids = [t for t, _ in row]
            values = np.array([v for _, v in row])
            assert len(row) == k and len(set(ids)) == k
            assert (np.diff(values) <= 0).all(), row  # most likely first
            if token in ids:  # the sampled token's own logprob, as its sequence reports it
                assert abs(values[ids.index(token)] - logprob) < 1e-5
            expected = np.sort(reference[position])[::-1][:k]
            np.testing.assert_allclose(values, expected, atol=1e-4)
            np.testing.assert_allclose(reference[position][ids], values, atol=1e-4)
        if temperature == 0:  # greedy: the sampled token is the top one, logprobs at temperature 1
            assert [row[0][0] for row in top] == tokens


def test_prompt_alternatives_are_draws_from_the_model(service, model):
    sampler = service.create_sampling_client(base_model=TINY).result()
    prompt = types.ModelInput.from_ints(TOKENS)

    def draws(k: int, seed: int | None, temperature: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
        result = sampler.sample(prompt=prompt, num_samples=1, prompt_alt_tokens_k=k,
                                sampling_params=types.SamplingParams(max_tokens=1, temperature=temperature,
                                                                     seed=seed)).result()
        alt = result.prompt_alt_tokens
        return alt.tokens.to_numpy(), alt.logprobs.to_numpy()

    ids, logprobs = draws(8, seed=5)
    assert ids.shape == logprobs.shape == (len(TOKENS) - 1, 8)
    reference = reference_logprobs(model, TOKENS, 1.0)[:-1]  # row i: the distribution over TOKENS[i + 1]
    np.testing.assert_allclose(logprobs, np.take_along_axis(reference, ids, axis=1), atol=1e-4)
    again, _ = draws(8, seed=5)
    assert (again == ids).all()  # a seed repeats its draws...
    other, _ = draws(8, seed=6)
    assert (other != ids).any()  # ...and another seed draws others

    hot_ids, hot_logprobs = draws(8, seed=5, temperature=1.7)
    hot = reference_logprobs(model, TOKENS, 1.7)[:-1]
    np.testing.assert_allclose(hot_logprobs, np.take_along_axis(hot, hot_ids, axis=1), atol=1e-4)
    greedy, greedy_logprobs = draws(4, seed=None, temperature=0.0)
    assert (greedy == reference.argmax(-1)[:, None]).all()
    np.testing.assert_allclose(greedy_logprobs, reference.max(-1, keepdims=True).repeat(4, 1), atol=1e-4)

    # Many draws: the most likely token at each position comes up about as often as its probability.
    calls = [sampler.sample(prompt=prompt, num_samples=1, prompt_alt_tokens_k=schemas.MAX_TOKEN_ALTERNATIVES,
                            sampling_params=types.SamplingParams(max_tokens=1, seed=100 + i)) for i in range(25)]
    drawn = np.concatenate([call.result().prompt_alt_tokens.tokens.to_numpy() for call in calls], axis=1)
    n = drawn.shape[1]
    top, p = reference.argmax(-1), np.exp(reference.max(-1))
    frequency = (drawn == top[:, None]).mean(1)
    assert (np.abs(frequency - p) <= 4 * np.sqrt(p * (1 - p) / n) + 0.02).all(), (frequency, p)


def test_a_lora_sampler_reports_its_own_topk_and_draws(service, model):
    trainer = service.create_lora_training_client(base_model=TINY, rank=8, seed=0).result()
    datum = types.Datum(model_input=types.ModelInput.from_ints(TOKENS[:-1]),
                        loss_fn_inputs={"target_tokens": TOKENS[1:], "weights": [1.0] * (len(TOKENS) - 1)})
    for _ in range(3):
        trainer.forward_backward([datum], "cross_entropy").result()
        trainer.optim_step(types.AdamParams(learning_rate=5e-3)).result()
    sampler = trainer.save_weights_and_get_sampling_client().result()
    prompt = TOKENS[:4]
    k = 5
    sample = sampler.sample(prompt=types.ModelInput.from_ints(prompt), num_samples=2, topk_sample_logprobs=k,
                            sampling_params=types.SamplingParams(max_tokens=6, seed=2, stop=[])).result()
    base_top = []
    for sequence in sample.sequences:
        full = prompt + list(sequence.tokens)
        # The same weights' prompt scoring of prompt + sequence: its top-k at the sampled positions.
        scored = sampler.sample(prompt=types.ModelInput.from_ints(full), num_samples=1, include_prompt_logprobs=True,
                                topk_prompt_logprobs=k, sampling_params=types.SamplingParams(max_tokens=1)).result()
        for row, expected in zip(sequence.topk_logprobs, scored.topk_prompt_logprobs[len(prompt):]):
            np.testing.assert_allclose([v for _, v in row], [v for _, v in expected], atol=1e-4)
            known = dict(expected)  # the same tokens (a near tie may swap two of them)
            assert sum(t in known for t, _ in row) >= k - 1
            assert all(abs(known[t] - v) < 1e-4 for t, v in row if t in known)
        base_top.append(reference_logprobs(model, full, 1.0)[len(prompt) - 1:-1])
    trained = np.array([[v for _, v in row] for s in sample.sequences for row in s.topk_logprobs])
    base = np.concatenate([np.sort(b, axis=-1)[:, ::-1][:, :k] for b in base_top])
    assert np.abs(trained - base).max() > 1e-3  # the adapter's numbers, not the base model's

    # Draws from the trained weights: each drawn token's logprob is the trained model's there, as
    # the training client computes it for the prompt's prefix followed by the draw.
    both = sampler.sample(prompt=types.ModelInput.from_ints(TOKENS), num_samples=1, prompt_alt_tokens_k=3,
                          sampling_params=types.SamplingParams(max_tokens=1, seed=4)).result()
    ids, logprobs = both.prompt_alt_tokens.tokens.to_numpy(), both.prompt_alt_tokens.logprobs.to_numpy()
    cells = [(i, j) for i in range(ids.shape[0]) for j in range(ids.shape[1])]
    drawn = [TOKENS[:i + 1] + [int(ids[i, j])] for i, j in cells]
    out = trainer.forward([types.Datum(model_input=types.ModelInput.from_ints(d[:-1]),
                                       loss_fn_inputs={"target_tokens": d[1:], "weights": [1.0] * (len(d) - 1)})
                           for d in drawn], "cross_entropy").result()
    trained_draws = [o["logprobs"].tolist()[-1] for o in out.loss_fn_outputs]
    np.testing.assert_allclose([logprobs[i, j] for i, j in cells], trained_draws, atol=2e-4)


def test_out_of_bounds_values_are_refused_by_name(server, keys, service):
    sampler = service.create_sampling_client(base_model=TINY).result()
    prompt = types.ModelInput.from_ints(TOKENS[:4])
    with pytest.raises(tinker.APIStatusError, match="topk_sample_logprobs") as refused:
        sampler.sample(prompt=prompt, num_samples=1, topk_sample_logprobs=schemas.MAX_TOKEN_ALTERNATIVES + 1,
                       sampling_params=types.SamplingParams(max_tokens=2)).result()
    assert refused.value.status_code == 422
    with pytest.raises(tinker.APIStatusError, match="prompt_alt_tokens_k"):
        sampler.sample(prompt=prompt, num_samples=1, prompt_alt_tokens_k=schemas.MAX_TOKEN_ALTERNATIVES + 1,
                       sampling_params=types.SamplingParams(max_tokens=2)).result()
    # What the SDK would refuse itself, sent raw: a negative k.
    body = {"base_model": TINY, "num_samples": 1, "prompt": {"chunks": [{"type": "encoded_text", "tokens": TOKENS[:4]}]},
            "sampling_params": {"max_tokens": 2}}
    with httpx.Client(base_url=server.url + "/api/v1", headers={"X-API-Key": "tml-" + keys["alice"]}, timeout=60,
                      trust_env=False) as raw:
        for field in ("topk_sample_logprobs", "prompt_alt_tokens_k"):
            answer = raw.post("/asample", json={**body, field: -1})
            assert answer.status_code == 422 and field in answer.text, answer.text
        # A call whose top-k would be too big a result: refused before any work, by name.
        big = {**body, "num_samples": 1024, "sampling_params": {"max_tokens": 256}, "topk_sample_logprobs": 20}
        answer = raw.post("/asample", json=big)
        assert answer.status_code == 400 and "topk_sample_logprobs" in answer.text, answer.text
    # The sampler goes on serving.
    ok = sampler.sample(prompt=prompt, num_samples=1, topk_sample_logprobs=2,
                        sampling_params=types.SamplingParams(max_tokens=2)).result()
    assert len(ok.sequences[0].topk_logprobs) == len(ok.sequences[0].tokens)


@pytest.fixture(scope="module")
def vlm(ray_cluster, tmp_path_factory, helpers):
    """A server of the tiny VLM, a key, and the tokenizer's digit-sum prompt around one picture."""
    from transformers import AutoTokenizer

    from opentinker.environments import digit_sum
    from opentinker.tiny_vlm import ensure_tiny_vlm

    data_dir = tmp_path_factory.mktemp("topk-vlm")
    live = helpers.LiveServer(helpers.test_settings(data_dir, models=["tiny-vlm"], max_image_pixels=200 * 200)).start()
    tokenizer = AutoTokenizer.from_pretrained(str(ensure_tiny_vlm()))
    chat = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": digit_sum.QUESTION}]}]
    ids = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=False)
    at = ids.index(tokenizer.convert_tokens_to_ids("<|image_pad|>"))
    picture = types.ImageChunk(data=digit_sum.DigitSumProblem(3, 4, 1).png(), format="png", expected_tokens=8)
    prompt = types.ModelInput(chunks=[types.EncodedTextChunk(tokens=ids[:at]), picture,
                                      types.EncodedTextChunk(tokens=ids[at + 1:])])
    try:
        yield live, "tml-" + helpers.make_user(data_dir, "vlm-user"), prompt
    finally:
        live.stop()


@pytest.mark.heavy
def test_a_vlm_prompt_with_a_picture_gets_topk_and_draws(vlm):
    server, key, prompt = vlm
    service = tinker.ServiceClient(base_url=server.url, api_key=key)
    sampler = service.create_sampling_client(base_model="tiny-vlm").result()
    k = 4
    sample = sampler.sample(prompt=prompt, num_samples=2, topk_sample_logprobs=k, prompt_alt_tokens_k=k,
                            sampling_params=types.SamplingParams(max_tokens=5, seed=3, stop=[])).result()
    assert sample.prompt_alt_tokens.tokens.shape == [prompt.length - 1, k]
    for sequence in sample.sequences:
        # The decode steps' top-k (rotary positions past the picture) are the prompt scorer's
        # top-k of prompt + sequence (one forward pass with the picture) at the same positions.
        full = types.ModelInput(chunks=[*prompt.chunks, types.EncodedTextChunk(tokens=list(sequence.tokens))])
        scored = sampler.sample(prompt=full, num_samples=1, include_prompt_logprobs=True, topk_prompt_logprobs=k,
                                sampling_params=types.SamplingParams(max_tokens=1)).result()
        for token, logprob, row, expected in zip(sequence.tokens, sequence.logprobs, sequence.topk_logprobs,
                                                 scored.topk_prompt_logprobs[prompt.length:]):
            np.testing.assert_allclose([v for _, v in row], [v for _, v in expected], atol=1e-4)
            if token in dict(row):
                assert abs(dict(row)[token] - logprob) < 1e-5
    # Greedy draws are the prompt scorer's most likely token at every position, picture's included.
    greedy = sampler.sample(prompt=prompt, num_samples=1, prompt_alt_tokens_k=2, include_prompt_logprobs=True,
                            topk_prompt_logprobs=1, sampling_params=types.SamplingParams(max_tokens=1,
                                                                                         temperature=0.0)).result()
    ids, logprobs = greedy.prompt_alt_tokens.tokens.to_numpy(), greedy.prompt_alt_tokens.logprobs.to_numpy()
    best = [row[0] for row in greedy.topk_prompt_logprobs[1:]]
    assert ids[:, 0].tolist() == ids[:, 1].tolist() == [t for t, _ in best]
    np.testing.assert_allclose(logprobs[:, 0], [v for _, v in best], atol=1e-5)
    service.close("success").result()
