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
from collections.abc import Callable, Iterator, Mapping
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ContextManager, Protocol

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


def _fused(parameters: list[torch.nn.Parameter]) -> bool | None:
    """AdamW's one-kernel update on a GPU (plain CUDA tensors: FSDP's sharded ones keep the
    default). Not on CPU: there it was 5.5x faster, but two FSDP ranks and one process then
    drifted apart 9x more (9.3e-5) in the shared-worker test, cause not found."""
    return True if parameters and all(p.is_cuda and type(p) is torch.nn.Parameter for p in parameters) else None


def adamw_for(optimizer: torch.optim.AdamW | None, parameters: list[torch.nn.Parameter],
              params: AdamParams) -> torch.optim.AdamW:
    """``optimizer`` (created over ``parameters`` on first use) set to this step's settings."""
    if optimizer is None:
        optimizer = torch.optim.AdamW(parameters, lr=params.lr, fused=_fused(parameters))
    for group in optimizer.param_groups:
        group.update(lr=params.lr, betas=tuple(params.betas), eps=params.eps, weight_decay=params.weight_decay)
    return optimizer


def adamw_from_state(parameters: list[torch.nn.Parameter], state: Mapping[str, Any]) -> torch.optim.AdamW:
    """An AdamW over ``parameters`` holding a saved ``state_dict`` (moments and step counts);
    its settings come with each step (:func:`adamw_for`), so it is made with lr 0."""
    optimizer = torch.optim.AdamW(parameters, lr=0.0, fused=_fused(parameters))
    optimizer.load_state_dict(state)
    return optimizer


def clipped_adamw_step(optimizer: torch.optim.AdamW | None, parameters: list[torch.nn.Parameter],
                       params: AdamParams, around_step: Callable[[], ContextManager[Any]] = nullcontext,
                       ) -> tuple[torch.optim.AdamW, dict[str, float]]:
    """The one optimizer step of every backend (one process, FSDP ranks, the shared adapter
    worker): clip, then one AdamW step; a non-finite gradient norm skips the step (it would
    poison the weights). Gradients are cleared either way. ``around_step`` wraps the step
    itself (FSDP brings offloaded moments to the device and back). Returns the optimizer (made
    on first use) and the step's metrics (``skipped_nonfinite`` 1.0: no step was taken)."""
    optimizer = adamw_for(optimizer, parameters, params)
    grad_norm = clip_gradients(parameters, params.grad_clip)
    finite = math.isfinite(grad_norm)
    if finite:
        with around_step():
            optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return optimizer, {"grad_norm": grad_norm, "lr": params.lr, "skipped_nonfinite": float(not finite)}


#: The one-file checkpoint of every backend's trained state (one process, the FSDP ranks, the
#: shared adapter worker): a checkpoint loads on any number of ranks or in one process.
STATE_FILE = "backend_state.pt"


def write_state_file(folder: str | Path, weights: Mapping[str, torch.Tensor], optimizer: Mapping[str, Any] | None,
                     rng: torch.Tensor, step: int, cuda_rng: Any = None,
                     rank_rngs: list[torch.Tensor] | None = None) -> Path:
    """``folder/backend_state.pt``: the trained weights under the model's own names (with LoRA:
    the adapters), the optimizer's ``state_dict()`` (keyed by position among the trained
    parameters, in the model's order; None before the first step), the RNG (FSDP: rank 0's,
    and every rank's in ``rank_rngs``) and the step count."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    torch.save({"model": dict(weights), "optimizer": None if optimizer is None else dict(optimizer),
                "rng": rng, "cuda_rng": cuda_rng, "step": step, "rank_rngs": rank_rngs}, folder / STATE_FILE)
    return folder


def read_state_file(folder: str | Path, map_location: Any = "cpu", mmap: bool = False) -> dict[str, Any]:
    """What :func:`write_state_file` wrote (keys ``model``, ``optimizer``, ``rng``, ``cuda_rng``,
    ``step``, ``rank_rngs``). ``mmap``: tensors stay in the file's pages until read (ranks on
    one node then share one copy)."""
    return torch.load(Path(folder) / STATE_FILE, map_location=map_location, weights_only=False, mmap=mmap)


def optimizer_state_by_position(state: Mapping[str, Any]) -> dict[str, Any]:
    """A full optimizer state keyed by parameter name (``torch.distributed.checkpoint``'s form)
    keyed by position instead, as ``optimizer.state_dict()`` keys it (the state file's form)."""
    names = [name for group in state["param_groups"] for name in group["params"]]
    position = {name: index for index, name in enumerate(names)}
    return {"state": {position[name]: value for name, value in state["state"].items()},
            "param_groups": [{**group, "params": [position[name] for name in group["params"]]}
                             for group in state["param_groups"]]}


def optimizer_state_by_name(state: Mapping[str, Any], names: list[str]) -> dict[str, Any]:
    """The inverse of :func:`optimizer_state_by_position`: ``names`` are the optimizer's
    parameters' names in its order."""
    return {"state": {names[index]: value for index, value in state["state"].items()},
            "param_groups": [{**group, "params": [names[index] for index in group["params"]]}
                             for group in state["param_groups"]]}


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
