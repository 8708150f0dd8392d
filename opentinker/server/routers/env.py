"""``POST /v1/env/check``: would these interaction specs work on this server, and are their
environment servers reachable from here (not just from the laptop)?

Each spec is built as a job would build it, so its env endpoints pass the operator's
endpoint policy (or the answer says why not, without contacting them). Only then are the
endpoints probed (``GET /health``), each distinct URL once however many interactions name
it, at most ``max_env_check_probes`` of them per check (400 beyond: check fewer at a time),
concurrently on the event loop (async httpx, no thread held), each within
``endpoint_check_timeout_s`` and all within ``env_check_budget_s``. A user runs one check at
a time and the server ``max_concurrent_env_checks`` (429 beyond), so a check against a
tarpit costs its sender a few seconds and nobody else anything.

An interaction that reads its servers' ``/schema`` (OpenEnv: ``check_schema``) and is not
relayed also has its config checked against that schema (an ``action_field`` the env's action
does not have is a problem naming the action's fields), in the same budget.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
from fastapi import APIRouter, Depends, Request

from opentinker.environments.registry import InteractionRegistry, UnknownInteractionError
from opentinker.protocol import EnvCheck, EnvCheckResult
from opentinker.server.auth import current_user
from opentinker.server.deps import get_registry, get_settings
from opentinker.server.errors import AUTHENTICATED_ERRORS, ApiError, error_responses
from opentinker.server.settings import ServerSettings
from opentinker.server.store import User

router = APIRouter(prefix="/env", tags=["environments"], dependencies=[Depends(current_user)], responses=AUTHENTICATED_ERRORS)

PROBE_CONCURRENCY = 16
RETRY_AFTER_S = 5


async def probe(client: httpx.AsyncClient, url: str, timeout_s: float) -> str | None:
    """What is wrong with ``url``'s ``/health``, or None. Says only whether it answered and
    with which status: never what a reply contained."""
    health = url.rstrip("/") + "/health"
    try:
        # Streamed and never read: the status is all we need, and a body may be endless.
        async with client.stream("GET", health, timeout=timeout_s) as reply:
            status = reply.status_code
    except httpx.TimeoutException:
        return f"{health}: no answer within {timeout_s:g} s; is the environment server running?"
    except httpx.HTTPError:
        return f"{health}: unreachable; is the environment server running?"
    return None if 200 <= status < 300 else f"{health}: health check answered HTTP {status}"


async def probe_all(probes: dict[str, list[str]], timeout_s: float, budget_s: float) -> list[str]:
    """``probes``: URL -> the labels of the interactions that use it. Every URL once, all
    within ``budget_s``; the problems, one per label."""
    limit = asyncio.Semaphore(PROBE_CONCURRENCY)
    async with httpx.AsyncClient(trust_env=False, follow_redirects=False) as client:

        async def one(url: str) -> str | None:
            async with limit:
                return await probe(client, url, timeout_s)

        tasks = {url: asyncio.create_task(one(url)) for url in probes}
        _, late = await asyncio.wait(tasks.values(), timeout=budget_s)
        for task in late:
            task.cancel()
        await asyncio.gather(*late, return_exceptions=True)  # their connections closed before the client is
        problems = []
        for url, task in tasks.items():
            if task in late:
                problem = f"{url.rstrip('/')}/health: not answered within this check's budget of {budget_s:g} s"
            else:
                problem = task.result()
            problems.extend(f"{label}: {problem}" for label in probes[url] if problem)
        return problems


async def check_schemas(checks: list[tuple[str, Any]], timeout_s: float, budget_s: float) -> list[str]:
    """``checks``: (label, interaction with ``check_schema``); each checks its config against its
    servers' ``/schema``, all within ``budget_s``; the problems, labelled. Servers that do not
    answer are left to the /health probes to report."""

    async def one(interaction: Any) -> list[str]:
        try:
            return await interaction.check_schema(timeout_s, include_unreachable=False)
        finally:
            await interaction.aclose()

    tasks = [asyncio.create_task(one(interaction)) for _, interaction in checks]
    late: set = set()
    if tasks:
        _, late = await asyncio.wait(tasks, timeout=budget_s)
    for task in late:
        task.cancel()
    await asyncio.gather(*late, return_exceptions=True)
    problems = []
    for (label, _), task in zip(checks, tasks):
        if task in late:
            problems.append(f"{label}: /schema not read within this check's budget of {budget_s:g} s")
        elif task.exception() is not None:
            problems.append(f"{label}: /schema check failed ({type(task.exception()).__name__})")
        else:
            problems.extend(f"{label}: {problem}" for problem in task.result())
    return problems


def build_all(body: EnvCheck, registry: InteractionRegistry, settings: ServerSettings,
              ) -> tuple[list[str], dict[str, list[str]], list[tuple[str, Any]]]:
    """Each spec built as a job would build it: the problems, the endpoints to probe
    (normalised URL -> the labels of the interactions that use it) and the interactions
    whose config is checked against their servers' /schema."""
    problems: list[str] = []
    probes: dict[str, list[str]] = {}
    schema_checks: list[tuple[str, Any]] = []
    context = settings.job_policy.interaction_context(None)
    for i, spec in enumerate(body.interactions):
        label = f"interactions[{i}] ({spec.name!r})"
        try:
            registry.resolve(spec.class_path)
            (interaction,) = registry.build([spec], context=context).values()
        except (UnknownInteractionError, TypeError, ValueError) as exc:
            problems.append(f"{label}: {exc}")
            continue
        if getattr(interaction, "relayed", False):
            continue  # on the user's machine: its client checks it (GenericEnvironment.setup)
        for url in getattr(interaction, "shards", ()):
            probes.setdefault(url, []).append(label)
        if hasattr(interaction, "check_schema"):
            schema_checks.append((label, interaction))
    return problems, probes, schema_checks


@router.post(
    "/check",
    response_model=EnvCheckResult,
    summary="Validate interaction specs and reach their env servers",
    responses=error_responses(400, 429),
)
async def check_env(
    body: EnvCheck,
    request: Request,
    user: User = Depends(current_user),
    registry: InteractionRegistry = Depends(get_registry),
    settings: ServerSettings = Depends(get_settings),
) -> EnvCheckResult:
    # In a thread: checking an endpoint on the server's own port may wait for a DNS lookup.
    problems, probes, schema_checks = await asyncio.to_thread(build_all, body, registry, settings)
    if len(probes) > settings.max_env_check_probes:
        raise ApiError(400, f"interactions: {len(probes)} distinct env endpoints; one check probes at most "
                            f"{settings.max_env_check_probes}: check fewer interactions at a time",
                       {"field": "interactions"})
    if probes:
        running: set[int] = request.app.state.env_checks_by_user
        if user.id in running:
            raise ApiError(429, "you have an env check running already; retry when it has answered",
                           headers={"Retry-After": str(RETRY_AFTER_S)})
        limiter: asyncio.Semaphore = request.app.state.env_check_slots
        if limiter.locked():
            raise ApiError(
                429,
                f"{settings.max_concurrent_env_checks} env checks are already running on this server; retry shortly",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )
        running.add(user.id)
        try:
            async with limiter:
                found = await asyncio.gather(
                    probe_all(probes, settings.endpoint_check_timeout_s, settings.env_check_budget_s),
                    check_schemas(schema_checks, settings.endpoint_check_timeout_s, settings.env_check_budget_s))
                problems.extend(problem for part in found for problem in part)
        finally:
            running.discard(user.id)
    return EnvCheckResult(ok=not problems, allowed_class_paths=registry.allowed_paths(), problems=problems)
