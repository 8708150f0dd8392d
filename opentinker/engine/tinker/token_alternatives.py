"""The other tokens a sampling call may ask about: the top-k of every sampled token
(``topk_sample_logprobs``) and independent draws at every prompt position (``prompt_alt_tokens_k``).

Both are under the distribution the sampler reports sequence logprobs for: the model's
log-softmax of its logits divided by the request's temperature, before top-k/top-p filtering
(:mod:`opentinker.engine.rollout.sampling`; a greedy request, temperature 0, reports
temperature 1). So a sampled token that is among its top-k has, there, the logprob its
sequence reports, and at temperature 1 every number is the model's own log-softmax.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

EMPTY_ID, EMPTY_LOGPROB = 0, -99999.0  # an empty top-k cell, as the SDK reads it
DRAW_CELLS = 2**24  # probabilities held at once while drawing (positions x vocabulary): 128 MiB of float64


class SampleTopk:
    """The top ``k`` tokens and logprobs at each generated position of a call's ``samples``
    samples, one row per decode step of each (a sample's rows are its tokens, in order)."""

    def __init__(self, k: int, samples: int):
        self.k = k
        self.rows: list[list[tuple[np.ndarray, np.ndarray]]] = [[] for _ in range(samples)]

    def add(self, index: int, ids: np.ndarray, logprobs: np.ndarray) -> None:
        self.rows[index].append((ids[:self.k], logprobs[:self.k]))

    def matrices(self, index: int, length: int) -> tuple[np.ndarray, np.ndarray]:
        """Sample ``index``'s ``[length, k]`` token ids (int32) and logprobs (float32); cells
        past the vocabulary's size are empty."""
        rows = self.rows[index]
        if len(rows) != length:  # one row per decode step: anything else is a scheduler bug
            raise RuntimeError(f"top-k of sample {index}: {len(rows)} positions recorded for {length} tokens")
        ids = np.full((length, self.k), EMPTY_ID, dtype=np.int32)
        logprobs = np.full((length, self.k), EMPTY_LOGPROB, dtype=np.float32)
        for position, (row_ids, row_logprobs) in enumerate(rows):
            ids[position, :len(row_ids)] = row_ids
            logprobs[position, :len(row_logprobs)] = row_logprobs
        return ids, logprobs


def sampling_logprobs(logits: torch.Tensor, temperature: torch.Tensor | float) -> torch.Tensor:
    """Log-softmax of ``logits`` [rows, vocab] at ``temperature`` ([rows], or one number; 0:
    greedy, reported at 1), the way :func:`~opentinker.engine.rollout.sampling.next_tokens`
    computes a sampled token's logprob."""
    logits = logits.float()
    if isinstance(temperature, torch.Tensor):
        temperature = torch.where(temperature > 0, temperature, torch.ones_like(temperature))
        if bool((temperature != 1.0).any()):
            logits = logits / temperature.to(logits.device).unsqueeze(-1)
    elif temperature not in (0, 1):
        logits = logits / temperature
    return torch.log_softmax(logits, dim=-1)


@torch.no_grad()
def record_step_topk(lane: Any, works: Mapping[int, Any]) -> None:
    """Before ``lane`` (a :class:`~opentinker.engine.rollout.decode_batch.DecodeBatch`) picks
    its rows' next tokens: the top-k of each row whose call asked for it (``work.sample_topk``),
    from the same logits and temperature the step samples with."""
    wanted = [(row, works[work_id], index) for row, (work_id, index) in enumerate(lane.tags)
              if works[work_id].sample_topk is not None]
    if not wanted:
        return
    rows = torch.tensor([row for row, _, _ in wanted], device=lane.logits.device)
    logprobs = sampling_logprobs(lane.logits[rows], lane.settings.temperature[rows])
    k = min(max(work.sample_topk.k for _, work, _ in wanted), logprobs.shape[-1])
    top = torch.topk(logprobs, k, dim=-1)
    ids, values = top.indices.cpu().numpy().astype(np.int32), top.values.cpu().numpy()
    for position, (_, work, index) in enumerate(wanted):
        work.sample_topk.add(index, ids[position], values[position])


def draws_generator(seed: int) -> torch.Generator:
    """The host stream of a seeded call's prompt draws: its own, not sample 0's (which is
    seeded with ``seed`` itself), so that the draws and the first sample are not alike."""
    mixed = (seed * 0x9E3779B97F4A7C15 + 0x632BE59BD9B4E019) % 2**64  # a splitmix64 step: distinct seeds stay distinct
    return torch.Generator(device="cpu").manual_seed(mixed)


@torch.no_grad()
def prompt_alternatives(logits: torch.Tensor, k: int, temperature: float, generator: torch.Generator
                        ) -> tuple[np.ndarray, np.ndarray]:
    """``k`` independent draws, with replacement, from each row of ``logits`` [positions, vocab]
    at ``temperature`` (0: the most likely token ``k`` times), and their logprobs there:
    ``[positions, k]`` int64 ids and float32 logprobs. The uniform numbers come from
    ``generator`` (on the host), all of them before any draw, so a seed gives the same draws on
    any device; each is placed by inverse CDF, so a token of probability 0 is never drawn."""
    positions, vocab = logits.shape
    uniform = torch.rand((positions, k), generator=generator, dtype=torch.float64)
    ids = torch.empty((positions, k), dtype=torch.long)
    logprobs = torch.empty((positions, k), dtype=torch.float32)
    chunk = max(1, DRAW_CELLS // max(vocab, 1))
    for start in range(0, positions, chunk):
        part = logits[start:start + chunk]
        scored = sampling_logprobs(part, temperature)
        if temperature == 0:
            drawn = part.argmax(-1, keepdim=True).expand(-1, k)
        else:
            cdf = torch.softmax(scored.double(), dim=-1).cumsum(-1)
            # Scaled by the total so that rounding never leaves a number past the last bin;
            # right=True: the first bin whose cdf passes the number (an empty bin never does).
            target = uniform[start:start + chunk].to(cdf.device) * cdf[:, -1:]
            drawn = torch.searchsorted(cdf, target, right=True).clamp(max=vocab - 1)
        ids[start:start + chunk] = drawn.cpu()
        logprobs[start:start + chunk] = scored.gather(-1, drawn).cpu()
    return ids.numpy(), logprobs.numpy()
