"""The transformers rollout engine against the real tiny model."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from opentinker.engine.batch import TokenBatch
from opentinker.engine.data import chat_prompt_ids
from opentinker.engine.rollout import RequestBatcher, SamplingParams
from opentinker.engine.rollout.sampling import inverse_cdf, uniforms
from opentinker.engine.rollout.transformers_engine import TransformersRolloutEngine


@pytest.fixture
def eager_engine(tiny_model, tiny_tokenizer):
    """For the tests of :class:`.DecodeBatch` itself (the eager loop, which the Tinker sampler drives)."""
    return TransformersRolloutEngine(
        tiny_model, eos_token_ids=[tiny_tokenizer.eos_token_id], pad_token_id=tiny_tokenizer.pad_token_id, seed=0,
        tokenizer=tiny_tokenizer,
    )


@pytest.fixture(params=["eager", "slots"])
def engine(request, tiny_model, tiny_tokenizer):
    """Every test of ``generate`` runs on both decode loops: the eager one and the slot decode
    (:mod:`.slot_decode`: per-row KV slots, each step on the device, CUDA graphs on a GPU)."""
    return TransformersRolloutEngine(
        tiny_model, eos_token_ids=[tiny_tokenizer.eos_token_id], pad_token_id=tiny_tokenizer.pad_token_id, seed=0,
        tokenizer=tiny_tokenizer, slot_decode=request.param == "slots",
    )


def test_logprobs_match_the_training_backend_at_temperature_one(engine, make_backend, arithmetic_prompt_ids):
    completions = engine.generate(arithmetic_prompt_ids, SamplingParams(temperature=1.0, max_tokens=12))
    batch = TokenBatch.from_responses(arithmetic_prompt_ids, [c.token_ids for c in completions])
    policy = make_backend().forward(batch, temperature=1.0).logprobs
    rollout = batch.pad_response_values([c.logprobs for c in completions])
    assert torch.allclose(policy * batch.response_mask, rollout, atol=1e-5)


def test_logprobs_are_temperature_scaled(engine, make_backend, arithmetic_prompt_ids):
    completions = engine.generate(arithmetic_prompt_ids, SamplingParams(temperature=0.7, max_tokens=8))
    batch = TokenBatch.from_responses(arithmetic_prompt_ids, [c.token_ids for c in completions])
    policy = make_backend().forward(batch, temperature=0.7).logprobs
    assert torch.allclose(policy, batch.pad_response_values([c.logprobs for c in completions]), atol=1e-5)


def test_greedy_is_deterministic_and_equals_top_k_one(engine, arithmetic_prompt_ids):
    greedy = engine.generate(arithmetic_prompt_ids, SamplingParams(temperature=0, max_tokens=10))
    again = engine.generate(arithmetic_prompt_ids, SamplingParams(temperature=0, max_tokens=10))
    top1 = engine.generate(arithmetic_prompt_ids, SamplingParams(temperature=1.0, top_k=1, max_tokens=10))
    tiny_nucleus = engine.generate(arithmetic_prompt_ids, SamplingParams(temperature=1.0, top_p=1e-6, max_tokens=10))
    assert [c.token_ids for c in greedy] == [c.token_ids for c in again]
    assert [c.token_ids for c in greedy] == [c.token_ids for c in top1]
    assert [c.token_ids for c in greedy] == [c.token_ids for c in tiny_nucleus]


def test_greedy_matches_transformers_generate(engine, tiny_model, tiny_tokenizer, arithmetic_prompt_ids):
    ours = engine.generate(arithmetic_prompt_ids, SamplingParams(temperature=0, max_tokens=10))
    for prompt, completion in zip(arithmetic_prompt_ids, ours):
        reference = tiny_model.generate(
            torch.tensor([prompt]), max_new_tokens=10, do_sample=False,
            eos_token_id=tiny_tokenizer.eos_token_id, pad_token_id=tiny_tokenizer.pad_token_id,
        )[0, len(prompt):].tolist()
        assert completion.token_ids == reference


def test_stop_reasons_and_max_tokens(engine, tiny_tokenizer, arithmetic_prompt_ids):
    eos = tiny_tokenizer.eos_token_id
    stopped = engine.generate(arithmetic_prompt_ids, SamplingParams(temperature=0, max_tokens=32))
    for completion in stopped:
        assert completion.finish_reason == "stop"
        assert completion.token_ids[-1] == eos
        assert eos not in completion.token_ids[:-1]
    capped = engine.generate(arithmetic_prompt_ids, SamplingParams(temperature=0, max_tokens=1))
    assert all(len(c.token_ids) == 1 and c.finish_reason in ("length", "stop") for c in capped)
    forced = engine.generate(arithmetic_prompt_ids[:2], SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True))
    assert all(len(c.token_ids) == 20 and c.finish_reason == "length" for c in forced)


def test_extra_stop_token(engine, arithmetic_prompt_ids):
    greedy = engine.generate(arithmetic_prompt_ids[:1], SamplingParams(temperature=0, max_tokens=32))[0]
    first = greedy.token_ids[0]
    stopped = engine.generate(
        arithmetic_prompt_ids[:1], SamplingParams(temperature=0, max_tokens=32, stop_token_ids=(first,))
    )[0]
    assert stopped.token_ids == [first] and stopped.finish_reason == "stop"


def test_per_request_seed_reproduces_regardless_of_batch(engine, arithmetic_prompt_ids):
    seeded = SamplingParams(temperature=1.0, max_tokens=12, seed=1234)
    alone = engine.generate(arithmetic_prompt_ids[:1], seeded)[0]
    unseeded = SamplingParams(temperature=1.0, max_tokens=12)
    mixed = engine.generate(arithmetic_prompt_ids[:3], [unseeded, seeded, unseeded])
    # the same prompt with the same seed, now in the middle of a batch
    in_batch = engine.generate([arithmetic_prompt_ids[1], arithmetic_prompt_ids[0]], [unseeded, seeded])[1]
    assert alone.token_ids == in_batch.token_ids
    assert len(mixed) == 3


def test_mixed_lengths_keep_prompts_apart(engine, tiny_tokenizer):
    """Left padding must not leak: a prompt gives the same greedy output alone and batched."""
    short = chat_prompt_ids(tiny_tokenizer, [{"role": "user", "content": "What is 1 + 2?"}])
    long = chat_prompt_ids(tiny_tokenizer, [{"role": "user", "content": "Here is a longer question. What is 41 + 27?"}])
    params = SamplingParams(temperature=0, max_tokens=8)
    alone = engine.generate([short], params)[0]
    together = engine.generate([long, short], params)[1]
    assert alone.token_ids == together.token_ids


def test_update_weights_streams_buckets_and_refuses_a_partial_sync(engine, make_backend, arithmetic_prompt_ids):
    params = SamplingParams(temperature=0, max_tokens=6)
    before = engine.generate(arithmetic_prompt_ids, params)
    backend = make_backend()
    with torch.no_grad():
        for parameter in backend.model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.5)
    buckets = list(backend.weights(bucket_bytes=1 << 16))
    assert len(buckets) > 3  # streamed in pieces, not one dict
    engine.update_weights(iter(buckets))
    after = engine.generate(arithmetic_prompt_ids, params)
    assert [c.token_ids for c in before] != [c.token_ids for c in after]
    assert after == make_engine_like(engine, backend.model).generate(arithmetic_prompt_ids, params)
    with pytest.raises(KeyError, match="no tensor named"):
        engine.update_weights({"not.a.weight": torch.zeros(1)})
    with pytest.raises(KeyError, match="no new value for"):
        engine.update_weights(iter(buckets[:-1]))


def make_engine_like(engine, model):
    return TransformersRolloutEngine(model, eos_token_ids=engine.eos_token_ids, pad_token_id=engine.pad_token_id,
                                     slot_decode=engine.slot_decoder is not None)


def test_concurrent_requests_are_batched_together(engine, arithmetic_prompt_ids):
    batcher = RequestBatcher(engine, gather_window_s=0.05)
    params = SamplingParams(temperature=0, max_tokens=6)
    expected = engine.generate(arithmetic_prompt_ids, params)
    results = [None] * len(arithmetic_prompt_ids)
    start = threading.Barrier(len(arithmetic_prompt_ids))

    def ask(i):
        start.wait()
        results[i] = batcher.submit(arithmetic_prompt_ids[i], params).result(timeout=60)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(arithmetic_prompt_ids))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert [r.token_ids for r in results] == [c.token_ids for c in expected]
    assert max(batcher.batch_sizes) > 1  # they shared a generate call

    async def ask_all():
        return await asyncio.gather(*(batcher.agenerate(p, params) for p in arithmetic_prompt_ids))

    async_results = asyncio.run(ask_all())
    assert [r.token_ids for r in async_results] == [c.token_ids for c in expected]
    assert batcher.batch_sizes[-1] == len(arithmetic_prompt_ids)
    batcher.close()


def test_engine_errors_reach_every_waiter(engine):
    batcher = RequestBatcher(engine)
    future = batcher.submit([], SamplingParams())
    with pytest.raises(ValueError, match="at least one token"):
        future.result(timeout=30)
    batcher.close()


def test_sampling_params_validation():
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)


def test_sampler_draws_from_the_distribution(eager_engine):
    engine = eager_engine
    """20k draws from a known distribution: frequencies within 1.5 percentage points,
    and a token with probability zero (filtered to -inf) is never drawn."""
    probs = torch.tensor([0.5, 0.0, 0.3, 0.15, 0.05])
    logits = torch.log(probs).expand(20_000, -1).contiguous()  # log(0) = -inf
    draws = inverse_cdf(logits, uniforms([None] * 20_000, engine.shared_generator))
    frequencies = torch.bincount(draws, minlength=5).float() / 20_000
    assert frequencies[1] == 0
    assert torch.allclose(frequencies, probs, atol=0.015)


# -- the decode loop against plain forward passes ------------------------------------


def full_forward(model, prompt, completion, temperature):
    """Logprobs of ``completion`` from one uncached forward pass over prompt + completion, and
    the most likely token at each of its positions."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + completion])).logits[0, len(prompt) - 1:-1]
    logprobs = torch.log_softmax(logits / temperature, dim=-1)
    return logprobs.gather(-1, torch.tensor(completion).unsqueeze(-1)).squeeze(-1), logits.argmax(-1).tolist()


def test_decode_matches_a_full_forward_pass(engine, tiny_model, arithmetic_prompt_ids):
    """The in-place KV cache, one prefill per distinct prompt and dropping finished rows change no
    number: each completion's logprobs, and every greedy token, are those of one plain forward
    pass over prompt + completion."""
    prompts = [p for p in arithmetic_prompt_ids[:3] for _ in range(3)] + [arithmetic_prompt_ids[3][:7]]
    temperatures = [0, 1.0, 0.7, 1.0, 0, 1.3, 0, 0.7, 1.0, 0]
    max_tokens = [5, 30, 12, 30, 1, 18, 30, 9, 24, 30]
    params = [SamplingParams(temperature=t, max_tokens=m, ignore_eos=i % 3 != 2)
              for i, (t, m) in enumerate(zip(temperatures, max_tokens))]
    completions = engine.generate(prompts, params)
    assert len({len(c.token_ids) for c in completions}) > 3  # rows left the batch at different steps
    for prompt, param, completion in zip(prompts, params, completions):
        if param.ignore_eos:
            assert len(completion.token_ids) == param.max_tokens
        expected, most_likely = full_forward(tiny_model, prompt, completion.token_ids, param.temperature or 1.0)
        assert torch.allclose(torch.tensor(completion.logprobs), expected, atol=1e-5)
        if param.temperature == 0:
            assert completion.token_ids == most_likely


def test_repeated_prompts_sample_like_distinct_ones(engine, arithmetic_prompt_ids):
    """A prompt repeated in the batch (prefilled once, its cache copied) gives what it gives alone."""
    prompt = arithmetic_prompt_ids[0]
    seeded = [SamplingParams(temperature=1.0, max_tokens=16, seed=s, ignore_eos=True) for s in (5, 6, 7)]
    together = engine.generate([prompt] * 3, seeded)
    alone = [engine.generate([prompt], [p])[0] for p in seeded]
    assert [c.token_ids for c in together] == [c.token_ids for c in alone]
    assert len({tuple(c.token_ids) for c in together}) > 1  # each row drew its own tokens


def test_in_place_cache_layer_matches_transformers_dynamic_layer():
    """Writes in place, grows past its capacity, keeps only selected rows and crops like
    transformers' concatenating layer."""
    from transformers.cache_utils import DynamicLayer

    from opentinker.engine.rollout.kv_cache import InPlaceLayer

    torch.manual_seed(0)
    ours, theirs = InPlaceLayer(capacity=4), DynamicLayer()

    def step(rows, tokens):
        keys, values = torch.randn(rows, 2, tokens, 3), torch.randn(rows, 2, tokens, 3)
        for got, want in zip(ours.update(keys, values), theirs.update(keys, values)):
            assert torch.equal(got, want)
        assert ours.get_seq_length() == theirs.get_seq_length()

    step(3, 3)
    step(3, 1)
    step(3, 2)  # 6 tokens: past the capacity of 4
    for layer in (ours, theirs):
        layer.batch_select_indices(torch.tensor([2, 0]))
    step(2, 1)
    for layer in (ours, theirs):
        layer.crop(-2)
    assert torch.equal(ours.keys, theirs.keys) and torch.equal(ours.values, theirs.values)
    step(2, 1)


def test_in_place_cache_replaces_the_full_attention_layers(tiny_model):
    from opentinker.engine.rollout.kv_cache import InPlaceLayer, in_place_cache

    cache = in_place_cache(tiny_model.config, capacity=8)
    assert len(cache.layers) == tiny_model.config.num_hidden_layers
    assert all(isinstance(layer, InPlaceLayer) and layer.capacity == 8 for layer in cache.layers)



def test_stop_strings_end_a_completion_with_the_text_kept(engine, tiny_tokenizer, arithmetic_prompt_ids):
    prompt = arithmetic_prompt_ids[0]
    greedy = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    # The text of the greedy output's second plain (not special) token.
    position = [i for i, t in enumerate(greedy.token_ids) if t not in tiny_tokenizer.all_special_ids][1]
    stop_text = tiny_tokenizer.decode(greedy.token_ids[position])
    params = [SamplingParams(temperature=0, max_tokens=12, stop=(stop_text,), ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)]  # the same prompt, no stop
    cut, uncut = engine.generate([prompt, prompt], params)
    assert cut.finish_reason == "stop" and uncut.finish_reason == "length"
    assert tiny_tokenizer.decode(cut.token_ids, skip_special_tokens=True).endswith(stop_text)
    assert cut.token_ids == greedy.token_ids[: len(cut.token_ids)] and len(cut.token_ids) <= position + 1
    assert uncut.token_ids == greedy.token_ids


def test_stop_strings_without_a_tokenizer_are_refused(tiny_model, tiny_tokenizer, arithmetic_prompt_ids):
    engine = TransformersRolloutEngine(tiny_model, [tiny_tokenizer.eos_token_id], tiny_tokenizer.pad_token_id)
    with pytest.raises(ValueError, match="stop strings need the engine's tokenizer"):
        engine.generate(arithmetic_prompt_ids[:1], SamplingParams(stop=("1",)))


# -- rows joining and leaving a running batch (continuous batching) ---------------------


def _run(batch, completions: dict) -> None:
    while len(batch):
        completions.update(batch.step())


def test_rows_that_join_a_running_batch_sample_as_they_would_alone(eager_engine, arithmetic_prompt_ids):
    engine = eager_engine
    """Seeded rows prefilled on their own and absorbed into a batch already 5 steps into its
    decode (their prompts shorter and longer than its width) give the tokens they give alone,
    and logprobs within 1e-5; so do the rows that were there first."""
    from opentinker.engine.rollout.decode_batch import DecodeBatch

    def params(seed, max_tokens):
        return SamplingParams(temperature=1.0, max_tokens=max_tokens, seed=seed, ignore_eos=True)

    first = [arithmetic_prompt_ids[0], arithmetic_prompt_ids[1]]
    late = [arithmetic_prompt_ids[2][:4], arithmetic_prompt_ids[3] + arithmetic_prompt_ids[4]]
    first_params, late_params = [params(1, 20), params(2, 9)], [params(3, 12), params(4, 25)]
    alone = engine.generate(first + late, first_params + late_params)

    batch = DecodeBatch.prefill(engine, first, first_params, ["a", "b"])
    got: dict = {}
    for _ in range(5):
        got.update(batch.step())
    batch.absorb(DecodeBatch.prefill(engine, late, late_params, ["c", "d"]))
    assert len(batch) == 4 and batch.tags == ["a", "b", "c", "d"]
    _run(batch, got)
    for tag, want in zip("abcd", alone):
        assert got[tag].token_ids == want.token_ids
        assert torch.allclose(torch.tensor(got[tag].logprobs), torch.tensor(want.logprobs), atol=1e-5)


def test_joining_drops_columns_that_are_padding_in_every_row(eager_engine, arithmetic_prompt_ids):
    engine = eager_engine
    """After the long rows leave, a late short row's join does not carry the old width along."""
    from opentinker.engine.rollout.decode_batch import DecodeBatch

    long_prompt = arithmetic_prompt_ids[0] * 3
    batch = DecodeBatch.prefill(engine, [long_prompt, arithmetic_prompt_ids[1][:3]],
                                [SamplingParams(temperature=0, max_tokens=2, ignore_eos=True),
                                 SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)], ["long", "short"])
    for _ in range(3):
        batch.step()
    assert batch.tags == ["short"] and batch.width == len(long_prompt) + 3  # a column per forward pass
    batch.absorb(DecodeBatch.prefill(engine, [arithmetic_prompt_ids[2][:2]],
                                     [SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)], ["late"]))
    assert batch.width == 3 + 3  # the short row's prompt and the tokens it has so far
    _run(batch, got := {})
    assert len(got["short"].token_ids) == 40 and len(got["late"].token_ids) == 5


def test_compiled_decode_gives_the_eager_tokens_and_logprobs_with_one_compile(tiny_model_dir, tiny_tokenizer,
                                                                              arithmetic_prompt_ids):
    """``compile_decode=True`` (torch.compile over the in-place cache): greedy and seeded rows
    give the eager engine's tokens and logprobs within 1e-5, through rows leaving the batch at
    different steps, a second batch of other widths and rows joining a running batch; the whole
    test compiles the step once (the widths and batch sizes are dynamic dimensions)."""
    from torch._dynamo.utils import counters

    from opentinker.engine.model_loading import load_causal_lm
    from opentinker.engine.rollout.decode_batch import DecodeBatch

    def make(compiled):
        return TransformersRolloutEngine(load_causal_lm(str(tiny_model_dir)), [tiny_tokenizer.eos_token_id],
                                         tiny_tokenizer.pad_token_id, seed=0, tokenizer=tiny_tokenizer,
                                         compile_decode=compiled)

    eager, compiled = make(False), make(True)
    prompts = [p for p in arithmetic_prompt_ids[:3] for _ in range(3)] + [arithmetic_prompt_ids[3][:7]]
    params = [SamplingParams(temperature=t, max_tokens=m, seed=i if t else None, ignore_eos=i % 3 != 2)
              for i, (t, m) in enumerate(zip([0, 1.0, 0.7, 1.0, 0, 1.3, 0, 0.7, 1.0, 0],
                                             [5, 30, 12, 30, 1, 18, 30, 9, 24, 30]))]
    second = [arithmetic_prompt_ids[4] + arithmetic_prompt_ids[5], arithmetic_prompt_ids[5][:5]]
    second_params = [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)] * 2
    graphs_before = counters["stats"]["unique_graphs"]
    for batch_prompts, batch_params in ((prompts, params), (second, second_params)):
        want, got = eager.generate(batch_prompts, batch_params), compiled.generate(batch_prompts, batch_params)
        assert len({len(c.token_ids) for c in got}) > 1 or batch_prompts is second
        for expected, actual in zip(want, got):
            assert actual.token_ids == expected.token_ids
            assert torch.allclose(torch.tensor(actual.logprobs), torch.tensor(expected.logprobs), atol=1e-5)

    results = []
    for engine in (eager, compiled):  # continuous batching: rows absorbed 4 steps in
        batch = DecodeBatch.prefill(engine, prompts[:2], params[1:3], ["a", "b"])
        got: dict = {}
        for _ in range(4):
            got.update(batch.step())
        batch.absorb(DecodeBatch.prefill(engine, second, second_params, ["c", "d"]))
        _run(batch, got)
        results.append(got)
    for tag in "abcd":
        assert results[1][tag].token_ids == results[0][tag].token_ids
        assert torch.allclose(torch.tensor(results[1][tag].logprobs), torch.tensor(results[0][tag].logprobs),
                              atol=1e-5)
    assert counters["stats"]["unique_graphs"] - graphs_before <= 2  # one graph (two if the first was static)
