"""Per-token KL estimators between the current policy and a reference policy.

Both inputs are log-probabilities of the sampled tokens, ``[batch, response_len]``. The
estimators are those of J. Schulman, "Approximating KL divergence" (2020); aliases name
the same estimator and give identical results.
"""

from __future__ import annotations

import torch

from opentinker.engine.algorithms.registry import unknown_name_error

KL_KINDS: tuple[str, ...] = ("k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl")


def kl_penalty(logprob: torch.Tensor, ref_logprob: torch.Tensor, kind: str) -> torch.Tensor:
    """Elementwise KL estimate; same shape as the inputs, not masked or reduced.

    - ``k1`` | ``kl``: ``lp - ref``
    - ``abs``: ``|lp - ref|``
    - ``k2`` | ``mse``: ``0.5 * (lp - ref)**2``
    - ``k3`` | ``low_var_kl``: with ``d = clamp(ref - lp, -20, 20)``,
      ``clamp(exp(d) - d - 1, -10, 10)`` -- non-negative, low variance, clamped for stability.
    """
    if kind in ("k1", "kl"):
        return logprob - ref_logprob
    if kind == "abs":
        return (logprob - ref_logprob).abs()
    if kind in ("k2", "mse"):
        return 0.5 * (logprob - ref_logprob).square()
    if kind in ("k3", "low_var_kl"):
        log_ratio = torch.clamp(ref_logprob - logprob, min=-20.0, max=20.0)
        estimate = torch.exp(log_ratio) - log_ratio - 1.0
        return torch.clamp(estimate, min=-10.0, max=10.0)
    raise unknown_name_error("KL kind", kind, KL_KINDS)
