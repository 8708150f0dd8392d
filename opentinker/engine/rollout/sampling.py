"""Choosing the next token of many rows at once, each row with its own sampling settings.

The reported logprob of a token is under the temperature-scaled distribution *before*
top-k/top-p filtering: the quantity the trainer recomputes. Sampling is by inverse CDF on
one uniform number per row, drawn from the row's own generator when its request has a seed
(so it samples alike in any batch), else from the engine's shared generator.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from opentinker.engine.rollout.base import SamplingParams


def filter_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask (to -inf) tokens outside each row's top-k and nucleus ``top_p``."""
    sorted_logits, sorted_idx = torch.sort(logits, dim=-1, descending=True)
    vocab = logits.shape[-1]
    rank = torch.arange(vocab, device=logits.device).expand_as(sorted_logits)
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab)).clamp(max=vocab)
    drop = rank >= k.unsqueeze(-1)
    probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
    # Keep a token while the mass strictly before it is < top_p (the first token always stays).
    mass_before = torch.cumsum(probs, dim=-1) - probs
    drop |= mass_before >= top_p.unsqueeze(-1)
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, sorted_idx, sorted_logits)


def inverse_cdf(logits: torch.Tensor, uniform: torch.Tensor, block: int = 1024,
                logsumexp: torch.Tensor | None = None) -> torch.Tensor:
    """The token whose cumulative-probability bin holds each row's uniform number; a
    zero-probability token never wins. A vocabulary of over 16 blocks goes by blocks instead of
    one float64 cumulative sum over all of it (at 256 rows of a 152k vocabulary that sum is
    311 MB written and read three times per token on a GPU, more bytes than a 0.5B model's
    weights): the probabilities' sums over blocks of ``block`` tokens pick the block, and a
    float64 cumulative sum inside that one block picks the token, the same token as the whole
    sum (``tests/engine/test_slot_decode.py``; 1.3x faster on CPU at 152k tokens, and 2.2x
    slower at 1.5k: a small vocabulary keeps the one sum). ``logsumexp``: the rows' own, if the
    caller has it."""
    rows, vocab = logits.shape
    if vocab <= 16 * block:
        cdf = torch.softmax(logits.double(), dim=-1).cumsum(-1)
        # Scale by the total so rounding can never leave u above the last bin; right=True: the
        # first bin whose cdf exceeds u, so a zero-probability token never wins.
        target = (uniform.to(cdf.device) * cdf[:, -1]).unsqueeze(-1)
        return torch.searchsorted(cdf, target, right=True).squeeze(-1).clamp(max=vocab - 1)
    blocks = -(-vocab // block)
    probs = logits.new_zeros((rows, blocks * block), dtype=torch.float32)  # zeros past the vocabulary
    if logsumexp is None:
        logsumexp = torch.logsumexp(logits.float(), dim=-1)
    probs[:, :vocab].copy_(logits).sub_(logsumexp.unsqueeze(-1)).exp_()
    grouped = probs.view(rows, blocks, block)
    cdf = grouped.sum(-1, dtype=torch.float64).cumsum(-1)
    target = (uniform.to(cdf.device) * cdf[:, -1]).unsqueeze(-1)
    chosen = torch.searchsorted(cdf, target, right=True).clamp(max=blocks - 1)
    before = torch.where(chosen > 0, cdf.gather(-1, (chosen - 1).clamp(min=0)), torch.zeros_like(target))
    inside = grouped[torch.arange(rows, device=logits.device), chosen.squeeze(-1)].double().cumsum(-1)
    offset = torch.searchsorted(inside, target - before, right=True)
    # Rounding can leave the number past the block's last bin: take its last token with mass.
    last = (inside < inside[:, -1:]).sum(-1, keepdim=True)
    return (chosen * block + torch.minimum(offset, last)).squeeze(-1)


def uniforms(generators: Sequence[torch.Generator | None], shared: torch.Generator) -> torch.Tensor:
    """One uniform number per row: from the row's generator, or (rows without one, in row
    order) from ``shared``."""
    shared_rows = [i for i, generator in enumerate(generators) if generator is None]
    if len(shared_rows) == len(generators):
        return torch.rand(len(generators), generator=shared, dtype=torch.float64)
    uniform = torch.empty(len(generators), dtype=torch.float64)
    if shared_rows:
        uniform[shared_rows] = torch.rand(len(shared_rows), generator=shared, dtype=torch.float64)
    for i, generator in enumerate(generators):
        if generator is not None:
            uniform[i] = torch.rand(1, generator=generator, dtype=torch.float64)
    return uniform


_MASK32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, constant: int) -> torch.Tensor:
    """``x * constant mod 2**32`` for ``x`` in [0, 2**32), in int64 without overflow (split in 16-bit halves)."""
    return (x * (constant & 0xFFFF) + (((x * (constant >> 16)) & 0xFFFF) << 16)) & _MASK32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A bijection of 32-bit integers that spreads every input bit over the output (the
    "lowbias32" integer hash)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def counter_uniform(seed: torch.Tensor, counter: torch.Tensor) -> torch.Tensor:
    """A uniform number in [0, 1) (float64, 53 random bits) for each ``(seed, counter)`` pair of
    int64 tensors: a pure function of the pair, so it needs no generator state. A row that
    samples its token ``k`` with ``counter_uniform(seed, k)`` draws alike in any batch, on any
    device, inside a CUDA graph, with no host round trip (:mod:`.slot_decode`)."""
    low, high = seed & _MASK32, (seed >> 32) & _MASK32
    first = _mix32(_mix32(_mix32(counter & _MASK32) ^ low) ^ high)
    second = _mix32(first ^ 0x9E3779B9)
    return ((first >> 5) * 67108864 + (second >> 6)).double() / 9007199254740992.0


def choose_tokens(logits: torch.Tensor, temperature: torch.Tensor, greedy: torch.Tensor, top_k: torch.Tensor,
                  top_p: torch.Tensor, uniform: torch.Tensor, filtered: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`next_tokens` with every setting a tensor and the uniform numbers given: no
    branch on the rows' values, so one captured graph serves any mix of rows (``filtered``:
    whether top-k/top-p filtering runs at all). Greedy rows have temperature 1."""
    logits = logits.float() / temperature.unsqueeze(-1)
    # logprob = logit - logsumexp: no [rows, vocabulary] log_softmax written and read again.
    logsumexp = torch.logsumexp(logits, dim=-1)
    if filtered:
        sampled = inverse_cdf(filter_top_k_top_p(logits, top_k, top_p), uniform)
    else:
        sampled = inverse_cdf(logits, uniform, logsumexp=logsumexp)
    chosen = torch.where(greedy, logits.argmax(-1), sampled)
    return chosen, logits.gather(-1, chosen.unsqueeze(-1)).squeeze(-1) - logsumexp


def stop_id_sets(params: Sequence[SamplingParams], eos_token_ids: Sequence[int]) -> list[tuple[int, ...]]:
    """Each request's stop token ids, sorted: its own, and the end-of-sequence ids unless ``ignore_eos``."""
    return [tuple(sorted(set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_token_ids)))) for p in params]


_PER_ROW = ("temperature", "greedy", "top_k", "top_p", "max_tokens", "stop_ids")


@dataclass
class RowSettings:
    """The sampling settings of a batch's rows, as tensors (one entry per row, in row order)."""

    temperature: torch.Tensor  # 1 for greedy rows
    greedy: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    max_tokens: torch.Tensor
    stop_ids: torch.Tensor  # [rows, most stop ids of a row], -1 where a row has fewer
    generators: list[torch.Generator | None]  # a seeded request's own stream, per row
    # Whole-batch switches, decided when rows enter: leaving rows never turn one off, so a
    # batch's arithmetic does not change as it shrinks.
    scale_by_temperature: bool
    all_greedy: bool
    any_greedy: bool
    needs_filter: bool

    @classmethod
    def of(cls, params: Sequence[SamplingParams], eos_token_ids: Sequence[int], device: torch.device) -> RowSettings:
        stop_sets = stop_id_sets(params, eos_token_ids)
        stop_ids = torch.full((len(params), max(map(len, stop_sets))), -1, dtype=torch.long)
        for row, ids in enumerate(stop_sets):
            stop_ids[row, :len(ids)] = torch.tensor(ids, dtype=torch.long)
        greedy = [p.temperature == 0 for p in params]
        temperature = [1.0 if g else p.temperature for p, g in zip(params, greedy)]
        top_k = torch.tensor([p.top_k for p in params], device=device)
        top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device)
        return cls(
            temperature=torch.tensor(temperature, dtype=torch.float32, device=device),
            greedy=torch.tensor(greedy, device=device),
            top_k=top_k,
            top_p=top_p,
            max_tokens=torch.tensor([p.max_tokens for p in params], device=device),
            stop_ids=stop_ids.to(device),
            generators=[torch.Generator(device="cpu").manual_seed(p.seed) if p.seed is not None else None
                        for p in params],
            scale_by_temperature=any(t != 1.0 for t in temperature),  # x / 1.0 == x: skip the pass
            all_greedy=all(greedy),
            any_greedy=any(greedy),
            needs_filter=bool(((top_k > 0) | (top_p < 1)).any()),
        )

    def select(self, keep: torch.Tensor) -> RowSettings:
        narrowed = {name: getattr(self, name)[keep] for name in _PER_ROW}
        return replace(self, **narrowed, generators=[self.generators[i] for i in keep.tolist()])

    @staticmethod
    def concat(parts: Sequence[RowSettings]) -> RowSettings:
        width = max(part.stop_ids.shape[1] for part in parts)
        stop_ids = [torch.nn.functional.pad(part.stop_ids, (0, width - part.stop_ids.shape[1]), value=-1)
                    for part in parts]
        joined = {name: torch.cat([getattr(part, name) for part in parts]) for name in _PER_ROW if name != "stop_ids"}
        return RowSettings(**joined, stop_ids=torch.cat(stop_ids),
                           generators=[g for part in parts for g in part.generators],
                           scale_by_temperature=any(p.scale_by_temperature for p in parts),
                           all_greedy=all(p.all_greedy for p in parts),
                           any_greedy=any(p.any_greedy for p in parts),
                           needs_filter=any(p.needs_filter for p in parts))

    def is_stop(self, chosen: torch.Tensor) -> torch.Tensor:
        if self.stop_ids.shape[1] == 0:
            return torch.zeros_like(chosen, dtype=torch.bool)
        return (self.stop_ids == chosen.unsqueeze(-1)).any(-1)


def next_tokens(logits: torch.Tensor, settings: RowSettings, shared: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """The sampled (or greedy) token of each row and its logprob at the row's temperature,
    before top-k/top-p filtering."""
    logits = logits.float()
    if settings.scale_by_temperature:
        logits = logits / settings.temperature.unsqueeze(-1)
    token_logprobs = torch.log_softmax(logits, dim=-1)
    # Every row draws its number, greedy ones too: the shared random stream advances the same
    # way whatever the rows' settings.
    uniform = uniforms(settings.generators, shared)
    if settings.all_greedy:
        chosen = logits.argmax(-1)
    else:
        sample_logits = filter_top_k_top_p(logits, settings.top_k, settings.top_p) if settings.needs_filter else logits
        chosen = inverse_cdf(sample_logits, uniform)
        if settings.any_greedy:
            chosen = torch.where(settings.greedy, sample_logits.argmax(-1), chosen)
    return chosen, token_logprobs.gather(-1, chosen.unsqueeze(-1)).squeeze(-1)
