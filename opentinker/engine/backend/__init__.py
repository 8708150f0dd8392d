"""Training primitives behind one protocol (see :mod:`.base`): ``LocalBackend`` (one process)
and ``FSDPBackend`` (N FSDP2 ranks as Ray actors), built by :func:`make_backend` from a
:class:`~.spec.BackendSpec`.

The spec and this package's import are torch-free (the API process builds specs); the names
that need torch load on first use."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from opentinker.engine.backend.spec import BackendSpec, LoraSettings

if TYPE_CHECKING:
    from opentinker.engine.backend.base import TrainingBackend

# name -> the module that defines it, imported when the name is first asked for
_LAZY = {
    "DEFAULT_BUCKET_BYTES": "opentinker.engine.backend.base",
    "AdamParams": "opentinker.engine.backend.base",
    "ForwardBackwardOutput": "opentinker.engine.backend.base",
    "ForwardOutput": "opentinker.engine.backend.base",
    "TrainingBackend": "opentinker.engine.backend.base",
    "WeightBucket": "opentinker.engine.backend.base",
    "LocalBackend": "opentinker.engine.backend.local",
    "loss_names": "opentinker.engine.backend.losses",
    "register_loss": "opentinker.engine.backend.losses",
    "resolve_loss": "opentinker.engine.backend.losses",
    "bucketed": "opentinker.engine.weight_buckets",
}

__all__ = ["BackendSpec", "LoraSettings", "make_backend", *_LAZY]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value


def make_backend(spec: BackendSpec) -> TrainingBackend:
    """The backend ``spec`` names: ``local`` loads the model here; ``fsdp`` starts
    ``spec.ranks`` ranks that load it themselves (this process never holds it). A
    ``multi_adapter`` spec's backend is its base's shared adapter worker, not built here."""
    from opentinker.engine.model_loading import load_causal_lm, pick_device, resolved_spec

    if spec.multi_adapter:
        raise ValueError("multi_adapter: the model trains in its base's shared AdapterWorker "
                         "(opentinker.engine.tinker.adapter_worker), built from spec.shared_base()")
    spec = resolved_spec(spec)
    if spec.strategy == "fsdp":
        from opentinker.engine.backend.fsdp import FSDPBackend

        return FSDPBackend(spec)
    from opentinker.engine.backend.local import LocalBackend

    model = load_causal_lm(spec.model_path, device=pick_device(spec.device), trust_remote_code=spec.trust_remote_code)
    if not spec.train_vision:
        from opentinker.engine.vision import freeze_vision_tower

        freeze_vision_tower(model)
    if spec.value_head:
        from opentinker.engine.backend.value_head import attach_value_head

        attach_value_head(model, spec.seed)
    return LocalBackend(model, pad_token_id=spec.pad_token_id, with_reference=spec.with_reference,
                        use_remove_padding=spec.use_remove_padding, share_prompt_prefix=spec.share_prompt_prefix,
                        gradient_checkpointing=spec.gradient_checkpointing, lora=spec.lora,
                        value_head=spec.value_head)
