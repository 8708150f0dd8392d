"""``POST /v1/env/check``: would these interaction specs work on this server, and are their
environment servers reachable from here (not just from the laptop)?"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Depends

from opentinker.environments.gym_interaction import check_endpoint, shard_urls
from opentinker.environments.registry import InteractionRegistry, UnknownInteractionError
from opentinker.protocol import EnvCheck, EnvCheckResult
from opentinker.server.auth import current_user
from opentinker.server.deps import get_registry, get_settings
from opentinker.server.settings import ServerSettings

router = APIRouter(prefix="/env", tags=["environments"], dependencies=[Depends(current_user)])


async def _endpoint_problem(label: str, url: str, timeout_s: float) -> str | None:
    try:
        await check_endpoint(url, timeout_s=timeout_s)
    except Exception as exc:  # EnvironmentServerError names the URL; anything else, we do
        text = str(exc)
        return f"{label}: {text}" if url in text else f"{label}: {url}: {text}"
    return None


@router.post("/check", response_model=EnvCheckResult, summary="Validate interaction specs and reach their env servers")
async def check_env(
    body: EnvCheck,
    registry: InteractionRegistry = Depends(get_registry),
    settings: ServerSettings = Depends(get_settings),
) -> EnvCheckResult:
    problems: list[str] = []
    probes: list[tuple[str, str]] = []
    for i, spec in enumerate(body.interactions):
        label = f"interactions[{i}] ({spec.name!r})"
        try:
            registry.resolve(spec.class_path)
        except (UnknownInteractionError, TypeError) as exc:
            problems.append(f"{label}: {exc}")
        config = spec.config
        if config.get("env_endpoint") is None and config.get("env_shards") is None:
            continue
        try:
            urls = shard_urls(config.get("env_endpoint"), config.get("env_shards"))
        except ValueError as exc:
            problems.append(f"{label}: {exc}")
            continue
        probes.extend((label, url) for url in urls)
    results = await asyncio.gather(*(_endpoint_problem(label, url, settings.endpoint_check_timeout_s) for label, url in probes))
    problems.extend(p for p in results if p is not None)
    return EnvCheckResult(ok=not problems, allowed_class_paths=registry.allowed_paths(), problems=problems)
