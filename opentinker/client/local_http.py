"""The client relay's HTTP calls to an env on this machine: h11 over asyncio streams.

Why not httpx (the client's library elsewhere): a relay makes every call of a training step at
once (128 episodes: 384 calls), and httpx's pool spends about 1.2 ms of CPU on each of them
(``benchmarks/env_calls.py``: 384 calls in 0.45 s at its best pool size, against 0.11 s for
aiohttp, which the thin client does not install). h11 (already installed with httpx) parses
and writes HTTP/1.1; this module only keeps keep-alive connections, at most
``max_connections`` per endpoint (the relay makes it its own ``max_concurrent``, so the env
sees as many calls at once as the relay makes).

One :class:`LocalHTTP` per event loop. ``request`` returns ``(status, content_type, body)`` or
raises :class:`LocalCallFailed` (``unreachable``: nothing came back: refused, broken, timed
out; else an answer that cannot be used: too large, not HTTP).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any
from urllib.parse import urlsplit

import h11

__all__ = ["LocalCallFailed", "LocalHTTP"]

_READ_CHUNK = 1 << 16


class LocalCallFailed(Exception):
    def __init__(self, message: str, unreachable: bool):
        super().__init__(message)
        self.unreachable = unreachable


#: Idle connections are dropped after this long, before uvicorn's 5 s keep-alive closes them at the other end.
KEEPALIVE_S = 4.0


class _Connection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.reader, self.writer = reader, writer
        self.h11 = h11.Connection(our_role=h11.CLIENT)
        self.idle_since = 0.0

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.writer.close()


class LocalHTTP:
    """Keep-alive connections (at most ``max_connections`` per endpoint, open or in use) to env servers."""

    def __init__(self, max_connections: int = 16, max_body_bytes: int = 16 << 20):
        self.max_connections = max_connections
        self.max_body_bytes = max_body_bytes
        self._idle: dict[str, list[_Connection]] = {}
        self._slots: dict[str, asyncio.Semaphore] = {}

    async def request(self, method: str, base: str, path: str, body: Any, timeout_s: float) -> tuple[int, str, bytes]:
        """``method {base}/{path}`` with ``body`` as JSON (None: no body), within ``timeout_s``."""
        slot = self._slots.setdefault(base, asyncio.Semaphore(self.max_connections))
        async with slot:
            try:
                return await asyncio.wait_for(self._request(method, base, path, body), timeout_s)
            except (asyncio.TimeoutError, TimeoutError):
                raise LocalCallFailed(f"timed out after {timeout_s:g}s", True) from None

    async def _request(self, method: str, base: str, path: str, body: Any) -> tuple[int, str, bytes]:
        parts = urlsplit(base)
        idle = self._idle.setdefault(base, [])
        now = asyncio.get_running_loop().time()
        while idle:
            connection = idle.pop()
            if now - connection.idle_since < KEEPALIVE_S:
                try:
                    return await self._on(connection, idle, method, parts.netloc, path, body)
                except LocalCallFailed as failed:
                    if not failed.unreachable:
                        raise
                    # A kept-alive connection the env had closed: the call goes on a new one.
            else:
                connection.close()
        try:
            reader, writer = await asyncio.open_connection(parts.hostname, parts.port,
                                                           ssl=True if parts.scheme == "https" else None)
        except OSError as exc:
            raise LocalCallFailed(f"{type(exc).__name__}: {exc}", True) from exc
        return await self._on(_Connection(reader, writer), idle, method, parts.netloc, path, body)

    async def _on(self, connection: _Connection, idle: list[_Connection], method: str, host: str, path: str,
                  body: Any) -> tuple[int, str, bytes]:
        try:
            answer = await self._exchange(connection, method, host, path, body)
        except BaseException:
            connection.close()
            raise
        if connection.h11.our_state is h11.DONE and connection.h11.their_state is h11.DONE:
            connection.h11.start_next_cycle()
            connection.idle_since = asyncio.get_running_loop().time()
            idle.append(connection)
        else:
            connection.close()
        return answer

    async def _exchange(self, connection: _Connection, method: str, host: str, path: str,
                        body: Any) -> tuple[int, str, bytes]:
        data = json.dumps(body).encode() if body is not None else b""
        headers = [("Host", host), ("Content-Length", str(len(data)))]
        if body is not None:
            headers.append(("Content-Type", "application/json"))
        conn = connection.h11
        response, chunks, size = None, [], 0
        try:
            connection.writer.write(conn.send(h11.Request(method=method, target="/" + path, headers=headers)))
            if data:
                connection.writer.write(conn.send(h11.Data(data=data)))
            connection.writer.write(conn.send(h11.EndOfMessage()))
            await connection.writer.drain()
            while True:
                event = conn.next_event()
                if event is h11.NEED_DATA:
                    received = await connection.reader.read(_READ_CHUNK)
                    conn.receive_data(received)  # b"": the other end closed
                    continue
                if isinstance(event, h11.Response):
                    response = event
                elif isinstance(event, h11.Data):
                    size += len(event.data)
                    if size > self.max_body_bytes:
                        raise LocalCallFailed(f"answer larger than {self.max_body_bytes} bytes", False)
                    chunks.append(bytes(event.data))
                elif isinstance(event, h11.EndOfMessage):
                    break
                elif isinstance(event, h11.ConnectionClosed):
                    raise LocalCallFailed("the env closed the connection before answering", True)
        except (OSError, ConnectionError) as exc:
            raise LocalCallFailed(f"{type(exc).__name__}: {exc or 'connection broke'}", True) from exc
        except h11.RemoteProtocolError as exc:
            if response is None and not chunks:  # a kept-alive connection the server had closed
                raise LocalCallFailed(f"the connection broke ({exc})", True) from exc
            raise LocalCallFailed(f"not an HTTP answer ({exc})", False) from exc
        content_type = next((v.decode("latin-1") for k, v in response.headers if k == b"content-type"), "")
        return response.status_code, content_type, b"".join(chunks)

    async def aclose(self) -> None:
        for connections in self._idle.values():
            for connection in connections:
                connection.close()
        self._idle.clear()
