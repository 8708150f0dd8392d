"""Reductions over the tokens a mask selects.

A mask has the shape of ``values`` (or broadcasts to it) and may be bool or float; it is
used as a float weight. In this package a mask value of 1 marks a model-generated token
and 0 marks padding or an environment token, so masks may have holes in the middle.

Empty selections never produce NaN: a mean over nothing is 0.
"""

from __future__ import annotations

import torch

Dim = int | tuple[int, ...] | None


def as_float_mask(mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``mask`` as a float tensor on ``like``'s device: float32, or float64 if ``like`` is.

    Never half precision: token counts in bf16 are inexact beyond 256, so reductions over
    bf16/fp16 values are carried out (and returned) in float32.
    """
    dtype = torch.float64 if like.dtype == torch.float64 else torch.float32
    return mask.to(device=like.device, dtype=dtype)


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: Dim = None) -> torch.Tensor:
    """Sum of ``values * mask`` over ``dim`` (all elements when ``None``).

    Values outside the mask never leak in, even if they are NaN or inf.
    """
    mask = as_float_mask(mask, values)
    selected = torch.where(mask != 0, values, torch.zeros((), dtype=values.dtype, device=values.device))
    if dim is None:
        return (selected * mask).sum()
    return (selected * mask).sum(dim=dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: Dim = None) -> torch.Tensor:
    """``masked_sum / mask.sum()`` over ``dim``; 0 where the mask selects nothing."""
    mask = as_float_mask(mask, values)
    total = masked_sum(values, mask, dim)
    count = mask.sum() if dim is None else mask.sum(dim=dim)
    return total / torch.where(count != 0, count, torch.ones_like(count))


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of the selected values (a scalar over the whole tensor).

    With ``unbiased=True`` the Bessel factor ``n / (n - 1)`` is applied, ``n = mask.sum()``.
    When ``n <= 1`` that factor is undefined; the biased variance is returned instead
    (0 for a single value, 0 for an empty selection) rather than raising.
    """
    mask = as_float_mask(mask, values)
    mean = masked_mean(values, mask)
    variance = masked_mean((values - mean) ** 2, mask)
    if unbiased:
        count = mask.sum()
        # torch.where instead of an `if` keeps this free of a device-to-host sync.
        has_two = count > 1
        denominator = torch.where(has_two, count - 1, torch.ones_like(count))
        bessel = torch.where(has_two, count / denominator, torch.ones_like(count))
        variance = variance * bessel
    return variance


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """``(values - mean) * rsqrt(var + 1e-8)`` with mean and unbiased var over the mask.

    With ``shift_mean=False`` the mean is added back after scaling. Every element is
    transformed (masked-out ones too); multiply by the mask if they must be 0.
    """
    mask = as_float_mask(mask, values)
    mean = masked_mean(values, mask)
    variance = masked_var(values, mask, unbiased=True)
    whitened = (values - mean) * torch.rsqrt(variance + 1e-8)
    if not shift_mean:
        whitened = whitened + mean
    return whitened
