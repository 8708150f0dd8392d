"""The durable state of the server: users, API keys, jobs, their events, checkpoints and pushed steps.

One SQLite file (``<data_dir>/opentinker.db``) in WAL mode, so readers (an SSE stream
polling for events) never wait on the writer. One connection is shared by all threads
behind a lock: every call is a short indexed query, cheap enough to run directly on the
event loop. A job's heavy state lives in its Ray actor; what is here is what survives a
restart.

A job's datasets live in their own table (``job_data``), read only when its runner starts:
reading or listing jobs costs the same whatever their datasets weigh. A job's final status
event is always its last event: once it is stored, runner events for the job are dropped,
and a final status set while the runner still drains (a cancel) is published after it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import sqlite3
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from opentinker.protocol import CheckpointInfo, Event, JobInfo, JobStatus, StepAccepted
from opentinker.server import large_json

_SCHEMA = """
CREATE TABLE IF NOT EXISTS users (
    id INTEGER PRIMARY KEY,
    name TEXT NOT NULL UNIQUE,
    created_at REAL NOT NULL
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
        )


@dataclass(frozen=True)
class CheckpointRecord:
    job_id: str
    name: str
    step: int
    path: str
    created_at: float

    def info(self) -> CheckpointInfo:
        return CheckpointInfo(name=self.name, step=self.step, created_at=self.created_at)


class Store:
    """All reads and writes of the SQLite file; safe to share between threads."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.RLock()
        # isolation_level=None: autocommit; multi-statement writes use an explicit transaction.
        self._conn = sqlite3.connect(str(self.path), check_same_thread=False, isolation_level=None, timeout=30.0)
        self._conn.row_factory = sqlite3.Row
        with self._lock:
            self._conn.execute("PRAGMA journal_mode=WAL")
            self._conn.execute("PRAGMA synchronous=NORMAL")
            self._conn.execute("PRAGMA foreign_keys=ON")
            self._conn.executescript(_SCHEMA)
            columns = {row["name"] for row in self._conn.execute("PRAGMA table_info(jobs)")}
            for column, sql_type in _ADDED_JOB_COLUMNS.items():
                if column not in columns:  # a store made before the column existed
                    self._conn.execute(f"ALTER TABLE jobs ADD COLUMN {column} {sql_type}")
            self._conn.execute(
                "CREATE UNIQUE INDEX IF NOT EXISTS jobs_by_key ON jobs(user_id, idempotency_key) "
                "WHERE idempotency_key IS NOT NULL"
            )
            self._conn.execute("CREATE INDEX IF NOT EXISTS jobs_by_status ON jobs(status, created_at)")
            if "rows_json" not in {row["name"] for row in self._conn.execute("PRAGMA table_info(steps)")}:
                self._conn.execute("ALTER TABLE steps ADD COLUMN rows_json TEXT")
            if "last_used_at" not in {row["name"] for row in self._conn.execute("PRAGMA table_info(api_keys)")}:
                self._conn.execute("ALTER TABLE api_keys ADD COLUMN last_used_at REAL")
            self._move_datasets_out_of_specs()
        self.on_events: Callable[[str], None] | None = None  # called with a job id after its events change

    def _move_datasets_out_of_specs(self) -> None:
        """Stores made before ``job_data`` kept datasets inside ``spec_json``: move them once."""
        rows = self._conn.execute("SELECT job_id, spec_json FROM jobs WHERE spec_sha256 IS NULL").fetchall()
        for row in rows:
            spec = json.loads(row["spec_json"])
            data = {name: spec.pop(name, None) for name in DATA_FIELDS}
            self._conn.execute("BEGIN IMMEDIATE")
            self._conn.execute(
                "INSERT OR REPLACE INTO job_data (job_id, dataset_json, val_dataset_json) VALUES (?, ?, ?)",
                (row["job_id"], *(None if data[n] is None else json.dumps(data[n]) for n in DATA_FIELDS)),
            )
            self._conn.execute(
                "UPDATE jobs SET spec_json = ?, spec_sha256 = '' WHERE job_id = ?", (json.dumps(spec), row["job_id"])
            )
            self._conn.execute("COMMIT")

    def close(self) -> None:
        with self._lock:
            self._conn.close()

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                yield self._conn
            except BaseException:
                self._conn.execute("ROLLBACK")
                raise
            self._conn.execute("COMMIT")

    def _query(self, sql: str, params: Iterable[Any] = ()) -> list[sqlite3.Row]:
        with self._lock:
            return self._conn.execute(sql, tuple(params)).fetchall()

    # Other modules' tables (the Tinker API's) live in the same file, through these two.
    transaction = _transaction
    query = _query

    def server_id(self) -> str:
        """A random id made the first time this store is opened: it names this server's
        things in places shared with other servers (its Ray namespace)."""
        with self._transaction() as conn:
            conn.execute("INSERT OR IGNORE INTO meta (key, value) VALUES ('server_id', ?)", (uuid.uuid4().hex,))
            (value,) = conn.execute("SELECT value FROM meta WHERE key = 'server_id'").fetchone()
        return value

    # users and keys -------------------------------------------------------------------

    def create_user(self, name: str) -> User:
        """Raises ValueError when the name is taken."""
        now = time.time()
        try:
            with self._transaction() as conn:
                cur = conn.execute("INSERT INTO users (name, created_at) VALUES (?, ?)", (name, now))
        except sqlite3.IntegrityError as exc:
            raise ValueError(f"user {name!r} already exists") from exc
        return User(id=int(cur.lastrowid), name=name, created_at=now)

    def get_user(self, name: str) -> User | None:
        rows = self._query("SELECT id, name, created_at FROM users WHERE name = ?", (name,))
        return User(**dict(rows[0])) if rows else None

    def list_users(self) -> list[tuple[User, int]]:
        """Every user with the number of its active keys."""
        rows = self._query(
            "SELECT u.id, u.name, u.created_at, "
            "(SELECT COUNT(*) FROM api_keys k WHERE k.user_id = u.id AND k.revoked = 0) AS active_keys "
            "FROM users u ORDER BY u.name"
        )
        return [(User(id=r["id"], name=r["name"], created_at=r["created_at"]), r["active_keys"]) for r in rows]

    def add_api_key(self, user: User, key_hash: str, prefix: str) -> None:
        with self._transaction() as conn:
            conn.execute(
                "INSERT INTO api_keys (user_id, key_hash, prefix, created_at) VALUES (?, ?, ?, ?)",
                (user.id, key_hash, prefix, time.time()),
            )

    def user_for_key_hash(self, key_hash: str) -> User | None:
        """The owner of the (unrevoked) key of ``key_hash``; notes when the key was last used."""
        rows = self._query(
            "SELECT u.id, u.name, u.created_at, k.id AS key_id, k.last_used_at FROM api_keys k "
            "JOIN users u ON u.id = k.user_id WHERE k.key_hash = ? AND k.revoked = 0",
            (key_hash,),
        )
        if not rows:
            return None
        row, now = rows[0], time.time()
        # A write at most once a minute per key, not one per request.
        if row["last_used_at"] is None or now - row["last_used_at"] >= KEY_USE_RESOLUTION_S:
            with self._transaction() as conn:
                conn.execute("UPDATE api_keys SET last_used_at = ? WHERE id = ?", (now, row["key_id"]))
        return User(id=row["id"], name=row["name"], created_at=row["created_at"])

    def list_api_keys(self, user: User | None = None, key_hash: str | None = None) -> list[ApiKeyInfo]:
        """Every key (or ``user``'s, or the one of ``key_hash``), oldest first."""
        sql = (
            "SELECT k.id, u.name AS user_name, k.prefix, k.created_at, k.revoked, k.last_used_at "
            "FROM api_keys k JOIN users u ON u.id = k.user_id WHERE 1"
        )
        params: list[Any] = []
        if user is not None:
            sql += " AND k.user_id = ?"
            params.append(user.id)
        if key_hash is not None:
            sql += " AND k.key_hash = ?"
            params.append(key_hash)
        rows = self._query(sql + " ORDER BY k.id", params)
        return [ApiKeyInfo(**{**dict(r), "revoked": bool(r["revoked"])}) for r in rows]

    def revoke_api_key(self, key_hash: str) -> bool:
        """Revoke the key; its dashboard sessions end with it."""
        rows = self._query("SELECT id FROM api_keys WHERE key_hash = ?", (key_hash,))
        return bool(rows) and self.revoke_api_key_id(rows[0]["id"])

    def revoke_api_key_id(self, key_id: int) -> bool:
        """Revoke the key with this id (``list_api_keys``); False if there is none or it was
        revoked already. Its dashboard sessions end with it."""
        with self._transaction() as conn:
            cur = conn.execute("UPDATE api_keys SET revoked = 1 WHERE id = ? AND revoked = 0", (key_id,))
            conn.execute("DELETE FROM dashboard_sessions WHERE api_key_id = ?", (key_id,))
        return cur.rowcount > 0

    # dashboard sessions ---------------------------------------------------------------

    def create_session(self, key_hash: str, token_hash: str, ttl_s: float) -> DashboardSession | None:
        """A browser session for the (unrevoked) key of ``key_hash``, found by ``token_hash``
        for ``ttl_s`` seconds; None for an unknown or revoked key. Expired rows go meanwhile."""
        now = time.time()
        with self._transaction() as conn:
            conn.execute("DELETE FROM dashboard_sessions WHERE expires_at <= ?", (now,))
            cur = conn.execute(
                "INSERT INTO dashboard_sessions (token_hash, user_id, api_key_id, created_at, expires_at) "
                "SELECT ?, user_id, id, ?, ? FROM api_keys WHERE key_hash = ? AND revoked = 0",
                (token_hash, now, now + ttl_s, key_hash),
            )
        return self.session(token_hash) if cur.rowcount else None

    def session(self, token_hash: str) -> DashboardSession | None:
        """The live session of ``token_hash``: not expired, its API key not revoked."""
        rows = self._query(
            "SELECT u.id, u.name, u.created_at AS user_created_at, k.prefix, s.created_at, s.expires_at "
            "FROM dashboard_sessions s JOIN api_keys k ON k.id = s.api_key_id JOIN users u ON u.id = s.user_id "
            "WHERE s.token_hash = ? AND s.expires_at > ? AND k.revoked = 0",
            (token_hash, time.time()),
        )
        if not rows:
            return None
        r = rows[0]
        return DashboardSession(user=User(id=r["id"], name=r["name"], created_at=r["user_created_at"]),
                                key_prefix=r["prefix"], created_at=r["created_at"], expires_at=r["expires_at"])

    def ended_credentials(self, key_hashes: Sequence[str], token_hashes: Sequence[str]) -> tuple[set[str], set[str]]:
        """Of ``key_hashes`` those whose key is revoked (or unknown), and of ``token_hashes``
        those whose dashboard session has ended (logged out, expired, its key revoked)."""
        live_keys: set[str] = set()
        live_sessions: set[str] = set()
        now = time.time()
        for start in range(0, len(key_hashes), 500):  # SQLite's limit on parameters is 999 in old builds
            chunk = list(key_hashes[start:start + 500])
            rows = self._query(f"SELECT key_hash FROM api_keys WHERE revoked = 0 AND key_hash IN "
                               f"({', '.join('?' * len(chunk))})", chunk)
            live_keys.update(row["key_hash"] for row in rows)
        for start in range(0, len(token_hashes), 500):
            chunk = list(token_hashes[start:start + 500])
            rows = self._query(f"SELECT s.token_hash FROM dashboard_sessions s JOIN api_keys k ON k.id = s.api_key_id "
                               f"WHERE s.expires_at > ? AND k.revoked = 0 AND s.token_hash IN "
                               f"({', '.join('?' * len(chunk))})", [now, *chunk])
            live_sessions.update(row["token_hash"] for row in rows)
        return set(key_hashes) - live_keys, set(token_hashes) - live_sessions

    def delete_session(self, token_hash: str) -> bool:
        with self._transaction() as conn:
            cur = conn.execute("DELETE FROM dashboard_sessions WHERE token_hash = ?", (token_hash,))
        return cur.rowcount > 0

    # jobs ----------------------------------------------------------------------------

    def create_job(
        self,
        job_id: str,
        user: User,
        *,
        name: str | None,
        mode: str,
        spec: dict[str, Any],
        config: dict[str, Any],
        total_steps: int,
        idempotency_key: str | None = None,
        max_unfinished: int | None = None,
    ) -> tuple[JobRecord, bool, str | None]:
        """Insert a queued job and its first status event; returns ``(job, created, spec_sha256)``.

        ``spec`` is the whole JobCreate body: its datasets go to ``job_data``. With an
        ``idempotency_key`` the user already used, nothing is inserted and the job created
        then is returned with ``created=False`` and the hash of the body that created it.
        With ``max_unfinished``, raises :class:`QuotaExceeded` when the user already has that
        many queued or running jobs (checked in the same transaction as the insert).
        """
        now = time.time()
        spec = dict(spec)
        data = {name: spec.pop(name, None) for name in DATA_FIELDS}
        digest = spec_digest({**spec, **data})
        # Encoded before the store's lock is taken, so other requests' queries need not wait for it.
        data_json = [None if data[n] is None else large_json.dumps(data[n]) for n in DATA_FIELDS]
        with self._transaction() as conn:
            if idempotency_key is not None:
                row = conn.execute(
                    "SELECT job_id, spec_sha256 FROM jobs WHERE user_id = ? AND idempotency_key = ?",
                    (user.id, idempotency_key),
                ).fetchone()
                if row is not None:
                    earlier = self.get_job(row["job_id"])
                    assert earlier is not None
                    return earlier, False, row["spec_sha256"]
            if max_unfinished is not None:
                unfinished = self._count_unfinished(conn, user.id)
                if unfinished >= max_unfinished:
                    raise QuotaExceeded(unfinished, max_unfinished)
            conn.execute(
                "INSERT INTO jobs (job_id, user_id, name, mode, status, spec_json, config_json, step, "
                "total_steps, error, created_at, updated_at, idempotency_key, spec_sha256) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, 0, ?, NULL, ?, ?, ?, ?)",
                (
                    job_id,
                    user.id,
                    name,
                    mode,
                    JobStatus.QUEUED.value,
                    json.dumps(spec),
                    json.dumps(config),
                    total_steps,
                    now,
                    now,
                    idempotency_key,
                    digest,
                ),
            )
            conn.execute(
                "INSERT INTO job_data (job_id, dataset_json, val_dataset_json) VALUES (?, ?, ?)",
                (job_id, *data_json),
            )
            self._append_event(conn, job_id, "status", {"status": JobStatus.QUEUED.value}, now)
        self._notify(job_id)
        job = self.get_job(job_id)
        assert job is not None
        return job, True, digest

    @staticmethod
    def _count_unfinished(conn: sqlite3.Connection, user_id: int) -> int:
        (count,) = conn.execute(
            f"SELECT COUNT(*) FROM jobs WHERE user_id = ? AND status IN ({','.join('?' * len(_UNFINISHED))})",
            (user_id, *_UNFINISHED),
        ).fetchone()
        return int(count)

    def job_data(self, job_id: str) -> dict[str, Any]:
        """The job's datasets: ``{"dataset": rows | None, "val_dataset": rows | None}``."""
        rows = self._query("SELECT dataset_json, val_dataset_json FROM job_data WHERE job_id = ?", (job_id,))
        if not rows:
            return dict.fromkeys(DATA_FIELDS)
        return {
            name: None if rows[0][column] is None else large_json.loads(rows[0][column])
            for name, column in zip(DATA_FIELDS, ("dataset_json", "val_dataset_json"))
        }

    def unfinished_jobs(self, status: JobStatus | None = None) -> list[JobRecord]:
        """Queued and running jobs (or those of one status), oldest first."""
        statuses = (status.value,) if status is not None else _UNFINISHED
        rows = self._query(
            f"SELECT {_JOB_COLUMNS} FROM jobs WHERE status IN ({','.join('?' * len(statuses))}) "
            "ORDER BY created_at, job_id",
            statuses,
        )
        return [_job(r) for r in rows]

    def get_job(self, job_id: str, user: User | None = None) -> JobRecord | None:
        """The job, or None when it does not exist or (with ``user``) belongs to someone else."""
        sql, params = f"SELECT {_JOB_COLUMNS} FROM jobs WHERE job_id = ?", [job_id]
        if user is not None:
            sql += " AND user_id = ?"
            params.append(user.id)
        rows = self._query(sql, params)
        return _job(rows[0]) if rows else None

    def list_jobs(self, user: User | None = None) -> list[JobRecord]:
        """Newest first."""
        if user is None:
            rows = self._query(f"SELECT {_JOB_COLUMNS} FROM jobs ORDER BY created_at DESC, job_id")
        else:
            rows = self._query(
                f"SELECT {_JOB_COLUMNS} FROM jobs WHERE user_id = ? ORDER BY created_at DESC, job_id", (user.id,)
            )
        return [_job(r) for r in rows]

    def set_status(
        self,
        job_id: str,
        status: JobStatus,
        *,
        error: str | None = None,
        reason: str | None = None,
        step: int | None = None,
        unless_finished: bool = True,
        publish: bool = True,
    ) -> bool:
        """Move the job to ``status`` and append its status event, in one transaction.

        With ``unless_finished`` (the default) a job that already has a final status is
        left alone and False is returned: the first final status wins (a cancel that
        arrives while the run is ending, a runner result after a cancel).

        ``publish=False`` (a final status whose runner still drains its last events) stores
        the status now and its event later, with :meth:`publish_status`, so that the final
        status event stays the job's last event.
        """
        now = time.time()
        with self._transaction() as conn:
            row = conn.execute("SELECT status, step FROM jobs WHERE job_id = ?", (job_id,)).fetchone()
            if row is None:
                raise KeyError(job_id)
            if unless_finished and JobStatus(row["status"]).finished:
                return False
            new_step = row["step"] if step is None else max(int(step), row["step"])
            conn.execute(
                "UPDATE jobs SET status = ?, error = COALESCE(?, error), step = ?, updated_at = ?, "
                "status_reason = ?, status_event_pending = ? WHERE job_id = ?",
                (status.value, error, new_step, now, reason or error, int(not publish), job_id),
            )
            if publish:
                self._append_status_event(conn, job_id, status, reason or error, now)
        if publish:
            self._notify(job_id)
        return True

    def publish_status(self, job_id: str) -> bool:
        """Store the status event that ``set_status(publish=False)`` held back; False if none was."""
        now = time.time()
        with self._transaction() as conn:
            row = conn.execute(
                "SELECT status, status_reason, status_event_pending FROM jobs WHERE job_id = ?", (job_id,)
            ).fetchone()
            if row is None or not row["status_event_pending"]:
                return False
            conn.execute("UPDATE jobs SET status_event_pending = 0 WHERE job_id = ?", (job_id,))
            self._append_status_event(conn, job_id, JobStatus(row["status"]), row["status_reason"], now)
        self._notify(job_id)
        return True

    def _append_status_event(
        self, conn: sqlite3.Connection, job_id: str, status: JobStatus, reason: str | None, now: float
    ) -> None:
        data: dict[str, Any] = {"status": status.value}
        if reason:
            data["reason"] = reason
        seq = self._append_event(conn, job_id, "status", data, now)
        if status.finished:
            conn.execute("UPDATE jobs SET final_event_seq = ? WHERE job_id = ?", (seq, job_id))

    def mark_unfinished_interrupted(self, reason: str, keep_queued: bool = False) -> list[str]:
        """Every running job (and queued one, unless ``keep_queued``) becomes ``interrupted``
        with ``reason`` as its error, and held-back final status events are published (used
        at startup: the previous server process died with the jobs' Ray actors)."""
        now = time.time()
        statuses = (JobStatus.RUNNING.value,) if keep_queued else _UNFINISHED
        with self._transaction() as conn:
            ids = [
                r["job_id"]
                for r in conn.execute(
                    f"SELECT job_id FROM jobs WHERE status IN ({','.join('?' * len(statuses))}) ORDER BY created_at",
                    statuses,
                )
            ]
            for job_id in ids:
                conn.execute(
                    "UPDATE jobs SET status = ?, error = ?, status_reason = ?, updated_at = ? WHERE job_id = ?",
                    (JobStatus.INTERRUPTED.value, reason, reason, now, job_id),
                )
                self._append_status_event(conn, job_id, JobStatus.INTERRUPTED, reason, now)
            pending = [r["job_id"] for r in conn.execute("SELECT job_id FROM jobs WHERE status_event_pending = 1")]
        for job_id in pending:
            self.publish_status(job_id)
        return ids

    # events --------------------------------------------------------------------------

    @staticmethod
    def _append_event(conn: sqlite3.Connection, job_id: str, type_: str, data: dict[str, Any], now: float) -> int:
        (last,) = conn.execute("SELECT COALESCE(MAX(seq), 0) FROM events WHERE job_id = ?", (job_id,)).fetchone()
        seq = int(last) + 1
        conn.execute(
            "INSERT INTO events (job_id, seq, type, data_json, created_at) VALUES (?, ?, ?, ?, ?)",
            (job_id, seq, type_, json.dumps(data), now),
        )
        return seq

    def append_event(self, job_id: str, type_: str, data: dict[str, Any]) -> int | None:
        """Store one event; returns its id (the job's next sequence number), or None when the
        job has ended (its final status event stays last)."""
        seqs = self.append_runner_events(job_id, [{"type": type_, "data": data}])
        return seqs[-1] if seqs else None

    def append_runner_events(self, job_id: str, events: list[dict[str, Any]]) -> list[int]:
        """Store events drained from a runner, in one transaction, with their side effects:
        ``progress``/``metrics`` advance the job's step, ``checkpoint`` ({"step", "name",
        "path"}) is indexed in ``checkpoints`` (the path stays server-side: the event keeps
        only step and name)."""
        now = time.time()
        seqs: list[int] = []
        with self._transaction() as conn:
            row = conn.execute("SELECT final_event_seq FROM jobs WHERE job_id = ?", (job_id,)).fetchone()
            if row is None or row["final_event_seq"] is not None:
                return []  # the final status event stays the last event of a job
            for event in events:
                type_, data = event["type"], dict(event.get("data") or {})
                step = data.get("step")
                if type_ in ("progress", "metrics") and isinstance(step, int):
                    conn.execute(
                        "UPDATE jobs SET step = MAX(step, ?), updated_at = ? WHERE job_id = ?", (step, now, job_id)
                    )
                if type_ == "checkpoint":
                    path = data.pop("path", None)
                    if isinstance(data.get("name"), str) and path:
                        conn.execute(
                            "INSERT OR REPLACE INTO checkpoints (job_id, name, step, path, created_at) "
                            "VALUES (?, ?, ?, ?, ?)",
                            (job_id, data["name"], int(data.get("step") or 0), str(path), now),
                        )
                seqs.append(self._append_event(conn, job_id, type_, data, now))
        if seqs:
            self._notify(job_id)
        return seqs

    def _notify(self, job_id: str) -> None:
        if self.on_events is not None:
            self.on_events(job_id)

    def list_events(self, job_id: str, after: int = 0, limit: int | None = None) -> list[Event]:
        sql = "SELECT * FROM events WHERE job_id = ? AND seq > ? ORDER BY seq"
        params: list[Any] = [job_id, after]
        if limit is not None:
            sql += " LIMIT ?"
            params.append(limit)
        return [
            Event(id=r["seq"], job_id=r["job_id"], type=r["type"], data=json.loads(r["data_json"]), created_at=r["created_at"])
            for r in self._query(sql, params)
        ]

    def final_status_event_id(self, job_id: str) -> int | None:
        """The id of the job's final status event, once it is stored."""
        rows = self._query("SELECT final_event_seq FROM jobs WHERE job_id = ?", (job_id,))
        return rows[0]["final_event_seq"] if rows else None

    # checkpoints ---------------------------------------------------------------------

    def list_checkpoints(self, job_id: str) -> list[CheckpointRecord]:
        rows = self._query("SELECT * FROM checkpoints WHERE job_id = ? ORDER BY step, name", (job_id,))
        return [CheckpointRecord(**dict(r)) for r in rows]

    def get_checkpoint(self, job_id: str, name: str) -> CheckpointRecord | None:
        rows = self._query("SELECT * FROM checkpoints WHERE job_id = ? AND name = ?", (job_id, name))
        return CheckpointRecord(**dict(rows[0])) if rows else None

    # client-mode steps ----------------------------------------------------------------

    def get_step(self, job_id: str, step: int) -> StepAccepted | None:
        rows = self._query("SELECT accepted_json FROM steps WHERE job_id = ? AND step = ?", (job_id, step))
        return StepAccepted.model_validate_json(rows[0]["accepted_json"]) if rows else None

    def get_step_by_key(self, job_id: str, idempotency_key: str) -> StepAccepted | None:
        rows = self._query(
            "SELECT accepted_json FROM steps WHERE job_id = ? AND idempotency_key = ?", (job_id, idempotency_key)
        )
        return StepAccepted.model_validate_json(rows[0]["accepted_json"]) if rows else None

    def last_step(self, job_id: str) -> int:
        """The highest step index accepted for the job (0 before the first)."""
        rows = self._query("SELECT COALESCE(MAX(step), 0) AS last FROM steps WHERE job_id = ?", (job_id,))
        return int(rows[0]["last"])

    def add_step(self, job_id: str, accepted: StepAccepted, idempotency_key: str | None,
                 rows: list[dict[str, Any]] | None = None) -> None:
        rows_json = None if rows is None else large_json.dumps(rows)  # before the lock, as in create_job
        with self._transaction() as conn:
            conn.execute(
                "INSERT INTO steps (job_id, step, idempotency_key, accepted_json, created_at, rows_json) "
                "VALUES (?, ?, ?, ?, ?, ?)",
                (job_id, accepted.step, idempotency_key, accepted.model_dump_json(), time.time(), rows_json),
            )

    def pushed_rows_after(self, job_id: str, step: int) -> list[tuple[int, list[dict[str, Any]]]]:
        """The rows of the job's pushed steps after ``step``, in step order."""
        rows = self._query("SELECT step, rows_json FROM steps WHERE job_id = ? AND step > ? AND rows_json IS NOT NULL "
                           "ORDER BY step", (job_id, step))
        return [(r["step"], large_json.loads(r["rows_json"])) for r in rows]

    # resuming -------------------------------------------------------------------------

    def resume_step(self, job_id: str) -> int | None:
        """The newest checkpoint step the job can resume from: at or before its last reported
        step (later steps' events were never published, so they run again without repeats)."""
        rows = self._query(
            "SELECT MAX(c.step) AS step FROM checkpoints c JOIN jobs j ON j.job_id = c.job_id "
            "WHERE c.job_id = ? AND c.step > 0 AND c.step <= j.step", (job_id,))
        return rows[0]["step"] if rows and rows[0]["step"] is not None else None

    def reopen(self, job_id: str, reason: str) -> bool:
        """Queue a finished (not completed) job again, to resume it; its final status stops
        being final. False when the job is completed or not finished."""
        now = time.time()
        with self._transaction() as conn:
            row = conn.execute("SELECT status FROM jobs WHERE job_id = ?", (job_id,)).fetchone()
            status = JobStatus(row["status"]) if row else None
            if status is None or not status.finished or status is JobStatus.COMPLETED:
                return False
            conn.execute(
                "UPDATE jobs SET status = ?, error = NULL, status_reason = ?, status_event_pending = 0, "
                "final_event_seq = NULL, updated_at = ? WHERE job_id = ?",
                (JobStatus.QUEUED.value, reason, now, job_id),
            )
            self._append_status_event(conn, job_id, JobStatus.QUEUED, reason, now)
        self._notify(job_id)
        return True


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
