"""What every Tinker route module shares: the prefix, the key check (``X-API-Key``,
``tml-<key>`` accepted as ``<key>``: the SDK refuses keys without the prefix), the service,
the lookups that turn a missing or unusable model, checkpoint or session into the right 4xx,
and :func:`submit`, which queues a training request in its model's ``seq_id`` order."""

from __future__ import annotations

import datetime as dt
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.security import APIKeyHeader

from opentinker.server.auth import INVALID_KEY, authenticate, hash_key, refuse_key
from opentinker.server.errors import ApiError, not_found
from opentinker.server.revocation import note_credential
from opentinker.server.store import User
from opentinker.server.tinker import identity, openapi
from opentinker.server.tinker.openapi import errors
from opentinker.server.tinker.workers import UserError
from opentinker.server.tinker.service import NotYours, TinkerService
from opentinker.server.tinker.state import CheckpointRow, ModelRow

PREFIX = "/api/v1"
SDK_KEY_PREFIX = "tml-"
_api_key = APIKeyHeader(name="X-API-Key", auto_error=False, description="tml-<your OpenTinker key>")


def tinker_router() -> APIRouter:
    """A router of one Tinker resource (each module has one; ``routes.router`` holds them all).
    Not in /openapi.json (the OpenTinker API's): the Tinker routes have their own document,
    /api/v1/openapi.json (openapi.py)."""
    return APIRouter(prefix=PREFIX, tags=["tinker"], include_in_schema=False, responses=errors(*openapi.COMMON_ERRORS))


def service(request: Request) -> TinkerService:
    return request.app.state.tinker


async def tinker_user(request: Request, header: str | None = Depends(_api_key)) -> User:
    """The user of ``X-API-Key``: an API key (``tml-<key>`` or ``<key>``) or an identity token
    traded for one (``POST /auth/token``, :mod:`..identity`)."""
    credential = _credential(header)
    if identity.looks_like_token(credential):
        return _token_user(request, credential)
    return _key_user(request, credential)


async def tinker_key_user(request: Request, header: str | None = Depends(_api_key)) -> User:
    """The user of an API key in ``X-API-Key``; an identity token is refused (one token must not
    buy the next: a token that leaked would then live as long as its key)."""
    credential = _credential(header)
    if identity.looks_like_token(credential):
        raise ApiError(401, "an identity token is traded for with the API key itself: send 'X-API-Key: tml-<key>'")
    return _key_user(request, credential)


def _credential(header: str | None) -> str:
    credential = (header or "").strip()
    if not credential:
        raise ApiError(401, "missing API key: send 'X-API-Key: tml-<key>' (the tinker SDK: api_key= or "
                            "TINKER_API_KEY)")
    return credential


def _key_user(request: Request, credential: str) -> User:
    key = credential.removeprefix(SDK_KEY_PREFIX)
    user = authenticate(request.app.state.store, key)
    if user is None:
        raise refuse_key(request, ApiError(401, INVALID_KEY))
    note_credential(request, "key", hash_key(key))
    return user


# RFC 6750: the SDK trades its key for a new token on a 401 with this, and sends the request again.
INVALID_TOKEN = {"WWW-Authenticate": 'Bearer error="invalid_token"'}


def identity_tokens(request: Request) -> identity.IdentityTokens:
    """The server's identity tokens (made once: the key is read from the store)."""
    tokens = getattr(request.app.state, "tinker_identity", None)
    if tokens is None:
        store, svc = request.app.state.store, service(request)
        tokens = identity.IdentityTokens(store.secret("identity_tokens"), store.server_id(),
                                         svc.settings.identity_token_s)
        request.app.state.tinker_identity = tokens
    return tokens


def _token_user(request: Request, token: str) -> User:
    """The user of an identity token whose API key still works (looked up on every request)."""
    try:
        claims = identity_tokens(request).verify(token)
    except identity.ExpiredToken as error:  # the normal end of a token: not counted as a wrong key
        raise ApiError(401, str(error), headers=INVALID_TOKEN) from None
    except identity.InvalidToken as error:
        raise refuse_key(request, ApiError(401, str(error), headers=INVALID_TOKEN)) from None
    user = request.app.state.store.user_for_key_hash(claims.key_sha256)
    if user is None or identity.user_urn(user) != claims.subject:
        raise refuse_key(request, ApiError(401, "the API key this identity token was traded for is revoked",
                                           headers=INVALID_TOKEN))
    note_credential(request, "key", claims.key_sha256)  # watched as its key: revoking it ends long polls
    return user


def user_error(message: str) -> ApiError:
    return ApiError(400, message)


def iso(timestamp: float | None) -> str | None:
    return None if timestamp is None else dt.datetime.fromtimestamp(timestamp, dt.timezone.utc).isoformat()


def usable_model(svc: TinkerService, model_id: str, user: User) -> ModelRow:
    try:
        return svc.usable_model(model_id, user.id)
    except LookupError as error:
        raise not_found(str(error)) from None
    except UserError as error:
        raise user_error(str(error)) from None


def owned_checkpoint(svc: TinkerService, path: str, user: User, kind: str | None = None,
                     request: Request | None = None) -> CheckpointRow:
    """The caller's own checkpoint, to change or delete. Another user's published one is a 403
    (read-only to the caller); an unpublished one a 404 exactly like a missing one."""
    return _checkpoint(svc, svc.owned_checkpoint, path, user, kind, request, "change")


def readable_checkpoint(svc: TinkerService, path: str, user: User, kind: str | None = None,
                        request: Request | None = None, *, loads: bool = False) -> CheckpointRow:
    """The caller's checkpoint or a published one, to read (another user's unpublished one:
    404). With ``loads``, another user's load of a published one is recorded (checkpoint_read)."""
    row = _checkpoint(svc, svc.readable_checkpoint, path, user, kind, request, "read")
    if loads and row.user_id != user.id and request is not None:
        owner = svc.state.store.user_by_id(row.user_id)
        svc.audit.record_request(request, "checkpoint_read", user, tinker_path=row.tinker_path,
                                 owner=owner.name if owner else row.user_id)
    return row


def _checkpoint(svc: TinkerService, lookup, path: str, user: User, kind: str | None, request: Request | None,
                action: str) -> CheckpointRow:
    try:
        return lookup(path, user.id, kind)
    except NotYours as denied:
        if denied.row.public:  # the caller may read it, not change it
            raise ApiError(403, f"{path!r} was published by another user: you may load it, not change or delete "
                                "it") from None
        record_denied(svc, request, user, denied.row.user_id, tinker_path=path, action=action)
        raise not_found(str(denied)) from None
    except LookupError as error:
        raise not_found(str(error)) from None
    except UserError as error:
        raise user_error(str(error)) from None


def record_denied(svc: TinkerService, request: Request | None, asker: User, owner_id: int, **details: Any) -> None:
    """An ``access_denied`` audit entry about the owner of what ``asker`` asked for
    (:meth:`~opentinker.server.accounting.audit.AuditLog.record_denied`)."""
    svc.audit.record_denied(request, asker, owner_id, **details)


def active_session(svc: TinkerService, session_id: str, user: User) -> None:
    state = svc.state.session_state(session_id, user.id)
    if state is None:
        raise not_found(f"session {session_id!r}")
    if state != "active":
        raise user_error(f"session {session_id!r} is {state}; start a new ServiceClient")


def submit(svc: TinkerService, user: User, model_id: str, seq_id: int | None, kind: str, run,
           trace_args: dict[str, Any] | None = None) -> dict[str, Any]:
    """Queue ``run`` on the model in ``seq_id`` order; a re-sent ``(model_id, seq_id)`` gets its
    first future. A number the model would never reach, or has gone past, is refused (400); a
    full queue is a 429 (the SDK retries with the same number, so nothing is skipped for it).
    ``trace_args``: counts shown with the request in its session's trace (:mod:`..traces`)."""
    existing = svc.futures.existing(model_id, seq_id)
    if existing is not None:
        return existing.submit_answer()
    slot = svc.host.slot(model_id)
    if slot is None:  # unloaded while the request was being read
        raise user_error(f"model {model_id!r} was unloaded; load it again from a checkpoint")
    problem = slot.seq_problem(seq_id)
    if problem:
        raise user_error(problem)
    # The number the model waits for is always taken: refusing it would stall what waits behind it.
    if seq_id is None or seq_id != slot.next_seq:
        limits = svc.settings
        if slot.pending >= limits.max_queued_per_model:
            raise ApiError(429, f"model {model_id} has {slot.pending} requests waiting or running, the most it "
                                "queues (--tinker-max-queued-requests); retry when some are done",
                           headers={"Retry-After": "1"})
        if svc.host.user_pending(user.id) >= limits.max_queued_per_user:
            raise ApiError(429, f"your models have {limits.max_queued_per_user} requests waiting or running, the "
                                "most this server queues per user; retry when some are done",
                           headers={"Retry-After": "1"})
    row = svc.futures.add(user.id, kind, model_id, seq_id, trace_args=trace_args)  # none yet: checked above
    svc.host.submit(model_id, seq_id, row.request_id, run)
    svc.state.touch_model(model_id)
    return row.submit_answer()


def refuse_seq(svc: TinkerService, model_id: str | None, seq_id: int | None, user: User) -> None:
    """A request refused at submit still used its number: the model must not wait for it."""
    if isinstance(model_id, str) and isinstance(seq_id, int) and svc.state.model(model_id, user.id) is not None:
        svc.host.skip(model_id, seq_id)
