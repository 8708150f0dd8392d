"""API keys: ``ot-`` + 43 URL-safe characters, shown once, stored only as a hash.

The keys are 256 bits from :mod:`secrets`, so nobody can guess one or brute-force it from
its hash; a fast unsalted SHA-256 is therefore enough (slow, salted hashes exist for
low-entropy passwords) and lets a request find its key by an indexed lookup of the hash.
That lookup is also why no constant-time comparison is needed: nothing secret is compared
byte by byte, and the hash of a wrong key says nothing about the right one.
"""

from __future__ import annotations

import hashlib
import logging
import math
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from opentinker.server.errors import ApiError
from opentinker.server.audit_hooks import note_refused_key
from opentinker.server.revocation import note_credential
from opentinker.server.store import Store, User

KEY_PREFIX = "ot-"
DISPLAY_PREFIX_CHARS = 8
# The usual cause of a key that never worked: it was made in another data folder than the
# running server's (the admin commands and `serve` each default to $OPENTINKER_DATA_DIR, else
# ~/.opentinker-server). The folder itself is the operator's business, so it is not named.
INVALID_KEY = ("invalid or revoked API key (a key works on the server whose data folder it was made in: "
               "'opentinker-server admin create-key' and 'serve' must be given the same --data-dir or "
               "OPENTINKER_DATA_DIR)")

log = logging.getLogger("opentinker.server.auth")


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def create_user(store: Store, name: str) -> User:
    """A new user; raises ValueError for a blank or taken name."""
    name = name.strip()
    if not name:
        raise ValueError("user name must not be blank")
    return store.create_user(name)


def create_api_key(store: Store, user: User | str) -> str:
    """A new key for ``user`` (a User or a user name); the plaintext is returned once and
    never stored. Raises LookupError for an unknown user name."""
    if isinstance(user, str):
        found = store.get_user(user)
        if found is None:
            raise LookupError(f"no user named {user!r}")
        user = found
    key = KEY_PREFIX + secrets.token_urlsafe(32)
    store.add_api_key(user, hash_key(key), key[:DISPLAY_PREFIX_CHARS])
    return key


def authenticate(store: Store, key: str) -> User | None:
    """The user owning ``key``, or None for an unknown or revoked key."""
    if not key.startswith(KEY_PREFIX):
        return None
    return store.user_for_key_hash(hash_key(key))


def revoke_api_key(store: Store, key: str) -> bool:
    return store.revoke_api_key(hash_key(key))


class FailedAuthLimiter:
    """Wrong API keys per client address, counted in windows of ``window_s`` seconds.

    Past ``limit`` in a window, a wrong key from that address is answered 429 with
    Retry-After (the window's end) instead of 401. A right key from it is still accepted:
    keys are 256 random bits, so this limit is not what stops guessing, and refusing right
    keys would let one client behind a shared address (a NAT, a proxy, loopback) lock out
    everyone else behind it. What it does is push back a client stuck on a wrong key (a
    script retrying in a loop, a scanner) with an answer that says to wait. At most
    ``max_addresses`` are tracked, the least recently failing dropped first, so many
    addresses cannot grow it without bound. Used from the event loop only (no lock).
    """

    def __init__(self, limit: int, window_s: float = 60.0, max_addresses: int = 10_000,
                 clock: Callable[[], float] = time.monotonic):
        self.limit = limit
        self.window_s = window_s
        self.max_addresses = max_addresses
        self._clock = clock
        self._windows: OrderedDict[str, tuple[float, int]] = OrderedDict()  # address -> (start, failures)

    def __len__(self) -> int:
        return len(self._windows)

    def failed(self, address: str) -> float | None:
        """Count a wrong key from ``address``: the seconds it must wait when that puts it
        over the limit, else None."""
        now = self._clock()
        start, failures = self._windows.pop(address, (now, 0))
        if now - start >= self.window_s:
            start, failures = now, 0
        failures += 1
        self._windows[address] = (start, failures)  # the most recent last
        if len(self._windows) > self.max_addresses:
            self._windows.popitem(last=False)
        if failures <= self.limit:
            return None
        if failures == self.limit + 1:
            log.warning("%s sent more than %d wrong API keys within %gs; answering 429 until the minute is over",
                        address, self.limit, self.window_s)
        return start + self.window_s - now


def refuse_key(request: Request, unauthorized: ApiError) -> ApiError:
    """The answer to a wrong API key: ``unauthorized`` (401), or 429 once the client's
    address has sent too many (``app.state.auth_limiter``; None: no limit). Leaves a
    ``key_refused`` audit entry (at most one per address a minute: :mod:`.audit_hooks`)."""
    note_refused_key(request)
    limiter: FailedAuthLimiter | None = getattr(request.app.state, "auth_limiter", None)
    wait = limiter.failed(request.client.host if request.client else "") if limiter is not None else None
    if wait is None:
        return unauthorized
    seconds = max(1, math.ceil(wait))
    return ApiError(429, f"too many wrong API keys from this address (more than {limiter.limit} a minute); "
                         f"retry after {seconds} s with a valid key", headers={"Retry-After": str(seconds)})


# auto_error=False: a missing header must give our 401 body, not FastAPI's 403.
_bearer = HTTPBearer(auto_error=False, description="An API key from `opentinker-server admin create-key USER`.")


def _unauthorized(message: str) -> ApiError:
    return ApiError(401, message, headers={"WWW-Authenticate": "Bearer"})


# The dashboard's login: a random token in an HttpOnly, SameSite=Strict cookie, stored hashed
# like a key (same entropy, same reasoning). A request the cookie authenticates that changes
# something must also carry DASHBOARD_HEADER, which a cross-site form or link cannot set.
SESSION_COOKIE = "ot_session"
DASHBOARD_HEADER = "X-OpenTinker-Dashboard"
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


def new_session_token() -> str:
    return secrets.token_urlsafe(32)


def check_dashboard_header(request: Request) -> None:
    """403 for an unsafe request without ``X-OpenTinker-Dashboard: 1`` (cross-site request forgery)."""
    if request.method not in SAFE_METHODS and request.headers.get(DASHBOARD_HEADER) != "1":
        raise ApiError(403, f"a {request.method} authenticated by the dashboard's session cookie must send the "
                            f"header '{DASHBOARD_HEADER}: 1' (so that other sites cannot make it)")


async def current_user(request: Request, credentials: HTTPAuthorizationCredentials | None = Depends(_bearer)) -> User:
    """FastAPI dependency: the user of the request's ``Authorization: Bearer <key>``, else of
    its dashboard session cookie (unsafe methods then also need the dashboard header)."""
    if credentials is None:
        token = request.cookies.get(SESSION_COOKIE)
        if not token:
            raise _unauthorized("missing API key: send 'Authorization: Bearer <key>'")
        session = request.app.state.store.session(hash_key(token))
        if session is None:
            raise _unauthorized("the dashboard session has ended (expired, logged out or its API key revoked); "
                                "log in again")
        check_dashboard_header(request)
        note_credential(request, "session", hash_key(token))
        return session.user
    key = credentials.credentials.strip()
    user = authenticate(request.app.state.store, key)
    if user is None:
        raise refuse_key(request, _unauthorized(INVALID_KEY))
    note_credential(request, "key", hash_key(key))
    return user
