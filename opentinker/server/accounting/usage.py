"""Usage metering: how much of the server each user's work used, in hourly buckets.

A bucket is ``(hour, user, session or job, base model, kind, cached)`` with a quantity that
writes add to, so the table grows with the hours and things used, never with the requests:

- ``training``: tokens in forward and forward_backward passes (Tinker) and in a job's update
  steps (the RL job API);
- ``sampling_prefill`` / ``sampling_sample``: prompt tokens read and tokens generated;
- ``compute_s``: seconds a worker spent on the user's passes and samples;
- ``checkpoint``: checkpoints written;
- ``storage``: checkpoint bytes kept, as gigabyte-hours (accrued by :meth:`accrue_storage`
  from the sizes on record, so a deleted checkpoint stops counting).

No prices are kept here: an operator who sets some (``--price-*``) gets costs computed from
these quantities where they are read. Buckets older than ``retention_days`` are dropped.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from opentinker.server.store import Store

_SCHEMA = """
CREATE TABLE IF NOT EXISTS usage_buckets (
    hour INTEGER NOT NULL,  -- the bucket's start, a UTC hour boundary in epoch seconds
    user_id INTEGER NOT NULL REFERENCES users(id),
    session_id TEXT NOT NULL DEFAULT '',  -- a Tinker session ('' for none)
    job_id TEXT NOT NULL DEFAULT '',  -- an RL job ('' for none)
    base_model TEXT NOT NULL DEFAULT '',
    kind TEXT NOT NULL,
    cached INTEGER NOT NULL DEFAULT 0,
    quantity REAL NOT NULL,
    PRIMARY KEY (hour, user_id, session_id, job_id, base_model, kind, cached)
);
CREATE INDEX IF NOT EXISTS usage_by_user ON usage_buckets(user_id, hour)
"""

KINDS = ("training", "sampling_prefill", "sampling_sample", "compute_s", "checkpoint", "storage")
TOKEN_KINDS = ("training", "sampling_prefill", "sampling_sample")
HOUR = 3600
_ACCRUED_KEY = "usage_storage_accrued_at"


def hour_of(timestamp: float) -> int:
    return int(timestamp // HOUR) * HOUR


@dataclass(frozen=True)
class UsageBucket:
    hour: int
    user_id: int
    user_name: str
    session_id: str
    job_id: str
    base_model: str
    kind: str
    cached: bool
    quantity: float


@dataclass(frozen=True)
class StoredBytes:
    """Checkpoint bytes one user keeps for one session or job (what storage accrues from)."""

    user_id: int
    size_bytes: int
    session_id: str = ""
    job_id: str = ""
    base_model: str = ""


class UsageMeter:
    def __init__(self, store: Store, retention_days: float = 400.0):
        self.store = store
        self.retention_s = retention_days * 86400.0
        with store.transaction() as conn:
            for statement in _SCHEMA.split(";"):
                if statement.strip():
                    conn.execute(statement)

    def record(self, user_id: int, kind: str, quantity: float, *, session_id: str | None = None,
               job_id: str | None = None, base_model: str | None = None, cached: bool = False,
               at: float | None = None) -> None:
        """Add ``quantity`` of ``kind`` to the bucket of the hour ``at`` (now)."""
        if kind not in KINDS:
            raise ValueError(f"unknown usage kind {kind!r}; expected one of {', '.join(KINDS)}")
        if quantity <= 0:
            return
        with self.store.transaction() as conn:
            self._add(conn, hour_of(time.time() if at is None else at), user_id, session_id or "", job_id or "",
                      base_model or "", kind, cached, quantity)

    @staticmethod
    def _add(conn, hour: int, user_id: int, session_id: str, job_id: str, base_model: str, kind: str, cached: bool,
             quantity: float) -> None:
        conn.execute("INSERT INTO usage_buckets VALUES (?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (hour, user_id, session_id,"
                     " job_id, base_model, kind, cached) DO UPDATE SET quantity = quantity + excluded.quantity",
                     (hour, user_id, session_id, job_id, base_model, kind, int(cached), float(quantity)))

    def accrue_storage(self, stored: Iterable[StoredBytes], now: float | None = None) -> float:
        """Add the gigabyte-hours of ``stored`` (the checkpoint bytes kept now) over the time
        since the last accrual (at most an hour back: a server that was down kept nothing
        running, and the sizes then are unknown). Returns the hours accrued."""
        now = time.time() if now is None else now
        with self.store.transaction() as conn:
            row = conn.execute("SELECT value FROM meta WHERE key = ?", (_ACCRUED_KEY,)).fetchone()
            since = max(float(row[0]) if row else now, now - HOUR)
            hours = max(0.0, now - since) / HOUR
            if hours > 0:
                for item in stored:
                    if item.size_bytes > 0:
                        self._add(conn, hour_of(now), item.user_id, item.session_id, item.job_id, item.base_model,
                                  "storage", False, item.size_bytes / 1e9 * hours)
            conn.execute("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)", (_ACCRUED_KEY, repr(now)))
            conn.execute("DELETE FROM usage_buckets WHERE hour < ?", (hour_of(now - self.retention_s),))
        return hours

    def buckets(self, *, user_id: int | None, start: float, end: float, kinds: Iterable[str] = (),
                session_id: str | None = None) -> list[UsageBucket]:
        """Buckets whose hour starts in ``[start, end)``, of one user (None: everyone's), by hour."""
        sql = ("SELECT b.*, u.name AS user_name FROM usage_buckets b JOIN users u ON u.id = b.user_id "
               "WHERE b.hour >= ? AND b.hour < ?")
        params: list = [start, end]
        if user_id is not None:
            sql, params = sql + " AND b.user_id = ?", params + [user_id]
        if session_id is not None:
            sql, params = sql + " AND b.session_id = ?", params + [session_id]
        kinds = tuple(kinds)
        if kinds:
            sql += " AND b.kind IN (" + ",".join("?" for _ in kinds) + ")"
            params += list(kinds)
        rows = self.store.query(sql + " ORDER BY b.hour, b.quantity DESC", params)
        return [UsageBucket(r["hour"], r["user_id"], r["user_name"], r["session_id"], r["job_id"], r["base_model"],
                            r["kind"], bool(r["cached"]), r["quantity"]) for r in rows]

    def totals(self, *, user_id: int | None, start: float = 0.0, end: float | None = None,
               session_id: str | None = None) -> dict[tuple[str, str], float]:
        """``{(user name, kind): quantity}`` summed over ``[start, end)``."""
        out: dict[tuple[str, str], float] = {}
        for b in self.buckets(user_id=user_id, start=start, end=end if end is not None else time.time() + HOUR,
                              session_id=session_id):
            out[(b.user_name, b.kind)] = out.get((b.user_name, b.kind), 0.0) + b.quantity
        return out


def estimated_cost(kind: str, quantity: float, prices: Mapping[str, float]) -> float | None:
    """USD for ``quantity`` of ``kind`` at the operator's ``prices`` (per million tokens for the
    token kinds, per gigabyte-month of 720 hours for storage, per hour for compute); None if unpriced."""
    price = prices.get(kind)
    if price is None:
        return None
    if kind in TOKEN_KINDS:
        return price * quantity / 1e6
    if kind == "storage":
        return price * quantity / 720.0
    if kind == "compute_s":
        return price * quantity / 3600.0
    return price * quantity
