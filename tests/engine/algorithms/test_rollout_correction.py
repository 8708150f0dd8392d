"""Rollout correction (truncated / masked importance sampling) against a numpy hand computation,
on ragged masks with environment-token holes."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from opentinker.engine.algorithms.rollout_correction import rollout_correction

# 3 rows: a full one, a short one, one with an environment turn (mask hole) in the middle.
MASK = np.array([[1, 1, 1, 1, 1],
                 [1, 1, 0, 0, 0],
                 [1, 1, 0, 0, 1]], dtype=np.float64)
OLD = np.array([[-0.5, -1.0, -0.2, -2.0, -0.1],
                [-1.5, -0.3, 0.0, 0.0, 0.0],
                [-0.7, -0.9, 0.0, 0.0, -1.2]])
ROLLOUT = np.array([[-0.6, -1.8, -0.2, -1.0, -0.1],
                    [-1.4, -0.3, 0.0, 0.0, 0.0],
                    [-0.1, -0.9, -3.0, -3.0, -1.0]])  # env tokens' values are ignored


def run(**options):
    return rollout_correction(torch.tensor(OLD), torch.tensor(ROLLOUT), torch.tensor(MASK), **options)


def by_hand_token_ratio():
    return np.exp((OLD - ROLLOUT) * MASK)


def test_token_level_truncated_weights_and_their_statistics():
    weights, rs_mask, metrics = run(rollout_is="token", is_threshold=1.5)
    ratio = by_hand_token_ratio()
    np.testing.assert_allclose(weights.numpy(), np.minimum(ratio, 1.5) * MASK, rtol=1e-12)
    assert rs_mask is None
    kept = ratio[MASK > 0]
    assert metrics["rollout_corr/rollout_is_mean"] == pytest.approx(kept.mean())
    assert metrics["rollout_corr/rollout_is_std"] == pytest.approx(kept.std())
    assert metrics["rollout_corr/rollout_is_max"] == pytest.approx(kept.max())
    assert metrics["rollout_corr/rollout_is_min"] == pytest.approx(kept.min())
    assert metrics["rollout_corr/rollout_is_eff_sample_size"] == pytest.approx(kept.mean() ** 2 / (kept ** 2).mean())
    assert metrics["rollout_corr/rollout_is_ratio_fraction_high"] == pytest.approx((kept > 1.5).mean())
    assert metrics["rollout_corr/kl"] == pytest.approx(((ROLLOUT - OLD) * MASK).sum() / MASK.sum())


def test_sequence_level_weight_is_the_product_over_model_tokens():
    weights, _, metrics = run(rollout_is="sequence", is_threshold=2.0)
    per_row = np.exp(((OLD - ROLLOUT) * MASK).sum(-1))
    np.testing.assert_allclose(weights.numpy(), np.minimum(per_row, 2.0)[:, None] * MASK, rtol=1e-12)
    assert metrics["rollout_corr/rollout_is_mean"] == pytest.approx(per_row.mean())
    assert metrics["rollout_corr/rollout_is_ratio_fraction_high"] == pytest.approx((per_row > 2.0).mean())


@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
def test_rejection_masks_what_leaves_the_interval(level):
    upper, lower = 1.3, 0.8
    _, rs_mask, metrics = run(rollout_rs=level, rs_upper=upper, rs_lower=lower)
    log_ratio = (OLD - ROLLOUT) * MASK
    if level == "token":
        ratio = np.exp(log_ratio)
    elif level == "sequence":
        ratio = np.exp(log_ratio.sum(-1))[:, None].repeat(5, 1)
    else:
        ratio = np.exp(log_ratio.sum(-1) / MASK.sum(-1))[:, None].repeat(5, 1)
    expected = ((ratio >= lower) & (ratio <= upper)) * MASK
    np.testing.assert_array_equal(rs_mask.numpy(), expected)
    assert 0 < expected.sum() < MASK.sum()  # the case tests something on both sides
    assert metrics["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(1 - expected.sum() / MASK.sum())


def test_default_lower_bound_is_the_reciprocal_and_far_ratios_do_not_overflow():
    old = torch.tensor([[0.0, -200.0]])
    rollout = torch.tensor([[-200.0, 0.0]])
    weights, rs_mask, metrics = rollout_correction(old, rollout, torch.ones(1, 2), rollout_is="token",
                                                   is_threshold=3.0, rollout_rs="token", rs_upper=4.0)
    assert torch.equal(weights, torch.tensor([[3.0, math.exp(-20.0)]], dtype=weights.dtype))
    assert torch.equal(rs_mask, torch.zeros(1, 2))  # e^20 > 4, e^-20 < 1/4
    assert all(math.isfinite(v) for v in metrics.values())


def test_identical_policies_give_unit_weights_and_keep_everything():
    weights, rs_mask, metrics = rollout_correction(
        torch.tensor(OLD), torch.tensor(OLD), torch.tensor(MASK), rollout_is="sequence", rollout_rs="token",
        rs_upper=1.0001)
    np.testing.assert_array_equal(weights.numpy(), MASK)
    np.testing.assert_array_equal(rs_mask.numpy(), MASK)
    assert metrics["rollout_corr/kl"] == 0.0
