"""Policy-gradient losses: one registry of per-token losses, each usable by every trainer.

A policy loss is registered in its per-token form:

``fn(old_logprob, logprob, advantages, response_mask, **cfg) -> (losses, stats, mask)``

- All tensors are [B, T]. ``logprob`` is the current policy's log-probability of each sampled
  token and the only input gradients flow into; ``old_logprob`` (the policy that sampled)
  and ``advantages`` are treated as constants.
- ``response_mask``: 1 = model token (carries loss), 0 = padding or environment token.
- Options: ``clip_ratio`` (0.2); ``clip_ratio_low`` / ``clip_ratio_high`` (``None`` -> ``clip_ratio``);
  ``clip_ratio_c`` (3.0, dual clip). Unknown options are ignored so a trainer can pass one
  common kwargs dict.
- ``losses`` [B, T] before any aggregation; ``stats`` per-token statistics {name: [B, T]}
  (``pg_clipfrac``, ``ppo_kl``, ``pg_clipfrac_lower``); ``mask`` the float response mask.

That is the form the training backends take (their losses are weighted sums over tokens,
normalised by the PPO recipe), so a loss registered here trains, and the config's
``actor_rollout_ref.actor.policy_loss`` accepts exactly the registered names.
:func:`get_policy_loss` gives the aggregated form,
``(old_logprob, logprob, advantages, response_mask, loss_agg_mode="token-mean", **cfg) -> (loss, metrics)``,
with ``loss_scale_factor`` for ``seq-mean-token-sum-norm`` and the metrics as token means.
A loss registered with ``aggregation=`` always aggregates that way (GSPO: per sequence).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from opentinker.engine.algorithms.aggregation import agg_loss
from opentinker.engine.algorithms.masked import as_float_mask, masked_mean
from opentinker.engine.algorithms.registry import RegisteredNames, Registry

PolicyLossOutput = tuple[torch.Tensor, dict[str, float]]
PolicyLossFn = Callable[..., PolicyLossOutput]
#: ``(per-token losses [B, T], per-token stats {name: [B, T]}, float mask [B, T])``
TokenLossOutput = tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]
PolicyTokenLossFn = Callable[..., TokenLossOutput]

_REGISTRY: Registry[PolicyTokenLossFn] = Registry("policy loss", config_key="actor_rollout_ref.actor.policy_loss")

#: Names of the registered policy losses (a live, tuple-like view).
POLICY_LOSSES = RegisteredNames(_REGISTRY)
#: Losses whose aggregation is fixed, whatever ``loss_agg_mode`` says.
SEQUENCE_AGGREGATED_LOSSES: dict[str, str] = {}


def register_policy_loss(name: str, *, override: bool = False,
                         aggregation: str | None = None) -> Callable[[PolicyTokenLossFn], PolicyTokenLossFn]:
    """Decorator adding a per-token policy loss under ``name`` (see the module docstring);
    ``aggregation``: a ``loss_agg_mode`` it always uses, whatever the config says."""
    register = _REGISTRY.register(name, override=override)

    def decorator(fn: PolicyTokenLossFn) -> PolicyTokenLossFn:
        register(fn)
        if aggregation is None:
            SEQUENCE_AGGREGATED_LOSSES.pop(name, None)
        else:
            SEQUENCE_AGGREGATED_LOSSES[name] = aggregation
        return fn

    return decorator


def policy_token_losses(name: str) -> PolicyTokenLossFn:
    """The per-token form of the policy loss ``name``; ``ValueError`` naming the valid ones."""
    return _REGISTRY.get(name)


def get_policy_loss(name: str) -> PolicyLossFn:
    """The policy loss ``name`` aggregated to a scalar; ``ValueError`` naming the valid ones."""
    token_losses = _REGISTRY.get(name)
    fixed = SEQUENCE_AGGREGATED_LOSSES.get(name)

    def aggregated(old_logprob: torch.Tensor, logprob: torch.Tensor, advantages: torch.Tensor,
                   response_mask: torch.Tensor, loss_agg_mode: str = "token-mean", *,
                   loss_scale_factor: float | None = None, **cfg: Any) -> PolicyLossOutput:
        losses, stats, mask = token_losses(old_logprob, logprob, advantages, response_mask, **cfg)
        return agg_loss(losses, mask, fixed or loss_agg_mode, loss_scale_factor), _token_means(stats, mask)

    aggregated.__doc__ = token_losses.__doc__
    return aggregated


def _clip_range(clip_ratio: float, clip_ratio_low: float | None, clip_ratio_high: float | None) -> tuple[float, float]:
    low = clip_ratio if clip_ratio_low is None else clip_ratio_low
    high = clip_ratio if clip_ratio_high is None else clip_ratio_high
    return float(low), float(high)


def _constants(
    old_logprob: torch.Tensor, advantages: torch.Tensor, response_mask: torch.Tensor, logprob: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Detached old log-probs and advantages and a float mask, all in ``logprob``'s dtype."""
    if not (old_logprob.shape == logprob.shape == advantages.shape == response_mask.shape):
        raise ValueError(
            "old_logprob, logprob, advantages and response_mask must share one [batch, response_len] shape; got "
            f"{tuple(old_logprob.shape)}, {tuple(logprob.shape)}, {tuple(advantages.shape)}, "
            f"{tuple(response_mask.shape)}."
        )
    old = old_logprob.detach().to(logprob.dtype)
    adv = advantages.detach().to(logprob.dtype)
    return old, adv, as_float_mask(response_mask, logprob)


def _token_means(stats: dict[str, torch.Tensor], mask: torch.Tensor) -> dict[str, float]:
    """Per-token stats as their mean over the model tokens (the metrics of the aggregate losses)."""
    return {name: float(masked_mean(value.detach(), mask)) for name, value in stats.items()}


@register_policy_loss("vanilla")
def vanilla_token_losses(
    old_logprob: torch.Tensor,
    logprob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_ratio: float = 0.2,
    clip_ratio_low: float | None = None,
    clip_ratio_high: float | None = None,
    clip_ratio_c: float = 3.0,
    **_: Any,
) -> TokenLossOutput:
    """PPO clipped surrogate with dual clip (https://arxiv.org/abs/1912.09729).

    ``log_ratio = clamp(logprob - old, -20, 20)``, ``ratio = exp(log_ratio)``;
    ``l1 = -A * ratio``, ``l2 = -A * clamp(ratio, 1 - low, 1 + high)``, ``c1 = max(l1, l2)``;
    for ``A < 0`` the loss is further capped at ``l3 = -A * clip_ratio_c``: ``min(l3, c1)``.
    Metrics: ``pg_clipfrac`` = share of model tokens with ``l2 > l1``; ``pg_clipfrac_lower``
    = share with ``A < 0`` and ``c1 > l3``; ``ppo_kl`` = mean of ``-log_ratio``.
    """
    if clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c (the dual-clip bound) must be greater than 1.0, got {clip_ratio_c}.")
    low, high = _clip_range(clip_ratio, clip_ratio_low, clip_ratio_high)
    old, adv, mask = _constants(old_logprob, advantages, response_mask, logprob)

    log_ratio = torch.clamp(logprob - old, min=-20.0, max=20.0)
    ratio = torch.exp(log_ratio)
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - low, 1.0 + high)
    clipped_once = torch.maximum(unclipped, clipped)
    dual_bound = -adv * clip_ratio_c
    clipped_twice = torch.minimum(dual_bound, clipped_once)
    negative = adv < 0
    losses = torch.where(negative, clipped_twice, clipped_once)
    stats = {
        "pg_clipfrac": (clipped > unclipped).to(mask.dtype),
        "ppo_kl": -log_ratio.detach(),
        "pg_clipfrac_lower": ((clipped_once > dual_bound) & negative).to(mask.dtype),
    }
    return losses, stats, mask


@register_policy_loss("gspo", aggregation="seq-mean-token-mean")
def gspo_token_losses(
    old_logprob: torch.Tensor,
    logprob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_ratio: float = 0.2,
    clip_ratio_low: float | None = None,
    clip_ratio_high: float | None = None,
    **_: Any,
) -> TokenLossOutput:
    """GSPO: PPO clipping on a sequence-level importance ratio (https://arxiv.org/abs/2507.18071).

    ``s_i`` = mean over the sequence's model tokens of ``logprob - old``. Each token uses
    ``log r = logprob - sg(logprob) + sg(s_i)`` (clamped above at 10): its value is the
    sequence ratio, its gradient is the token's own. Then ``max(-A r, -A clamp(r, 1-low, 1+high))``.

    Each row holds a whole sequence, so the sequence ratio is computed here; aggregated, the
    loss is always ``seq-mean-token-mean`` (as in verl), whatever ``loss_agg_mode`` says.
    ``pg_clipfrac_lower`` is always 0 (no dual clip).
    """
    low, high = _clip_range(clip_ratio, clip_ratio_low, clip_ratio_high)
    old, adv, mask = _constants(old_logprob, advantages, response_mask, logprob)

    token_log_ratio = logprob - old
    seq_log_ratio = masked_mean(token_log_ratio.detach(), mask, dim=-1)
    log_ratio = logprob - logprob.detach() + seq_log_ratio.unsqueeze(-1)
    ratio = torch.exp(torch.clamp(log_ratio, max=10.0))
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - low, 1.0 + high)
    losses = torch.maximum(unclipped, clipped)
    stats = {
        "pg_clipfrac": (clipped > unclipped).to(mask.dtype),
        "ppo_kl": -token_log_ratio.detach(),
        "pg_clipfrac_lower": torch.zeros_like(mask),
    }
    return losses, stats, mask


@register_policy_loss("cispo")
def cispo_token_losses(
    old_logprob: torch.Tensor,
    logprob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_ratio: float = 0.2,
    clip_ratio_low: float | None = None,
    clip_ratio_high: float | None = None,
    **_: Any,
) -> TokenLossOutput:
    """CISPO (MiniMax-M1, https://arxiv.org/abs/2506.13585): clip the importance weight, not the update.

    ``ratio = exp(clamp(logprob - old, -20, 20))``; per token
    ``loss = -sg(clamp(ratio, 1 - low, 1 + high)) * A * logprob``. The clipped weight is a
    constant, so every token keeps a gradient (``-w * A`` w.r.t. its log-prob).
    ``pg_clipfrac`` = share of model tokens whose ratio was clipped; ``pg_clipfrac_lower`` = 0.
    """
    low, high = _clip_range(clip_ratio, clip_ratio_low, clip_ratio_high)
    old, adv, mask = _constants(old_logprob, advantages, response_mask, logprob)

    log_ratio = torch.clamp(logprob.detach() - old, min=-20.0, max=20.0)
    ratio = torch.exp(log_ratio)
    weight = torch.clamp(ratio, 1.0 - low, 1.0 + high)
    losses = -weight * adv * logprob
    stats = {
        "pg_clipfrac": (ratio != weight).to(mask.dtype),
        "ppo_kl": -log_ratio,
        "pg_clipfrac_lower": torch.zeros_like(mask),
    }
    return losses, stats, mask
