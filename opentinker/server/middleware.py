"""ASGI middleware: a limit on request bodies (413 past ``max_body_bytes``, as ErrorBody JSON).

The limit holds whether or not the client sends ``Content-Length``: a declared length over
the limit is refused before anything is read, and a streamed (chunked) body is counted as
it arrives: past the limit reading fails (so the route never runs on a cut-off body) and
whatever error that produces is answered as the 413 instead. The server never holds more than the limit of
one request's body. (FastAPI's own ``max_body_size`` answers a declared length in plain
text, outside the API's error shape, hence this.)
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from opentinker.server.errors import error_response


class _TooLarge(Exception):
    """Raised from ``receive`` once a streamed body passes the limit."""


class BodySizeLimit:
    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    def _refusal(self, declared: int | None = None):
        size = f" ({declared} bytes)" if declared is not None else ""
        return error_response(
            413, f"request body too large{size}: this server accepts at most {self.max_bytes} bytes",
            {"max_body_bytes": self.max_bytes},
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers", ())).get(b"content-length")
        if declared is not None:
            try:
                length = int(declared)
            except ValueError:
                await error_response(400, "header Content-Length: not a number")(scope, receive, send)
                return
            if length > self.max_bytes:
                await self._refusal(length)(scope, receive, send)
                return
        received = 0
        too_large = False

        async def counting_receive() -> Message:
            nonlocal received, too_large
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    too_large = True
                    raise _TooLarge
            return message

        refused = False

        async def replacing_send(message: Message) -> None:
            nonlocal refused
            if not too_large:
                await send(message)
            elif not refused:  # the failed read became some error answer: make it the 413
                refused = True
                await self._refusal()(scope, receive, send)

        try:
            await self.app(scope, counting_receive, replacing_send)
        except _TooLarge:
            if not refused:
                await self._refusal()(scope, receive, send)
