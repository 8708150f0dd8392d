"""FastAPI dependencies shared by the routers: the app's store, settings, job manager and
interaction registry, and the caller's own job (404 for anyone else's)."""

from __future__ import annotations

from pathlib import Path as FilePath

from fastapi import Depends, Path, Request

from opentinker.environments.registry import InteractionRegistry
from opentinker.protocol import JOB_ID_PATTERN
from opentinker.server.audit_hooks import record_denied
from opentinker.server.auth import current_user
from opentinker.server.errors import ApiError, not_found
from opentinker.server.jobs import JobManager
from opentinker.server.settings import ServerSettings
from opentinker.server.store import CheckpointRecord, JobRecord, Store, User


def get_store(request: Request) -> Store:
    return request.app.state.store


def get_settings(request: Request) -> ServerSettings:
    return request.app.state.settings


def get_manager(request: Request) -> JobManager:
    return request.app.state.manager


def get_registry(request: Request) -> InteractionRegistry:
    return request.app.state.registry


def owned_job(
    request: Request,
    job_id: str = Path(description="the id POST /v1/jobs returned", pattern=JOB_ID_PATTERN),
    user: User = Depends(current_user),
    store: Store = Depends(get_store),
) -> JobRecord:
    """The job, if it is the caller's. Another user's job is reported exactly like a
    missing one, so ids cannot be probed; the attempt is an ``access_denied`` audit entry
    about the job's owner (the asker must not learn from their own entries that it exists)."""
    job = store.get_job(job_id, user=user)
    if job is None:
        other = store.get_job(job_id)
        if other is not None:
            record_denied(request, user, other.user_id, resource=f"job:{job_id}", path=request.url.path)
        raise not_found(f"job {job_id!r}")
    return job


def checkpoint_folder(record: CheckpointRecord, settings: ServerSettings) -> FilePath:
    """The checkpoint's model folder; 404 unless it is on the server inside the job's own
    folder (whatever path a runner reported, nothing else is ever read)."""
    folder = FilePath(record.path).resolve()
    if not folder.is_relative_to(settings.job_dir(record.job_id).resolve()) or not folder.is_dir():
        raise ApiError(404, f"checkpoint {record.name!r} of job {record.job_id} is listed but its files are not on the server")
    return folder
