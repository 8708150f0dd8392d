"""``/v1/jobs``: create (validated up front, within the user's quota), list, get, cancel."""

from __future__ import annotations

import asyncio
import uuid
from collections import Counter
from typing import Any

from fastapi import APIRouter, Depends, Header, Request, Response

from opentinker.config import ConfigError
from opentinker.environments.registry import InteractionRegistry, UnknownInteractionError
from opentinker.protocol import JobCreate, JobCreated, JobInfo, JobList, JobStatus
from opentinker.recipe import RecipeSpec
from opentinker.server.auth import current_user
from opentinker.server.deps import get_manager, get_registry, get_settings, get_store, owned_job
from opentinker.server.errors import AUTHENTICATED_ERRORS, ApiError, error_responses
from opentinker.server.jobs import JobManager
from opentinker.server.policy import JobPolicy, PolicyError
from opentinker.server.request_body import documented_body, read_model
from opentinker.server.settings import ServerSettings
from opentinker.server.store import DATA_FIELDS, JobRecord, QuotaExceeded, Store, User, spec_digest
from opentinker.server.validation import RowRules, rows_problems

router = APIRouter(prefix="/jobs", tags=["jobs"], dependencies=[Depends(current_user)], responses=AUTHENTICATED_ERRORS)

MAX_IDEMPOTENCY_KEY_CHARS = 200
QUOTA_RETRY_AFTER_S = 30


def idempotency_key_header():
    """The ``Idempotency-Key`` header parameter (its bounds are in the OpenAPI document)."""
    return Header(None, alias="Idempotency-Key", min_length=1, max_length=MAX_IDEMPOTENCY_KEY_CHARS,
                  description="a retry with the same key gets the first answer")


def interaction_classes(
    specs: list[Any], registry: InteractionRegistry, policy: JobPolicy
) -> dict[str, type]:
    """The job's interactions, name -> class, each built once with the server's context so
    that its config (env endpoints included) is checked as the runner will build it."""
    duplicates = sorted(name for name, count in Counter(s.name for s in specs).items() if count > 1)
    if duplicates:
        raise ApiError(400, f"interactions: duplicate names {duplicates}", {"field": "interactions"})
    classes: dict[str, type] = {}
    for i, spec in enumerate(specs):
        label = f"interactions[{i}] ({spec.name!r})"
        try:
            cls = registry.resolve(spec.class_path)
        except (UnknownInteractionError, TypeError) as exc:
            raise ApiError(
                400,
                f"{label}: {exc}",
                {"field": f"interactions[{i}].class_path", "allowed_class_paths": registry.allowed_paths()},
            ) from exc
        try:
            registry.build([spec], context=policy.interaction_context(None))
        except ValueError as exc:
            raise ApiError(400, f"{label}: {exc}", {"field": f"interactions[{i}].config"}) from exc
        classes[spec.name] = cls
    return classes


async def check_rows(
    rows: list[Any], field: str, rules: RowRules, tokenizers: Any, model_name: str | None
) -> None:
    """400 naming the first bad rows; prompt lengths are counted with the model's tokenizer,
    in a worker thread (a dataset can be large)."""

    def problems() -> list[str]:
        rules.tokenizer = tokenizers.get(model_name)
        rules.pictures = tokenizers.pictures(model_name)
        return rows_problems(rows, field, rules)

    found = await asyncio.to_thread(problems)
    if found:
        raise ApiError(400, "; ".join(found), {"field": field, "problems": found})


async def _check_data(body: JobCreate, recipe: RecipeSpec, classes: dict[str, type], tokenizers: Any) -> None:
    if body.mode == "client" and body.dataset is not None:
        raise ApiError(
            400,
            "dataset: a client-mode job takes its rows step by step (POST /v1/jobs/{id}/steps); "
            "send no dataset, or use mode 'server'",
            {"field": "dataset"},
        )
    if not classes and not recipe.data.task:
        raise ApiError(
            400,
            "config key 'data.task': a job without interactions is scored by a built-in task; "
            "set data.task (e.g. 'arithmetic') or give interactions",
            {"field": "config.data.task"},
        )
    rules = RowRules(recipe.data.max_prompt_length, recipe.data.task, classes)
    for field, rows in (("dataset", body.dataset), ("val_dataset", body.val_dataset)):
        if rows is None:
            continue
        await check_rows(rows, field, rules, tokenizers, recipe.actor_rollout_ref.model.path)


@router.post(
    "",
    status_code=201,
    response_model=JobCreated,
    summary="Create and start a training job",
    responses={
        200: {"description": "a retry with an Idempotency-Key already used: the job created then"},
        **error_responses(400, 409, 429),
    },
    openapi_extra=documented_body(JobCreate),  # read by read_model, off the event loop (a dataset can be large)
)
async def create_job(
    request: Request,
    response: Response,
    idempotency_key: str | None = idempotency_key_header(),
    user: User = Depends(current_user),
    store: Store = Depends(get_store),
    manager: JobManager = Depends(get_manager),
    registry: InteractionRegistry = Depends(get_registry),
    settings: ServerSettings = Depends(get_settings),
) -> JobCreated:
    body = await read_model(request, JobCreate)
    policy = settings.job_policy
    try:
        # Parsed once, with the rules that depend on the job (its mode) and on this server (its GPUs).
        recipe = policy.client_recipe(body.config, mode=body.mode, gpus=manager.cluster.has_gpus())
    except PolicyError as exc:
        raise ApiError(400, str(exc), {"field": exc.field}) from exc
    except ConfigError as exc:
        raise ApiError(400, str(exc), {"field": f"config.{exc.key}" if exc.key else "config"}) from exc
    placement = manager.cluster.placement_problem(recipe)
    if placement:
        raise ApiError(400, placement, {"field": "config.trainer.n_gpus_per_node"})
    # In a thread: checking an endpoint on the server's own port may wait for a DNS lookup.
    classes = await asyncio.to_thread(interaction_classes, body.interactions, registry, policy)
    await _check_data(body, recipe, classes, request.app.state.tokenizers)

    # The rows as they came (wire_problem made them plain JSON): dumping them again would hold
    # the GIL for as long as decoding them did.
    spec = {**body.model_dump(mode="json", exclude=set(DATA_FIELDS)), **{f: getattr(body, f) for f in DATA_FIELDS}}
    limit = settings.max_running_jobs_per_user + settings.max_queued_jobs_per_user
    try:
        job, created, digest = await asyncio.to_thread(
            store.create_job,
            uuid.uuid4().hex,
            user,
            name=body.name,
            mode=body.mode,
            spec=spec,
            config=recipe.to_dotted(),
            total_steps=recipe.trainer.total_training_steps,
            idempotency_key=idempotency_key,
            max_unfinished=limit,
        )
    except QuotaExceeded as exc:
        raise ApiError(
            429,
            f"you have {exc.count} unfinished jobs (running or queued), the most this server allows per user "
            f"({settings.max_running_jobs_per_user} running + {settings.max_queued_jobs_per_user} queued); "
            "wait for one to end or cancel one",
            {"unfinished": exc.count, "limit": exc.limit},
            headers={"Retry-After": str(QUOTA_RETRY_AFTER_S)},
        ) from exc
    if not created:  # a retry whose first answer was lost: the job already exists
        if digest != await asyncio.to_thread(spec_digest, spec):
            raise ApiError(409, f"Idempotency-Key {idempotency_key!r} was already used for a different job ({job.job_id})")
        response.status_code = 200
        return JobCreated(job_id=job.job_id)
    manager.submit(job)
    request.app.state.audit.record_request(request, "job_create", user, job_id=job.job_id, name=body.name,
                                           mode=body.mode)
    return JobCreated(job_id=job.job_id)


def job_info(job: JobRecord, request: Request) -> JobInfo:
    """The job's info, with whether its client relay is connected (jobs with relayed interactions)."""
    return job.info().model_copy(update={"relay": request.app.state.relays.info(job)})


@router.get("", response_model=JobList, summary="Your jobs, newest first")
async def list_jobs(request: Request, user: User = Depends(current_user), store: Store = Depends(get_store)) -> JobList:
    return JobList(jobs=[job_info(job, request) for job in store.list_jobs(user)])


@router.get("/{job_id}", response_model=JobInfo, summary="One of your jobs", responses=error_responses(404))
async def get_job(request: Request, job: JobRecord = Depends(owned_job)) -> JobInfo:
    return job_info(job, request)


@router.post(
    "/{job_id}/cancel", response_model=JobInfo, summary="Stop a job after its current step", responses=error_responses(404)
)
async def cancel_job(
    request: Request,
    job: JobRecord = Depends(owned_job),
    user: User = Depends(current_user),
    store: Store = Depends(get_store),
    manager: JobManager = Depends(get_manager),
) -> JobInfo:
    if not job.status.finished:  # a finished job stays as it is: cancelling is idempotent
        await manager.cancel(job.job_id)
        request.app.state.audit.record_request(request, "job_cancel", user, job_id=job.job_id)
    updated = store.get_job(job.job_id)
    assert updated is not None
    return job_info(updated, request)


@router.post(
    "/{job_id}/resume",
    response_model=JobInfo,
    status_code=202,
    summary="Continue a stopped job from its last checkpoint",
    responses=error_responses(404, 409, 429),
)
async def resume_job(
    request: Request,
    job: JobRecord = Depends(owned_job),
    user: User = Depends(current_user),
    store: Store = Depends(get_store),
    manager: JobManager = Depends(get_manager),
    settings: ServerSettings = Depends(get_settings),
) -> JobInfo:
    if not job.status.finished or job.status is JobStatus.COMPLETED:
        raise ApiError(409, f"job {job.job_id} is {job.status.value}; only a stopped job (interrupted, failed or "
                            "cancelled) can be resumed")
    if manager.is_active(job.job_id):  # its runner is still finishing the last step
        raise ApiError(409, f"job {job.job_id} is still stopping (its runner is finishing a step); resume it once "
                            "its final status event has arrived", headers={"Retry-After": "2"})
    limit = settings.max_running_jobs_per_user + settings.max_queued_jobs_per_user
    unfinished = sum(1 for j in store.list_jobs(user) if not j.status.finished)
    if unfinished >= limit:
        raise ApiError(429, f"you have {unfinished} unfinished jobs, the most this server allows per user",
                       headers={"Retry-After": str(QUOTA_RETRY_AFTER_S)})
    if not await manager.resume(job.job_id, "resumed by the user"):
        raise ApiError(409, f"job {job.job_id} has no checkpoint to resume from (checkpoints come with "
                            "trainer.save_freq or POST /v1/jobs/{id}/checkpoints)")
    request.app.state.audit.record_request(request, "job_resume", user, job_id=job.job_id)
    updated = store.get_job(job.job_id)
    assert updated is not None
    return job_info(updated, request)
