"""Entropy of the policy's next-token distribution, from raw logits."""

from __future__ import annotations

import torch


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Shannon entropy (nats) of ``softmax(logits)`` over the last dim: ``[..., V] -> [...]``.

    Computed as ``logsumexp(logits) - sum(softmax(logits) * logits)``, which never takes the
    log of a probability, so it stays finite for very peaked distributions. Logits must be
    finite (a ``-inf`` logit makes ``0 * -inf`` = NaN). Differentiable w.r.t. ``logits``.
    """
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(dim=-1)
