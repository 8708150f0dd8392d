"""The reference of every recipe key, read off the schema: ``opentinker config keys`` prints it,
and ``docs/config_keys.md`` is this module's Markdown (``python -m opentinker.recipe.reference
> docs/config_keys.md``; a test keeps the page equal to it)."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator

from opentinker.recipe.knobs import KeyInfo, knobs_of
from opentinker.recipe.spec import RecipeSpec

_INTRO = """# Recipe keys

Every key of a training recipe, with its default, what it allows and what it does. Give keys
dotted (`actor_rollout_ref.actor.optim.lr=1e-5` on `opentinker-train`, or
`{"actor_rollout_ref.actor.optim.lr": 1e-5}` in a `GenericEnvironment`'s config) or nested.
A server operator may lower or raise the upper bound of a numeric key (`opentinker-server serve
--limit KEY=VALUE`) and turn off a key marked *operator switch*. Names of advantage estimators and
policy losses registered in the engine are valid too.

Generated from `opentinker/recipe/components.py` by `python -m opentinker.recipe.reference`; do not
edit by hand (`opentinker config keys` prints the same)."""


def _number(value: float) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def allowed(info: KeyInfo) -> str:
    """What the key's values may be, in a few words."""
    knob = info.knob
    parts = [info.kind.__name__ + (" or null" if info.nullable else "")]
    if knob.choices:
        parts.append("one of " + ", ".join(knob.choices) if info.kind is not list else
                     "items from " + ", ".join(knob.choices))
    if knob.low is not None or knob.high is not None:
        low = "" if knob.low is None else f"{'>' if knob.above_low else '>='} {_number(knob.low)}"
        high = "" if knob.high is None else f"<= {_number(knob.high)}"
        parts.append(" and ".join(p for p in (low, high) if p))
    if knob.switch:
        parts.append("operator switch")
    return "; ".join(parts)


def rows() -> Iterator[tuple[str, str, str, str]]:
    """``(key, default as JSON, allowed, doc)`` of every key, in the schema's order."""
    for info in knobs_of(RecipeSpec):
        yield info.key, json.dumps(info.default), allowed(info), info.knob.doc


def markdown() -> str:
    lines = [_INTRO.rstrip("\n")]
    section = None
    for key, default, allows, doc in rows():
        top = key.split(".")[0]
        if top != section:
            section = top
            lines += ["", f"## `{top}`", "", "| key | default | allowed | what it does |", "|---|---|---|---|"]
        cell = doc.replace("|", "\\|")
        lines.append(f"| `{key}` | `{default}` | {allows.replace('|', '/')} | {cell} |")
    return "\n".join(lines) + "\n"


def plain() -> str:
    """One block per key, for a terminal."""
    return "\n".join(f"{key} = {default}\n    {allows}\n    {doc}" for key, default, allows, doc in rows()) + "\n"


if __name__ == "__main__":
    sys.stdout.write(markdown())
