"""``POST /v1/env/check``: would these interaction specs work on this server, and are their
environment servers reachable from here (not just from the laptop)?

Each spec is built as a job would build it, so its env endpoints pass the operator's
endpoint policy (or the answer says why not, without contacting them). Only then are the
endpoints probed (``GET /health``): at most ``max_env_shards`` per interaction, a few at a
time, each with a timeout, in worker threads, and at most ``max_concurrent_env_checks``
checks server-wide (429 beyond), so no check can slow other clients down.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import httpx
from fastapi import APIRouter, Depends, Request

from opentinker.environments.registry import InteractionRegistry, UnknownInteractionError
from opentinker.protocol import EnvCheck, EnvCheckResult
from opentinker.server.auth import current_user
from opentinker.server.deps import get_registry, get_settings
from opentinker.server.errors import AUTHENTICATED_ERRORS, ApiError, error_responses
from opentinker.server.settings import ServerSettings

router = APIRouter(prefix="/env", tags=["environments"], dependencies=[Depends(current_user)], responses=AUTHENTICATED_ERRORS)

PROBE_THREADS = 8
RETRY_AFTER_S = 5


def probe(url: str, timeout_s: float) -> str | None:
    """What is wrong with ``url``'s ``/health``, or None. Says only whether it answered and
    with which status: never what a reply contained."""
    health = url.rstrip("/") + "/health"
    try:
        with httpx.Client(timeout=timeout_s, trust_env=False, follow_redirects=False) as client:
            status = client.get(health).status_code
    except httpx.TimeoutException:
        return f"{health}: no answer within {timeout_s:g} s; is the environment server running?"
    except httpx.HTTPError:
        return f"{health}: unreachable; is the environment server running?"
    return None if 200 <= status < 300 else f"{health}: health check answered HTTP {status}"


def probe_all(probes: list[tuple[str, str]], timeout_s: float) -> list[str]:
    with ThreadPoolExecutor(max_workers=min(PROBE_THREADS, len(probes)) or 1) as pool:
        results = pool.map(lambda item: probe(item[1], timeout_s), probes)
        return [f"{label}: {problem}" for (label, _), problem in zip(probes, results) if problem]


@router.post(
    "/check",
    response_model=EnvCheckResult,
    summary="Validate interaction specs and reach their env servers",
    responses=error_responses(429),
)
async def check_env(
    body: EnvCheck,
    request: Request,
    registry: InteractionRegistry = Depends(get_registry),
    settings: ServerSettings = Depends(get_settings),
) -> EnvCheckResult:
    problems: list[str] = []
    probes: list[tuple[str, str]] = []
    context = settings.job_policy.interaction_context(None)
    for i, spec in enumerate(body.interactions):
        label = f"interactions[{i}] ({spec.name!r})"
        try:
            registry.resolve(spec.class_path)
            (interaction,) = registry.build([spec], context=context).values()
        except (UnknownInteractionError, TypeError, ValueError) as exc:
            problems.append(f"{label}: {exc}")
            continue
        probes.extend((label, url) for url in getattr(interaction, "shards", ()))
    if probes:
        limiter: asyncio.Semaphore = request.app.state.env_check_slots
        if limiter.locked():
            raise ApiError(
                429,
                f"{settings.max_concurrent_env_checks} env checks are already running on this server; retry shortly",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )
        async with limiter:
            problems.extend(await asyncio.to_thread(probe_all, probes, settings.endpoint_check_timeout_s))
    return EnvCheckResult(ok=not problems, allowed_class_paths=registry.allowed_paths(), problems=problems)
