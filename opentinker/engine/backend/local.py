"""``LocalBackend``: the training primitives on one model in this process (CPU or one GPU)."""

from __future__ import annotations

import contextlib
import copy
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
    adamw_from_state,
    clipped_adamw_step,
    loss_without_gradients,
    read_state_file,
    write_state_file,
)
from opentinker.engine.backend.forward import scorer_for
from opentinker.engine.backend.lora import LoraSettings, add_adapters, merge_plan, merged_state_dict, merged_tensor
from opentinker.engine.backend.losses import check_inputs, resolve_loss, weighted_loss
from opentinker.engine.backend.weight_casts import CastWeights
from opentinker.engine.batch import TokenBatch
from opentinker.engine.model_loading import enable_gradient_checkpointing
from opentinker.engine.weight_buckets import bucketed


class LocalBackend:
    """Actor model + AdamW (+ a frozen reference when a KL term needs one: a copy, or with
    LoRA the base model itself with the adapters disabled)."""

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        pad_token_id: int,
        with_reference: bool = False,
        use_remove_padding: bool = True,
        share_prompt_prefix: bool = True,
        gradient_checkpointing: bool = False,
        lora: LoraSettings | None = None,
        value_head: bool = False,
    ):
        self.device = next(model.parameters()).device
        self.lora = lora
        self.with_reference = with_reference
        self.reference = copy.deepcopy(model).eval().requires_grad_(False) if with_reference and not lora else None
        if gradient_checkpointing:
            enable_gradient_checkpointing(model)
        self.model = add_adapters(model, lora) if lora else model
        # A value model's outputs are values (its head: engine/backend/value_head.py).
        self.scorer = scorer_for(
            value_head, pad_token_id, self.device, use_remove_padding, share_prompt_prefix and not gradient_checkpointing
        )
        # On a GPU the model runs under bf16 autocast: its linear weights are cast once per
        # change, not once per micro-batch (weight_casts.py). None: autocast's own casts.
        on_gpu = self.device.type == "cuda"
        self.weight_casts = CastWeights(self.model) if on_gpu else None
        self.reference_casts = CastWeights(self.reference) if on_gpu and self.reference is not None else None
        self.optimizer: torch.optim.AdamW | None = None  # made at the first step: its settings come with it
        self.step = 0

    # -- primitives ----------------------------------------------------------------
    @torch.no_grad()
    def forward(
        self, batch: TokenBatch, *, temperature: float = 1.0, reference: bool = False, with_entropy: bool = False
    ) -> ForwardOutput:
        if reference and not self.with_reference:
            raise RuntimeError("forward(reference=True) but this backend has no reference model")
        model = self.reference if reference and self.reference is not None else self.model
        was_training = model.training
        model.eval()
        with self.model.disable_adapter() if reference and self.lora else contextlib.nullcontext():
            logprobs, entropy = self.scorer(self._runner(model), batch, temperature, with_entropy, entropy_grad=False)
        model.train(was_training)
        return ForwardOutput(logprobs.cpu(), None if entropy is None else entropy.cpu())

    def _runner(self, model: PreTrainedModel) -> Any:
        """What to call for ``model`` (the actor or the reference): it on its cached casts when
        there are some (on a GPU), else the model itself."""
        casts = self.reference_casts if model is self.reference else self.weight_casts
        return model if casts is None else casts

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
        logprobs, entropy = self.scorer(self._runner(self.model), batch, temperature, need_entropy,
                                        entropy_grad=spec.needs_entropy(config))
        out = weighted_loss(spec, config, logprobs, entropy, batch, self.device)
        out.loss.backward()
        return ForwardBackwardOutput(
            logprobs.detach().cpu(), out.elementwise.cpu(), out.metrics,
            None if entropy is None else entropy.detach().cpu(),
        )

    def forward_loss(self, batch: TokenBatch, loss_fn: str, loss_config: Mapping[str, Any] | None = None, *,
                     temperature: float = 1.0) -> ForwardBackwardOutput:
        """``forward_backward``'s outputs, the gradients left as they are."""
        return loss_without_gradients(self, batch, loss_fn, loss_config, temperature)

    def optim_step(self, params: AdamParams) -> dict[str, float]:
        """Clip, then one AdamW step; a non-finite gradient norm skips the step (it would
        poison the weights). Gradients are cleared either way."""
        parameters = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer, metrics = clipped_adamw_step(self.optimizer, parameters, params)
        for casts in (self.weight_casts, self.reference_casts):
            if casts is not None:  # the actor's are stale now; both free their memory before the rollout
                casts.clear()
        self.step += not metrics["skipped_nonfinite"]
        return metrics

    # -- weights and state ----------------------------------------------------------
    def weights(self, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> Iterator[WeightBucket]:
        """The full weights under the base model's names (with LoRA: merged, one layer at a time)."""
        if self.lora:
            state = self.model.get_base_model().state_dict()
            named = ((entry.name, merged_tensor(entry, state)) for entry in merge_plan(self.model))
        else:
            named = ((name, t.detach()) for name, t in self.model.state_dict().items())
        return bucketed(named, bucket_bytes)

    def _trained_state(self) -> dict[str, torch.Tensor]:
        """What training changes: every weight, or with LoRA only the adapters."""
        if self.lora:
            return {name: p.detach() for name, p in self.model.named_parameters() if p.requires_grad}
        return self.model.state_dict()

    def save_state(self, path: str | Path) -> Path:
        """Weights (with LoRA: the adapters), optimizer, RNG and step in ``path/backend_state.pt``."""
        cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
        return write_state_file(path, self._trained_state(), self.optimizer and self.optimizer.state_dict(),
                                torch.get_rng_state(), self.step, cuda_rng)

    def load_state(self, path: str | Path, *, with_optimizer: bool = True) -> None:
        """Everything :meth:`save_state` wrote; ``with_optimizer=False`` keeps only the weights
        (and step) and starts the optimizer afresh."""
        state = read_state_file(path, map_location=self.device)
        missing, unexpected = self.model.load_state_dict(state["model"], strict=not self.lora)
        if unexpected or (self.lora and set(state["model"]) != set(self._trained_state())):
            raise ValueError(f"{path}: the saved state does not fit this model (unexpected: {unexpected[:3]})")
        self.optimizer = None  # saved before the first step (or not wanted): made at the next
        if state["optimizer"] is not None and with_optimizer:
            self.optimizer = adamw_from_state([p for p in self.model.parameters() if p.requires_grad],
                                              state["optimizer"])
        torch.set_rng_state(state["rng"].cpu())
        if state.get("cuda_rng") is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda_rng"])
        self.step = int(state["step"])

    def export_hf(self, path: str | Path, tokenizer: Any = None) -> Path:
        """A Hugging Face folder (with LoRA: the merged model, and the adapter in ``adapter/``)."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        if self.lora:
            self.model.get_base_model().save_pretrained(path, state_dict=merged_state_dict(self.model))
            self.model.save_pretrained(path / "adapter")
        else:
            self.model.save_pretrained(path)
        if tokenizer is not None:
            tokenizer.save_pretrained(path)
        return path

    def close(self) -> None:
        pass
