"""Clipped value-function (critic) loss for PPO with GAE."""

from __future__ import annotations

import torch

from opentinker.engine.algorithms.aggregation import agg_loss
from opentinker.engine.algorithms.masked import as_float_mask, masked_mean


def compute_value_loss(
    vpreds: torch.Tensor,
    values: torch.Tensor,
    returns: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_value: float,
    loss_agg_mode: str = "token-mean",
    loss_scale_factor: float | None = None,
) -> tuple[torch.Tensor, float]:
    """Clipped squared error of the critic; returns ``(vf_loss, vf_clipfrac)``.

    All tensors are [B, T]: ``vpreds`` are the critic's current predictions (the only input
    gradients flow into), ``values`` the predictions at rollout time, ``returns`` the targets,
    ``response_mask`` 1 on model tokens. Note the argument order: old ``values`` come
    *before* ``returns`` (verl orders them the other way round).

    ``clipped = values + clamp(vpreds - values, -c, c)``; per token
    ``max((vpreds - returns)**2, (clipped - returns)**2)``; ``vf_loss = 0.5 * agg_loss(...)``.
    ``vf_clipfrac`` is the share of model tokens where the clipped error is the larger one.
    """
    if not (vpreds.shape == values.shape == returns.shape == response_mask.shape):
        raise ValueError(
            "vpreds, values, returns and response_mask must share one [batch, response_len] shape; got "
            f"{tuple(vpreds.shape)}, {tuple(values.shape)}, {tuple(returns.shape)}, {tuple(response_mask.shape)}."
        )
    old_values = values.detach().to(vpreds.dtype)
    targets = returns.detach().to(vpreds.dtype)
    mask = as_float_mask(response_mask, vpreds)

    clipped_vpreds = old_values + torch.clamp(vpreds - old_values, -cliprange_value, cliprange_value)
    unclipped_error = (vpreds - targets) ** 2
    clipped_error = (clipped_vpreds - targets) ** 2
    vf_loss = 0.5 * agg_loss(torch.maximum(unclipped_error, clipped_error), mask, loss_agg_mode, loss_scale_factor)
    vf_clipfrac = float(masked_mean((clipped_error > unclipped_error).to(mask.dtype), mask).detach())
    return vf_loss, vf_clipfrac
