"""The audit log: one row per thing a person would ask about later — who created, deleted,
published, copied or loaded a model or checkpoint, who started or cancelled a job, which key
was used, and which requests were refused (a wrong key, another user's resource).

An entry names its event ``<resource>_<action>`` (the Tinker SDK's convention, e.g.
``checkpoint_publish``), the user it is about (None: unknown, such as a wrong key), the key it
came from (its display prefix, never the key), the client address, and a small JSON object of
details. A user reads the entries about themselves; an admin key or ``opentinker-server admin
audit`` reads all. The table is bounded: entries older than ``retention_days`` and past the
newest ``max_entries`` are dropped when new ones are written (checked every ``PRUNE_EVERY``
writes, so the cost of pruning is spread).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from opentinker.server.store import Store

log = logging.getLogger("opentinker.server.audit")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS audit_log (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    at REAL NOT NULL,
    event TEXT NOT NULL,
    user_id INTEGER,  -- whom it is about (None: nobody known, e.g. a wrong key)
    user_name TEXT,
    key_prefix TEXT,  -- the display prefix of the key used
    address TEXT,
    details_json TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS audit_by_time ON audit_log(at);
CREATE INDEX IF NOT EXISTS audit_by_user ON audit_log(user_id, at)
"""

PRUNE_EVERY = 256
MAX_DETAIL_CHARS = 2000  # a details object longer than this is cut (it is a record, not a payload store)
# The SDK's event_type filter, as event name prefixes.
CATEGORIES: dict[str, tuple[str, ...]] = {
    "all": (),
    "checkpoints": ("checkpoint_",),
    "projects": ("project_", "session_project"),
    "teams": ("user_",),
    "organizations": ("key_", "user_", "access_"),
}


@dataclass(frozen=True)
class AuditEntry:
    id: int
    at: float
    event: str
    user_id: int | None
    user_name: str | None
    key_prefix: str | None
    address: str | None
    details: dict[str, Any]

    def seen_by(self, viewer: Any) -> AuditEntry:
        """The entry as ``viewer`` (a User) may read it: an ``access_denied`` entry is about the
        owner of what was asked for, but the key and address in it are the asker's, which only
        an admin sees (the owner sees who asked, by name)."""
        if viewer.is_admin or "asker" not in self.details:
            return self
        return dataclasses.replace(self, key_prefix=None, address=None)

    def as_json(self) -> dict[str, Any]:
        return {"id": self.id, "time": dt.datetime.fromtimestamp(self.at, dt.timezone.utc).isoformat(),
                "event": self.event, "user": self.user_name, "key": self.key_prefix, "address": self.address,
                "details": self.details}


def key_prefix_of(request: Any, store: Store) -> str | None:
    """The display prefix of the API key a request was authenticated with ("dashboard" for the
    dashboard's cookie), from what the key check noted (:func:`~opentinker.server.revocation.note_credential`)."""
    credential = getattr(request.state, "credential", None)
    if credential is None:
        return None
    if credential.kind != "key":
        return credential.kind
    keys = store.list_api_keys(key_hash=credential.digest)
    return keys[0].prefix if keys else None


def day_window(day: dt.date) -> tuple[float, float]:
    """A UTC day as ``[start, end)`` timestamps."""
    start = dt.datetime.combine(day, dt.time(), dt.timezone.utc).timestamp()
    return start, start + 86400.0


class AuditLog:
    def __init__(self, store: Store, retention_days: float = 90.0, max_entries: int = 1_000_000):
        self.store = store
        self.retention_s = retention_days * 86400.0
        self.max_entries = max_entries
        self._writes = 0
        with store.transaction() as conn:
            for statement in _SCHEMA.split(";"):
                if statement.strip():
                    conn.execute(statement)

    def record(self, event: str, *, user_id: int | None, user_name: str | None = None, key_prefix: str | None = None,
               address: str | None = None, **details: Any) -> None:
        """Add an entry. Never raises: an audit write that fails is logged, and the request it
        describes goes on (a full disk must not turn every request into a 500)."""
        text = json.dumps({k: v for k, v in details.items() if v is not None}, default=str)
        if len(text) > MAX_DETAIL_CHARS:
            text = json.dumps({"truncated": text[:MAX_DETAIL_CHARS]})
        try:
            with self.store.transaction() as conn:
                conn.execute("INSERT INTO audit_log (at, event, user_id, user_name, key_prefix, address, details_json)"
                             " VALUES (?, ?, ?, ?, ?, ?, ?)",
                             (time.time(), event, user_id, user_name, key_prefix, address, text))
                self._writes += 1
                if self._writes % PRUNE_EVERY == 0:
                    self._prune(conn)
        except Exception:  # noqa: BLE001 (see the docstring)
            log.exception("could not write the audit entry %s", event)

    def record_request(self, request: Any, event: str, user: Any, **details: Any) -> None:
        """Add an entry about ``user`` (a User, or None when nobody is known) for this HTTP
        request: the key it was made with (display prefix) and its client address."""
        self.record(event, user_id=None if user is None else user.id, user_name=None if user is None else user.name,
                    key_prefix=key_prefix_of(request, self.store), address=request.client.host if request.client else None,
                    **details)

    def recorder(self, request: Any, user: Any) -> Callable[..., None]:
        """``record(event, **details)`` about ``user`` for this request, to call later (when a
        queued operation lands): the key prefix and address are read now."""
        key_prefix = key_prefix_of(request, self.store)
        address = request.client.host if request.client else None

        def record(event: str, **details: Any) -> None:
            self.record(event, user_id=user.id, user_name=user.name, key_prefix=key_prefix, address=address,
                        **details)

        return record

    def record_denied(self, request: Any, asker: Any, owner_id: int, **details: Any) -> None:
        """An ``access_denied`` entry for a request about another user's thing (answered 404,
        like a missing one), kept about its OWNER, who sees who asked: the asker reads only
        entries about themselves and must not learn from one that the thing exists."""
        owner = self.store.user_by_id(owner_id)
        self.record("access_denied", user_id=owner_id, user_name=owner.name if owner else None,
                    key_prefix=key_prefix_of(request, self.store) if request is not None else None,
                    address=request.client.host if request is not None and request.client else None,
                    asker=asker.name, **details)

    def _prune(self, conn) -> None:
        conn.execute("DELETE FROM audit_log WHERE at < ?", (time.time() - self.retention_s,))
        conn.execute("DELETE FROM audit_log WHERE id <= (SELECT id FROM audit_log ORDER BY id DESC LIMIT 1 OFFSET ?)",
                     (self.max_entries,))

    def prune(self) -> None:
        with self.store.transaction() as conn:
            self._prune(conn)

    def entries(self, *, user_id: int | None, day: dt.date | None = None, category: str = "all",
                events: tuple[str, ...] = (), limit: int = 1000, before_id: int | None = None,
                since: float | None = None, until: float | None = None,
                user_name: str | None = None) -> list[AuditEntry]:
        """Entries about ``user_id`` (None: everyone's), newest first, at most ``limit``: of one
        UTC ``day`` if given, of a ``category`` (``CATEGORIES``) or these exact ``events``, older
        than ``before_id`` (a page's last id) if given, within ``[since, until)`` (timestamps)
        if given. ``user_name``: by the name recorded (an admin's filter: it also finds what a
        user did that is nobody's entry, such as a refused request)."""
        sql, params = "SELECT * FROM audit_log WHERE 1", []
        if user_id is not None:
            sql, params = sql + " AND user_id = ?", params + [user_id]
        if user_name is not None:
            sql, params = sql + " AND user_name = ?", params + [user_name]
        if day is not None:
            sql, params = sql + " AND at >= ? AND at < ?", params + list(day_window(day))
        if since is not None:
            sql, params = sql + " AND at >= ?", params + [since]
        if until is not None:
            sql, params = sql + " AND at < ?", params + [until]
        prefixes = CATEGORIES.get(category, ())
        if prefixes:
            sql += " AND (" + " OR ".join("event LIKE ?" for _ in prefixes) + ")"
            params += [p.replace("_", r"\_") + "%" for p in prefixes]
            sql = sql.replace("LIKE ?", r"LIKE ? ESCAPE '\'")
        if events:
            sql += " AND event IN (" + ",".join("?" for _ in events) + ")"
            params += list(events)
        if before_id is not None:
            sql, params = sql + " AND id < ?", params + [before_id]
        rows = self.store.query(sql + " ORDER BY id DESC LIMIT ?", params + [limit])
        return [AuditEntry(r["id"], r["at"], r["event"], r["user_id"], r["user_name"], r["key_prefix"], r["address"],
                           json.loads(r["details_json"])) for r in rows]
