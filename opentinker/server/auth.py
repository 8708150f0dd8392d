"""API keys: ``ot-`` + 43 URL-safe characters, shown once, stored only as a hash.

The keys are 256 bits from :mod:`secrets`, so nobody can guess one or brute-force it from
its hash; a fast unsalted SHA-256 is therefore enough (slow, salted hashes exist for
low-entropy passwords) and lets a request find its key by an indexed lookup of the hash.
That lookup is also why no constant-time comparison is needed: nothing secret is compared
byte by byte, and the hash of a wrong key says nothing about the right one.
"""

from __future__ import annotations

import hashlib
import secrets

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from opentinker.server.errors import ApiError
from opentinker.server.store import Store, User

KEY_PREFIX = "ot-"
DISPLAY_PREFIX_CHARS = 8


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
        return session.user
    user = authenticate(request.app.state.store, credentials.credentials.strip())
    if user is None:
        raise _unauthorized("invalid or revoked API key")
    return user
