"""What a client relay may carry, decided on the user's machine from the user's own specs.

Each relayed interaction (``"relay": "client"``) becomes a :class:`Route`: its protocol (the
gym HTTP protocol, or OpenEnv's) and its endpoints (``env_endpoint`` / ``env_shards``), so a call
names an interaction and a shard, never a URL. The protocols' calls are listed here: what the
relay forwards, and nothing else. The specs are also kept on disk (:func:`remember`), so that a
new client process (``job.attach()``, ``opentinker jobs logs -f``) can carry the calls of a job
an earlier one started: never the server's copy (a server must not choose where a client connects).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import httpx

from opentinker.environments.registry import InteractionSpec
from opentinker.environments.relay import relay_mode
from opentinker.json_limits import MAX_ENV_JSON_DEPTH, loads_bounded

if TYPE_CHECKING:
    from opentinker.client.client import OpenTinkerClient

__all__ = ["GYM", "HTTP_CALLS", "OPENENV", "SESSION_MESSAGES", "SESSION_PATHS", "Route", "forget", "local_problems",
           "recall", "relayed_specs", "remember", "routes"]

GYM = "gym"
OPENENV = "openenv"
_PROTOCOLS = {
    "gym": GYM, "GymEnvironmentInteraction": GYM, "verl.interactions.gym_environment_interaction.GymEnvironmentInteraction": GYM,
    "opentinker.environments.gym_interaction.GymEnvironmentInteraction": GYM,
    "openenv": OPENENV, "opentinker.environments.openenv_interaction.OpenEnvInteraction": OPENENV,
}
#: The (method, path) of each protocol's HTTP calls, its WebSocket session paths and session messages.
HTTP_CALLS = {GYM: {("POST", "reset"), ("POST", "step"), ("POST", "finalize"), ("GET", "health")},
              OPENENV: {("GET", "health"), ("GET", "schema")}}
SESSION_PATHS = {OPENENV: {"ws"}}
SESSION_MESSAGES = {"reset", "step", "state", "close"}


@dataclass(frozen=True)
class Route:
    protocol: str
    shards: tuple[str, ...]


def _shards(spec: InteractionSpec) -> tuple[str, ...]:
    from opentinker.environments.env_routing import shard_urls

    return tuple(shard_urls(spec.config.get("env_endpoint"), spec.config.get("env_shards")))


def relayed_specs(specs: Sequence[InteractionSpec]) -> list[InteractionSpec]:
    """The specs with ``relay: client`` (ValueError for one whose protocol cannot be relayed)."""
    relayed = []
    for spec in specs:
        if not relay_mode(spec.config.get("relay")):
            continue
        if spec.class_path not in _PROTOCOLS:
            raise ValueError(f"interaction {spec.name!r}: relay: client carries the gym protocol ('gym') and OpenEnv "
                             f"('openenv'), not {spec.class_path!r}")
        _shards(spec)  # a malformed endpoint is an error now, not at the first call
        relayed.append(spec)
    return relayed


def routes(specs: Sequence[InteractionSpec]) -> dict[str, Route]:
    """The route of each relayed interaction of ``specs``, by its name."""
    return {spec.name: Route(_PROTOCOLS[spec.class_path], _shards(spec)) for spec in relayed_specs(specs)}


def local_problems(specs: Sequence[InteractionSpec], timeout_s: float = 3.0) -> list[str]:
    """What is wrong with the relayed envs of ``specs``, checked from this machine (where the relay
    will call them): each endpoint's ``GET /health`` must answer 2xx, and an OpenEnv server's
    ``/schema`` must fit the interaction's ``action_field`` (as the server checks a direct one)."""
    from opentinker.environments.openenv_schema import action_field_for

    problems = []
    by_name = {spec.name: spec for spec in specs}
    with httpx.Client(trust_env=False, follow_redirects=False, timeout=timeout_s) as http:
        for name, route in routes(specs).items():
            for base in route.shards:
                label = f"interaction {name!r} (relay: client): {base}"
                try:
                    status = http.get(f"{base}/health").status_code
                    if not 200 <= status < 300:
                        problems.append(f"{label}/health answered HTTP {status}")
                        continue
                    if route.protocol == OPENENV:
                        config = by_name[name].config
                        schema = loads_bounded(http.get(f"{base}/schema").content, MAX_ENV_JSON_DEPTH)
                        action_field_for(schema, config.get("action_field"),
                                         config.get("action_extra"))
                except httpx.HTTPError as exc:
                    problems.append(f"{label} does not answer on this machine ({type(exc).__name__}); is the "
                                    "environment server running?")
                except ValueError as exc:  # the schema does not fit, is not JSON, or nests too deep
                    problems.append(f"{label}/schema: {exc}")
    return problems


def _state_dir() -> Path:
    configured = os.environ.get("OPENTINKER_STATE_DIR", "").strip()
    if configured:
        return Path(configured).expanduser()
    base = os.environ.get("XDG_STATE_HOME", "").strip() or "~/.local/state"
    return Path(base).expanduser() / "opentinker"


def _record_path(client: OpenTinkerClient, job_id: str) -> Path:
    server = hashlib.sha256(client.base_url.encode()).hexdigest()[:16]
    safe = "".join(c for c in job_id if c.isalnum() or c in "-_")[:128] or "job"
    return _state_dir() / "relays" / server / f"{safe}.json"


def remember(client: OpenTinkerClient, job_id: str, specs: Sequence[InteractionSpec]) -> Path | None:
    """Keep the job's relayed specs on this machine (mode 0600), for a later :func:`recall`."""
    relayed = relayed_specs(specs)
    if not relayed:
        return None
    path = _record_path(client, job_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = json.dumps({"server": client.base_url, "job_id": job_id,
                       "interactions": [s.model_dump(mode="json") for s in relayed]}, indent=1)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as out:
        out.write(data)
    return path


def recall(client: OpenTinkerClient, job_id: str) -> list[InteractionSpec]:
    """The relayed specs this machine kept for the job (empty when it kept none)."""
    path = _record_path(client, job_id)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return []
    if data.get("server") != client.base_url or data.get("job_id") != job_id:
        return []
    return [InteractionSpec.model_validate(s) for s in data.get("interactions") or ()]


def forget(client: OpenTinkerClient, job_id: str) -> None:
    with contextlib.suppress(OSError):
        _record_path(client, job_id).unlink()
