"""A job's event stream (Server-Sent Events) that follows the job to its end and survives
dropped connections: each reconnect resumes with ``Last-Event-ID``, so no event is lost or
repeated; quiet or cleanly ended streams reconnect; failed connections back off and give up
only after the client's retries *and* ``patience_s`` without reaching the server (a server
restart takes a while). A final status event ends the stream only while it is the job's end:
a job that was stopped and then resumed (``jobs resume``, a server restart that continues it
from its checkpoint) goes on, and so does the stream, to the job's real end."""

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
from opentinker.protocol import Event, JobInfo, JobStatus

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


#: How long a stream keeps reconnecting to a server it cannot reach (a restart) before it gives up.
PATIENCE_S = 300.0


def ended_by(info: JobInfo, last: int) -> bool:
    """Whether the job of ``info`` has ended with an event id at most ``last``: False while it
    lives, and once it was resumed after a stop (its earlier final event is not its end)."""
    if "final_event_id" not in info.model_fields_set:  # a server that does not say where events end
        return info.status.finished
    return info.final_event_id is not None and last >= info.final_event_id


def stream_events(job: JobHandle, after: int | None, deadline: float | None,
                  patience_s: float = PATIENCE_S) -> Iterator[Event]:
    """``job``'s events after ``after`` until its end (see :meth:`JobHandle.stream`);
    JobTimeoutError at ``deadline`` (``time.monotonic()``; None: none)."""
    # One tenacity attempt per connection. Events reset the count of failed connections;
    # a clean end or a quiet stream (ReadTimeout) is a _Resume, which never counts as one.
    client = job.client
    last = int(after or 0)
    failures = 0  # consecutive failed connections
    idle = 0  # consecutive clean ends that brought nothing new
    reached = time.monotonic()  # when the server last answered

    def wait(state: RetryCallState) -> float:
        error = state.outcome.exception() if state.outcome is not None else None
        delay = error.delay if isinstance(error, _Resume) else client.backoff_delay(failures - 1)
        return until(deadline, delay)

    def give_up(state: RetryCallState) -> bool:
        error = state.outcome.exception() if state.outcome is not None else None
        if isinstance(error, _Resume):
            return False
        return failures > client.retries and time.monotonic() - reached > patience_s

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
                        reached = time.monotonic()
                        if event.id <= last:
                            continue  # the server repeated something we have: skip, never yield twice
                        last = event.id
                        received, failures, idle = True, 0, 0
                        yield event
                        if final_status(event) is not None and ended_by(job.info(), event.id):
                            return
                        if deadline is not None and time.monotonic() >= deadline:
                            raise JobTimeoutError(f"timed out waiting for job {job.job_id} (it keeps running)")
                except httpx.ReadTimeout:
                    raise _Resume() from None  # a quiet stream (no heartbeat): reconnect at once
                except (httpx.TransportError, RetryableStatus):
                    failures += 1
                    raise
                reached = time.monotonic()
                if received:
                    raise _Resume()  # the stream ended early: resume at once from the last id
                if ended_by(job.info(), last):
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
