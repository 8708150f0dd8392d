"""Light checks of dataset rows, done before anything reaches a runner.

A row either carries its prompt (``prompt``: a non-empty list of ``{"role", "content"}``
chat messages, verl's format) or is data-free and names its environment through
``extra_info.interaction_kwargs`` (the environment supplies the first observation).
Everything else in a row (``reward_model``, ``data_source``, ...) is the runner's business.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


def row_problem(row: Any) -> str | None:
    """What is wrong with one row, or None."""
    if not isinstance(row, Mapping):
        return f"must be an object, got {type(row).__name__}"
    prompt = row.get("prompt")
    extra_info = row.get("extra_info")
    has_kwargs = isinstance(extra_info, Mapping) and isinstance(extra_info.get("interaction_kwargs"), Mapping)
    if prompt is None:
        if has_kwargs:
            return None
        return "needs a 'prompt' (a list of chat messages) or 'extra_info.interaction_kwargs' (a data-free row)"
    if not isinstance(prompt, list) or not prompt:
        return f"'prompt' must be a non-empty list of chat messages, got {type(prompt).__name__}"
    for i, message in enumerate(prompt):
        if not (
            isinstance(message, Mapping)
            and isinstance(message.get("role"), str)
            and isinstance(message.get("content"), str)
        ):
            return f"'prompt[{i}]' must be a message object with string 'role' and 'content'"
    if extra_info is not None and not isinstance(extra_info, Mapping):
        return f"'extra_info' must be an object, got {type(extra_info).__name__}"
    return None


def rows_problems(rows: Sequence[Any], field: str, limit: int = 5) -> list[str]:
    """Up to ``limit`` problems, each naming its row as ``field[i]``."""
    problems = []
    for i, row in enumerate(rows):
        problem = row_problem(row)
        if problem is not None:
            problems.append(f"{field}[{i}]: {problem}")
            if len(problems) >= limit:
                break
    return problems
