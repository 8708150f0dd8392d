"""The store's per-job logs: events, the checkpoint index and pushed steps."""

from __future__ import annotations

import json
import sqlite3
import time
from typing import Any

from opentinker.protocol import Event, StepAccepted
from opentinker.server import large_json
from opentinker.server.store.records import CheckpointRecord


class EventTables:
    """A job's event log, checkpoint index and client-mode steps: a part of :class:`~opentinker.server.store.Store`
    (its connection, lock and transactions)."""

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
        "path", "size_bytes"}) is indexed in ``checkpoints`` (path and size stay server-side:
        the event keeps only step and name)."""
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
                    path, size = data.pop("path", None), data.pop("size_bytes", None)
                    if isinstance(data.get("name"), str) and path:
                        conn.execute(
                            "INSERT OR REPLACE INTO checkpoints (job_id, name, step, path, created_at, size_bytes) "
                            "VALUES (?, ?, ?, ?, ?, ?)",
                            (job_id, data["name"], int(data.get("step") or 0), str(path), now, size),
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

    def checkpoint_bytes(self, user_id: int | None = None) -> int:
        """Bytes on disk of the jobs' checkpoints kept: the user's jobs', or (None) every job's."""
        sql = "SELECT COALESCE(SUM(c.size_bytes), 0) AS size FROM checkpoints c"
        if user_id is None:
            return int(self._query(sql)[0]["size"])
        rows = self._query(sql + " JOIN jobs j ON j.job_id = c.job_id WHERE j.user_id = ?", (user_id,))
        return int(rows[0]["size"])

    def all_checkpoint_bytes(self) -> int:
        """Bytes on disk of every checkpoint this server keeps, all users': the jobs' (this index)
        and the Tinker API's (its table in this file, once the API has made it)."""
        total = self.checkpoint_bytes()
        if self._query("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'tinker_checkpoints'"):
            total += int(self._query("SELECT COALESCE(SUM(size_bytes), 0) AS size FROM tinker_checkpoints")[0]["size"])
        return total

    def newest_checkpoint_bytes(self, job_id: str) -> int | None:
        """The size of the job's newest checkpoint kept (None before its first)."""
        rows = self._query("SELECT size_bytes FROM checkpoints WHERE job_id = ? AND size_bytes IS NOT NULL "
                           "ORDER BY step DESC, created_at DESC LIMIT 1", (job_id,))
        return int(rows[0]["size_bytes"]) if rows else None

    def every_checkpoint(self) -> list[CheckpointRecord]:
        """Every job's checkpoints (to measure them again)."""
        return [CheckpointRecord(**dict(r)) for r in self._query("SELECT * FROM checkpoints")]

    def set_checkpoint_size(self, job_id: str, name: str, size: int) -> None:
        with self._transaction() as conn:
            conn.execute("UPDATE checkpoints SET size_bytes = ? WHERE job_id = ? AND name = ?", (size, job_id, name))

    def forget_checkpoint(self, job_id: str, name: str) -> None:
        """Drops a checkpoint from the index (its files are gone)."""
        with self._transaction() as conn:
            conn.execute("DELETE FROM checkpoints WHERE job_id = ? AND name = ?", (job_id, name))

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
