"""How an interaction's calls reach its environment server: the contract every route keeps.

Two routes exist. :class:`~opentinker.environments.env_http.DirectTransport` sends the calls
from the trainer's own process (aiohttp). :class:`~opentinker.environments.relay.RelayTransport`
hands them to the job's client relay, which the user's thin client holds open to the server
and which forwards them to the env on the user's machine (the server never connects there).
An interaction names an env server by its base URL and a protocol path (``"step"``, ``"ws"``);
the route decides where that goes.

Every call ends in an :class:`Answer` (any status) or one of two errors: :class:`NoAnswer`
(the server could not be reached, the connection broke, or the time ran out: worth a retry,
and an outage when it lasts) and :class:`BadAnswer` (something came that cannot be used: too
large, not JSON where JSON is due, JSON nested deeper than ``MAX_ENV_JSON_DEPTH``). A session (:class:`EnvSession`) is one WebSocket
connection: one JSON message out, one JSON message back.

Pure Python, no aiohttp: the relay and the thin client import it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from opentinker.json_limits import MAX_ENV_JSON_DEPTH, loads_bounded

__all__ = ["MAX_ANSWER_BYTES", "Answer", "BadAnswer", "EnvSession", "EnvTransport", "NoAnswer"]

#: The largest answer (HTTP body or WebSocket message) taken from an env server, on every route.
MAX_ANSWER_BYTES = 16 << 20


@dataclass(frozen=True)
class Answer:
    status: int
    content_type: str
    body: bytes

    def json(self) -> Any:
        """The body as JSON: ValueError when it is not, :class:`~opentinker.json_limits.JsonTooDeep`
        (a ValueError) when it nests deeper than an env answer may."""
        return loads_bounded(self.body, MAX_ENV_JSON_DEPTH)


class NoAnswer(Exception):
    """No answer came: the connection failed or broke, or the time ran out."""


class BadAnswer(Exception):
    """An answer came that cannot be used (larger than :data:`MAX_ANSWER_BYTES`, not JSON)."""


class EnvSession(Protocol):
    """One open WebSocket session with an env server (OpenEnv's ``/ws``)."""

    async def exchange(self, message: dict[str, Any], timeout_s: float) -> Any:
        """Send ``message`` as JSON and return the next message, parsed."""

    async def close(self) -> None:
        """Close the session (never raises)."""


class EnvTransport(Protocol):
    """A route to env servers; every method is called in the interaction's event loop."""

    def describe(self, base: str) -> str:
        """What errors and outage messages call the server at ``base``."""

    async def request(self, method: str, base: str, path: str, timeout_s: float, body: Any = None) -> Answer:
        """``method {base}/{path}`` with ``body`` as JSON (when given)."""

    async def open_session(self, base: str, path: str, timeout_s: float) -> EnvSession:
        """A WebSocket session with ``{base}/{path}`` (``http`` becomes ``ws``)."""

    async def aclose(self) -> None:
        """Release connections; the transport may be used again afterwards."""
