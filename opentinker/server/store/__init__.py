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
import json
import secrets
import sqlite3
import threading
import uuid
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from opentinker.server.store.credentials import CredentialTables
from opentinker.server.store.events import EventTables
from opentinker.server.store.jobs import JobTables
from opentinker.server.store.records import (
    _ADDED_JOB_COLUMNS,
    _SCHEMA,
    DATA_FIELDS,
    ApiKeyInfo,
    CheckpointRecord,
    DashboardSession,
    JobRecord,
    QuotaExceeded,
    User,
    spec_digest,
)

__all__ = ["DATA_FIELDS", "ApiKeyInfo", "CheckpointRecord", "DashboardSession", "JobRecord", "QuotaExceeded", "Store",
           "User", "spec_digest"]


class Store(CredentialTables, JobTables, EventTables):
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
            if "size_bytes" not in {row["name"] for row in self._conn.execute("PRAGMA table_info(checkpoints)")}:
                self._conn.execute("ALTER TABLE checkpoints ADD COLUMN size_bytes INTEGER")
            if "is_admin" not in {row["name"] for row in self._conn.execute("PRAGMA table_info(users)")}:
                self._conn.execute("ALTER TABLE users ADD COLUMN is_admin INTEGER NOT NULL DEFAULT 0")
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

    def secret(self, name: str) -> bytes:
        """A random 256-bit key made the first time ``name`` is asked for and kept in this store
        (what signs download URLs and identity tokens): the same across restarts, never sent."""
        with self._transaction() as conn:
            conn.execute("INSERT OR IGNORE INTO meta (key, value) VALUES (?, ?)", (f"secret:{name}", secrets.token_hex(32)))
            (value,) = conn.execute("SELECT value FROM meta WHERE key = ?", (f"secret:{name}",)).fetchone()
        return bytes.fromhex(value)

    def server_id(self) -> str:
        """A random id made the first time this store is opened: it names this server's
        things in places shared with other servers (its Ray namespace)."""
        with self._transaction() as conn:
            conn.execute("INSERT OR IGNORE INTO meta (key, value) VALUES ('server_id', ?)", (uuid.uuid4().hex,))
            (value,) = conn.execute("SELECT value FROM meta WHERE key = 'server_id'").fetchone()
        return value
