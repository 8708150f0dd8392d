"""``GET /v1/health`` (no key: for load balancers and ``wait until up``) and ``GET /v1/version``."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends

import opentinker
from opentinker.protocol import PROTOCOL_VERSION, Health
from opentinker.server.auth import current_user
from opentinker.server.errors import AUTHENTICATED_ERRORS
from opentinker.server.store import User

router = APIRouter(tags=["health"])


@router.get("/health", response_model=Health, summary="Liveness; needs no API key")
async def health() -> Health:
    return Health(version=opentinker.__version__)


@router.get(
    "/version", summary="Server and protocol version, and who the key belongs to", responses=AUTHENTICATED_ERRORS
)
async def version(user: User = Depends(current_user)) -> dict[str, Any]:
    return {"version": opentinker.__version__, "protocol": PROTOCOL_VERSION, "user": user.name}
