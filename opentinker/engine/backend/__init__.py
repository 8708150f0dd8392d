"""Training primitives behind one protocol (see :mod:`.base`): ``LocalBackend`` (one process)
and ``FSDPBackend`` (N FSDP2 ranks as Ray actors), chosen by ``actor_rollout_ref.actor.strategy``."""

from __future__ import annotations

import torch
from omegaconf import DictConfig

from opentinker.engine.backend.base import (
    DEFAULT_BUCKET_BYTES,
    AdamParams,
    ForwardBackwardOutput,
    ForwardOutput,
    TrainingBackend,
    WeightBucket,
    bucketed,
)
from opentinker.engine.backend.local import LocalBackend
from opentinker.engine.backend.losses import loss_names, register_loss, resolve_loss

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "AdamParams",
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


def make_backend(cfg: DictConfig, model_path: str, pad_token_id: int, device: torch.device) -> TrainingBackend:
    """The backend ``actor_rollout_ref.actor.strategy`` names, for the model at ``model_path``:
    ``local`` loads it here; ``fsdp`` starts ``trainer.nnodes x trainer.n_gpus_per_node`` ranks
    that load it themselves (this process never holds it)."""
    from opentinker.engine.backend.lora import LoraSettings

    ar = cfg.actor_rollout_ref
    lora = LoraSettings(int(ar.model.lora_rank), float(ar.model.lora_alpha), str(ar.model.target_modules),
                        seed=int(cfg.trainer.seed)) if ar.model.lora_rank > 0 else None
    common = dict(
        pad_token_id=pad_token_id,
        with_reference=bool(ar.actor.use_kl_loss),
        use_remove_padding=bool(ar.model.use_remove_padding),
        share_prompt_prefix=bool(ar.model.share_prompt_prefix),
        lora=lora,
    )
    if ar.actor.strategy == "local":
        from opentinker.engine.model_loading import load_causal_lm

        model = load_causal_lm(model_path, device=device, trust_remote_code=ar.model.trust_remote_code)
        return LocalBackend(model, gradient_checkpointing=bool(ar.model.enable_gradient_checkpointing), **common)
    if ar.actor.strategy == "fsdp":
        from opentinker.engine.backend.fsdp import FSDPBackend, FSDPOptions

        fsdp = ar.actor.fsdp_config
        options = FSDPOptions(
            model_path=model_path,
            device=cfg.trainer.device,  # the ranks' own devices, whatever this process has
            trust_remote_code=bool(ar.model.trust_remote_code),
            gradient_checkpointing=bool(ar.model.enable_gradient_checkpointing),
            param_offload=bool(fsdp.param_offload),
            optimizer_offload=bool(fsdp.optimizer_offload),
            **common,
        )
        return FSDPBackend(options, world_size=int(cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node))
    raise ValueError(f"actor_rollout_ref.actor.strategy: unknown strategy {ar.actor.strategy!r} (local | fsdp)")
