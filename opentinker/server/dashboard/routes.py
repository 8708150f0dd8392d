"""The dashboard's routes: the page at ``/``, its static files, and the browser's login.

``GET /`` and ``/dashboard/static/*`` are public: they are the same files for everyone and
hold no data; the page fetches everything else from the API with its session cookie.

``POST /v1/session {"api_key"}`` opens a session: a random token in an ``HttpOnly``,
``SameSite=Strict`` cookie (``Secure`` over https), of which the store keeps only the
SHA-256, tied to the API key it was opened with (revoking the key ends it).
``auth.current_user`` accepts that cookie where no ``Authorization`` header is sent, so
``EventSource`` and plain download links work. ``DELETE /v1/session`` logs out,
``GET /v1/session`` says who is logged in. None of these are in the OpenAPI schema: they
serve the page, not API clients.
"""

from __future__ import annotations

import mimetypes
from pathlib import Path

from fastapi import APIRouter, Depends, Query, Request, Response
from fastapi.responses import FileResponse
from pydantic import BaseModel, ConfigDict, Field

from opentinker.server.auth import (
    SESSION_COOKIE,
    authenticate,
    check_dashboard_header,
    current_user,
    hash_key,
    new_session_token,
    refuse_key,
)
from opentinker.server.errors import ApiError, not_found
from opentinker.json_value import MAX_INT
from opentinker.server.dashboard import views
from opentinker.server.store import User

STATIC_DIR = Path(__file__).resolve().parent / "static"
STATIC_PREFIX = "/dashboard/static"
# Every file the page may load, found once: a request names one of these or gets 404, so no
# path from a request ever reaches the file system.
_STATIC_FILES = {p.relative_to(STATIC_DIR).as_posix(): p for p in STATIC_DIR.rglob("*") if p.is_file()}
_MEDIA_TYPES = {".js": "text/javascript", ".css": "text/css", ".html": "text/html", ".md": "text/plain"}

# The page loads only its own files (uPlot included), is never framed (clickjacking of its
# Cancel button) and sends no Referer with its download links.
_PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                               "connect-src 'self'; object-src 'none'; base-uri 'none'; form-action 'none'; "
                               "frame-ancestors 'none'",
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}

router = APIRouter(include_in_schema=False)


class SessionCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    api_key: str = Field(min_length=1, max_length=200)


def _static(name: str) -> FileResponse:
    path = _STATIC_FILES.get(name)
    if path is None:
        raise not_found(f"dashboard file {name!r}")
    media_type = _MEDIA_TYPES.get(path.suffix) or mimetypes.guess_type(path.name)[0] or "application/octet-stream"
    return FileResponse(path, media_type=media_type, headers=_PAGE_HEADERS)


@router.get("/")
async def page() -> FileResponse:
    return _static("index.html")


@router.get(STATIC_PREFIX + "/{name:path}")
async def static_file(name: str) -> FileResponse:
    return _static(name)


@router.post("/v1/session", status_code=204)
async def log_in(body: SessionCreate, request: Request) -> Response:
    check_dashboard_header(request)  # a cross-site form must not log a browser into another account
    store = request.app.state.store
    settings = request.app.state.settings
    token = new_session_token()
    key = body.api_key.strip()
    session = None
    if authenticate(store, key) is not None:
        session = store.create_session(hash_key(key), hash_key(token), settings.dashboard_session_s)
    if session is None:
        raise refuse_key(request, ApiError(401, "invalid or revoked API key"))
    response = Response(status_code=204)
    response.set_cookie(
        SESSION_COOKIE, token, max_age=int(settings.dashboard_session_s), path="/", httponly=True,
        samesite="strict", secure=request.url.scheme == "https",
    )
    return response


@router.delete("/v1/session", status_code=204)
async def log_out(request: Request) -> Response:
    check_dashboard_header(request)
    token = request.cookies.get(SESSION_COOKIE)
    if token:
        request.app.state.store.delete_session(hash_key(token))
    response = Response(status_code=204)
    response.delete_cookie(SESSION_COOKIE, path="/", httponly=True, samesite="strict",
                           secure=request.url.scheme == "https")
    return response


@router.get("/v1/session")
async def who(request: Request, user: User = Depends(current_user)) -> dict:
    token = request.cookies.get(SESSION_COOKIE)
    session = request.app.state.store.session(hash_key(token)) if token else None
    return {
        "user": user.name,
        "key_prefix": session.key_prefix if session else None,
        "expires_at": session.expires_at if session else None,
    }


# --- what the page shows besides the jobs: the user's own Tinker runs, sessions and
# checkpoints, usage and audit entries (cookie or key, as the API; read only; paged) ---------

_LIMIT = Query(50, ge=1, le=200)
_OFFSET = Query(0, ge=0, le=MAX_INT)


@router.get("/v1/dashboard/training-runs")
async def training_runs(request: Request, limit: int = _LIMIT, offset: int = _OFFSET,
                        user: User = Depends(current_user)) -> dict:
    return views.training_runs(request.app.state.store, user.id, limit, offset)


@router.get("/v1/dashboard/sessions")
async def sessions(request: Request, limit: int = _LIMIT, offset: int = _OFFSET,
                   user: User = Depends(current_user)) -> dict:
    return views.sessions(request.app.state.store, user.id, limit, offset)


@router.get("/v1/dashboard/checkpoints")
async def checkpoints(request: Request, limit: int = _LIMIT, offset: int = _OFFSET,
                      user: User = Depends(current_user)) -> dict:
    return views.checkpoints(request.app.state.store, user.id, limit, offset)


@router.get("/v1/dashboard/usage")
async def usage(request: Request, user: User = Depends(current_user)) -> dict:
    return views.usage_totals(request.app.state.store, user.id)


@router.get("/v1/dashboard/audit")
async def audit(request: Request, limit: int = _LIMIT, before_id: int | None = Query(None, ge=1, le=MAX_INT),
                user: User = Depends(current_user)) -> dict:
    """The user's newest audit entries (about them, whoever's key), a page before ``before_id``."""
    return views.audit_entries(request.app.state.audit, user, limit, before_id)
