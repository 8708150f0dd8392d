"""Advantage estimators against values worked out by hand from their formulas."""

import numpy as np
import pytest
import torch

from opentinker.engine.algorithms import ADVANTAGE_ESTIMATORS, get_advantage_estimator

# Hand values used below:
#   rewards [1, 0, 0, 1]: mean 0.5, unbiased std sqrt(1/3) = 0.5773503
#       -> +-0.5 / (0.5773503 + 1e-6) = +-0.8660239
#   rewards {2, 0}: mean 1, unbiased std sqrt(2) -> +-1 / (1.4142136 + 1e-6) = +-0.7071063
#   single sample with score 5: mean 0, std 1 -> 5 / (1 + 1e-6) = 4.999995


def _outcome(scores, mask):
    """token_rewards with each score on the last mask=1 token."""
    mask = torch.as_tensor(mask, dtype=torch.float32)
    rewards = torch.zeros_like(mask)
    for row, score in enumerate(scores):
        last = int(mask[row].nonzero().max())
        rewards[row, last] = score
    return rewards, mask


def _estimate(name, *args, **kwargs):
    return get_advantage_estimator(name)(*args, **kwargs)


def test_grpo_single_group():
    rewards, mask = _outcome([1.0, 0.0, 0.0, 1.0], torch.ones(4, 3))
    adv, ret, metrics = _estimate("grpo", rewards, mask, ["p"] * 4)
    expected = torch.tensor([0.8660239, -0.8660239, -0.8660239, 0.8660239]).unsqueeze(-1).expand(4, 3)
    torch.testing.assert_close(adv, expected)
    torch.testing.assert_close(ret, expected)
    assert adv.dtype == torch.float32
    assert isinstance(metrics, dict)


# three interleaved groups: 7 -> scores {2, 0}; 3 -> {1, 1} (all equal); 9 -> {5} (size one).
# Masks have holes (environment tokens) and different lengths.
INTERLEAVED_MASK = [[1, 1, 0, 1], [1, 0, 0, 0], [1, 0, 1, 1], [1, 1, 1, 1], [0, 1, 1, 0]]
INTERLEAVED_SCORES = [2.0, 1.0, 0.0, 1.0, 5.0]
GRPO_PER_SAMPLE = [0.7071063, 0.0, -0.7071063, 0.0, 4.999995]
DR_GRPO_PER_SAMPLE = [1.0, 0.0, -1.0, 0.0, 5.0]


@pytest.mark.parametrize(
    "group_index",
    [
        [7, 3, 7, 3, 9],
        ("b", "a", "b", "a", "c"),
        np.array(["b", "a", "b", "a", "c"]),
        np.array([7, 3, 7, 3, 9]),
        torch.tensor([7, 3, 7, 3, 9]),
    ],
)
def test_grpo_interleaved_groups_equal_rewards_and_singletons(group_index):
    rewards, mask = _outcome(INTERLEAVED_SCORES, INTERLEAVED_MASK)
    adv, ret, _ = _estimate("grpo", rewards, mask, group_index)
    torch.testing.assert_close(adv, torch.tensor(GRPO_PER_SAMPLE).unsqueeze(-1) * mask)
    torch.testing.assert_close(ret, adv)


def test_dr_grpo_does_not_divide_by_std():
    rewards, mask = _outcome(INTERLEAVED_SCORES, INTERLEAVED_MASK)
    adv, _, _ = _estimate("grpo", rewards, mask, [7, 3, 7, 3, 9], norm_adv_by_std_in_grpo=False)
    torch.testing.assert_close(adv, torch.tensor(DR_GRPO_PER_SAMPLE).unsqueeze(-1) * mask)


def test_grpo_epsilon_option():
    rewards, mask = _outcome([1.0, 0.0], torch.ones(2, 1))
    # std of {1, 0} is sqrt(0.5) = 0.7071068; with epsilon 1: 0.5 / 1.7071068 = 0.2928932
    adv, _, _ = _estimate("grpo", rewards, mask, [0, 0], epsilon=1.0)
    torch.testing.assert_close(adv, torch.tensor([[0.2928932], [-0.2928932]]))


def test_rloo():
    # group "a": [1, 0, 0, 1] -> s*4/3 - 0.5*4/3 = +-2/3 (= s - mean of the other three)
    # group "b": {2, 0} -> 2*2 - 1*2 = 2 and -2 ; group "c": single -> passes through (3)
    scores = [1.0, 2.0, 0.0, 3.0, 0.0, 1.0, 0.0]
    group_index = ["a", "b", "a", "c", "a", "a", "b"]
    rewards, mask = _outcome(scores, [[1, 1], [1, 0], [1, 1], [0, 1], [1, 1], [1, 1], [1, 1]])
    adv, ret, _ = _estimate("rloo", rewards, mask, group_index)
    per_sample = torch.tensor([2 / 3, 2.0, -2 / 3, 3.0, -2 / 3, 2 / 3, -2.0])
    torch.testing.assert_close(adv, per_sample.unsqueeze(-1) * mask)
    torch.testing.assert_close(ret, adv)


def test_reinforce_plus_plus_discounting_and_whitening():
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    adv, ret, _ = _estimate("reinforce_plus_plus", rewards, mask, None, gamma=0.5)
    # returns: row 0 [0.25, 0.5, 1]; row 1 [1, 2, 0]
    torch.testing.assert_close(ret, torch.tensor([[0.25, 0.5, 1.0], [1.0, 2.0, 0.0]]))
    # whitened over the five model tokens: mean 0.95, unbiased var 1.8 / 4 = 0.45
    expected = torch.tensor([[-1.0434984, -0.6708204, 0.0745356], [0.0745356, 1.5652476, 0.0]])
    torch.testing.assert_close(adv, expected)


def test_reinforce_plus_plus_resets_at_environment_tokens():
    # verl's order: running = r + gamma*running; returns_t = running; running *= mask_t.
    # Backwards: t2 -> 1; t1 (env token) -> 1, then reset to 0; t0 -> 0.
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    mask = torch.tensor([[1.0, 0.0, 1.0]])
    adv, ret, _ = _estimate("reinforce_plus_plus", rewards, mask, None)
    torch.testing.assert_close(ret, torch.tensor([[0.0, 0.0, 1.0]]))  # 0 on the env token
    # model-token returns {0, 1}: mean 0.5, unbiased std sqrt(0.5)
    torch.testing.assert_close(adv, torch.tensor([[-0.7071068, 0.0, 0.7071068]]))


def test_reinforce_plus_plus_baseline():
    # groups a: {1, 0} -> +-0.5; b: single score 3, baseline 0 -> 3
    rewards, mask = _outcome([1.0, 0.0, 3.0], [[1, 1], [1, 0], [1, 1]])
    adv, ret, _ = _estimate("reinforce_plus_plus_baseline", rewards, mask, ["a", "a", "b"])
    # tokens .5 .5 -.5 3 3: mean 1.3, unbiased var 10.3 / 4 = 2.575
    expected = torch.tensor([[-0.4985416, -0.4985416], [-1.1217185, 0.0], [1.0594008, 1.0594008]])
    torch.testing.assert_close(adv, expected)
    torch.testing.assert_close(ret, adv)


def test_gae_skips_environment_tokens():
    rewards = torch.tensor([[0.0, 0.0, 0.0, 1.0], [0.0, 2.0, 0.0, 0.0]])
    values = torch.tensor([[1.0, 2.0, 3.0, 4.0], [0.5, 0.5, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 0.0, 1.0, 1.0], [1.0, 1.0, 0.0, 0.0]])
    adv, ret, _ = _estimate("gae", rewards, mask, None, values=values, gamma=0.9, lam=0.8)
    # row 0 backwards: t3 delta = 1 - 4 = -3 -> -3; t2 delta = 0.9*4 - 3 = 0.6 -> 0.6 + 0.72*(-3) = -1.56;
    #   t1 env token: carries (next value 3, gae -1.56); t0 delta = 0.9*3 - 1 = 1.7 -> 1.7 + 0.72*(-1.56) = 0.5768
    # row 1: t3, t2 padding (carry zeros); t1 delta = 2 - 0.5 = 1.5; t0 delta = 0.45 - 0.5 -> -0.05 + 0.72*1.5 = 1.03
    torch.testing.assert_close(ret, torch.tensor([[1.5768, 0.0, 1.44, 1.0], [1.53, 2.0, 0.0, 0.0]]))
    # whitened over {0.5768, -1.56, -3, 1.03, 1.5}: mean -0.29064, unbiased var 3.66371
    expected = torch.tensor([[0.4531885, 0.0, -0.6631691, -1.4154879], [0.6899600, 0.9355085, 0.0, 0.0]])
    torch.testing.assert_close(adv, expected)


def test_gae_requires_values():
    rewards, mask = _outcome([1.0], [[1, 1]])
    with pytest.raises(ValueError, match="values"):
        _estimate("gae", rewards, mask, None)


# --- creativity estimators -----------------------------------------------------------------

LABELS = ["a", "a", "a", "b", "b", "c", "d", "d"]
SCORES8 = [1.0, 1.0, 0.0, 1.0, 0.0, 1.0, 0.0, 0.0]
# GRPO over 8 samples, 4 ones: mean 0.5, unbiased std sqrt(2/7) -> A = +-0.5/(0.5345225 + 1e-6) = +-0.9354126
# weights: a -> 3^-0.7 = 0.4634631, b and d -> 2^-0.7 = 0.6155722, c -> 1
A8, WA, WB = 0.9354126, 0.4634631, 0.6155722


def test_grpo_weighted_add():
    rewards, mask = _outcome(SCORES8, torch.ones(8, 2))
    adv, ret, metrics = _estimate("grpo_weighted_add", rewards, mask, ["q"] * 8, strategy_labels=LABELS)
    per_sample = torch.tensor([A8 + WA, A8 + WA, -A8 + WA, A8 + WB, -A8 + WB, A8 + 1.0, -A8 + WB, -A8 + WB])
    torch.testing.assert_close(adv, per_sample.unsqueeze(-1).expand(8, 2))
    torch.testing.assert_close(ret, adv)
    assert metrics["creativity/weight_mean"] == pytest.approx((3 * WA + 4 * WB + 1.0) / 8, abs=1e-6)
    assert metrics["creativity/weight_min"] == pytest.approx(WA, abs=1e-6)
    assert metrics["creativity/weight_max"] == pytest.approx(1.0)
    assert metrics["creativity/distinct_strategies_mean"] == pytest.approx(4.0)
    assert all(isinstance(value, float) for value in metrics.values())


def test_grpo_weighted_mul():
    rewards, mask = _outcome(SCORES8, [[1, 1, 1]] * 4 + [[1, 0, 1]] * 4)
    adv, _, _ = _estimate("grpo_weighted_mul", rewards, mask, np.array(["q"] * 8), strategy_labels=np.array(LABELS))
    per_sample = torch.tensor([A8 * WA, A8 * WA, -A8 * WA, A8 * WB, -A8 * WB, A8, -A8 * WB, -A8 * WB])
    torch.testing.assert_close(adv, per_sample.unsqueeze(-1) * mask)


def test_grpo_weighted_counts_labels_per_group_and_none_is_weight_one():
    # group 0: scores [1, 0, 0] -> (2/3, -1/3, -1/3) / (sqrt(1/3) + 1e-6) = 1.1546985, -0.5773493, -0.5773493
    # group 1: all 1 -> 0. Label "x" twice in group 0 (weight 2^-1 = 0.5), once in group 1 (weight 1).
    group_index = [0, 1, 0, 1, 0, 1]
    labels = ["x", "x", "x", None, "y", None]
    rewards, mask = _outcome([1.0, 1.0, 0.0, 1.0, 0.0, 1.0], torch.ones(6, 1))
    adv, _, metrics = _estimate(
        "grpo_weighted_mul", rewards, mask, group_index, strategy_labels=labels, weight_power=1.0
    )
    torch.testing.assert_close(adv[:, 0], torch.tensor([1.1546985 * 0.5, 0.0, -0.5773493 * 0.5, 0.0, -0.5773493, 0.0]))
    assert metrics["creativity/weight_min"] == pytest.approx(0.5)
    assert metrics["creativity/weight_mean"] == pytest.approx((0.5 + 0.5 + 4 * 1.0) / 6)
    # distinct non-None labels: group 0 {x, y} = 2, group 1 {x} = 1
    assert metrics["creativity/distinct_strategies_mean"] == pytest.approx(1.5)

    adv_add, _, _ = _estimate(
        "grpo_weighted_add",
        rewards,
        mask,
        group_index,
        strategy_labels=labels,
        weight_power=1.0,
        norm_adv_by_std_in_grpo=False,
    )
    # Dr.GRPO: group 0 -> 2/3, -1/3, -1/3; then + weight
    torch.testing.assert_close(adv_add[:, 0], torch.tensor([2 / 3 + 0.5, 1.0, -1 / 3 + 0.5, 1.0, -1 / 3 + 1.0, 1.0]))


@pytest.mark.parametrize("name", ["grpo_weighted_add", "grpo_weighted_mul"])
def test_grpo_weighted_needs_labels_of_the_right_length(name):
    rewards, mask = _outcome(SCORES8, torch.ones(8, 2))
    with pytest.raises(ValueError, match="strategy_labels"):
        _estimate(name, rewards, mask, ["q"] * 8)
    with pytest.raises(ValueError, match=r"strategy_labels.*expected 8, got 7"):
        _estimate(name, rewards, mask, ["q"] * 8, strategy_labels=LABELS[:7])


# --- properties shared by every estimator ---------------------------------------------------

COMMON_KWARGS = {
    "gamma": 0.9,
    "lam": 0.95,
    "epsilon": 1e-6,
    "norm_adv_by_std_in_grpo": True,
    "weight_power": 0.7,
    "strategy_labels": ["s", "t", "s", None],
    "values": torch.tensor([[0.1, 0.2, 0.3], [0.0, 0.5, 0.1]] * 2),
    "some_option_only_another_estimator_uses": 123,
}


@pytest.mark.parametrize("name", list(ADVANTAGE_ESTIMATORS))
def test_every_estimator_accepts_common_kwargs_is_masked_and_pure(name):
    rewards, mask = _outcome([1.0, 0.0, 0.5, 2.0], [[1, 0, 1], [1, 1, 0], [0, 1, 1], [1, 1, 1]])
    group_index = ["g1", "g1", "g2", "g2"]
    rewards_before, mask_before, values_before = rewards.clone(), mask.clone(), COMMON_KWARGS["values"].clone()
    adv, ret, metrics = _estimate(name, rewards, mask.bool(), group_index, **COMMON_KWARGS)
    assert adv.shape == ret.shape == (4, 3)
    assert adv.dtype == ret.dtype == torch.float32
    assert torch.all(adv[mask == 0] == 0) and torch.all(ret[mask == 0] == 0)
    assert torch.isfinite(adv).all() and torch.isfinite(ret).all()
    assert isinstance(metrics, dict) and all(isinstance(v, float) for v in metrics.values())
    assert torch.equal(rewards, rewards_before) and torch.equal(mask, mask_before)
    assert torch.equal(COMMON_KWARGS["values"], values_before)


def test_group_index_of_wrong_length():
    rewards, mask = _outcome([1.0, 0.0], torch.ones(2, 1))
    with pytest.raises(ValueError, match=r"group_index.*expected 2, got 3"):
        _estimate("grpo", rewards, mask, ["a", "a", "b"])


@pytest.mark.parametrize("name", ["grpo", "rloo", "grpo_weighted_mul"])
def test_equal_non_representable_rewards_give_exactly_zero(name):
    # 0.1 is not exact in binary; float32 rounding noise must not be divided by epsilon
    # (in float32, seven times 0.1 summed and divided by 7 is off by 7e-9)
    rewards, mask = _outcome([0.1] * 7, torch.ones(7, 2))
    adv, _, _ = _estimate(name, rewards, mask, ["g"] * 7, strategy_labels=list("abbcccc"))
    assert torch.all(adv == 0.0)


def test_empty_batch():
    for name in ("grpo", "grpo_weighted_add"):
        adv, ret, metrics = _estimate(name, torch.zeros(0, 3), torch.zeros(0, 3), [], strategy_labels=[])
        assert adv.shape == ret.shape == (0, 3)
        assert all(v == v for v in metrics.values())  # no NaN


def test_grpo_weighted_mul_positive_only_leaves_penalties_alone():
    # one group of 4: rewards [1, 1, 0, 0] -> mean 0.5, unbiased std 0.57735 -> A = [+0.866, +0.866, -0.866, -0.866]
    # labels [a, b, a, a]: counts a=3, b=1 -> w = [3^-0.7, 1, 3^-0.7, 3^-0.7] = [0.46346, 1, 0.46346, 0.46346]
    rewards = torch.tensor([[1.0], [1.0], [0.0], [0.0]])
    mask = torch.ones(4, 1)
    labels = ["a", "b", "a", "a"]
    from opentinker.engine.algorithms import get_advantage_estimator

    mul = get_advantage_estimator("grpo_weighted_mul")
    plain, _, _ = mul(rewards, mask, [0, 0, 0, 0], strategy_labels=labels)
    positive_only, _, _ = mul(rewards, mask, [0, 0, 0, 0], strategy_labels=labels, weight_positive_only=True)
    assert plain.squeeze(-1).tolist() == pytest.approx([0.866025 * 0.463463, 0.866025, -0.866025 * 0.463463,
                                                        -0.866025 * 0.463463], abs=1e-5)
    assert positive_only.squeeze(-1).tolist() == pytest.approx([0.866025 * 0.463463, 0.866025, -0.866025,
                                                                -0.866025], abs=1e-5)


@pytest.mark.parametrize("frequency", range(1, 9))
@pytest.mark.parametrize("combine", ["add", "mul"])
def test_weighted_estimators_for_every_strategy_frequency(frequency, combine):
    """n = 8 samples of one prompt; `frequency` of them share strategy "a", the rest are each unique.
    Rewards alternate 1, 0 so GRPO advantages are +-0.935414 (mean 0.5, unbiased std 0.534522)."""
    from opentinker.engine.algorithms import get_advantage_estimator

    rewards = torch.tensor([[1.0], [0.0]] * 4)
    labels = ["a"] * frequency + [f"unique{i}" for i in range(8 - frequency)]
    advantages, _, metrics = get_advantage_estimator(f"grpo_weighted_{combine}")(
        rewards, torch.ones(8, 1), [0] * 8, strategy_labels=labels)
    grpo = [0.935414 if i % 2 == 0 else -0.935414 for i in range(8)]
    weights = [frequency ** -0.7 if i < frequency else 1.0 for i in range(8)]  # e.g. 8 ** -0.7 = 0.233258
    expected = [a + w if combine == "add" else a * w for a, w in zip(grpo, weights)]
    assert advantages.squeeze(-1).tolist() == pytest.approx(expected, abs=1e-5)
    assert metrics["creativity/distinct_strategies_mean"] == 1 + (8 - frequency)


def test_unclassified_samples_weigh_one_as_with_classify_only_correct():
    """classify_only_correct gives incorrect samples no label (None): their weight is exactly 1."""
    from opentinker.engine.algorithms import get_advantage_estimator

    rewards = torch.tensor([[1.0], [1.0], [1.0], [0.0]])  # mean 0.75, std 0.5 -> A = [0.5, 0.5, 0.5, -1.5]
    labels = ["s0", "s0", "s1", None]  # weights [2^-0.7, 2^-0.7, 1, 1] = [0.615572, 0.615572, 1, 1]
    mul, _, _ = get_advantage_estimator("grpo_weighted_mul")(rewards, torch.ones(4, 1), [0] * 4, strategy_labels=labels)
    add, _, _ = get_advantage_estimator("grpo_weighted_add")(rewards, torch.ones(4, 1), [0] * 4, strategy_labels=labels)
    assert mul.squeeze(-1).tolist() == pytest.approx([0.307786, 0.307786, 0.5, -1.5], abs=1e-5)
    assert add.squeeze(-1).tolist() == pytest.approx([1.115572, 1.115572, 1.5, -0.5], abs=1e-5)
