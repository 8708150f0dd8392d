"""Billing usage as the SDK reads it (``AdminClient`` / ``RestClient.get_billing_usage`` and
``get_current_checkpoint_storage_usage``), from the server's usage meter
(:mod:`opentinker.server.accounting`).

A user reads their own usage; an admin user (``opentinker-server admin set-admin``) everyone's.
RL jobs' usage is there too, with no session. ``compute_s`` is not a kind the SDK knows: it
is left out here (``GET /v1/usage`` and the dashboard show it). Costs are estimates from the
operator's ``--price`` flags, null without them.
"""

from __future__ import annotations

from typing import Any

from fastapi import Depends, Query

from opentinker.server.accounting.usage import HOUR, TOKEN_KINDS, UsageBucket, estimated_cost
from opentinker.server.accounting.usage_views import (
    WindowError,
    check_window,
    checkpoint_storage,
    iso,
    read_buckets,
    session_facts,
    utc_datetime,
)
from opentinker.server.store import User
from opentinker.server.tinker.identity import URN_PREFIX  # the SDK's user urn, as the identity tokens' subject
from opentinker.server.tinker.openapi import errors
from opentinker.server.tinker.routes.common import service, tinker_router, tinker_user, user_error
from opentinker.server.tinker.service import TinkerService

router = tinker_router()

SDK_KINDS = ("training", "sampling_prefill", "sampling_sample", "checkpoint", "storage")
MAX_DAYS = 14  # the SDK's documented window
MAX_EVENTS = 20_000  # one answer's events (about 8 MB of JSON); a longer answer: ask a shorter window


def _event_info(bucket: UsageBucket) -> dict[str, Any]:
    quantity = bucket.quantity
    if bucket.kind == "storage":
        return {"type": "storage", "free": False, "gigabyte_hours": quantity}
    if bucket.kind == "checkpoint":
        return {"type": "checkpoint", "count": round(quantity)}
    info = {"type": bucket.kind, "token_count": round(quantity)}
    return {**info, "cached": bucket.cached} if bucket.kind == "sampling_prefill" else info


def _event(bucket: UsageBucket, project_id: str | None, prices: dict[str, float]) -> dict[str, Any]:
    rate = prices.get(bucket.kind)
    return {
        "bucket_start": iso(bucket.hour), "bucket_end": iso(bucket.hour + HOUR),
        "base_model": bucket.base_model or None, "user_id": URN_PREFIX + bucket.user_name,
        "user_name": bucket.user_name, "session_id": bucket.session_id or None, "project_id": project_id,
        "estimated_cost_usd": estimated_cost(bucket.kind, bucket.quantity, prices),
        "effective_rate_usd_per_million_tokens": rate if bucket.kind in TOKEN_KINDS else None,
        "effective_rate_usd_per_gigabyte_month": rate if bucket.kind == "storage" else None,
        "event_info": _event_info(bucket),
    }


@router.get("/billing/usage/events", responses=errors(400))
async def billing_usage_events(
    starting_on: str | None = Query(None, max_length=64, description="inclusive start, a UTC hour (RFC 3339)"),
    ending_before: str | None = Query(None, max_length=64,
                                      description=f"exclusive end, a UTC hour at most {MAX_DAYS} days later"),
    user: User = Depends(tinker_user), svc: TinkerService = Depends(service),
) -> dict[str, Any]:
    """``get_billing_usage``: hourly usage buckets of the window (yours; an admin's: everyone's)."""
    try:
        window = []
        for field, value in (("starting_on", starting_on), ("ending_before", ending_before)):
            if value is None:
                raise WindowError(f"{field} is required (a UTC hour, RFC 3339: 2026-07-13T00:00:00Z)")
            window.append((field, utc_datetime(field, value)))
        start, end = check_window(window[0], window[1], MAX_DAYS, hour_aligned=True)
    except WindowError as error:
        raise user_error(str(error)) from None
    store = svc.state.store
    buckets = read_buckets(store, user_id=None if user.is_admin else user.id, start=start, end=end, kinds=SDK_KINDS,
                           limit=MAX_EVENTS + 1)
    if len(buckets) > MAX_EVENTS:
        raise user_error(f"ending_before: the window holds more than {MAX_EVENTS} usage events, the most one answer "
                         "carries; ask for a shorter window")
    facts = session_facts(store, {bucket.session_id for bucket in buckets if bucket.session_id})
    prices = svc.settings.prices
    data = [_event(bucket, facts[bucket.session_id].project_id if bucket.session_id in facts else None, prices)
            for bucket in buckets]
    sessions = {bucket.session_id: {"user_metadata": facts[bucket.session_id].user_metadata
                                    if bucket.session_id in facts else None}
                for bucket in buckets if bucket.session_id}
    return {"data": data, "sessions": sessions, "cost_data_through": None}


@router.get("/billing/usage/checkpoints/current", responses=errors(400))
async def current_checkpoint_storage(
    project_id: str | None = Query(None, max_length=256, description="only this project's checkpoints"),
    user: User = Depends(tinker_user), svc: TinkerService = Depends(service),
) -> dict[str, Any]:
    """``get_current_checkpoint_storage_usage``: the checkpoints kept now, by project and owner
    (yours; an admin's: everyone's), the RL jobs' with no project."""
    rate = svc.settings.prices.get("storage")
    data = []
    for item in checkpoint_storage(svc.state.store, user_id=None if user.is_admin else user.id, project_id=project_id):
        gigabytes = item.size_bytes / 1e9
        data.append({"project_id": item.project_id, "org_user_urn": URN_PREFIX + item.user_name, "user_email": None,
                     "user_name": item.user_name, "checkpoint_count": item.count, "size_bytes": item.size_bytes,
                     "size_gigabytes": gigabytes,
                     "estimated_monthly_cost_usd": None if rate is None else rate * gigabytes})
    return {"effective_rate_usd_per_gigabyte_month": rate, "data": data}
