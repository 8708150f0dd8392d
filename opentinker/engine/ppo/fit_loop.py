"""``RLTrainer.fit``'s loop: steps until ``trainer.total_training_steps``, with a progress
bar, the validation lines, wandb logging and the caller's per-step callback. What a step does
is the trainer's; this only drives and reports."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from opentinker.engine.ppo.trainer import RLTrainer

__all__ = ["fit_loop"]


def fit_loop(trainer: RLTrainer, on_step: Callable[[int, dict[str, Any]], None] | None = None) -> list[dict[str, Any]]:
    """Train until ``trainer.total_training_steps``; every step's metrics (and step 0's
    validation, when there is one)."""
    total = trainer.cfg.trainer.total_training_steps
    history: list[dict[str, Any]] = []
    progress = _progress_bar(total, trainer.cfg.trainer.progress_bar)
    last_val = trainer.initial_validation()
    if last_val:
        history.append({"step": 0, **last_val})
        progress.write(f"step 0: {_format(last_val)}")
        _log_wandb(trainer.wandb_run, history[-1], step=0)
    while trainer.global_step < total:
        metrics = trainer.train_step()
        if "skip_reason" in metrics:
            progress.write(f"step {trainer.global_step}: skipped, nothing to train on: {metrics['skip_reason']}")
        val = {k: v for k, v in metrics.items() if k.startswith("val/")}
        if val:
            last_val = val
            progress.write(f"step {trainer.global_step}: {_format(last_val)}")
        history.append(metrics)
        progress.set_postfix(
            reward=f"{metrics.get('reward/mean', float('nan')):.3f}",
            kl=f"{metrics.get('actor/kl', 0.0):.4f}",
            val=f"{last_val.get('val/accuracy', float('nan')):.3f}",
        )
        progress.update(1)
        _log_wandb(trainer.wandb_run, metrics, step=trainer.global_step)
        if on_step is not None:
            on_step(trainer.global_step, metrics)
    progress.close()
    return history


def _log_wandb(run: Any, metrics: dict[str, Any], step: int) -> None:
    """Every numeric metric of a step to the wandb run, at that step (skip_reason and
    checkpoint are strings and stay out)."""
    if run is not None:
        run.log({k: v for k, v in metrics.items() if isinstance(v, (int, float))}, step=step)


def _format(metrics: dict[str, float]) -> str:
    return " ".join(f"{k}={v:.4f}" for k, v in metrics.items())


def _progress_bar(total: int, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="GRPO steps", unit="step", disable=not enabled, dynamic_ncols=True)
