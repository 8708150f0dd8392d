"""Training primitives behind one protocol (see :mod:`.base`): ``LocalBackend`` today."""

from __future__ import annotations

from omegaconf import DictConfig
from transformers import PreTrainedModel

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


def make_backend(cfg: DictConfig, model: PreTrainedModel, pad_token_id: int) -> TrainingBackend:
    """The backend ``actor_rollout_ref.actor.strategy`` names, holding ``model``."""
    ar = cfg.actor_rollout_ref
    if ar.actor.strategy != "local":
        raise ValueError(f"actor_rollout_ref.actor.strategy: unknown strategy {ar.actor.strategy!r} (local)")
    return LocalBackend(
        model,
        pad_token_id=pad_token_id,
        with_reference=bool(ar.actor.use_kl_loss),
        use_remove_padding=bool(ar.model.use_remove_padding),
        share_prompt_prefix=bool(ar.model.share_prompt_prefix),
        gradient_checkpointing=bool(ar.model.enable_gradient_checkpointing),
    )
