"""The sessions of :class:`~opentinker.environments.openenv_interaction.OpenEnvInteraction`:
opening one per episode through its transport, and how many may be open at once.

An OpenEnv server serves at most ``max_concurrent_envs`` sessions; past that it answers a new
one with ``CAPACITY_REACHED``. That is not an env error: :meth:`SessionOpener.open` backs off
(exponentially, with jitter, capped) and tries again, and learns the server's ``max_sessions``,
so that from then on this interaction opens no more sessions there at once (the rest queue
here, first come first served, in a :class:`SessionGate`). A session keeps its connection for
its whole episode, so the connection pool bounds the sessions too. An unreachable server is
retried (``retries``, ``backoff_s``). An episode waits in the queue as long as it moves; once no
slot was freed for ``capacity_wait_s``, or the server kept refusing for that long, the episode
fails as unreachable (the trainer's outage rule then waits for the server and redoes the step).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import deque
from typing import Any, Protocol

from opentinker.environments.env_replies import join_url
from opentinker.environments.interaction import EnvironmentServerError
from opentinker.environments.transport import BadAnswer, EnvSession, EnvTransport, NoAnswer

__all__ = ["CAPACITY_REACHED", "SessionGate", "SessionOpener", "error_of"]

logger = logging.getLogger("opentinker.environments.openenv_interaction")

CAPACITY_REACHED = "CAPACITY_REACHED"
CAPACITY_FIRST_DELAY_S = 0.1  # the first back-off after a CAPACITY_REACHED; doubles, jittered
CAPACITY_MAX_DELAY_S = 5.0
EXCHANGE_SLACK_S = 10.0  # beyond timeout_s, for a message's way through a relay (its own slack is 5 s)
CLOSE_TIMEOUT_S = 5.0  # closing a session: the close message and the socket's close
_MAX_LEARNED_SESSIONS = 100_000


class _AtCapacity(Exception):
    def __init__(self, active: Any, maximum: Any):
        super().__init__("at capacity")
        self.active = active if _count(active) else None
        self.maximum = maximum if _count(maximum) else None


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


class SessionGate:
    """How many sessions this interaction may hold with one env server at once (None: not yet
    known), and the episodes waiting for one, first come first served. ``release`` is
    synchronous, so a cancelled episode can always give its slot back."""

    def __init__(self, limit: int | None):
        self.limit = limit
        self.held = 0
        self.moved_at = time.monotonic()  # when a slot was last freed or handed out
        self._waiting: deque[asyncio.Future] = deque()

    def _free(self) -> bool:
        return self.limit is None or self.held < self.limit

    async def acquire(self, idle_timeout_s: float) -> bool:
        """Take a slot; False once no slot was freed or handed out to anyone for ``idle_timeout_s``
        (while slots change hands the queue moves, and a place in it is progress, not an outage)."""
        if self._free() and not self._waiting:
            self.held += 1
            self.moved_at = time.monotonic()
            return True
        if idle_timeout_s <= 0:
            return False
        waiter = asyncio.get_running_loop().create_future()
        self._waiting.append(waiter)
        started = time.monotonic()
        try:
            while True:
                left = max(started, self.moved_at) + idle_timeout_s - time.monotonic()
                if left <= 0:
                    return waiter.done()  # _wake may have handed it a slot just now
                try:
                    await asyncio.wait_for(asyncio.shield(waiter), left)  # _wake counted the slot as held for us
                    return True
                except (asyncio.TimeoutError, TimeoutError):
                    continue
        except BaseException:
            if waiter.done() and not waiter.cancelled():  # handed a slot, then cancelled: give it back
                self.release()
            else:
                waiter.cancel()
            raise
        finally:
            if waiter in self._waiting:
                self._waiting.remove(waiter)

    def release(self) -> None:
        self.held -= 1
        self.moved_at = time.monotonic()
        self._wake()

    def learn(self, limit: int) -> None:
        self.limit = limit
        self._wake()

    def _wake(self) -> None:
        while self._waiting and self._free():
            waiter = self._waiting.popleft()
            if not waiter.done():
                self.held += 1
                self.moved_at = time.monotonic()
                waiter.set_result(None)


def error_of(reply: Any) -> dict | None:
    """The data of an OpenEnv error message (``{"type": "error", "data": ...}``), else None."""
    if isinstance(reply, dict) and reply.get("type") == "error":
        data = reply.get("data")
        return data if isinstance(data, dict) else {}
    return None


class _Holder(Protocol):
    """What holds a session: an episode (its server, its session, the slots it holds)."""

    base: str
    session: EnvSession | None
    gates: tuple[SessionGate, ...]


class SessionOpener:
    """Opens and closes an interaction's sessions, within its servers' capacity and its pool."""

    def __init__(self, transport: EnvTransport, *, timeout_s: float, retries: int, backoff_s: float,
                 max_connections: int, capacity_wait_s: float):
        self.transport = transport
        self.timeout_s = timeout_s
        self.retries = retries
        self.backoff_s = backoff_s
        self.max_connections = max_connections
        self.capacity_wait_s = capacity_wait_s
        self.limits: dict[str, int] = {}  # learned max_sessions per base URL
        self._loop: asyncio.AbstractEventLoop | None = None
        self._gates: dict[str, SessionGate] = {}
        self._pool: SessionGate | None = None
        #: CAPACITY_REACHED answers seen (each one a session refused and tried again later).
        self.capacity_refusals = 0

    def ws_url(self, base: str) -> str:
        return join_url(self.transport.describe(base), "ws")

    # -- per event loop state ----------------------------------------------------------

    def _for_loop(self) -> None:
        loop = asyncio.get_running_loop()
        if self._loop is not loop:  # gates belong to one loop (the agent runner's)
            self._loop, self._gates, self._pool = loop, {}, None

    def gate(self, base: str) -> SessionGate:
        self._for_loop()
        gate = self._gates.get(base)
        if gate is None:
            gate = self._gates[base] = SessionGate(self.limits.get(base))
        return gate

    @property
    def session_limit(self) -> int:
        """The most sessions this interaction holds at once over all its servers: a session keeps
        its connection from the pool of ``max_connections`` for its whole episode, and two stay
        free for /health and /schema."""
        return max(1, self.max_connections - 2)

    def pool_gate(self) -> SessionGate:
        self._for_loop()
        if self._pool is None:
            self._pool = SessionGate(self.session_limit)
        return self._pool

    # -- sessions ----------------------------------------------------------------------

    async def exchange(self, session: EnvSession, message: dict[str, Any]) -> Any:
        try:
            return await asyncio.wait_for(session.exchange(message, self.timeout_s),
                                          self.timeout_s + EXCHANGE_SLACK_S)
        except (asyncio.TimeoutError, TimeoutError):
            raise NoAnswer(f"no answer within {self.timeout_s:g}s") from None

    async def close_session(self, session: EnvSession) -> None:
        """Send ``close`` (the server ends the session and closes the connection, no answer),
        then close our end; never raises."""
        try:
            await asyncio.wait_for(session.exchange({"type": "close"}, CLOSE_TIMEOUT_S), CLOSE_TIMEOUT_S + 1.0)
        except Exception:  # the usual outcome: "closed by the env server"
            pass
        try:
            await asyncio.wait_for(session.close(), CLOSE_TIMEOUT_S + 1.0)
        except Exception:
            pass

    async def release(self, episode: _Holder) -> None:
        """Close the episode's session (if any) and give its slot back; idempotent."""
        session, episode.session = episode.session, None
        gates, episode.gates = episode.gates, ()
        try:
            if session is not None:
                await self.close_session(session)
        finally:
            for gate in gates:
                gate.release()

    async def open(self, episode: _Holder, reset: dict[str, Any]) -> Any:
        """A session for ``episode`` (kept on it) and the env's reply to ``reset`` on it: waits
        for a slot, backs off from CAPACITY_REACHED and retries an unreachable server."""
        base, url = episode.base, self.ws_url(episode.base)
        loop = asyncio.get_running_loop()
        refused_since: float | None = None  # the server's own capacity: waited for from its first refusal
        gate, pool = self.gate(base), self.pool_gate()
        failures = refusals = 0
        while True:
            if not await gate.acquire(self.capacity_wait_s):
                raise EnvironmentServerError(
                    url, f"no env session was freed for capacity_wait_s={self.capacity_wait_s:g}s (the server takes "
                         f"{gate.limit} sessions at once; this interaction's other episodes hold them)",
                    unreachable=True)
            episode.gates = (gate,)
            if not await pool.acquire(self.capacity_wait_s):
                await self.release(episode)
                raise EnvironmentServerError(
                    url, f"no connection was freed for a session for capacity_wait_s={self.capacity_wait_s:g}s "
                         f"(max_connections={self.max_connections} holds {pool.limit} sessions at once; this "
                         "interaction's other episodes hold them)", unreachable=True)
            episode.gates = (gate, pool)
            try:
                episode.session = await self.transport.open_session(base, "ws", self.timeout_s)
                reply = await self.exchange(episode.session, reset)
                refused = error_of(reply)
                if refused is not None and refused.get("code") == CAPACITY_REACHED:
                    raise _AtCapacity(refused.get("active_sessions"), refused.get("max_sessions"))
                return reply
            except _AtCapacity as full:
                await self.release(episode)
                self.capacity_refusals += 1
                refusals += 1
                self._learn_limit(base, gate, full.maximum)
                delay = min(CAPACITY_MAX_DELAY_S, CAPACITY_FIRST_DELAY_S * 2 ** (refusals - 1))
                delay *= random.uniform(0.5, 1.0)
                refused_since = loop.time() if refused_since is None else refused_since
                if loop.time() + delay > refused_since + self.capacity_wait_s:
                    at = f" ({full.active}/{full.maximum} sessions)" if full.maximum is not None else ""
                    raise EnvironmentServerError(
                        url, f"the env server stayed at capacity{at} for capacity_wait_s={self.capacity_wait_s:g}s "
                             f"({refusals} tries)", unreachable=True) from None
                await asyncio.sleep(delay)
            except NoAnswer as exc:
                await self.release(episode)
                failures += 1
                if failures > self.retries:
                    tries = f" (after {failures} attempts)" if failures > 1 else ""
                    raise EnvironmentServerError(url, f"{exc}{tries}", unreachable=True) from exc
                logger.warning("%s failed (%s); retry %d/%d", url, exc, failures, self.retries)
                await asyncio.sleep(self.backoff_s * 2 ** (failures - 1))
            except (BadAnswer, ValueError) as exc:
                await self.release(episode)
                raise EnvironmentServerError(url, str(exc)) from exc

    def _learn_limit(self, base: str, gate: SessionGate, maximum: int | None) -> None:
        """From a CAPACITY_REACHED: the server's own limit, else the sessions held here now."""
        limit = maximum if maximum is not None else gate.held
        limit = min(max(1, limit), _MAX_LEARNED_SESSIONS)
        if self.limits.get(base) != limit:
            logger.info("%s serves %d sessions at once: this interaction opens no more there at once",
                        self.ws_url(base), limit)
        self.limits[base] = limit
        gate.learn(limit)
