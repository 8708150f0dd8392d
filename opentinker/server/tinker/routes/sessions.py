"""Sessions and the SDK's bootstrap: health, client config, the identity token exchange,
capabilities, session start / heartbeat / finish, and listing a user's sessions."""

from __future__ import annotations

import uuid
from typing import Any, Literal

from fastapi import Depends, Path, Query, Request, Response
from fastapi.responses import JSONResponse
from pydantic import Field

from opentinker.protocol import MAX_INT
from opentinker.server.errors import not_found
from opentinker.server.store import User
from opentinker.server.tinker import projects, schemas, wire
from opentinker.server.tinker.state import DEFAULT_PROJECT
from opentinker.server.tinker.openapi import errors
from opentinker.server.tinker.service import TinkerService
from opentinker.server.tinker.routes.common import (
    identity_tokens,
    service,
    tinker_key_user,
    tinker_router,
    tinker_user,
    user_error,
)

router = tinker_router()


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.post("/client/config")
async def client_config(user: User = Depends(tinker_user)) -> dict[str, Any]:
    # proto_compress_fwdbwd: forward_backward bodies come zstd-compressed (benchmarks/wire_compression.py).
    # pjwt_auth_enabled: the SDK trades its key for identity tokens (/auth/token, identity.py).
    return {"pjwt_auth_enabled": True, "proto_compress_fwdbwd": True, "sample_use_retrieve_futures": True,
            "custom_loss_server_side": False, "sample_join_sampling_session": False, "parallel_fwdbwd_chunks": True,
            "fwdbwd_max_chunk_len": wire.MAX_DATUMS}


@router.post("/client/dynamic_config")
async def dynamic_config(user: User = Depends(tinker_user)) -> dict[str, Any]:
    return {"refresh_interval_sec": 300, "sample_cancel_enabled": False}


@router.post("/auth/token")
async def auth_token(request: Request, user: User = Depends(tinker_key_user)) -> dict[str, str]:
    """An identity token for the API key in ``X-API-Key`` (what ``RestClient.whoami`` reads);
    valid --identity-token-s seconds, and only while the key is not revoked."""
    return {"jwt": identity_tokens(request).mint(user, request.state.credential.digest)}


class CreateSessionRequest(schemas.CreateSession):
    project_id: str | None = Field(None, pattern=projects.PROJECT_NAME, description="1-64 of A-Z a-z 0-9 . _ -")
    display_name: str | None = Field(None, max_length=256)


@router.post("/create_session", responses=errors(400))
async def create_session(request: Request, body: CreateSessionRequest, user: User = Depends(tinker_user),
                         svc: TinkerService = Depends(service)) -> dict[str, Any]:
    # 400, not 429: only the user can end their sessions, so a retry would just wait and fail.
    limit = svc.settings.max_sessions_per_user
    if svc.state.active_sessions(user.id) >= limit:
        raise user_error(f"you have {limit} active sessions, the most this server allows per user "
                          "(--tinker-max-sessions); close a ServiceClient (close(), or use it in a with block) "
                          f"first; a session without heartbeats ends after {svc.settings.session_timeout_s:.0f} s")
    project_id = body.project_id or DEFAULT_PROJECT
    problem = projects.project_problem(svc.state.store, user.id, project_id, svc.settings.max_projects_per_user)
    if problem:
        raise user_error(problem)
    session_id = uuid.uuid4().hex
    svc.state.create_session(session_id, user.id, body.tags, body.user_metadata or {}, project_id,
                             body.display_name or None)
    return {"session_id": session_id}


@router.post("/session_heartbeat", responses=errors(404, 410))
async def session_heartbeat(body: schemas.SessionRef, user: User = Depends(tinker_user),
                            svc: TinkerService = Depends(service)) -> Response:
    state = svc.state.session_state(body.session_id, user.id)
    if state is None:
        raise not_found(f"session {body.session_id!r}")
    if state != "active":  # 410 stops the SDK's heartbeat loop
        return JSONResponse({"error": f"session {body.session_id!r} is {state}"}, status_code=410)
    svc.state.touch_session(body.session_id)
    return JSONResponse({"type": "session_heartbeat"})


@router.post("/sessions/{session_id}/finish", status_code=204, responses=errors(404))
async def finish_session(request: Request, body: schemas.FinishSession, session_id: str = Path(max_length=256),
                         user: User = Depends(tinker_user), svc: TinkerService = Depends(service)) -> Response:
    if svc.state.session_state(session_id, user.id) is None:
        raise not_found(f"session {session_id!r}")
    if body.reason is not None and body.reason.type in ("success", "errored", "interrupted"):
        svc.state.note_finish_reason(session_id, body.reason.type)  # search_sessions shows it
    await svc.end_session(session_id, "finished")
    return Response(status_code=204)


@router.post("/telemetry")
async def telemetry(user: User = Depends(tinker_user)) -> dict[str, str]:
    return {"status": "accepted"}  # accepted and dropped: nothing is collected


@router.get("/get_server_capabilities")
async def capabilities(user: User = Depends(tinker_user), svc: TinkerService = Depends(service)) -> dict[str, Any]:
    return {"supported_models": [{"model_name": m.name, "trainable": True, "sampleable": True}
                                 for m in svc.policy.models]}


@router.get("/sessions")
async def list_sessions(limit: int = Query(20, ge=1, le=1000), offset: int = Query(0, ge=0, le=MAX_INT),
                        access_scope: Literal["owned", "accessible"] = "owned", user: User = Depends(tinker_user),
                        svc: TinkerService = Depends(service)) -> dict[str, Any]:
    """``RestClient.list_sessions(limit, offset)``: a page of your session ids, newest first.
    ``accessible`` is every user's for an admin (User.is_admin), else the same as ``owned``:
    nothing is shared between users."""
    everyone = access_scope == "accessible" and user.is_admin
    sessions, total = svc.state.sessions(None if everyone else user.id, limit, offset)
    return {"sessions": sessions, "cursor": {"offset": offset, "limit": limit, "total_count": total}}


@router.get("/sessions/{session_id}", responses=errors(404))
async def get_session(session_id: str = Path(max_length=256), user: User = Depends(tinker_user),
                      svc: TinkerService = Depends(service)) -> dict[str, Any]:
    if svc.state.session_state(session_id, user.id) is None:
        raise not_found(f"session {session_id!r}")
    return {"training_run_ids": svc.state.session_models(session_id),
            "sampler_ids": svc.state.session_samplers(session_id)}
