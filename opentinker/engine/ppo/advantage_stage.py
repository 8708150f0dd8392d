"""Rewards to advantages: the estimator of ``algorithm.adv_estimator`` over a step's samples,
with the critic's values (GAE) and, for the creativity estimators (``grpo_weighted_*``), one
strategy label per sample from the judge."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from opentinker.engine.algorithms import masked_mean
from opentinker.engine.batch import TokenBatch
from opentinker.engine.ppo.policy_update import explained_variance
from opentinker.recipe.estimators import estimator_needs

if TYPE_CHECKING:
    from opentinker.creativity import StrategyJudge
    from opentinker.engine.ppo.step import StepSamples
    from opentinker.recipe.components import AlgorithmSpec

__all__ = ["AdvantageStage", "question_of"]


class AdvantageStage:
    """Owns the estimator and the strategy judge of a run (no state across steps)."""

    def __init__(self, algorithm: AlgorithmSpec, estimator: Callable[..., Any],
                 strategy_judge: StrategyJudge | None = None):
        self.algorithm = algorithm
        self.estimator = estimator
        self.strategy_judge = strategy_judge

    @staticmethod
    def token_rewards(batch: TokenBatch, rewards: Sequence[float]) -> torch.Tensor:
        """Each scalar reward placed on its response's last model token (mask = 1)."""
        token_rewards = torch.zeros_like(batch.response_mask)
        positions = torch.arange(batch.response_width).expand_as(batch.response_mask)
        last = torch.where(batch.response_mask > 0, positions, -1).max(dim=-1).values
        for row, (position, reward) in enumerate(zip(last.tolist(), rewards)):
            if position >= 0:
                token_rewards[row, position] = reward
        return token_rewards

    def compute(self, batch: TokenBatch, rollout: StepSamples) -> dict[str, float]:
        """The batch's advantages (and, with the critic's values, the returns) as tensors on it; metrics."""
        algorithm = self.algorithm
        labels, label_metrics = None, {}
        if estimator_needs(algorithm.adv_estimator).strategies:
            labels, label_metrics = self.strategy_labels(rollout)
        values = batch.tensors.get("old_values")
        advantages, returns, metrics = self.estimator(
            self.token_rewards(batch, rollout.rewards),
            batch.response_mask,
            [p.uid for p in rollout.prompts],
            norm_adv_by_std_in_grpo=algorithm.norm_adv_by_std_in_grpo,
            gamma=algorithm.gamma,
            lam=algorithm.lam,
            weight_power=algorithm.weight_power,
            weight_positive_only=algorithm.weight_positive_only,
            strategy_labels=labels,
            **({} if values is None else {"values": values}),
        )
        batch.tensors["advantages"] = advantages
        metrics = {**metrics, **label_metrics, "advantages/mean": float(masked_mean(advantages, batch.response_mask))}
        if values is not None:  # what the critic learns from: the returns its values should predict
            batch.tensors["returns"] = returns
            mask = batch.response_mask
            metrics.update({"critic/values/mean": float(masked_mean(values, mask)),
                            "critic/returns/mean": float(masked_mean(returns, mask)),
                            "critic/explained_variance": explained_variance(values, returns, mask)})
        return metrics

    def strategy_labels(self, rollout: StepSamples) -> tuple[list[Any], dict[str, float]]:
        """One strategy label per sample from the judge; ``None`` (weight 1) where a sample is not
        classified: no judge, an incorrect response under ``classify_only_correct``, or a group the
        judge failed on (a fallback, counted in ``creativity/judge_fallbacks``)."""
        labels: list[Any] = [None] * len(rollout.prompts)
        if self.strategy_judge is None:
            return labels, {}
        members_of: dict[str, list[int]] = {}
        for index, prompt in enumerate(rollout.prompts):
            if not self.algorithm.classify_only_correct or rollout.rewards[index] > 0:
                members_of.setdefault(prompt.uid, []).append(index)
        groups = list(members_of.values())
        requests = [(question_of(rollout, members[0]), [rollout.texts[i] for i in members]) for members in groups]
        results = self.strategy_judge.label_groups(requests) if requests else []
        fallbacks = 0
        for members, result in zip(groups, results):
            if result is None:
                fallbacks += 1
                continue
            for index, label in zip(members, result):
                labels[index] = label
        metrics = dict(self.strategy_judge.pop_metrics())
        metrics["creativity/judge_fallbacks"] = fallbacks
        metrics["creativity/classified_fraction"] = sum(label is not None for label in labels) / len(labels)
        return labels, metrics


def question_of(rollout: StepSamples, index: int) -> str:
    """The user's question of a sample (its first user message), for the strategy judge."""
    for message in rollout.trajectories[index].messages or rollout.prompts[index].row.get("prompt") or []:
        if message.get("role") == "user":
            return message["content"]
    return ""
