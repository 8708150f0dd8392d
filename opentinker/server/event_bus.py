"""Wakes a job's event streams when its events change, so streams need not poll the store.

The store calls :meth:`EventBus.notify` (from any thread) after it appends events or a
status; a stream takes a :meth:`waiter` *before* it reads the store, then awaits it, so an
event stored between the read and the wait is never missed.
"""

from __future__ import annotations

import asyncio


class EventBus:
    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = loop
        self._waiters: dict[str, set[asyncio.Future]] = {}

    def waiter(self, job_id: str) -> asyncio.Future:
        """A future that completes at the job's next notify (call on the event loop)."""
        future = self._loop.create_future()
        self._waiters.setdefault(job_id, set()).add(future)
        future.add_done_callback(lambda f: self._discard(job_id, f))
        return future

    def _discard(self, job_id: str, future: asyncio.Future) -> None:
        waiting = self._waiters.get(job_id)
        if waiting is not None:
            waiting.discard(future)
            if not waiting:
                del self._waiters[job_id]

    def notify(self, job_id: str) -> None:
        """Wake the job's waiters; safe from any thread."""
        if not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._wake, job_id)

    def _wake(self, job_id: str) -> None:
        for future in list(self._waiters.get(job_id, ())):
            if not future.done():
                future.set_result(None)
