"""A training run's checkpoint folders (verl's layout): written after a step, found and read
to resume. What goes in ``trainer_state.pt`` is the trainer's components' own state."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch

from opentinker.config import ConfigError
from opentinker.protocol import step_checkpoint_name

__all__ = ["ACTOR_STATE", "CRITIC_STATE", "LATEST_CHECKPOINT", "TRAINER_STATE", "find_checkpoint", "read_trainer_state",
           "write_checkpoint"]

TRAINER_STATE = "trainer_state.pt"
ACTOR_STATE = "state"  # the policy's backend state (weights, optimizer, RNG)
CRITIC_STATE = "critic_state"  # the value model's backend state, beside the actor's "state"
LATEST_CHECKPOINT = "latest_checkpointed_iteration.txt"  # verl's name for the same file


#: A model folder's files for its inputs beside the tokenizer's (a vision-language model's image processor).
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")


def write_checkpoint(root: Path, step: int, backend: Any, tokenizer: Any, critic_backend: Any | None,
                     trainer_state: dict[str, Any], model_path: str | None = None) -> Path:
    """``<root>/global_step_<step>/``: ``actor/`` (a Hugging Face folder, with the processor
    files of the model folder ``model_path`` beside the tokenizer's), ``state/`` (the
    backend's weights, optimizer and RNG), ``critic_state/`` (with a critic) and
    ``trainer_state.pt`` (step, data position, schedules, RNG: ``trainer_state``); the file
    ``latest_checkpointed_iteration.txt`` names the newest complete one. Returns the ``actor``
    folder."""
    folder = root / step_checkpoint_name(step)
    actor = backend.export_hf(folder / "actor", tokenizer)
    for name in PROCESSOR_FILES:
        source = Path(model_path) / name if model_path else None
        if source is not None and source.is_file():
            shutil.copyfile(source, actor / name)
    backend.save_state(folder / ACTOR_STATE)
    if critic_backend is not None:
        critic_backend.save_state(folder / CRITIC_STATE)
    torch.save(trainer_state, folder / TRAINER_STATE)  # last: its presence marks a complete checkpoint
    latest = root / LATEST_CHECKPOINT
    tmp = latest.with_suffix(".tmp")
    tmp.write_text(str(step))
    tmp.replace(latest)
    return actor


def read_trainer_state(folder: Path) -> dict[str, Any]:
    """What :func:`write_checkpoint` saved as ``trainer_state``."""
    return torch.load(folder / TRAINER_STATE, weights_only=False)


def find_checkpoint(resume_mode: str, root: str | None) -> Path | None:
    """The checkpoint ``trainer.resume_mode`` asks for: ``disable`` none; ``auto`` the newest
    complete one under ``root`` (none on a fresh run); else the ``global_step_<k>`` folder it
    names, which must be complete."""
    if resume_mode == "disable":
        return None
    if resume_mode == "auto":
        latest = Path(root) / LATEST_CHECKPOINT if root else None
        if latest is None or not latest.exists():
            return None
        folder = Path(root) / step_checkpoint_name(int(latest.read_text().strip()))
    else:
        folder = Path(resume_mode)
    if not (folder / TRAINER_STATE).exists():
        raise ConfigError(f"trainer.resume_mode: {folder} is not a complete checkpoint (no {TRAINER_STATE})")
    return folder
