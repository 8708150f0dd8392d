"""The thin client's retry policies, on tenacity: what is retried, how long to wait, when to stop.

* :func:`retry_transient`: connection errors and 502/503/504 answers (:class:`RetryableStatus`),
  ``retries`` extra attempts with the client's exponential backoff; a ``Retry-After`` on the
  failed answer is honoured, capped at :data:`MAX_RETRY_AFTER_S`. What tenacity raises once
  the attempts are spent becomes the typed error (:class:`ConnectionFailedError` naming the
  number of attempts, or the last answer's own error).
* :func:`retry_rate_limited`: 429 answers (:class:`RateLimitError`), waiting the answer's
  ``Retry-After`` (default :data:`DEFAULT_RETRY_AFTER_S`, capped at :data:`MAX_RETRY_AFTER_S`)
  until a deadline.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

import httpx
from tenacity import (
    RetryCallState,
    RetryError,
    Retrying,
    retry_if_exception_type,
    stop_after_attempt,
    stop_before_delay,
    stop_never,
)

from opentinker.client.errors import RateLimitError, error_from_response, parse_retry_after

if TYPE_CHECKING:
    from opentinker.client.client import OpenTinkerClient

__all__ = [
    "DEFAULT_RETRY_AFTER_S",
    "MAX_RETRY_AFTER_S",
    "RETRY_STATUSES",
    "RetryableStatus",
    "Stopped",
    "retry_rate_limited",
    "retry_transient",
    "until",
]

RETRY_STATUSES = frozenset({502, 503, 504})
#: the longest a ``Retry-After`` header makes the client wait
MAX_RETRY_AFTER_S = 60.0
#: the wait after a 429 without a ``Retry-After`` header
DEFAULT_RETRY_AFTER_S = 1.0
T = TypeVar("T")


class RetryableStatus(Exception):
    """A 502/503/504 answer, raised so that it is retried like a connection error."""

    def __init__(self, response: httpx.Response):
        super().__init__(f"HTTP {response.status_code}")
        self.response = response
        self.status_code = response.status_code
        self.retry_after = parse_retry_after(response.headers.get("Retry-After"))


class Stopped(Exception):
    """The stop event was set while waiting to retry."""


def until(deadline: float | None, seconds: float) -> float:
    """``seconds``, but never past ``deadline`` (a ``time.monotonic()`` value; None: no deadline)."""
    return seconds if deadline is None else min(seconds, max(0.0, deadline - time.monotonic()))


def backoff_wait(client: OpenTinkerClient, deadline: float | None = None) -> Callable[[RetryCallState], float]:
    """A tenacity wait: the client's backoff for the attempt, at least the failed answer's
    ``Retry-After`` (capped), never past ``deadline``."""

    def wait(state: RetryCallState) -> float:
        error = state.outcome.exception() if state.outcome is not None else None
        retry_after = getattr(error, "retry_after", None)
        return until(deadline, client.backoff_delay(state.attempt_number - 1, retry_after))

    return wait


def retry_transient(client: OpenTinkerClient, send: Callable[[], T], *, resend: bool = True) -> T:
    """``send()``, retried on connection errors and :class:`RetryableStatus` (``client.retries``
    extra attempts; none when ``resend`` is False: a request whose effect is unknown must not
    be repeated). Raises :class:`ConnectionFailedError` or the last answer's typed error once
    the attempts are spent; other errors at once."""
    retrying = Retrying(
        retry=retry_if_exception_type((httpx.TransportError, RetryableStatus)),
        stop=stop_after_attempt(client.retries + 1 if resend else 1),
        wait=backoff_wait(client),
    )
    try:
        return retrying(send)
    except RetryError as spent:
        error = spent.last_attempt.exception()
        if isinstance(error, RetryableStatus):
            raise error_from_response(error.response) from None
        raise client.connection_error(error, spent.last_attempt.attempt_number) from error


def _retry_after(state: RetryCallState) -> float:
    error = state.outcome.exception() if state.outcome is not None else None
    delay = getattr(error, "retry_after", None)
    return min(max(DEFAULT_RETRY_AFTER_S if delay is None else delay, 0.01), MAX_RETRY_AFTER_S)


def retry_rate_limited(
    send: Callable[[], T], *, timeout: float | None = None, stop: threading.Event | None = None
) -> T:
    """``send()``, repeated after each :class:`RateLimitError` once its ``Retry-After`` has
    passed. The last 429 is raised when the next wait would end past ``timeout`` seconds
    (None: no limit); :class:`Stopped` when ``stop`` is set during a wait."""

    def sleep(seconds: float) -> None:
        if stop is None:
            time.sleep(seconds)
        elif stop.wait(seconds):
            raise Stopped

    retrying = Retrying(
        retry=retry_if_exception_type(RateLimitError),
        wait=_retry_after,
        stop=stop_never if timeout is None else stop_before_delay(timeout),
        sleep=sleep,
        reraise=True,
    )
    return retrying(send)
