"""Advantage estimators: a registry of pure functions with one signature.

``fn(token_rewards, response_mask, group_index, **cfg) -> (advantages, returns, metrics)``

- ``token_rewards`` [B, T] float: per-token rewards. For outcome rewards the scalar sits on
  the last mask=1 token, and outcome estimators use ``scores = token_rewards.sum(-1)``.
- ``response_mask`` [B, T] bool or float: 1 = model token, 0 = padding or environment
  token (masks may have holes in multi-turn rollouts).
- ``group_index``: length-B sequence (list, tuple, numpy array or tensor) of hashable prompt
  ids (str or int). Samples sharing an id are the n samples of one prompt. Groups are
  numbered in order of first appearance, so nothing depends on hashing order.
- ``**cfg``: estimator options; every estimator ignores options it does not use, so a
  trainer may pass one common kwargs dict.

Returns ``advantages`` and ``returns`` as float32 [B, T], both 0 wherever the mask is 0,
and ``metrics``, a ``dict[str, float]`` (possibly empty). No gradient flows out and the
inputs are never modified.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any

import numpy as np
import torch

from opentinker.engine.algorithms.masked import masked_whiten
from opentinker.engine.algorithms.registry import RegisteredNames, Registry
from opentinker.recipe.estimators import EstimatorNeeds, declare_estimator

AdvantageOutput = tuple[torch.Tensor, torch.Tensor, dict[str, float]]
AdvantageEstimatorFn = Callable[..., AdvantageOutput]
GroupIndex = Sequence[Hashable] | np.ndarray | torch.Tensor

_REGISTRY: Registry[AdvantageEstimatorFn] = Registry("advantage estimator", config_key="algorithm.adv_estimator")

#: Names of the registered advantage estimators (a live, tuple-like view).
ADVANTAGE_ESTIMATORS = RegisteredNames(_REGISTRY)


def register_advantage_estimator(
    name: str, *, needs: EstimatorNeeds | None = None, override: bool = False
) -> Callable[[AdvantageEstimatorFn], AdvantageEstimatorFn]:
    """Decorator adding an estimator under ``name`` (see the module docstring for the signature).
    ``needs``: what it needs from the recipe (groups of samples, a critic, strategy labels),
    which the config's rules and the trainer then apply; a built-in's are in
    ``opentinker/recipe/estimators.py``."""
    register = _REGISTRY.register(name, override=override)

    def decorator(fn: AdvantageEstimatorFn) -> AdvantageEstimatorFn:
        declare_estimator(name, needs)
        return register(fn)

    return decorator


def get_advantage_estimator(name: str) -> AdvantageEstimatorFn:
    """The estimator registered as ``name``; ``ValueError`` naming the valid ones otherwise."""
    return _REGISTRY.get(name)


# --------------------------------------------------------------------------- helpers


def _prepare(token_rewards: torch.Tensor, response_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Detached float32 copies of rewards and mask, after checking they are matching [B, T]."""
    if token_rewards.dim() != 2:
        raise ValueError(f"token_rewards must be [batch, response_len], got shape {tuple(token_rewards.shape)}.")
    if response_mask.shape != token_rewards.shape:
        raise ValueError(
            f"response_mask shape {tuple(response_mask.shape)} does not match "
            f"token_rewards shape {tuple(token_rewards.shape)}."
        )
    rewards = token_rewards.detach().to(torch.float32)
    mask = response_mask.detach().to(device=rewards.device, dtype=torch.float32)
    return rewards, mask


def _as_list(values: Any, batch_size: int, what: str) -> list[Any]:
    """``values`` as a plain Python list of length ``batch_size`` (numpy/torch scalars unwrapped)."""
    if values is None:
        raise ValueError(f"{what} is required: one entry per sample, {batch_size} in this batch.")
    if isinstance(values, (torch.Tensor, np.ndarray)):
        items = values.tolist()
    elif isinstance(values, (str, bytes)):
        raise ValueError(f"{what} must be a sequence with one entry per sample, got a single {type(values).__name__}.")
    else:
        items = list(values)
    if not isinstance(items, list) or len(items) != batch_size:
        length = len(items) if isinstance(items, list) else "a scalar"
        raise ValueError(f"{what} must have one entry per sample: expected {batch_size}, got {length}.")
    return items


def _group_ids(group_index: GroupIndex, batch_size: int, device: torch.device) -> tuple[torch.Tensor, int]:
    """Dense group numbers [B] (0, 1, ... in order of first appearance) and the group count."""
    keys = _as_list(group_index, batch_size, "group_index")
    numbering: dict[Hashable, int] = {}
    try:
        ids = [numbering.setdefault(key, len(numbering)) for key in keys]
    except TypeError as error:
        raise ValueError(f"group_index entries must be hashable prompt ids (str or int): {error}") from None
    return torch.tensor(ids, dtype=torch.long, device=device), len(numbering)


def _group_mean_std(
    scores: torch.Tensor, ids: torch.Tensor, num_groups: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sample group mean, unbiased group std and group size, each [B].

    A group of one sample has mean 0 and std 1 by convention, so its score passes through.
    """
    sizes = torch.bincount(ids, minlength=num_groups).to(scores.dtype)
    sums = torch.zeros(num_groups, dtype=scores.dtype, device=scores.device).index_add(0, ids, scores)
    means = sums / sizes
    squared = (scores - means[ids]) ** 2
    sum_squared = torch.zeros_like(sums).index_add(0, ids, squared)
    stds = torch.sqrt(sum_squared / (sizes - 1).clamp(min=1))
    single = sizes == 1
    means = torch.where(single, torch.zeros_like(means), means)
    stds = torch.where(single, torch.ones_like(stds), stds)
    return means[ids], stds[ids], sizes[ids]


def _grpo_sequence_advantages(
    scores: torch.Tensor,
    ids: torch.Tensor,
    num_groups: int,
    epsilon: float,
    norm_adv_by_std_in_grpo: bool,
) -> torch.Tensor:
    """GRPO's per-sample advantage [B]: ``(s - mean) / (std + eps)`` or ``s - mean`` (Dr.GRPO)."""
    mean, std, _ = _group_mean_std(scores, ids, num_groups)
    if norm_adv_by_std_in_grpo:
        return (scores - mean) / (std + epsilon)
    return scores - mean


def _sequence_scores(rewards: torch.Tensor) -> torch.Tensor:
    """Outcome score per sample [B], in float64 so that group statistics of equal rewards are exact
    (equal rewards must give advantage 0, not float32 rounding noise divided by epsilon)."""
    return rewards.sum(dim=-1, dtype=torch.float64)


def _broadcast(per_sample: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B] -> [B, T] in the mask's dtype (float32), zero on masked-out tokens."""
    return per_sample.to(mask.dtype).unsqueeze(-1) * mask


# --------------------------------------------------------------------------- outcome estimators


@register_advantage_estimator("grpo")
def grpo(
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_index: GroupIndex,
    *,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
    **_: Any,
) -> AdvantageOutput:
    """GRPO: each sample's score standardised within its group (mean, unbiased std).

    ``norm_adv_by_std_in_grpo=False`` gives Dr.GRPO (``s - mean``, no std division).
    Groups whose rewards are all equal get advantage 0; a group of one sample has
    mean 0 and std 1. ``returns == advantages``.
    """
    rewards, mask = _prepare(token_rewards, response_mask)
    ids, num_groups = _group_ids(group_index, rewards.shape[0], rewards.device)
    per_sample = _grpo_sequence_advantages(_sequence_scores(rewards), ids, num_groups, epsilon, norm_adv_by_std_in_grpo)
    advantages = _broadcast(per_sample, mask)
    return advantages, advantages.clone(), {}


@register_advantage_estimator("rloo")
def rloo(
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_index: GroupIndex,
    **_: Any,
) -> AdvantageOutput:
    """RLOO: score minus the mean of the *other* samples of its group.

    For a group of size ``n > 1`` that is ``s * n/(n-1) - mean * n/(n-1)``; a group of one
    passes its score through. ``returns == advantages``.
    """
    rewards, mask = _prepare(token_rewards, response_mask)
    ids, num_groups = _group_ids(group_index, rewards.shape[0], rewards.device)
    scores = _sequence_scores(rewards)
    mean, _, size = _group_mean_std(scores, ids, num_groups)
    scale = size / (size - 1).clamp(min=1)
    per_sample = torch.where(size > 1, scores * scale - mean * scale, scores)
    advantages = _broadcast(per_sample, mask)
    return advantages, advantages.clone(), {}


@register_advantage_estimator("reinforce_plus_plus_baseline")
def reinforce_plus_plus_baseline(
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_index: GroupIndex,
    **_: Any,
) -> AdvantageOutput:
    """REINFORCE++ with a group baseline: ``s - group mean`` broadcast to the model tokens,
    then whitened over all model tokens of the batch. A group of one has mean 0.
    ``returns == advantages``.
    """
    rewards, mask = _prepare(token_rewards, response_mask)
    ids, num_groups = _group_ids(group_index, rewards.shape[0], rewards.device)
    scores = _sequence_scores(rewards)
    mean, _, _ = _group_mean_std(scores, ids, num_groups)
    advantages = masked_whiten(_broadcast(scores - mean, mask), mask) * mask
    return advantages, advantages.clone(), {}


# --------------------------------------------------------------------------- token-level estimators


@register_advantage_estimator("reinforce_plus_plus")
def reinforce_plus_plus(
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_index: GroupIndex | None = None,
    *,
    gamma: float = 1.0,
    **_: Any,
) -> AdvantageOutput:
    """REINFORCE++: discounted reward-to-go, whitened over all model tokens of the batch.

    Backwards over t: ``running = r_t + gamma * running``; ``returns_t = running``; then
    ``running *= mask_t``, so the sum restarts at every masked-out token (verl's order).
    ``group_index`` is not used.
    """
    rewards, mask = _prepare(token_rewards, response_mask)
    returns = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        running = rewards[:, t] + gamma * running
        returns[:, t] = running
        running = running * mask[:, t]
    advantages = masked_whiten(returns, mask) * mask
    return advantages, returns * mask, {}


@register_advantage_estimator("gae")
def gae(
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_index: GroupIndex | None = None,
    *,
    values: torch.Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    **_: Any,
) -> AdvantageOutput:
    """Generalised Advantage Estimation over model tokens, for PPO with a critic.

    ``values`` [B, T] are the critic's predictions. Backwards over t:
    ``delta = r_t + gamma * next_value - v_t``, ``gae_t = delta + gamma * lam * last_gae``;
    at mask=1 ``next_value, last_gae := v_t, gae_t``; at mask=0 both carry through unchanged,
    so environment tokens are skipped. ``returns = gae + values``; the advantages are then
    whitened over all model tokens of the batch. ``group_index`` is not used.
    """
    rewards, mask = _prepare(token_rewards, response_mask)
    if values is None:
        raise ValueError("The 'gae' advantage estimator needs values=<critic values [batch, response_len]>.")
    if values.shape != rewards.shape:
        raise ValueError(f"values shape {tuple(values.shape)} does not match token_rewards {tuple(rewards.shape)}.")
    values = values.detach().to(device=rewards.device, dtype=torch.float32)

    next_value = torch.zeros_like(rewards[:, 0])
    last_gae = torch.zeros_like(rewards[:, 0])
    raw_advantages = torch.zeros_like(rewards)
    for t in reversed(range(rewards.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        gae_t = delta + gamma * lam * last_gae
        keep = mask[:, t]
        next_value = values[:, t] * keep + next_value * (1 - keep)
        last_gae = gae_t * keep + last_gae * (1 - keep)
        raw_advantages[:, t] = last_gae
    returns = (raw_advantages + values) * mask
    advantages = masked_whiten(raw_advantages, mask) * mask
    return advantages, returns, {}


# --------------------------------------------------------------------------- creativity estimators


def _strategy_weights(
    ids: torch.Tensor, num_groups: int, labels: list[Any], weight_power: float
) -> tuple[list[float], float]:
    """Per-sample weights ``count(same group, same label) ** -weight_power`` (1.0 for a
    ``None`` label) and the mean number of distinct non-``None`` labels per group."""
    group_of = ids.tolist()
    counts: dict[tuple[int, Hashable], int] = {}
    try:
        for group, label in zip(group_of, labels):
            if label is not None:
                counts[(group, label)] = counts.get((group, label), 0) + 1
    except TypeError as error:
        raise ValueError(f"strategy_labels entries must be hashable (str, int or None): {error}") from None
    weights = [
        1.0 if label is None else float(counts[(group, label)]) ** (-weight_power)
        for group, label in zip(group_of, labels)
    ]
    distinct_per_group = [0] * num_groups
    for group, _label in counts:
        distinct_per_group[group] += 1
    return weights, sum(distinct_per_group) / max(num_groups, 1)


def _grpo_weighted(
    combine: str,
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_index: GroupIndex,
    *,
    strategy_labels: Sequence[Hashable | None] | np.ndarray | None,
    weight_power: float,
    epsilon: float,
    norm_adv_by_std_in_grpo: bool,
    weight_positive_only: bool = False,
) -> AdvantageOutput:
    """GRPO advantage combined (``add`` or ``mul``) with per-sample strategy weights."""
    rewards, mask = _prepare(token_rewards, response_mask)
    batch_size = rewards.shape[0]
    ids, num_groups = _group_ids(group_index, batch_size, rewards.device)
    labels = _as_list(strategy_labels, batch_size, f"strategy_labels (for 'grpo_weighted_{combine}')")
    per_sample = _grpo_sequence_advantages(_sequence_scores(rewards), ids, num_groups, epsilon, norm_adv_by_std_in_grpo)
    weight_list, distinct_mean = _strategy_weights(ids, num_groups, labels, weight_power)
    weights = torch.tensor(weight_list, dtype=torch.float64, device=rewards.device)
    if combine == "add":
        combined = per_sample + weights
    elif weight_positive_only:  # rarity scales rewarded samples only; penalties stay as GRPO's
        combined = torch.where(per_sample > 0, per_sample * weights, per_sample)
    else:
        combined = per_sample * weights
    advantages = _broadcast(combined, mask)
    metrics = {
        "creativity/weight_mean": sum(weight_list) / max(batch_size, 1),
        "creativity/weight_min": min(weight_list, default=0.0),
        "creativity/weight_max": max(weight_list, default=0.0),
        "creativity/distinct_strategies_mean": float(distinct_mean),
    }
    return advantages, advantages.clone(), metrics


@register_advantage_estimator("grpo_weighted_add")
def grpo_weighted_add(
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_index: GroupIndex,
    *,
    strategy_labels: Sequence[Hashable | None] | np.ndarray | None = None,
    weight_power: float = 0.7,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
    **_: Any,
) -> AdvantageOutput:
    """GRPO advantage plus a rarity bonus for the sample's solution strategy.

    ``strategy_labels`` (required, one per sample) names each sample's strategy; ``None``
    means "not classified". The weight of a sample is ``k ** -weight_power`` where ``k`` is
    the number of samples with the same group id *and* the same label (``None`` -> 1.0), so
    rarer strategies weigh more. Per sample ``A = A_grpo + w``, broadcast to model tokens.
    Metrics: ``creativity/weight_{mean,min,max}`` over samples and
    ``creativity/distinct_strategies_mean`` (distinct non-``None`` labels per group, averaged).
    """
    return _grpo_weighted(
        "add",
        token_rewards,
        response_mask,
        group_index,
        strategy_labels=strategy_labels,
        weight_power=weight_power,
        epsilon=epsilon,
        norm_adv_by_std_in_grpo=norm_adv_by_std_in_grpo,
    )


@register_advantage_estimator("grpo_weighted_mul")
def grpo_weighted_mul(
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_index: GroupIndex,
    *,
    strategy_labels: Sequence[Hashable | None] | np.ndarray | None = None,
    weight_power: float = 0.7,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
    weight_positive_only: bool = False,
    **_: Any,
) -> AdvantageOutput:
    """GRPO advantage scaled by the sample's strategy weight: ``A = A_grpo * w``.

    ``weight_positive_only`` scales only positive advantages (negative ones stay plain GRPO).
    Weights and metrics as in :func:`grpo_weighted_add`.
    """
    return _grpo_weighted(
        "mul",
        token_rewards,
        response_mask,
        group_index,
        strategy_labels=strategy_labels,
        weight_power=weight_power,
        epsilon=epsilon,
        norm_adv_by_std_in_grpo=norm_adv_by_std_in_grpo,
        weight_positive_only=weight_positive_only,
    )
