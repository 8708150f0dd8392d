"""Where an env interaction's calls go: its servers (``shard_urls``: one URL, a list, or N on
consecutive ports; each checked against the operator's endpoint policy) and the route the
calls take (``env_route``: direct from this process, or carried by the job's client relay),
with the ``/health`` probe by that route. Shared by the gym and OpenEnv interactions
(:class:`RoutedEnvServers`)."""

from __future__ import annotations

import zlib
from typing import TYPE_CHECKING, Any

from opentinker.environments.endpoints import EndpointPolicy, normalise_endpoint
from opentinker.environments.env_replies import UNAVAILABLE_STATUSES, join_url
from opentinker.environments.interaction import EnvironmentServerError, InteractionContext
from opentinker.environments.relay import RelayTransport, relay_mode
from opentinker.environments.transport import BadAnswer, NoAnswer

if TYPE_CHECKING:
    from opentinker.environments.transport import EnvTransport

__all__ = ["RoutedEnvServers", "check_endpoint", "env_route", "probe_health", "shard_urls"]


def _check_shard_count(count: int, max_shards: int | None) -> None:
    if max_shards is not None and count > max_shards:
        raise ValueError(f"env_shards: at most {max_shards} env servers per interaction on this server, got {count}")


def shard_urls(
    env_endpoint: str | None,
    env_shards: Any = None,
    *,
    max_shards: int | None = None,
    policy: EndpointPolicy | None = None,
) -> list[str]:
    """The normalised base URLs (``scheme://host:port``) of all shards.

    ``env_shards`` is None (one server at ``env_endpoint``), a list of base URLs, or an
    int N: N servers on consecutive ports starting at ``env_endpoint``'s port (same scheme
    and host). ``max_shards`` bounds the number of shards; with ``policy`` every URL must
    pass ``policy.check`` (the error names the field: ``env_endpoint``, ``env_shards[2]``).
    Raises ValueError (:class:`~opentinker.environments.endpoints.EndpointError` for a bad URL).
    """
    check = policy.check if policy is not None else normalise_endpoint
    if env_shards is None:
        if env_endpoint is None:
            raise ValueError("env_endpoint is required (the environment server's base URL)")
        return [check(env_endpoint, "env_endpoint")]
    if isinstance(env_shards, (list, tuple)):
        if not env_shards:
            raise ValueError("env_shards must not be an empty list")
        _check_shard_count(len(env_shards), max_shards)
        urls = [check(u, f"env_shards[{i}]") for i, u in enumerate(env_shards)]
        if len(set(urls)) != len(urls):
            raise ValueError(f"env_shards has duplicate URLs: {urls}")
        return urls
    if isinstance(env_shards, int) and not isinstance(env_shards, bool):
        if env_shards < 1:
            raise ValueError(f"env_shards must be >= 1, got {env_shards}")
        _check_shard_count(env_shards, max_shards)
        if env_endpoint is None:
            raise ValueError("env_shards as a count needs env_endpoint (the first shard's URL)")
        prefix, port = normalise_endpoint(env_endpoint, "env_endpoint").rsplit(":", 1)  # the port is explicit
        first = int(port)
        if first + env_shards - 1 > 65535:
            raise ValueError(f"env_shards={env_shards} from port {first} runs past port 65535")
        return [
            check(f"{prefix}:{first + i}", "env_endpoint" if i == 0 else f"env_shards[{i}]")
            for i in range(env_shards)
        ]
    raise ValueError(f"env_shards must be a list of URLs or an int, got {type(env_shards).__name__}")


async def check_endpoint(url: str, timeout_s: float = 5.0) -> None:
    """GET ``{url}/health`` from this process; raise :class:`EnvironmentServerError` naming the
    URL unless it answers 2xx."""
    from opentinker.environments.env_http import DirectTransport  # aiohttp: the trainer's side only

    transport = DirectTransport(timeout_s, 1)
    try:
        await probe_health(transport, url, timeout_s)
    finally:
        await transport.aclose()


def env_route(config: dict[str, Any], context: InteractionContext, *, timeout_s: float,
              max_connections: int) -> tuple[list[str], EnvTransport]:
    """An env interaction's servers (normalised base URLs) and the route its calls take.

    Direct (the default): every URL must pass the operator's endpoint policy, and the calls
    go out from this process. ``"relay": "client"``: the URLs are the user's own (on the
    machine of the job's client, which carries the calls), so no policy applies to them; the
    server must allow relays (``context.relay_refusal``).
    """
    relayed = relay_mode(config.get("relay"))
    if relayed and context.relay_refusal is not None:
        raise ValueError(f"relay: {context.relay_refusal}")
    shards = shard_urls(config.get("env_endpoint"), config.get("env_shards"), max_shards=context.max_env_shards,
                        policy=None if relayed else context.endpoint_policy)
    if relayed:
        return shards, RelayTransport(context.relay, str(config.get("name", "")), shards)
    from opentinker.environments.env_http import DirectTransport  # aiohttp: the trainer's side only

    return shards, DirectTransport(timeout_s, max_connections)


async def probe_health(transport: EnvTransport, base: str, timeout_s: float) -> None:
    """``GET {base}/health`` over ``transport``: EnvironmentServerError naming the URL unless it answers 2xx."""
    health = join_url(transport.describe(base), "health")
    try:
        answer = await transport.request("GET", base, "health", timeout_s)
    except (NoAnswer, BadAnswer, ValueError) as exc:
        raise EnvironmentServerError(
            health, f"unreachable ({exc or 'no detail'}); is the environment server running?",
            unreachable=isinstance(exc, NoAnswer),
        ) from exc
    if not 200 <= answer.status < 300:
        raise EnvironmentServerError(health, f"health check answered HTTP {answer.status}",
                                     unreachable=answer.status in UNAVAILABLE_STATUSES)


class RoutedEnvServers:
    """The env servers an interaction talks to (``shards``) and the route its calls take
    (``_transport``), both from :func:`env_route`: which server an instance uses, what errors
    call it, and its ``/health`` by that route (what the trainer's outage rule probes)."""

    shards: list[str]
    _transport: EnvTransport

    @property
    def relayed(self) -> bool:
        """Whether the job's client carries the calls (``relay: client``)."""
        return isinstance(self._transport, RelayTransport)

    @property
    def relay_hub(self) -> Any:
        """The job's :class:`~opentinker.environments.relay.RelayHub` carrying the calls (None: direct)."""
        return self._transport.hub if isinstance(self._transport, RelayTransport) else None

    def shard_for(self, instance_id: str) -> str:
        """The base URL serving ``instance_id``: stable across calls and processes."""
        return self.shards[zlib.crc32(instance_id.encode("utf-8")) % len(self.shards)]

    def endpoint_for(self, instance_id: str) -> str:
        return self._transport.describe(self.shard_for(instance_id))

    def endpoints(self) -> dict[str, str]:
        """``{what errors call a server: its base URL}`` for every shard."""
        return {self._transport.describe(url): url for url in self.shards}

    async def check_health(self, endpoint: str, timeout_s: float) -> None:
        """``GET /health`` of the server that errors call ``endpoint``, by this interaction's route."""
        await probe_health(self._transport, self.endpoints()[endpoint], timeout_s)
