"""Policy losses against hand-computed values, including gradients."""

import math

import pytest
import torch

from opentinker.engine.algorithms import POLICY_LOSSES, get_policy_loss

LN = math.log

# vanilla PPO, clip 0.2, dual clip c = 3. Per token (ratio, A):
#   t0 (1.1,  1): inside the clip           -> loss -1.1
#   t1 (1.5,  1): above 1.2, clipped         -> loss -1.2     (pg_clipfrac)
#   t2 (0.5, -1): below 0.8, clipped         -> loss  0.8     (pg_clipfrac)
#   t3 (4.0, -1): max(-A r, -A clip) = 4 > 3 -> dual clip 3   (pg_clipfrac_lower)
#   t4: padding (mask 0) with a huge ratio and advantage
RATIOS = [1.1, 1.5, 0.5, 4.0, 50.0]
ADVANTAGES = torch.tensor([[1.0, 1.0, -1.0, -1.0, 100.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0]])
OLD = torch.full((1, 5), -1.0)


def _logprob(old, ratios):
    return (old + torch.tensor([[LN(r) for r in ratios]])).requires_grad_(True)


def test_vanilla_clip_and_dual_clip():
    logprob = _logprob(OLD, RATIOS)
    loss, metrics = get_policy_loss("vanilla")(OLD, logprob, ADVANTAGES, MASK)
    assert loss.item() == pytest.approx((-1.1 - 1.2 + 0.8 + 3.0) / 4, abs=1e-6)
    assert metrics["pg_clipfrac"] == pytest.approx(2 / 4)
    assert metrics["pg_clipfrac_lower"] == pytest.approx(1 / 4)
    # ppo_kl = mean(-log ratio) = -(ln 1.1 + ln 1.5 + ln 0.5 + ln 4) / 4
    assert metrics["ppo_kl"] == pytest.approx(-0.2984806, abs=1e-6)
    assert all(isinstance(value, float) for value in metrics.values())

    loss.backward()
    # only t0 is unclipped: d(-A * exp(lp - old))/dlp = -A * ratio = -1.1, divided by 4 tokens
    torch.testing.assert_close(logprob.grad, torch.tensor([[-0.275, 0.0, 0.0, 0.0, 0.0]]))


def test_vanilla_asymmetric_clip_range():
    logprob = _logprob(OLD, RATIOS)
    # clip_ratio_high 0.6 lets t1 (ratio 1.5) through; the low side still uses clip_ratio (0.2)
    loss, metrics = get_policy_loss("vanilla")(OLD, logprob, ADVANTAGES, MASK, clip_ratio_high=0.6, unused_key=1)
    assert loss.item() == pytest.approx((-1.1 - 1.5 + 0.8 + 3.0) / 4, abs=1e-6)
    assert metrics["pg_clipfrac"] == pytest.approx(1 / 4)


def test_vanilla_seq_mean_token_sum():
    logprob = _logprob(OLD, RATIOS)
    loss, _ = get_policy_loss("vanilla")(OLD, logprob, ADVANTAGES, MASK, "seq-mean-token-sum")
    assert loss.item() == pytest.approx(-1.1 - 1.2 + 0.8 + 3.0, abs=1e-6)


def test_vanilla_rejects_dual_clip_bound_not_above_one():
    with pytest.raises(ValueError, match="clip_ratio_c"):
        get_policy_loss("vanilla")(OLD, _logprob(OLD, RATIOS), ADVANTAGES, MASK, clip_ratio_c=1.0)


def test_gspo_sequence_ratio():
    # row 0: log-ratios 0.1, 0.3 (0.5 on a padding token) -> s = 0.2, ratio e^0.2 = 1.2214028 on every
    #        token; A = 1 -> clipped to 1.2 -> loss -1.2 per token, both tokens count in pg_clipfrac
    # row 1: log-ratios -0.1, 0, 0.1 -> s = 0, ratio 1; A = -2 -> loss 2 per token
    old = torch.tensor([[-1.0, -2.0, -1.0], [-1.0, -1.0, -1.0]])
    logprob = (old + torch.tensor([[0.1, 0.3, 0.5], [-0.1, 0.0, 0.1]])).requires_grad_(True)
    advantages = torch.tensor([[1.0, 1.0, 1.0], [-2.0, -2.0, -2.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    # the mode passed in is ignored: always seq-mean-token-mean -> (-1.2 + 2) / 2
    loss, metrics = get_policy_loss("gspo")(old, logprob, advantages, mask, "token-mean")
    assert loss.item() == pytest.approx(0.4, abs=1e-6)
    assert metrics["pg_clipfrac"] == pytest.approx(2 / 5)
    assert metrics["ppo_kl"] == pytest.approx(-(0.1 + 0.3 - 0.1 + 0.0 + 0.1) / 5, abs=1e-6)
    assert metrics["pg_clipfrac_lower"] == 0.0

    loss.backward()
    # row 1: d(-A * ratio)/dlp = 2 * 1 per token, weighted 1/2 (sequences) * 1/3 (tokens); row 0 clipped
    torch.testing.assert_close(logprob.grad, torch.tensor([[0.0, 0.0, 0.0], [1 / 3, 1 / 3, 1 / 3]]))


def test_cispo_keeps_gradient_of_clipped_tokens():
    # ratios 1.5, 1, 0.5 -> clipped weights 1.2, 1, 0.8; A = 1, 1, -2
    old = torch.full((1, 4), -1.0)
    logprob = _logprob(old, [1.5, 1.0, 0.5, 9.0])
    advantages = torch.tensor([[1.0, 1.0, -2.0, 5.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    loss, metrics = get_policy_loss("cispo")(old, logprob, advantages, mask)
    # -w * A * lp with lp = -1 + ln 1.5, -1, -1 + ln 0.5:
    #   -1.2 * (-0.5945349) = 0.7134419; 1; -0.8 * -2 * (-1.6931472) = -2.7090355 -> mean -0.3318645
    assert loss.item() == pytest.approx(-0.3318645, abs=1e-6)
    assert metrics["pg_clipfrac"] == pytest.approx(2 / 3)
    assert metrics["ppo_kl"] == pytest.approx(-(LN(1.5) + LN(0.5)) / 3, abs=1e-6)
    assert metrics["pg_clipfrac_lower"] == 0.0

    loss.backward()
    # d/dlp = -w * A / 3 for every model token, clipped or not
    torch.testing.assert_close(logprob.grad, torch.tensor([[-0.4, -1 / 3, 1.6 / 3, 0.0]]))


def test_cispo_aggregation_mode_is_used():
    old = torch.full((1, 3), -1.0)
    logprob = _logprob(old, [1.5, 1.0, 0.5])
    loss, _ = get_policy_loss("cispo")(old, logprob, torch.tensor([[1.0, 1.0, -2.0]]), torch.ones(1, 3),
                                       "seq-mean-token-sum")
    assert loss.item() == pytest.approx(-0.9955936, abs=1e-6)


@pytest.mark.parametrize("name", list(POLICY_LOSSES))
def test_gradient_flows_into_logprob_only(name):
    old = torch.tensor([[-1.0, -0.5, -2.0]], requires_grad=True)
    logprob = torch.tensor([[-0.9, -0.7, -2.0]], requires_grad=True)
    advantages = torch.tensor([[1.0, -1.0, 0.5]], requires_grad=True)
    mask = torch.tensor([[True, True, False]])
    inputs_before = [t.detach().clone() for t in (old, logprob, advantages, mask)]
    loss, metrics = get_policy_loss(name)(old, logprob, advantages, mask, clip_ratio=0.2, foo="ignored")
    assert loss.dim() == 0 and set(metrics) == {"pg_clipfrac", "ppo_kl", "pg_clipfrac_lower"}
    loss.backward()
    assert logprob.grad is not None and logprob.grad[0, 2] == 0.0
    assert old.grad is None and advantages.grad is None
    for before, after in zip(inputs_before, (old, logprob, advantages, mask)):
        assert torch.equal(before, after.detach())


def test_a_registered_policy_loss_is_a_valid_config_value_and_trains_through_the_backend_loss():
    from opentinker.config import CHOICES, make_config
    from opentinker.engine.algorithms import policy_losses as module
    from opentinker.engine.algorithms import register_policy_loss
    from opentinker.engine.backend.losses import resolve_loss, weighted_loss
    from opentinker.engine.batch import TokenBatch

    name = "test_only_reinforce"

    @register_policy_loss(name)
    def reinforce(old_logprob, logprob, advantages, response_mask, **_):
        mask = response_mask.to(logprob.dtype)
        return -advantages * logprob, {"pg_clipfrac": torch.zeros_like(mask)}, mask

    try:
        assert make_config([f"actor_rollout_ref.actor.policy_loss={name}"]).actor_rollout_ref.actor.policy_loss == name
        batch = TokenBatch.from_responses([[1], [2]], [[3, 4, 5], [6, 7]])
        batch.tensors["advantages"] = batch.pad_response_values([[1.0, 1.0, 1.0], [-2.0, -2.0]])
        logprobs = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.25, 0.0]], requires_grad=True)
        spec, config = resolve_loss("rl_policy", {"policy_loss": name})
        out = weighted_loss(spec, config, logprobs, None, batch, torch.device("cpu"))
        out.loss.backward()
        assert out.metrics["loss:sum"] == pytest.approx(6.0 - 1.5)  # -(1 x -6) - (-2 x -0.75)
        assert logprobs.grad.tolist() == [[-1.0, -1.0, -1.0], [2.0, 2.0, 0.0]]
        aggregated, _ = get_policy_loss(name)(logprobs.detach(), logprobs.detach(), batch.tensors["advantages"],
                                              batch.response_mask)
        assert float(aggregated) == pytest.approx(4.5 / 5)  # token-mean over the 5 model tokens
    finally:
        module._REGISTRY._functions.pop(name, None)
        CHOICES["actor_rollout_ref.actor.policy_loss"].remove(name)
