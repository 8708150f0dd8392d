"""The step's side of rollout correction (``algorithm.rollout_correction``): the batch the
actor trains on without rejected tokens, and the sampler/trainer gap the step reports. The
formulas are ``algorithms/rollout_correction.py``'s."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

from opentinker.engine.algorithms.rollout_correction import rollout_correction
from opentinker.engine.batch import TokenBatch

if TYPE_CHECKING:
    from opentinker.recipe.components import RolloutCorrectionSpec

__all__ = ["sampler_gap_metrics", "without_rejected"]


def without_rejected(batch: TokenBatch, correction: RolloutCorrectionSpec) -> TokenBatch:
    """The batch the actor trains on: with ``rollout_rs``, its response mask without the tokens
    (or sequences) whose sampler/trainer ratio is out of bounds. (The IS weights of
    ``rollout_is`` are applied in the loss.)"""
    if correction.rollout_rs is None or correction.bypass_mode:
        return batch
    _, kept, _ = rollout_correction(
        batch.tensors["old_logprobs"], batch.tensors["rollout_logprobs"], batch.response_mask,
        rollout_rs=correction.rollout_rs, rs_upper=correction.rollout_rs_threshold,
        rs_lower=correction.rollout_rs_threshold_lower)
    return dataclasses.replace(batch, response_mask=kept, tensors=dict(batch.tensors))


def sampler_gap_metrics(batch: TokenBatch, correction: RolloutCorrectionSpec, asynchronous: bool,
                        logprobs_before_update: torch.Tensor | None) -> dict[str, float]:
    """The gap between sampler and trainer, ``rollout_corr/*`` (IS-weight statistics at the
    configured level, token level when IS is off; the fraction rejected), wherever the
    trainer's policy before the update is known: recomputed old logprobs, or the update's own
    pass when it was a single step (``logprobs_before_update``). Synchronous steps without
    correction skip it."""
    if correction.bypass_mode or not (asynchronous or correction.rollout_is or correction.rollout_rs):
        return {}
    before = batch.tensors.get("old_logprobs", logprobs_before_update)
    if before is None:
        return {}
    _, _, metrics = rollout_correction(
        before, batch.tensors["rollout_logprobs"], batch.response_mask,
        rollout_is=correction.rollout_is or "token", is_threshold=correction.rollout_is_threshold,
        rollout_rs=correction.rollout_rs, rs_upper=correction.rollout_rs_threshold,
        rs_lower=correction.rollout_rs_threshold_lower)
    return metrics
