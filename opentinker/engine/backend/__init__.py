"""Training primitives behind one protocol (see :mod:`.base`): ``LocalBackend`` (one process)
and ``FSDPBackend`` (N FSDP2 ranks as Ray actors), built by :func:`make_backend` from a
:class:`~.spec.BackendSpec`."""

from __future__ import annotations

from opentinker.engine.backend.base import (
    DEFAULT_BUCKET_BYTES,
    AdamParams,
    ForwardBackwardOutput,
    ForwardOutput,
    TrainingBackend,
    WeightBucket,
)
from opentinker.engine.backend.local import LocalBackend
from opentinker.engine.backend.losses import loss_names, register_loss, resolve_loss
from opentinker.engine.backend.spec import BackendSpec
from opentinker.engine.weight_buckets import bucketed

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "AdamParams",
    "BackendSpec",
    "ForwardBackwardOutput",
    "ForwardOutput",
    "LocalBackend",
    "TrainingBackend",
    "WeightBucket",
    "bucketed",
    "loss_names",
    "make_backend",
    "register_loss",
    "resolve_loss",
]


def make_backend(spec: BackendSpec) -> TrainingBackend:
    """The backend ``spec`` names: ``local`` loads the model here; ``fsdp`` starts
    ``spec.ranks`` ranks that load it themselves (this process never holds it)."""
    if spec.strategy == "fsdp":
        from opentinker.engine.backend.fsdp import FSDPBackend

        return FSDPBackend(spec)
    from opentinker.engine.model_loading import load_causal_lm, pick_device

    model = load_causal_lm(spec.model_path, device=pick_device(spec.device), trust_remote_code=spec.trust_remote_code)
    if spec.value_head:
        from opentinker.engine.backend.value_head import attach_value_head

        attach_value_head(model, spec.seed)
    return LocalBackend(model, pad_token_id=spec.pad_token_id, with_reference=spec.with_reference,
                        use_remove_padding=spec.use_remove_padding, share_prompt_prefix=spec.share_prompt_prefix,
                        gradient_checkpointing=spec.gradient_checkpointing, lora=spec.lora,
                        value_head=spec.value_head)
