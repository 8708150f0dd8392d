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


async def current_user(request: Request, credentials: HTTPAuthorizationCredentials | None = Depends(_bearer)) -> User:
    """FastAPI dependency: the user of the request's ``Authorization: Bearer <key>``."""
    if credentials is None:
        raise _unauthorized("missing API key: send 'Authorization: Bearer <key>'")
    user = authenticate(request.app.state.store, credentials.credentials.strip())
    if user is None:
        raise _unauthorized("invalid or revoked API key")
    return user
