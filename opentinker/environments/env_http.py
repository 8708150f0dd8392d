"""The direct route of env calls (:class:`DirectTransport`), on aiohttp.

Why aiohttp and not httpx (the client package's library): an agent-loop step sends three calls
per episode (reset, step, finalize), all of a step's episodes at once, and httpx's connection
pool does work proportional to its connections times its waiting requests for every request
it hands out. ``benchmarks/env_calls.py`` (128 episodes against a local env server, 2 cores):
384 calls cost 1.55 s of client CPU through httpx, 0.21 s through this module. Only the
trainer's side imports it; the thin client does not need aiohttp.

What a call raises is the transport contract's (:mod:`opentinker.environments.transport`):
:class:`NoAnswer` or :class:`BadAnswer`, and ValueError for a URL aiohttp cannot send to.
Redirects are never followed and proxy settings never read from the environment.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp

from opentinker.environments.env_replies import join_url
from opentinker.environments.transport import MAX_ANSWER_BYTES, Answer, BadAnswer, NoAnswer
from opentinker.json_limits import MAX_ENV_JSON_DEPTH, JsonTooDeep, loads_bounded

__all__ = ["MAX_ANSWER_BYTES", "Answer", "BadAnswer", "DirectTransport", "NoAnswer", "new_session", "request"]


def new_session(timeout_s: float, max_connections: int) -> aiohttp.ClientSession:
    """A session (call it in the event loop that will use it) with at most ``max_connections``
    open connections; ``timeout_s`` bounds each phase of a call (waiting for a connection,
    connecting, each read), as httpx's timeouts do."""
    timeout = aiohttp.ClientTimeout(total=None, connect=timeout_s, sock_connect=timeout_s, sock_read=timeout_s)
    # Idle connections are dropped after 4 s, before uvicorn's 5 s keep-alive closes them at the
    # other end: a request sent on a connection the server is closing would fail.
    connector = aiohttp.TCPConnector(limit=max_connections, keepalive_timeout=4.0)
    return aiohttp.ClientSession(connector=connector, timeout=timeout, trust_env=False)


async def forget(session: aiohttp.ClientSession) -> None:
    """Drop a session made in an event loop that is gone (its sockets cannot be closed in it),
    without "unclosed session" warnings."""
    connector = session.connector
    session.detach()
    if connector is not None:
        await connector.close()


async def request(session: aiohttp.ClientSession, method: str, url: str, timeout_s: float,
                  body: Any = None) -> Answer:
    """``method url`` with ``body`` as JSON (when given); see the module docstring for what it raises."""
    # This call's own timeout (each phase, as the session's), whatever the session was made with.
    timeout = aiohttp.ClientTimeout(total=None, connect=timeout_s, sock_connect=timeout_s, sock_read=timeout_s)
    try:
        async with session.request(method, url, json=body, allow_redirects=False, timeout=timeout) as response:
            chunks, size = [], 0
            async for chunk in response.content.iter_any():
                size += len(chunk)
                if size > MAX_ANSWER_BYTES:
                    raise BadAnswer(f"answer larger than {MAX_ANSWER_BYTES} bytes (HTTP {response.status})")
                chunks.append(chunk)
            return Answer(response.status, response.headers.get("Content-Type", ""), b"".join(chunks))
    except aiohttp.InvalidURL as exc:
        raise ValueError(f"invalid URL ({exc})") from exc
    except (asyncio.TimeoutError, TimeoutError) as exc:  # aiohttp's own timeouts subclass it
        raise NoAnswer(f"timed out after {timeout_s:g}s ({type(exc).__name__})") from exc
    except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as exc:
        raise NoAnswer(f"{type(exc).__name__}: {exc or 'connection failed'}") from exc
    except aiohttp.ClientError as exc:
        raise BadAnswer(f"{type(exc).__name__}: {exc}") from exc


class _DirectSession:
    """One aiohttp WebSocket connection (see :class:`~opentinker.environments.transport.EnvSession`)."""

    def __init__(self, socket: aiohttp.ClientWebSocketResponse):
        self._socket = socket

    async def exchange(self, message: dict[str, Any], timeout_s: float) -> Any:
        try:
            await self._socket.send_str(json.dumps(message))
            received = await self._socket.receive(timeout=timeout_s)
        except (asyncio.TimeoutError, TimeoutError) as exc:
            raise NoAnswer(f"no message within {timeout_s:g}s") from exc
        except (aiohttp.ClientError, ConnectionError, RuntimeError) as exc:  # RuntimeError: sent on a closing socket
            raise NoAnswer(f"the session broke ({type(exc).__name__}: {exc})") from exc
        if received.type == aiohttp.WSMsgType.TEXT:
            try:
                return loads_bounded(received.data, MAX_ENV_JSON_DEPTH)
            except JsonTooDeep as exc:
                raise BadAnswer(f"a message {exc}") from exc
            except ValueError as exc:
                raise BadAnswer(f"a message that is not JSON ({len(received.data)} characters)") from exc
        if received.type == aiohttp.WSMsgType.ERROR and isinstance(received.data, aiohttp.WebSocketError) \
                and received.data.code == aiohttp.WSCloseCode.MESSAGE_TOO_BIG:
            raise BadAnswer(f"a message larger than {MAX_ANSWER_BYTES} bytes")
        if received.type == aiohttp.WSMsgType.BINARY:
            raise BadAnswer(f"a binary message ({len(received.data)} bytes) where JSON text was due")
        raise NoAnswer(f"the session was closed by the env server ({received.type.name.lower()})")

    async def close(self) -> None:
        try:
            await self._socket.close()
        except Exception:  # closing must never raise
            pass


class DirectTransport:
    """Env calls sent from this process, on one aiohttp session per event loop.

    A session's pooled connections belong to the event loop that opened them; used from a
    new loop, a new session is made (the old loop is gone with its sockets).
    """

    def __init__(self, timeout_s: float, max_connections: int):
        self.timeout_s = timeout_s
        self.max_connections = max_connections
        self._session: aiohttp.ClientSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        # WebSocket sessions hold their connection for a whole episode: a pool of their own, so that
        # they never leave the HTTP calls (a /health probe) waiting; the interaction bounds how many.
        self._sockets: aiohttp.ClientSession | None = None

    def describe(self, base: str) -> str:
        return base

    async def _current(self, sockets: bool = False) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        if self._session is None or self._session.closed or self._loop is not loop:
            for old in (self._session, self._sockets):
                if old is not None and not old.closed:
                    await forget(old)
            self._session = new_session(self.timeout_s, self.max_connections)
            self._sockets = new_session(self.timeout_s, 0)  # 0: no limit of aiohttp's own
            self._loop = loop
        return self._sockets if sockets else self._session

    async def request(self, method: str, base: str, path: str, timeout_s: float, body: Any = None) -> Answer:
        return await request(await self._current(), method, join_url(base, path), timeout_s, body)

    async def open_session(self, base: str, path: str, timeout_s: float) -> _DirectSession:
        url = "ws" + join_url(base, path)[len("http"):]  # http -> ws, https -> wss
        session = await self._current(sockets=True)
        try:
            socket = await asyncio.wait_for(session.ws_connect(
                url, max_msg_size=MAX_ANSWER_BYTES, autoping=True, heartbeat=None,
                timeout=aiohttp.ClientWSTimeout(ws_receive=None, ws_close=timeout_s),
            ), timeout_s)
        except aiohttp.WSServerHandshakeError as exc:
            if exc.status in (502, 503, 504):
                raise NoAnswer(f"WebSocket handshake answered HTTP {exc.status}") from exc
            raise BadAnswer(f"WebSocket handshake answered HTTP {exc.status}") from exc
        except aiohttp.InvalidURL as exc:
            raise ValueError(f"invalid URL ({exc})") from exc
        except (asyncio.TimeoutError, TimeoutError) as exc:
            raise NoAnswer(f"timed out after {timeout_s:g}s opening a session") from exc
        except (aiohttp.ClientError, ConnectionError) as exc:
            raise NoAnswer(f"{type(exc).__name__}: {exc or 'connection failed'}") from exc
        return _DirectSession(socket)

    async def aclose(self) -> None:
        sessions, loop = (self._session, self._sockets), self._loop
        self._session = self._sockets = self._loop = None
        for session in sessions:
            if session is not None and not session.closed:
                if loop is asyncio.get_running_loop():
                    await session.close()
                else:
                    await forget(session)
