"""``GET /v1/audit``: the audit log (:mod:`opentinker.server.accounting.audit`), newest
first, a page at a time: who created, deleted or shared what, on either API, which key was
used, which requests were refused.

A user reads the entries about themselves; an admin user reads everyone's (or one user's:
``user``), refused keys included. Entries of one UTC ``day``, or of a window (``since``,
``until``), or all that are kept; of the named ``event`` s only, if given. A page holds at
most ``limit`` (at most 1,000) entries; ``next_before_id`` asks for the next (older) page.
"""

from __future__ import annotations

import datetime as dt
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Request
from pydantic import BaseModel, Field, StringConstraints

from opentinker.json_value import MAX_INT
from opentinker.server.auth import current_user
from opentinker.server.errors import AUTHENTICATED_ERRORS, ApiError, error_responses, not_found
from opentinker.server.store import User

router = APIRouter(tags=["audit"], responses=AUTHENTICATED_ERRORS)

MAX_PAGE = 1000
MAX_EVENTS = 32
EventName = Annotated[str, StringConstraints(pattern=r"^[a-z][a-z_]{0,63}$")]


class AuditEntryInfo(BaseModel):
    id: int = Field(description="ascending with time; a page's last id is the next page's before_id")
    time: str = Field(description="UTC, ISO 8601")
    event: str = Field(description="<resource>_<action>, e.g. job_create, checkpoint_download, key_refused")
    user: str | None = Field(description="whom the entry is about (null: nobody known, e.g. a wrong key)")
    key: str | None = Field(description="the first characters of the API key used (never the key)")
    address: str | None = Field(description="the client's address")
    details: dict[str, Any]


class AuditPage(BaseModel):
    entries: list[AuditEntryInfo] = Field(description="newest first")
    next_before_id: int | None = Field(description="before_id of the next (older) page; null: this is the last")


DAY = r"^\d{4}-\d{2}-\d{2}$"
# Times and days are read here, not by pydantic, which also takes numbers (unix times) for them.
TIME = r"^\d{4}-\d{2}-\d{2}([T ]\d{2}:\d{2}(:\d{2}(\.\d{1,6})?)?)?(Z|[+-]\d{2}:\d{2})?$"


def parse_day(field: str, value: str) -> dt.date:
    try:
        return dt.date.fromisoformat(value)
    except ValueError:
        raise ApiError(400, f"{field}: {value!r} is not a date; expected YYYY-MM-DD", {"field": field}) from None


def _timestamp(field: str, value: str) -> float:
    """ISO 8601; naive means UTC."""
    try:
        moment = dt.datetime.fromisoformat(value.replace("Z", "+00:00"))
        return (moment.replace(tzinfo=dt.timezone.utc) if moment.tzinfo is None else moment).timestamp()
    except (OverflowError, ValueError):
        raise ApiError(400, f"{field}: {value!r} is not a time; expected ISO 8601, e.g. 2026-07-13T00:00:00Z",
                       {"field": field}) from None


@router.get("/audit", response_model=AuditPage, summary="The audit log: what was done, by whom, from which key",
            responses=error_responses(400, 404))
async def audit_log(
    request: Request,
    day: str | None = Query(None, pattern=DAY, description="only this UTC day (YYYY-MM-DD); not with since/until"),
    since: str | None = Query(None, pattern=TIME, description="only entries at or after this time (ISO 8601; naive: "
                                                              "UTC)"),
    until: str | None = Query(None, pattern=TIME, description="only entries before this time (ISO 8601; naive: UTC)"),
    event: list[EventName] = Query([], max_length=MAX_EVENTS, description="only these events (repeatable)"),
    user: str | None = Query(None, max_length=200, description="an admin: only this user's (default: everyone's)"),
    before_id: int | None = Query(None, ge=1, le=MAX_INT, description="only entries older than this id (paging)"),
    limit: int = Query(100, ge=1, le=MAX_PAGE, description="entries in this page"),
    caller: User = Depends(current_user),
) -> AuditPage:
    if day is not None and (since is not None or until is not None):
        raise ApiError(400, "day: give a day or a window (since, until), not both", {"field": "day"})
    whose: dict[str, Any] = {"user_id": caller.id}
    if user is not None and user != caller.name:
        if not caller.is_admin:  # someone else's entries read like no such user
            raise not_found(f"user {user!r}")
        whose = {"user_id": None, "user_name": user}  # by name: also what they did that is nobody's entry
    elif caller.is_admin:
        whose = {"user_id": None, "user_name": user}
    audit = request.app.state.audit
    entries = audit.entries(**whose, day=None if day is None else parse_day("day", day), events=tuple(event),
                            before_id=before_id, limit=limit + 1,
                            since=None if since is None else _timestamp("since", since),
                            until=None if until is None else _timestamp("until", until))
    page = [AuditEntryInfo(**entry.seen_by(caller).as_json()) for entry in entries[:limit]]
    return AuditPage(entries=page, next_before_id=page[-1].id if len(entries) > limit else None)
