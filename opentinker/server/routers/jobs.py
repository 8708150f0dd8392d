"""``/v1/jobs``: create (validated up front), list, get, cancel."""

from __future__ import annotations

import asyncio
import functools
import uuid
from collections import Counter

from fastapi import APIRouter, Depends, Header, Response

from opentinker.config import ConfigError, make_config, to_dotted
from opentinker.environments.registry import InteractionRegistry, UnknownInteractionError
from opentinker.protocol import JobCreate, JobCreated, JobInfo, JobList
from opentinker.server.auth import current_user
from opentinker.server.deps import get_manager, get_registry, get_store, owned_job
from opentinker.server.errors import ApiError
from opentinker.server.jobs import JobManager
from opentinker.server.store import JobRecord, Store, User
from opentinker.server.validation import rows_problems

router = APIRouter(prefix="/jobs", tags=["jobs"], dependencies=[Depends(current_user)])

MAX_IDEMPOTENCY_KEY_CHARS = 200


@functools.lru_cache(maxsize=1)
def builtin_task_names() -> frozenset[str] | None:
    """Names of the built-in datasets, or None when the engine cannot be imported here.

    The engine module pulls in transformers (seconds to import), so this runs once, in a
    worker thread."""
    try:
        from opentinker.engine.data import BUILTIN_TASKS
    except ImportError:
        return None
    return frozenset(BUILTIN_TASKS)


def _check_interactions(body: JobCreate, registry: InteractionRegistry) -> None:
    duplicates = sorted(name for name, count in Counter(s.name for s in body.interactions).items() if count > 1)
    if duplicates:
        raise ApiError(422, f"interactions: duplicate names {duplicates}", {"field": "interactions"})
    for i, spec in enumerate(body.interactions):
        try:
            registry.resolve(spec.class_path)
        except (UnknownInteractionError, TypeError) as exc:
            raise ApiError(
                400,
                f"interactions[{i}] ({spec.name!r}): {exc}",
                {"field": f"interactions[{i}].class_path", "allowed_class_paths": registry.allowed_paths()},
            ) from exc


async def _check_data(body: JobCreate, task: str | None) -> None:
    if body.mode == "client" and body.dataset is not None:
        raise ApiError(
            422,
            "dataset: a client-mode job takes its rows step by step (POST /v1/jobs/{id}/steps); "
            "send no dataset, or use mode 'server'",
            {"field": "dataset"},
        )
    if body.mode == "server" and body.dataset is None:
        if not task:
            raise ApiError(
                422, "dataset: a server-mode job needs a dataset or a built-in data.task", {"field": "dataset"}
            )
        names = await asyncio.to_thread(builtin_task_names)
        if names is not None and task not in names:
            raise ApiError(
                422,
                f"config key 'data.task': unknown built-in task {task!r}; built-in tasks: {sorted(names)}",
                {"field": "config.data.task"},
            )
    for field, rows in (("dataset", body.dataset), ("val_dataset", body.val_dataset)):
        if rows is None:
            continue
        if not rows:
            raise ApiError(422, f"{field}: must not be empty (send null for none)", {"field": field})
        problems = rows_problems(rows, field)
        if problems:
            raise ApiError(422, "; ".join(problems), {"field": field, "problems": problems})


@router.post(
    "",
    status_code=201,
    response_model=JobCreated,
    summary="Create and start a training job",
    responses={200: {"description": "a retry with an Idempotency-Key already used: the job created then"}},
)
async def create_job(
    body: JobCreate,
    response: Response,
    idempotency_key: str | None = Header(None, alias="Idempotency-Key"),
    user: User = Depends(current_user),
    store: Store = Depends(get_store),
    manager: JobManager = Depends(get_manager),
    registry: InteractionRegistry = Depends(get_registry),
) -> JobCreated:
    try:
        cfg = make_config(body.config)
    except ConfigError as exc:
        raise ApiError(422, str(exc), {"field": "config"}) from exc
    except Exception as exc:  # OmegaConf rejects some value shapes before our checks run
        raise ApiError(422, f"config: {exc}", {"field": "config"}) from exc
    if cfg.trainer.default_local_dir is not None:
        # The server decides where a job writes (its own folder); a client must not pick
        # a path on the server's disk.
        raise ApiError(
            422,
            "config key 'trainer.default_local_dir' is set by the server (each job saves into its own "
            "folder); leave it out and use trainer.save_freq or POST /v1/jobs/{id}/checkpoints",
            {"field": "config.trainer.default_local_dir"},
        )
    _check_interactions(body, registry)
    await _check_data(body, cfg.data.task)

    if idempotency_key is not None and not 0 < len(idempotency_key) <= MAX_IDEMPOTENCY_KEY_CHARS:
        raise ApiError(422, f"header Idempotency-Key: must be 1 to {MAX_IDEMPOTENCY_KEY_CHARS} characters")
    spec = body.model_dump(mode="json")
    job, created = store.create_job(
        uuid.uuid4().hex,
        user,
        name=body.name,
        mode=body.mode,
        spec=spec,
        config=to_dotted(cfg),
        total_steps=int(cfg.trainer.total_training_steps),
        idempotency_key=idempotency_key,
    )
    if not created:  # a retry whose first answer was lost: the job already exists
        if job.spec != spec:
            raise ApiError(409, f"Idempotency-Key {idempotency_key!r} was already used for a different job ({job.job_id})")
        response.status_code = 200
        return JobCreated(job_id=job.job_id)
    manager.submit(job)
    return JobCreated(job_id=job.job_id)


@router.get("", response_model=JobList, summary="Your jobs, newest first")
async def list_jobs(user: User = Depends(current_user), store: Store = Depends(get_store)) -> JobList:
    return JobList(jobs=[job.info() for job in store.list_jobs(user)])


@router.get("/{job_id}", response_model=JobInfo, summary="One of your jobs")
async def get_job(job: JobRecord = Depends(owned_job)) -> JobInfo:
    return job.info()


@router.post("/{job_id}/cancel", response_model=JobInfo, summary="Stop a job after its current step")
async def cancel_job(
    job: JobRecord = Depends(owned_job),
    store: Store = Depends(get_store),
    manager: JobManager = Depends(get_manager),
) -> JobInfo:
    if not job.status.finished:  # a finished job stays as it is: cancelling is idempotent
        await manager.cancel(job.job_id)
    updated = store.get_job(job.job_id)
    assert updated is not None
    return updated.info()
