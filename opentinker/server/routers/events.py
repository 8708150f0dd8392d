"""``GET /v1/jobs/{id}/events``: the job's event log as Server-Sent Events (or JSON).

Each event is ``id: <seq>``, ``event: <type>``, ``data: <Event JSON>``. A stream starts
after ``Last-Event-ID`` (what a reconnecting SSE client sends) or ``?after=N``, sends what
is stored, then polls the store for new events, and ends once the job's final status
event has been sent, so ``for event in stream`` terminates by itself.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from fastapi import APIRouter, Depends, Header, Query
from fastapi.responses import JSONResponse, StreamingResponse

from opentinker.protocol import Event
from opentinker.server.auth import current_user
from opentinker.server.deps import get_settings, get_store, owned_job
from opentinker.server.errors import ApiError
from opentinker.server.settings import ServerSettings
from opentinker.server.store import JobRecord, Store

router = APIRouter(prefix="/jobs", tags=["events"], dependencies=[Depends(current_user)])

PAGE = 500


def format_sse(event: Event) -> str:
    return f"id: {event.id}\nevent: {event.type}\ndata: {event.model_dump_json()}\n\n"


async def event_stream(store: Store, job_id: str, after: int, poll_s: float, keepalive_s: float) -> AsyncIterator[str]:
    cursor = after
    last_write = time.monotonic()
    while True:
        # Read the status before the events: a final status and its event are stored in one
        # transaction, so if the job is finished here, its final event is in what follows.
        job = store.get_job(job_id)
        if job is None:
            return
        final_id = store.final_status_event_id(job_id) if job.status.finished else None
        events = store.list_events(job_id, after=cursor, limit=PAGE)
        for event in events:
            yield format_sse(event)
            cursor = event.id
        if events:
            last_write = time.monotonic()
            if len(events) == PAGE:
                continue
        if job.status.finished and (final_id is None or cursor >= final_id):
            return
        if time.monotonic() - last_write >= keepalive_s:
            yield ": keep-alive\n\n"
            last_write = time.monotonic()
        await asyncio.sleep(poll_s)


@router.get(
    "/{job_id}/events",
    summary="The job's events as Server-Sent Events (or JSON with stream=false)",
    responses={200: {"content": {"text/event-stream": {}, "application/json": {}}}},
)
async def job_events(
    job: JobRecord = Depends(owned_job),
    after: int = Query(0, ge=0, description="send events with id > after"),
    stream: bool = Query(True, description="false: one JSON answer {events: [...]}"),
    limit: int | None = Query(None, ge=1, le=100_000, description="stream=false only: at most this many"),
    last_event_id: str | None = Header(None, alias="Last-Event-ID"),
    store: Store = Depends(get_store),
    settings: ServerSettings = Depends(get_settings),
):
    if last_event_id is not None and last_event_id.strip():
        try:
            after = int(last_event_id)
        except ValueError:
            raise ApiError(422, f"header Last-Event-ID: must be an event id (an integer), got {last_event_id!r}") from None
        if after < 0:
            raise ApiError(422, "header Last-Event-ID: must be >= 0")
    if not stream:
        events = store.list_events(job.job_id, after=after, limit=limit)
        return JSONResponse({"events": [event.model_dump(mode="json") for event in events]})
    return StreamingResponse(
        event_stream(store, job.job_id, after, settings.event_poll_s, settings.keepalive_s),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )
