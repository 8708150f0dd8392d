"""The job's end of a client relay: env calls carried by the user's own client.

An interaction configured with ``"relay": "client"`` never connects anywhere. Its calls wait
in the job's :class:`RelayHub` until the control plane takes them (``take``) and sends them
down the WebSocket that the user's thin client opened to it; the client makes each call to
the env on its own machine and the answers come back the same way (``answer``). The hub
lives in the job's runner process, next to the agent loops; the control plane reaches it
through the runner's Ray methods, so the server never holds a connection to the user's
network and nothing here listens on a port.

Rules the hub keeps:

- a call made while no client is attached fails at once with
  :class:`~opentinker.environments.transport.NoAnswer` (an env outage: the trainer waits,
  probes ``/health`` through the relay, and redoes the step when the client is back);
- a client that disconnects, or is replaced by a newer connection, fails every call it had;
- at most ``max_in_flight`` calls wait or run at once; more wait for a slot (backpressure);
- a call gets no more than its own timeout (plus ``RELAY_SLACK_S`` for the two extra hops).

What goes down the relay is a *call*, never a URL: ``{"op": "http", "interaction": name,
"shard": index, "method", "path", "body"}`` or a session operation (``ws_open``,
``ws_exchange``, ``ws_close``). The client maps the interaction and shard to the endpoint its
user configured and refuses any path its protocol does not have (``opentinker/client/relay.py``).

No torch, no aiohttp, no Ray: plain threads and asyncio.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import threading
import time
import uuid
from collections import deque
from typing import Any

from opentinker.environments.transport import MAX_ANSWER_BYTES, Answer, BadAnswer, NoAnswer

__all__ = ["RELAY_MODES", "RelayDoor", "RelayHub", "RelayTransport", "relay_mode"]

RELAY_MODES = ("client",)
RELAY_SLACK_S = 5.0  # the two extra hops of a relayed call (control plane, client) on top of its timeout
DEFAULT_MAX_IN_FLIGHT = 256
NOT_CONNECTED = ("the job's client relay is not connected (the client that started the job is not running: "
                 "job.attach(env) or `opentinker jobs logs -f JOB_ID` on the machine with the env reconnects it)")


def relay_mode(value: Any) -> bool:
    """Whether an interaction config's ``relay`` asks for the client relay (ValueError if malformed)."""
    if value is None or value == "direct":
        return False
    if value in RELAY_MODES:
        return True
    raise ValueError(f"relay must be 'client' (the job's client carries the env calls) or left out, got {value!r}")


class RelayHub:
    """Env calls of one job, waiting for (or carried by) its client relay. Thread-safe: the agent
    loops call :meth:`call` from their event loop, the runner's Ray methods the rest, and the
    trainer :meth:`wait_attached` (to redo a step as soon as a client is back after an outage,
    instead of at its next ``/health`` probe)."""

    def __init__(self, max_in_flight: int = DEFAULT_MAX_IN_FLIGHT, clock=time.time):
        self.max_in_flight = max_in_flight
        self._clock = clock
        self._lock = threading.Lock()
        self._ready = threading.Condition(self._lock)  # calls queued, or the connection changed (take)
        self._attached = threading.Condition(self._lock)  # a client attached (wait_attached)
        self._pending: deque[dict[str, Any]] = deque()  # calls not yet taken by the control plane
        self._waiting: dict[int, concurrent.futures.Future] = {}  # call id -> its answer (pending or taken)
        self._ids = itertools.count(1)
        self._connections = itertools.count(1)
        self._connection: int | None = None
        self._connected_since: float | None = None
        self._disconnected_at: float | None = None
        self._carried = 0
        self._slots: dict[asyncio.AbstractEventLoop, asyncio.Semaphore] = {}

    # -- the control plane's side (through the runner's Ray methods) ----------------------

    def attach(self) -> int:
        """A client connected: its connection id. A previous connection is replaced (its calls fail)."""
        with self._lock:
            self._fail_all_locked("the client relay was replaced by a newer connection")
            self._connection = next(self._connections)
            self._connected_since = self._clock()
            self._ready.notify_all()
            self._attached.notify_all()
            return self._connection

    def detach(self, connection: int) -> None:
        """The client of ``connection`` went away: every call it had (or was to get) fails."""
        with self._lock:
            if connection != self._connection:
                return
            self._connection, self._connected_since, self._disconnected_at = None, None, self._clock()
            self._fail_all_locked("the client relay disconnected")
            self._ready.notify_all()

    def take(self, connection: int, max_calls: int, wait_s: float) -> list[dict[str, Any]] | None:
        """Up to ``max_calls`` calls for the client, waiting up to ``wait_s`` for the first;
        None when ``connection`` is no longer the attached one (close it)."""
        deadline = time.monotonic() + wait_s
        with self._lock:
            while not self._pending and connection == self._connection:
                left = deadline - time.monotonic()
                if left <= 0:
                    return []
                self._ready.wait(left)
            if connection != self._connection:
                return None
            calls = []
            while self._pending and len(calls) < max_calls:
                calls.append(self._pending.popleft())
            return calls

    def answer(self, connection: int, answers: list[dict[str, Any]]) -> None:
        """Answers from the client of ``connection`` (each with the ``id`` of its call).
        Answers to calls that are gone (timed out, or of an older connection) are dropped."""
        with self._lock:
            if connection != self._connection:
                return
            for answer in answers:
                future = self._waiting.pop(answer.get("id"), None)
                if future is not None and not future.done():
                    future.set_result(answer)
                    self._carried += 1

    def wait_attached(self, timeout_s: float) -> bool:
        """True as soon as a client relay is attached (at once if one is now), False once
        ``timeout_s`` passes without one. Blocks the calling thread."""
        with self._lock:
            return self._attached.wait_for(lambda: self._connection is not None, max(0.0, timeout_s))

    def status(self) -> dict[str, Any]:
        with self._lock:
            return {"connected": self._connection is not None, "connected_since": self._connected_since,
                    "disconnected_at": self._disconnected_at, "in_flight": len(self._waiting),
                    "calls": self._carried}

    def _fail_all_locked(self, why: str) -> None:
        self._pending.clear()
        waiting, self._waiting = self._waiting, {}
        for future in waiting.values():
            if not future.done():
                future.set_exception(NoAnswer(why))

    # -- the agent loops' side -------------------------------------------------------

    def _slot(self) -> asyncio.Semaphore:
        loop = asyncio.get_running_loop()
        slot = self._slots.get(loop)
        if slot is None:
            slot = self._slots[loop] = asyncio.Semaphore(self.max_in_flight)
        return slot

    async def call(self, op: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        """Send ``op`` through the relay and return the client's answer; NoAnswer when no client
        is attached, it goes away, or no answer comes within ``timeout_s`` (+ the relay's slack)."""
        async with self._slot():
            with self._lock:
                if self._connection is None:
                    raise NoAnswer(NOT_CONNECTED)
                call_id = next(self._ids)
                future: concurrent.futures.Future = concurrent.futures.Future()
                self._waiting[call_id] = future
                self._pending.append({**op, "id": call_id, "timeout_s": timeout_s})
                self._ready.notify()
            try:
                return await asyncio.wait_for(asyncio.wrap_future(future), timeout_s + RELAY_SLACK_S)
            except (asyncio.TimeoutError, TimeoutError):
                raise NoAnswer(f"no answer through the client relay within {timeout_s + RELAY_SLACK_S:g}s") from None
            finally:
                with self._lock:
                    self._waiting.pop(call_id, None)
                    if not future.done():  # still queued: take it back
                        self._pending = deque(c for c in self._pending if c["id"] != call_id)


class RelayDoor:
    """The methods a job's runner (a Ray actor) exposes for the control plane to carry its relay
    (``server/routers/relay.py``); a runner mixes it in and sets ``self.relay`` to its hub."""

    relay: RelayHub

    def relay_attach(self) -> int:
        return self.relay.attach()

    def relay_detach(self, connection: int) -> None:
        self.relay.detach(connection)

    def relay_take(self, connection: int, max_calls: int, wait_s: float) -> list[dict[str, Any]] | None:
        return self.relay.take(connection, max_calls, wait_s)

    def relay_answer(self, connection: int, answers: list[dict[str, Any]]) -> None:
        self.relay.answer(connection, answers)


def _raise_for(answer: dict[str, Any]) -> None:
    """The client's error answer as the transport's exception."""
    error = answer.get("error")
    if error is None:
        return
    detail = str(answer.get("detail") or error)[:500]
    if error == "no_answer":
        raise NoAnswer(f"{detail} (on the client's machine)")
    raise BadAnswer(f"{detail} (the client relay: {error})")


class _RelaySession:
    """A WebSocket session the client holds open to its env, driven through the relay."""

    def __init__(self, hub: RelayHub, session_id: str):
        self._hub = hub
        self.session_id = session_id

    async def exchange(self, message: dict[str, Any], timeout_s: float) -> Any:
        answer = await self._hub.call({"op": "ws_exchange", "session": self.session_id, "message": message},
                                      timeout_s)
        _raise_for(answer)
        if "message" not in answer:
            raise BadAnswer("the client relay answered a session exchange without a message")
        return answer["message"]

    async def close(self) -> None:
        try:
            await self._hub.call({"op": "ws_close", "session": self.session_id}, 5.0)
        except Exception:  # closing must never raise; a dropped relay closed it anyway
            pass


class RelayTransport:
    """The route of one relayed interaction: its calls go through ``hub`` to the client, which
    knows the interaction by ``name`` and its servers by their index in ``shards``."""

    def __init__(self, hub: RelayHub | None, interaction: str, shards: list[str]):
        self.hub = hub
        self.interaction = interaction
        self.shards = list(shards)

    def describe(self, base: str) -> str:
        return f"client:{base}"

    def _shard(self, base: str) -> int:
        if self.hub is None:  # built to be checked (POST /v1/env/check), not to run
            raise NoAnswer(NOT_CONNECTED)
        return self.shards.index(base)

    async def request(self, method: str, base: str, path: str, timeout_s: float, body: Any = None) -> Answer:
        answer = await self.hub.call({"op": "http", "interaction": self.interaction, "shard": self._shard(base),
                                      "method": method, "path": path, "body": body}, timeout_s)
        _raise_for(answer)
        text = answer.get("body")
        status = answer.get("status")
        if not isinstance(text, str) or isinstance(status, bool) or not isinstance(status, int):
            raise BadAnswer("the client relay's answer has no status or body")
        data = text.encode("utf-8")
        if len(data) > MAX_ANSWER_BYTES:
            raise BadAnswer(f"answer larger than {MAX_ANSWER_BYTES} bytes (HTTP {status})")
        return Answer(status, str(answer.get("content_type") or ""), data)

    async def open_session(self, base: str, path: str, timeout_s: float) -> _RelaySession:
        session_id = uuid.uuid4().hex  # unique on the client's side, whichever transport opened it
        answer = await self.hub.call({"op": "ws_open", "interaction": self.interaction, "shard": self._shard(base),
                                      "path": path, "session": session_id}, timeout_s)
        _raise_for(answer)
        return _RelaySession(self.hub, session_id)

    async def aclose(self) -> None:
        return None
