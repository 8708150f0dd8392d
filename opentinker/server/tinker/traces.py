"""Session traces: every Tinker request of a session with its timings, kept so that
``RestClient.export_session_trace`` can show the session's timeline.

A row per request (its future): kind, request id, model, when it was submitted, handed to
the worker (``started_at``; None for what has no queue of its own, such as a model's
creation) and finished, its status (pending | done | failed) and a few counts known at
submit (tokens, datums, samples). The futures table forgets results after ``future_ttl_s``;
this one keeps the newest ``max_per_session`` requests of each session (older ones go as new
ones come), at most ``max_rows`` over all sessions, and a session's rows go once the session
itself is forgotten (:meth:`TraceLog.forget_orphans`, from the housekeeping).

:func:`chrome_trace` turns the rows into Chrome's trace-event JSON (which Perfetto's UI and
chrome://tracing open): it is JSON, not Perfetto's ``.pftrace`` protobuf, whatever the SDK's
docstring calls the file.
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from opentinker.server.store import Store

_SCHEMA = """
CREATE TABLE IF NOT EXISTS tinker_traces (
    request_id TEXT PRIMARY KEY,
    session_id TEXT NOT NULL,
    seq INTEGER NOT NULL,  -- the n-th traced request of its session (what "newest N" counts)
    user_id INTEGER NOT NULL,
    kind TEXT NOT NULL,  -- the future's kind: ForwardBackward, OptimStep, Sample, SaveWeights, ...
    model_id TEXT,
    submitted_at REAL NOT NULL,
    started_at REAL,
    finished_at REAL,
    status TEXT NOT NULL,  -- pending | done | failed
    args_json TEXT
);
CREATE INDEX IF NOT EXISTS tinker_traces_by_session ON tinker_traces(session_id, seq)
"""

MAX_PER_SESSION = 20_000
MAX_ROWS = 2_000_000
FORGET_EVERY_S = 300.0
_SEQ_CACHE = 10_000  # sessions whose next number is remembered (others are read again)

#: The SDK's names of the future kinds (what a user called).
KIND_NAMES = {"ForwardBackward": "forward_backward", "Forward": "forward", "OptimStep": "optim_step",
              "Sample": "sample", "SaveWeights": "save_state", "SaveWeightsForSampler": "save_weights_for_sampler",
              "LoadWeights": "load_state", "CreateModel": "create_model"}


def session_of(model_id: str | None) -> str | None:
    """The session of a training model (its id is ``<session_id>:train:<n>``, state.py)."""
    if not model_id or ":train:" not in model_id:
        return None
    return model_id.split(":train:", 1)[0]


@dataclass(frozen=True)
class TraceRow:
    request_id: str
    session_id: str
    kind: str
    model_id: str | None
    submitted_at: float
    started_at: float | None
    finished_at: float | None
    status: str
    args: dict[str, Any]


class TraceLog:
    def __init__(self, store: Store, max_per_session: int = MAX_PER_SESSION, max_rows: int = MAX_ROWS):
        self.store = store
        self.max_per_session = max_per_session
        self.max_rows = max_rows
        self._next_seq: OrderedDict[str, int] = OrderedDict()  # session -> its next number
        self._forgot_at = float("-inf")
        with store.transaction() as conn:
            for statement in _SCHEMA.split(";"):
                if statement.strip():
                    conn.execute(statement)

    # Written inside the futures' own transactions (``conn``): no extra commit per request.
    def submitted(self, conn: sqlite3.Connection, request_id: str, session_id: str, user_id: int, kind: str,
                  model_id: str | None, at: float, args: dict[str, Any] | None = None) -> None:
        seq = self._next_seq.pop(session_id, None)
        if seq is None:
            (last,) = conn.execute("SELECT COALESCE(MAX(seq), 0) FROM tinker_traces WHERE session_id = ?",
                                   (session_id,)).fetchone()
            seq = int(last) + 1
        self._next_seq[session_id] = seq + 1
        if len(self._next_seq) > _SEQ_CACHE:
            self._next_seq.popitem(last=False)
        conn.execute("INSERT OR IGNORE INTO tinker_traces (request_id, session_id, seq, user_id, kind, model_id, "
                     "submitted_at, status, args_json) VALUES (?, ?, ?, ?, ?, ?, ?, 'pending', ?)",
                     (request_id, session_id, seq, user_id, kind, model_id, at, json.dumps(args or {})))
        # The session's oldest beyond its newest max_per_session (one row, by the index).
        conn.execute("DELETE FROM tinker_traces WHERE session_id = ? AND seq <= ?",
                     (session_id, seq - self.max_per_session))

    def finished(self, conn: sqlite3.Connection, request_id: str, status: str, at: float) -> None:
        conn.execute("UPDATE tinker_traces SET status = ?, finished_at = ? WHERE request_id = ? AND status = 'pending'",
                     (status, at, request_id))

    def fail_pending(self, conn: sqlite3.Connection, at: float) -> None:
        conn.execute("UPDATE tinker_traces SET status = 'failed', finished_at = ? WHERE status = 'pending'", (at,))

    def started(self, request_id: str) -> None:
        """The request was handed to its worker (a model's queue) or its sampler."""
        with self.store.transaction() as conn:
            conn.execute("UPDATE tinker_traces SET started_at = ? WHERE request_id = ? AND started_at IS NULL",
                         (time.time(), request_id))

    def forget_orphans(self, every_s: float = FORGET_EVERY_S) -> None:
        """Rows of sessions no longer kept (state.py forgets a user's oldest ended ones), and
        the oldest rows past ``max_rows``. Both read the whole table, so this runs at most once
        every ``every_s`` seconds however often it is called."""
        if time.monotonic() - self._forgot_at < every_s:
            return
        self._forgot_at = time.monotonic()
        with self.store.transaction() as conn:
            conn.execute("DELETE FROM tinker_traces WHERE session_id NOT IN (SELECT session_id FROM tinker_sessions)")
            # rowid grows with each insert: the newest max_rows are the highest.
            cut = conn.execute("SELECT rowid FROM tinker_traces ORDER BY rowid DESC LIMIT 1 OFFSET ?",
                               (self.max_rows,)).fetchone()
            if cut is not None:
                conn.execute("DELETE FROM tinker_traces WHERE rowid <= ?", (cut[0],))

    def rows(self, session_id: str) -> list[TraceRow]:
        """The session's requests in the order they were submitted."""
        rows = self.store.query("SELECT * FROM tinker_traces WHERE session_id = ? ORDER BY seq", (session_id,))
        return [TraceRow(r["request_id"], r["session_id"], r["kind"], r["model_id"], r["submitted_at"],
                         r["started_at"], r["finished_at"], r["status"], json.loads(r["args_json"] or "{}"))
                for r in rows]


def _us(seconds: float) -> int:
    return int(round(seconds * 1e6))


SAMPLING_TID = 1000  # sampling lanes: 1000, 1001, ... (models: 1, 2, ...)


def chrome_trace(session_id: str, rows: list[TraceRow], now: float | None = None) -> dict[str, Any]:
    """The session as Chrome trace-event JSON: one complete event (``ph: X``, times in µs)
    per request; one track per model, whose requests run one after another (a request starts
    when handed to the worker or when the one before it ended, whichever is later, so the
    slices never overlap), and sampling on tracks of its own, overlapping calls on separate
    lanes. A request still running ends at ``now``. Each event's ``args`` carry the request
    id, status, the time it waited and the counts known at submit."""
    now = time.time() if now is None else now
    events: list[dict[str, Any]] = [{"name": "process_name", "ph": "M", "pid": 1, "tid": 0,
                                     "args": {"name": f"tinker session {session_id}"}}]
    model_tids: dict[str, int] = {}
    model_end: dict[int, float] = {}
    lanes: list[float] = []  # each sampling lane's last end
    for row in rows:
        end = row.finished_at if row.finished_at is not None else now
        begin = row.started_at if row.started_at is not None else row.submitted_at
        if row.model_id is not None:
            tid = model_tids.get(row.model_id)
            if tid is None:
                tid = model_tids[row.model_id] = len(model_tids) + 1
                events.append({"name": "thread_name", "ph": "M", "pid": 1, "tid": tid,
                               "args": {"name": f"model {row.model_id}"}})
            begin = max(begin, model_end.get(tid, begin))
            model_end[tid] = max(end, begin)
        else:
            lane = next((i for i, last in enumerate(lanes) if last <= begin), None)
            if lane is None:
                lane = len(lanes)
                lanes.append(begin)
                events.append({"name": "thread_name", "ph": "M", "pid": 1, "tid": SAMPLING_TID + lane,
                               "args": {"name": "sampling" if lane == 0 else f"sampling (lane {lane + 1})"}})
            lanes[lane] = max(end, begin)
            tid = SAMPLING_TID + lane
        args = {"request_id": row.request_id, "status": row.status, "model_id": row.model_id,
                "queued_ms": round(max(0.0, begin - row.submitted_at) * 1000, 3), **row.args}
        events.append({"name": KIND_NAMES.get(row.kind, row.kind), "cat": "sample" if row.model_id is None else "train",
                       "ph": "X", "ts": _us(begin), "dur": max(0, _us(end) - _us(begin)), "pid": 1, "tid": tid,
                       "args": {k: v for k, v in args.items() if v is not None}})
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"session_id": session_id, "format": "Chrome trace-event JSON (not .pftrace protobuf)"}}
