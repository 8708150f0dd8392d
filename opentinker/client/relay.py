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
- answers of at most 16 MiB; redirects are never followed, proxies never used for the env;
- at most ``max_concurrent`` calls at once: past that, the relay stops reading (backpressure)
  and the server's calls wait; at most ``MAX_SESSIONS`` open env sessions.

So a compromised server can make the relay send only what the job could anyway: env calls to
the env the user chose. A dropped connection is retried with backoff (the job waits for its
env meanwhile, as for any env outage, and redoes the step once the relay is back); refusals
that cannot change (a wrong key, a finished job) end the relay.

The relay runs in a thread of its own with its own event loop; :meth:`EnvRelay.start` and
:meth:`EnvRelay.stop` are called from the user's thread. Its specs are also kept on disk
(:func:`remember`), so that a new client process (``job.attach()``, ``opentinker jobs logs -f``)
can carry the calls of a job that an earlier one started.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import random
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from opentinker.client.local_http import LocalCallFailed, LocalHTTP
from opentinker.environments.registry import InteractionSpec
from opentinker.environments.relay import relay_mode
from opentinker.environments.transport import MAX_ANSWER_BYTES

if TYPE_CHECKING:
    from opentinker.client.client import OpenTinkerClient

__all__ = ["EnvRelay", "forget", "local_problems", "recall", "relayed_specs", "remember"]

log = logging.getLogger("opentinker.client.relay")

MAX_SESSIONS = 4096
MAX_CALL_BYTES = 64 << 20  # the largest message taken from the server (a call carries an action)
MAX_TIMEOUT_S = 3600.0
#: How a server refusal ends the relay: these statuses will not change by retrying.
_FINAL_CLOSE_CODES = {4401: "the API key was refused", 4403: "client relays are turned off on the server",
                      4404: "the server has no such job of yours", 4409: "the job needs no relay (it has finished)"}
_GYM = "gym"
_OPENENV = "openenv"
_PROTOCOLS = {
    "gym": _GYM, "GymEnvironmentInteraction": _GYM, "verl.interactions.gym_environment_interaction.GymEnvironmentInteraction": _GYM,
    "opentinker.environments.gym_interaction.GymEnvironmentInteraction": _GYM,
    "openenv": _OPENENV, "opentinker.environments.openenv_interaction.OpenEnvInteraction": _OPENENV,
}
_HTTP_CALLS = {_GYM: {("POST", "reset"), ("POST", "step"), ("POST", "finalize"), ("GET", "health")},
               _OPENENV: {("GET", "health"), ("GET", "schema")}}
_SESSION_PATHS = {_OPENENV: {"ws"}}
_SESSION_MESSAGES = {"reset", "step", "state", "close"}


class _Refused(Exception):
    """A call outside what the user configured: answered ``refused``, and logged."""


class _Final(Exception):
    """The server ended the relay for a reason retrying will not change."""


@dataclass(frozen=True)
class _Route:
    protocol: str
    shards: tuple[str, ...]


def _shards(spec: InteractionSpec) -> tuple[str, ...]:
    from opentinker.environments.gym_interaction import shard_urls

    return tuple(shard_urls(spec.config.get("env_endpoint"), spec.config.get("env_shards")))


def relayed_specs(specs: Sequence[InteractionSpec]) -> list[InteractionSpec]:
    """The specs with ``relay: client`` (ValueError for one whose protocol cannot be relayed)."""
    relayed = []
    for spec in specs:
        if not relay_mode(spec.config.get("relay")):
            continue
        if spec.class_path not in _PROTOCOLS:
            raise ValueError(f"interaction {spec.name!r}: relay: client carries the gym protocol ('gym') and OpenEnv "
                             f"('openenv'), not {spec.class_path!r}")
        _shards(spec)  # a malformed endpoint is an error now, not at the first call
        relayed.append(spec)
    return relayed


def _routes(specs: Sequence[InteractionSpec]) -> dict[str, _Route]:
    return {spec.name: _Route(_PROTOCOLS[spec.class_path], _shards(spec)) for spec in relayed_specs(specs)}


def local_problems(specs: Sequence[InteractionSpec], timeout_s: float = 3.0) -> list[str]:
    """What is wrong with the relayed envs of ``specs``, checked from this machine (where the relay
    will call them): each endpoint's ``GET /health`` must answer 2xx, and an OpenEnv server's
    ``/schema`` must fit the interaction's ``action_field`` (as the server checks a direct one)."""
    from opentinker.environments.openenv_schema import action_field_for

    problems = []
    by_name = {spec.name: spec for spec in specs}
    with httpx.Client(trust_env=False, follow_redirects=False, timeout=timeout_s) as http:
        for name, route in _routes(specs).items():
            for base in route.shards:
                label = f"interaction {name!r} (relay: client): {base}"
                try:
                    status = http.get(f"{base}/health").status_code
                    if not 200 <= status < 300:
                        problems.append(f"{label}/health answered HTTP {status}")
                        continue
                    if route.protocol == _OPENENV:
                        config = by_name[name].config
                        action_field_for(http.get(f"{base}/schema").json(), config.get("action_field"),
                                         config.get("action_extra"))
                except httpx.HTTPError as exc:
                    problems.append(f"{label} does not answer on this machine ({type(exc).__name__}); is the "
                                    "environment server running?")
                except ValueError as exc:  # the schema does not fit, or is not JSON
                    problems.append(f"{label}/schema: {exc}")
    return problems


# ---------------------------------------------------------------------- the record on disk


def _state_dir() -> Path:
    configured = os.environ.get("OPENTINKER_STATE_DIR", "").strip()
    if configured:
        return Path(configured).expanduser()
    base = os.environ.get("XDG_STATE_HOME", "").strip() or "~/.local/state"
    return Path(base).expanduser() / "opentinker"


def _record_path(client: OpenTinkerClient, job_id: str) -> Path:
    server = hashlib.sha256(client.base_url.encode()).hexdigest()[:16]
    safe = "".join(c for c in job_id if c.isalnum() or c in "-_")[:128] or "job"
    return _state_dir() / "relays" / server / f"{safe}.json"


def remember(client: OpenTinkerClient, job_id: str, specs: Sequence[InteractionSpec]) -> Path | None:
    """Keep the job's relayed specs on this machine (mode 0600), for a later :func:`recall`."""
    relayed = relayed_specs(specs)
    if not relayed:
        return None
    path = _record_path(client, job_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = json.dumps({"server": client.base_url, "job_id": job_id,
                       "interactions": [s.model_dump(mode="json") for s in relayed]}, indent=1)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as out:
        out.write(data)
    return path


def recall(client: OpenTinkerClient, job_id: str) -> list[InteractionSpec]:
    """The relayed specs this machine kept for the job (empty when it kept none)."""
    path = _record_path(client, job_id)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return []
    if data.get("server") != client.base_url or data.get("job_id") != job_id:
        return []
    return [InteractionSpec.model_validate(s) for s in data.get("interactions") or ()]


def forget(client: OpenTinkerClient, job_id: str) -> None:
    with contextlib.suppress(OSError):
        _record_path(client, job_id).unlink()


# ---------------------------------------------------------------------- the relay


def _ws_url(http_url: str) -> str:
    return "ws" + http_url[len("http"):]


def _timeout(call: dict[str, Any]) -> float:
    value = call.get("timeout_s", 30.0)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= MAX_TIMEOUT_S:
        raise _Refused(f"timeout_s must be a number of seconds in (0, {MAX_TIMEOUT_S:g}], got {value!r}")
    return float(value)


class EnvRelay:
    """Carries the env calls of job ``job_id`` to the endpoints of ``specs`` (their relayed
    ones), until :meth:`stop` or the server ends it for good (see the module docstring)."""

    def __init__(self, client: OpenTinkerClient, job_id: str, specs: Sequence[InteractionSpec], *,
                 max_concurrent: int = 64):
        self.client = client
        self.job_id = job_id
        self.routes = _routes(specs)
        if not self.routes:
            raise ValueError("no interaction of these specs has relay: client")
        self.max_concurrent = max_concurrent
        self.error: str | None = None  # why the server ended the relay for good
        self.calls = 0  # calls answered
        self.refused = 0  # calls refused (outside what the specs allow)
        self.connections = 0  # times connected
        self._connected = threading.Event()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._main: asyncio.Task | None = None
        self._sessions: dict[str, Any] = {}
        self._http: LocalHTTP | None = None

    def __repr__(self) -> str:
        return f"EnvRelay(job={self.job_id!r}, interactions={sorted(self.routes)}, connected={self.connected})"

    @property
    def connected(self) -> bool:
        return self._connected.is_set()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

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
        finally:
            self._connected.clear()
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

    async def _run(self) -> None:
        from websockets.asyncio.client import connect
        from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidURI

        url = _ws_url(self.client.url(f"/jobs/{self.job_id}/relay"))
        headers = {"Authorization": f"Bearer {self.client.api_key}"}
        loopback = httpx.URL(self.client.base_url).host in ("127.0.0.1", "localhost", "::1")
        failures = 0
        self._http = LocalHTTP(max_body_bytes=MAX_ANSWER_BYTES)
        try:
            while not self._stopping.is_set():
                try:
                    async with connect(url, additional_headers=headers, max_size=MAX_CALL_BYTES, compression=None,
                                       open_timeout=self.client.timeout, proxy=None if loopback else True) as socket:
                        await self._serve(socket)
                        failures = 0
                except _Final as final:
                    self.error = str(final)
                    finished = str(final).startswith(_FINAL_CLOSE_CODES[4409])
                    log.log(logging.INFO if finished else logging.WARNING, "job %s: the client relay ended: %s",
                            self.job_id, final)
                    return
                except (OSError, asyncio.TimeoutError, TimeoutError, ConnectionClosed, InvalidHandshake) as exc:
                    log.info("job %s: client relay connection lost (%s); reconnecting", self.job_id, exc)
                except InvalidURI as exc:
                    self.error = f"bad server URL: {exc}"
                    return
                finally:
                    self._connected.clear()
                    await self._close_sessions()
                failures += 1
                delay = min(10.0, 0.25 * 2 ** min(failures, 6)) * random.uniform(0.8, 1.2)
                await self._pause(delay)
        finally:
            await self._http.aclose()

    async def _pause(self, seconds: float) -> None:
        """Sleep ``seconds``, or less when :meth:`stop` is called meanwhile."""
        end = asyncio.get_running_loop().time() + seconds
        while not self._stopping.is_set() and asyncio.get_running_loop().time() < end:
            await asyncio.sleep(0.1)

    async def _serve(self, socket: Any) -> None:
        """Answer the calls of one connection until it closes."""
        from websockets.exceptions import ConnectionClosed

        slots = asyncio.Semaphore(self.max_concurrent)
        running: set[asyncio.Task] = set()
        try:
            async for text in socket:
                message = json.loads(text) if isinstance(text, str) else None
                kind = message.get("type") if isinstance(message, dict) else None
                if kind == "hello":
                    self.connections += 1
                    self._connected.set()
                    unknown = sorted(set(message.get("interactions") or ()) - set(self.routes))
                    if unknown:
                        log.warning("job %s: the server relays interactions this client does not carry: %s "
                                    "(their calls will be refused)", self.job_id, ", ".join(map(str, unknown)))
                elif kind == "error":  # the close that follows says whether it is for good
                    log.debug("job %s: the server ends the relay: %s", self.job_id, message.get("message"))
                elif kind == "call":
                    await slots.acquire()  # past max_concurrent: stop reading until one is done
                    task = asyncio.ensure_future(self._answer(socket, message))
                    running.add(task)
                    task.add_done_callback(lambda done: (running.discard(done), slots.release()))
        except ConnectionClosed as closed:
            final = _FINAL_CLOSE_CODES.get(closed.rcvd.code if closed.rcvd else 0)
            if final is not None:
                raise _Final(f"{final}: {closed.rcvd.reason}") from None
            raise
        finally:
            for task in running:
                task.cancel()
            await asyncio.gather(*running, return_exceptions=True)
        code = socket.close_code
        if code in _FINAL_CLOSE_CODES:
            raise _Final(f"{_FINAL_CLOSE_CODES[code]}: {socket.close_reason}")

    async def _answer(self, socket: Any, call: dict[str, Any]) -> None:
        try:
            answer = await self._handle(call)
            self.calls += 1
        except _Refused as refused:
            self.refused += 1
            log.warning("job %s: refused a relayed call (%s): %s", self.job_id, refused,
                        json.dumps({k: call.get(k) for k in ("op", "interaction", "shard", "method", "path")})[:300])
            answer = {"error": "refused", "detail": f"the client relay refused the call: {refused}"}
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug here must not end the relay
            log.exception("job %s: a relayed call failed", self.job_id)
            answer = {"error": "bad_answer", "detail": f"the client relay failed: {type(exc).__name__}"}
        with contextlib.suppress(Exception):  # the connection may be gone: the server fails the call itself
            await socket.send(json.dumps({"type": "answer", "id": call.get("id"), **answer}, ensure_ascii=False))

    def _base(self, call: dict[str, Any]) -> tuple[_Route, str]:
        route = self.routes.get(call.get("interaction"))  # type: ignore[arg-type]
        if route is None:
            raise _Refused(f"interaction {str(call.get('interaction'))[:80]!r} is not relayed by this client")
        shard = call.get("shard")
        if isinstance(shard, bool) or not isinstance(shard, int) or not 0 <= shard < len(route.shards):
            raise _Refused(f"shard {str(shard)[:20]!r} is not one of its {len(route.shards)} endpoint(s)")
        return route, route.shards[shard]

    async def _handle(self, call: dict[str, Any]) -> dict[str, Any]:
        op = call.get("op")
        if op == "http":
            return await self._http_call(call)
        if op == "ws_open":
            return await self._open_session(call)
        if op == "ws_exchange":
            return await self._exchange(call)
        if op == "ws_close":
            session = self._sessions.pop(str(call.get("session")), None)
            if session is not None:
                await session.close()
            return {"ok": True}
        raise _Refused(f"unknown operation {str(op)[:40]!r}")

    async def _http_call(self, call: dict[str, Any]) -> dict[str, Any]:
        route, base = self._base(call)
        method, path = call.get("method"), call.get("path")
        if (method, path) not in _HTTP_CALLS[route.protocol]:
            raise _Refused(f"{str(method)[:10]} /{str(path)[:80]} is not a call of the {route.protocol} protocol")
        body = call.get("body")
        if method == "GET" and body is not None:
            raise _Refused("a GET carries no body")
        timeout = _timeout(call)
        assert self._http is not None
        try:
            status, content_type, data = await self._http.request(method, base, path, body, timeout)
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

        route, base = self._base(call)
        path = call.get("path")
        if path not in _SESSION_PATHS.get(route.protocol, ()):
            raise _Refused(f"a session on /{str(path)[:80]} is not part of the {route.protocol} protocol")
        session_id = call.get("session")
        if not isinstance(session_id, str) or not 0 < len(session_id) <= 200 or session_id in self._sessions:
            raise _Refused("a session needs a new id (a string of at most 200 characters)")
        if len(self._sessions) >= MAX_SESSIONS:
            raise _Refused(f"this relay holds {MAX_SESSIONS} env sessions already")
        timeout = _timeout(call)
        try:
            session = await connect(f"{_ws_url(base)}/{path}", max_size=MAX_ANSWER_BYTES, compression=None,
                                    open_timeout=timeout, proxy=None)
        except InvalidStatus as exc:
            status = exc.response.status_code
            return {"error": "no_answer" if status in (502, 503, 504) else "bad_answer",
                    "detail": f"WebSocket handshake answered HTTP {status}"}
        except (OSError, asyncio.TimeoutError, TimeoutError, WebSocketException) as exc:
            return {"error": "no_answer", "detail": f"{type(exc).__name__}: {exc or 'connection failed'}"}
        self._sessions[session_id] = _LocalSession(session)
        return {"ok": True}

    async def _exchange(self, call: dict[str, Any]) -> dict[str, Any]:
        session = self._sessions.get(str(call.get("session")))
        if session is None:
            return {"error": "no_answer", "detail": "no such env session (it was closed, or the relay reconnected)"}
        message = call.get("message")
        if not isinstance(message, dict) or message.get("type") not in _SESSION_MESSAGES:
            raise _Refused(f"session messages are {', '.join(sorted(_SESSION_MESSAGES))}")
        return await session.exchange(message, _timeout(call))

    async def _close_sessions(self) -> None:
        sessions, self._sessions = self._sessions, {}
        await asyncio.gather(*(s.close() for s in sessions.values()), return_exceptions=True)


class _LocalSession:
    """A WebSocket session with the local env; one exchange at a time."""

    def __init__(self, socket: Any):
        self.socket = socket
        self.lock = asyncio.Lock()

    async def exchange(self, message: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        from websockets.exceptions import ConnectionClosed, PayloadTooBig

        async with self.lock:
            try:
                await self.socket.send(json.dumps(message))
                reply = await asyncio.wait_for(self.socket.recv(), timeout_s)
            except (asyncio.TimeoutError, TimeoutError):
                return {"error": "no_answer", "detail": f"no message within {timeout_s:g}s"}
            except PayloadTooBig:
                return {"error": "bad_answer", "detail": f"a message larger than {MAX_ANSWER_BYTES} bytes"}
            except ConnectionClosed as closed:
                return {"error": "no_answer", "detail": f"the env closed the session ({closed})"}
        if not isinstance(reply, str):
            return {"error": "bad_answer", "detail": "a binary message where JSON text was due"}
        try:
            return {"message": json.loads(reply)}
        except ValueError:
            return {"error": "bad_answer", "detail": "a message that is not JSON"}

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await self.socket.close()
