"""``POST /v1/jobs/{id}/steps``: client-mode batches, in order, idempotent, with back-pressure.

A batch is checked here before it is forwarded, so a malformed one is answered 400 (422: against the schema) and
never reaches (or breaks) the running job. A repeat (same ``step``, or same
``Idempotency-Key``) gets the stored acknowledgement with ``duplicate: true`` and is not
forwarded again: a client may retry freely after a timeout.
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Depends, Request, Response
from ray.exceptions import RayActorError, RayTaskError

from opentinker.environments.registry import InteractionRegistry, InteractionSpec
from opentinker.protocol import StepAccepted, StepBatch
from opentinker.server.auth import current_user
from opentinker.server.deps import get_manager, get_registry, get_settings, get_store, owned_job
from opentinker.server.errors import AUTHENTICATED_ERRORS, ApiError, error_responses
from opentinker.server.jobs import JobManager, JobNotActiveError, RunnerBusyError
from opentinker.server.request_body import documented_body, read_model
from opentinker.server.routers.jobs import check_rows, idempotency_key_header
from opentinker.server.settings import ServerSettings
from opentinker.server.store import JobRecord, Store
from opentinker.server.validation import RowRules

router = APIRouter(prefix="/jobs", tags=["steps"], dependencies=[Depends(current_user)], responses=AUTHENTICATED_ERRORS)

RETRY_AFTER_S = 2


def _job_lock(request: Request, job_id: str) -> asyncio.Lock:
    # One push at a time per job: the duplicate check, the order check and the forward
    # must not interleave with a concurrent retry of the same step.
    locks: dict[str, asyncio.Lock] = request.app.state.step_locks
    return locks.setdefault(job_id, asyncio.Lock())


def _row_rules(job: JobRecord, registry: InteractionRegistry) -> RowRules:
    """The rules the job's rows follow, from its stored config and interactions (all of which
    were checked when the job was created)."""
    specs = [InteractionSpec.model_validate(s) for s in job.spec.get("interactions") or []]
    return RowRules(
        max_prompt_length=int(job.config["data.max_prompt_length"]),
        task=job.config.get("data.task"),
        interactions={spec.name: registry.resolve(spec.class_path) for spec in specs},
    )


def _duplicate(accepted: StepAccepted, response: Response) -> StepAccepted:
    response.status_code = 200
    return accepted.model_copy(update={"duplicate": True})


@router.post(
    "/{job_id}/steps",
    status_code=202,
    response_model=StepAccepted,
    summary="Push the rows of one training step (client mode)",
    responses={
        200: {"description": "a repeat of an accepted step (duplicate: true)"},
        **error_responses(400, 404, 409, 429, 503),
    },
    openapi_extra=documented_body(StepBatch),  # read by read_model, off the event loop (up to 64 MiB of rows)
)
async def push_step(
    request: Request,
    response: Response,
    job: JobRecord = Depends(owned_job),
    idempotency_key: str | None = idempotency_key_header(),
    store: Store = Depends(get_store),
    settings: ServerSettings = Depends(get_settings),
    manager: JobManager = Depends(get_manager),
    registry: InteractionRegistry = Depends(get_registry),
) -> StepAccepted:
    job_id = job.job_id
    body = await read_model(request, StepBatch)
    if job.mode != "client":
        raise ApiError(409, f"job {job_id} runs in {job.mode} mode; only client-mode jobs take pushed steps")
    if len(body.rows) > settings.max_rows_per_step:
        raise ApiError(
            422, f"rows: at most {settings.max_rows_per_step} rows per step on this server, got {len(body.rows)}",
            {"field": "rows"},
        )

    async with _job_lock(request, job_id):
        if idempotency_key is not None:
            earlier = store.get_step_by_key(job_id, idempotency_key)
            if earlier is not None:
                if earlier.step != body.step:
                    raise ApiError(
                        409,
                        f"Idempotency-Key {idempotency_key!r} was already used for step {earlier.step}, "
                        f"not step {body.step}",
                    )
                return _duplicate(earlier, response)
        earlier = store.get_step(job_id, body.step)
        if earlier is not None:
            return _duplicate(earlier, response)

        current = store.get_job(job_id)
        assert current is not None
        if current.status.finished:
            raise ApiError(409, f"job {job_id} is {current.status.value}; it takes no more steps")
        await check_rows(body.rows, "rows", _row_rules(job, registry), request.app.state.tokenizers,
                         job.config.get("actor_rollout_ref.model.path"))
        expected = store.last_step(job_id) + 1
        if body.step != expected:
            raise ApiError(
                409, f"steps must arrive in order: expected step {expected}, got {body.step}", {"expected_step": expected}
            )
        if body.step > current.total_steps:
            raise ApiError(
                409, f"step {body.step} is past the job's last step ({current.total_steps})", {"expected_step": None}
            )

        try:
            queued = await manager.queued(job_id)
            if queued >= settings.max_queued_steps:
                raise ApiError(
                    429,
                    f"job {job_id} already has {queued} batches waiting to be trained (limit "
                    f"{settings.max_queued_steps}); retry step {body.step} later",
                    {"queued": queued, "max_queued_steps": settings.max_queued_steps},
                    headers={"Retry-After": str(RETRY_AFTER_S)},
                )
            await manager.push_batch(job_id, body.step, body.rows)
        except JobNotActiveError as exc:
            raise ApiError(409, f"job {job_id} is not running: {exc}") from exc
        except RunnerBusyError as exc:
            raise ApiError(503, f"{exc}; retry step {body.step}", headers={"Retry-After": str(RETRY_AFTER_S)}) from exc
        except RayActorError as exc:
            raise ApiError(409, f"job {job_id}'s runner is gone; the job is ending") from exc
        except RayTaskError as exc:
            cause = getattr(exc, "cause", None)
            if isinstance(cause, (ValueError, TypeError, KeyError)):
                raise ApiError(400, f"rows: the job rejected step {body.step}: {cause}", {"field": "rows"}) from exc
            raise ApiError(500, f"the job's runner failed to take step {body.step}: {cause or exc}") from exc

        accepted = StepAccepted(step=body.step, queued=queued + 1)
        # Kept (a resumed job is fed them again); in a thread: encoding the rows takes a while.
        await asyncio.to_thread(store.add_step, job_id, accepted, idempotency_key, body.rows)
        return accepted
