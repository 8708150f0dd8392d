"""Wire models of the v1 HTTP API, shared by the server and the thin client (no torch).

Every route but ``GET /v1/health`` needs ``Authorization: Bearer <api key>``. Errors are
``{"error": "<message>", "detail": ...}`` with the HTTP status saying what kind.
"""

from __future__ import annotations

import enum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from opentinker.environments.registry import InteractionSpec

API_PREFIX = "/v1"
PROTOCOL_VERSION = 1


class JobStatus(str, enum.Enum):
    QUEUED = "queued"
    RUNNING = "running"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"
    INTERRUPTED = "interrupted"  # the server stopped while the job was running

    @property
    def finished(self) -> bool:
        return self in (JobStatus.COMPLETED, JobStatus.FAILED, JobStatus.CANCELLED, JobStatus.INTERRUPTED)


JobMode = Literal["server", "client"]
"""server: the dataset is uploaded with the job and the server runs every step;
client: the client pushes one batch of rows per step (``POST /v1/jobs/{id}/steps``)."""


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class JobCreate(_Model):
    """``POST /v1/jobs``. ``config`` holds verl-style overrides, nested or as dotted keys."""

    name: str | None = None
    mode: JobMode = "server"
    config: dict[str, Any] = Field(default_factory=dict)
    interactions: list[InteractionSpec] = Field(default_factory=list)
    dataset: list[dict[str, Any]] | None = None  # train rows (server mode); None = built-in data.task
    val_dataset: list[dict[str, Any]] | None = None


class JobCreated(_Model):
    job_id: str


class JobInfo(_Model):
    job_id: str
    name: str | None
    mode: JobMode
    status: JobStatus
    created_at: float
    updated_at: float
    step: int = 0  # last finished training step
    total_steps: int
    error: str | None = None
    config: dict[str, Any] = Field(default_factory=dict)  # the resolved config, dotted keys


class JobList(_Model):
    jobs: list[JobInfo]


EventType = Literal["status", "progress", "metrics", "checkpoint", "error", "log"]


class Event(_Model):
    """One entry of a job's event log; ``id`` increases by one per job from 1.

    status: ``{"status": ..., "reason"?: ...}``; progress: ``{"step", "total_steps"}``;
    metrics: ``{"step", "metrics": {name: value}}``; checkpoint: ``{"step", "name"}``;
    error: ``{"message"}``; log: ``{"message"}``.
    """

    id: int
    job_id: str
    type: EventType
    data: dict[str, Any]
    created_at: float


class StepBatch(_Model):
    """``POST /v1/jobs/{id}/steps`` (client mode): the prompts of training step ``step`` (1-based).

    Re-sending the same step index (or the same ``Idempotency-Key`` header) is a no-op
    answered with the original acknowledgement.
    """

    step: int = Field(ge=1)
    rows: list[dict[str, Any]] = Field(min_length=1)


class StepAccepted(_Model):
    step: int
    queued: int  # batches waiting, this one included
    duplicate: bool = False


class CheckpointInfo(_Model):
    name: str  # e.g. "global_step_20"
    step: int
    created_at: float


class CheckpointList(_Model):
    checkpoints: list[CheckpointInfo]


class EnvCheck(_Model):
    """``POST /v1/env/check``: validate interaction specs and reach each env endpoint."""

    interactions: list[InteractionSpec]


class EnvCheckResult(_Model):
    ok: bool
    allowed_class_paths: list[str]
    problems: list[str] = Field(default_factory=list)


class Health(_Model):
    status: Literal["ok"] = "ok"
    version: str
    protocol: int = PROTOCOL_VERSION


class ErrorBody(BaseModel):
    error: str
    detail: Any = None
