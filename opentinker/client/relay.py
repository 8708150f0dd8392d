"""The client's end of a job's relay: env calls from the server, made to an env on this machine.

An interaction with ``"relay": "client"`` names an env endpoint on the user's own machine (or
network): ``http://127.0.0.1:8080``. The server never connects there. Instead
:class:`EnvRelay` opens one WebSocket to the server (``/v1/jobs/{id}/relay``, outbound, like
any API call), receives the job's env calls on it, makes each one to the endpoint and sends
the answer back.

What it forwards is decided here, from the user's own interaction specs, never by the server:

- a call names an interaction and a shard; it goes to that interaction's configured endpoint
  (``env_endpoint`` / ``env_shards``) and nowhere else; a call for another interaction, a shard
  out of range, or any other host, port or path is refused and logged;
- only the env protocol's calls: the gym protocol's ``POST /reset``, ``/step``, ``/finalize``
  and ``GET /health``; OpenEnv's ``GET /health``, ``GET /schema`` and WebSocket sessions on
  ``/ws`` whose messages are ``reset``, ``step``, ``state`` or ``close``;
- answers of at most 16 MiB, and an env's JSON (an OpenEnv message) nested at most
  ``MAX_ENV_JSON_DEPTH`` levels; redirects are never followed, proxies never used for the env;
- at most ``max_concurrent`` (64) calls at once to the env (its HTTP connections too: up to
  that many per endpoint). Frames are read as they come, however busy the env is, so the
  server's keepalive pings are always answered; calls wait in a queue of at most
  ``MAX_QUEUED_CALLS`` (16,384) calls and ``MAX_QUEUED_BYTES`` (256 MiB) of frames, and a call
  past that is answered ``no_answer`` at once (the relay is busy: the server treats it as an
  env outage);
- at most ``max_sessions`` (``MAX_SESSIONS``, 4096) env sessions open or being opened (a slot
  is taken before connecting), and a session with no exchange for ``session_idle_s`` (600 s)
  is closed; all of them close when the connection to the server does.

A frame that cannot be used (not JSON, nested deeper than ``RELAY_FRAME_DEPTH``, a call
without an integer id, a malformed hello) is skipped, and logged at most once per
``LOG_INTERVAL_S`` with a count; a call of the wrong shape is answered ``refused``.

So a compromised server can make the relay send only what the job could anyway: env calls to
the env the user chose. A dropped connection, and anything unforeseen while serving one, is
retried with backoff (the job waits for its env meanwhile, as for any env outage, and redoes
the step once the relay is back); refusals that cannot change (a wrong key, a finished job), a
bad server URL or a crash of the relay's thread end the relay, and :attr:`EnvRelay.error` says why.

The relay runs in a thread of its own with its own event loop; :meth:`EnvRelay.start` and
:meth:`EnvRelay.stop` are called from the user's thread. Its specs are also kept on disk
(:func:`remember`), so that a new client process (``job.attach()``, ``opentinker jobs logs -f``)
can carry the calls of a job that an earlier one started.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import random
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import httpx

from opentinker.client.relay_calls import (
    MAX_QUEUED_BYTES, MAX_QUEUED_CALLS, MAX_SESSIONS, RELAY_FRAME_DEPTH, SESSION_IDLE_S, CallQueue, LocalEnvCalls,
    Refused, Throttled, answer_frame, frame, frame_bytes, ws_url,
)
from opentinker.client.relay_specs import forget, local_problems, recall, relayed_specs, remember, routes
from opentinker.environments.registry import InteractionSpec

if TYPE_CHECKING:
    from opentinker.client.client import OpenTinkerClient

__all__ = ["MAX_QUEUED_BYTES", "MAX_QUEUED_CALLS", "MAX_SESSIONS", "RELAY_FRAME_DEPTH", "SESSION_IDLE_S", "EnvRelay",
           "forget", "local_problems", "recall", "relayed_specs", "remember"]

log = logging.getLogger("opentinker.client.relay")

MAX_CALL_BYTES = 64 << 20  # the largest message taken from the server (a call carries an action)
#: How a server refusal ends the relay: these statuses will not change by retrying.
_FINAL_CLOSE_CODES = {4401: "the API key was refused", 4403: "client relays are turned off on the server",
                      4404: "the server has no such job of yours", 4409: "the job needs no relay (it has finished)"}


class _Final(Exception):
    """The server ended the relay for a reason retrying will not change."""


def _backoff(failures: int) -> float:
    """Seconds to wait before connecting again after ``failures`` tries in a row."""
    return min(10.0, 0.25 * 2 ** min(failures, 6)) * random.uniform(0.8, 1.2)


class EnvRelay:
    """Carries the env calls of job ``job_id`` to the endpoints of ``specs`` (their relayed
    ones), until :meth:`stop` or the relay ends for good (see the module docstring)."""

    def __init__(self, client: OpenTinkerClient, job_id: str, specs: Sequence[InteractionSpec], *,
                 max_concurrent: int = 64, max_sessions: int = MAX_SESSIONS, session_idle_s: float = SESSION_IDLE_S):
        self.client = client
        self.job_id = job_id
        self.routes = routes(specs)
        if not self.routes:
            raise ValueError("no interaction of these specs has relay: client")
        if max_concurrent < 1:
            raise ValueError("max_concurrent must be at least 1")
        self.max_concurrent = max_concurrent
        #: Why the relay ended for good (the server's refusal, a bad URL, a crash); None while it runs or reconnects.
        self.error: str | None = None
        self.calls = 0  # calls answered
        self.refused = 0  # calls refused (outside what the specs allow, or malformed)
        self.connections = 0  # times connected
        self._connected = threading.Event()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._main: asyncio.Task | None = None
        self.env = LocalEnvCalls(self.routes, max_concurrent, max_sessions, session_idle_s)  # the calls it makes
        self._skipped = Throttled("skipped {count} frame(s) from the server that it cannot use")
        self._refusals = Throttled("refused {count} call(s) outside what its specs allow")

    def __repr__(self) -> str:
        return f"EnvRelay(job={self.job_id!r}, interactions={sorted(self.routes)}, connected={self.connected})"

    @property
    def connected(self) -> bool:
        return self._connected.is_set()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def skipped(self) -> int:
        """Frames from the server that could not be used (not JSON, too deep, malformed)."""
        return self._skipped.count

    def start(self) -> EnvRelay:
        if self.running:
            return self
        self._stopping.clear()
        self._thread = threading.Thread(target=self._thread_main, name=f"env-relay-{self.job_id}", daemon=True)
        self._thread.start()
        return self

    def wait_connected(self, timeout: float) -> bool:
        """Whether the relay is connected within ``timeout`` seconds."""
        return self._connected.wait(timeout)

    def stop(self, timeout: float = 10.0) -> None:
        """Close the relay (the job's env calls then wait, as for an env outage)."""
        self._stopping.set()
        loop, main = self._loop, self._main
        if loop is not None and main is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop ended meanwhile
                loop.call_soon_threadsafe(main.cancel)
        if self._thread is not None:
            self._thread.join(timeout)

    def __enter__(self) -> EnvRelay:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- the thread ---------------------------------------------------------------------

    def _thread_main(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        try:
            self._main = loop.create_task(self._run())
            with contextlib.suppress(asyncio.CancelledError):
                loop.run_until_complete(self._main)
        except Exception as exc:  # a bug past _run's own guards: the relay ends, and says why
            log.exception("job %s: the client relay crashed", self.job_id)
            self.error = f"the client relay crashed ({type(exc).__name__}: {str(exc)[:200]})"
        finally:
            self._connected.clear()
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

    def _end(self, reason: str, quietly: bool = False) -> None:
        """The relay ends for good, for ``reason`` (kept in :attr:`error`)."""
        self.error = reason
        log.log(logging.INFO if quietly else logging.WARNING, "job %s: the client relay ended: %s",
                self.job_id, reason)

    async def _run(self) -> None:
        from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidURI
        from websockets.uri import parse_uri

        url = ws_url(self.client.url(f"/jobs/{self.job_id}/relay"))
        try:
            parse_uri(url)
        except (InvalidURI, ValueError) as exc:  # e.g. a port out of range
            self._end(f"bad server URL: {exc}")
            return
        failures = 0
        try:
            while not self._stopping.is_set():
                connections = self.connections
                try:
                    await self._connection(url)
                except _Final as final:
                    self._end(str(final), quietly=str(final).startswith(_FINAL_CLOSE_CODES[4409]))
                    return
                except (OSError, asyncio.TimeoutError, TimeoutError, ConnectionClosed, InvalidHandshake,
                        InvalidURI) as exc:
                    log.info("job %s: client relay connection lost (%s); reconnecting", self.job_id, exc)
                except Exception:  # a bug, or what no one foresaw: the relay reconnects, never dies of it
                    log.exception("job %s: the client relay failed unexpectedly; reconnecting", self.job_id)
                finally:
                    self._connected.clear()
                failures = 1 if self.connections > connections else failures + 1
                await self._pause(_backoff(failures))
        finally:
            await self.env.aclose()

    async def _pause(self, seconds: float) -> None:
        """Sleep ``seconds``, or less when :meth:`stop` is called meanwhile."""
        end = asyncio.get_running_loop().time() + seconds
        while not self._stopping.is_set() and asyncio.get_running_loop().time() < end:
            await asyncio.sleep(0.1)

    async def _connection(self, url: str) -> None:
        """One connection to the server, served until it closes."""
        from websockets.asyncio.client import connect

        headers = {"Authorization": f"Bearer {self.client.api_key}"}
        loopback = httpx.URL(self.client.base_url).host in ("127.0.0.1", "localhost", "::1")
        async with connect(url, additional_headers=headers, max_size=MAX_CALL_BYTES, compression=None,
                           open_timeout=self.client.timeout, proxy=None if loopback else True) as socket:
            await self._serve(socket)

    async def _serve(self, socket: Any) -> None:
        """Answer the calls of one connection until it closes. Frames are read as they come,
        however busy the env is (so the server's keepalive pings are answered); calls wait in a
        bounded :class:`CallQueue` for one of ``max_concurrent`` workers."""
        from websockets.exceptions import ConnectionClosed

        queue = CallQueue()
        answer = functools.partial(self._answer, socket)
        tasks = [asyncio.create_task(queue.serve(answer)) for _ in range(self.max_concurrent)]
        tasks.append(asyncio.create_task(self.env.sessions.sweep(self.job_id)))
        try:
            async for data in socket:
                await self._take(socket, data, queue)
        except ConnectionClosed as closed:
            final = _FINAL_CLOSE_CODES.get(closed.rcvd.code if closed.rcvd else 0)
            if final is not None:
                raise _Final(f"{final}: {closed.rcvd.reason}") from None
            raise
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self.env.sessions.close()  # the server's sessions end with its connection
        code = socket.close_code
        if code in _FINAL_CLOSE_CODES:
            raise _Final(f"{_FINAL_CLOSE_CODES[code]}: {socket.close_reason}")

    async def _take(self, socket: Any, data: str | bytes, queue: CallQueue) -> None:
        """One frame from the server: a call is queued (or, past the queue's bounds, answered
        ``no_answer`` at once), a hello noted; a frame that cannot be used is logged and skipped."""
        try:
            message = frame(data)
        except ValueError as exc:
            self._skipped.warn(self.job_id, str(exc))
            return
        kind = message.get("type")
        if kind == "call":
            call_id = message.get("id")
            if isinstance(call_id, bool) or not isinstance(call_id, int):
                self._skipped.warn(self.job_id, "a call without an integer id")
            elif not queue.offer(message, frame_bytes(data)):  # type: ignore[arg-type]  # _frame took text only
                await self._send(socket, call_id, {
                    "error": "no_answer", "detail": f"the client relay is busy ({queue.calls} calls waiting or "
                    f"running, at most {queue.max_calls} and {queue.max_bytes >> 20} MiB); the call was not made"})
        elif kind == "hello":
            self._hello(message)
        elif kind == "error":  # the close that follows says whether it is for good
            log.debug("job %s: the server ends the relay: %s", self.job_id, str(message.get("message"))[:500])
        else:
            self._skipped.warn(self.job_id, f"a frame of unknown type {str(kind)[:40]!r}")

    def _hello(self, message: dict[str, Any]) -> None:
        if not self._connected.is_set():  # the first hello of this connection (cleared when it ends)
            self.connections += 1
            self._connected.set()
        names = message.get("interactions") or []
        if not isinstance(names, list) or not all(isinstance(name, str) for name in names):
            self._skipped.warn(self.job_id, "a hello whose interactions are not a list of names")
            return
        unknown = sorted(set(names) - set(self.routes))
        if unknown:
            log.warning("job %s: the server relays interactions this client does not carry: %s "
                        "(their calls will be refused)", self.job_id, ", ".join(unknown[:20])[:1000])

    async def _send(self, socket: Any, call_id: int, answer: dict[str, Any]) -> None:
        with contextlib.suppress(Exception):  # the connection may be gone: the server fails the call itself
            await socket.send(answer_frame(call_id, answer))

    async def _answer(self, socket: Any, call: dict[str, Any]) -> None:
        try:
            answer = await self.env.handle(call)
            self.calls += 1
        except Refused as refused:
            self.refused += 1
            fields = {key: str(call.get(key))[:80] for key in ("op", "interaction", "shard", "method", "path")}
            self._refusals.warn(self.job_id, f"{refused}: {json.dumps(fields)}")
            answer = {"error": "refused", "detail": f"the client relay refused the call: {refused}"}
        except Exception as exc:  # a bug here must not end the relay
            log.exception("job %s: a relayed call failed", self.job_id)
            answer = {"error": "bad_answer", "detail": f"the client relay failed: {type(exc).__name__}"}
        await self._send(socket, call["id"], answer)
