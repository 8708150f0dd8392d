"""``/v1/jobs/{id}/checkpoints``: list, request one, download one as ``.tar.gz``."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Path, Request
from fastapi.responses import StreamingResponse
from ray.exceptions import RayActorError, RayTaskError

from opentinker.protocol import CHECKPOINT_NAME_PATTERN, CheckpointList
from opentinker.server.archive import iter_tar_gz
from opentinker.server.auth import current_user
from opentinker.server.deps import checkpoint_folder, get_manager, get_settings, get_store, owned_job
from opentinker.server.errors import AUTHENTICATED_ERRORS, ApiError, error_responses, not_found
from opentinker.server.jobs import JobManager, JobNotActiveError, RunnerBusyError
from opentinker.server.settings import ServerSettings
from opentinker.server.store import JobRecord, Store, User

router = APIRouter(
    prefix="/jobs", tags=["checkpoints"], dependencies=[Depends(current_user)],
    responses={**AUTHENTICATED_ERRORS, **error_responses(404)},
)


@router.get("/{job_id}/checkpoints", response_model=CheckpointList, summary="The job's saved checkpoints")
async def list_checkpoints(job: JobRecord = Depends(owned_job), store: Store = Depends(get_store)) -> CheckpointList:
    return CheckpointList(checkpoints=[c.info() for c in store.list_checkpoints(job.job_id)])


@router.post(
    "/{job_id}/checkpoints", status_code=202, summary="Save a checkpoint at the end of the current step",
    responses=error_responses(409, 503),
)
async def request_checkpoint(
    job: JobRecord = Depends(owned_job), manager: JobManager = Depends(get_manager)
) -> dict[str, Any]:
    if job.status.finished:
        raise ApiError(409, f"job {job.job_id} is {job.status.value}; it saves no more checkpoints")
    try:
        await manager.request_checkpoint(job.job_id)
    except (JobNotActiveError, RayActorError) as exc:
        raise ApiError(409, f"job {job.job_id} is not running") from exc
    except RunnerBusyError as exc:
        raise ApiError(503, f"{exc}; retry later", headers={"Retry-After": "2"}) from exc
    except RayTaskError as exc:
        raise ApiError(500, f"the job's runner failed to take the request: {getattr(exc, 'cause', None) or exc}") from exc
    return {
        "job_id": job.job_id,
        "requested": True,
        "message": "a checkpoint will be saved at the end of the current step; watch for its checkpoint event",
    }


@router.get(
    "/{job_id}/checkpoints/{name}/download",
    summary="A checkpoint (a Hugging Face model folder) as .tar.gz",
    response_class=StreamingResponse,
    responses={200: {"content": {"application/gzip": {}}}},
)
async def download_checkpoint(
    request: Request,
    name: str = Path(description="a checkpoint name from the job's list", pattern=CHECKPOINT_NAME_PATTERN),
    job: JobRecord = Depends(owned_job),
    user: User = Depends(current_user),
    store: Store = Depends(get_store),
    settings: ServerSettings = Depends(get_settings),
) -> StreamingResponse:
    if ".." in name:  # the pattern already excludes separators
        raise ApiError(400, f"checkpoint name {name!r} is not valid (letters, digits, '_', '.', '-')")
    record = store.get_checkpoint(job.job_id, name)
    if record is None:
        raise not_found(f"checkpoint {name!r} of job {job.job_id}")
    folder = checkpoint_folder(record, settings)
    request.app.state.audit.record_request(request, "checkpoint_download", user, job_id=job.job_id, name=name)
    return StreamingResponse(
        iter_tar_gz(folder, name),
        media_type="application/gzip",
        headers={"Content-Disposition": f'attachment; filename="{job.job_id}-{name}.tar.gz"'},
    )
