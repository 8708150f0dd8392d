"""FastAPI dependencies shared by the routers: the app's store, settings, job manager and
interaction registry, and the caller's own job (404 for anyone else's)."""

from __future__ import annotations

from fastapi import Depends, Path, Request

from opentinker.environments.registry import InteractionRegistry
from opentinker.protocol import JOB_ID_PATTERN
from opentinker.server.auth import current_user
from opentinker.server.errors import not_found
from opentinker.server.jobs import JobManager
from opentinker.server.settings import ServerSettings
from opentinker.server.store import JobRecord, Store, User


def get_store(request: Request) -> Store:
    return request.app.state.store


def get_settings(request: Request) -> ServerSettings:
    return request.app.state.settings


def get_manager(request: Request) -> JobManager:
    return request.app.state.manager


def get_registry(request: Request) -> InteractionRegistry:
    return request.app.state.registry


def owned_job(
    job_id: str = Path(description="the id POST /v1/jobs returned", pattern=JOB_ID_PATTERN),
    user: User = Depends(current_user),
    store: Store = Depends(get_store),
) -> JobRecord:
    """The job, if it is the caller's. Another user's job is reported exactly like a
    missing one, so ids cannot be probed."""
    job = store.get_job(job_id, user=user)
    if job is None:
        raise not_found(f"job {job_id!r}")
    return job
