"""A small Server-Sent Events parser (the WHATWG event-stream format, as the server writes it).

The server sends ``id: <seq>\\nevent: <type>\\ndata: <Event JSON>\\n\\n`` per event and may
send ``: comment`` lines as heartbeats. An event is dispatched at the blank line that ends
it; an event cut off by a dropped connection (no blank line yet) is discarded, so a
reconnect with ``Last-Event-ID`` picks it up again.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class ServerSentEvent:
    data: str
    event: str = "message"
    id: str | None = None  # the last id seen on the stream so far (SSE's "last event ID")
    retry_ms: int | None = None


def iter_sse(lines: Iterable[str]) -> Iterator[ServerSentEvent]:
    """Events from the stream's lines (without their line terminators)."""
    data: list[str] = []
    event = ""
    last_id: str | None = None
    retry_ms: int | None = None
    for line in lines:
        if line == "":
            if data:
                yield ServerSentEvent(data="\n".join(data), event=event or "message", id=last_id, retry_ms=retry_ms)
            data, event = [], ""
            continue
        if line.startswith(":"):
            continue
        field, sep, value = line.partition(":")
        if sep and value.startswith(" "):
            value = value[1:]
        if field == "data":
            data.append(value)
        elif field == "event":
            event = value
        elif field == "id":
            if "\0" not in value:
                last_id = value
        elif field == "retry":
            if value.isdigit():
                retry_ms = int(value)
        # other fields are ignored, as the format says
