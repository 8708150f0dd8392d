"""Masked reductions, checked against values worked out by hand."""

import math

import pytest
import torch

from opentinker.engine.algorithms import masked_mean, masked_sum, masked_var, masked_whiten

VALUES = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
# selects 1, 3 and 5: sum 9, mean 3, squared deviations 4 + 0 + 4 = 8
MASK = torch.tensor([[1.0, 0.0, 1.0], [0.0, 1.0, 0.0]])


def test_sum_and_mean_over_everything_and_per_row():
    assert masked_sum(VALUES, MASK).item() == pytest.approx(9.0)
    assert masked_mean(VALUES, MASK).item() == pytest.approx(3.0)
    torch.testing.assert_close(masked_sum(VALUES, MASK, dim=-1), torch.tensor([4.0, 5.0]))
    torch.testing.assert_close(masked_mean(VALUES, MASK, dim=-1), torch.tensor([2.0, 5.0]))


def test_bool_mask_equals_float_mask():
    assert masked_mean(VALUES, MASK.bool()).item() == pytest.approx(3.0)
    assert masked_var(VALUES, MASK.bool()).item() == pytest.approx(4.0)


def test_empty_selection_gives_zero_not_nan():
    empty = torch.zeros_like(MASK)
    assert masked_mean(VALUES, empty).item() == 0.0
    torch.testing.assert_close(masked_mean(VALUES, torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]]), dim=-1),
                               torch.tensor([1.5, 0.0]))
    assert masked_var(VALUES, empty).item() == 0.0


def test_masked_out_nan_does_not_leak():
    values = torch.tensor([[1.0, float("nan"), 3.0]])
    mask = torch.tensor([[1.0, 0.0, 1.0]])
    assert masked_sum(values, mask).item() == pytest.approx(4.0)
    assert masked_mean(values, mask).item() == pytest.approx(2.0)


def test_variance_unbiased_and_biased():
    assert masked_var(VALUES, MASK).item() == pytest.approx(4.0)  # 8 / (3 - 1)
    assert masked_var(VALUES, MASK, unbiased=False).item() == pytest.approx(8.0 / 3.0)
    # a single selected value: the Bessel factor is undefined, the biased variance (0) is returned
    assert masked_var(VALUES, torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 0.0]])).item() == 0.0


def test_whiten_with_and_without_mean_shift():
    # (x - 3) / sqrt(4 + 1e-8); the masked-out entries are transformed too
    expected = torch.tensor([[-1.0, -0.5, 0.0], [0.5, 1.0, 1.5]])
    torch.testing.assert_close(masked_whiten(VALUES, MASK), expected)
    torch.testing.assert_close(masked_whiten(VALUES, MASK, shift_mean=False), expected + 3.0)


def test_whiten_constant_values_is_zero_and_finite():
    out = masked_whiten(torch.full((2, 2), 7.0), torch.ones(2, 2))
    assert torch.all(out == 0.0)


def test_inputs_are_not_modified():
    values, mask = VALUES.clone(), MASK.clone()
    masked_whiten(values, mask, shift_mean=False)
    masked_var(values, mask)
    assert torch.equal(values, VALUES) and torch.equal(mask, MASK)


def test_whiten_matches_hand_value_for_two_points():
    out = masked_whiten(torch.tensor([[0.0, 1.0]]), torch.ones(1, 2))
    # mean 0.5, unbiased var 0.5
    torch.testing.assert_close(out, torch.tensor([[-0.5 / math.sqrt(0.5), 0.5 / math.sqrt(0.5)]]))


def test_half_precision_values_are_reduced_in_float32():
    # 1001 tokens: a bf16 token count would round 1001 to 1000
    values = torch.ones(1, 1001, dtype=torch.bfloat16)
    values[0, 0] = 0.0
    out = masked_mean(values, torch.ones(1, 1001))
    assert out.dtype == torch.float32
    assert out.item() == pytest.approx(1000 / 1001, abs=1e-7)
