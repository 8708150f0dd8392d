"""What the dashboard shows besides a user's RL jobs, read from the store: their Tinker
training runs, sessions and checkpoints (a page each, newest first, always filtered by the
user), their usage totals and their newest audit entries. Columns that other parts of the
server add (sessions' ``project_id`` / ``display_name``, checkpoints' ``public``) read as None
on a store without them."""

from __future__ import annotations

import dataclasses

import json
import time
from typing import Any

from opentinker.server.accounting import AuditLog
from opentinker.server.accounting.usage import KINDS
from opentinker.server.accounting.usage_views import UNITS, columns, hour_window, iso, totals
from opentinker.server.store import Store, User

USAGE_WINDOWS = {"last_24h": 1.0, "last_30d": 30.0}  # days


def _page(store: Store, table: str, select: str, user_id: int, limit: int, offset: int,
          where: str = "") -> tuple[list[Any], int]:
    if not columns(store, table):  # the Tinker API has not made its tables in this store yet
        return [], 0
    rows = store.query(f"SELECT {select} FROM {table} WHERE user_id = ?{where} "
                       "ORDER BY created_at DESC, rowid DESC LIMIT ? OFFSET ?", (user_id, limit, offset))
    total = store.query(f"SELECT COUNT(*) AS n FROM {table} WHERE user_id = ?{where}", (user_id,))
    return rows, int(total[0]["n"])


def training_runs(store: Store, user_id: int, limit: int, offset: int) -> dict[str, Any]:
    rows, total = _page(store, "tinker_models", "*", user_id, limit, offset)
    runs = []
    for row in rows:
        spec = json.loads(row["spec_json"])
        runs.append({"model_id": row["model_id"], "session_id": row["session_id"],
                     "base_model": spec.get("named_as", row["base_model"]),
                     "lora_rank": int(spec.get("lora_rank") or 0) or None, "state": row["state"],
                     "created_at": row["created_at"], "last_request_at": row["last_request_at"]})
    return {"runs": runs, "total": total}


def sessions(store: Store, user_id: int, limit: int, offset: int) -> dict[str, Any]:
    have = columns(store, "tinker_sessions")
    extra = "".join(f", {name}" if name in have else f", NULL AS {name}" for name in ("project_id", "display_name"))
    rows, total = _page(store, "tinker_sessions", "session_id, state, created_at, last_seen" + extra, user_id,
                        limit, offset)
    return {"sessions": [{"session_id": r["session_id"], "project_id": r["project_id"],
                          "display_name": r["display_name"], "state": r["state"], "created_at": r["created_at"],
                          "last_seen": r["last_seen"]} for r in rows], "total": total}


def checkpoints(store: Store, user_id: int, limit: int, offset: int) -> dict[str, Any]:
    """Named checkpoints (the sampler snapshots an RL loop makes every step are left out)."""
    public = ", public" if "public" in columns(store, "tinker_checkpoints") else ", NULL AS public"
    rows, total = _page(store, "tinker_checkpoints", "run_id, kind, name, size_bytes, created_at, expires_at" + public,
                        user_id, limit, offset, where=" AND ephemeral = 0")
    return {"checkpoints": [{"path": f"tinker://{r['run_id']}/{r['kind']}/{r['name']}", "kind": r["kind"],
                             "size_bytes": r["size_bytes"], "public": None if r["public"] is None else bool(r["public"]),
                             "created_at": r["created_at"], "expires_at": r["expires_at"]} for r in rows],
            "total": total}


def usage_totals(store: Store, user_id: int, now: float | None = None) -> dict[str, Any]:
    """The user's total of each kind over the last 24 hours and 30 days (whole UTC hours)."""
    now = time.time() if now is None else now
    windows = {}
    for name, days in USAGE_WINDOWS.items():
        start, end = hour_window(days, now)
        found = {kind: quantity for _, kind, quantity in totals(store, user_id=user_id, start=start, end=end)}
        windows[name] = {"start": iso(start), "end": iso(end), "totals": {kind: found.get(kind, 0.0) for kind in KINDS}}
    return {"units": UNITS, **windows}


def audit_entries(audit: AuditLog, user: User, limit: int, before_id: int | None) -> dict[str, Any]:
    """The newest entries about ``user`` (their own, also when they are an admin)."""
    entries = audit.entries(user_id=user.id, limit=limit, before_id=before_id)
    return {"entries": [entry.seen_by(dataclasses.replace(user, is_admin=False)).as_json() for entry in entries],
            "next_before_id": entries[-1].id if len(entries) == limit else None}
