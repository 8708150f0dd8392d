"""``GymEnvironmentInteraction``: an interaction whose turns come from an environment server.

The server speaks a small gym-like HTTP protocol (field names are fixed; existing
servers speak them)::

    POST {url}/reset     {"instance_id", "job_id"?, "seed"?, **env_kwargs, **kwargs}
                         -> {"observation": str, "system_prompt"?: str, "info"?: dict}
    POST {url}/step      {"instance_id", "action": str}
                         -> {"observation": str, "reward": float, "done": bool, "info"?: dict}
    POST {url}/finalize  {"instance_id"}
    GET  {url}/health

``url`` is one base URL, or one of several shards; an instance always goes to the same
shard (a stable hash of its id). Every failure surfaces as
:class:`~opentinker.environments.interaction.EnvironmentServerError`.

Retries: connection errors, timeouts and 5xx answers are retried ``retries`` times with
exponential backoff; 4xx answers and malformed bodies are not. A retried ``/step`` may be
applied twice by a server that processed it but whose answer was lost; the protocol has
no step index to deduplicate on, so keep ``retries`` at 0 for environments where that
matters.
"""

from __future__ import annotations

import asyncio
import logging
import math
import zlib
from dataclasses import dataclass
from typing import Any

import httpx

from opentinker.environments.interaction import (
    EnvironmentServerError,
    InitialObservation,
    Interaction,
    last_assistant_content,
)

__all__ = ["GymEnvironmentInteraction", "check_endpoint", "shard_urls"]

logger = logging.getLogger(__name__)

_MAX_BODY_IN_ERROR = 300


def _join(base: str, path: str) -> str:
    return base.rstrip("/") + "/" + path.lstrip("/")


def _validate_base_url(url: Any, key: str) -> str:
    if not isinstance(url, str) or not url.strip():
        raise ValueError(f"{key} must be a non-empty URL string, got {url!r}")
    url = url.strip().rstrip("/")
    try:
        parsed = httpx.URL(url)
    except Exception as exc:  # httpx.InvalidURL and friends
        raise ValueError(f"{key}: invalid URL {url!r}: {exc}") from exc
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise ValueError(f"{key} must be an http(s) URL with a host, got {url!r}")
    return url


def shard_urls(env_endpoint: str | None, env_shards: Any = None) -> list[str]:
    """The base URLs of all shards.

    ``env_shards`` is None (one server at ``env_endpoint``), a list of base URLs, or an
    int N: N servers on consecutive ports starting at ``env_endpoint``'s port (same
    scheme, host and path).
    """
    if env_shards is None:
        if env_endpoint is None:
            raise ValueError("env_endpoint is required (the environment server's base URL)")
        return [_validate_base_url(env_endpoint, "env_endpoint")]
    if isinstance(env_shards, (list, tuple)):
        if not env_shards:
            raise ValueError("env_shards must not be an empty list")
        urls = [_validate_base_url(u, f"env_shards[{i}]") for i, u in enumerate(env_shards)]
        if len(set(urls)) != len(urls):
            raise ValueError(f"env_shards has duplicate URLs: {urls}")
        return urls
    if isinstance(env_shards, int) and not isinstance(env_shards, bool):
        if env_shards < 1:
            raise ValueError(f"env_shards must be >= 1, got {env_shards}")
        if env_endpoint is None:
            raise ValueError("env_shards as a count needs env_endpoint (the first shard's URL)")
        base = _validate_base_url(env_endpoint, "env_endpoint")
        parsed = httpx.URL(base)
        port = parsed.port or (443 if parsed.scheme == "https" else 80)
        if port + env_shards - 1 > 65535:
            raise ValueError(f"env_shards={env_shards} from port {port} runs past port 65535")
        return [str(parsed.copy_with(port=port + i)).rstrip("/") for i in range(env_shards)]
    raise ValueError(f"env_shards must be a list of URLs or an int, got {type(env_shards).__name__}")


async def check_endpoint(url: str, timeout_s: float = 5.0) -> None:
    """GET ``{url}/health``; raise :class:`EnvironmentServerError` naming the URL unless it answers 2xx."""
    health = _join(url, "health")
    try:
        async with httpx.AsyncClient(timeout=timeout_s, trust_env=False) as client:
            response = await client.get(health)
    except httpx.HTTPError as exc:
        raise EnvironmentServerError(
            health,
            f"unreachable ({type(exc).__name__}: {exc or 'no detail'}); is the environment server running?",
        ) from exc
    if not response.is_success:
        raise EnvironmentServerError(health, f"health check answered HTTP {response.status_code}")


@dataclass
class _Instance:
    url: str
    observation: InitialObservation
    steps: int = 0
    done: bool = False


class _Retryable(Exception):
    pass


class GymEnvironmentInteraction(Interaction):
    """HTTP client of an environment server (see the module docstring for the protocol).

    Config keys:
        env_endpoint: base URL of the server, e.g. ``"http://127.0.0.1:8000"``.
        env_shards: optional list of base URLs, or an int N (N consecutive ports from
            env_endpoint's port).
        max_steps: steps after which the episode ends (done=True, info["truncated"]); 20.
        observation_template: how an observation becomes the next user turn;
            ``"{observation}"``; may use ``{observation}``, ``{reward}``, ``{step}``.
        timeout_s: per-request timeout, 30.
        retries: retries of connection errors / timeouts / 5xx, 2.
        backoff_s: first retry delay (doubles each retry), 0.2.
        env_kwargs: dict merged into every /reset body.
        job_id: sent in /reset unless the interaction kwargs give one.
        max_connections: connection pool size, 256.
        trust_env: honour proxy environment variables, False (env servers are local).
    """

    def __init__(self, config: dict[str, Any]):
        super().__init__(config)
        cfg = self.config
        self.shards: list[str] = shard_urls(cfg.get("env_endpoint"), cfg.get("env_shards"))
        self.max_steps = int(cfg.get("max_steps", 20))
        if self.max_steps < 1:
            raise ValueError(f"max_steps must be >= 1, got {self.max_steps}")
        self.observation_template = str(cfg.get("observation_template", "{observation}"))
        try:
            self.observation_template.format(observation="", reward=0.0, step=0)
        except (KeyError, IndexError, ValueError) as exc:
            raise ValueError(
                f"observation_template {self.observation_template!r} is invalid ({exc!r}); "
                "it may use {observation}, {reward} and {step}"
            ) from exc
        self.timeout_s = float(cfg.get("timeout_s", 30.0))
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")
        self.retries = int(cfg.get("retries", 2))
        if self.retries < 0:
            raise ValueError(f"retries must be >= 0, got {self.retries}")
        self.backoff_s = float(cfg.get("backoff_s", 0.2))
        env_kwargs = cfg.get("env_kwargs") or {}
        if not isinstance(env_kwargs, dict):
            raise ValueError(f"env_kwargs must be a dict, got {type(env_kwargs).__name__}")
        self.env_kwargs: dict[str, Any] = dict(env_kwargs)
        self.job_id: str | None = cfg.get("job_id")
        self.max_connections = int(cfg.get("max_connections", 256))
        self.trust_env = bool(cfg.get("trust_env", False))
        self._instances: dict[str, _Instance] = {}
        self._client: httpx.AsyncClient | None = None
        self._client_loop: asyncio.AbstractEventLoop | None = None

    # HTTP plumbing ---------------------------------------------------------------------

    def _http(self) -> httpx.AsyncClient:
        """The shared client, created on first use in the running event loop.

        A client's pooled connections belong to one event loop; if the interaction is
        used from a new loop, a new client is made (the old loop is gone with its sockets).
        """
        loop = asyncio.get_running_loop()
        if self._client is None or self._client.is_closed or self._client_loop is not loop:
            self._client = httpx.AsyncClient(
                timeout=httpx.Timeout(self.timeout_s),
                limits=httpx.Limits(
                    max_connections=self.max_connections,
                    max_keepalive_connections=min(64, self.max_connections),
                ),
                trust_env=self.trust_env,
            )
            self._client_loop = loop
        return self._client

    async def aclose(self) -> None:
        """Close the HTTP client (the interaction can still be used; a new one is made)."""
        client, self._client, self._client_loop = self._client, None, None
        if client is not None and not client.is_closed:
            await client.aclose()

    async def __aenter__(self) -> GymEnvironmentInteraction:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def shard_for(self, instance_id: str) -> str:
        """The base URL serving ``instance_id``: stable across calls and processes."""
        return self.shards[zlib.crc32(instance_id.encode("utf-8")) % len(self.shards)]

    async def _request_once(self, url: str, body: dict[str, Any]) -> Any:
        try:
            response = await self._http().post(url, json=body)
        except (httpx.UnsupportedProtocol, httpx.InvalidURL) as exc:
            raise EnvironmentServerError(url, f"{type(exc).__name__}: {exc}") from exc
        except httpx.TimeoutException as exc:
            raise _Retryable(f"timed out after {self.timeout_s:g}s ({type(exc).__name__})") from exc
        except httpx.TransportError as exc:
            raise _Retryable(f"{type(exc).__name__}: {exc or 'connection failed'}") from exc
        except httpx.HTTPError as exc:  # e.g. a body that cannot be decoded
            raise EnvironmentServerError(url, f"{type(exc).__name__}: {exc}") from exc
        if response.status_code >= 500:
            raise _Retryable(f"HTTP {response.status_code}: {response.text[:_MAX_BODY_IN_ERROR]}")
        if response.status_code >= 400:
            raise EnvironmentServerError(
                url, f"HTTP {response.status_code}: {response.text[:_MAX_BODY_IN_ERROR]}"
            )
        try:
            return response.json()
        except ValueError as exc:
            raise EnvironmentServerError(
                url, f"invalid JSON in answer: {response.text[:_MAX_BODY_IN_ERROR]!r}"
            ) from exc

    async def _post(self, base: str, path: str, body: dict[str, Any], retries: int | None = None) -> Any:
        url = _join(base, path)
        retries = self.retries if retries is None else retries
        for attempt in range(retries + 1):
            try:
                return await self._request_once(url, body)
            except _Retryable as exc:
                if attempt == retries:
                    tries = f" (after {attempt + 1} attempts)" if attempt else ""
                    raise EnvironmentServerError(url, f"{exc}{tries}") from exc.__cause__
                delay = self.backoff_s * (2**attempt)
                logger.warning("%s failed (%s); retry %d/%d in %.2fs", url, exc, attempt + 1, retries, delay)
                await asyncio.sleep(delay)
        raise AssertionError("unreachable")  # pragma: no cover

    # Interaction API ---------------------------------------------------------------

    async def start_interaction(self, instance_id: str | None = None, **kwargs: Any) -> str:
        """POST /reset on the instance's shard and keep its first observation."""
        instance_id = await super().start_interaction(instance_id)
        base = self.shard_for(instance_id)
        body: dict[str, Any] = {**self.env_kwargs, **kwargs}
        for optional in ("job_id", "seed"):  # left out rather than sent as null
            if optional in body and body[optional] is None:
                del body[optional]
        if "job_id" not in body and self.job_id is not None:
            body["job_id"] = self.job_id
        body["instance_id"] = instance_id
        try:
            data = await self._post(base, "reset", body)
            observation = self._parse_reset(_join(base, "reset"), data)
        except BaseException:
            self._rewards.pop(instance_id, None)
            raise
        self._instances[instance_id] = _Instance(url=base, observation=observation)
        return instance_id

    @staticmethod
    def _parse_reset(url: str, data: Any) -> InitialObservation:
        observation = _observation_of(url, data)
        system_prompt = data.get("system_prompt")
        if system_prompt is not None and not isinstance(system_prompt, str):
            raise EnvironmentServerError(url, f"'system_prompt' must be a string, got {type(system_prompt).__name__}")
        info = data.get("info") or {}
        if not isinstance(info, dict):
            raise EnvironmentServerError(url, f"'info' must be an object, got {type(info).__name__}")
        return InitialObservation(observation=observation, system_prompt=system_prompt, info=info)

    async def initial_observation(self, instance_id: str) -> InitialObservation | None:
        """The observation (and system prompt) the server gave at /reset."""
        return self._instance(instance_id).observation

    def _instance(self, instance_id: str) -> _Instance:
        try:
            return self._instances[instance_id]
        except KeyError:
            raise KeyError(
                f"unknown instance {instance_id!r} of interaction {self.name!r}: "
                "start_interaction was not called or the instance was finalized"
            ) from None

    async def generate_response(
        self, instance_id: str, messages: list[dict[str, str]], **kwargs: Any
    ) -> tuple[bool, str, float, dict[str, Any]]:
        """POST /step with the last assistant message; return the formatted observation."""
        state = self._instance(instance_id)
        if state.done:
            return True, "", 0.0, {"step": state.steps, "already_done": True}
        action = last_assistant_content(messages)
        data = await self._post(state.url, "step", {"instance_id": instance_id, "action": action})
        url = _join(state.url, "step")
        observation, reward, done, info = self._parse_step(url, data)
        state.steps += 1
        self._record_reward(instance_id, reward)  # calculate_score: the sum of the step rewards
        info = dict(info)
        info.setdefault("step", state.steps)
        if not done and state.steps >= self.max_steps:
            done = True
            info["truncated"] = True
        state.done = done
        text = self.observation_template.format(observation=observation, reward=reward, step=state.steps)
        return done, text, reward, info

    @staticmethod
    def _parse_step(url: str, data: Any) -> tuple[str, float, bool, dict[str, Any]]:
        observation = _observation_of(url, data)
        reward = data.get("reward")
        if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
            raise EnvironmentServerError(
                url, f"'reward' must be a finite number, got {_describe(reward, 'reward' in data)}"
            )
        done = data.get("done")
        if not isinstance(done, bool):
            raise EnvironmentServerError(url, f"'done' must be a boolean, got {_describe(done, 'done' in data)}")
        info = data.get("info") or {}
        if not isinstance(info, dict):
            raise EnvironmentServerError(url, f"'info' must be an object, got {type(info).__name__}")
        return observation, float(reward), done, info

    async def finalize_interaction(self, instance_id: str, **kwargs: Any) -> None:
        """Forget the instance and POST /finalize (one attempt; errors are logged, never raised).

        The request is sent even for an instance unknown here (e.g. a /reset whose answer
        was lost), since the shard follows from the id; calling it twice is harmless.
        """
        state = self._instances.pop(instance_id, None)
        await super().finalize_interaction(instance_id)
        base = state.url if state is not None else self.shard_for(instance_id)
        try:
            await self._post(base, "finalize", {"instance_id": instance_id}, retries=0)
        except EnvironmentServerError as exc:
            level = logging.DEBUG if state is None else logging.WARNING
            logger.log(level, "finalize of instance %s failed: %s", instance_id, exc)
        except Exception as exc:  # never raise from cleanup
            logger.warning("finalize of instance %s failed: %r", instance_id, exc)

    async def check_endpoints(self, timeout_s: float = 5.0) -> None:
        """:func:`check_endpoint` on every shard, concurrently."""
        await asyncio.gather(*(check_endpoint(url, timeout_s) for url in self.shards))

    @property
    def active_instances(self) -> int:
        return len(self._instances)


def _observation_of(url: str, data: Any) -> str:
    """The ``observation`` string of a /reset or /step answer, or EnvironmentServerError."""
    if not isinstance(data, dict):
        raise EnvironmentServerError(url, f"expected a JSON object, got {type(data).__name__}")
    observation = data.get("observation")
    if not isinstance(observation, str):
        raise EnvironmentServerError(
            url, f"'observation' must be a string, got {_describe(observation, 'observation' in data)}"
        )
    return observation


def _describe(value: Any, present: bool) -> str:
    return type(value).__name__ if present else "nothing (field missing)"
