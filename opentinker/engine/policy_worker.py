"""The policy worker: owns the actor (and optional reference) model and trains it with PPO.

One worker holds a whole model in this process. The trainer talks to it through the
:class:`WorkerGroup` protocol, which a group of N FSDP2 workers can implement as well, so
the trainer never knows how many processes hold the model.
"""

from __future__ import annotations

import copy
import math
from collections import defaultdict
from contextlib import nullcontext
from pathlib import Path
from typing import Protocol

import torch
from omegaconf import DictConfig
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from opentinker.engine.algorithms import agg_loss, entropy_from_logits, get_policy_loss, kl_penalty
from opentinker.engine.batch import ModelInputs, TokenBatch, packed_inputs, padded_inputs, shared_prefix_inputs

# Policy losses that aggregate per sequence regardless of loss_agg_mode (see policy_losses.py).
_SEQUENCE_AGGREGATED_LOSSES = {"gspo": "seq-mean-token-mean"}


class WorkerGroup(Protocol):
    """What the trainer needs from whoever holds the policy (1 local worker or N FSDP ranks)."""

    def compute_logprobs(
        self, batch: TokenBatch, *, temperature: float, reference: bool = False, with_entropy: bool = False
    ) -> dict[str, torch.Tensor]:
        """``{"logprobs": [B, R], "entropy": [B, R]?}`` for the response tokens of ``batch``."""

    def update(self, batch: TokenBatch, *, temperature: float) -> dict[str, float]:
        """One PPO update on ``batch``: needs ``advantages``; ``ref_logprobs`` for a KL loss;
        ``old_logprobs`` unless the update is on-policy (one epoch, one mini-batch)."""

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Full (unsharded) actor weights, for weight sync and checkpoints."""

    def save_checkpoint(self, path: str | Path, tokenizer: PreTrainedTokenizerBase | None = None) -> Path:
        """Write the actor as a Hugging Face folder."""


def _warmup_then_schedule(total_steps: int, warmup_steps: int, style: str, min_lr_ratio: float):
    def factor(step: int) -> float:
        if warmup_steps > 0 and step < warmup_steps:
            return (step + 1) / warmup_steps
        if style == "cosine":
            progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
            return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
        return 1.0

    return factor


class PolicyWorker:
    """Actor model + optimizer (+ frozen reference model when a KL term needs it)."""

    def __init__(
        self,
        model: PreTrainedModel,
        cfg: DictConfig,
        *,
        total_steps: int,
        pad_token_id: int,
        with_reference: bool,
        rollout_n: int,
        max_response_length: int,
        seed: int = 0,
    ):
        self.cfg = cfg
        self.actor_cfg = cfg.actor
        self.model = model
        self.device = next(model.parameters()).device
        self.pad_token_id = pad_token_id
        self.rollout_n = rollout_n
        # seq-mean-token-sum-norm divides by a constant; the configured length keeps it one.
        self.loss_scale_factor = float(max_response_length)
        self.use_remove_padding = bool(cfg.model.use_remove_padding)
        # The prompt's KV cache is reused across its samples; activation checkpointing
        # re-runs layers without a cache, so the two do not combine.
        self.share_prompt_prefix = bool(cfg.model.share_prompt_prefix) and not cfg.model.enable_gradient_checkpointing
        self.reference = copy.deepcopy(model).eval().requires_grad_(False) if with_reference else None
        if cfg.model.enable_gradient_checkpointing:
            # transformers 5 renamed gradient_checkpointing_enable; accept either.
            enable = getattr(self.model, "activation_checkpointing_enable", None) or self.model.gradient_checkpointing_enable
            enable()
            self.model.config.use_cache = False
        optim = self.actor_cfg.optim
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=optim.lr, betas=tuple(optim.betas), weight_decay=optim.weight_decay
        )
        warmup = optim.lr_warmup_steps if optim.lr_warmup_steps >= 0 else int(optim.lr_warmup_steps_ratio * total_steps)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, _warmup_then_schedule(total_steps, warmup, optim.warmup_style, optim.min_lr_ratio)
        )
        self.policy_loss_fn = get_policy_loss(self.actor_cfg.policy_loss)
        self._shuffle = torch.Generator().manual_seed(seed)

    # -- forward -------------------------------------------------------------------
    def _inputs(self, batch: TokenBatch) -> ModelInputs:
        return packed_inputs(batch) if self.use_remove_padding else padded_inputs(batch, self.pad_token_id)

    def _autocast(self):
        if self.device.type == "cuda":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return nullcontext()

    def _forward(
        self, model: PreTrainedModel, batch: TokenBatch, temperature: float, with_entropy: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logprobs (and entropy) of each response token, [B, R]; 0 past each response."""
        with self._autocast():
            logits, targets, valid = self._response_logits(model, batch)
        logits = logits.float() / temperature
        targets, valid = targets.to(self.device), valid.to(self.device)
        logprobs = torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        logprobs = logprobs * valid
        entropy = entropy_from_logits(logits) * valid if with_entropy else None
        return logprobs, entropy

    def _response_logits(self, model: PreTrainedModel, batch: TokenBatch):
        """[B, R, V] logits at the positions that predict each response token."""
        repeated_prompts = len({tuple(p) for p in batch.prompt_ids}) < len(batch)
        if not self.use_remove_padding and self.share_prompt_prefix and repeated_prompts:
            return self._shared_prefix_logits(model, batch)
        inputs = self._inputs(batch)
        # Only the positions that predict response tokens go through the LM head.
        keep = inputs.logit_cols if inputs.attention_mask is not None else inputs.logit_cols.reshape(1, -1)
        logits = model(
            input_ids=inputs.input_ids.to(self.device),
            position_ids=inputs.position_ids.to(self.device),
            attention_mask=None if inputs.attention_mask is None else inputs.attention_mask.to(self.device),
            logits_to_keep=keep.to(self.device),
            use_cache=False,
        ).logits
        return logits.reshape(len(batch), batch.response_width, -1), inputs.targets, inputs.valid

    def _shared_prefix_logits(self, model: PreTrainedModel, batch: TokenBatch):
        """Each distinct prompt runs once; its KV cache is expanded (differentiably) to its samples."""
        inputs = shared_prefix_inputs(batch, self.pad_token_id)
        device = self.device
        prompt_out = model(
            input_ids=inputs.prompt_ids.to(device),
            attention_mask=inputs.prompt_attention_mask.to(device),
            position_ids=inputs.prompt_position_ids.to(device),
            use_cache=True,
            logits_to_keep=1,
        )
        group_of_row = inputs.group_of_row.to(device)
        first = prompt_out.logits[:, -1][group_of_row].unsqueeze(1)  # predicts response token 0
        if inputs.response_input_ids.shape[1] == 0:
            return first, inputs.targets, inputs.valid
        cache = prompt_out.past_key_values
        cache.batch_select_indices(group_of_row)
        rest = model(
            input_ids=inputs.response_input_ids.to(device),
            attention_mask=inputs.attention_mask.to(device),
            position_ids=inputs.response_position_ids.to(device),
            past_key_values=cache,
            use_cache=True,
        ).logits
        return torch.cat([first, rest], dim=1), inputs.targets, inputs.valid

    @torch.no_grad()
    def compute_logprobs(
        self, batch: TokenBatch, *, temperature: float, reference: bool = False, with_entropy: bool = False
    ) -> dict[str, torch.Tensor]:
        model = self.reference if reference else self.model
        if model is None:
            raise RuntimeError("compute_logprobs(reference=True) but this worker has no reference model")
        micro = self.cfg.ref.log_prob_micro_batch_size if reference else self.actor_cfg.ppo_micro_batch_size
        was_training = model.training
        model.eval()
        parts = [self._forward(model, part, temperature, with_entropy) for part in batch.split(micro)]
        model.train(was_training)
        width = batch.response_width
        out = {"logprobs": torch.cat([_pad_to(lp, width) for lp, _ in parts]).cpu()}
        if with_entropy:
            out["entropy"] = torch.cat([_pad_to(ent, width) for _, ent in parts]).cpu()
        return out

    # -- update --------------------------------------------------------------------
    def _micro_loss(
        self, micro: TokenBatch, temperature: float, agg_mode: str
    ) -> tuple[torch.Tensor, dict[str, float]]:
        cfg = self.actor_cfg
        need_entropy = True  # reported every step; cheap next to the forward pass
        logprobs, entropy = self._forward(self.model, micro, temperature, need_entropy)
        mask = micro.response_mask.to(self.device)
        # Without stored old logprobs the update is on-policy: the ratio is exactly 1.
        old = micro.tensors["old_logprobs"].to(self.device) if "old_logprobs" in micro.tensors else logprobs.detach()
        advantages = micro.tensors["advantages"].to(self.device)
        pg_loss, metrics = self.policy_loss_fn(
            old,
            logprobs,
            advantages,
            mask,
            loss_agg_mode=cfg.loss_agg_mode,
            clip_ratio=cfg.clip_ratio,
            clip_ratio_low=cfg.clip_ratio_low,
            clip_ratio_high=cfg.clip_ratio_high,
            clip_ratio_c=cfg.clip_ratio_c,
            loss_scale_factor=self.loss_scale_factor,
        )
        loss = pg_loss
        entropy_value = agg_loss(entropy, mask, agg_mode, self.loss_scale_factor)
        metrics = {f"actor/{k}": float(v) for k, v in metrics.items()}
        metrics["actor/pg_loss"] = float(pg_loss.detach())
        metrics["actor/entropy"] = float(entropy_value.detach())
        if cfg.entropy_coeff:
            loss = loss - cfg.entropy_coeff * entropy_value
        if cfg.use_kl_loss:
            ref = micro.tensors["ref_logprobs"].to(self.device)
            kl = agg_loss(kl_penalty(logprobs, ref, cfg.kl_loss_type), mask, agg_mode, self.loss_scale_factor)
            loss = loss + cfg.kl_loss_coef * kl
            metrics["actor/kl"] = float(kl.detach())
        return loss, metrics

    def update(self, batch: TokenBatch, *, temperature: float) -> dict[str, float]:
        """PPO epochs over mini-batches (in prompts x n), grad accumulation over micro-batches."""
        cfg = self.actor_cfg
        agg_mode = _SEQUENCE_AGGREGATED_LOSSES.get(cfg.policy_loss, cfg.loss_agg_mode)
        mini_size = cfg.ppo_mini_batch_size * self.rollout_n
        self.model.train()
        sums: dict[str, float] = defaultdict(float)
        weights: dict[str, float] = defaultdict(float)
        optimizer_steps = skipped = 0
        for _ in range(cfg.ppo_epochs):
            order = torch.randperm(len(batch), generator=self._shuffle) if cfg.ppo_epochs > 1 else torch.arange(len(batch))
            for start in range(0, len(batch), mini_size):
                mini = batch.select(order[start : start + mini_size])
                self.optimizer.zero_grad(set_to_none=True)
                for micro in mini.split(cfg.ppo_micro_batch_size):
                    share = _loss_share(micro.response_mask, mini.response_mask, agg_mode)
                    if share == 0:
                        continue
                    loss, metrics = self._micro_loss(micro, temperature, agg_mode)
                    (loss * share).backward()
                    for key, value in metrics.items():
                        sums[key] += value * share
                        weights[key] += share
                grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip)
                if torch.isfinite(grad_norm):
                    self.optimizer.step()
                    optimizer_steps += 1
                else:  # a NaN/inf gradient would poison the weights: drop this mini-batch
                    skipped += 1
                sums["actor/grad_norm"] += float(grad_norm)
                weights["actor/grad_norm"] += 1
        self.scheduler.step()
        result = {key: sums[key] / weights[key] for key in sums if weights[key]}
        result["actor/lr"] = self.optimizer.param_groups[0]["lr"]
        result["actor/optimizer_steps"] = optimizer_steps
        result["actor/skipped_nonfinite_steps"] = skipped
        return result

    # -- weights -------------------------------------------------------------------
    def state_dict(self) -> dict[str, torch.Tensor]:
        return {name: tensor.detach() for name, tensor in self.model.state_dict().items()}

    def save_checkpoint(self, path: str | Path, tokenizer: PreTrainedTokenizerBase | None = None) -> Path:
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(path)
        if tokenizer is not None:
            tokenizer.save_pretrained(path)
        return path


def _loss_share(micro_mask: torch.Tensor, mini_mask: torch.Tensor, agg_mode: str) -> float:
    """The weight of a micro-batch's loss so that the accumulated gradient equals the mini-batch's.

    Token-mean divides by the mini-batch's token count; sequence means by its number of
    non-empty sequences; the "-norm" mode divides by a constant, so micro losses just add up.
    """
    if agg_mode == "token-mean":
        total = float(mini_mask.sum())
        return float(micro_mask.sum()) / total if total else 0.0
    if agg_mode == "seq-mean-token-sum-norm":
        return 1.0 if float(micro_mask.sum()) else 0.0
    total = float((mini_mask.sum(-1) > 0).sum())
    return float((micro_mask.sum(-1) > 0).sum()) / total if total else 0.0


def _pad_to(values: torch.Tensor, width: int) -> torch.Tensor:
    return torch.nn.functional.pad(values, (0, width - values.shape[1]))


def make_worker_group(cfg: DictConfig, model: PreTrainedModel, pad_token_id: int) -> WorkerGroup:
    """The policy workers a config asks for (``actor.strategy``); today one local worker."""
    ar = cfg.actor_rollout_ref
    if ar.actor.strategy != "local":
        raise ValueError(f"actor_rollout_ref.actor.strategy: unknown strategy '{ar.actor.strategy}' (local)")
    return PolicyWorker(
        model,
        ar,
        total_steps=cfg.trainer.total_training_steps,
        pad_token_id=pad_token_id,
        with_reference=bool(ar.actor.use_kl_loss),
        rollout_n=ar.rollout.n,
        max_response_length=cfg.data.max_response_length,
        seed=cfg.trainer.seed,
    )
