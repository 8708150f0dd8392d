"""The whole recipe typed: :class:`RecipeSpec`, the root of the component specs
(``components.py``), whose attribute paths are the config's dotted keys, so code written as
``spec.actor_rollout_ref.actor.optim.lr`` reads it. :meth:`RecipeSpec.from_config` types a tree
already checked key by key (``config.make_config``) and applies every rule that spans keys
(``rules.py``); ``config.build_recipe`` does both from the user's overrides, and is what the
client, ``POST /v1/jobs`` and the trainer call: a combination that cannot run is refused at the
door, naming the key, before a job is queued.

No torch: the thin client builds specs too.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from omegaconf import DictConfig, OmegaConf

from opentinker.recipe.components import (
    ActorRolloutRefSpec, AlgorithmSpec, AsyncTrainingSpec, CriticSpec, DataSpec, JobMode, RewardSpec, TrainerSpec,
)
from opentinker.recipe.knobs import ConfigError, is_section, knobs_of, section
from opentinker.recipe.rules import cross_field_problem

__all__ = ["RecipeSpec", "spec_keys"]


@dataclass(frozen=True)
class RecipeSpec:
    """A whole training recipe; attribute paths are the config's dotted keys."""

    data: DataSpec = section(DataSpec)
    actor_rollout_ref: ActorRolloutRefSpec = section(ActorRolloutRefSpec)
    critic: CriticSpec = section(CriticSpec)
    reward_model: RewardSpec = section(RewardSpec)
    algorithm: AlgorithmSpec = section(AlgorithmSpec)
    async_training: AsyncTrainingSpec = section(AsyncTrainingSpec)
    trainer: TrainerSpec = section(TrainerSpec)
    mode: JobMode = field(default="server", compare=False)  # how the job gets its batches

    @classmethod
    def from_config(cls, cfg: DictConfig | Mapping[str, Any], *, mode: JobMode = "server",
                    gpus: bool | None = None) -> RecipeSpec:
        """The spec of a config already checked key by key (``make_config``), with the
        cross-field rules applied; ConfigError naming the key when one fails."""
        tree = OmegaConf.to_container(cfg, resolve=False) if isinstance(cfg, DictConfig) else dict(cfg)
        return _typed(cls, tree).for_job(mode, gpus=gpus)

    def for_job(self, mode: JobMode, gpus: bool | None = None) -> RecipeSpec:
        """This spec for a job of ``mode`` on a machine with GPUs or not (None: unknown), the
        rules across keys checked for it (ConfigError naming the key)."""
        spec = dataclasses.replace(self, mode=mode)
        problem = cross_field_problem(spec, gpus=gpus)
        if problem is not None:
            key, message = problem
            raise ConfigError(message, key=key)
        return spec

    def to_tree(self) -> dict[str, Any]:
        """The spec as the config's nested dict (lists where the config has them)."""
        tree: dict[str, Any] = {}
        for key, value in self.to_dotted().items():
            node = tree
            *parts, leaf = key.split(".")
            for part in parts:
                node = node.setdefault(part, {})
            node[leaf] = value
        return tree

    def replaced(self, key: str, value: Any) -> RecipeSpec:
        """A copy with the dotted ``key`` set to ``value`` (not checked again: for values the
        server sets itself, e.g. where a job resumes from)."""
        top, _, rest = key.partition(".")
        if not rest:
            return dataclasses.replace(self, **{top: value})
        return dataclasses.replace(self, **{top: _replaced(getattr(self, top), rest, value)})

    def to_dotted(self) -> dict[str, Any]:
        """The spec as the wire's flat ``{dotted.key: value}`` (lists where the config has them)."""
        flat: dict[str, Any] = {}

        def walk(node: Any, prefix: str) -> None:
            for item in dataclasses.fields(node):
                if item.name == "mode" and prefix == "":
                    continue
                value = getattr(node, item.name)
                if dataclasses.is_dataclass(value):
                    walk(value, f"{prefix}{item.name}.")
                else:
                    flat[f"{prefix}{item.name}"] = list(value) if isinstance(value, tuple) else value

        walk(self, "")
        return flat


def _replaced(node: Any, key: str, value: Any) -> Any:
    name, _, rest = key.partition(".")
    if not hasattr(node, name):
        raise KeyError(f"no config key {key!r} here")
    return dataclasses.replace(node, **{name: _replaced(getattr(node, name), rest, value) if rest else value})


def _typed(cls: type, tree: Mapping[str, Any]) -> Any:
    """``cls`` (a spec dataclass) from its section of the config tree; lists become tuples."""
    hints = typing.get_type_hints(cls)
    values = {}
    for item in dataclasses.fields(cls):
        if item.name not in tree:
            continue  # its default
        value = tree[item.name]
        if is_section(hints[item.name]):
            value = _typed(hints[item.name], value)
        elif isinstance(value, list):
            value = tuple(value)
        values[item.name] = value
    return cls(**values)


def spec_keys() -> list[str]:
    """Every dotted key of the recipe, in declaration order."""
    return [info.key for info in knobs_of(RecipeSpec)]
