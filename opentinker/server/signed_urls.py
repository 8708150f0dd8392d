"""Download links that work without an API key for a while: ``<path>?expires=<unix time>&signature=<hex>``.

The signature is an HMAC-SHA256, under a key kept in the server's store (:meth:`Store.secret`),
of the path and the expiry together, so a link cannot be stretched in time or pointed at
another file: changing either breaks it. A link names one file the server chose when it
signed it; the download route still checks that the file is where it was. Links outlive
nothing on the server: a deleted checkpoint's link answers 404.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from urllib.parse import quote


class SignatureError(ValueError):
    """A link that is expired, altered or not signed here (answered 403)."""


class UrlSigner:
    def __init__(self, key: bytes):
        self._key = key

    def _mac(self, path: str, expires: int) -> str:
        return hmac.new(self._key, f"{path}\n{expires}".encode(), hashlib.sha256).hexdigest()

    def sign(self, path: str, ttl_s: float, now: float | None = None) -> tuple[str, int]:
        """``(path?expires=..&signature=.., expires)`` for a link to ``path`` (already URL-quoted)
        that works for ``ttl_s`` seconds."""
        expires = int((time.time() if now is None else now) + ttl_s)
        return f"{path}?expires={expires}&signature={self._mac(path, expires)}", expires

    def verify(self, path: str, expires: str | int | None, signature: str | None, now: float | None = None) -> None:
        """Raise :class:`SignatureError` unless ``signature`` signs ``path`` until ``expires`` and
        that time has not passed."""
        try:
            expiry = int(expires)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            raise SignatureError("the link has no valid expiry: ask for a new one") from None
        if not signature or not hmac.compare_digest(self._mac(path, expiry), signature):
            raise SignatureError("the link's signature does not match (altered, or not signed by this server)")
        if (time.time() if now is None else now) >= expiry:
            raise SignatureError("the link has expired: ask for a new one")


def check_link(signer: UrlSigner, path: str, expires: str | None, signature: str | None, source: str) -> None:
    """The answer to a download: 401 for no signature at all (like any route without a
    credential; ``source`` says where links come from), 403 for an expired or altered one."""
    from opentinker.server.errors import ApiError  # the HTTP layer's, kept out of the signing itself

    if expires is None and signature is None:
        raise ApiError(401, f"a download needs a signed link: {source} gives them (each works without an API key "
                            "until it expires)")
    try:
        signer.verify(path, expires, signature)
    except SignatureError as error:
        raise ApiError(403, str(error)) from None


def quoted(*parts: str) -> str:
    """``/a/b/c`` from path parts, each URL-quoted (a part holds no slash of its own)."""
    return "".join("/" + quote(part, safe="") for part in parts)
