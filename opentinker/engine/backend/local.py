"""``LocalBackend``: the training primitives on one model in this process (CPU or one GPU)."""

from __future__ import annotations

import copy
import math
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel

from opentinker.engine.backend.base import (
    DEFAULT_BUCKET_BYTES,
    AdamParams,
    ForwardBackwardOutput,
    ForwardOutput,
    WeightBucket,
    bucketed,
)
from opentinker.engine.backend.forward import ResponseScorer
from opentinker.engine.backend.losses import check_inputs, resolve_loss
from opentinker.engine.batch import TokenBatch

STATE_FILE = "backend_state.pt"


class LocalBackend:
    """Actor model + AdamW (+ a frozen reference copy when a KL term needs one)."""

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        pad_token_id: int,
        with_reference: bool = False,
        use_remove_padding: bool = False,
        share_prompt_prefix: bool = True,
        gradient_checkpointing: bool = False,
    ):
        self.model = model
        self.device = next(model.parameters()).device
        self.reference = copy.deepcopy(model).eval().requires_grad_(False) if with_reference else None
        if gradient_checkpointing:
            # transformers 5 renamed gradient_checkpointing_enable; accept either.
            enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
            enable()
            model.config.use_cache = False
        self.scorer = ResponseScorer(
            pad_token_id, self.device, use_remove_padding, share_prompt_prefix and not gradient_checkpointing
        )
        self.optimizer: torch.optim.AdamW | None = None  # made at the first step: its settings come with it
        self.step = 0

    # -- primitives ----------------------------------------------------------------
    @torch.no_grad()
    def forward(
        self, batch: TokenBatch, *, temperature: float = 1.0, reference: bool = False, with_entropy: bool = False
    ) -> ForwardOutput:
        model = self.reference if reference else self.model
        if model is None:
            raise RuntimeError("forward(reference=True) but this backend has no reference model")
        was_training = model.training
        model.eval()
        logprobs, entropy = self.scorer(model, batch, temperature, with_entropy)
        model.train(was_training)
        return ForwardOutput(logprobs.cpu(), None if entropy is None else entropy.cpu())

    def forward_backward(
        self,
        batch: TokenBatch,
        loss_fn: str,
        loss_config: Mapping[str, Any] | None = None,
        *,
        temperature: float = 1.0,
        with_entropy: bool = False,
    ) -> ForwardBackwardOutput:
        spec, config = resolve_loss(loss_fn, loss_config)
        check_inputs(spec, batch.tensors, tuple(batch.response_mask.shape))
        self.model.train()
        need_entropy = with_entropy or spec.needs_entropy(config)
        logprobs, entropy = self.scorer(self.model, batch, temperature, need_entropy)
        inputs = {name: t.to(self.device) for name, t in batch.tensors.items()}
        inputs["response_mask"] = batch.response_mask.to(self.device)
        elementwise, stats = spec.fn(logprobs, inputs, config, entropy)
        weights = inputs.get("weights", inputs["response_mask"])
        loss = (elementwise * weights).sum()
        loss.backward()
        if entropy is not None:
            stats = {**stats, "entropy": entropy.detach()}
        metrics = {"loss:sum": float(loss.detach())}
        metrics.update({f"{name}:sum": float((value * weights).sum()) for name, value in stats.items()})
        return ForwardBackwardOutput(
            logprobs.detach().cpu(), elementwise.detach().cpu(), metrics,
            None if entropy is None else entropy.detach().cpu(),
        )

    def optim_step(self, params: AdamParams) -> dict[str, float]:
        """Clip, then one AdamW step; a non-finite gradient norm skips the step (it would
        poison the weights). Gradients are cleared either way."""
        parameters = [p for p in self.model.parameters() if p.requires_grad]
        if self.optimizer is None:
            self.optimizer = torch.optim.AdamW(parameters, lr=params.lr)
        for group in self.optimizer.param_groups:
            group.update(lr=params.lr, betas=tuple(params.betas), eps=params.eps, weight_decay=params.weight_decay)
        max_norm = params.grad_clip if params.grad_clip is not None else math.inf
        grad_norm = float(torch.nn.utils.clip_grad_norm_(parameters, max_norm))
        finite = math.isfinite(grad_norm)
        if finite:
            self.optimizer.step()
            self.step += 1
        self.optimizer.zero_grad(set_to_none=True)
        return {"grad_norm": grad_norm, "lr": params.lr, "skipped_nonfinite": float(not finite)}

    # -- weights and state ----------------------------------------------------------
    def weights(self, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> Iterator[WeightBucket]:
        return bucketed(((name, t.detach()) for name, t in self.model.state_dict().items()), bucket_bytes)

    def save_state(self, path: str | Path) -> Path:
        """Weights, optimizer, RNG and step in ``path/backend_state.pt``."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        torch.save(
            {
                "model": self.model.state_dict(),
                "optimizer": None if self.optimizer is None else self.optimizer.state_dict(),
                "rng": torch.get_rng_state(),
                "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
                "step": self.step,
            },
            path / STATE_FILE,
        )
        return path

    def load_state(self, path: str | Path) -> None:
        state = torch.load(Path(path) / STATE_FILE, map_location=self.device, weights_only=False)
        self.model.load_state_dict(state["model"])
        if state["optimizer"] is None:
            self.optimizer = None  # saved before the first step: so it is again
        else:
            if self.optimizer is None:
                self.optimizer = torch.optim.AdamW([p for p in self.model.parameters() if p.requires_grad], lr=0.0)
            self.optimizer.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["rng"].cpu())
        if state.get("cuda_rng") is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda_rng"])
        self.step = int(state["step"])

    def export_hf(self, path: str | Path, tokenizer: Any = None) -> Path:
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(path)
        if tokenizer is not None:
            tokenizer.save_pretrained(path)
        return path

    def close(self) -> None:
        pass
