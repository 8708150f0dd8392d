"""Typed errors of the thin client.

Every error the client raises on purpose is an :class:`OpenTinkerError`. Errors that come
from an HTTP answer carry ``status_code`` and the server's ``detail``; their message is the
server's ``error`` field (the v1 error body is ``{"error": msg, "detail": ...}``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import httpx

    from opentinker.protocol import JobInfo

__all__ = [
    "AuthenticationError",
    "ConfigurationError",
    "ConflictError",
    "ConnectionFailedError",
    "DatasetError",
    "EnvironmentSetupError",
    "JobFailedError",
    "JobTimeoutError",
    "NotFoundError",
    "OpenTinkerError",
    "RateLimitError",
    "ServerError",
    "UnsafeArchiveError",
    "ValidationError",
    "error_from_response",
]


class OpenTinkerError(Exception):
    """Base class of every error the client raises."""

    def __init__(
        self,
        message: str,
        *,
        status_code: int | None = None,
        detail: Any = None,
        response: httpx.Response | None = None,
    ):
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.detail = detail
        self.response = response


class ConfigurationError(OpenTinkerError, ValueError):
    """The client is missing its base URL or API key, or was given an invalid one."""


class ConnectionFailedError(OpenTinkerError, ConnectionError):
    """The server could not be reached (after the configured retries)."""


class AuthenticationError(OpenTinkerError):
    """HTTP 401/403: the API key is missing, wrong or not allowed to do this."""


class NotFoundError(OpenTinkerError, LookupError):
    """HTTP 404: no such job, checkpoint or route."""


class ValidationError(OpenTinkerError, ValueError):
    """HTTP 400/422: the server rejected the request; the message is the server's ``error``."""


class ConflictError(OpenTinkerError):
    """HTTP 409: the request does not fit the job's state (wrong step order, wrong mode, finished job)."""


class RateLimitError(OpenTinkerError):
    """HTTP 429: the server's queue is full; ``retry_after`` is the server's hint in seconds."""

    def __init__(self, message: str, *, retry_after: float | None = None, **kw: Any):
        super().__init__(message, **kw)
        self.retry_after = retry_after


class ServerError(OpenTinkerError):
    """HTTP 5xx (after retries where retrying was allowed)."""


class JobFailedError(OpenTinkerError):
    """The job ended as ``failed`` (or ``interrupted``); ``info`` is its final :class:`JobInfo`."""

    def __init__(self, message: str, *, info: JobInfo | None = None):
        super().__init__(message)
        self.info = info


class JobTimeoutError(OpenTinkerError, TimeoutError):
    """``JobHandle.wait(timeout=...)`` ran out of time; the job itself keeps running."""


class EnvironmentSetupError(OpenTinkerError):
    """``GenericEnvironment.setup`` found a problem: an env endpoint that does not answer, an
    interaction class the server does not allow, or an invalid spec."""


class DatasetError(OpenTinkerError, ValueError):
    """A dataset file or row is invalid; the message names the file, the line/index and what is wrong."""


class UnsafeArchiveError(OpenTinkerError):
    """A downloaded checkpoint archive has a member that would land outside the destination."""


_BY_STATUS: dict[int, type[OpenTinkerError]] = {
    400: ValidationError,
    401: AuthenticationError,
    403: AuthenticationError,
    404: NotFoundError,
    409: ConflictError,
    422: ValidationError,
    429: RateLimitError,
}


def parse_retry_after(value: str | None) -> float | None:
    """Seconds from a ``Retry-After`` header: a number (fractions allowed) or an HTTP date."""
    if value is None:
        return None
    value = value.strip()
    try:
        seconds = float(value)
    except ValueError:
        import email.utils
        import time

        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError, IndexError):
            return None
        if when is None:
            return None
        seconds = when.timestamp() - time.time()
    if seconds != seconds:  # NaN
        return None
    return max(0.0, seconds)


def error_from_response(response: httpx.Response) -> OpenTinkerError:
    """The typed error for an HTTP error answer (the body read already)."""
    status = response.status_code
    try:
        body = response.json()
    except Exception:  # not JSON (a proxy's HTML page, an empty body)
        body = None
    detail: Any = None
    message: str | None = None
    if isinstance(body, dict):
        detail = body.get("detail")
        if isinstance(body.get("error"), str):
            message = body["error"]
        elif isinstance(detail, str):  # FastAPI's default error body
            message = detail
    if not message:
        text = (response.text or "").strip()
        message = text[:500] if text and body is None else f"HTTP {status} {response.reason_phrase}".strip()
    cls = _BY_STATUS.get(status) or (ServerError if status >= 500 else OpenTinkerError)
    if cls is AuthenticationError:
        message = f"{message} (HTTP {status}; check the API key: OPENTINKER_API_KEY or api_key=/--api-key)"
    kw: dict[str, Any] = {"status_code": status, "detail": detail, "response": response}
    if cls is RateLimitError:
        return RateLimitError(message, retry_after=parse_retry_after(response.headers.get("Retry-After")), **kw)
    return cls(message, **kw)
