"""What a training step and a validation report about their rollouts."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from opentinker.engine.batch import TokenBatch

if TYPE_CHECKING:
    from opentinker.engine.ppo.step import StepSamples

__all__ = ["pass_at_k", "rollout_metrics", "token_count", "validation_metrics"]


def rollout_metrics(rollout: StepSamples, batch: TokenBatch) -> dict[str, float]:
    """Reward and length statistics of a step's rollout, and its token counts."""
    rewards = torch.tensor(rollout.rewards)
    lengths = batch.response_mask.sum(-1)
    truncated = sum(t.stop_reason == "max_response_length" for t in rollout.trajectories)
    return {
        "reward/mean": float(rewards.mean()),
        "reward/std": float(rewards.std()) if len(rewards) > 1 else 0.0,
        "reward/max": float(rewards.max()),
        "reward/min": float(rewards.min()),
        "response_length/mean": float(lengths.mean()),
        "response_length/max": float(lengths.max()),
        "prompt_length/mean": sum(len(p) for p in batch.prompt_ids) / len(batch),
        "response_length/clip_ratio": truncated / len(rollout.trajectories),
        # Counts, not means: what usage metering bills a job's step for (server/job_metering.py).
        "tokens/prompt": float(sum(len(p) for p in batch.prompt_ids)),
        "tokens/generated": float(lengths.sum()),
        "tokens/trained": float(token_count(batch)),
    }


def token_count(batch: TokenBatch) -> int:
    """Prompt and response tokens of a batch (what tokens/s counts)."""
    return sum(len(p) + len(r) for p, r in zip(batch.prompt_ids, batch.response_ids))


def validation_metrics(rollout: StepSamples, samples: int) -> dict[str, float]:
    """Accuracy (mean of reward > 0) and mean reward of a validation rollout of ``samples``
    samples per prompt, ``val/excluded`` for samples left out (env errors), and pass@k for
    k = 1, 2, 4, ... up to ``samples`` when there are several; a metric with no sample to
    average over is absent."""
    groups = [  # the rewards of each prompt's samples that count
        [t.reward for t in rollout.trajectories[i:i + samples] if not t.excluded]
        for i in range(0, len(rollout.trajectories), samples)
    ]
    rewards = [r for group in groups for r in group]
    metrics = {"val/excluded": float(len(rollout.trajectories) - len(rewards))}
    if rewards:
        metrics["val/accuracy"] = sum(r > 0 for r in rewards) / len(rewards)
        metrics["val/reward_mean"] = sum(rewards) / len(rewards)
    if samples > 1:
        for k in sorted({min(2 ** e, samples) for e in range(samples.bit_length() + 1)}):
            usable = [(len(group), sum(r > 0 for r in group)) for group in groups if len(group) >= k]
            if usable:
                metrics[f"val/pass@{k}"] = sum(pass_at_k(n, c, k) for n, c in usable) / len(usable)
    return metrics


def pass_at_k(n: int, correct: int, k: int) -> float:
    """Probability that at least one of k samples drawn from n (``correct`` right) is right."""
    if n - correct < k:
        return 1.0
    return 1.0 - math.comb(n - correct, k) / math.comb(n, k)
