"""Trained models, served: what the OpenAI-compatible routes (``routers/completions.py``) call.

A request's ``model`` is one of the caller's jobs:

- ``JOB_ID``: a running job answers with its own rollout engine between steps (its current
  weights); a stopped one with its newest checkpoint.
- ``JOB_ID/CHECKPOINT``: that checkpoint of the job (a name from its checkpoint list).

Checkpoints are served by one :class:`~opentinker.engine.serving.CheckpointServer` Ray actor,
started on first use, which keeps the few most recently used ones loaded. Requests to one
running job are served one at a time (each waits for the job's current step to end anyway).
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import ray
from ray.exceptions import RayActorError, RayTaskError

from opentinker.protocol import CHECKPOINT_NAME_PATTERN, JOB_ID_PATTERN
from opentinker.server.deps import checkpoint_folder
from opentinker.server.errors import ApiError, not_found
from opentinker.server.jobs import JobManager
from opentinker.server.runner_reports import ray_failure_reason
from opentinker.server.settings import ServerSettings
from opentinker.server.store import Store, User

log = logging.getLogger("opentinker.server.serving")

CHECKPOINT_SERVER_NAME = "opentinker-checkpoint-server"
CHECKPOINT_SERVER_THREADS = 4
RETRY_AFTER_S = 2


@dataclass(frozen=True)
class ServedWeights:
    """Where a request's completions come from: a running job's runner, or a checkpoint folder."""

    model: str  # as the client named it
    job_id: str
    folder: str | None = None  # None: the running job's runner


def _matches(pattern: str, text: str) -> bool:
    return re.fullmatch(pattern, text) is not None


class ModelServing:
    def __init__(self, store: Store, manager: JobManager, settings: ServerSettings):
        self.store = store
        self.manager = manager
        self.settings = settings
        self._checkpoint_server: Any = None
        self._job_turns: dict[str, asyncio.Semaphore] = {}

    def resolve(self, user: User, model: str) -> ServedWeights:
        """The weights ``model`` names, if they are the caller's (404 otherwise, alike for
        another user's job and a missing one)."""
        job_id, _, name = model.partition("/")
        if not _matches(JOB_ID_PATTERN, job_id) or (name and not _matches(CHECKPOINT_NAME_PATTERN, name)):
            raise ApiError(404, f"model {model!r}: expected a job id (32 hex digits) or JOB_ID/CHECKPOINT "
                                "(a name from the job's checkpoint list)")
        job = self.store.get_job(job_id, user=user)
        if job is None:
            raise not_found(f"model {model!r}: job {job_id!r}")
        if name:
            record = self.store.get_checkpoint(job_id, name)
            if record is None:
                raise not_found(f"model {model!r}: checkpoint {name!r} of job {job_id}")
            return ServedWeights(model, job_id, str(checkpoint_folder(record, self.settings)))
        if self.manager.started_actor(job_id) is not None:
            return ServedWeights(model, job_id)
        checkpoints = self.store.list_checkpoints(job_id)
        if checkpoints:
            return ServedWeights(model, job_id, str(checkpoint_folder(checkpoints[-1], self.settings)))
        if not job.status.finished:
            raise ApiError(503, f"model {model!r}: job {job_id} is {job.status.value} and not training yet; "
                                "try again once it runs", headers={"Retry-After": str(RETRY_AFTER_S)})
        raise ApiError(409, f"model {model!r}: job {job_id} is {job.status.value} and saved no checkpoint, "
                            "so there are no weights to serve")

    async def events(self, weights: ServedWeights, request: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """The completion events of ``request`` (see ``stream_completions``). Errors before the
        first event are ApiErrors with the status they deserve; later ones end the iteration
        by raising ApiError 500 (the caller may already have answered 200)."""
        if weights.folder is not None:
            async for event in self._stream(weights, self._server().stream, weights.folder, request):
                yield event
            return
        turn = self._job_turns.setdefault(weights.job_id, asyncio.Semaphore(1))
        async with turn:
            actor = self.manager.started_actor(weights.job_id)
            if actor is None:
                raise ApiError(503, f"model {weights.model!r}: job {weights.job_id} stopped; try again (a stopped "
                                    "job is served from its newest checkpoint)", headers={"Retry-After": str(RETRY_AFTER_S)})
            async for event in self._stream(weights, actor.serve, request):
                yield event

    async def _stream(self, weights: ServedWeights, method: Any, *args: Any) -> AsyncIterator[dict[str, Any]]:
        generator = method.options(num_returns="streaming").remote(*args)
        try:
            async for ref in generator:
                yield await ref
        except RayTaskError as exc:
            raise self._error(weights, getattr(exc, "cause", None), exc) from exc
        except RayActorError as exc:
            raise ApiError(503, f"model {weights.model!r}: its server stopped while answering "
                                f"({ray_failure_reason(exc)}); try again",
                           headers={"Retry-After": str(RETRY_AFTER_S)}) from exc

    @staticmethod
    def _error(weights: ServedWeights, cause: BaseException | None, exc: RayTaskError) -> ApiError:
        from opentinker.server.runner import NotServingError

        if isinstance(cause, NotServingError):
            return ApiError(503, f"model {weights.model!r}: {cause}", headers={"Retry-After": str(RETRY_AFTER_S)})
        if isinstance(cause, ValueError):
            return ApiError(400, f"model {weights.model!r}: {cause}")
        log.error("serving %s failed: %s", weights.model, ray_failure_reason(exc))
        return ApiError(500, f"model {weights.model!r}: generation failed: {ray_failure_reason(exc)}")

    def _server(self) -> Any:
        if self._checkpoint_server is None:
            from opentinker.engine.serving import CheckpointServer

            options: dict[str, Any] = {"max_concurrency": CHECKPOINT_SERVER_THREADS, "namespace": self.manager.namespace,
                                       "name": CHECKPOINT_SERVER_NAME, "num_cpus": 0}
            if self.settings.serve_device == "cuda":
                options["num_gpus"] = 1
            self._checkpoint_server = ray.remote(CheckpointServer).options(**options).remote(
                device=self.settings.serve_device, max_models=self.settings.serve_max_models)
        return self._checkpoint_server

    async def shutdown(self) -> None:
        if self._checkpoint_server is not None:
            ray.kill(self._checkpoint_server)
            self._checkpoint_server = None
