"""The store's jobs: their rows, statuses and datasets."""

from __future__ import annotations

import json
import sqlite3
import time
from typing import Any

from opentinker.protocol import JobStatus
from opentinker.server import large_json
from opentinker.server.store.records import (
    _JOB_COLUMNS,
    _UNFINISHED,
    DATA_FIELDS,
    JobRecord,
    QuotaExceeded,
    User,
    _job,
    spec_digest,
)


class JobTables:
    """Jobs: creation with quotas, status, listing, resuming: a part of :class:`~opentinker.server.store.Store`
    (its connection, lock and transactions)."""

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
