"""Futures: every Tinker operation answers at once with a request id, runs in the background,
and its result is fetched with ``retrieve_future``.

Results live in the store (they survive a restart); waiting is in memory: a poll holds until
the result lands or ``long_poll_s`` passes (answered ``try_again``, which the SDK re-polls at
once), always under the SDK's 45 s read timeout. A training request re-sent with the same
``(model_id, seq_id)`` gets the original future back, whatever its idempotency key. A future
that fails for the server's reasons (category ``server``) carries an error id in its message;
the server's log has the failure, and its trace, under that id.

Every future of a session is also written to its session's trace (:mod:`.traces`), in the
same transactions: submitted, started (:meth:`FutureTable.started`, called where a request is
handed to its worker) and finished.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import time
import uuid
from dataclasses import dataclass
from typing import Any

from opentinker.server.errors import new_error_id
from opentinker.server.store import Store
from opentinker.server.tinker.traces import TraceLog, session_of

log = logging.getLogger("opentinker.server.tinker")

PROTOBUF = "application/x-protobuf"
JSON = "application/json"


@dataclass(frozen=True)
class FutureRow:
    request_id: str
    user_id: int
    model_id: str | None
    seq_id: int | None
    kind: str
    state: str  # pending | done | failed
    content_type: str | None
    result: bytes | None
    error: str | None
    category: str | None
    extra: dict[str, Any]

    def submit_answer(self) -> dict[str, Any]:
        """What the POST that made this future answers (``UntypedAPIFuture``)."""
        answer: dict[str, Any] = {"request_id": self.request_id}
        if self.model_id is not None:
            answer["model_id"] = self.model_id
        return {**answer, **self.extra}


class FutureTable:
    def __init__(self, store: Store, traces: TraceLog | None = None):
        self.store = store
        self.traces = traces
        self._events: dict[str, asyncio.Event] = {}

    def existing(self, model_id: str | None, seq_id: int | None) -> FutureRow | None:
        """The future of a training request already sent with ``(model_id, seq_id)``, if any."""
        if seq_id is None or model_id is None:
            return None
        rows = self.store.query("SELECT * FROM tinker_futures WHERE model_id = ? AND seq_id = ?", (model_id, seq_id))
        return self._row(rows[0]) if rows else None

    def create(self, user_id: int, kind: str, model_id: str | None = None, seq_id: int | None = None,
               extra: dict[str, Any] | None = None, request_id: str | None = None) -> tuple[FutureRow, bool]:
        """A new pending future, or (``False``) the existing one for a re-sent ``(model_id, seq_id)``."""
        existing = self.existing(model_id, seq_id)
        if existing is not None:
            return existing, False
        return self.add(user_id, kind, model_id, seq_id, extra, request_id), True

    def add(self, user_id: int, kind: str, model_id: str | None = None, seq_id: int | None = None,
            extra: dict[str, Any] | None = None, request_id: str | None = None, *, session_id: str | None = None,
            trace_args: dict[str, Any] | None = None) -> FutureRow:
        """A new pending future; the caller knows ``(model_id, seq_id)`` has none yet (:meth:`existing`).
        Traced in its session's trace (``session_id``, else the model's) with ``trace_args``."""
        request_id = request_id or uuid.uuid4().hex
        now, session_id = time.time(), session_id or session_of(model_id)
        with self.store.transaction() as conn:
            conn.execute("INSERT INTO tinker_futures (request_id, user_id, model_id, seq_id, kind, state, extra_json, "
                         "created_at) VALUES (?, ?, ?, ?, ?, 'pending', ?, ?)",
                         (request_id, user_id, model_id, seq_id, kind, json.dumps(extra or {}), now))
            if self.traces is not None and session_id is not None:
                self.traces.submitted(conn, request_id, session_id, user_id, kind, model_id, now, trace_args)
        self._events[request_id] = asyncio.Event()
        return self.get(request_id)

    def get(self, request_id: str, user_id: int | None = None) -> FutureRow | None:
        sql = "SELECT * FROM tinker_futures WHERE request_id = ?" + ("" if user_id is None else " AND user_id = ?")
        rows = self.store.query(sql, (request_id,) if user_id is None else (request_id, user_id))
        return self._row(rows[0]) if rows else None

    def resolve(self, request_id: str, payload: Any, content_type: str = JSON) -> None:
        """``payload``: bytes (a protobuf message) or anything JSON-able."""
        body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        self._finish(request_id, "done", content_type=content_type, result=body)

    def fail(self, request_id: str, message: str, category: str = "server",
             error: BaseException | None = None) -> None:
        """``category`` "user": the client's request was wrong, the message says how. "server":
        an error id is added to the message and the failure logged under it, with the trace of
        ``error`` (default: the exception being handled, as callers fail futures in ``except``)."""
        row = self.get(request_id) if category == "server" else None
        if row is not None and row.state == "pending":  # a finished one stays as it is: nothing to log
            error = error if error is not None else sys.exc_info()[1]
            error_id = new_error_id()
            # Without an exception (a model unloaded under its requests) there is no trace to keep.
            log.log(logging.ERROR if error is not None else logging.WARNING,
                    "tinker %s request %s (model %s) failed: error id %s: %s", row.kind, request_id,
                    row.model_id, error_id, message,
                    exc_info=(type(error), error, error.__traceback__) if error is not None else None)
            message = f"{message} (error id {error_id})"
        self._finish(request_id, "failed", error=message, category=category)

    def started(self, request_id: str) -> None:
        """The request was handed to its worker or sampler (its trace's start)."""
        if self.traces is not None:
            self.traces.started(request_id)

    def _finish(self, request_id: str, state: str, **values: Any) -> None:
        now = time.time()
        with self.store.transaction() as conn:
            conn.execute("UPDATE tinker_futures SET state = ?, content_type = ?, result = ?, error = ?, category = ?, "
                         "finished_at = ? WHERE request_id = ? AND state = 'pending'",
                         (state, values.get("content_type"), values.get("result"), values.get("error"),
                          values.get("category"), now, request_id))
            if self.traces is not None:
                self.traces.finished(conn, request_id, state, now)
        event = self._events.pop(request_id, None)
        if event is not None:
            event.set()

    async def wait(self, request_id: str, user_id: int, timeout: float) -> FutureRow | None:
        """The future once finished, or still pending after ``timeout`` s; None if not the caller's."""
        row = self.get(request_id, user_id)
        if row is None or row.state != "pending":
            return row
        event = self._events.setdefault(request_id, asyncio.Event())
        try:
            await asyncio.wait_for(event.wait(), timeout)
        except asyncio.TimeoutError:
            pass
        return self.get(request_id, user_id)

    def fail_pending(self, message: str) -> int:
        """At startup: whatever was running in the previous process will never finish."""
        error_id = new_error_id()
        with self.store.transaction() as conn:
            cur = conn.execute("UPDATE tinker_futures SET state = 'failed', error = ?, category = 'server', "
                               "finished_at = ? WHERE state = 'pending'",
                               (f"{message} (error id {error_id})", time.time()))
            if self.traces is not None:
                self.traces.fail_pending(conn, time.time())
        if cur.rowcount:
            log.warning("%d tinker request(s) of the previous process failed: error id %s: %s", cur.rowcount,
                        error_id, message)
        return cur.rowcount

    def forget_older_than(self, age_s: float) -> int:
        """Drop finished futures whose results nobody fetched in ``age_s`` s."""
        with self.store.transaction() as conn:
            cur = conn.execute("DELETE FROM tinker_futures WHERE state != 'pending' AND finished_at < ?",
                               (time.time() - age_s,))
        return cur.rowcount

    def pending_count(self, user_id: int, kind: str) -> int:
        rows = self.store.query("SELECT COUNT(*) AS n FROM tinker_futures WHERE user_id = ? AND kind = ? "
                                "AND state = 'pending'", (user_id, kind))
        return int(rows[0]["n"])

    @staticmethod
    def _row(row) -> FutureRow:
        return FutureRow(row["request_id"], row["user_id"], row["model_id"], row["seq_id"], row["kind"], row["state"],
                         row["content_type"], row["result"], row["error"], row["category"],
                         json.loads(row["extra_json"] or "{}"))
