"""One error shape for every failure: ``{"error": "<message>", "detail": ...}`` (protocol.ErrorBody).

Handlers are installed for our own :class:`ApiError`, for Starlette's HTTP errors (unknown
route, wrong method) and for FastAPI's request validation, whose message names each
failing field as a dotted path (``body.config.data``, ``body.rows[2]``, ``query.after``).
An unexpected exception is a 500 whose message carries an error id; its trace is in the
server's log under that id, never sent.
"""

from __future__ import annotations

import logging
import re
import uuid
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from opentinker.protocol import ErrorBody

log = logging.getLogger("opentinker.server")
_FASTAPI_BODY_PARSE_ERROR = "There was an error parsing the body"


class ApiError(Exception):
    """Raise in a route or dependency to answer ``status`` with ``{"error": message, "detail": detail}``."""

    def __init__(self, status: int, message: str, detail: Any = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.detail = detail
        self.headers = headers


_ERROR_DESCRIPTIONS = {
    # The rule: 422 only for what this document says (types, bounds, patterns), so a request
    # the document allows is never a 422; 400 for what it cannot say.
    400: "the request fits the schema but not this server: something it does not allow (an interaction "
         "class, a config key or value) or content it cannot train on (a dataset row); the message names the field",
    401: "missing, invalid or revoked API key",
    404: "no such resource among the caller's own",
    409: "the request conflicts with the resource's state",
    413: "the request body is larger than the server accepts",
    422: "the request does not fit this document's schema; the message names the field",
    429: "over a limit of this server; retry after Retry-After seconds",
    500: "internal server error",
    503: "a job's runner did not answer in time; retry after Retry-After seconds",
}


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses`` for these error statuses, all with the ErrorBody shape."""
    return {status: {"model": ErrorBody, "description": _ERROR_DESCRIPTIONS[status]} for status in statuses}


#: What any authenticated route can answer (429: too many wrong keys from the client's address).
AUTHENTICATED_ERRORS = error_responses(401, 413, 422, 429, 500)


def new_error_id() -> str:
    """What a client quotes to the operator; the server's log has the trace under it."""
    return uuid.uuid4().hex[:12]


def not_found(what: str) -> ApiError:
    return ApiError(404, f"{what} not found")


def error_response(status: int, message: str, detail: Any = None, headers: dict[str, str] | None = None) -> JSONResponse:
    body = ErrorBody(error=message, detail=jsonable_encoder(detail))
    return JSONResponse(body.model_dump(), status_code=status, headers=headers)


def field_path(loc: Sequence[Any]) -> str:
    """``("body", "rows", 2, "prompt")`` -> ``"body.rows[2].prompt"``."""
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        else:
            path += f".{part}" if path else str(part)
    return path or "request"


def validation_message(errors: Sequence[dict[str, Any]]) -> str:
    return "; ".join(f"{field_path(e.get('loc', ()))}: {e.get('msg', 'invalid')}" for e in errors)


def allowed_methods(request: Request) -> list[str]:
    """Every method the API documents at the request's path (from the OpenAPI paths, built once)."""
    table = getattr(request.app.state, "methods_by_path", None)
    if table is None:
        table = [
            (re.compile("^" + "[^/]+".join(map(re.escape, re.split(r"\{[^/}]+\}", path))) + "$"),
             {method.upper() for method in operations})
            for path, operations in request.app.openapi()["paths"].items()
        ]
        request.app.state.methods_by_path = table
    return sorted({m for pattern, methods in table if pattern.match(request.url.path) for m in methods})


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.detail, exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 400 and exc.detail == _FASTAPI_BODY_PARSE_ERROR:
            # FastAPI's answer when json.loads raises something other than a decode error (a
            # body that is not UTF-8; nesting too deep to parse is refused before: middleware.py).
            return error_response(422, "request body: not valid JSON, or nested too deeply to parse")
        message = exc.detail if isinstance(exc.detail, str) else "HTTP error"
        detail = None if isinstance(exc.detail, str) else exc.detail
        headers = dict(getattr(exc, "headers", None) or {})
        if exc.status_code == 405:  # FastAPI's Allow names one route's methods; a path may have several
            headers["Allow"] = ", ".join(allowed_methods(request)) or headers.get("Allow", "")
        return error_response(exc.status_code, message, detail, headers or None)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        error_id = new_error_id()
        log.exception("%s %s failed: error id %s", request.method, request.url.path, error_id)
        return error_response(500, f"internal server error (error id {error_id})",
                              {"type": type(exc).__name__, "error_id": error_id})

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = list(exc.errors())
        # The offending input can be a whole dataset; the field path and message say enough.
        detail = [{"field": field_path(e.get("loc", ())), "message": e.get("msg"), "type": e.get("type")} for e in errors]
        return error_response(422, validation_message(errors), detail)
