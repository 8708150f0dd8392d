"""What the Tinker API keeps across restarts, in the server's SQLite file: sessions, models,
futures, checkpoints and sampling sessions, each row owned by one user.

Lookups always filter by the caller's user id, so another user's session, model, future or
checkpoint reads exactly like a missing one; the exception is a checkpoint's lookup by path,
which finds anyone's, so that ``TinkerService.readable_checkpoint`` can let others read one
its owner published (and ``owned_checkpoint`` keep the changes to the owner).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

from opentinker.server.store import Store

_SCHEMA = """
CREATE TABLE IF NOT EXISTS tinker_sessions (
    session_id TEXT PRIMARY KEY,
    user_id INTEGER NOT NULL REFERENCES users(id),
    tags_json TEXT NOT NULL,
    metadata_json TEXT NOT NULL,
    state TEXT NOT NULL,  -- active | finished | expired
    created_at REAL NOT NULL,
    last_seen REAL NOT NULL,
    project_id TEXT NOT NULL DEFAULT 'default',  -- a name in the user's own namespace
    display_name TEXT,
    finish_reason TEXT  -- what the client said at finish: success | errored | interrupted
);
CREATE TABLE IF NOT EXISTS tinker_models (
    model_id TEXT PRIMARY KEY,  -- "<session_id>:train:<model_seq_id>", also its training run id
    session_id TEXT NOT NULL,
    user_id INTEGER NOT NULL REFERENCES users(id),
    base_model TEXT NOT NULL,
    spec_json TEXT NOT NULL,  -- lora_rank, train_attn, train_mlp, train_unembed, adapts_unembed, seed
    metadata_json TEXT,
    state TEXT NOT NULL,  -- loading | ready | failed | lost | unloaded
    error TEXT,
    created_at REAL NOT NULL,
    last_request_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS tinker_futures (
    request_id TEXT PRIMARY KEY,
    user_id INTEGER NOT NULL REFERENCES users(id),
    model_id TEXT,
    seq_id INTEGER,
    kind TEXT NOT NULL,
    state TEXT NOT NULL,  -- pending | done | failed
    content_type TEXT,
    result BLOB,
    error TEXT,
    category TEXT,
    extra_json TEXT,  -- what the submit answer carries besides the id (sample_sequence_ids)
    created_at REAL NOT NULL,
    finished_at REAL
);
CREATE UNIQUE INDEX IF NOT EXISTS tinker_futures_by_seq ON tinker_futures(model_id, seq_id)
    WHERE seq_id IS NOT NULL;
CREATE TABLE IF NOT EXISTS tinker_checkpoints (
    run_id TEXT NOT NULL,
    kind TEXT NOT NULL,  -- weights | sampler_weights | external_weights
    name TEXT NOT NULL,
    user_id INTEGER NOT NULL REFERENCES users(id),
    folder TEXT NOT NULL,
    size_bytes INTEGER,
    ephemeral INTEGER NOT NULL DEFAULT 0,
    metadata_json TEXT,
    created_at REAL NOT NULL,
    expires_at REAL,
    public INTEGER NOT NULL DEFAULT 0,  -- published: readable (never changeable) by every user
    PRIMARY KEY (run_id, kind, name)
);
CREATE TABLE IF NOT EXISTS tinker_samplers (
    sampler_id TEXT PRIMARY KEY,
    user_id INTEGER NOT NULL REFERENCES users(id),
    session_id TEXT,
    base_model TEXT NOT NULL,
    model_path TEXT,  -- the tinker:// path it samples from (None: the base model)
    created_at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS tinker_sessions_by_user ON tinker_sessions(user_id, state, created_at);
CREATE INDEX IF NOT EXISTS tinker_models_by_session ON tinker_models(session_id);
CREATE INDEX IF NOT EXISTS tinker_samplers_by_session ON tinker_samplers(session_id, created_at);
CREATE INDEX IF NOT EXISTS tinker_samplers_by_user ON tinker_samplers(user_id, created_at);
CREATE INDEX IF NOT EXISTS tinker_checkpoints_by_user ON tinker_checkpoints(user_id);
"""


@dataclass(frozen=True)
class ModelRow:
    model_id: str
    session_id: str
    user_id: int
    base_model: str
    spec: dict[str, Any]
    metadata: dict[str, str] | None
    state: str
    error: str | None
    created_at: float
    last_request_at: float

    @property
    def lora_rank(self) -> int:
        return int(self.spec.get("lora_rank", 0))


@dataclass(frozen=True)
class CheckpointRow:
    run_id: str
    kind: str
    name: str
    user_id: int
    folder: str
    size_bytes: int | None
    ephemeral: bool
    metadata: dict[str, str] | None
    created_at: float
    expires_at: float | None
    public: bool = False  # published by its owner: readable by every user, changeable by the owner only

    @property
    def tinker_path(self) -> str:
        return f"tinker://{self.run_id}/{self.kind}/{self.name}"


@dataclass(frozen=True)
class SamplerRow:
    sampler_id: str
    user_id: int
    session_id: str | None
    base_model: str
    model_path: str | None


def unembed_adapted(spec: dict[str, Any]) -> bool:
    """Whether a model recorded with ``spec`` has an adapter on its unembedding. Specs recorded
    before ``train_unembed`` took effect lack ``adapts_unembed``: their models (and checkpoints)
    have none, and a model loaded from one must match them."""
    return bool(spec.get("train_unembed", True)) and bool(spec.get("adapts_unembed", False))


DEFAULT_PROJECT = "default"  # a session created without a project_id is in it
# Session columns added after the first release, with their SQL type (old stores get them at open).
_ADDED_SESSION_COLUMNS = {"project_id": f"TEXT NOT NULL DEFAULT '{DEFAULT_PROJECT}'", "display_name": "TEXT",
                          "finish_reason": "TEXT"}


def _loads(text: str | None) -> Any:
    return None if text is None else json.loads(text)


class TinkerState:
    """The tables. Rows a client can add without bound are capped here: ended sessions beyond
    a user's newest ``keep_ended_sessions`` are forgotten (with their samplers, and their
    models that left no checkpoint), and so are a session's samplers beyond its newest
    ``samplers_per_session`` and a user's beyond ``samplers_per_user``."""

    def __init__(self, store: Store, keep_ended_sessions: int = 1000, samplers_per_session: int = 256,
                 samplers_per_user: int = 4096):
        self.store = store
        self.keep_ended_sessions = keep_ended_sessions
        self.samplers_per_session = samplers_per_session
        self.samplers_per_user = samplers_per_user
        with store.transaction() as conn:
            for statement in _SCHEMA.split(";"):
                if statement.strip():
                    conn.execute(statement)
            session_columns = {row["name"] for row in conn.execute("PRAGMA table_info(tinker_sessions)")}
            for column, sql_type in _ADDED_SESSION_COLUMNS.items():
                if column not in session_columns:  # a store made before the column existed
                    conn.execute(f"ALTER TABLE tinker_sessions ADD COLUMN {column} {sql_type}")
            conn.execute("CREATE INDEX IF NOT EXISTS tinker_sessions_by_project "
                         "ON tinker_sessions(user_id, project_id)")
            checkpoint_columns = {row["name"] for row in conn.execute("PRAGMA table_info(tinker_checkpoints)")}
            if "public" not in checkpoint_columns:  # a store made before checkpoints could be published
                conn.execute("ALTER TABLE tinker_checkpoints ADD COLUMN public INTEGER NOT NULL DEFAULT 0")
            # A copy (copy_weights) shares its source's folder: a folder goes when no row names it.
            conn.execute("CREATE INDEX IF NOT EXISTS tinker_checkpoints_by_folder ON tinker_checkpoints(folder)")

    # sessions -------------------------------------------------------------------------
    def create_session(self, session_id: str, user_id: int, tags: list[str], metadata: dict[str, Any],
                       project_id: str = DEFAULT_PROJECT, display_name: str | None = None) -> None:
        now = round(time.time(), 6)  # microseconds: what a search cursor carries
        with self.store.transaction() as conn:
            conn.execute("INSERT INTO tinker_sessions (session_id, user_id, tags_json, metadata_json, state, "
                         "created_at, last_seen, project_id, display_name) VALUES (?, ?, ?, ?, 'active', ?, ?, ?, ?)",
                         (session_id, user_id, json.dumps(tags), json.dumps(metadata), now, now, project_id,
                          display_name))
            forgotten = [row[0] for row in conn.execute(
                "SELECT session_id FROM tinker_sessions WHERE user_id = ? AND state != 'active' "
                "ORDER BY created_at DESC, rowid DESC LIMIT -1 OFFSET ?", (user_id, self.keep_ended_sessions))]
            for session in forgotten:
                conn.execute("DELETE FROM tinker_samplers WHERE session_id = ?", (session,))
                conn.execute("DELETE FROM tinker_models WHERE session_id = ? AND state NOT IN ('loading', 'ready') "
                             "AND model_id NOT IN (SELECT run_id FROM tinker_checkpoints)", (session,))
                conn.execute("DELETE FROM tinker_sessions WHERE session_id = ?", (session,))

    def active_sessions(self, user_id: int) -> int:
        rows = self.store.query("SELECT COUNT(*) AS n FROM tinker_sessions WHERE user_id = ? AND state = 'active'",
                                (user_id,))
        return int(rows[0]["n"])

    def session_state(self, session_id: str, user_id: int) -> str | None:
        rows = self.store.query("SELECT state FROM tinker_sessions WHERE session_id = ? AND user_id = ?",
                                (session_id, user_id))
        return rows[0]["state"] if rows else None

    def touch_session(self, session_id: str) -> None:
        with self.store.transaction() as conn:
            conn.execute("UPDATE tinker_sessions SET last_seen = ? WHERE session_id = ?", (time.time(), session_id))

    def end_session(self, session_id: str, state: str) -> None:
        with self.store.transaction() as conn:
            conn.execute("UPDATE tinker_sessions SET state = ? WHERE session_id = ? AND state = 'active'",
                         (state, session_id))

    def sessions(self, user_id: int | None, limit: int, offset: int) -> tuple[list[str], int]:
        """A page of the user's session ids (None: every user's), newest first, and how many there are."""
        where, params = ("", ()) if user_id is None else (" WHERE user_id = ?", (user_id,))
        rows = self.store.query(f"SELECT session_id FROM tinker_sessions{where} "
                                "ORDER BY created_at DESC, rowid DESC LIMIT ? OFFSET ?", params + (limit, offset))
        total = self.store.query(f"SELECT COUNT(*) AS n FROM tinker_sessions{where}", params)
        return [row["session_id"] for row in rows], int(total[0]["n"])

    def session_owner(self, session_id: str) -> int | None:
        """Whose session it is, whoever asks (to tell a missing session from another user's)."""
        rows = self.store.query("SELECT user_id FROM tinker_sessions WHERE session_id = ?", (session_id,))
        return int(rows[0]["user_id"]) if rows else None

    def note_finish_reason(self, session_id: str, reason: str) -> None:
        """The client's reason, kept while the session is active (the first finish wins)."""
        with self.store.transaction() as conn:
            conn.execute("UPDATE tinker_sessions SET finish_reason = ? WHERE session_id = ? AND state = 'active' "
                         "AND finish_reason IS NULL", (reason, session_id))

    def session_samplers(self, session_id: str) -> list[str]:
        rows = self.store.query("SELECT sampler_id FROM tinker_samplers WHERE session_id = ? ORDER BY created_at",
                                (session_id,))
        return [row["sampler_id"] for row in rows]

    def idle_sessions(self, idle_s: float) -> list[str]:
        rows = self.store.query("SELECT session_id FROM tinker_sessions WHERE state = 'active' AND last_seen < ?",
                                (time.time() - idle_s,))
        return [row["session_id"] for row in rows]

    # models ---------------------------------------------------------------------------
    def add_model(self, model_id: str, session_id: str, user_id: int, base_model: str, spec: dict[str, Any],
                  metadata: dict[str, str] | None) -> None:
        now = time.time()
        with self.store.transaction() as conn:
            conn.execute("INSERT INTO tinker_models VALUES (?, ?, ?, ?, ?, ?, 'loading', NULL, ?, ?)",
                         (model_id, session_id, user_id, base_model, json.dumps(spec),
                          None if metadata is None else json.dumps(metadata), now, now))

    def set_model_state(self, model_id: str, state: str, error: str | None = None) -> None:
        with self.store.transaction() as conn:
            conn.execute("UPDATE tinker_models SET state = ?, error = ? WHERE model_id = ?", (state, error, model_id))

    def touch_model(self, model_id: str) -> None:
        with self.store.transaction() as conn:
            conn.execute("UPDATE tinker_models SET last_request_at = ? WHERE model_id = ?", (time.time(), model_id))

    def model(self, model_id: str, user_id: int | None = None) -> ModelRow | None:
        sql = "SELECT * FROM tinker_models WHERE model_id = ?" + ("" if user_id is None else " AND user_id = ?")
        rows = self.store.query(sql, (model_id,) if user_id is None else (model_id, user_id))
        return self._model(rows[0]) if rows else None

    def models(self, user_id: int, session_id: str | None = None) -> list[ModelRow]:
        sql = "SELECT * FROM tinker_models WHERE user_id = ?" + ("" if session_id is None else " AND session_id = ?")
        params = (user_id,) if session_id is None else (user_id, session_id)
        return [self._model(row) for row in self.store.query(sql + " ORDER BY created_at", params)]

    def session_models(self, session_id: str) -> list[str]:
        rows = self.store.query("SELECT model_id FROM tinker_models WHERE session_id = ?", (session_id,))
        return [row["model_id"] for row in rows]

    def mark_models_lost(self, reason: str) -> int:
        """At startup: the models that lived in the previous process's actors are gone."""
        with self.store.transaction() as conn:
            cur = conn.execute("UPDATE tinker_models SET state = 'lost', error = ? "
                               "WHERE state IN ('loading', 'ready')", (reason,))
        return cur.rowcount

    @staticmethod
    def _model(row) -> ModelRow:
        return ModelRow(row["model_id"], row["session_id"], row["user_id"], row["base_model"],
                        json.loads(row["spec_json"]), _loads(row["metadata_json"]), row["state"], row["error"],
                        row["created_at"], row["last_request_at"])

    # checkpoints ----------------------------------------------------------------------
    def add_checkpoint(self, row: CheckpointRow) -> None:
        with self.store.transaction() as conn:
            conn.execute("INSERT OR REPLACE INTO tinker_checkpoints (run_id, kind, name, user_id, folder, size_bytes, "
                         "ephemeral, metadata_json, created_at, expires_at, public) "
                         "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                         (row.run_id, row.kind, row.name, row.user_id, row.folder, row.size_bytes,
                          int(row.ephemeral), None if row.metadata is None else json.dumps(row.metadata),
                          row.created_at, row.expires_at, int(row.public)))

    def checkpoint(self, run_id: str, kind: str, name: str, user_id: int | None) -> CheckpointRow | None:
        """The user's checkpoint (``user_id`` None: whoever's, for the published-checkpoint and
        signed-link lookups, which decide themselves who may have it)."""
        sql = "SELECT * FROM tinker_checkpoints WHERE run_id = ? AND kind = ? AND name = ?"
        params: tuple = (run_id, kind, name)
        if user_id is not None:
            sql, params = sql + " AND user_id = ?", params + (user_id,)
        rows = self.store.query(sql, params)
        return self._checkpoint(rows[0]) if rows else None

    def public_checkpoints(self, run_id: str) -> list[CheckpointRow]:
        """A run's published checkpoints (what another user sees of it)."""
        rows = self.store.query("SELECT * FROM tinker_checkpoints WHERE run_id = ? AND public = 1 ORDER BY created_at",
                                (run_id,))
        return [self._checkpoint(row) for row in rows]

    def set_public(self, row: CheckpointRow, public: bool) -> None:
        with self.store.transaction() as conn:
            conn.execute("UPDATE tinker_checkpoints SET public = ? WHERE run_id = ? AND kind = ? AND name = ?",
                         (int(public), row.run_id, row.kind, row.name))

    def set_expiry(self, row: CheckpointRow, expires_at: float | None) -> None:
        with self.store.transaction() as conn:
            conn.execute("UPDATE tinker_checkpoints SET expires_at = ? WHERE run_id = ? AND kind = ? AND name = ?",
                         (expires_at, row.run_id, row.kind, row.name))

    def folder_in_use(self, folder: str) -> bool:
        """Whether a checkpoint row still names ``folder`` (a copy shares its source's)."""
        return bool(self.store.query("SELECT 1 FROM tinker_checkpoints WHERE folder = ? LIMIT 1", (folder,)))

    def checkpoints(self, user_id: int, run_id: str | None = None, ephemeral: bool = False) -> list[CheckpointRow]:
        sql = "SELECT * FROM tinker_checkpoints WHERE user_id = ? AND ephemeral = ?"
        params: tuple = (user_id, int(ephemeral))
        if run_id is not None:
            sql, params = sql + " AND run_id = ?", params + (run_id,)
        return [self._checkpoint(row) for row in self.store.query(sql + " ORDER BY created_at", params)]

    def checkpoint_usage(self, user_id: int) -> tuple[int, int]:
        """How many checkpoints the user has (ephemeral ones included) and their bytes on disk."""
        rows = self.store.query("SELECT COUNT(*) AS n, COALESCE(SUM(size_bytes), 0) AS size FROM tinker_checkpoints "
                                "WHERE user_id = ?", (user_id,))
        return int(rows[0]["n"]), int(rows[0]["size"])

    def latest_checkpoint_size(self, run_id: str, kind: str) -> int | None:
        """The size of the run's newest checkpoint of ``kind``, if it has one."""
        rows = self.store.query("SELECT size_bytes FROM tinker_checkpoints WHERE run_id = ? AND kind = ? AND "
                                "size_bytes IS NOT NULL ORDER BY created_at DESC LIMIT 1", (run_id, kind))
        return int(rows[0]["size_bytes"]) if rows else None

    def unsized_checkpoints(self) -> list[CheckpointRow]:
        rows = self.store.query("SELECT * FROM tinker_checkpoints WHERE size_bytes IS NULL")
        return [self._checkpoint(row) for row in rows]

    def set_checkpoint_size(self, row: CheckpointRow, size: int) -> None:
        with self.store.transaction() as conn:
            conn.execute("UPDATE tinker_checkpoints SET size_bytes = ? WHERE run_id = ? AND kind = ? AND name = ?",
                         (size, row.run_id, row.kind, row.name))

    def delete_checkpoint(self, row: CheckpointRow) -> None:
        """Deletes that write of it: a checkpoint saved again under its name (a folder of its
        own) stays."""
        with self.store.transaction() as conn:
            conn.execute("DELETE FROM tinker_checkpoints WHERE run_id = ? AND kind = ? AND name = ? AND folder = ?",
                         (row.run_id, row.kind, row.name, row.folder))

    def ephemeral_beyond(self, run_id: str, keep: int) -> list[CheckpointRow]:
        """A model's ephemeral sampler snapshots past the newest ``keep``."""
        rows = self.store.query("SELECT * FROM tinker_checkpoints WHERE run_id = ? AND ephemeral = 1 "
                                "ORDER BY created_at DESC", (run_id,))
        return [self._checkpoint(row) for row in rows[keep:]]

    def expired_checkpoints(self, session_ids: list[str] = ()) -> list[CheckpointRow]:
        """Named checkpoints past their TTL, and ephemeral ones of the given (ended) sessions."""
        rows = list(self.store.query("SELECT * FROM tinker_checkpoints WHERE expires_at IS NOT NULL "
                                     "AND expires_at < ?", (time.time(),)))
        for session_id in session_ids:
            rows += self.store.query("SELECT c.* FROM tinker_checkpoints c JOIN tinker_models m ON "
                                     "c.run_id = m.model_id WHERE m.session_id = ? AND c.ephemeral = 1", (session_id,))
        return [self._checkpoint(row) for row in rows]

    @staticmethod
    def _checkpoint(row) -> CheckpointRow:
        return CheckpointRow(row["run_id"], row["kind"], row["name"], row["user_id"], row["folder"],
                             row["size_bytes"], bool(row["ephemeral"]), _loads(row["metadata_json"]),
                             row["created_at"], row["expires_at"], bool(row["public"]))

    # samplers -------------------------------------------------------------------------
    def add_sampler(self, row: SamplerRow) -> None:
        with self.store.transaction() as conn:
            conn.execute("INSERT OR REPLACE INTO tinker_samplers VALUES (?, ?, ?, ?, ?, ?)",
                         (row.sampler_id, row.user_id, row.session_id, row.base_model, row.model_path, time.time()))
            # An RL loop makes a sampler every step: the oldest are forgotten (their ephemeral
            # snapshots are long gone: a model keeps its newest few).
            conn.execute("DELETE FROM tinker_samplers WHERE sampler_id IN (SELECT sampler_id FROM tinker_samplers "
                         "WHERE session_id = ? ORDER BY created_at DESC, rowid DESC LIMIT -1 OFFSET ?)",
                         (row.session_id, self.samplers_per_session))
            conn.execute("DELETE FROM tinker_samplers WHERE sampler_id IN (SELECT sampler_id FROM tinker_samplers "
                         "WHERE user_id = ? ORDER BY created_at DESC, rowid DESC LIMIT -1 OFFSET ?)",
                         (row.user_id, self.samplers_per_user))

    def sampler(self, sampler_id: str, user_id: int) -> SamplerRow | None:
        rows = self.store.query("SELECT * FROM tinker_samplers WHERE sampler_id = ? AND user_id = ?",
                                (sampler_id, user_id))
        if not rows:
            return None
        row = rows[0]
        return SamplerRow(row["sampler_id"], row["user_id"], row["session_id"], row["base_model"], row["model_path"])
