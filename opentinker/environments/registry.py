"""Which interactions a job may use, and which one a dataset row gets.

A job names its interactions with :class:`InteractionSpec` objects (sent by the thin
client). The class path in a spec is never imported on the client's say-so: it must be
registered (the built-ins, under their full dotted paths and short aliases) or put on
the allowlist by the server operator (:meth:`InteractionRegistry.allow`). Only allowed
paths are imported, and what they name must be a subclass of
:class:`~opentinker.environments.interaction.Interaction`.

No torch/transformers/ray here: the thin client imports this module for the spec.
"""

from __future__ import annotations

import importlib
import re
from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Any

from pydantic import AliasChoices, BaseModel, ConfigDict, Field

from opentinker.environments.gym_interaction import GymEnvironmentInteraction
from opentinker.environments.interaction import Interaction, InteractionContext
from opentinker.environments.openenv_interaction import OpenEnvInteraction
from opentinker.environments.text_interactions import Gsm8kInteraction, SimpleTextEnvironment
from opentinker.json_value import JsonObject

__all__ = [
    "BUILTIN_ALIASES",
    "InteractionRegistry",
    "InteractionSpec",
    "UnknownInteractionError",
    "default_registry",
    "select_interaction",
]

INTERACTION_NAME = r"^[A-Za-z0-9_][A-Za-z0-9_.:-]{0,127}$"
CLASS_PATH = r"^[A-Za-z_][A-Za-z0-9_.]{0,255}$"
_DOTTED_PATH = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)+")


class UnknownInteractionError(ValueError):
    """A class path that is not registered or allowed, or a row naming an unknown interaction."""


class InteractionSpec(BaseModel):
    """One interaction of a job: the ``name`` dataset rows refer to, its class and its config.

    ``class_name`` (verl's key for the same thing) is accepted as an alias of ``class_path``.
    """

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    # Patterns rather than "not blank": the OpenAPI document then says exactly what is taken.
    name: str = Field(pattern=INTERACTION_NAME, description="the name dataset rows use to pick this interaction")
    class_path: str = Field(
        pattern=CLASS_PATH,
        validation_alias=AliasChoices("class_path", "class_name"),
        description="a registered alias or an allowed dotted path of an Interaction subclass",
    )
    config: JsonObject = Field(default_factory=dict, description="passed to the class's constructor")


def _own_path(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


_BUILTINS: tuple[type[Interaction], ...] = (
    GymEnvironmentInteraction,
    OpenEnvInteraction,
    SimpleTextEnvironment,
    Gsm8kInteraction,
)

#: Short names and other common spellings of the built-ins (verl's and OpenTinker's).
BUILTIN_ALIASES: dict[str, type[Interaction]] = {
    "gym": GymEnvironmentInteraction,
    "openenv": OpenEnvInteraction,
    "simple_text": SimpleTextEnvironment,
    "gsm8k": Gsm8kInteraction,
    "verl.interactions.gym_environment_interaction.GymEnvironmentInteraction": GymEnvironmentInteraction,
    "verl.interactions.gsm8k_interaction.Gsm8kInteraction": Gsm8kInteraction,
}


class InteractionRegistry:
    """Maps allowed class paths to interaction classes.

    ``register`` binds a path (or alias) to a class already imported; ``allow`` puts a
    dotted path on the allowlist, to be imported on first ``resolve``. Nothing else is
    ever imported.
    """

    def __init__(self, allowed: Iterable[str] = ()):
        self._classes: dict[str, type[Interaction]] = {}
        self._allowed: set[str] = set()
        for path in allowed:
            self.allow(path)

    def register(self, class_path: str, cls: type[Interaction]) -> None:
        """Make ``class_path`` (a dotted path or a short alias) resolve to ``cls``."""
        if not isinstance(class_path, str) or not class_path.strip():
            raise ValueError(f"class path must be a non-empty string, got {class_path!r}")
        if not (isinstance(cls, type) and issubclass(cls, Interaction)):
            raise TypeError(f"{cls!r} is not a subclass of {_own_path(Interaction)}")
        self._classes[class_path.strip()] = cls

    def allow(self, class_path: str) -> None:
        """Allow the dotted path ``module.Class`` to be imported (server operator's config)."""
        path = class_path.strip() if isinstance(class_path, str) else class_path
        if not isinstance(path, str) or not _DOTTED_PATH.fullmatch(path):
            raise ValueError(f"allowed class path must be a dotted 'module.Class' path, got {class_path!r}")
        self._allowed.add(path)

    def allowed_paths(self) -> list[str]:
        """All class paths and aliases that resolve, sorted."""
        return sorted(set(self._classes) | self._allowed)

    def __contains__(self, class_path: object) -> bool:
        return isinstance(class_path, str) and (class_path in self._classes or class_path in self._allowed)

    def resolve(self, class_path: str) -> type[Interaction]:
        """The class for ``class_path``.

        Raises UnknownInteractionError (listing the allowed paths) when the path is
        neither registered nor allowed — without importing anything — and TypeError when
        an allowed path does not name an Interaction subclass.
        """
        path = class_path.strip() if isinstance(class_path, str) else class_path
        if isinstance(path, str) and path in self._classes:
            return self._classes[path]
        if not isinstance(path, str) or path not in self._allowed:
            raise UnknownInteractionError(
                f"interaction class {class_path!r} is not allowed on this server; allowed: "
                f"{', '.join(self.allowed_paths())}. A server operator can allow more class paths."
            )
        module_name, _, attribute = path.rpartition(".")
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            raise UnknownInteractionError(
                f"allowed interaction class {path!r}: cannot import {module_name!r}: {exc}"
            ) from exc
        try:
            obj = getattr(module, attribute)
        except AttributeError as exc:
            raise UnknownInteractionError(
                f"allowed interaction class {path!r}: {module_name!r} has no {attribute!r}"
            ) from exc
        if not (isinstance(obj, type) and issubclass(obj, Interaction)):
            raise TypeError(f"allowed path {path!r} names {obj!r}, which is not a subclass of {_own_path(Interaction)}")
        self._classes[path] = obj
        return obj

    def build(
        self,
        specs: Iterable[InteractionSpec | Mapping[str, Any]],
        context: InteractionContext | None = None,
    ) -> dict[str, Interaction]:
        """Instantiate every spec, keyed by its name.

        All specs are validated and resolved before any is instantiated; duplicate names
        raise ValueError. Each instance is made by ``cls.create({**spec.config, "name":
        spec.name}, context)``: ``context`` carries what the operator, not the job, decides
        (job id, allowed env endpoints); None means trusted in-process use.
        """
        parsed = [s if isinstance(s, InteractionSpec) else InteractionSpec.model_validate(s) for s in specs]
        counts = Counter(spec.name for spec in parsed)
        duplicates = sorted(name for name, count in counts.items() if count > 1)
        if duplicates:
            raise ValueError(f"duplicate interaction names: {duplicates}")
        classes = [self.resolve(spec.class_path) for spec in parsed]
        for spec, cls in zip(parsed, classes):
            known = cls.config_keys
            unknown = sorted(set(spec.config) - known - {"name", "timeout_s"}) if known is not None else []
            if unknown:
                raise ValueError(f"config: unknown key(s) {unknown} for {spec.class_path} (it takes: "
                                 f"{', '.join(sorted(known))})")
        for spec in parsed:
            timeout = spec.config.get("timeout_s")
            if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                        or not 0 < timeout <= 3600):
                raise ValueError(f"config.timeout_s of interaction {spec.name!r}: {timeout!r} is not a number of "
                                 "seconds in (0, 3600]")
        return {
            spec.name: cls.create({**spec.config, "name": spec.name}, context) for spec, cls in zip(parsed, classes)
        }

    def copy(self) -> InteractionRegistry:
        other = InteractionRegistry()
        other._classes = dict(self._classes)
        other._allowed = set(self._allowed)
        return other


def default_registry(allowed: Iterable[str] = ()) -> InteractionRegistry:
    """A new registry with the built-ins (full paths and aliases), plus ``allowed`` paths.

    Each call returns a fresh object, so extending one never changes another.
    """
    registry = InteractionRegistry()
    for cls in _BUILTINS:
        registry.register(_own_path(cls), cls)
    for alias, cls in BUILTIN_ALIASES.items():
        registry.register(alias, cls)
    for path in allowed:
        registry.allow(path)
    return registry


def select_interaction(
    row: Mapping[str, Any], interactions: Mapping[str, Interaction], default: str | None = None
) -> tuple[Interaction, dict[str, Any]]:
    """The interaction a dataset row asks for, and the row's interaction kwargs minus ``name``.

    The row names it in ``row["extra_info"]["interaction_kwargs"]["name"]``. Without a
    name: ``default`` if given, else the only interaction when there is exactly one.
    """
    if not interactions:
        raise ValueError("no interactions are configured for this job")
    extra_info = row.get("extra_info") or {}
    if not isinstance(extra_info, Mapping):
        raise ValueError(f"row 'extra_info' must be a mapping, got {type(extra_info).__name__}")
    kwargs = extra_info.get("interaction_kwargs") or {}
    if not isinstance(kwargs, Mapping):
        raise ValueError(f"row 'extra_info.interaction_kwargs' must be a mapping, got {type(kwargs).__name__}")
    rest = {k: v for k, v in kwargs.items() if k != "name"}
    name = kwargs.get("name")
    known = ", ".join(sorted(interactions))
    if name is not None:
        if name not in interactions:
            raise UnknownInteractionError(f"row names interaction {name!r}, which is not configured; known: {known}")
        return interactions[name], rest
    if default is not None:
        if default not in interactions:
            raise UnknownInteractionError(f"default interaction {default!r} is not configured; known: {known}")
        return interactions[default], rest
    if len(interactions) == 1:
        return next(iter(interactions.values())), rest
    raise ValueError(
        "row names no interaction (extra_info.interaction_kwargs.name) and no default is set; "
        f"known: {known}"
    )
