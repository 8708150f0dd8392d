"""JSON documents of tens of MiB (a job's datasets) in a worker thread, without stalling the event loop.

Moving the work to a thread is not enough: one ``json.loads`` or ``json.dumps`` call is C
code that holds the GIL for the whole document (0.7 s / 0.3 s for 26 MiB of small rows),
and the event loop waits for the GIL just as it would for the call. So the work is made of
short calls: :func:`loads` runs a Python hook per JSON object (the GIL can pass to the event
loop at each), :func:`dumps_chunks` encodes lists element by element. The text and values
are the same as ``json``'s.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any


def _same(value: dict[str, Any]) -> dict[str, Any]:
    return value


def loads(data: bytes | str) -> Any:
    """``json.loads(data)``, letting other threads run while it decodes (see the module docstring)."""
    return json.loads(data, object_hook=_same)


def dumps_chunks(value: Any, *, sort_keys: bool = False, separators: tuple[str, str] = (", ", ": ")) -> Iterator[str]:
    """The text of ``json.dumps(value, sort_keys=..., separators=...)`` in pieces: a list is
    encoded element by element, a dict key by key (so a dataset's rows one at a time)."""
    item_separator, key_separator = separators
    if isinstance(value, list):
        yield "["
        for i, item in enumerate(value):
            if i:
                yield item_separator
            yield json.dumps(item, sort_keys=sort_keys, separators=separators)
        yield "]"
    elif isinstance(value, dict) and all(isinstance(key, str) for key in value):
        yield "{"
        items = sorted(value.items()) if sort_keys else value.items()
        for i, (key, item) in enumerate(items):
            yield (item_separator if i else "") + json.dumps(key) + key_separator
            yield from dumps_chunks(item, sort_keys=sort_keys, separators=separators)
        yield "}"
    else:
        yield json.dumps(value, sort_keys=sort_keys, separators=separators)


def dumps(value: Any) -> str:
    """``json.dumps(value)``, in short calls."""
    return "".join(dumps_chunks(value))
