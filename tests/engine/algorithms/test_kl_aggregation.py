"""KL estimators and loss aggregation, against hand-computed values."""

import pytest
import torch

from opentinker.engine.algorithms import KL_KINDS, LOSS_AGG_MODES, agg_loss, kl_penalty

# lp - ref = 0.5, -1, 30, -2, -3, -25   (so ref - lp = -0.5, 1, -30, 2, 3, 25)
LOGPROB = torch.tensor([[-1.0, -2.0, 0.0, -3.0, -4.0, -30.0]])
REF = torch.tensor([[-1.5, -1.0, -30.0, -1.0, -1.0, -5.0]])


def test_k1_abs_k2():
    torch.testing.assert_close(kl_penalty(LOGPROB, REF, "k1"), torch.tensor([[0.5, -1.0, 30.0, -2.0, -3.0, -25.0]]))
    torch.testing.assert_close(kl_penalty(LOGPROB, REF, "abs"), torch.tensor([[0.5, 1.0, 30.0, 2.0, 3.0, 25.0]]))
    torch.testing.assert_close(
        kl_penalty(LOGPROB, REF, "k2"), torch.tensor([[0.125, 0.5, 450.0, 2.0, 4.5, 312.5]])
    )


def test_k3_with_both_clamps():
    # exp(d) - d - 1 with d = ref - lp clamped to [-20, 20], result clamped to [-10, 10]:
    # d=-0.5 -> 0.1065307; d=1 -> e - 2; d=-30 -> -20 -> exp(-20) + 19 -> 10;
    # d=2 -> e^2 - 3; d=3 -> e^3 - 4 = 16.09 -> 10; d=25 -> 20 -> huge -> 10
    expected = torch.tensor([[0.1065307, 0.7182818, 10.0, 4.3890561, 10.0, 10.0]])
    torch.testing.assert_close(kl_penalty(LOGPROB, REF, "k3"), expected)


@pytest.mark.parametrize(("alias", "name"), [("kl", "k1"), ("mse", "k2"), ("low_var_kl", "k3")])
def test_aliases_are_identical(alias, name):
    assert torch.equal(kl_penalty(LOGPROB, REF, alias), kl_penalty(LOGPROB, REF, name))


def test_kl_kinds_lists_every_name():
    assert set(KL_KINDS) == {"k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl"}
    for kind in KL_KINDS:
        assert torch.isfinite(kl_penalty(LOGPROB, REF, kind)).all()


def test_unknown_kl_kind():
    with pytest.raises(ValueError, match=r"'low_var'.*'low_var_kl'"):
        kl_penalty(LOGPROB, REF, "low_var")


LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
# row 0 keeps 1, 2 (sum 3, mean 1.5); row 1 keeps all (sum 15, mean 5); row 2 is empty
AGG_MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token-mean", 18.0 / 5.0),
        ("seq-mean-token-sum", (3.0 + 15.0) / 2.0),  # the empty row is left out
        ("seq-mean-token-mean", (1.5 + 5.0) / 2.0),
        ("seq-mean-token-sum-norm", 18.0 / 3.0),  # divided by T only, not by the sequence count
    ],
)
def test_agg_modes(mode, expected):
    assert agg_loss(LOSS, AGG_MASK, mode).item() == pytest.approx(expected)
    assert agg_loss(LOSS, AGG_MASK.bool(), mode).item() == pytest.approx(expected)


def test_seq_mean_token_sum_norm_scale_factor():
    assert agg_loss(LOSS, AGG_MASK, "seq-mean-token-sum-norm", loss_scale_factor=4).item() == pytest.approx(4.5)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_all_zero_mask_gives_zero_loss_and_zero_grad(mode):
    loss_mat = LOSS.clone().requires_grad_(True)
    loss = agg_loss(loss_mat, torch.zeros(3, 3), mode)
    assert loss.item() == 0.0
    loss.backward()
    assert torch.all(loss_mat.grad == 0.0)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_masked_out_nan_does_not_leak(mode):
    loss_mat = LOSS.clone()
    loss_mat[0, 2] = float("nan")
    loss_mat[2, :] = float("inf")
    assert torch.isfinite(agg_loss(loss_mat, AGG_MASK, mode))


def test_seq_mean_token_mean_gradient():
    loss_mat = LOSS.clone().requires_grad_(True)
    agg_loss(loss_mat, AGG_MASK, "seq-mean-token-mean").backward()
    # row 0: 1 / (2 sequences * 2 tokens); row 1: 1 / (2 * 3)
    expected = torch.tensor([[0.25, 0.25, 0.0], [1 / 6, 1 / 6, 1 / 6], [0.0, 0.0, 0.0]])
    torch.testing.assert_close(loss_mat.grad, expected)


def test_unknown_agg_mode():
    with pytest.raises(ValueError, match=r"'token_mean'.*'token-mean'"):
        agg_loss(LOSS, AGG_MASK, "token_mean")
