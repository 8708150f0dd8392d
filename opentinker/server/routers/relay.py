"""``WS /v1/jobs/{id}/relay``: the job's client relay, opened by the user's thin client.

The server never connects to a user's machine. For interactions with ``"relay": "client"``
the client that started the job opens this WebSocket (outbound from its side) and the job's
env calls come down it: the runner's :class:`~opentinker.environments.relay.RelayHub` holds
them, :func:`relay` takes them through the runner's Ray methods and sends them as
``{"type": "call", "id", "op", ...}``; the client makes each call to its own env and answers
``{"type": "answer", "id", ...}``. A call is never a URL: it names an interaction and a
shard, and the client maps them to the endpoint its user configured.

Rules: the key must own the job, the job must have a relayed interaction and not be finished,
relays must be on (``--no-env-relay`` turns them off), and a user holds at most
``--max-env-relays-per-user`` at once (one per job: a second connection for a job replaces the
first, as a restarted client would). Refusals close the socket with ``4000 + the HTTP status``
(4401 key, 4403 relays off, 4404 job, 4409 finished or no relayed interaction, 4429 too many)
after a ``{"type": "error", "status", "message"}`` message. A revoked key ends the relay
within the credential watch's interval.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, WebSocket, WebSocketDisconnect

from opentinker.environments.relay import relay_mode
from opentinker.environments.transport import MAX_ANSWER_BYTES
from opentinker.protocol import RelayInfo
from opentinker.server.auth import INVALID_KEY, authenticate, hash_key, refuse_key
from opentinker.server.errors import ApiError
from opentinker.server.revocation import Credential
from opentinker.server.store import JobRecord

log = logging.getLogger("opentinker.server.relay")

router = APIRouter(prefix="/jobs", tags=["jobs"])

#: The largest message a client relay may send: an env's largest answer, JSON-escaped, and its envelope.
MAX_MESSAGE_BYTES = 2 * MAX_ANSWER_BYTES + (1 << 20)
TAKE_BATCH = 64  # calls taken from the runner at once
TAKE_WAIT_S = 1.0  # a take waits this long for calls (then the loop checks the job again)
START_POLL_S = 0.5  # how often a relay waits for its job's runner to start


def relayed_interactions(spec: dict[str, Any]) -> list[str]:
    """The names of a job spec's interactions with ``relay: client``."""
    names = []
    for interaction in spec.get("interactions") or ():
        try:
            if relay_mode((interaction.get("config") or {}).get("relay")):
                names.append(str(interaction.get("name")))
        except ValueError:  # refused when the job was made; never relayed
            continue
    return names


@dataclass
class _Connection:
    job_id: str
    user_id: int
    since: float
    replaced: asyncio.Event = field(default_factory=asyncio.Event)


class RelayBoard:
    """The client relays connected to this server (event loop only)."""

    def __init__(self, per_user: int):
        self.per_user = per_user
        self._by_job: dict[str, _Connection] = {}

    def claim(self, job_id: str, user_id: int) -> _Connection | None:
        """The job's new connection (a previous one is told to end), or None when the user
        already holds ``per_user`` relays for other jobs."""
        others = sum(1 for c in self._by_job.values() if c.user_id == user_id and c.job_id != job_id)
        if others >= self.per_user:
            return None
        previous = self._by_job.get(job_id)
        if previous is not None:
            previous.replaced.set()
        connection = self._by_job[job_id] = _Connection(job_id, user_id, time.time())
        return connection

    def release(self, connection: _Connection) -> None:
        if self._by_job.get(connection.job_id) is connection:
            del self._by_job[connection.job_id]

    def info(self, job: JobRecord) -> RelayInfo | None:
        names = relayed_interactions(job.spec)
        if not names:
            return None
        connection = self._by_job.get(job.job_id)
        return RelayInfo(interactions=names, connected=connection is not None,
                         connected_since=connection.since if connection is not None else None)


class _Refused(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def _user(websocket: WebSocket):
    header = websocket.headers.get("authorization", "")
    scheme, _, key = header.partition(" ")
    key = key.strip()
    if scheme.lower() != "bearer" or not key:
        raise _Refused(401, "missing API key: send 'Authorization: Bearer <key>'")
    user = authenticate(websocket.app.state.store, key)
    if user is None:  # counted against the address like any wrong key (429 past the limit)
        refusal = refuse_key(websocket, ApiError(401, INVALID_KEY))  # type: ignore[arg-type]
        raise _Refused(refusal.status, refusal.message)
    return user, Credential("key", hash_key(key))


def _relayed_names(websocket: WebSocket, job_id: str, user_id: int) -> list[str]:
    """The relayed interactions of the user's job, or _Refused saying why it can have no relay."""
    settings = websocket.app.state.settings
    job = websocket.app.state.store.get_job(job_id)
    if job is None or job.user_id != user_id:
        raise _Refused(404, f"no job {job_id!r} of yours")
    if not settings.env_relays:
        raise _Refused(403, "client relays are turned off on this server (--no-env-relay)")
    names = relayed_interactions(job.spec)
    if not names:
        raise _Refused(409, f"job {job_id} has no interaction with relay: client")
    if job.status.finished:
        raise _Refused(409, f"job {job_id} is {job.status.value}: it needs no relay")
    return names


async def _ray(ref: Any) -> Any:
    return await asyncio.wrap_future(ref.future())


@router.websocket("/{job_id}/relay")
async def relay(websocket: WebSocket, job_id: str) -> None:
    """Carry the job's env calls to its client and the answers back, until either side ends."""
    app = websocket.app
    board: RelayBoard = app.state.relays
    await websocket.accept()
    connection = None
    try:
        user, credential = _user(websocket)
        names = _relayed_names(websocket, job_id, user.id)
        connection = board.claim(job_id, user.id)
        if connection is None:
            raise _Refused(429, f"you hold {board.per_user} client relays already, the most this server allows "
                                "(--max-env-relays-per-user); end one first")
        await websocket.send_text(json.dumps({"type": "hello", "job_id": job_id,
                                              "interactions": names}))
        with app.state.credential_watch.watch(credential) as revoked:
            await _carry(websocket, job_id, names, connection, revoked)
    except _Refused as refused:
        await _close(websocket, refused.status, str(refused))
    except WebSocketDisconnect:
        pass
    finally:
        if connection is not None:
            board.release(connection)


async def _close(websocket: WebSocket, status: int, message: str) -> None:
    with contextlib.suppress(Exception):  # the client may be gone already
        await websocket.send_text(json.dumps({"type": "error", "status": status, "message": message}))
        await websocket.close(code=4000 + status, reason=message[:120])


async def _runner(websocket: WebSocket, job_id: str, ended: asyncio.Event) -> Any | None:
    """The job's runner actor once it is up (a queued job's relay waits), or None once the job ends."""
    manager = websocket.app.state.manager
    store = websocket.app.state.store
    while not ended.is_set():
        actor = manager.started_actor(job_id)
        if actor is not None:
            return actor
        job = store.get_job(job_id)
        if job is None or job.status.finished:
            return None
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(ended.wait(), START_POLL_S)
    return None


async def _carry(websocket: WebSocket, job_id: str, names: list[str], connection: _Connection,
                 revoked: asyncio.Event) -> None:
    ended = asyncio.Event()  # the client went away, the key was revoked, or another connection took over
    stop_on = [asyncio.ensure_future(revoked.wait()), asyncio.ensure_future(connection.replaced.wait())]
    for waiter in stop_on:
        waiter.add_done_callback(lambda _: ended.set())
    answers: asyncio.Queue = asyncio.Queue(maxsize=websocket.app.state.settings.env_relay_in_flight)
    reader = asyncio.ensure_future(_read_answers(websocket, answers, ended))
    actor = handle = None
    tasks: list[asyncio.Future] = []
    try:
        actor = await _runner(websocket, job_id, ended)
        if actor is None:
            return
        handle = await _ray(actor.relay_attach.remote())
        log.info("job %s: client relay connected", job_id)
        websocket.app.state.store.append_event(job_id, "log", {
            "message": f"client relay connected: the env calls of {', '.join(names)} go to the job's client"})
        tasks = [asyncio.ensure_future(_send_calls(websocket, actor, handle, ended)),
                 asyncio.ensure_future(_forward_answers(actor, handle, answers, ended))]
        await ended.wait()
    finally:
        ended.set()
        for task in (*tasks, reader, *stop_on):
            task.cancel()
        await asyncio.gather(*tasks, reader, *stop_on, return_exceptions=True)
        if actor is not None and handle is not None:
            with contextlib.suppress(Exception):  # a runner that is gone has no calls left to fail
                await _ray(actor.relay_detach.remote(handle))
            log.info("job %s: client relay disconnected", job_id)
            if not connection.replaced.is_set():  # (a replacing connection says it connected)
                websocket.app.state.store.append_event(job_id, "log", {  # nothing once the job has ended
                    "level": "warning", "message": "client relay disconnected: the job's env calls wait for its "
                    "client (job.attach() or `opentinker jobs logs -f JOB_ID` on the machine with the env)"})
        if revoked.is_set():
            await _close(websocket, 401, "the API key was revoked")
        elif connection.replaced.is_set():
            await _close(websocket, 409, "another connection of this job's client relay took over")
        else:
            job = websocket.app.state.store.get_job(job_id)
            if job is not None and job.status.finished:
                await _close(websocket, 409, f"job {job_id} is {job.status.value}")
            else:
                with contextlib.suppress(Exception):
                    await websocket.close()


async def _read_answers(websocket: WebSocket, answers: asyncio.Queue, ended: asyncio.Event) -> None:
    """The client's answers, queued for the runner; a full queue stops the reading (backpressure)."""
    try:
        while True:
            text = await websocket.receive_text()
            try:
                message = json.loads(text)
            except ValueError:
                log.warning("a client relay sent a message that is not JSON; closing it")
                return
            if isinstance(message, dict) and message.get("type") == "answer" and isinstance(message.get("id"), int):
                await answers.put(message)
    except (WebSocketDisconnect, RuntimeError):  # RuntimeError: received after the socket closed
        pass
    finally:
        ended.set()


async def _forward_answers(actor: Any, handle: int, answers: asyncio.Queue, ended: asyncio.Event) -> None:
    """Queued answers to the runner, as many per Ray call as have come."""
    try:
        while True:
            batch = [await answers.get()]
            while not answers.empty():
                batch.append(answers.get_nowait())
            await _ray(actor.relay_answer.remote(handle, batch))
    except asyncio.CancelledError:
        raise
    except Exception as error:  # the runner is gone: the job ended
        log.debug("client relay: the runner stopped taking answers (%r)", error)
        ended.set()


async def _send_calls(websocket: WebSocket, actor: Any, handle: int, ended: asyncio.Event) -> None:
    """The runner's calls to the client, as they come."""
    try:
        while True:
            calls = await _ray(actor.relay_take.remote(handle, TAKE_BATCH, TAKE_WAIT_S))
            if calls is None:  # the hub has another connection now
                break
            for call in calls:
                await websocket.send_text(json.dumps({"type": "call", **call}))
    except asyncio.CancelledError:
        raise
    except Exception as error:  # the runner is gone (the job ended), or the client
        log.debug("client relay: no more calls (%r)", error)
    finally:
        ended.set()
