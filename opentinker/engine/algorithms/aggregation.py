"""Reduce a per-token loss matrix to the scalar that is back-propagated.

``loss_mat`` and ``loss_mask`` are ``[batch, response_len]``; the mask is 1 on model
tokens (the ones that carry loss) and 0 on padding and environment tokens.
"""

from __future__ import annotations

import torch

from opentinker.engine.algorithms.masked import as_float_mask, masked_mean, masked_sum
from opentinker.engine.algorithms.registry import unknown_name_error

LOSS_AGG_MODES: tuple[str, ...] = (
    "token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)


def _mean_over_nonempty_sequences(seq_losses: torch.Tensor, token_counts: torch.Tensor) -> torch.Tensor:
    """Mean of ``seq_losses`` over sequences with at least one masked-in token (0 if none)."""
    return masked_mean(seq_losses, (token_counts > 0).to(seq_losses.dtype))


def agg_loss(
    loss_mat: torch.Tensor,
    loss_mask: torch.Tensor,
    mode: str,
    loss_scale_factor: float | None = None,
) -> torch.Tensor:
    """Aggregate ``loss_mat`` [B, T] over the tokens selected by ``loss_mask`` [B, T].

    Modes:

    - ``token-mean``: ``sum(l * m) / sum(m)`` -- every model token weighs the same.
    - ``seq-mean-token-sum``: mean over sequences of each sequence's token sum.
    - ``seq-mean-token-mean``: mean over sequences of each sequence's token mean.
    - ``seq-mean-token-sum-norm``: ``sum(l * m) / (loss_scale_factor or T)`` (Dr. GRPO's
      constant normaliser). As in verl, this is *not* divided by the number of
      sequences: the normaliser is a constant so that the loss has no length bias.

    Sequences whose mask is all zero are left out of the sequence means; an all-zero
    mask gives a loss of 0 (never NaN). ``loss_scale_factor`` only affects the last mode.
    """
    mask = as_float_mask(loss_mask, loss_mat)
    if mode == "token-mean":
        return masked_mean(loss_mat, mask)
    if mode not in LOSS_AGG_MODES:
        raise unknown_name_error("loss_agg_mode", mode, LOSS_AGG_MODES)

    seq_sums = masked_sum(loss_mat, mask, dim=-1)
    if mode == "seq-mean-token-sum-norm":
        normaliser = float(loss_mask.shape[-1]) if loss_scale_factor is None else float(loss_scale_factor)
        if normaliser <= 0:
            raise ValueError(f"loss_scale_factor must be positive, got {loss_scale_factor!r}.")
        return seq_sums.sum() / normaliser

    token_counts = mask.sum(dim=-1)
    if mode == "seq-mean-token-sum":
        return _mean_over_nonempty_sequences(seq_sums, token_counts)
    # seq-mean-token-mean
    seq_means = seq_sums / torch.where(token_counts != 0, token_counts, torch.ones_like(token_counts))
    return _mean_over_nonempty_sequences(seq_means, token_counts)
