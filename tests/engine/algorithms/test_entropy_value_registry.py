"""Entropy, value loss and the registries' errors."""

import math

import pytest
import torch

from opentinker.engine.algorithms import (
    ADVANTAGE_ESTIMATORS,
    POLICY_LOSSES,
    compute_value_loss,
    entropy_from_logits,
    get_advantage_estimator,
    get_policy_loss,
    register_advantage_estimator,
    register_policy_loss,
)
from opentinker.engine.algorithms import advantages as advantages_module
from opentinker.engine.algorithms import policy_losses as policy_losses_module


def test_entropy_hand_values():
    logits = torch.tensor([[[0.0, 0.0, 0.0, 0.0], [0.0, math.log(3.0), -1e9, -1e9]]])
    # uniform over 4 -> ln 4; p = (1/4, 3/4, 0, 0) -> -(.25 ln .25 + .75 ln .75) = 0.5623351
    torch.testing.assert_close(entropy_from_logits(logits), torch.tensor([[1.3862944, 0.5623351]]))


def test_entropy_is_stable_for_peaked_logits():
    out = entropy_from_logits(torch.tensor([[1000.0, 0.0, -1000.0]]))
    assert torch.isfinite(out).all() and abs(out.item()) < 1e-6


def test_value_loss_clipping():
    # c = 0.2. t0: clipped pred 0.5 + 0.2 = 0.7 -> max((1-2)^2, (0.7-2)^2) = 1.69 (clipped)
    #          t1: clipped pred 2.5 - 0.2 = 2.3 -> max(0, 0.09) = 0.09 (clipped)
    #          t2: clipped pred 2.7 -> max((3-2)^2 = 1, 0.49) = 1 (not clipped); t3 padding
    vpreds = torch.tensor([[1.0, 2.0, 3.0, 50.0]], requires_grad=True)
    values = torch.tensor([[0.5, 2.5, 2.5, 0.0]])
    returns = torch.tensor([[2.0, 2.0, 2.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    vf_loss, vf_clipfrac = compute_value_loss(vpreds, values, returns, mask, cliprange_value=0.2)
    assert vf_loss.item() == pytest.approx(0.5 * (1.69 + 0.09 + 1.0) / 3, abs=1e-6)
    assert vf_clipfrac == pytest.approx(2 / 3)
    vf_loss.backward()
    # only t2 is unclipped: 0.5 * 2 * (3 - 2) / 3
    torch.testing.assert_close(vpreds.grad, torch.tensor([[0.0, 0.0, 1 / 3, 0.0]]))


def test_value_loss_seq_mean_token_sum():
    vpreds = torch.tensor([[1.0, 2.0]])
    vf_loss, _ = compute_value_loss(vpreds, vpreds, torch.tensor([[0.0, 0.0]]), torch.ones(1, 2), 0.5,
                                    "seq-mean-token-sum")
    assert vf_loss.item() == pytest.approx(0.5 * (1.0 + 4.0))


def test_unknown_names_suggest_the_closest():
    with pytest.raises(ValueError, match=r"'grop'.*Did you mean 'grpo'\?.*rloo") as error:
        get_advantage_estimator("grop")
    assert "grpo_weighted_add" in str(error.value)
    with pytest.raises(ValueError, match=r"'vanila'.*Did you mean 'vanilla'\?.*gspo, cispo"):
        get_policy_loss("vanila")
    with pytest.raises(ValueError, match=r"'zzz'.*Valid names") as error:
        get_policy_loss("zzz")
    assert "Did you mean" not in str(error.value)


def test_registered_names():
    expected = {"gae", "grpo", "grpo_weighted_add", "grpo_weighted_mul", "rloo"}
    expected |= {"reinforce_plus_plus", "reinforce_plus_plus_baseline"}
    assert set(ADVANTAGE_ESTIMATORS) >= expected
    assert tuple(POLICY_LOSSES)[:3] == ("vanilla", "gspo", "cispo")
    assert "grpo" in ADVANTAGE_ESTIMATORS and "nope" not in POLICY_LOSSES


def test_register_new_estimator_and_conflicts():
    name = "test_only_constant_estimator"
    try:

        @register_advantage_estimator(name)
        def constant(token_rewards, response_mask, group_index, **_):
            return response_mask.float(), response_mask.float(), {}

        assert name in ADVANTAGE_ESTIMATORS  # the name list is live
        assert get_advantage_estimator(name) is constant
        register_advantage_estimator(name)(constant)  # same function again: fine
        with pytest.raises(ValueError, match="already registered"):
            register_advantage_estimator(name)(lambda *a, **k: None)
    finally:
        advantages_module._REGISTRY._functions.pop(name, None)
    assert name not in ADVANTAGE_ESTIMATORS


def test_register_new_policy_loss():
    name = "test_only_zero_loss"
    try:
        register_policy_loss(name)(lambda old, logprob, adv, mask, **k: (torch.zeros_like(logprob), {}, mask))
        assert name in POLICY_LOSSES
        with pytest.raises(ValueError, match="already registered"):
            register_policy_loss(name)(lambda *a, **k: None)
        register_policy_loss(name, override=True)(lambda *a, **k: None)
    finally:
        policy_losses_module._REGISTRY._functions.pop(name, None)
