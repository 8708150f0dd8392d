"""``GET /v1/usage``: what the caller's work used, from the usage meter
(:mod:`opentinker.server.accounting.usage`): tokens trained and sampled, compute seconds,
checkpoints written and checkpoint GB-hours, in hourly buckets, for the RL job API (by job)
and the Tinker API (by session) alike. An admin user reads everyone's (or one user's:
``user``). Costs are estimates from the operator's ``--price`` flags, null without them.
"""

from __future__ import annotations

import datetime as dt

from fastapi import APIRouter, Depends, Query, Request
from pydantic import BaseModel, Field

from opentinker.json_value import MAX_INT
from opentinker.server.accounting.usage import KINDS, estimated_cost
from opentinker.server.accounting.usage_views import (
    UNITS,
    WindowError,
    check_window,
    iso,
    read_buckets,
    totals,
    utc_datetime,
)
from opentinker.server.auth import current_user
from opentinker.server.errors import AUTHENTICATED_ERRORS, ApiError, error_responses, not_found
from opentinker.server.store import User

router = APIRouter(tags=["usage"], responses=AUTHENTICATED_ERRORS)

MAX_DAYS = 31
DEFAULT_DAYS = 1
MAX_PAGE = 5000


class UsageTotal(BaseModel):
    user: str
    kind: str = Field(description=f"one of {', '.join(KINDS)}")
    unit: str = Field(description="tokens, seconds, checkpoints or GB-hours")
    quantity: float
    estimated_cost_usd: float | None = Field(description="from the operator's --price; null without one")


class UsageBucketInfo(UsageTotal):
    hour: str = Field(description="the bucket's UTC hour (its start)")
    job_id: str | None = Field(description="the RL job the usage was for (null: Tinker API usage)")
    session_id: str | None = Field(description="the Tinker session the usage was for (null: an RL job's)")
    base_model: str | None
    cached: bool = Field(description="sampling_prefill served from a prompt cache (never, here)")


class UsageReport(BaseModel):
    start: str
    end: str
    user: str | None = Field(description="whose usage (null: everyone's, for an admin)")
    totals: list[UsageTotal] = Field(description="each user's total of each kind over the window")
    buckets: list[UsageBucketInfo] = Field(description="a page of the hourly buckets, by hour")
    next_offset: int | None = Field(description="the offset of the next page (null: this is the last)")


def _window(start: str | None, end: str | None) -> tuple[float, float]:
    try:
        end_at = utc_datetime("end", end) if end is not None else dt.datetime.now(dt.timezone.utc)
        start_at = utc_datetime("start", start) if start is not None else end_at - dt.timedelta(days=DEFAULT_DAYS)
        return check_window(("start", start_at), ("end", end_at), MAX_DAYS)
    except (WindowError, OverflowError) as error:
        raise ApiError(400, str(error) if isinstance(error, WindowError) else "start: out of range") from None


@router.get("/usage", response_model=UsageReport, summary="What your jobs and Tinker sessions used",
            responses=error_responses(400, 404))
async def usage(
    request: Request,
    # Text, read here: a time the schema's date-time format allows but Python cannot hold (a
    # leap second, year 0) is a 400 naming the field, not a 422.
    start: str | None = Query(None, max_length=64, description=f"from, an RFC 3339 time (default: {DEFAULT_DAYS} "
                                                               "day before end); buckets whose hour begins in "
                                                               "[start, end)"),
    end: str | None = Query(None, max_length=64, description=f"until, an RFC 3339 time (default: now); at most "
                                                             f"{MAX_DAYS} days after start"),
    user: str | None = Query(None, max_length=200, description="an admin: only this user's (default: everyone's)"),
    job_id: str | None = Query(None, max_length=64, description="only this RL job's usage"),
    session_id: str | None = Query(None, max_length=256, description="only this Tinker session's usage"),
    limit: int = Query(1000, ge=1, le=MAX_PAGE, description="buckets in this page"),
    offset: int = Query(0, ge=0, le=MAX_INT),
    caller: User = Depends(current_user),
) -> UsageReport:
    first, last = _window(start, end)
    store = request.app.state.store
    whose: int | None = caller.id
    if user is not None and user != caller.name:
        other = store.get_user(user) if caller.is_admin else None
        if other is None:  # someone else's usage reads like no such user
            raise not_found(f"user {user!r}")
        whose = other.id
    elif user is None and caller.is_admin:
        whose = None
    prices = request.app.state.settings.prices
    filters = {"user_id": whose, "start": first, "end": last, "job_id": job_id, "session_id": session_id}
    page = read_buckets(store, **filters, limit=limit + 1, offset=offset)
    return UsageReport(
        start=iso(first), end=iso(last), user=None if whose is None else (user or caller.name),
        totals=[UsageTotal(user=name, kind=kind, unit=UNITS[kind], quantity=quantity,
                           estimated_cost_usd=estimated_cost(kind, quantity, prices))
                for name, kind, quantity in totals(store, **filters)],
        buckets=[UsageBucketInfo(hour=iso(b.hour), user=b.user_name, job_id=b.job_id or None,
                                 session_id=b.session_id or None, base_model=b.base_model or None, kind=b.kind,
                                 unit=UNITS[b.kind], cached=b.cached, quantity=b.quantity,
                                 estimated_cost_usd=estimated_cost(b.kind, b.quantity, prices)) for b in page[:limit]],
        next_offset=offset + limit if len(page) > limit else None,
    )

