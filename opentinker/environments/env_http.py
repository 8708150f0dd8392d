"""The HTTP calls of :class:`~.gym_interaction.GymEnvironmentInteraction`, on aiohttp.

Why aiohttp and not httpx (the client package's library): an agent-loop step sends three calls
per episode (reset, step, finalize), all of a step's episodes at once, and httpx's connection
pool does work proportional to its connections times its waiting requests for every request
it hands out. ``benchmarks/env_calls.py`` (128 episodes against a local env server, 2 cores):
384 calls cost 1.55 s of client CPU through httpx, 0.21 s through this module. Only the
trainer's side imports it; the thin client does not need aiohttp.

Every call ends in an :class:`Answer` (any status) or one of two errors: :class:`NoAnswer`
(the connection failed or broke, or a timeout passed: worth a retry) and :class:`BadAnswer`
(an answer that cannot be used: too large, or not HTTP). A URL aiohttp cannot send to is a
ValueError. Redirects are never followed and proxy settings never read from the environment.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any

import aiohttp

#: The largest answer body read from an env server; a larger one is a :class:`BadAnswer`.
MAX_ANSWER_BYTES = 16 << 20


@dataclass(frozen=True)
class Answer:
    status: int
    content_type: str
    body: bytes

    def json(self) -> Any:
        """The body as JSON (ValueError when it is not)."""
        return json.loads(self.body)


class NoAnswer(Exception):
    """No answer came: the connection failed or broke, or ``timeout_s`` passed."""


class BadAnswer(Exception):
    """An answer came that cannot be used (larger than :data:`MAX_ANSWER_BYTES`, not HTTP)."""


def new_session(timeout_s: float, max_connections: int) -> aiohttp.ClientSession:
    """A session (call it in the event loop that will use it) with at most ``max_connections``
    open connections; ``timeout_s`` bounds each phase of a call (waiting for a connection,
    connecting, each read), as httpx's timeouts do."""
    timeout = aiohttp.ClientTimeout(total=None, connect=timeout_s, sock_connect=timeout_s, sock_read=timeout_s)
    # Idle connections are dropped after 4 s, before uvicorn's 5 s keep-alive closes them at the
    # other end: a request sent on a connection the server is closing would fail.
    connector = aiohttp.TCPConnector(limit=max_connections, keepalive_timeout=4.0)
    return aiohttp.ClientSession(connector=connector, timeout=timeout, trust_env=False)


async def forget(session: aiohttp.ClientSession) -> None:
    """Drop a session made in an event loop that is gone (its sockets cannot be closed in it),
    without "unclosed session" warnings."""
    connector = session.connector
    session.detach()
    if connector is not None:
        await connector.close()


async def request(session: aiohttp.ClientSession, method: str, url: str, timeout_s: float,
                  body: Any = None) -> Answer:
    """``method url`` with ``body`` as JSON (when given); see the module docstring for what it raises."""
    try:
        async with session.request(method, url, json=body, allow_redirects=False) as response:
            chunks, size = [], 0
            async for chunk in response.content.iter_any():
                size += len(chunk)
                if size > MAX_ANSWER_BYTES:
                    raise BadAnswer(f"answer larger than {MAX_ANSWER_BYTES} bytes (HTTP {response.status})")
                chunks.append(chunk)
            return Answer(response.status, response.headers.get("Content-Type", ""), b"".join(chunks))
    except aiohttp.InvalidURL as exc:
        raise ValueError(f"invalid URL ({exc})") from exc
    except (asyncio.TimeoutError, TimeoutError) as exc:  # aiohttp's own timeouts subclass it
        raise NoAnswer(f"timed out after {timeout_s:g}s ({type(exc).__name__})") from exc
    except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as exc:
        raise NoAnswer(f"{type(exc).__name__}: {exc or 'connection failed'}") from exc
    except aiohttp.ClientError as exc:
        raise BadAnswer(f"{type(exc).__name__}: {exc}") from exc
