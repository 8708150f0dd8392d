"""Reading usage back for people: time windows checked, buckets read in bounded pages, totals,
the sessions' projects and metadata, and the checkpoint bytes kept now. Shared by the SDK's
billing routes (``tinker/routes/usage.py``), ``GET /v1/usage`` (``routers/usage.py``), the
dashboard and ``opentinker-server admin usage``; nothing here writes.

Columns other parts of the server add later (``tinker_sessions.project_id`` and
``display_name``) are read when the store has them, and read as None otherwise.
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from opentinker.server.accounting.usage import HOUR, TOKEN_KINDS, UsageBucket
from opentinker.server.store import Store

UNITS = {"training": "tokens", "sampling_prefill": "tokens", "sampling_sample": "tokens", "compute_s": "seconds",
         "checkpoint": "checkpoints", "storage": "GB-hours"}
_CHUNK = 500  # ids per IN (...) query: far under SQLite's limit on parameters


class WindowError(ValueError):
    """A time window a request asked for that cannot be served; the message names the field."""


def utc_datetime(field: str, value: dt.datetime | str) -> dt.datetime:
    """``value`` (a datetime, or RFC 3339 / ISO 8601 text) as an aware UTC datetime; naive
    means UTC. WindowError naming ``field`` when it is not a time."""
    text = value if isinstance(value, str) else value.isoformat()
    if isinstance(value, str):
        try:
            value = dt.datetime.fromisoformat(value.strip())
        except ValueError:
            raise WindowError(f"{field}: {text!r} is not a time; expected RFC 3339, e.g. 2026-07-13T00:00:00Z") from None
    try:
        value = value.replace(tzinfo=dt.timezone.utc) if value.tzinfo is None else value.astimezone(dt.timezone.utc)
        value.timestamp()
    except (OverflowError, ValueError):
        raise WindowError(f"{field}: {text!r} is out of range") from None
    return value


def check_window(start: tuple[str, dt.datetime], end: tuple[str, dt.datetime], max_days: float, *,
                 hour_aligned: bool = False, now: float | None = None) -> tuple[float, float]:
    """``(start, end)`` timestamps of a window given as ``(field name, UTC datetime)`` pairs:
    end after start, at most ``max_days`` long, both on UTC hours with ``hour_aligned`` (then
    start not in the future either). WindowError naming the field otherwise."""
    (start_field, start_at), (end_field, end_at) = start, end
    if hour_aligned:
        for field, value in (start, end):
            if (value.minute, value.second, value.microsecond) != (0, 0, 0):
                raise WindowError(f"{field}: {value.isoformat()} is not on a UTC hour boundary; give a whole hour, "
                                  f"e.g. {value.replace(minute=0, second=0, microsecond=0).isoformat()}")
        now = dt.datetime.now(dt.timezone.utc).timestamp() if now is None else now
        if start_at.timestamp() > now:
            raise WindowError(f"{start_field}: {start_at.isoformat()} is in the future")
    if end_at <= start_at:
        raise WindowError(f"{end_field}: {end_at.isoformat()} must be after {start_field} ({start_at.isoformat()})")
    if end_at - start_at > dt.timedelta(days=max_days):
        raise WindowError(f"{end_field}: the window from {start_field} is {(end_at - start_at).total_seconds() / 86400:g}"
                          f" days; at most {max_days:g} days")
    return start_at.timestamp(), end_at.timestamp()


def iso(timestamp: float) -> str:
    return dt.datetime.fromtimestamp(timestamp, dt.timezone.utc).isoformat().replace("+00:00", "Z")


def _where(user_id: int | None, start: float, end: float, kinds: Iterable[str], job_id: str | None,
           session_id: str | None) -> tuple[str, list[Any]]:
    sql, params = " WHERE b.hour >= ? AND b.hour < ?", [start, end]
    for column, value in (("b.user_id", user_id), ("b.job_id", job_id), ("b.session_id", session_id)):
        if value is not None:
            sql, params = sql + f" AND {column} = ?", params + [value]
    kinds = tuple(kinds)
    if kinds:
        sql += " AND b.kind IN (" + ",".join("?" for _ in kinds) + ")"
        params += list(kinds)
    return sql, params


def read_buckets(store: Store, *, user_id: int | None, start: float, end: float, kinds: Iterable[str] = (),
                 job_id: str | None = None, session_id: str | None = None, limit: int = 1000,
                 offset: int = 0) -> list[UsageBucket]:
    """A page of the buckets whose hour begins in ``[start, end)``, of one user (None: all),
    by hour and then largest first (the SDK's order)."""
    where, params = _where(user_id, start, end, kinds, job_id, session_id)
    rows = store.query("SELECT b.*, u.name AS user_name FROM usage_buckets b JOIN users u ON u.id = b.user_id"
                       + where + " ORDER BY b.hour, b.quantity DESC, b.rowid LIMIT ? OFFSET ?",
                       params + [limit, offset])
    return [UsageBucket(r["hour"], r["user_id"], r["user_name"], r["session_id"], r["job_id"], r["base_model"],
                        r["kind"], bool(r["cached"]), r["quantity"]) for r in rows]


def totals(store: Store, *, user_id: int | None, start: float, end: float, kinds: Iterable[str] = (),
           job_id: str | None = None, session_id: str | None = None) -> list[tuple[str, str, float]]:
    """``(user name, kind, quantity)`` summed over the window, by user name and kind."""
    where, params = _where(user_id, start, end, kinds, job_id, session_id)
    rows = store.query("SELECT u.name AS user_name, b.kind, SUM(b.quantity) AS quantity FROM usage_buckets b "
                       "JOIN users u ON u.id = b.user_id" + where + " GROUP BY u.name, b.kind ORDER BY u.name, b.kind",
                       params)
    return [(r["user_name"], r["kind"], float(r["quantity"])) for r in rows]


def columns(store: Store, table: str) -> set[str]:
    return {row["name"] for row in store.query(f"PRAGMA table_info({table})")}


@dataclass(frozen=True)
class SessionFacts:
    project_id: str | None
    display_name: str | None
    user_metadata: dict[str, str] | None


def session_facts(store: Store, session_ids: Iterable[str]) -> dict[str, SessionFacts]:
    """Project, display name and user metadata of each of these Tinker sessions the store
    still has (a forgotten one is left out)."""
    have = columns(store, "tinker_sessions")
    if not have:
        return {}
    extra = "".join(f", {name}" if name in have else f", NULL AS {name}" for name in ("project_id", "display_name"))
    ids, found = sorted(set(session_ids)), {}
    for i in range(0, len(ids), _CHUNK):
        chunk = ids[i:i + _CHUNK]
        rows = store.query(f"SELECT session_id, metadata_json{extra} FROM tinker_sessions WHERE session_id IN ("
                           + ",".join("?" for _ in chunk) + ")", chunk)
        for row in rows:
            metadata = json.loads(row["metadata_json"] or "null")
            metadata = {str(k): str(v) for k, v in metadata.items()} if isinstance(metadata, dict) and metadata else None
            found[row["session_id"]] = SessionFacts(row["project_id"], row["display_name"], metadata)
    return found


@dataclass(frozen=True)
class StoredNow:
    """Checkpoints one user keeps in one project (None: none, or an RL job's) now."""

    project_id: str | None
    user_name: str
    count: int
    size_bytes: int


def checkpoint_storage(store: Store, *, user_id: int | None, project_id: str | None = None) -> list[StoredNow]:
    """The checkpoints kept now, by project and owner: the Tinker API's (a checkpoint's project
    is its model's session's) and, unless a project is asked for, the RL jobs'."""
    found: dict[tuple[str | None, str], tuple[int, int]] = {}

    def add(project: str | None, name: str, count: int, size: int) -> None:
        old = found.get((project, name), (0, 0))
        found[(project, name)] = (old[0] + count, old[1] + size)

    if columns(store, "tinker_checkpoints"):
        has_project = "project_id" in columns(store, "tinker_sessions")
        sql = ("SELECT " + ("s.project_id" if has_project else "NULL") + " AS project_id, u.name AS user_name, "
               "COUNT(*) AS n, COALESCE(SUM(c.size_bytes), 0) AS size FROM tinker_checkpoints c "
               "JOIN users u ON u.id = c.user_id LEFT JOIN tinker_models m ON m.model_id = c.run_id "
               "LEFT JOIN tinker_sessions s ON s.session_id = m.session_id WHERE 1")
        params: list[Any] = []
        if user_id is not None:
            sql, params = sql + " AND c.user_id = ?", params + [user_id]
        if project_id is not None:
            if not has_project:
                return []
            sql, params = sql + " AND s.project_id = ?", params + [project_id]
        for row in store.query(sql + " GROUP BY 1, 2", params):
            add(row["project_id"], row["user_name"], row["n"], row["size"])
    if project_id is None:
        sql = ("SELECT u.name AS user_name, COUNT(*) AS n, COALESCE(SUM(c.size_bytes), 0) AS size FROM checkpoints c "
               "JOIN jobs j ON j.job_id = c.job_id JOIN users u ON u.id = j.user_id")
        params = []
        if user_id is not None:
            sql, params = sql + " WHERE j.user_id = ?", [user_id]
        for row in store.query(sql + " GROUP BY u.name", params):
            add(None, row["user_name"], row["n"], row["size"])
    return [StoredNow(project, name, count, size) for (project, name), (count, size) in
            sorted(found.items(), key=lambda item: (item[0][0] or "", item[0][1]))]


def hour_window(days: float, now: float) -> tuple[float, float]:
    """The last ``days`` as a window of whole hours (the current one included)."""
    end = (now // HOUR + 1) * HOUR
    return end - days * 86400.0, end


__all__ = ["TOKEN_KINDS", "UNITS", "WindowError", "check_window", "checkpoint_storage", "hour_window", "iso",
           "read_buckets", "session_facts", "totals", "utc_datetime"]
