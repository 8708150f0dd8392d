"""``retrieve_future``: a request's result, long-polled."""

from __future__ import annotations

from fastapi import Depends, Response
from fastapi.responses import JSONResponse

from opentinker.server.errors import not_found
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
async def retrieve_future(body: schemas.RetrieveFuture, user: User = Depends(tinker_user),
                          svc: TinkerService = Depends(service)) -> Response:
    row = await svc.futures.wait(body.request_id, user.id, svc.settings.long_poll_s)
    if row is None:
        raise not_found(f"future {body.request_id!r}")
    if row.state == "pending":
        return JSONResponse({"type": "try_again", "request_id": row.request_id, "queue_state": "active"})
    if row.state == "failed":
        return JSONResponse({"error": row.error, "category": row.category or "server"})
    return Response(content=row.result, media_type=row.content_type)
