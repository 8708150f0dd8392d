"""The Tinker API's own OpenAPI document (``GET /api/v1/openapi.json``, public).

The main document (``/openapi.json``) is the OpenTinker API's; the Tinker routes are left out
of it and described here, each with every status it answers and the bounds of its fields.
``forward_backward`` takes a protobuf body (binary); ``retrieve_future`` answers JSON or
protobuf. Routes the SDK knows but this server does not offer are not in it.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from typing import Any

from fastapi.openapi.utils import get_openapi
from fastapi.routing import APIRoute

from opentinker.protocol import ErrorBody

PROTOBUF = "application/x-protobuf"
_DESCRIPTIONS = {
    400: "refused as asked (the message says why and what to change); the SDK does not retry it",
    401: "missing, invalid or revoked API key (X-API-Key: tml-<key>)",
    403: "another user's published checkpoint: you may read it, not change or delete it",
    404: "no such session, model, future, sampler or checkpoint among the caller's own",
    410: "the session has ended (the SDK's heartbeat stops)",
    413: "the request body is larger than the server accepts",
    422: "invalid request: the message names the field",
    429: "over a limit that frees up by itself; retry after Retry-After seconds (the SDK does)",
}
#: What every route with a key can answer.
COMMON_ERRORS = (401, 413, 422, 429)  # 429: too many wrong keys from the client's address


def errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """``responses=`` entries for these statuses, all with the ``{"error", "detail"}`` shape."""
    return {status: {"model": ErrorBody, "description": _DESCRIPTIONS[status]} for status in statuses}


def binary_body() -> dict[str, Any]:
    """``openapi_extra`` of a route whose body is a protobuf message."""
    return {"requestBody": {"required": True, "content": {PROTOBUF: {"schema": {"type": "string", "format": "binary"}}}}}


#: ``responses=`` of retrieve_future's 200: a JSON result or state, or a protobuf result.
FUTURE_RESULT = {200: {"description": "the result (JSON, or protobuf for samples and forward/backward), "
                                      "try_again, or {error, category}",
                       "content": {"application/json": {"schema": {"type": "object"}},
                                   PROTOBUF: {"schema": {"type": "string", "format": "binary"}}}}}


def document(routes: Iterable[Any], version: str) -> dict[str, Any]:
    """The OpenAPI document of ``routes`` (``routes.api_routes()``: plain ``APIRoute``s, which
    every FastAPI version's ``get_openapi`` reads; they are hidden from the main document)."""
    shown = []
    for route in routes:
        if not isinstance(route, APIRoute):  # never dropped silently: the document would miss it
            raise TypeError(f"the Tinker OpenAPI document is made of APIRoutes, got {route!r}")
        if not getattr(route.endpoint, "undocumented", False):
            route = copy.copy(route)
            route.include_in_schema = True
            shown.append(route)
    return get_openapi(
        title="OpenTinker: the Tinker API", version=version, routes=shown,
        description="The Tinker API as the official tinker SDK (0.38.0) speaks it. Every route but healthz (and "
                    "this document) needs `X-API-Key: tml-<key>`. Errors at submit are `{\"error\", \"detail\"}` "
                    "with a 4xx status; failures later are futures answering `{\"error\", \"category\"}`.")
