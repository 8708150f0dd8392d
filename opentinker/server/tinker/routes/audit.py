"""``GET /audit``: the audit log as the SDK reads it (``AdminClient.get_audit_log``, and the
deprecated ``RestClient.get_audit_log``): one UTC day of entries, oldest first.

A user reads the entries about themselves; an admin (``opentinker-server admin set-admin``)
reads everyone's, refused keys included. One answer holds at most :data:`MAX_ENTRIES`
entries, the day's newest (``truncated`` is then true; the OpenTinker API's ``GET
/v1/audit`` pages through any number). The SDK's ``event_type`` picks entries by their
event's resource (:data:`~opentinker.server.accounting.audit.CATEGORIES`).
"""

from __future__ import annotations

import datetime as dt
from typing import Any, Literal

from fastapi import Depends, Query

from opentinker.server.accounting.audit import AuditEntry
from opentinker.server.routers.audit import DAY, parse_day
from opentinker.server.store import User
from opentinker.server.tinker.openapi import errors
from opentinker.server.tinker.service import TinkerService
from opentinker.server.tinker.routes.common import iso, service, tinker_router, tinker_user

router = tinker_router()

MAX_ENTRIES = 10_000


def sdk_entry(entry: AuditEntry) -> dict[str, Any]:
    """An entry as the SDK's ``AuditLogEntry``: who, from which key and address, and the
    entry's details in ``event_details``; ``model_id`` / ``tinker_path`` when it names them."""
    details = entry.details
    path = details.get("tinker_path") or details.get("path")
    return {"timestamp": iso(entry.at), "event": entry.event,
            "event_details": {**details, "id": entry.id, "user": entry.user_name, "key": entry.key_prefix,
                              "address": entry.address},
            "model_id": details.get("model_id"),
            "tinker_path": path if isinstance(path, str) and path.startswith("tinker://") else None}


@router.get("/audit", responses=errors(400))
async def audit_log(event_type: Literal["all", "checkpoints", "projects", "teams", "organizations"] = "all",
                    day: str | None = Query(None, pattern=DAY, description="YYYY-MM-DD, a UTC day (default: today)"),
                    user: User = Depends(tinker_user), svc: TinkerService = Depends(service)) -> dict[str, Any]:
    when = parse_day("day", day) if day is not None else dt.datetime.now(dt.timezone.utc).date()
    entries = svc.audit.entries(user_id=None if user.is_admin else user.id, day=when, category=event_type,
                                limit=MAX_ENTRIES + 1)
    truncated = len(entries) > MAX_ENTRIES
    return {"entries": [sdk_entry(entry.seen_by(user)) for entry in reversed(entries[:MAX_ENTRIES])],
            "truncated": truncated}
