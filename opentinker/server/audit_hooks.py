"""The audit log's hooks into the rest of the server: entries about API keys, and about the
RL jobs' checkpoints.

- ``key_refused``: a wrong, revoked or forged credential, on either API (from
  :func:`opentinker.server.auth.refuse_key`, which both use). The entry names the address
  and the route, never the key. At most one per address per minute: the next one says how
  many were refused meanwhile (``refused_since_last``), so a client looping on a wrong key
  adds one entry a minute, not one a request. At most ``max_addresses`` are tracked (the
  least recently refused dropped first), like :class:`~opentinker.server.auth.FailedAuthLimiter`.
- ``key_use``: a key's first use in each UTC hour, with its prefix (from the store, which
  notes when a key was last used: :attr:`Store.on_key_use`), so at most one per key per hour.
- ``access_denied``: a user asked for another user's job (:func:`record_denied`, from
  :func:`opentinker.server.deps.owned_job`).
- ``checkpoint_create`` of a job's kept checkpoints (:func:`kept_checkpoints`, from the job
  manager, whose ``audit`` :func:`install` sets).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from opentinker.server.store import User


class RefusedKeys:
    """Which refused keys get an entry: the first from an address in each ``window_s``."""

    def __init__(self, window_s: float = 60.0, max_addresses: int = 10_000,
                 clock: Callable[[], float] = time.monotonic):
        self.window_s = window_s
        self.max_addresses = max_addresses
        self._clock = clock
        self._seen: OrderedDict[str, tuple[float, int]] = OrderedDict()  # address -> (last entry, refused since)

    def admit(self, address: str) -> int | None:
        """The refusals from ``address`` since its last entry when this one gets an entry, else None."""
        now = self._clock()
        last, since = self._seen.pop(address, (float("-inf"), 0))
        if now - last < self.window_s:
            self._seen[address] = (last, since + 1)
            return None
        self._seen[address] = (now, 0)
        if len(self._seen) > self.max_addresses:
            self._seen.popitem(last=False)
        return since


def note_refused_key(request: Any) -> None:
    """A ``key_refused`` entry for this request (an HTTP request or a websocket), within the bound."""
    state = request.app.state
    audit = getattr(state, "audit", None)
    if audit is None:  # the app is not started (no store yet)
        return
    refused = getattr(state, "refused_keys", None)
    if refused is None:
        refused = state.refused_keys = RefusedKeys()
    address = request.client.host if request.client else ""
    since = refused.admit(address)
    if since is not None:
        audit.record("key_refused", user_id=None, address=address or None, path=request.url.path,
                     refused_since_last=since)


def record_denied(request: Any, asker: User, owner_id: int, **details: Any) -> None:
    """An ``access_denied`` entry about the owner of what ``asker`` asked for (the OpenTinker
    API's; :meth:`~opentinker.server.accounting.audit.AuditLog.record_denied`)."""
    audit = getattr(request.app.state, "audit", None)
    if audit is not None:
        audit.record_denied(request, asker, owner_id, **details)


def kept_checkpoints(audit: Any, store: Any, user_id: int, job_id: str, events: list[dict[str, Any]]) -> None:
    """A ``checkpoint_create`` entry for each checkpoint a job's runner wrote that was kept
    (measured: it carries ``size_bytes``; one over the bounds became a warning instead)."""
    kept = [e["data"] for e in events if e["type"] == "checkpoint" and e["data"].get("size_bytes") is not None]
    if audit is None or not kept:
        return
    owner = store.user_by_id(user_id)
    for data in kept:
        audit.record("checkpoint_create", user_id=user_id, user_name=owner and owner.name, job_id=job_id,
                     name=data.get("name"), step=data.get("step"), size_bytes=data["size_bytes"])


def install(app: Any) -> None:
    """Hooks the app's audit log (``app.state.audit``) into the store (``key_use``) and the job
    manager (its jobs' kept checkpoints)."""
    audit = app.state.audit

    def key_used(user: User, prefix: str) -> None:
        audit.record("key_use", user_id=user.id, user_name=user.name, key_prefix=prefix)

    app.state.store.on_key_use = key_used
    app.state.manager.audit = audit
