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

What a client sends is bounded (:class:`_Answers`): a frame is kept only when it answers a call
sent on this connection and not yet answered or over (its id is read from the frame's head;
anything else, every frame of a relay whose job is still queued included, is dropped unread and
counted); a kept answer is parsed with a bound on its depth (one that cannot be read answers its
call ``bad_answer``); and kept answers not yet handed to the runner hold at most
``--env-relay-buffer-mb`` (plus the frame being read) before the route stops reading
(backpressure). uvicorn holds at most one more received frame per connection, besides the
one it is reading (``ServerSettings.uvicorn_options``). A malformed frame never ends the relay.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import math
import re
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, WebSocket, WebSocketDisconnect

from opentinker.environments.relay import RELAY_SLACK_S, relay_mode
from opentinker.environments.transport import MAX_ANSWER_BYTES
from opentinker.json_limits import MAX_ENV_JSON_DEPTH, loads_bounded
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
MAX_ANSWER_DEPTH = MAX_ENV_JSON_DEPTH + 8  # an env's answer (an OpenEnv message) in the relay's envelope
PARSE_OFF_LOOP_CHARS = 1 << 20  # answers longer than this are parsed in a thread, not on the event loop
DROP_LOG_S = 10.0  # a connection logs its dropped frames at most this often
MIN_PRUNE = 1024  # the calls an answer is awaited for are pruned of finished ones past this many

_S = r"\s{0,8}"  # JSON whitespace, as much as any writer puts there
#: The head of an answer as the client writes it, ``{"type": "answer", "id": N, ...``: the id of the
#: call it answers, read without parsing the (up to 33 MiB) rest.
_ANSWER_HEAD = re.compile(rf'\{{{_S}"type"{_S}:{_S}"answer"{_S},{_S}"id"{_S}:{_S}(\d{{1,18}}){_S}[,}}]')


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


class _Answers:
    """One connection's answers on their way from the client to the job's runner (event loop only).

    :meth:`sent` records each call sent to the client until its answer comes or its time at the
    hub is over (its timeout plus the relay's slack, counted from when it was sent: never before
    the hub gives up on it). :meth:`offer` keeps a frame only when the id in its head
    (``_ANSWER_HEAD``) is such a call's; every other frame (not an answer's head, a binary frame,
    an answer to a call never sent on this connection, answered already or over) is dropped
    without being parsed, counted in :attr:`dropped`, and logged at most every ``DROP_LOG_S``.
    A kept frame is parsed with :func:`loads_bounded`; one that is not a JSON object or nests
    deeper than ``MAX_ANSWER_DEPTH`` is counted too, and answers its call ``bad_answer`` instead
    (the hub raises BadAnswer for it).

    Kept answers weigh their frame's size in memory from when they are read until the runner
    has them (:meth:`batch`, then :meth:`forwarded`); :meth:`room` waits while they weigh
    ``budget_bytes`` or more, so a reader that awaits it before each frame holds at most the
    budget plus one frame.
    """

    def __init__(self, job_id: str, budget_bytes: int, clock=time.monotonic):
        self.job_id = job_id
        self.budget_bytes = budget_bytes
        self._clock = clock
        self._awaited: dict[int, float] = {}  # call id -> when the hub stops waiting for its answer
        self._prune_at = MIN_PRUNE
        self._kept: list[dict[str, Any]] = []
        self._kept_bytes = 0
        self.held_bytes = 0  # kept, or being handed to the runner
        self._room = asyncio.Event()
        self._ready = asyncio.Event()
        self._room.set()
        self.dropped: collections.Counter[str] = collections.Counter()  # why -> frames
        self._logged_at = -math.inf

    def sent(self, calls: list[dict[str, Any]]) -> None:
        """The client is sent ``calls``: their answers are awaited."""
        now = self._clock()
        for call in calls:
            self._awaited[call["id"]] = now + float(call.get("timeout_s") or 0.0) + RELAY_SLACK_S
        if len(self._awaited) >= self._prune_at:  # calls the client never answered
            self._awaited = {i: end for i, end in self._awaited.items() if end > now}
            self._prune_at = max(MIN_PRUNE, 2 * len(self._awaited))

    async def room(self) -> None:
        """Wait until the kept answers weigh less than the budget."""
        await self._room.wait()

    async def offer(self, text: str | None) -> None:
        """A frame from the client (None: a binary one): kept when it answers an awaited call."""
        head = _ANSWER_HEAD.match(text) if text is not None else None
        if head is None:
            self._drop("not an answer", "a frame that does not begin as an answer")
            return
        call_id = int(head.group(1))
        if self._awaited.pop(call_id, -math.inf) < self._clock():
            self._drop("no such call", f"an answer to call {call_id}, which is not waiting on this connection")
            return
        try:
            if len(text) > PARSE_OFF_LOOP_CHARS:
                answer = await asyncio.to_thread(loads_bounded, text, MAX_ANSWER_DEPTH)
            else:
                answer = loads_bounded(text, MAX_ANSWER_DEPTH)
            if not isinstance(answer, dict):
                raise ValueError("not a JSON object")
        except ValueError as error:  # not JSON, or nested too deep
            self._drop("unreadable", f"an answer to call {call_id} that cannot be read ({error})")
            answer = {"type": "answer", "error": "bad_answer",
                      "detail": f"the client relay's answer could not be read: {str(error)[:200]}"}
        answer["id"] = call_id  # the call it was let through for, whatever else the text says
        weight = sys.getsizeof(text)
        self._kept.append(answer)
        self._kept_bytes += weight
        self.held_bytes += weight
        self._update()

    async def batch(self) -> tuple[list[dict[str, Any]], int]:
        """The kept answers, once there are some, and their weight (give it to :meth:`forwarded`)."""
        await self._ready.wait()
        batch, weight = self._kept, self._kept_bytes
        self._kept, self._kept_bytes = [], 0
        self._update()
        return batch, weight

    def forwarded(self, weight: int) -> None:
        """The runner has answers of ``weight`` (or they are lost): they no longer count."""
        self.held_bytes -= weight
        self._update()

    def _update(self) -> None:
        for event, on in ((self._room, self.held_bytes < self.budget_bytes), (self._ready, bool(self._kept))):
            if on:
                event.set()
            else:
                event.clear()

    def _drop(self, why: str, example: str) -> None:
        self.dropped[why] += 1
        now = self._clock()
        if now - self._logged_at >= DROP_LOG_S:
            self._logged_at = now
            log.warning("job %s: client relay frames dropped so far: %s (latest: %s)",
                        self.job_id, dict(self.dropped), example)


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
    answers = _Answers(job_id, websocket.app.state.settings.env_relay_buffer_mb * 2**20)
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
        tasks = [asyncio.ensure_future(_send_calls(websocket, actor, handle, answers, ended)),
                 asyncio.ensure_future(_forward_answers(actor, handle, answers, ended))]
        await ended.wait()
    finally:
        ended.set()
        for task in (*tasks, reader, *stop_on):
            task.cancel()
        await asyncio.gather(*tasks, reader, *stop_on, return_exceptions=True)
        if answers.dropped:
            log.warning("job %s: client relay frames dropped: %s", job_id, dict(answers.dropped))
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


async def _read_answers(websocket: WebSocket, answers: _Answers, ended: asyncio.Event) -> None:
    """The client's frames, one at a time, offered to ``answers``; no frame is read while the
    kept ones fill their budget (backpressure). Only the client going away ends it."""
    try:
        while True:
            await answers.room()
            message = await websocket.receive()
            if message["type"] == "websocket.disconnect":
                return
            await answers.offer(message.get("text"))
            del message  # not held while the next one is awaited
    except (WebSocketDisconnect, RuntimeError):  # RuntimeError: received after the socket closed
        pass
    finally:
        ended.set()


async def _forward_answers(actor: Any, handle: int, answers: _Answers, ended: asyncio.Event) -> None:
    """Kept answers to the runner, as many per Ray call as have come."""
    try:
        while True:
            batch, weight = await answers.batch()
            try:
                await _ray(actor.relay_answer.remote(handle, batch))
            finally:
                del batch
                answers.forwarded(weight)
    except asyncio.CancelledError:
        raise
    except Exception as error:  # the runner is gone: the job ended
        log.debug("client relay: the runner stopped taking answers (%r)", error)
        ended.set()


async def _send_calls(websocket: WebSocket, actor: Any, handle: int, answers: _Answers,
                      ended: asyncio.Event) -> None:
    """The runner's calls to the client, as they come (their answers awaited from then on)."""
    try:
        while True:
            calls = await _ray(actor.relay_take.remote(handle, TAKE_BATCH, TAKE_WAIT_S))
            if calls is None:  # the hub has another connection now
                break
            answers.sent(calls)
            for call in calls:
                await websocket.send_text(json.dumps({"type": "call", **call}))
    except asyncio.CancelledError:
        raise
    except Exception as error:  # the runner is gone (the job ended), or the client
        log.debug("client relay: no more calls (%r)", error)
    finally:
        ended.set()
