"""One error shape for every failure: ``{"error": "<message>", "detail": ...}`` (protocol.ErrorBody).

Handlers are installed for our own :class:`ApiError`, for Starlette's HTTP errors (unknown
route, wrong method) and for FastAPI's request validation, whose message names each
failing field as a dotted path (``body.config.data``, ``body.rows[2]``, ``query.after``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from opentinker.protocol import ErrorBody

log = logging.getLogger("opentinker.server")


class ApiError(Exception):
    """Raise in a route or dependency to answer ``status`` with ``{"error": message, "detail": detail}``."""

    def __init__(self, status: int, message: str, detail: Any = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.detail = detail
        self.headers = headers


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


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.detail, exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else "HTTP error"
        detail = None if isinstance(exc.detail, str) else exc.detail
        return error_response(exc.status_code, message, detail, getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("%s %s failed", request.method, request.url.path)
        return error_response(500, "internal server error", {"type": type(exc).__name__})

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = list(exc.errors())
        # The offending input can be a whole dataset; the field path and message say enough.
        detail = [{"field": field_path(e.get("loc", ())), "message": e.get("msg"), "type": e.get("type")} for e in errors]
        return error_response(422, validation_message(errors), detail)
