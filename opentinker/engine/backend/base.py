"""The training primitives: what the PPO recipe (and, later, the Tinker API) drive a model with.

One protocol, :class:`TrainingBackend`, whoever holds the model (one process, or N FSDP ranks):

- ``forward(batch)`` -> per-token logprobs (and entropy) of the response tokens;
- ``forward_backward(batch, loss_fn, loss_config)`` -> metrics and per-token outputs; the
  loss is a **sum** over tokens of ``weights * elementwise_loss`` (``batch.tensors["weights"]``,
  default the response mask), so the caller chooses the normalisation (e.g. ``1 / tokens in
  the mini-batch`` for token-mean) and calls may be split freely: gradients accumulate
  until the next ``optim_step``;
- ``forward_loss(batch, loss_fn, loss_config)`` -> the same outputs as ``forward_backward``
  without touching the gradients (Tinker's ``forward``: loss values of held-out data);
- ``optim_step(AdamParams)`` -> metrics (grad norm, lr); the learning rate comes with every
  call, so schedules belong to the caller;
- ``weights()`` -> the full weights as size-bounded buckets of ``(name, tensor)``, for weight
  sync and export, never one whole second state dict;
- ``save_state(path)`` / ``load_state(path, with_optimizer=)``: weights, optimizer, RNG and step;
  ``export_hf(path)``.

All per-token tensors are ``[B, R]``, aligned with ``TokenBatch.response_mask``.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from opentinker.engine.batch import TokenBatch

from opentinker.engine.weight_buckets import DEFAULT_BUCKET_BYTES, WeightBucket


@dataclass(frozen=True)
class AdamParams:
    """One optimizer step's settings (AdamW). ``grad_clip``: max global grad norm (None: none)."""

    lr: float
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    grad_clip: float | None = None


def adamw_for(optimizer: torch.optim.AdamW | None, parameters: list[torch.nn.Parameter],
              params: AdamParams) -> torch.optim.AdamW:
    """``optimizer`` (created over ``parameters`` on first use) set to this step's settings."""
    if optimizer is None:
        optimizer = torch.optim.AdamW(parameters, lr=params.lr)
    for group in optimizer.param_groups:
        group.update(lr=params.lr, betas=tuple(params.betas), eps=params.eps, weight_decay=params.weight_decay)
    return optimizer


def clipped_adamw_step(optimizer: torch.optim.AdamW | None, parameters: list[torch.nn.Parameter],
                       params: AdamParams) -> tuple[torch.optim.AdamW, dict[str, float]]:
    """Clip, then one AdamW step; a non-finite gradient norm skips the step (it would poison
    the weights). Gradients are cleared either way. Returns the optimizer (made on first use)
    and the step's metrics (``skipped_nonfinite`` 1.0: no step was taken)."""
    optimizer = adamw_for(optimizer, parameters, params)
    grad_norm = clip_gradients(parameters, params.grad_clip)
    finite = math.isfinite(grad_norm)
    if finite:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return optimizer, {"grad_norm": grad_norm, "lr": params.lr, "skipped_nonfinite": float(not finite)}


def clip_gradients(parameters: list[torch.nn.Parameter], grad_clip: float | None) -> float:
    """Clips to ``grad_clip`` (None: no clip) and returns the global gradient norm (for
    sharded parameters, over the whole model)."""
    norm = torch.nn.utils.clip_grad_norm_(parameters, grad_clip if grad_clip is not None else math.inf)
    return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)


@dataclass
class ForwardOutput:
    logprobs: torch.Tensor  # [B, R], 0 past each response
    entropy: torch.Tensor | None = None  # [B, R] when asked for


@dataclass
class ForwardBackwardOutput:
    """``metrics``: ``"loss:sum"`` (the summed, weighted loss) and ``"<stat>:sum"`` for each
    per-token statistic of the loss, each summed with the same weights."""

    logprobs: torch.Tensor  # [B, R], detached
    elementwise_loss: torch.Tensor  # [B, R], before the weights
    metrics: dict[str, float] = field(default_factory=dict)
    entropy: torch.Tensor | None = None  # [B, R] when asked for


class TrainingBackend(Protocol):
    """What holds the policy (and its frozen reference) and trains it."""

    step: int  # optimizer steps taken

    def forward(
        self, batch: TokenBatch, *, temperature: float = 1.0, reference: bool = False, with_entropy: bool = False
    ) -> ForwardOutput: ...

    def forward_backward(
        self,
        batch: TokenBatch,
        loss_fn: str,
        loss_config: Mapping[str, Any] | None = None,
        *,
        temperature: float = 1.0,
        with_entropy: bool = False,
    ) -> ForwardBackwardOutput: ...

    def forward_loss(
        self, batch: TokenBatch, loss_fn: str, loss_config: Mapping[str, Any] | None = None, *,
        temperature: float = 1.0,
    ) -> ForwardBackwardOutput: ...

    def optim_step(self, params: AdamParams) -> dict[str, float]: ...

    def weights(self, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> Iterator[WeightBucket]: ...

    def save_state(self, path: str | Path) -> Path: ...

    def load_state(self, path: str | Path, *, with_optimizer: bool = True) -> None: ...

    def export_hf(self, path: str | Path, tokenizer: Any = None) -> Path: ...

    def close(self) -> None: ...


def loss_without_gradients(backend: TrainingBackend, batch: TokenBatch, loss_fn: str,
                           loss_config: Mapping[str, Any] | None, temperature: float) -> ForwardBackwardOutput:
    """``forward_loss`` for any backend: its ``forward``, then the loss on the driver side."""
    from opentinker.engine.backend.losses import check_inputs, resolve_loss, weighted_loss

    spec, config = resolve_loss(loss_fn, loss_config)
    check_inputs(spec, batch.tensors, tuple(batch.response_mask.shape))
    out = backend.forward(batch, temperature=temperature, with_entropy=spec.needs_entropy(config))
    with torch.no_grad():
        loss = weighted_loss(spec, config, out.logprobs, out.entropy, batch, out.logprobs.device)
    return ForwardBackwardOutput(out.logprobs, loss.elementwise, loss.metrics, out.entropy)
