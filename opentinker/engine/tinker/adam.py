"""Tinker's ``AdamParams`` as the training primitives' :class:`AdamParams`, and an
``optim_step``'s metrics back under Tinker's names."""

from __future__ import annotations

from collections.abc import Mapping

from opentinker.engine.backend.base import AdamParams


def adam_params(adam: Mapping[str, float]) -> AdamParams:
    """Tinker's ``AdamParams`` fields as the backend's."""
    clip = float(adam.get("grad_clip_norm") or 0.0)
    return AdamParams(lr=float(adam["learning_rate"]), betas=(float(adam["beta1"]), float(adam["beta2"])),
                      eps=float(adam["eps"]), weight_decay=float(adam["weight_decay"]),
                      grad_clip=clip if clip > 0 else None)


def tinker_step_metrics(metrics: Mapping[str, float]) -> dict[str, float]:
    """The backend's ``optim_step`` metrics under Tinker's names."""
    return {"grad_norm:mean": metrics["grad_norm"], "learning_rate:mean": metrics["lr"],
            "skipped_nonfinite:sum": metrics["skipped_nonfinite"]}
