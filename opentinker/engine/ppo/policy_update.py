"""The PPO update as a recipe over the training primitives.

``PPOUpdate.update(batch)``: for each epoch, for each mini-batch (``ppo_mini_batch_size``
prompts x ``rollout.n`` samples), ``forward_backward`` every micro-batch with the
``rl_policy`` loss, then one ``optim_step``. The loss is a weighted sum over tokens; the
weights implement ``loss_agg_mode`` over the whole mini-batch (:func:`loss_weights`), so the
accumulated gradient is the mini-batch's, however it is split into micro-batches or ranks.

The learning-rate schedule (warm-up, then constant or cosine) lives here: its position is
the number of updates done (``updates``), part of a trainer checkpoint.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any

import torch

from opentinker.engine.algorithms.policy_losses import SEQUENCE_AGGREGATED_LOSSES
from opentinker.engine.backend import AdamParams, TrainingBackend
from opentinker.engine.backend.forward import pad_to
from opentinker.engine.batch import TokenBatch
from opentinker.recipe import RecipeSpec

LOSS = "rl_policy"
VALUE_LOSS = "value"
# The loss statistics reported (each summed with the loss weights: the mini-batch's mean).
_STATS = ("pg_loss", "kl", "entropy", "pg_clipfrac", "ppo_kl", "pg_clipfrac_lower")


def loss_weights(mask: torch.Tensor, agg_mode: str, scale: float) -> torch.Tensor:
    """Per-token weights [B, R] whose weighted sum of a per-token loss is ``agg_loss(loss,
    mask, agg_mode, scale)`` over this (mini-)batch.

    token-mean: ``1 / tokens``; seq-mean-token-sum: ``1 / sequences``; seq-mean-token-mean:
    ``1 / (sequence length * sequences)``; seq-mean-token-sum-norm: ``1 / scale``. Sequences
    without a model token count for nothing; an empty batch gets all-zero weights.
    """
    mask = mask.to(torch.float32)
    lengths = mask.sum(-1)
    sequences = float((lengths > 0).sum())
    if agg_mode == "token-mean":
        total = float(mask.sum())
        return mask / total if total else torch.zeros_like(mask)
    if agg_mode == "seq-mean-token-sum":
        return mask / sequences if sequences else torch.zeros_like(mask)
    if agg_mode == "seq-mean-token-mean":
        per_row = lengths.clamp(min=1).unsqueeze(-1) * max(sequences, 1.0)
        return mask / per_row
    if agg_mode == "seq-mean-token-sum-norm":
        return mask / scale
    raise ValueError(f"unknown loss_agg_mode {agg_mode!r}")


def lr_factor(update: int, total_updates: int, warmup: int, style: str, min_lr_ratio: float) -> float:
    """The learning-rate multiplier of update ``update`` (0-based): linear warm-up, then
    constant or cosine down to ``min_lr_ratio``."""
    if warmup > 0 and update < warmup:
        return (update + 1) / warmup
    if style == "cosine":
        progress = (update - warmup) / max(1, total_updates - warmup)
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return 1.0


def run_epochs(backend: TrainingBackend, batch: TokenBatch, *, epochs: int, mini_batch_samples: int,
               micro_batch_size: int, agg_mode: str, scale: float, shuffle: torch.Generator, loss: str,
               loss_config: dict, stats: tuple[str, ...], params: AdamParams,
               logprobs_out: list[torch.Tensor] | None = None,
               **forward_backward_options) -> tuple[dict[str, float], int, int, int]:
    """``epochs`` passes over ``batch`` (shuffled when more than one) in mini-batches of
    ``mini_batch_samples``: ``forward_backward`` of each micro-batch with ``loss``, weighted
    for ``agg_mode`` over the mini-batch, then one ``optim_step``. Returns the sums over
    mini-batches of each stat (and ``grad_norm``), the mini-batches, the steps taken and the
    steps skipped (a non-finite gradient). ``logprobs_out`` collects each micro-batch's per-token
    outputs (padded to the batch's width), in the order they ran."""
    sums: dict[str, float] = defaultdict(float)
    mini_batches = steps = skipped = 0
    for _ in range(epochs):
        order = torch.randperm(len(batch), generator=shuffle) if epochs > 1 else torch.arange(len(batch))
        for start in range(0, len(batch), mini_batch_samples):
            mini = batch.select(order[start:start + mini_batch_samples])
            mini.tensors["weights"] = loss_weights(mini.response_mask, agg_mode, scale)
            if not float(mini.tensors["weights"].sum()):
                continue  # no model token: nothing to learn from
            for micro in mini.split(micro_batch_size):
                if not float(micro.tensors["weights"].sum()):
                    continue
                out = backend.forward_backward(micro, loss, loss_config, **forward_backward_options)
                if logprobs_out is not None:
                    logprobs_out.append(pad_to(out.logprobs.detach(), batch.response_width))
                for stat in stats:
                    if f"{stat}:sum" in out.metrics:
                        sums[stat] += out.metrics[f"{stat}:sum"]
            step = backend.optim_step(params)
            sums["grad_norm"] += step["grad_norm"]
            mini_batches += 1
            steps += not step["skipped_nonfinite"]
            skipped += int(step["skipped_nonfinite"])
    return sums, mini_batches, steps, skipped


class _ScheduledUpdate:
    """What an update owns across steps: how many it has made (its place in the learning-rate
    schedule) and the generator that shuffles its mini-batches; saved in checkpoints."""

    updates: int
    _shuffle: torch.Generator

    def state_dict(self) -> dict[str, Any]:
        return {"updates": self.updates, "shuffle": self._shuffle.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.updates = int(state["updates"])
        self._shuffle.set_state(state["shuffle"])


class PPOUpdate(_ScheduledUpdate):
    """Epochs x mini-batches x micro-batches of the ``rl_policy`` loss on a backend."""

    def __init__(self, backend: TrainingBackend, cfg: RecipeSpec, *, seed: int = 0):
        self.backend = backend
        ar = cfg.actor_rollout_ref
        self.actor = actor = ar.actor
        self.rollout_n = int(ar.rollout.n)
        self.ref_micro_batch_size = int(ar.ref.log_prob_micro_batch_size)
        self.agg_mode = SEQUENCE_AGGREGATED_LOSSES.get(actor.policy_loss, actor.loss_agg_mode)
        # seq-mean-token-sum-norm divides by a constant; the configured length keeps it one.
        self.scale = float(cfg.data.max_response_length)
        self.loss_config = {
            "policy_loss": actor.policy_loss,
            "clip_ratio": actor.clip_ratio,
            "clip_ratio_low": actor.clip_ratio_low,
            "clip_ratio_high": actor.clip_ratio_high,
            "clip_ratio_c": actor.clip_ratio_c,
            "entropy_coeff": actor.entropy_coeff,
            "use_kl_loss": actor.use_kl_loss,
            "kl_loss_coef": actor.kl_loss_coef,
            "kl_loss_type": actor.kl_loss_type,
            "rollout_is": cfg.algorithm.rollout_correction.rollout_is,
            "rollout_is_threshold": cfg.algorithm.rollout_correction.rollout_is_threshold,
        }
        optim = actor.optim
        self.total_updates = int(cfg.trainer.total_training_steps)
        self.warmup = optim.lr_warmup_steps if optim.lr_warmup_steps >= 0 else int(
            optim.lr_warmup_steps_ratio * self.total_updates)
        self.updates = 0  # update() calls so far: the position in the learning-rate schedule
        self._shuffle = torch.Generator().manual_seed(seed)
        # The last update's logprobs of its batch before any optimizer step, when the update was
        # a single step (no old_logprobs needed): the rollout correction's statistics use them.
        self.logprobs_before_update: torch.Tensor | None = None

    @property
    def mini_batch_samples(self) -> int:
        return int(self.actor.ppo_mini_batch_size) * self.rollout_n

    def needs_old_logprobs(self, batch: TokenBatch) -> bool:
        """Whether the update leaves the sampling policy before its last mini-batch: more than
        one epoch, or more samples than one mini-batch (e.g. a large client-pushed batch).
        Otherwise the policy being trained is the one that sampled, and the ratio is 1."""
        return self.actor.ppo_epochs > 1 or len(batch) > self.mini_batch_samples

    def logprobs(self, batch: TokenBatch, *, temperature: float, reference: bool = False) -> torch.Tensor:
        """[B, R] logprobs of the actor (or the reference), in micro-batches."""
        size = self.ref_micro_batch_size if reference else int(self.actor.ppo_micro_batch_size)
        parts = [self.backend.forward(part, temperature=temperature, reference=reference).logprobs
                 for part in batch.split(size)]
        return torch.cat([pad_to(p, batch.response_width) for p in parts])

    def adam_params(self) -> AdamParams:
        optim = self.actor.optim
        factor = lr_factor(self.updates, self.total_updates, self.warmup, optim.warmup_style, optim.min_lr_ratio)
        return AdamParams(lr=optim.lr * factor, betas=tuple(optim.betas), weight_decay=optim.weight_decay,
                          grad_clip=self.actor.grad_clip)

    def update(self, batch: TokenBatch, *, temperature: float) -> dict[str, float]:
        """One PPO update on ``batch`` (``advantages``; ``ref_logprobs`` for a KL loss;
        ``old_logprobs`` when :meth:`needs_old_logprobs`)."""
        if self.needs_old_logprobs(batch) and "old_logprobs" not in batch.tensors:
            raise ValueError("this update leaves the sampling policy: the batch needs 'old_logprobs'")
        params = self.adam_params()
        single_step = not self.needs_old_logprobs(batch)
        seen: list[torch.Tensor] | None = [] if single_step else None
        sums, mini_batches, steps, skipped = run_epochs(
            self.backend, batch, epochs=self.actor.ppo_epochs, mini_batch_samples=self.mini_batch_samples,
            micro_batch_size=int(self.actor.ppo_micro_batch_size), agg_mode=self.agg_mode, scale=self.scale,
            shuffle=self._shuffle, loss=LOSS, loss_config=self.loss_config, stats=_STATS, params=params,
            logprobs_out=seen, temperature=temperature, with_entropy=True)
        # Micro-batches with no weight are skipped, so rows line up only when all of them ran.
        self.logprobs_before_update = torch.cat(seen) if seen and sum(len(p) for p in seen) == len(batch) else None
        self.updates += 1
        result = {f"actor/{name}": value / mini_batches for name, value in sums.items()} if mini_batches else {}
        result.update({"actor/lr": params.lr, "actor/optimizer_steps": steps, "actor/skipped_nonfinite_steps": skipped})
        return result


class CriticUpdate(_ScheduledUpdate):
    """The value model's update (``critic.*``): its values before the update, then epochs x
    mini-batches x micro-batches of the clipped ``value`` loss against the returns, on a
    backend of its own (a value head: ``BackendSpec.value_head``)."""

    def __init__(self, backend: TrainingBackend, cfg: RecipeSpec, *, seed: int = 0):
        self.backend = backend
        self.critic = critic = cfg.critic
        self.rollout_n = int(cfg.actor_rollout_ref.rollout.n)
        self.scale = float(cfg.data.max_response_length)
        self.loss_config = {"cliprange_value": float(critic.cliprange_value)}
        optim = critic.optim
        self.total_updates = int(cfg.trainer.total_training_steps)
        self.warmup = optim.lr_warmup_steps if optim.lr_warmup_steps >= 0 else int(
            optim.lr_warmup_steps_ratio * self.total_updates)
        self.updates = 0  # the position in the critic's learning-rate schedule
        self._shuffle = torch.Generator().manual_seed(seed + 1)

    def values(self, batch: TokenBatch) -> torch.Tensor:
        """[B, R] values of the response tokens (0 past each response), in micro-batches."""
        parts = [self.backend.forward(part).logprobs for part in batch.split(int(self.critic.ppo_micro_batch_size))]
        return torch.cat([pad_to(p, batch.response_width) for p in parts])

    def adam_params(self) -> AdamParams:
        optim = self.critic.optim
        factor = lr_factor(self.updates, self.total_updates, self.warmup, optim.warmup_style, optim.min_lr_ratio)
        return AdamParams(lr=optim.lr * factor, betas=tuple(optim.betas), weight_decay=optim.weight_decay,
                          grad_clip=self.critic.grad_clip)

    def update(self, batch: TokenBatch) -> dict[str, float]:
        """One critic update on ``batch`` (``returns``; ``old_values``: the values it was given)."""
        params = self.adam_params()
        sums, mini_batches, steps, skipped = run_epochs(
            self.backend, batch, epochs=int(self.critic.ppo_epochs),
            mini_batch_samples=int(self.critic.ppo_mini_batch_size) * self.rollout_n,
            micro_batch_size=int(self.critic.ppo_micro_batch_size), agg_mode=self.critic.loss_agg_mode,
            scale=self.scale, shuffle=self._shuffle, loss=VALUE_LOSS, loss_config=self.loss_config,
            stats=("loss", "vf_clipfrac", "vpred"), params=params)
        self.updates += 1
        names = {"loss": "vf_loss", "vf_clipfrac": "vf_clipfrac", "vpred": "vpred_mean", "grad_norm": "grad_norm"}
        result = {f"critic/{names[k]}": v / mini_batches for k, v in sums.items()} if mini_batches else {}
        result.update({"critic/lr": params.lr, "critic/optimizer_steps": steps,
                       "critic/skipped_nonfinite_steps": skipped})
        return result


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    """``1 - Var(returns - values) / Var(returns)`` over the model tokens (1: the values
    predict the returns; 0: no better than their mean; NaN when the returns do not vary)."""
    keep = mask > 0
    target, residual = returns[keep].double(), (returns - values)[keep].double()
    variance = float(target.var(unbiased=False)) if target.numel() else 0.0
    return 1.0 - float(residual.var(unbiased=False)) / variance if variance > 0 else float("nan")
