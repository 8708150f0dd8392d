"""Correcting for the gap between the policy that sampled and the one being trained.

The rollout engine's logprobs (``rollout``) come from the behaviour policy: an older policy
version under asynchronous training, or the same weights in another engine (bf16 vLLM vs
the trainer). The update's ``old`` logprobs are the trainer's policy before this update.
The ratio ``old / rollout`` (per token, or the product over a sequence) corrects for the gap
in two ways, as verl's ``algorithm.rollout_correction`` does:

- importance sampling (``rollout_is``): the policy loss of each token is multiplied by the
  ratio, truncated at ``is_threshold`` (truncated IS: bounded variance, a little bias);
  at ``sequence`` level one weight (the sequence's product) for all its tokens;
- rejection sampling (``rollout_rs``): tokens (``token``) or whole sequences (``sequence``:
  the product; ``geometric``: the per-token geometric mean) whose ratio leaves
  ``[rs_lower, rs_upper]`` are masked out of the loss.

Log-ratios are clamped to [-20, 20] before ``exp`` so a far-off token cannot overflow.
"""

from __future__ import annotations

import torch

from opentinker.engine.algorithms.masked import masked_mean

LOG_RATIO_BOUND = 20.0


def rollout_correction(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    rollout_is: str | None = None,
    is_threshold: float = 2.0,
    rollout_rs: str | None = None,
    rs_upper: float | None = None,
    rs_lower: float | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None, dict[str, float]]:
    """``(is_weights, rs_mask, metrics)``: the IS weights [B, R] (None without ``rollout_is``;
    0 off the mask), the mask of tokens kept [B, R] (None without ``rollout_rs``; 0 off the
    mask) and statistics (``rollout_corr/...``: the weights' mean/std/min/max and effective
    sample size before truncation, the fraction truncated, the fraction masked, and the
    mismatch KL(rollout || old) per token)."""
    mask = response_mask.to(torch.float64)
    log_ratio = ((old_logprobs.double() - rollout_logprobs.double()) * mask).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    rows = mask.sum(-1) > 0
    sequence_log_ratio = log_ratio.sum(-1).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    metrics: dict[str, float] = {}
    if mask.sum() > 0:
        metrics["rollout_corr/kl"] = float(masked_mean(-log_ratio, mask))  # k1 estimate, per token
    is_weights = rs_mask = None
    if rollout_is is not None:
        if rollout_is == "token":
            raw = torch.exp(log_ratio)
            values = raw[mask > 0]  # the statistics are over what is weighted: tokens
        elif rollout_is == "sequence":
            raw = torch.exp(sequence_log_ratio)[:, None].expand_as(mask)
            values = torch.exp(sequence_log_ratio)[rows]  # ... or sequences
        else:
            raise ValueError(f"rollout_is must be 'token', 'sequence' or None, got {rollout_is!r}")
        metrics.update(_is_weight_stats(values, is_threshold))
        is_weights = (raw.clamp(max=is_threshold) * mask).to(old_logprobs.dtype)
    if rollout_rs is not None:
        if rs_upper is None:
            raise ValueError("rollout_rs needs rs_upper (the largest ratio kept)")
        lower = 1.0 / rs_upper if rs_lower is None else rs_lower
        if rollout_rs == "token":
            ratio = torch.exp(log_ratio)
            kept = (ratio >= lower) & (ratio <= rs_upper)
        elif rollout_rs in ("sequence", "geometric"):
            per_row = sequence_log_ratio if rollout_rs == "sequence" else (
                log_ratio.sum(-1) / mask.sum(-1).clamp(min=1))
            ratio = torch.exp(per_row)
            kept = ((ratio >= lower) & (ratio <= rs_upper))[:, None].expand_as(mask)
        else:
            raise ValueError(f"rollout_rs must be 'token', 'sequence', 'geometric' or None, got {rollout_rs!r}")
        rs_mask = (kept.double() * mask).to(response_mask.dtype)
        if mask.sum() > 0:
            metrics["rollout_corr/rollout_rs_masked_fraction"] = float(1 - rs_mask.double().sum() / mask.sum())
    return is_weights, rs_mask, metrics


def _is_weight_stats(values: torch.Tensor, is_threshold: float) -> dict[str, float]:
    """The IS weights' statistics before truncation (none without a weight)."""
    if not values.numel():
        return {}
    return {
        "rollout_corr/rollout_is_mean": float(values.mean()),
        "rollout_corr/rollout_is_std": float(values.std(unbiased=False)),
        "rollout_corr/rollout_is_min": float(values.min()),
        "rollout_corr/rollout_is_max": float(values.max()),
        "rollout_corr/rollout_is_eff_sample_size": float(values.mean() ** 2 / (values ** 2).mean()),
        "rollout_corr/rollout_is_ratio_fraction_high": float((values > is_threshold).double().mean()),
    }
