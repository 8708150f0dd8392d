"""``GET /v1/jobs/{id}/events``: the job's event log as Server-Sent Events (or JSON).

Each event is ``id: <seq>``, ``event: <type>``, ``data: <Event JSON>`` (sse-starlette's
``EventSourceResponse`` writes them). A stream starts after ``Last-Event-ID`` (what a
reconnecting SSE client sends) or ``?after=N``, sends what is stored, then waits for the store
to announce new events (``EventBus``; no polling), and ends once the job's final status event
has been sent, so ``for event in stream`` terminates by itself. A ``: keep-alive`` comment goes
out every ``keepalive_s`` seconds (sse-starlette's ping) so that proxies keep idle streams open.
A stream also ends within seconds of its API key being revoked (:mod:`..revocation`).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from fastapi import APIRouter, Depends, Header, Query, Request
from fastapi.responses import JSONResponse
from sse_starlette import EventSourceResponse, ServerSentEvent

from opentinker.protocol import MAX_JSON_INT, Event
from opentinker.server.auth import current_user
from opentinker.server.deps import get_settings, get_store, owned_job
from opentinker.server.errors import AUTHENTICATED_ERRORS, error_responses
from opentinker.server.event_bus import EventBus
from opentinker.server.revocation import stream_until_revoked
from opentinker.server.settings import ServerSettings
from opentinker.server.store import JobRecord, Store

router = APIRouter(
    prefix="/jobs", tags=["events"], dependencies=[Depends(current_user)],
    responses={**AUTHENTICATED_ERRORS, **error_responses(404)},
)

PAGE = 500


def to_sse(event: Event) -> ServerSentEvent:
    return ServerSentEvent(data=event.model_dump_json(), id=str(event.id), event=event.type, sep="\n")


def keep_alive() -> ServerSentEvent:
    return ServerSentEvent(comment="keep-alive", sep="\n")


async def event_stream(
    store: Store, bus: EventBus, job_id: str, after: int, wake_s: float
) -> AsyncIterator[ServerSentEvent]:
    """The job's events after ``after``, then each new one as the bus announces it; ends after
    the final status event. Not a retry loop: one pass per page or per wake-up."""
    cursor = after
    while True:
        wake = bus.waiter(job_id)  # before reading: an event stored meanwhile still wakes us
        try:
            # Read the job before the events: its final status event is stored in the same
            # transaction as the final status, so if it is known here, it is in what follows.
            job = store.get_job(job_id)
            if job is None:
                return
            events = store.list_events(job_id, after=cursor, limit=PAGE)
            for event in events:
                yield to_sse(event)
                cursor = event.id
            if len(events) == PAGE:
                continue
            if job.final_event_seq is not None and cursor >= job.final_event_seq:
                return
            await asyncio.wait({wake}, timeout=wake_s)  # the timeout: a store change the bus missed
        finally:
            wake.cancel()


@router.get(
    "/{job_id}/events",
    summary="The job's events as Server-Sent Events (or JSON with stream=false)",
    responses={200: {"content": {"text/event-stream": {}, "application/json": {}}}},
)
async def job_events(
    request: Request,
    job: JobRecord = Depends(owned_job),
    after: int = Query(0, ge=0, le=MAX_JSON_INT, description="send events with id > after"),
    stream: bool = Query(True, description="false: one JSON answer {events: [...]}"),
    limit: int | None = Query(None, ge=1, le=100_000, description="stream=false only: at most this many"),
    last_event_id: str = Header(
        "", alias="Last-Event-ID", pattern=r"^[0-9]{0,15}$",  # 15 digits: always below 2**53
        description="what a reconnecting SSE client sends: resume after this event id",
    ),
    store: Store = Depends(get_store),
    settings: ServerSettings = Depends(get_settings),
):
    if last_event_id:
        after = int(last_event_id)
    if not stream:
        events = store.list_events(job.job_id, after=after, limit=limit)
        return JSONResponse({"events": [event.model_dump(mode="json") for event in events]})
    return EventSourceResponse(
        stream_until_revoked(request, event_stream(store, request.app.state.event_bus, job.job_id, after,
                                                   settings.keepalive_s)),
        headers={"Cache-Control": "no-cache"},
        ping=settings.keepalive_s,
        ping_message_factory=keep_alive,
        sep="\n",
    )
