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
from opentinker.server.tinker import openapi
from opentinker.server.tinker.openapi import errors
from opentinker.server.tinker.workers import UserError
from opentinker.server.tinker.service import TinkerService
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
    """The user of ``X-API-Key`` (``tml-<key>`` or ``<key>``)."""
    key = (header or "").strip()
    if not key:
        raise ApiError(401, "missing API key: send 'X-API-Key: tml-<key>' (the tinker SDK: api_key= or "
                            "TINKER_API_KEY)")
    key = key.removeprefix(SDK_KEY_PREFIX)
    user = authenticate(request.app.state.store, key)
    if user is None:
        raise refuse_key(request, ApiError(401, INVALID_KEY))
    note_credential(request, "key", hash_key(key))
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


def owned_checkpoint(svc: TinkerService, path: str, user: User, kind: str | None = None) -> CheckpointRow:
    try:
        return svc.owned_checkpoint(path, user.id, kind)
    except LookupError as error:
        raise not_found(str(error)) from None
    except UserError as error:
        raise user_error(str(error)) from None


def active_session(svc: TinkerService, session_id: str, user: User) -> None:
    state = svc.state.session_state(session_id, user.id)
    if state is None:
        raise not_found(f"session {session_id!r}")
    if state != "active":
        raise user_error(f"session {session_id!r} is {state}; start a new ServiceClient")


def submit(svc: TinkerService, user: User, model_id: str, seq_id: int | None, kind: str, run) -> dict[str, Any]:
    """Queue ``run`` on the model in ``seq_id`` order; a re-sent ``(model_id, seq_id)`` gets its
    first future. A number the model would never reach, or has gone past, is refused (400); a
    full queue is a 429 (the SDK retries with the same number, so nothing is skipped for it)."""
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
    row = svc.futures.add(user.id, kind, model_id, seq_id)  # none yet: checked above, with no await between
    svc.host.submit(model_id, seq_id, row.request_id, run)
    svc.state.touch_model(model_id)
    return row.submit_answer()


def refuse_seq(svc: TinkerService, model_id: str | None, seq_id: int | None, user: User) -> None:
    """A request refused at submit still used its number: the model must not wait for it."""
    if isinstance(model_id, str) and isinstance(seq_id, int) and svc.state.model(model_id, user.id) is not None:
        svc.host.skip(model_id, seq_id)
