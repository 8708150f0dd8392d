"""The shape every dataset row must have: one set of rules, applied by the client as it reads a
dataset (``client/environment.py``) and by the server as a job's rows arrive
(``server/validation.py``, which adds what only the server knows: the interaction classes' own
row checks, the built-in task's, and prompt lengths in the served model's tokens).

A row either carries its prompt (``prompt``: a non-empty list of ``{"role", "content"}`` chat
messages, verl's format; a content is a string or a list of text and picture parts, see
``opentinker/images.py``) or, in a job with interactions, is data-free and names its environment
through ``extra_info.interaction_kwargs`` (the environment's first observation opens the chat).
It picks one of the job's interactions by ``extra_info.interaction_kwargs.name``, or implicitly
when the job has exactly one.

No torch: the thin client imports it.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

from opentinker.images import ImageError, image_url

__all__ = ["ROLES", "interaction_kwargs", "parts_problem", "prompt_problem", "row_shape_problem"]

ROLES = ("system", "user", "assistant", "tool")


def prompt_problem(prompt: Any) -> str | None:
    """What is wrong with a row's ``prompt`` (a non-empty list of chat messages), or None."""
    if not isinstance(prompt, list) or not prompt:
        return f"'prompt' must be a non-empty list of chat messages [{{'role': ..., 'content': ...}}], " \
               f"got {type(prompt).__name__}"
    for i, message in enumerate(prompt):
        content = message.get("content") if isinstance(message, Mapping) else None
        if isinstance(content, list):
            problem = parts_problem(content)
            if problem is not None:
                return f"'prompt[{i}].content{problem}"
        elif not isinstance(content, str):
            content = None
        if content is None or not isinstance(message.get("role"), str):
            return (f"'prompt[{i}]' must be a message object with string 'role' and 'content' (a string, or a "
                    "list of text and picture parts)")
        if message["role"] not in ROLES:
            return f"'prompt[{i}].role' must be one of {', '.join(ROLES)}, got {message['role']!r}"
    return None


def parts_problem(parts: list) -> str | None:
    """What is wrong with a content list of parts (``[...]`` and the rest of the message, to
    follow a field name), or None: each part a text part ``{"type": "text", "text": str}`` or a
    picture part whose picture is a data URL (read and bounded only on the server)."""
    if not parts:
        return "' must not be an empty list of parts"
    for j, part in enumerate(parts):
        if isinstance(part, Mapping) and part.get("type") == "text":
            if not isinstance(part.get("text"), str):
                return f"[{j}].text' must be a string"
            continue
        try:
            url = image_url(part)
        except ImageError as error:
            return f"[{j}]': {error}"
        if url is None:
            return (f"[{j}]' must be a text part {{'type': 'text', 'text': ...}} or a picture part "
                    f"{{'type': 'image', 'image': 'data:image/png;base64,...'}} or {{'type': 'image_url', ...}}")
        if not url.startswith("data:"):
            return f"[{j}]': a picture must be a data: URL (the server fetches no URL a client names)"
    return None


def interaction_kwargs(row: Mapping[str, Any]) -> Any:
    """The row's ``extra_info.interaction_kwargs`` (None when it has none)."""
    extra_info = row.get("extra_info")
    return extra_info.get("interaction_kwargs") if isinstance(extra_info, Mapping) else None


def row_shape_problem(row: Any, interactions: Collection[str]) -> str | None:
    """What is wrong with the shape of ``row`` for a job with the named ``interactions``, or None:
    an object; ``extra_info`` and its ``interaction_kwargs`` objects when present; a prompt, or
    (with interactions) a data-free row; and, with interactions, the one it picks exists."""
    if not isinstance(row, Mapping):
        return f"must be an object, got {type(row).__name__}"
    extra_info = row.get("extra_info")
    if extra_info is not None and not isinstance(extra_info, Mapping):
        return f"'extra_info' must be an object, got {type(extra_info).__name__}"
    kwargs = interaction_kwargs(row)
    if kwargs is not None and not isinstance(kwargs, Mapping):
        return f"'extra_info.interaction_kwargs' must be an object, got {type(kwargs).__name__}"
    prompt = row.get("prompt")
    if prompt is None:
        keys = f" (its keys: {', '.join(sorted(map(str, row)))[:200] or 'none'})"
        if not interactions:
            return ("needs a 'prompt' (a list of chat messages); a data-free row ('extra_info.interaction_kwargs', no "
                    "prompt) needs an interaction to open the chat, and there is none" + keys)
        if kwargs is None:
            return ("needs a 'prompt' (a list of chat messages) or 'extra_info.interaction_kwargs' (a data-free row)"
                    + keys)
    else:
        problem = prompt_problem(prompt)
        if problem:
            return problem
    if not interactions:
        return None
    name = (kwargs or {}).get("name")
    if name is None:
        if len(interactions) != 1:
            return (f"names no interaction (extra_info.interaction_kwargs.name) and there are "
                    f"{len(interactions)}: {', '.join(sorted(interactions))}")
    elif name not in interactions:
        return (f"'extra_info.interaction_kwargs.name' {name!r} is not one of the interactions: "
                f"{', '.join(sorted(interactions))}")
    return None
