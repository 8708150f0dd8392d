"""Identity tokens: the short-lived JWTs the ``tinker`` SDK trades its API key for.

With ``pjwt_auth_enabled`` in ``/client/config`` the SDK posts its key to ``/auth/token`` and
then sends the token instead of the key, trading again at about half its lifetime (and at
once after a 401 marked ``invalid_token``); ``RestClient.whoami`` reads the token's claims.

A token is HS256 over ``{"sub": "tml:user:<name>", "org_id": <server id>, "email": "",
"iat", "exp", "key_sha256"}`` under a key kept in the store (``Store.secret``). It names the
API key it was traded for by that key's SHA-256 (what the store keeps, never the key): each
request looks the key up again, so revoking it stops its tokens at once, and the request is
watched under it like a key's (revocation.CredentialWatch). Stdlib only: the format is three
base64url parts, and the one algorithm accepted is fixed here, never read from a token.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import time
from collections.abc import Callable
from dataclasses import dataclass

from opentinker.server.store import User

URN_PREFIX = "tml:user:"
MAX_TOKEN_CHARS = 4096  # far above a real one (~400): checked before any decoding
_HEADER = {"alg": "HS256", "typ": "JWT"}


class InvalidToken(Exception):
    """Not a token this server made, or altered since (the message says which part)."""


class ExpiredToken(InvalidToken):
    """A token of this server past its ``exp``: the SDK trades its key for a new one."""


@dataclass(frozen=True)
class Claims:
    subject: str  # tml:user:<name>
    key_sha256: str  # the API key it was traded for (its hash)
    issued_at: int
    expires_at: int


def user_urn(user: User) -> str:
    return URN_PREFIX + user.name


def looks_like_token(credential: str) -> bool:
    """A JWT (``eyJ`` is base64url of ``{"``), as opposed to an API key (``tml-ot-...``)."""
    return credential.startswith("eyJ")


def _b64encode(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _b64decode(part: str) -> bytes:
    return base64.urlsafe_b64decode(part + "=" * (-len(part) % 4))


def _json_part(data: dict) -> str:
    return _b64encode(json.dumps(data, separators=(",", ":"), sort_keys=True).encode("utf-8"))


class IdentityTokens:
    """Makes and checks tokens under ``secret`` (32 random bytes), valid ``lifetime_s``."""

    def __init__(self, secret: bytes, org_id: str, lifetime_s: int, clock: Callable[[], float] = time.time):
        if lifetime_s < 1:
            raise ValueError(f"identity_token_s must be at least 1 second, got {lifetime_s}")
        self._secret = secret
        self.org_id = org_id
        self.lifetime_s = int(lifetime_s)
        self._clock = clock

    def _signature(self, signed: str) -> str:
        return _b64encode(hmac.new(self._secret, signed.encode("ascii"), hashlib.sha256).digest())

    def mint(self, user: User, key_sha256: str) -> str:
        now = int(self._clock())
        claims = {"sub": user_urn(user), "org_id": self.org_id, "email": "", "iat": now,
                  "exp": now + self.lifetime_s, "key_sha256": key_sha256}
        signed = _json_part(_HEADER) + "." + _json_part(claims)
        return signed + "." + self._signature(signed)

    def verify(self, token: str) -> Claims:
        """The claims of a token this server made and that has not expired; else InvalidToken
        (ExpiredToken for one that only expired). Whether its key still works is the caller's
        check (a lookup in the store)."""
        if len(token) > MAX_TOKEN_CHARS:
            raise InvalidToken(f"the identity token is longer than {MAX_TOKEN_CHARS} characters")
        parts = token.split(".")
        if len(parts) != 3 or not token.isascii():
            raise InvalidToken("the identity token is not a JWT (three base64url parts)")
        # The signature first: nothing of a token is read before it is known to be ours.
        if not hmac.compare_digest(self._signature(parts[0] + "." + parts[1]), parts[2]):
            raise InvalidToken("the identity token's signature does not match: not made by this server, or altered")
        try:
            header = json.loads(_b64decode(parts[0]))
            claims = json.loads(_b64decode(parts[1]))
            result = Claims(str(claims["sub"]), str(claims["key_sha256"]), int(claims["iat"]), int(claims["exp"]))
        except (ValueError, KeyError, TypeError, binascii.Error) as error:
            raise InvalidToken(f"the identity token's claims cannot be read: {error}") from None
        if header != _HEADER:
            raise InvalidToken("the identity token is not HS256")
        if result.expires_at <= self._clock():
            raise ExpiredToken("the identity token has expired; trade the API key for a new one (POST /api/v1/auth/"
                               "token; the tinker SDK does this itself)")
        return result
