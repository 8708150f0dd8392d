"""Session traces (``RestClient.export_session_trace``): ``GET /sessions/{id}/trace_export``
answers at once ``{"status": "ready", "url": <signed link>}`` (the trace is small and is
built when the link is fetched, so there is nothing to wait for); the link, public for
``--signed-url-s`` seconds and refused (403) once expired or altered, serves the session's
requests as Chrome trace-event JSON (:func:`~opentinker.server.tinker.traces.chrome_trace`),
which Perfetto's UI (https://ui.perfetto.dev) and chrome://tracing open. It is JSON, not the
``.pftrace`` protobuf the SDK's docstring names: save it under any name.

A user exports their own sessions; an admin anyone's. Another user's session reads as a
missing one (404) and leaves an ``access_denied`` entry for its owner.
"""

from __future__ import annotations

from typing import Any

from fastapi import Depends, Path, Query, Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from opentinker.server.errors import not_found
from opentinker.server.signed_urls import check_link, quoted
from opentinker.server.store import User
from opentinker.server.tinker.openapi import errors
from opentinker.server.tinker.service import TinkerService
from opentinker.server.tinker.traces import chrome_trace
from opentinker.server.tinker.routes.common import PREFIX, record_denied, service, tinker_router, tinker_user

router = tinker_router()


def _trace_path(session_id: str) -> str:
    """The download link's path (what its signature covers)."""
    return PREFIX + quoted("session_traces", session_id)


@router.get("/sessions/{session_id}/trace_export", responses=errors(404))
async def export_session_trace(request: Request, session_id: str = Path(max_length=256),
                               user: User = Depends(tinker_user),
                               svc: TinkerService = Depends(service)) -> dict[str, Any]:
    owner = svc.state.session_owner(session_id)
    if owner is None or (owner != user.id and not user.is_admin):
        if owner is not None:
            record_denied(svc, request, user, owner, resource=f"session:{session_id}", action="trace_export")
        raise not_found(f"session {session_id!r}")
    url, expires = svc.signed_url(str(request.base_url), _trace_path(session_id))
    return {"status": "ready", "url": url, "expires_at": expires}


@router.get("/session_traces/{session_id}", include_in_schema=False)
async def download_session_trace(session_id: str = Path(max_length=256), expires: str | None = Query(None),
                                  signature: str | None = Query(None),
                                  svc: TinkerService = Depends(service)) -> JSONResponse:
    """The trace a signed link names (no key: the signature is the permission)."""
    check_link(svc.signer, _trace_path(session_id), expires, signature, "RestClient.export_session_trace")
    if svc.state.session_owner(session_id) is None:  # forgotten since the link was made
        raise not_found(f"session {session_id!r}")
    # Up to MAX_PER_SESSION rows: built off the event loop.
    trace = await run_in_threadpool(lambda: chrome_trace(session_id, svc.traces.rows(session_id)))
    return JSONResponse(trace, headers={"Content-Disposition": f'attachment; filename="{session_id}.trace.json"'})


download_session_trace.undocumented = True  # a link handed out by trace_export, not an SDK route
