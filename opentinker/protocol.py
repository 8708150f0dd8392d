"""Wire models of the v1 HTTP API, shared by the server and the thin client (no torch).

Every route but ``GET /v1/health`` needs ``Authorization: Bearer <api key>``. Errors are
``{"error": "<message>", "detail": ...}`` with the HTTP status saying what kind.
"""

from __future__ import annotations

import enum
import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

from opentinker.environments.registry import InteractionSpec
from opentinker.json_value import MAX_INT, MAX_JSON_INT, JsonObject

API_PREFIX = "/v1"
PROTOCOL_VERSION = 1

MAX_JSON_DEPTH = 32  # nesting of objects and arrays in a request body
JOB_ID_PATTERN = r"^[0-9a-f]{32}$"
CHECKPOINT_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$"  # one folder's name, never a path


def step_checkpoint_name(step: int) -> str:
    """The folder name of the checkpoint a run saves after ``step`` (verl's layout)."""
    return f"global_step_{int(step)}"

MAX_NAME_CHARS = 200
MAX_INTERACTIONS = 256  # per job or env check


def wire_problem(value: Any, path: str = "", depth: int = 0, limit: int = MAX_JSON_INT) -> str | None:
    """What makes a decoded JSON value unsafe to store and send back, or None.

    JSON admits values that break later: a lone surrogate (``"\\ud800"``) cannot be encoded
    as UTF-8, so every later answer that includes it fails; integers past int64 do not fit
    SQLite; ``NaN`` and ``Infinity`` are not JSON at all; and deep nesting exhausts the
    stack of whatever walks it next. Checking here turns each into a 422 naming the field.
    Every number, integer or not, must lie within +-``limit`` (the main API: I-JSON's
    2**53 - 1, which its OpenAPI document states as ``json_value.JsonValue``; JSON Schema
    cannot tell ``1e20`` from an integer, so floats are bounded too).
    """
    where = path or "body"
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            return f"{where}: {value[exc.start:exc.end]!r} (a lone surrogate) is not valid text"
        return None
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, int):
        return None if -limit <= value <= limit else f"{where}: {value} is out of range (at most {limit} in magnitude)"
    if isinstance(value, float):
        if not math.isfinite(value):
            return f"{where}: {value} is not a finite number"
        return None if -limit <= value <= limit else f"{where}: {value:g} is out of range (at most {limit} in magnitude)"
    if isinstance(value, (dict, list)):
        if depth >= MAX_JSON_DEPTH:
            return f"{where}: nested deeper than {MAX_JSON_DEPTH} levels"
        # A long list of plain ints (a prompt's tokens) is checked at C speed; one out of
        # range is named by the walk below.
        if isinstance(value, list) and len(value) > 64 and all(type(item) is int for item in value) \
                and -limit <= min(value) and max(value) <= limit:
            return None
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, item in items:
            if isinstance(key, str):
                problem = wire_problem(key, f"{where} (a key)", depth, limit)
                if problem:
                    return problem
            child = f"{path}.{key}" if isinstance(key, str) and path else f"{path}[{key}]" if path else str(key)
            problem = wire_problem(item, child, depth + 1, limit)
            if problem:
                return problem
    return None


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


class _Request(_Model):
    """A request body: refused as a whole (422) when any value in it is unsafe (wire_problem)."""

    @model_validator(mode="before")
    @classmethod
    def _wire_safe(cls, data: Any) -> Any:
        problem = wire_problem(data)
        if problem:
            raise PydanticCustomError("unsafe_value", problem)  # no "Value error, " prefix
        return data


class JobCreate(_Request):
    """``POST /v1/jobs``. ``config`` holds verl-style overrides, nested or as dotted keys."""

    name: str | None = Field(None, max_length=MAX_NAME_CHARS)
    mode: JobMode = "server"
    config: JsonObject = Field(default_factory=dict)
    interactions: list[InteractionSpec] = Field(default_factory=list, max_length=MAX_INTERACTIONS)
    # Train rows (server mode); None = the built-in data.task.
    dataset: list[JsonObject] | None = Field(None, min_length=1)
    val_dataset: list[JsonObject] | None = Field(None, min_length=1)


class JobCreated(_Model):
    job_id: str


class RelayInfo(_Model):
    """The client relay of a job with ``relay: client`` interactions: whether the user's client
    is connected and carrying their env calls (a job without it waits like for an env outage)."""

    interactions: list[str]  # the relayed interactions' names
    connected: bool
    connected_since: float | None = None


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
    relay: RelayInfo | None = None  # None: the job has no relayed interaction
    # The id of the job's final status event, once it has one (a stream of its events ends there).
    # A stopped job that is resumed has none again: its earlier final event is not its end.
    final_event_id: int | None = None


class JobList(_Model):
    jobs: list[JobInfo]


EventType = Literal["status", "progress", "metrics", "checkpoint", "error", "log"]


class Event(_Model):
    """One entry of a job's event log; ``id`` increases by one per job from 1.

    status: ``{"status": ..., "reason"?: ...}``; progress: ``{"step", "total_steps"}``;
    metrics: ``{"step", "metrics": {name: value}}``; checkpoint: ``{"step", "name"}``;
    error: ``{"message", "error_id"}`` (the id names the trace in the server's log);
    log: ``{"message"}``.
    """

    id: int
    job_id: str
    type: EventType
    data: dict[str, Any]
    created_at: float


class StepBatch(_Request):
    """``POST /v1/jobs/{id}/steps`` (client mode): the prompts of training step ``step`` (1-based).

    Re-sending the same step index (or the same ``Idempotency-Key`` header) is a no-op
    answered with the original acknowledgement.
    """

    step: int = Field(ge=1, le=MAX_JSON_INT)
    rows: list[JsonObject] = Field(min_length=1)


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


class EnvCheck(_Request):
    """``POST /v1/env/check``: validate interaction specs and reach each env endpoint."""

    interactions: list[InteractionSpec] = Field(max_length=MAX_INTERACTIONS)


class EnvCheckResult(_Model):
    ok: bool
    allowed_class_paths: list[str]
    problems: list[str] = Field(default_factory=list)


class ServedModelInfo(_Model):
    name: str  # what ``actor_rollout_ref.model.path`` takes
    default: bool = False  # used when a job names no model


class ModelList(_Model):
    """``GET /v1/models``: the models jobs may train, and the strategy-judge models they may pick."""

    models: list[ServedModelInfo]
    judge_models: list[str] = Field(default_factory=list)


class TokenizerFiles(_Model):
    """``GET /v1/models/{name}/tokenizer``: a served model's tokenizer files (base64), what
    ``opentinker tokenizer NAME`` places in the Hugging Face cache so that
    ``AutoTokenizer.from_pretrained(NAME)`` (the tinker SDK's ``get_tokenizer()``) works offline."""

    model: str
    files: dict[str, str]  # file name -> base64 of its bytes


class Health(_Model):
    status: Literal["ok"] = "ok"
    version: str
    protocol: int = PROTOCOL_VERSION


class ErrorBody(BaseModel):
    error: str
    detail: Any = None
