"""Observation templates: how an env's observation becomes the next user turn.

A template comes from a job's client, so it is checked by parsing before it is ever used:
plain field names only (``"{observation.__class__}"`` or ``"{step[0]}"`` would reach into
Python objects), no nested fields in a format spec, and widths and precisions of at most
:data:`MAX_TEMPLATE_NUMBER` (``"{observation:>1000000000}"`` is a memory bomb).

Pure Python: the thin client imports it.
"""

from __future__ import annotations

import re
import string
from typing import Any

__all__ = ["BASE_FIELDS", "MAX_TEMPLATE_CHARS", "MAX_TEMPLATE_NUMBER", "checked_template", "template_names"]

#: The fields every template may use: the observation's text, the step's reward, the step count.
BASE_FIELDS = ("observation", "reward", "step")
MAX_TEMPLATE_CHARS = 2000
MAX_TEMPLATE_NUMBER = 100
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")


def checked_template(template: Any, *, named_fields: bool = False) -> str:
    """``template`` when it may use only ``{observation}``, ``{reward}`` and ``{step}`` (format
    specs such as ``{reward:.2f}`` are fine), else ValueError saying why.

    ``named_fields``: it may also name other fields (plain identifiers, e.g. ``{board}``): an
    observation's own fields, which the caller formats as text (checked here as empty text).
    """
    if not isinstance(template, str):
        raise ValueError(f"observation_template must be a string, got {type(template).__name__}")
    if len(template) > MAX_TEMPLATE_CHARS:
        raise ValueError(f"observation_template: at most {MAX_TEMPLATE_CHARS} characters, got {len(template)}")
    allowed = ("{observation}, {reward}, {step} and the observation's own fields by name (e.g. {board})"
               if named_fields else "{observation}, {reward} and {step}")
    try:
        parts = list(string.Formatter().parse(template))
    except ValueError as exc:
        raise ValueError(f"observation_template {template!r} is invalid ({exc}); it may use {allowed}") from exc
    names = set()
    for _, field, spec, _ in parts:
        if field is None:
            continue
        if field not in BASE_FIELDS and not (named_fields and _NAME.fullmatch(field)):
            raise ValueError(
                f"observation_template may use only the plain fields {allowed} (no attribute access, "
                f"indexing or positional fields), got {{{field}}}"
            )
        names.add(field)
        if "{" in spec or "}" in spec:
            raise ValueError(f"observation_template: nested fields in a format spec are not allowed, got {spec!r}")
        if any(int(number) > MAX_TEMPLATE_NUMBER for number in re.findall(r"\d+", spec)):
            raise ValueError(
                f"observation_template: widths and precisions are at most {MAX_TEMPLATE_NUMBER}, got {spec!r}"
            )
    try:
        template.format(**{**{name: "" for name in names}, "observation": "", "reward": 0.0, "step": 0})
    except (ValueError, TypeError) as exc:  # a spec that does not fit its value, e.g. {observation:d}
        raise ValueError(f"observation_template {template!r} is invalid ({exc}); it may use {allowed}") from exc
    return template


def template_names(template: str) -> list[str]:
    """The fields a checked template names besides :data:`BASE_FIELDS`, in order of first use."""
    names: list[str] = []
    for _, field, _, _ in string.Formatter().parse(template):
        if field is not None and field not in BASE_FIELDS and field not in names:
            names.append(field)
    return names
