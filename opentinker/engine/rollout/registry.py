"""The rollout engines a recipe may name (``actor_rollout_ref.rollout.name``): each registered
once with its builder and what it can do. A new engine registers here (or from its own module
or a test) and is then a valid config value, with nothing else to change.

A builder takes a :class:`RolloutBuild` (the recipe and what the trainer has loaded) and
returns a :class:`~opentinker.engine.rollout.base.RolloutEngine`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from opentinker.engine.algorithms.registry import Registry
from opentinker.engine.rollout.base import RolloutEngine
from opentinker.recipe import RecipeSpec


@dataclass
class RolloutBuild:
    """What a builder gets: the recipe, the model's folder, tokenizer and end-of-sequence ids,
    the training device, and a list to append what the user should be told at the first step."""

    cfg: RecipeSpec
    model_path: str
    tokenizer: Any
    eos_ids: Any
    device: Any  # torch.device
    warnings: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class RolloutEngineKind:
    """A registered engine: its builder and what it can do. ``samples_while_training``: it
    keeps sampling while the update runs, which ``async_training.max_staleness > 0`` needs."""

    name: str
    build: Callable[[RolloutBuild], RolloutEngine]
    samples_while_training: bool


_ENGINES: Registry[Callable[[RolloutBuild], RolloutEngine]] = Registry(
    "rollout engine", config_key="actor_rollout_ref.rollout.name")
_KINDS: dict[str, RolloutEngineKind] = {}


def register_rollout_engine(name: str, *, samples_while_training: bool, override: bool = False):
    """Decorator registering ``build(RolloutBuild) -> RolloutEngine`` as the engine ``name``."""

    def decorator(build: Callable[[RolloutBuild], RolloutEngine]) -> Callable[[RolloutBuild], RolloutEngine]:
        _ENGINES.register(name, override=override)(build)
        _KINDS[name] = RolloutEngineKind(name, build, samples_while_training)
        return build

    return decorator


def rollout_engine_kind(name: str) -> RolloutEngineKind:
    """The engine registered as ``name``; ValueError naming the registered ones otherwise."""
    _ENGINES.get(name)  # the error with the closest name and the valid ones
    return _KINDS[name]


def rollout_engine_names() -> tuple[str, ...]:
    return _ENGINES.names()
