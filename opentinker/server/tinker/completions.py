"""What ``/api/v1/retrieve_futures`` reports: per sampling session (and cloned sampler), the
sample requests that finished, in order, each with a cursor.

With ``sample_use_retrieve_futures`` on (the server's ``client_config``), an SDK sampling
client runs one long poll per session instead of one ``retrieve_future`` long poll per
request in flight, and fetches a request's payload once it is reported done. A poll names the
last cursor it saw (``prev_cursor``): what is at or before it is dropped, what is after it is
answered, and with nothing new the poll waits up to its ``timeout`` (None: the server's long
poll) for the next completion.

Bounded: a feed keeps its newest ``max_events`` completions and a user their ``max_feeds``
most recently used feeds (an SDK client polls all along, so only a client that never polls
loses any: it still has ``retrieve_future``); feeds idle past the futures' TTL are dropped.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

#: A feed: (user id, sampling session id, cloned sampler id).
FeedKey = tuple[int, str, int]


@dataclass
class _Feed:
    events: collections.deque = field(default_factory=collections.deque)  # (cursor, completion dict)
    cursor: int = 0  # of the newest event
    touched: float = 0.0
    changed: asyncio.Event = field(default_factory=asyncio.Event)


class CompletionFeeds:
    def __init__(self, max_events: int = 1024, max_feeds: int = 64, clock: Callable[[], float] = time.monotonic):
        self.max_events = max_events
        self.max_feeds = max_feeds
        self.clock = clock
        self._feeds: dict[int, collections.OrderedDict[tuple[str, int], _Feed]] = {}

    def _feed(self, user_id: int, session: str, clone: int) -> _Feed:
        feeds = self._feeds.setdefault(user_id, collections.OrderedDict())
        feed = feeds.get((session, clone))
        if feed is None:
            feed = feeds[(session, clone)] = _Feed()
            while len(feeds) > self.max_feeds:
                feeds.popitem(last=False)
        feeds.move_to_end((session, clone))
        feed.touched = self.clock()
        return feed

    def add(self, user_id: int, session: str, clone: int, request_id: str, failed: bool,
            payload_size: int | None = None) -> None:
        """A sample request of that feed finished (or failed)."""
        feed = self._feed(user_id, session, clone)
        feed.cursor += 1
        completion: dict[str, Any] = {"state": "failed" if failed else "finished", "request_id": request_id}
        if not failed:
            completion["response_payload_uncompressed_size"] = payload_size
        feed.events.append((feed.cursor, completion))
        while len(feed.events) > self.max_events:
            feed.events.popleft()
        feed.changed.set()

    async def poll(self, user_id: int, session: str, clone: int, prev_cursor: int,
                   timeout_s: float) -> tuple[list[dict[str, Any]], int]:
        """Completions after ``prev_cursor`` (waiting up to ``timeout_s`` for one) and the cursor
        to send next time."""
        feed = self._feed(user_id, session, clone)
        while feed.events and feed.events[0][0] <= prev_cursor:
            feed.events.popleft()
        if not feed.events and timeout_s > 0:
            feed.changed.clear()
            try:
                await asyncio.wait_for(feed.changed.wait(), timeout_s)
            except asyncio.TimeoutError:
                pass
        news = [completion for cursor, completion in feed.events if cursor > prev_cursor]
        return news, max(prev_cursor, feed.events[-1][0] if news else prev_cursor)

    def forget_idle(self, idle_s: float) -> None:
        """Drops feeds nobody added to or polled for ``idle_s``."""
        cutoff = self.clock() - idle_s
        for user_id in list(self._feeds):
            feeds = self._feeds[user_id]
            for key in [key for key, feed in feeds.items() if feed.touched < cutoff]:
                del feeds[key]
            if not feeds:
                del self._feeds[user_id]
