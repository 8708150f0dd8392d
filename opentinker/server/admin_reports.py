"""``opentinker-server admin usage``: what each user's work used (tokens trained and sampled,
compute seconds, checkpoints written, checkpoint GB-hours), read straight from the server's
SQLite file, so it works while the server runs. Quantities only: prices are the running
server's (``--price``), and ``GET /v1/usage`` or the SDK's billing calls show the costs."""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Callable

from opentinker.server.accounting.usage import KINDS, UsageMeter
from opentinker.server.accounting.usage_views import UNITS, WindowError, hour_window, iso, totals, utc_datetime
from opentinker.server.store import Store

DEFAULT_DAYS = 30.0


def usage_window(since_days: float | None, start: str | None, end: str | None,
                 now: float | None = None) -> tuple[float, float]:
    """The report's window: ``--start``/``--end`` (UTC times or dates), else the last
    ``--since`` days (default 30) up to the end of the current hour. ValueError naming the flag."""
    now = time.time() if now is None else now
    if start is None and end is None:
        days = DEFAULT_DAYS if since_days is None else since_days
        if days <= 0:
            raise ValueError(f"--since {days:g}: expected a number of days > 0")
        return hour_window(days, now)
    if since_days is not None:
        raise ValueError("give --since or --start/--end, not both")
    try:
        end_at = utc_datetime("--end", end) if end is not None else dt.datetime.fromtimestamp(
            hour_window(0, now)[1], dt.timezone.utc)
        start_at = utc_datetime("--start", start) if start is not None else end_at - dt.timedelta(days=DEFAULT_DAYS)
    except WindowError as error:
        raise ValueError(str(error).replace("RFC 3339", "ISO 8601")) from None
    if end_at <= start_at:
        raise ValueError(f"--end {end_at.isoformat()} must be after --start {start_at.isoformat()}")
    return start_at.timestamp(), end_at.timestamp()


def _quantity(kind: str, quantity: float) -> str:
    if kind == "storage":
        return f"{quantity:.6g}"
    if kind == "compute_s":
        return f"{quantity:.2f}"
    return str(round(quantity))


def print_usage(store: Store, user_name: str | None, since_days: float | None, start: str | None, end: str | None,
                out: Callable[[str], None] = print) -> None:
    """A table of quantities per user and kind. ValueError for an unknown user or a bad window."""
    first, last = usage_window(since_days, start, end)
    user_id = None
    if user_name is not None:
        user = store.get_user(user_name)
        if user is None:
            raise ValueError(f"no user {user_name!r} (opentinker-server admin list-users)")
        user_id = user.id
    UsageMeter(store)  # the table, on a store no server has opened yet
    rows = totals(store, user_id=user_id, start=first, end=last)
    out(f"usage of buckets from {iso(first)} to {iso(last)} (UTC hours)"
        + (f" of {user_name!r}" if user_name else ""))
    if not rows:
        out("no usage recorded in this window")
        return
    order = {kind: i for i, kind in enumerate(KINDS)}
    out("user\tkind\tquantity\tunit")
    for name, kind, quantity in sorted(rows, key=lambda row: (row[0], order.get(row[1], len(order)))):
        out(f"{name}\t{kind}\t{_quantity(kind, quantity)}\t{UNITS.get(kind, '')}")
