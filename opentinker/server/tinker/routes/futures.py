"""``retrieve_future``: a request's result, long-polled; ``retrieve_futures``: which of a
sampling session's requests are done (one long poll per session: :mod:`..completions`).
A poll whose API key is revoked while it waits is answered 401 within seconds
(:mod:`opentinker.server.revocation`)."""

from __future__ import annotations

from typing import Any

from fastapi import Depends, Request, Response
from fastapi.responses import JSONResponse

from opentinker.server.errors import not_found
from opentinker.server.revocation import until_revoked
from opentinker.server.store import User
from opentinker.server.tinker import openapi, schemas
from opentinker.server.tinker.openapi import errors
from opentinker.server.tinker.service import TinkerService
from opentinker.server.tinker.routes.common import (
    service,
    tinker_router,
    tinker_user,
)

router = tinker_router()


@router.post("/retrieve_future", responses={**openapi.FUTURE_RESULT, **errors(404)})
async def retrieve_future(request: Request, body: schemas.RetrieveFuture, user: User = Depends(tinker_user),
                          svc: TinkerService = Depends(service)) -> Response:
    row = await until_revoked(request, svc.futures.wait(body.request_id, user.id, svc.settings.long_poll_s))
    if row is None:
        raise not_found(f"future {body.request_id!r}")
    if row.state == "pending":
        return JSONResponse({"type": "try_again", "request_id": row.request_id, "queue_state": "active"})
    if row.state == "failed":
        return JSONResponse({"error": row.error, "category": row.category or "server"})
    return Response(content=row.result, media_type=row.content_type)


@router.post("/retrieve_futures", responses=errors(404))
async def retrieve_futures(request: Request, body: schemas.RetrieveFutures, user: User = Depends(tinker_user),
                           svc: TinkerService = Depends(service)) -> dict[str, Any]:
    target = body.target
    if svc.state.sampler(target.sampling_session_id, user.id) is None:
        raise not_found(f"sampler {target.sampling_session_id!r}")
    # The SDK's read timeout is 45 s: hold at most the long poll of retrieve_future.
    timeout = svc.settings.long_poll_s if body.timeout is None else min(body.timeout, svc.settings.long_poll_s)
    completions, cursor = await until_revoked(request, svc.completions.poll(
        user.id, target.sampling_session_id, target.cloned_sampler_id, body.prev_cursor, timeout))
    return {"completions": completions, "cursor": cursor}
