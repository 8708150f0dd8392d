"""``opentinker-server admin audit`` (the audit log as a table, newest first) and ``admin
set-admin`` (who reads everyone's audit log, usage, sessions and checkpoints). Both read and
write the server's SQLite file directly, so they work while the server runs."""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
import time
from typing import Any

from opentinker.server.accounting import AuditEntry, AuditLog
from opentinker.server.store import Store

MAX_LIMIT = 100_000
DETAILS_CHARS = 120  # a table row's details are cut here (GET /v1/audit has them whole)
_COLUMNS = ("time (UTC)", "event", "user", "key", "address", "details")


def _fail(message: str) -> int:
    print(f"opentinker-server: error: {message}", file=sys.stderr)
    return 2


def _details(details: dict[str, Any]) -> str:
    text = " ".join(f"{k}={v if isinstance(v, (str, int, float)) else json.dumps(v)}" for k, v in details.items())
    return text if len(text) <= DETAILS_CHARS else text[:DETAILS_CHARS - 1] + "…"


def _row(entry: AuditEntry) -> tuple[str, ...]:
    return (time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(entry.at)), entry.event, entry.user_name or "-",
            entry.key_prefix or "-", entry.address or "-", _details(entry.details))


def table(entries: list[AuditEntry]) -> str:
    """The entries as aligned columns (in the order given)."""
    rows = [_COLUMNS] + [_row(entry) for entry in entries]
    widths = [max(len(row[i]) for row in rows) for i in range(len(_COLUMNS) - 1)]
    return "\n".join("  ".join([cell.ljust(width) for cell, width in zip(row, widths)] + [row[-1]]).rstrip()
                     for row in rows)


def print_audit(store: Store, args: argparse.Namespace) -> int:
    """``admin audit``: entries of a user (by name: what they did, refused requests included),
    a UTC day or the last hours, some events, at most ``--limit``, newest first."""
    if not 1 <= args.limit <= MAX_LIMIT:
        return _fail(f"--limit {args.limit}: expected 1 to {MAX_LIMIT}")
    if args.user is not None and store.get_user(args.user) is None:
        return _fail(f"no user {args.user!r} (opentinker-server admin list-users)")
    day = None
    if args.day is not None:
        try:
            day = dt.date.fromisoformat(args.day)
        except ValueError:
            return _fail(f"--day {args.day!r}: expected a date, YYYY-MM-DD")
    since = None
    if args.since is not None:
        if not args.since > 0:
            return _fail(f"--since {args.since}: expected a number of hours above 0")
        since = time.time() - args.since * 3600
    entries = AuditLog(store).entries(user_id=None, user_name=args.user, day=day, since=since,
                                      events=tuple(args.event), limit=args.limit)
    if not entries:
        print("no audit entries match")
        return 0
    print(table(entries))
    if len(entries) == args.limit:
        print(f"(the newest {args.limit}; --limit N shows more)")
    return 0


def set_admin(store: Store, name: str, on: bool) -> int:
    """``admin set-admin NAME [--off]`` (and ``create-user NAME --admin``)."""
    if not store.set_admin(name, on):
        return _fail(f"no user {name!r} (opentinker-server admin list-users)")
    user = store.get_user(name)
    AuditLog(store).record("user_admin_set", user_id=user.id, user_name=user.name, admin=on,
                           by="opentinker-server admin")
    if on:
        print(f"{name!r} is an admin: their keys read every user's audit log, usage, sessions and checkpoints "
              "(read-only); undo with: opentinker-server admin set-admin " + name + " --off")
    else:
        print(f"{name!r} is no longer an admin: their keys read only their own things")
    return 0
