"""Ends what a request holds open once the key it was made with is revoked.

A key is checked when a request arrives; an event stream or a long poll then outlives that
check by minutes or hours. Keys are revoked by ``opentinker-server admin revoke-key``, another
process writing the same SQLite file, so nothing tells this one: a :class:`CredentialWatch`
looks every credential that something is held open under up again every ``interval_s`` (2 s),
all of them in one query, and wakes what is held under one that is gone (a revoked key; a
dashboard session logged out, expired or whose key was revoked). Routes use the two helpers:
:func:`stream_until_revoked` (an event stream ends: nothing more is sent) and
:func:`until_revoked` (a long poll is answered 401).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sqlite3
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Iterator
from dataclasses import dataclass
from typing import TypeVar

from fastapi import Request

from opentinker.server.errors import ApiError
from opentinker.server.store import Store

log = logging.getLogger("opentinker.server.auth")
T = TypeVar("T")

CHECK_INTERVAL_S = 2.0


@dataclass(frozen=True)
class Credential:
    """What a request was authenticated with: ``kind`` "key" (an API key) or "session" (the
    dashboard's cookie), and the SHA-256 of the key or the session token."""

    kind: str
    digest: str


def note_credential(request: Request, kind: str, digest: str) -> None:
    """Called by the key checks, so that what the request holds open can be watched."""
    request.state.credential = Credential(kind, digest)


class CredentialWatch:
    """The credentials that streams and long polls are held under, looked up every
    ``interval_s`` by one task that runs only while something is watched. Used from the
    event loop only."""

    def __init__(self, store: Store, interval_s: float = CHECK_INTERVAL_S):
        self.store = store
        self.interval_s = interval_s
        self._watched: dict[Credential, list] = {}  # credential -> [holders, ended event]
        self._task: asyncio.Task | None = None

    @contextlib.contextmanager
    def watch(self, credential: Credential) -> Iterator[asyncio.Event]:
        """An event set once ``credential`` is no longer valid (within ``interval_s``)."""
        entry = self._watched.setdefault(credential, [0, asyncio.Event()])
        entry[0] += 1
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())
        try:
            yield entry[1]
        finally:
            entry[0] -= 1
            if entry[0] == 0 and self._watched.get(credential) is entry:
                del self._watched[credential]

    async def _run(self) -> None:
        while self._watched:  # ends when nothing is watched; the next watch starts it again
            await asyncio.sleep(self.interval_s)
            self.check()

    def check(self) -> None:
        """Set the ended event of every watched credential that is no longer valid."""
        live = {c: entry[1] for c, entry in self._watched.items() if not entry[1].is_set()}
        if not live:
            return
        try:
            gone_keys, gone_sessions = self.store.ended_credentials(
                [c.digest for c in live if c.kind == "key"], [c.digest for c in live if c.kind == "session"])
        except sqlite3.Error as error:  # e.g. locked for longer than the store waits: try again next time
            log.warning("could not check whether open streams' API keys are still valid: %s", error)
            return
        for credential, ended in live.items():
            if credential.digest in (gone_keys if credential.kind == "key" else gone_sessions):
                ended.set()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task


def _watched(request: Request) -> contextlib.AbstractContextManager[asyncio.Event]:
    credential = getattr(request.state, "credential", None)
    if credential is None:  # a route that holds something open always checks a key first
        raise RuntimeError(f"{request.url.path}: no credential was noted for this request")
    return request.app.state.credential_watch.watch(credential)


def revoked_error() -> ApiError:
    return ApiError(401, "the API key was revoked (or the dashboard session ended) while this request waited",
                    headers={"WWW-Authenticate": "Bearer"})


async def until_revoked(request: Request, awaitable: Awaitable[T]) -> T:
    """``awaitable``'s result; if the request's key is revoked first, it is cancelled and the
    request answered 401 (also when both happen at once: nothing is delivered after)."""
    with _watched(request) as ended:
        work = asyncio.ensure_future(awaitable)
        ender = asyncio.ensure_future(ended.wait())
        try:
            await asyncio.wait({work, ender}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            ender.cancel()
            if not work.done():
                work.cancel()
        if ended.is_set():
            log.info("%s %s: its API key was revoked; answered 401", request.method, request.url.path)
            raise revoked_error()
        return work.result()


async def _next(iterator: AsyncIterator[T]) -> T:
    return await iterator.__anext__()


async def stream_until_revoked(request: Request, items: AsyncIterable[T]) -> AsyncIterator[T]:
    """``items`` until they end or the request's key is revoked; then the stream ends and
    nothing more is sent (a reconnecting client is told 401 by the key check)."""
    iterator = items.__aiter__()
    with _watched(request) as ended:
        ender = asyncio.ensure_future(ended.wait())
        step: asyncio.Future | None = None
        try:
            while not ended.is_set():
                # The next item is awaited in a task of its own so that it can be given up
                # when the key goes, whatever it is waiting for.
                step = asyncio.ensure_future(_next(iterator))
                await asyncio.wait({step, ender}, return_when=asyncio.FIRST_COMPLETED)
                if ended.is_set():
                    break
                try:
                    item = step.result()
                except StopAsyncIteration:
                    return
                step = None
                yield item
            log.info("%s %s: its API key was revoked; the stream ended", request.method, request.url.path)
        finally:
            ender.cancel()
            if step is not None and not step.done():
                step.cancel()  # the generator ends inside it (CancelledError at its await)
            elif hasattr(iterator, "aclose"):
                await iterator.aclose()
