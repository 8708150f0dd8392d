"""A recipe key declared once: its default, its one-line doc and its checks, on the field of
the component spec that holds it (``knob(...)``). The config's tables (defaults, types,
choices, ranges) and the key reference are read off these declarations (:func:`knobs_of`).

No torch, and nothing from the rest of the package: the thin client imports this.
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

_KNOB = "opentinker.knob"


class ConfigError(ValueError):
    """A config key or value is invalid; the message names the key, and ``key`` is it (the dotted
    key; None when no single key is at fault)."""

    def __init__(self, message: str, key: str | None = None):
        super().__init__(message)
        if key is None:  # the per-key checks say "config key '<key>'"
            named = re.search(r"config key '([A-Za-z0-9_.]+)'", message)
            key = named.group(1) if named else None
        self.key = key

    def __reduce__(self):  # the key survives pickling (a runner's error crossing to the server)
        return (type(self), (str(self), self.key))


@dataclass(frozen=True)
class Knob:
    """What one key allows. ``low``/``high``: inclusive bounds (None: none on that side; ``high``
    is a sanity limit an operator may change), ``above_low``: the value must exceed ``low``;
    ``choices``: the names allowed (each item, for a list); ``switch``: a boolean an operator
    may turn off on their server."""

    doc: str
    choices: tuple[str, ...] | None = None
    low: float | None = None
    high: float | None = None
    above_low: bool = False
    switch: bool = False


def knob(default: Any, doc: str, *, choices: tuple[str, ...] | None = None,
         range: tuple[float | None, float | None] | None = None,  # noqa: A002 - the word for it
         above_low: bool = False, switch: bool = False) -> Any:
    """A spec field holding one key: its default (a list is stored as a tuple), doc and checks."""
    low, high = range if range is not None else (None, None)
    if isinstance(default, list):
        default = tuple(default)
    meta = Knob(doc=doc, choices=choices, low=low, high=high, above_low=above_low, switch=switch)
    return dataclasses.field(default=default, metadata={_KNOB: meta})


def section(cls: type) -> Any:
    """A spec field holding a component (a nested section of the config) with its defaults."""
    return dataclasses.field(default_factory=cls)


@dataclass(frozen=True)
class KeyInfo:
    """One key of the recipe as the config reads it: ``kind`` is the type its values take
    (``list`` for a tuple field) and ``nullable`` whether null is a value of it."""

    key: str
    default: Any
    kind: type
    nullable: bool
    knob: Knob


def _kind(annotation: Any) -> tuple[type, bool]:
    """``(type of a value, whether None is allowed)`` of a field's resolved annotation."""
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        (inner,) = [a for a in args if a is not type(None)]
        return _kind(inner)[0], True
    if typing.get_origin(annotation) is tuple or annotation is tuple:
        return list, False
    return annotation, False


def is_section(annotation: Any) -> bool:
    return isinstance(annotation, type) and dataclasses.is_dataclass(annotation)


def knobs_of(cls: type, prefix: str = "") -> Iterator[KeyInfo]:
    """Every key under the spec class ``cls``, dotted, in declaration order."""
    hints = typing.get_type_hints(cls)
    for item in dataclasses.fields(cls):
        annotation = hints[item.name]
        if is_section(annotation):
            yield from knobs_of(annotation, f"{prefix}{item.name}.")
        elif _KNOB in item.metadata:
            kind, nullable = _kind(annotation)
            default = list(item.default) if isinstance(item.default, tuple) else item.default
            yield KeyInfo(f"{prefix}{item.name}", default, kind, nullable, item.metadata[_KNOB])
