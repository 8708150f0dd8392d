"""A job's event stream (Server-Sent Events) that survives dropped connections: each
reconnect resumes with ``Last-Event-ID``, so no event is lost or repeated; failed connections
back off and give up after the client's retries, quiet or cleanly ended streams reconnect."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

import httpx
import pydantic
from httpx_sse import EventSource, SSEError
from tenacity import RetryCallState, Retrying, retry_if_exception_type

from opentinker.client.errors import JobTimeoutError, OpenTinkerError, error_from_response
from opentinker.client.retries import RETRY_STATUSES, RetryableStatus, until
from opentinker.protocol import Event, JobStatus

if TYPE_CHECKING:
    from opentinker.client.jobs import JobHandle

__all__ = ["final_status", "stream_events"]


class _Resume(Exception):
    """The event stream ended or went quiet before the job's final status: connect again
    (after ``delay`` seconds), resuming after the last event id."""

    def __init__(self, delay: float = 0.0):
        super().__init__("the event stream ended before the final status")
        self.delay = delay


def final_status(event: Event) -> JobStatus | None:
    """The finished status an event announces, or None."""
    if event.type != "status":
        return None
    try:
        status = JobStatus(event.data.get("status"))
    except ValueError:
        return None
    return status if status.finished else None


def stream_events(job: JobHandle, after: int | None, deadline: float | None) -> Iterator[Event]:
    """``job``'s events after ``after`` until its final status (see :meth:`JobHandle.stream`);
    JobTimeoutError at ``deadline`` (``time.monotonic()``; None: none)."""
    # One tenacity attempt per connection. Events reset the count of failed connections;
    # a clean end or a quiet stream (ReadTimeout) is a _Resume, which never counts as one.
    client = job.client
    last = int(after or 0)
    failures = 0  # consecutive failed connections
    idle = 0  # consecutive clean ends that brought nothing new

    def wait(state: RetryCallState) -> float:
        error = state.outcome.exception() if state.outcome is not None else None
        delay = error.delay if isinstance(error, _Resume) else client.backoff_delay(failures - 1)
        return until(deadline, delay)

    def give_up(state: RetryCallState) -> bool:
        error = state.outcome.exception() if state.outcome is not None else None
        return not isinstance(error, _Resume) and failures > client.retries

    reconnects = Retrying(
        retry=retry_if_exception_type((_Resume, httpx.TransportError, RetryableStatus)),
        stop=give_up,
        wait=wait,
        reraise=True,
    )
    try:
        for attempt in reconnects:
            with attempt:
                read_timeout = client.stream_read_timeout
                if deadline is not None:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        raise JobTimeoutError(f"timed out waiting for job {job.job_id} (it keeps running)")
                    read_timeout = min(read_timeout, remaining)
                received = False
                try:
                    for event in _connect(job, last, read_timeout):
                        if event.id <= last:
                            continue  # the server repeated something we have: skip, never yield twice
                        last = event.id
                        received, failures, idle = True, 0, 0
                        yield event
                        if final_status(event) is not None:
                            return
                        if deadline is not None and time.monotonic() >= deadline:
                            raise JobTimeoutError(f"timed out waiting for job {job.job_id} (it keeps running)")
                except httpx.ReadTimeout:
                    raise _Resume() from None  # a quiet stream (no heartbeat): reconnect at once
                except (httpx.TransportError, RetryableStatus):
                    failures += 1
                    raise
                if received:
                    raise _Resume()  # the stream ended early: resume at once from the last id
                if job.info().status.finished:
                    return  # nothing after `last` will ever come
                idle += 1
                raise _Resume(client.backoff_delay(min(idle - 1, 4)))
    except (httpx.TransportError, RetryableStatus) as exc:
        raise client.connection_error(exc, failures) from exc

def _connect(job: JobHandle, last: int, read_timeout: float) -> Iterator[Event]:
    headers = {"Accept": "text/event-stream", "Cache-Control": "no-cache"}
    if last:
        headers["Last-Event-ID"] = str(last)
    with job.client.open_stream(f"{job.path}/events", headers=headers, read_timeout=read_timeout) as response:
        if response.status_code in RETRY_STATUSES:
            raise RetryableStatus(response)
        if response.is_error:
            response.read()
            raise error_from_response(response)
        try:
            for sse in EventSource(response).iter_sse():
                if not sse.data:
                    continue  # a bare id or retry field: no event
                try:
                    yield Event.model_validate_json(sse.data)
                except pydantic.ValidationError as exc:
                    raise OpenTinkerError(
                        f"malformed event on the stream of job {job.job_id}: {sse.data[:200]!r}"
                    ) from exc
        except SSEError as exc:
            raise OpenTinkerError(f"the events of job {job.job_id} came back as something else: {exc}") from exc
