"""The slot decode (:mod:`opentinker.engine.rollout.slot_decode`) beyond what every engine test
checks (``tests/engine/test_rollout.py`` runs those on both decode loops): its counter-based
random numbers, rows taking over freed slots, its host looking only every few steps, its pool."""

from __future__ import annotations

import pytest
import torch

from opentinker.engine.rollout import SamplingParams
from opentinker.engine.rollout.sampling import choose_tokens, counter_uniform, inverse_cdf
from opentinker.engine.rollout.slot_decode import SlotDecoder, row_buckets
from opentinker.engine.rollout.transformers_engine import TransformersRolloutEngine


def make_engine(model, tokenizer, **kwargs):
    return TransformersRolloutEngine(model, [tokenizer.eos_token_id], tokenizer.pad_token_id, seed=0,
                                     tokenizer=tokenizer, **kwargs)


@pytest.fixture
def slots(tiny_model, tiny_tokenizer):
    return make_engine(tiny_model, tiny_tokenizer, slot_decode=True)


def test_counter_uniforms_are_uniform_independent_and_pure():
    seeds = torch.arange(400).repeat_interleave(250)
    counters = torch.arange(250).repeat(400)
    u = counter_uniform(seeds, counters)
    assert u.dtype == torch.float64 and bool(((u >= 0) & (u < 1)).all())
    histogram = torch.histc(u.float(), bins=20, min=0, max=1) / len(u)
    assert torch.allclose(histogram, torch.full((20,), 0.05), atol=0.004)
    # Neighbouring tokens of a row, and neighbouring seeds at one token, are uncorrelated.
    grid = u.reshape(400, 250)
    for a, b in ((grid[:, :-1], grid[:, 1:]), (grid[:-1], grid[1:])):
        assert abs(float(torch.corrcoef(torch.stack([a.flatten(), b.flatten()]))[0, 1])) < 0.02
    assert torch.equal(counter_uniform(seeds[:7], counters[:7]), u[:7])  # a pure function of the pair
    assert float(counter_uniform(torch.tensor([-5, 2 ** 62]), torch.tensor([3, 3])).min()) >= 0


def test_device_side_choice_draws_from_the_distribution():
    probs = torch.tensor([0.5, 0.0, 0.3, 0.15, 0.05])
    rows = 20_000
    logits = torch.log(probs).expand(rows, -1).contiguous()
    ones = torch.ones(rows)
    chosen, logprobs = choose_tokens(logits, ones, torch.zeros(rows, dtype=torch.bool), torch.full((rows,), -1),
                                     ones, counter_uniform(torch.arange(rows), torch.zeros(rows, dtype=torch.long)),
                                     filtered=False)
    frequencies = torch.bincount(chosen, minlength=5).float() / rows
    assert frequencies[1] == 0
    assert torch.allclose(frequencies, probs, atol=0.015)
    assert torch.allclose(logprobs, torch.log(probs)[chosen])
    top2, _ = choose_tokens(logits, ones, torch.zeros(rows, dtype=torch.bool), torch.full((rows,), 2), ones,
                            counter_uniform(torch.arange(rows), torch.ones(rows, dtype=torch.long)), filtered=True)
    assert set(top2.tolist()) == {0, 2}


def whole_vocabulary_inverse_cdf(logits, uniform):
    """The reference: one float64 cumulative sum over every token."""
    cdf = torch.softmax(logits.double(), dim=-1).cumsum(-1)
    target = (uniform * cdf[:, -1]).unsqueeze(-1)
    return torch.searchsorted(cdf, target, right=True).squeeze(-1).clamp(max=logits.shape[-1] - 1)


@pytest.mark.parametrize("vocab, block", [(151_936, 1024), (1000, 16), (300, 1024), (5, 2), (1000, 64)])
def test_blocked_inverse_cdf_picks_the_whole_sums_token(vocab, block):
    generator = torch.Generator().manual_seed(vocab)
    logits = torch.randn(400, vocab, generator=generator) * 3
    logits[:, ::7] = float("-inf")  # filtered tokens (every 7th) are never drawn
    logits[0] = float("-inf")  # a row with one token left
    logits[0, vocab // 2] = 0.0
    uniform = torch.rand(400, generator=generator, dtype=torch.float64)
    uniform[:2] = torch.tensor([0.0, 1 - 2 ** -53], dtype=torch.float64)  # the edges
    chosen = inverse_cdf(logits, uniform, block)
    assert torch.equal(chosen, whole_vocabulary_inverse_cdf(logits, uniform))
    assert torch.isfinite(logits.gather(1, chosen.unsqueeze(-1))).all()
    # Capturable in a graph: traced whole, no host round trip.
    traced = torch.compile(inverse_cdf, fullgraph=True, dynamic=False, backend="eager")
    assert torch.equal(traced(logits, uniform, block), chosen)


def test_row_buckets():
    assert row_buckets(1) == [1]
    assert row_buckets(6) == [1, 2, 4, 6]
    assert row_buckets(40) == [1, 2, 4, 8, 16, 32, 40]
    assert row_buckets(256)[-3:] == [224, 240, 256]


def test_rows_take_over_freed_slots_and_sample_as_they_would_alone(tiny_model_dir, tiny_tokenizer,
                                                                  arithmetic_prompt_ids):
    """Two slots, six rows of different lengths: rows wait, take the slot a finished row left
    (its keys and values not copied nor cleared), and give what they give alone, greedy or seeded;
    the pool stays two slots wide."""
    from opentinker.engine.model_loading import load_causal_lm

    prompts = [arithmetic_prompt_ids[i][:length] for i, length in enumerate((30, 9, 22, 14, 30, 5))]
    params = [SamplingParams(temperature=0 if i % 2 else 1.0, max_tokens=m, seed=i, ignore_eos=True)
              for i, m in enumerate((3, 17, 6, 11, 2, 9))]
    two = make_engine(load_causal_lm(str(tiny_model_dir)), tiny_tokenizer, slot_decode=True, max_batch_size=2)
    wide = make_engine(load_causal_lm(str(tiny_model_dir)), tiny_tokenizer, slot_decode=True)
    eager = make_engine(load_causal_lm(str(tiny_model_dir)), tiny_tokenizer)
    got = two.generate(prompts, params)
    assert two.slot_decoder.pool.slots == 2
    alone = [wide.generate([prompt], [param])[0] for prompt, param in zip(prompts, params)]
    greedy = eager.generate(prompts, params)
    for i, (completion, want) in enumerate(zip(got, alone)):
        assert len(completion.token_ids) == params[i].max_tokens
        assert completion.token_ids == want.token_ids
        assert torch.allclose(torch.tensor(completion.logprobs), torch.tensor(want.logprobs), atol=1e-5)
        if params[i].temperature == 0:
            assert completion.token_ids == greedy[i].token_ids


def test_looking_every_step_or_every_eight_gives_the_same_rows_and_tokens_as_they_come(slots, arithmetic_prompt_ids):
    """The host looks at the rows every ``sync_every`` steps; ``on_tokens`` still hears every
    step's tokens in order (in bursts), and what rows give does not depend on how often it looks."""
    prompts = arithmetic_prompt_ids[:4]
    params = [SamplingParams(temperature=1.0, max_tokens=m, seed=i) for i, m in enumerate((20, 3, 13, 20))]
    heard: dict[int, list[int]] = {row: [] for row in range(4)}
    steps = []

    def on_tokens(rows, tokens):
        steps.append(len(rows))
        for row, token in zip(rows, tokens):
            heard[row].append(token)

    slots.slot_decoder.sync_every = 8
    every_eight = slots.generate(prompts, params, on_tokens=on_tokens)
    assert [heard[row] for row in range(4)] == [c.token_ids for c in every_eight]
    assert len(steps) == max(len(c.token_ids) for c in every_eight)
    assert steps == sorted(steps, reverse=True)  # rows leave, none comes back
    slots.slot_decoder.sync_every = 1
    every_step = slots.generate(prompts, params)
    assert every_step == every_eight


def test_the_pool_is_reused_when_a_call_fits_and_grows_when_one_does_not(slots, arithmetic_prompt_ids):
    small = SamplingParams(temperature=0, max_tokens=4)
    slots.generate(arithmetic_prompt_ids[:3], small)
    pool = slots.slot_decoder.pool
    assert (pool.slots, pool.new_tokens) == (4, 4)
    first = slots.generate(arithmetic_prompt_ids[:2], small)
    assert slots.slot_decoder.pool is pool
    longer = SamplingParams(temperature=0, max_tokens=300)
    slots.generate(arithmetic_prompt_ids[:5], longer)
    grown = slots.slot_decoder.pool
    assert grown is not pool and grown.slots == 8 and grown.new_tokens == 300
    assert grown.columns % 256 == 0 and grown.columns >= max(map(len, arithmetic_prompt_ids[:5])) + 300
    assert slots.generate(arithmetic_prompt_ids[:2], small) == first  # old rows, new pool: the same


@pytest.mark.parametrize("filtered", [False, True])
def test_a_step_never_waits_for_the_host(slots, arithmetic_prompt_ids, filtered):
    """What a CUDA graph needs (and what makes a step cost no host round trip): the whole step,
    sampling, bookkeeping and forward pass, traces as one graph (``fullgraph=True`` fails on any
    ``.item()``, ``bool(tensor)`` or data-dependent shape). Traced only (``backend="eager"``)."""
    slots.generate(arithmetic_prompt_ids[:3], SamplingParams(max_tokens=4))
    decoder = slots.slot_decoder
    step = torch.compile(decoder._step, fullgraph=True, dynamic=False, backend="eager")
    with torch.no_grad():
        step(4, filtered, decoder.pool.columns)


def test_two_decode_loops_at_once_are_refused(tiny_model, tiny_tokenizer):
    with pytest.raises(ValueError, match="pick one"):
        make_engine(tiny_model, tiny_tokenizer, slot_decode=True, compile_decode=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs of the slot decode need a CUDA GPU")
def test_cuda_graphs_give_the_steps_tokens_and_logprobs(tiny_model_dir, tiny_tokenizer, arithmetic_prompt_ids):
    from opentinker.engine.model_loading import load_causal_lm

    def engine(graphs):
        model = load_causal_lm(str(tiny_model_dir), device="cuda")
        made = make_engine(model, tiny_tokenizer, slot_decode=True)
        made.slot_decoder = SlotDecoder(made, graphs=graphs)
        return made

    params = [SamplingParams(temperature=t, max_tokens=20, seed=i, top_k=k)
              for i, (t, k) in enumerate([(0, -1), (1.0, -1), (0.7, 5), (1.0, -1)])]
    want = engine(False).generate(arithmetic_prompt_ids[:4], params)
    captured = engine(True)
    got = captured.generate(arithmetic_prompt_ids[:4], params)
    assert captured.slot_decoder._graphs
    for a, b in zip(want, got):
        assert a.token_ids == b.token_ids
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4)
