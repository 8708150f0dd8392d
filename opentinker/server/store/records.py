"""The store's schema and what its rows become: users, keys, sessions, jobs, checkpoints."""

from __future__ import annotations

import hashlib
import json
import sqlite3
from dataclasses import dataclass
from typing import Any

from opentinker.protocol import CheckpointInfo, JobInfo, JobStatus
from opentinker.server import large_json

_SCHEMA = """
CREATE TABLE IF NOT EXISTS users (
    id INTEGER PRIMARY KEY,
    name TEXT NOT NULL UNIQUE,
    created_at REAL NOT NULL,
    is_admin INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS api_keys (
    id INTEGER PRIMARY KEY,
    user_id INTEGER NOT NULL REFERENCES users(id),
    key_hash TEXT NOT NULL UNIQUE,
    prefix TEXT NOT NULL,
    created_at REAL NOT NULL,
    revoked INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS jobs (
    job_id TEXT PRIMARY KEY,
    user_id INTEGER NOT NULL REFERENCES users(id),
    name TEXT,
    mode TEXT NOT NULL,
    status TEXT NOT NULL,
    spec_json TEXT NOT NULL,
    config_json TEXT NOT NULL,
    step INTEGER NOT NULL DEFAULT 0,
    total_steps INTEGER NOT NULL,
    error TEXT,
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL,
    idempotency_key TEXT  -- of the POST /v1/jobs that created it, so a retried create finds it
);
CREATE TABLE IF NOT EXISTS meta (
    key TEXT PRIMARY KEY,
    value TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS job_data (
    job_id TEXT PRIMARY KEY REFERENCES jobs(job_id),
    dataset_json TEXT,
    val_dataset_json TEXT
);
CREATE INDEX IF NOT EXISTS jobs_by_user ON jobs(user_id, created_at);
CREATE TABLE IF NOT EXISTS events (
    job_id TEXT NOT NULL REFERENCES jobs(job_id),
    seq INTEGER NOT NULL,
    type TEXT NOT NULL,
    data_json TEXT NOT NULL,
    created_at REAL NOT NULL,
    PRIMARY KEY (job_id, seq)
);
CREATE TABLE IF NOT EXISTS checkpoints (
    job_id TEXT NOT NULL REFERENCES jobs(job_id),
    name TEXT NOT NULL,
    step INTEGER NOT NULL,
    path TEXT NOT NULL,
    created_at REAL NOT NULL,
    size_bytes INTEGER,  -- its folder's bytes on disk, measured when it was kept
    PRIMARY KEY (job_id, name)
);
CREATE TABLE IF NOT EXISTS steps (
    job_id TEXT NOT NULL REFERENCES jobs(job_id),
    step INTEGER NOT NULL,
    idempotency_key TEXT,
    accepted_json TEXT NOT NULL,
    created_at REAL NOT NULL,
    rows_json TEXT,  -- the pushed rows, fed again to a job resumed from an earlier checkpoint
    PRIMARY KEY (job_id, step)
);
CREATE UNIQUE INDEX IF NOT EXISTS steps_by_key ON steps(job_id, idempotency_key)
    WHERE idempotency_key IS NOT NULL;
-- The dashboard's cookie sessions: only the token's hash; a session lives while its API key does.
CREATE TABLE IF NOT EXISTS dashboard_sessions (
    token_hash TEXT PRIMARY KEY,
    user_id INTEGER NOT NULL REFERENCES users(id),
    api_key_id INTEGER NOT NULL REFERENCES api_keys(id),
    created_at REAL NOT NULL,
    expires_at REAL NOT NULL
);
"""

_UNFINISHED = (JobStatus.QUEUED.value, JobStatus.RUNNING.value)
KEY_USE_RESOLUTION_S = 60.0  # how stale an API key's last_used_at may be
DATA_FIELDS = ("dataset", "val_dataset")
# Columns added after the first release, with their SQL type (old stores get them at open).
_ADDED_JOB_COLUMNS = {
    "idempotency_key": "TEXT",
    "spec_sha256": "TEXT",  # of the whole JobCreate body, datasets included (idempotent create)
    "status_reason": "TEXT",  # why the job has its status (e.g. who cancelled it)
    "status_event_pending": "INTEGER NOT NULL DEFAULT 0",  # final status set, its event not yet stored
    "final_event_seq": "INTEGER",  # the id of the job's final status event, once stored
}
_JOB_COLUMNS = (
    "job_id, user_id, name, mode, status, spec_json, config_json, step, total_steps, error, created_at, "
    "updated_at, status_reason, status_event_pending, final_event_seq"
)


@dataclass(frozen=True)
class User:
    id: int
    name: str
    created_at: float
    is_admin: bool = False  # sees every user's usage, audit entries, sessions and checkpoints (read-only)


@dataclass(frozen=True)
class ApiKeyInfo:
    """What is kept of a key: never the key, only its hash and its first characters."""

    id: int
    user_name: str
    prefix: str
    created_at: float
    revoked: bool
    last_used_at: float | None = None  # to the minute (KEY_USE_RESOLUTION_S); None: never used


@dataclass(frozen=True)
class DashboardSession:
    """A browser's login (``POST /v1/session``): valid until ``expires_at`` while its key is not revoked."""

    user: User
    key_prefix: str  # of the API key it was opened with
    created_at: float
    expires_at: float


@dataclass(frozen=True)
class JobRecord:
    """A row of ``jobs``. ``spec`` is the JobCreate the user sent (as a dict, without its
    datasets); ``config`` the resolved config in dotted keys."""

    job_id: str
    user_id: int
    name: str | None
    mode: str
    status: JobStatus
    spec: dict[str, Any]  # without the datasets (Store.job_data has them)
    config: dict[str, Any]
    step: int
    total_steps: int
    error: str | None
    created_at: float
    updated_at: float
    status_reason: str | None = None
    status_event_pending: bool = False
    final_event_seq: int | None = None

    def info(self) -> JobInfo:
        return JobInfo(
            job_id=self.job_id,
            name=self.name,
            mode=self.mode,  # type: ignore[arg-type]
            status=self.status,
            created_at=self.created_at,
            updated_at=self.updated_at,
            step=self.step,
            total_steps=self.total_steps,
            error=self.error,
            config=self.config,
            final_event_id=self.final_event_seq,
        )


@dataclass(frozen=True)
class CheckpointRecord:
    job_id: str
    name: str
    step: int
    path: str
    created_at: float
    size_bytes: int | None = None  # on disk, measured when it was kept (None: kept before sizes were)

    def info(self) -> CheckpointInfo:
        return CheckpointInfo(name=self.name, step=self.step, created_at=self.created_at)


class QuotaExceeded(Exception):
    """The user already has ``count`` unfinished jobs, the most allowed (``limit``)."""

    def __init__(self, count: int, limit: int):
        super().__init__(f"{count} unfinished jobs (limit {limit})")
        self.count = count
        self.limit = limit


def spec_digest(spec: dict[str, Any]) -> str:
    """A stable hash of a job's whole request body (to tell a retried create from a new one)."""
    digest = hashlib.sha256()
    for chunk in large_json.dumps_chunks(spec, sort_keys=True, separators=(",", ":")):  # = json.dumps's text
        digest.update(chunk.encode("utf-8"))
    return digest.hexdigest()


def _job(row: sqlite3.Row) -> JobRecord:
    return JobRecord(
        job_id=row["job_id"],
        user_id=row["user_id"],
        name=row["name"],
        mode=row["mode"],
        status=JobStatus(row["status"]),
        spec=json.loads(row["spec_json"]),
        config=json.loads(row["config_json"]),
        step=row["step"],
        total_steps=row["total_steps"],
        error=row["error"],
        created_at=row["created_at"],
        updated_at=row["updated_at"],
        status_reason=row["status_reason"],
        status_event_pending=bool(row["status_event_pending"]),
        final_event_seq=row["final_event_seq"],
    )
