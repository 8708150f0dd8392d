"""ASGI middleware: limits on request bodies, answered as ErrorBody JSON before any route
decodes the body.

- Size: 413 past ``max_bytes``, whether or not the client sends ``Content-Length``: a
  declared length over the limit is refused before anything is read, and a streamed
  (chunked) body is counted as it arrives. The server never holds more than the limit of one
  request's body. (FastAPI's own ``max_body_size`` answers a declared length in plain text,
  outside the API's error shape, hence this.)
- Nesting: 400 when arrays and objects nest deeper than ``max_depth`` (``MAX_JSON_DEPTH``,
  32), counted as the body arrives (:class:`JsonDepth`). A body nested a few thousand levels
  deep makes ``json.loads`` raise RecursionError wherever a route decodes it, and JSON Schema
  cannot state a depth, so it is a 400 (what the OpenAPI document cannot say), checked here
  once for every route of both APIs, the Tinker routes this server does not offer included.
  Only protobuf bodies (``forward_backward``) are not JSON and not counted.

Past either limit reading fails (so the route never runs on a cut-off body) and whatever
error that produces is answered as the refusal instead.
"""

from __future__ import annotations

from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from opentinker.json_limits import JsonDepth
from opentinker.protocol import MAX_JSON_DEPTH
from opentinker.server.errors import error_response

_NOT_JSON = {b"application/x-protobuf"}  # forward_backward's body: binary, never decoded as JSON


class _Refused(Exception):
    """Raised from ``receive`` once a body passes a limit."""


class BodyLimits:
    def __init__(self, app: ASGIApp, max_bytes: int, max_depth: int = MAX_JSON_DEPTH):
        self.app = app
        self.max_bytes = max_bytes
        self.max_depth = max_depth

    def _too_large(self, declared: int | None = None) -> Response:
        size = f" ({declared} bytes)" if declared is not None else ""
        return error_response(
            413, f"request body too large{size}: this server accepts at most {self.max_bytes} bytes",
            {"max_body_bytes": self.max_bytes},
        )

    def _too_deep(self) -> Response:
        return error_response(
            400, f"request body: arrays and objects nested deeper than {self.max_depth} levels; this server "
                 f"accepts at most {self.max_depth}", {"max_depth": self.max_depth},
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers", ()))
        declared = headers.get(b"content-length")
        if declared is not None:
            try:
                length = int(declared)
            except ValueError:
                await error_response(400, "header Content-Length: not a number")(scope, receive, send)
                return
            if length > self.max_bytes:
                await self._too_large(length)(scope, receive, send)
                return
        media_type = headers.get(b"content-type", b"").split(b";", 1)[0].strip().lower()
        depth = None if media_type in _NOT_JSON else JsonDepth()
        received = 0
        refusal: Response | None = None

        async def checking_receive() -> Message:
            nonlocal received, refusal
            message = await receive()
            if message["type"] == "http.request":
                body = message.get("body", b"")
                received += len(body)
                if received > self.max_bytes:
                    refusal = self._too_large()
                elif depth is not None and depth.feed(body) > self.max_depth:
                    refusal = self._too_deep()
                if refusal is not None:
                    raise _Refused
            return message

        refused = False

        async def replacing_send(message: Message) -> None:
            nonlocal refused
            if refusal is None:
                await send(message)
            elif not refused:  # the failed read became some error answer: make it the refusal
                refused = True
                await refusal(scope, receive, send)

        try:
            await self.app(scope, checking_receive, replacing_send)
        except _Refused:
            if not refused:
                await refusal(scope, receive, send)
