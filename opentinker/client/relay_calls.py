"""The calls and env sessions of one client relay, on the user's machine.

A frame from the server is read with a depth bound (:func:`frame`); a call waits in a bounded
:class:`CallQueue` for one of the relay's workers; OpenEnv sessions live in a
:class:`SessionTable` (a slot reserved before connecting, idle ones closed), each a
:class:`LocalSession` that makes one exchange at a time. :class:`Refused` is a call outside what
the user configured (answered ``refused``); :class:`LocalEnvCalls` makes a call to the env,
refusing any its specs do not allow; :class:`Throttled` keeps a flood of one kind of warning
to a line every few seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from opentinker.client.local_http import LocalCallFailed, LocalHTTP
from opentinker.client.relay_specs import HTTP_CALLS, SESSION_MESSAGES, SESSION_PATHS, Route
from opentinker.environments.transport import MAX_ANSWER_BYTES
from opentinker.json_limits import MAX_ENV_JSON_DEPTH, JsonTooDeep, loads_bounded

__all__ = ["MAX_QUEUED_BYTES", "MAX_QUEUED_CALLS", "MAX_SESSIONS", "RELAY_FRAME_DEPTH", "SESSION_IDLE_S", "CallQueue",
           "LocalEnvCalls", "LocalSession", "Refused", "SessionTable", "Throttled", "answer_frame", "call_timeout",
           "frame", "frame_bytes", "shape_problem", "ws_url"]

log = logging.getLogger("opentinker.client.relay")

MAX_SESSIONS = 4096  # env sessions open or being opened at once (the default of ``max_sessions``)
SESSION_IDLE_S = 600.0  # a session with no exchange for this long is closed (the default of ``session_idle_s``)
#: How deeply a frame from the server may nest: an env's JSON (an action, a message) inside the call's envelope.
RELAY_FRAME_DEPTH = MAX_ENV_JSON_DEPTH + 8
MAX_QUEUED_CALLS = 16_384  # calls read and not answered yet; past that (or the bytes below) a call is answered busy
MAX_QUEUED_BYTES = 256 << 20
MAX_TIMEOUT_S = 3600.0
CLOSED_RECV_S = 1.0  # how long to wait for what an env sent before it closed a session
LOG_INTERVAL_S = 5.0  # at most one line per this long about skipped frames, and about refused calls
#: The types a call's fields must have when present (the rest are checked where they are used).
_CALL_FIELDS: dict[str, type] = {"op": str, "interaction": str, "method": str, "path": str, "session": str,
                                 "message": dict}


def ws_url(http_url: str) -> str:
    """``http(s)://...`` as ``ws(s)://...``."""
    return "ws" + http_url[len("http"):]


class Refused(Exception):
    """A call outside what the user configured: answered ``refused``, and logged."""


def call_timeout(call: dict[str, Any]) -> float:
    value = call.get("timeout_s", 30.0)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= MAX_TIMEOUT_S:
        raise Refused(f"timeout_s must be a number of seconds in (0, {MAX_TIMEOUT_S:g}], got {value!r}")
    return float(value)


def frame(data: str | bytes) -> dict[str, Any]:
    """The message of one frame from the server; ValueError saying why it cannot be used."""
    if not isinstance(data, str):
        raise ValueError("a binary frame")
    try:
        message = loads_bounded(data, max_depth=RELAY_FRAME_DEPTH)
    except JsonTooDeep as exc:
        raise ValueError(f"a frame of {exc}") from None
    except ValueError:
        raise ValueError("a frame that is not JSON") from None
    if not isinstance(message, dict):
        raise ValueError("a frame that is not a JSON object")
    return message


def frame_bytes(text: str) -> int:
    """The size of a text frame on the wire (UTF-8)."""
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))


def shape_problem(call: dict[str, Any]) -> str | None:
    """What is wrong with the types of a call's fields (None: nothing)."""
    for key, kind in _CALL_FIELDS.items():
        value = call.get(key)
        if value is not None and not isinstance(value, kind):
            return f"its {key} is a {type(value).__name__}, not a {kind.__name__}"
    return None


def answer_frame(call_id: int, answer: dict[str, Any]) -> str:
    """The frame that answers call ``call_id``. A text frame must be UTF-8, so an env's lone
    surrogate (JSON's ``"\\ud800"``, read into a str) is sent escaped, as JSON allows."""
    frame = {"type": "answer", "id": call_id, **answer}
    text = json.dumps(frame, ensure_ascii=False)
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            return json.dumps(frame)
    return text


def session_message(reply: str | bytes) -> dict[str, Any]:
    """The answer carrying an env session's ``reply``, or the error answer it earns."""
    if not isinstance(reply, str):
        return {"error": "bad_answer", "detail": "a binary message where JSON text was due"}
    try:
        return {"message": loads_bounded(reply, max_depth=MAX_ENV_JSON_DEPTH)}
    except JsonTooDeep as exc:
        return {"error": "bad_answer", "detail": f"a message of {exc}"}
    except ValueError:
        return {"error": "bad_answer", "detail": "a message that is not JSON"}


class Throttled:
    """Warnings of one kind: at most one line per ``interval_s``, which counts the ones it stands for."""

    def __init__(self, what: str, interval_s: float = LOG_INTERVAL_S):
        self.what = what  # a format string with {count}
        self.interval_s = interval_s
        self.count = 0  # in all
        self._unsaid = 0
        self._said_at: float | None = None

    def warn(self, job_id: str, latest: str) -> None:
        self.count += 1
        self._unsaid += 1
        now = time.monotonic()
        if self._said_at is not None and now - self._said_at < self.interval_s:
            return
        log.warning("job %s: the client relay %s (the latest: %s)", job_id, self.what.format(count=self._unsaid),
                    latest)
        self._unsaid, self._said_at = 0, now


class CallQueue:
    """The calls of one connection that were read and are not answered yet: at most
    ``max_calls``, whose frames add up to at most ``max_bytes`` (:meth:`offer` says False past
    that). Each :meth:`serve` task answers them one at a time, in the order they came."""

    def __init__(self, max_calls: int = MAX_QUEUED_CALLS, max_bytes: int = MAX_QUEUED_BYTES):
        self.max_calls = max_calls
        self.max_bytes = max_bytes
        self.calls = 0
        self.bytes = 0
        self._waiting: asyncio.Queue[tuple[dict[str, Any], int]] = asyncio.Queue()

    def offer(self, call: dict[str, Any], size: int) -> bool:
        if self.calls >= self.max_calls or self.bytes + size > self.max_bytes:
            return False
        self.calls += 1
        self.bytes += size
        self._waiting.put_nowait((call, size))
        return True

    async def serve(self, answer: Callable[[dict[str, Any]], Awaitable[None]]) -> None:
        """``await answer(call)`` for each call as it comes (until cancelled)."""
        while True:
            call, size = await self._waiting.get()
            try:
                await answer(call)
            finally:
                self.calls -= 1
                self.bytes -= size


class LocalSession:
    """A WebSocket session with the local env; one exchange at a time."""

    def __init__(self, socket: Any):
        self.socket = socket
        self.lock = asyncio.Lock()
        self.exchanges = 0  # running or waiting for the lock
        self.used_at = asyncio.get_running_loop().time()

    def idle_for(self, now: float) -> float:
        """How long the session has had no exchange (0 while it has one)."""
        return 0.0 if self.exchanges else now - self.used_at

    async def exchange(self, message: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        self.exchanges += 1
        try:
            async with self.lock:
                reply = await self._send_and_receive(message, timeout_s)
        finally:
            self.exchanges -= 1
            self.used_at = asyncio.get_running_loop().time()
        return reply if isinstance(reply, dict) else session_message(reply)

    async def _send_and_receive(self, message: dict[str, Any], timeout_s: float) -> str | bytes | dict[str, Any]:
        """The env's reply to ``message``, or an error answer."""
        from websockets.exceptions import ConnectionClosed, PayloadTooBig

        try:
            try:
                await self.socket.send(json.dumps(message))
            except ConnectionClosed:
                # The env may have said why before closing (OpenEnv's CAPACITY_REACHED, sent as it
                # accepts a session past its max_concurrent_envs): recv() returns what was received
                # before the close, else raises ConnectionClosed.
                timeout_s = min(timeout_s, CLOSED_RECV_S)
            return await asyncio.wait_for(self.socket.recv(), timeout_s)
        except (asyncio.TimeoutError, TimeoutError):
            return {"error": "no_answer", "detail": f"no message within {timeout_s:g}s"}
        except PayloadTooBig:
            return {"error": "bad_answer", "detail": f"a message larger than {MAX_ANSWER_BYTES} bytes"}
        except ConnectionClosed as closed:
            return {"error": "no_answer", "detail": f"the env closed the session ({closed})"}

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await self.socket.close()


async def _close_all(sessions: Sequence[LocalSession]) -> None:
    await asyncio.gather(*(session.close() for session in sessions), return_exceptions=True)


class SessionTable:
    """The relay's env sessions: at most ``limit`` open or being opened (:meth:`reserve` takes a
    slot before the connection is made, :meth:`settle` keeps the session or frees the slot),
    and one with no exchange for ``idle_s`` is closed by :meth:`sweep`."""

    def __init__(self, limit: int = MAX_SESSIONS, idle_s: float = SESSION_IDLE_S):
        if limit < 1 or idle_s <= 0:
            raise ValueError("a relay needs max_sessions >= 1 and session_idle_s > 0")
        self.limit = limit
        self.idle_s = idle_s
        self._open: dict[str, LocalSession] = {}
        self._opening: set[str] = set()

    def __len__(self) -> int:
        return len(self._open) + len(self._opening)

    def reserve(self, session_id: str) -> None:
        if session_id in self._open or session_id in self._opening:
            raise Refused("a session needs a new id")
        if len(self) >= self.limit:
            raise Refused(f"this relay holds {self.limit} env sessions already")
        self._opening.add(session_id)

    def settle(self, session_id: str, session: LocalSession | None) -> None:
        """The end of ``session_id``'s reservation: ``session`` opened, or None (the slot is free again)."""
        self._opening.discard(session_id)
        if session is not None:
            self._open[session_id] = session

    def get(self, session_id: str) -> LocalSession | None:
        return self._open.get(session_id)

    def pop(self, session_id: str) -> LocalSession | None:
        return self._open.pop(session_id, None)

    async def close_idle(self) -> int:
        """Close the sessions idle for longer than ``idle_s``; how many."""
        now = asyncio.get_running_loop().time()
        idle = [session_id for session_id, session in self._open.items() if session.idle_for(now) > self.idle_s]
        await _close_all([self._open.pop(session_id) for session_id in idle])
        return len(idle)

    async def sweep(self, job_id: str) -> None:
        """:meth:`close_idle` every ``min(30, idle_s / 4)`` seconds (until cancelled)."""
        while True:
            await asyncio.sleep(min(30.0, self.idle_s / 4))
            closed = await self.close_idle()
            if closed:
                log.info("job %s: closed %d env session(s) idle for over %gs", job_id, closed, self.idle_s)

    async def close(self) -> None:
        sessions = list(self._open.values())
        self._open.clear()
        await _close_all(sessions)


class LocalEnvCalls:
    """The calls a relay carries, made to the env on this machine: a call names an interaction
    and a shard, which ``routes`` (from the user's own specs) map to an endpoint, and is
    :class:`Refused` unless that protocol has it. Local HTTP on :class:`LocalHTTP` (at most
    ``max_concurrent`` connections per endpoint); OpenEnv sessions in a :class:`SessionTable`."""

    def __init__(self, routes: dict[str, Route], max_concurrent: int, max_sessions: int = MAX_SESSIONS,
                 session_idle_s: float = SESSION_IDLE_S):
        self.routes = routes
        self.http = LocalHTTP(max_connections=max_concurrent, max_body_bytes=MAX_ANSWER_BYTES)
        self.sessions = SessionTable(max_sessions, session_idle_s)

    async def aclose(self) -> None:
        await self.sessions.close()
        await self.http.aclose()

    def _route(self, call: dict[str, Any]) -> tuple[Route, str]:
        route = self.routes.get(call.get("interaction"))  # type: ignore[arg-type]
        if route is None:
            raise Refused(f"interaction {str(call.get('interaction'))[:80]!r} is not relayed by this client")
        shard = call.get("shard")
        if isinstance(shard, bool) or not isinstance(shard, int) or not 0 <= shard < len(route.shards):
            raise Refused(f"shard {str(shard)[:20]!r} is not one of its {len(route.shards)} endpoint(s)")
        return route, route.shards[shard]

    async def handle(self, call: dict[str, Any]) -> dict[str, Any]:
        problem = shape_problem(call)
        if problem is not None:
            raise Refused(f"a malformed call: {problem}")
        op = call.get("op")
        if op == "http":
            return await self._http_call(call)
        if op == "ws_open":
            return await self._open_session(call)
        if op == "ws_exchange":
            return await self._exchange(call)
        if op == "ws_close":
            session = self.sessions.pop(str(call.get("session")))
            if session is not None:
                await session.close()
            return {"ok": True}
        raise Refused(f"unknown operation {str(op)[:40]!r}")

    async def _http_call(self, call: dict[str, Any]) -> dict[str, Any]:
        route, base = self._route(call)
        method, path = call.get("method"), call.get("path")
        if (method, path) not in HTTP_CALLS[route.protocol]:
            raise Refused(f"{str(method)[:10]} /{str(path)[:80]} is not a call of the {route.protocol} protocol")
        body = call.get("body")
        if method == "GET" and body is not None:
            raise Refused("a GET carries no body")
        timeout = call_timeout(call)
        try:
            status, content_type, data = await self.http.request(method, base, path, body, timeout)
        except LocalCallFailed as failed:
            return {"error": "no_answer" if failed.unreachable else "bad_answer", "detail": str(failed)}
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            return {"error": "bad_answer", "detail": "an answer that is not UTF-8 text"}
        return {"status": status, "content_type": content_type, "body": text}

    async def _open_session(self, call: dict[str, Any]) -> dict[str, Any]:
        from websockets.asyncio.client import connect
        from websockets.exceptions import InvalidStatus, WebSocketException

        route, base = self._route(call)
        path = call.get("path")
        if path not in SESSION_PATHS.get(route.protocol, ()):
            raise Refused(f"a session on /{str(path)[:80]} is not part of the {route.protocol} protocol")
        session_id = call.get("session")
        if not isinstance(session_id, str) or not 0 < len(session_id) <= 200:
            raise Refused("a session needs a new id (a string of at most 200 characters)")
        timeout = call_timeout(call)
        self.sessions.reserve(session_id)  # before connecting: concurrent opens never pass the limit
        session = None
        try:
            session = LocalSession(await connect(f"{ws_url(base)}/{path}", max_size=MAX_ANSWER_BYTES,
                                                  compression=None, open_timeout=timeout, proxy=None))
        except InvalidStatus as exc:
            status = exc.response.status_code
            return {"error": "no_answer" if status in (502, 503, 504) else "bad_answer",
                    "detail": f"WebSocket handshake answered HTTP {status}"}
        except (OSError, asyncio.TimeoutError, TimeoutError, WebSocketException) as exc:
            return {"error": "no_answer", "detail": f"{type(exc).__name__}: {exc or 'connection failed'}"}
        finally:
            self.sessions.settle(session_id, session)
        return {"ok": True}

    async def _exchange(self, call: dict[str, Any]) -> dict[str, Any]:
        message = call.get("message")
        kind = message.get("type") if isinstance(message, dict) else None
        if not isinstance(kind, str) or kind not in SESSION_MESSAGES:
            raise Refused(f"session messages are {', '.join(sorted(SESSION_MESSAGES))}")
        timeout = call_timeout(call)
        session = self.sessions.get(str(call.get("session")))
        if session is None:
            return {"error": "no_answer", "detail": "no such env session (it was closed, idle for over "
                    f"{self.sessions.idle_s:g}s, or the relay reconnected)"}
        return await session.exchange(message, timeout)  # type: ignore[arg-type]
