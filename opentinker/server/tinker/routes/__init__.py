"""``/api/v1/*``: the Tinker API as the official ``tinker`` SDK (0.38.0) speaks it, one router
per resource (:mod:`.sessions`, :mod:`.training`, :mod:`.sampling`, :mod:`.futures`,
:mod:`.runs`, :mod:`.unsupported`; shared helpers in :mod:`.common`).

Same process, store and users as the OpenTinker API. A key is sent as ``X-API-Key``; the SDK
refuses keys without the ``tml-`` prefix before sending anything, so ``tml-<key>`` is accepted
as ``<key>`` (one key, stored hashed once, for both APIs). Operations answer at once with a
future; ``retrieve_future`` long-polls for its result: protobuf for samples and
forward/backward, JSON otherwise, or ``{"error", "category"}`` on failure. Refusals that can
be made at submit are 4xx there (never 5xx: the SDK retries those for minutes).
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from starlette.routing import BaseRoute

import opentinker
from opentinker.server.tinker import openapi
from opentinker.server.tinker.routes import futures, runs, sampling, sessions, training, unsupported
from opentinker.server.tinker.routes import projects
from opentinker.server.tinker.routes import usage
from opentinker.server.tinker.routes import downloads, sharing
from opentinker.server.tinker.routes import audit, traces
from opentinker.server.tinker.routes.common import PREFIX, tinker_router

router = APIRouter()
_document = tinker_router()


@_document.get("/openapi.json", include_in_schema=False)
async def openapi_document(request: Request) -> JSONResponse:
    """This API's OpenAPI document (public, like /openapi.json)."""
    if getattr(request.app.state, "tinker_openapi", None) is None:
        request.app.state.tinker_openapi = openapi.document(api_routes(), opentinker.__version__)
    return JSONResponse(request.app.state.tinker_openapi)


openapi_document.undocumented = True

# In the order the routes were declared in one module before (unsupported last).
# projects before sessions: its POST /sessions/search must be matched before GET /sessions/{session_id}
# (else OPTIONS /sessions/search answers 'Allow: GET').
_PARTS = (_document, projects.router, sessions.router, training.router, sampling.router, futures.router, runs.router,
          usage.router,
          sharing.router, downloads.router,
          audit.router, traces.router,
          unsupported.router)
for _part in _PARTS:
    router.include_router(_part)


def api_routes() -> list[BaseRoute]:
    """Every Tinker route, each with its full path, in order.

    Read from each resource's own router, whose routes are plain ``APIRoute``s in every
    FastAPI version; ``router.routes`` is not: FastAPI 0.165 keeps the included routers there
    (objects without ``path`` or ``methods``), so a document made from it has no operations."""
    return [route for part in _PARTS for route in part.routes]


__all__ = ["PREFIX", "api_routes", "router"]
