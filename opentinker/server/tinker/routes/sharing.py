"""Sharing and keeping checkpoints: publish / unpublish, a checkpoint's TTL, ``copy_weights``,
and signed download links of external weights (served by :mod:`.downloads`).

Only a checkpoint's owner changes it: another user's published checkpoint is a 403 (they may
read it), an unpublished one a 404 like a missing one (and an ``access_denied`` entry for its
owner). Publishing a published checkpoint, or unpublishing a private one, changes nothing and
succeeds: the SDK retries a 409 for five minutes. Logic apart from HTTP: :mod:`..sharing`.
"""

from __future__ import annotations

import datetime as dt
from pathlib import Path as FilePath
from typing import Any

from fastapi import Depends, Header, HTTPException, Path, Request, Response
from fastapi.routing import APIRoute

from opentinker.server.errors import ApiError, not_found
from opentinker.server.store import User
from opentinker.server.tinker import sharing
from opentinker.server.tinker.checkpoint_quota import QuotaExceeded
from opentinker.server.tinker.openapi import errors
from opentinker.server.tinker.projects import project_problem
from opentinker.server.tinker.service import TinkerService
from opentinker.server.tinker.state import DEFAULT_PROJECT
from opentinker.server.tinker.routes.downloads import link_path
from opentinker.server.tinker.routes.common import (
    active_session,
    owned_checkpoint,
    readable_checkpoint,
    service,
    tinker_router,
    tinker_user,
    user_error,
)

router = tinker_router()
CHECKPOINT = "/training_runs/{run_id}/checkpoints/{kind}/{name}"
#: ``responses=`` of a route changing a checkpoint (403: another user's published one).
_NO_CONTENT = {"status_code": 204, "responses": errors(400, 403, 404)}


def _path(run_id: str, kind: str, name: str) -> str:
    return f"tinker://{run_id}/{kind}/{name}"


async def _publish(request: Request, run_id: str, kind: str, name: str, user: User, svc: TinkerService,
                   public: bool) -> Response:
    row = owned_checkpoint(svc, _path(run_id, kind, name), user, request=request)
    if row.public != public:
        svc.state.set_public(row, public)
        svc.audit.record_request(request, "checkpoint_publish" if public else "checkpoint_unpublish", user,
                                 tinker_path=row.tinker_path)
    return Response(status_code=204)


class _PublishRoute(APIRoute):
    """POST and DELETE .../publish are two routes (two operations in the document). A request
    with another method reaches the first, and FastAPI's 405 would name its method alone."""

    async def handle(self, scope, receive, send) -> None:
        if scope["method"] not in self.methods:
            raise HTTPException(405, headers={"Allow": "DELETE, POST"})
        await super().handle(scope, receive, send)


async def publish_checkpoint(request: Request, run_id: str = Path(max_length=256), kind: str = Path(max_length=32),
                             name: str = Path(max_length=256), user: User = Depends(tinker_user),
                             svc: TinkerService = Depends(service)) -> Response:
    """Makes the caller's checkpoint readable by every user of this server (load, sample, copy,
    weights_info, its run's record); they can never change or delete it."""
    return await _publish(request, run_id, kind, name, user, svc, True)


async def unpublish_checkpoint(request: Request, run_id: str = Path(max_length=256), kind: str = Path(max_length=32),
                               name: str = Path(max_length=256), user: User = Depends(tinker_user),
                               svc: TinkerService = Depends(service)) -> Response:
    """Makes it private again: other users' next request for it is a 404 (models they already
    loaded from it, and their copies, stay theirs)."""
    return await _publish(request, run_id, kind, name, user, svc, False)


router.add_api_route(CHECKPOINT + "/publish", publish_checkpoint, methods=["POST"], route_class_override=_PublishRoute,
                     **_NO_CONTENT)
router.add_api_route(CHECKPOINT + "/publish", unpublish_checkpoint, methods=["DELETE"],
                     route_class_override=_PublishRoute, **_NO_CONTENT)


@router.put(CHECKPOINT + "/ttl", **_NO_CONTENT)
async def set_checkpoint_ttl(body: sharing.SetTtl, request: Request, run_id: str = Path(max_length=256),
                             kind: str = Path(max_length=32), name: str = Path(max_length=256),
                             user: User = Depends(tinker_user), svc: TinkerService = Depends(service)) -> Response:
    """The checkpoint expires ``ttl_seconds`` from now (1 hour to 10 years, at most
    --tinker-max-checkpoint-ttl), or never (null); housekeeping deletes it once expired."""
    row = owned_checkpoint(svc, _path(run_id, kind, name), user, request=request)
    problem = sharing.ttl_problem(body.ttl_seconds, svc.settings.max_checkpoint_ttl_s)
    if problem:
        raise user_error(problem)
    svc.state.set_expiry(row, sharing.expiry(body.ttl_seconds))
    svc.audit.record_request(request, "checkpoint_ttl_set", user, tinker_path=row.tinker_path,
                             ttl_seconds=body.ttl_seconds)
    return Response(status_code=204)


@router.post("/copy_weights", responses=errors(400, 404, 429))
async def copy_weights(body: sharing.CopyWeights, request: Request,
                       idempotency_key: str | None = Header(None, alias="X-Idempotency-Key", max_length=256),
                       access_token: str | None = Header(None, alias="X-Tinker-Weights-Access-Token", max_length=8192),
                       user: User = Depends(tinker_user), svc: TinkerService = Depends(service)) -> dict[str, Any]:
    """A copy of the caller's checkpoint or a published one, as a new run of the caller's that
    cannot be trained on, sharing the source's files (no bytes are written). Into a new session
    in ``destination_project_id``, or into the caller's active session ``session_id`` as model
    ``model_seq_id``. The same X-Idempotency-Key answers the same copy."""
    if body.weights_access_token or access_token:
        raise user_error("weights_access_token is not offered here: a checkpoint another user published is readable "
                         "with your own key, and an unpublished one is not shared")
    if body.session_id is not None:
        if body.model_seq_id is None:
            raise user_error("copy_weights: session_id needs model_seq_id (the copy's model in that session)")
        session_id, new_session = body.session_id, False
    elif body.destination_project_id is not None:
        session_id, new_session = sharing.copy_session_id(user.id, idempotency_key), True
    else:
        raise user_error("copy_weights: give destination_project_id, or session_id and model_seq_id")
    if not new_session:
        active_session(svc, session_id, user)
    model_id = f"{session_id}:train:{body.model_seq_id or 0}"
    made = svc.state.model(model_id, user.id)
    if made is not None and made.state == sharing.COPY_STATE:  # re-sent: the copy it made
        return {"tinker_path": sharing.copy_path(made)}
    if made is not None:
        raise user_error(f"copy_weights: model_seq_id {body.model_seq_id} of session {session_id!r} is taken")
    project = body.destination_project_id or DEFAULT_PROJECT
    problem = new_session and project_problem(svc.state.store, user.id, project, svc.settings.max_projects_per_user)
    problem = problem or sharing.ttl_problem(body.ttl_seconds, svc.settings.max_checkpoint_ttl_s)
    if problem:
        raise user_error(problem)
    source = readable_checkpoint(svc, body.source_path, user, request=request)
    source_model = svc.state.model(source.run_id)
    if source_model is None:
        raise not_found(f"checkpoint {body.source_path!r}")
    try:
        sharing.check_copy_quota(svc, user.id, source)
    except QuotaExceeded as error:
        if error.retry:
            raise ApiError(429, str(error), headers={"Retry-After": "10"}) from None
        raise user_error(str(error)) from None
    if new_session:  # ended at once: it holds the copy and runs nothing
        svc.state.create_session(session_id, user.id, ["copy_weights"], {"copy_of": source.tinker_path},
                                 project_id=project)
        svc.state.end_session(session_id, "finished")
    copy = sharing.make_copy(svc.state, source, source_model, user.id, model_id, session_id, body.ttl_seconds)
    owner = svc.state.store.user_by_id(source.user_id)
    svc.audit.record_request(request, "checkpoint_copy", user, source=source.tinker_path, tinker_path=copy.tinker_path,
                             source_owner=owner.name if owner else None, project=project if new_session else None)
    return {"tinker_path": copy.tinker_path}


@router.get(CHECKPOINT + "/external_weights_urls", responses=errors(400, 404))
async def external_weights_urls(request: Request, run_id: str = Path(max_length=256), kind: str = Path(max_length=32),
                                name: str = Path(max_length=256), user: User = Depends(tinker_user),
                                svc: TinkerService = Depends(service)) -> dict[str, Any]:
    """A signed link per file of external weights (the caller's or published ones), keyed by
    its path in the checkpoint; each works without a key until ``expires`` (--signed-url-s)."""
    row = readable_checkpoint(svc, _path(run_id, kind, name), user, "external_weights", request, loads=True)
    try:
        files = sharing.external_files(FilePath(row.folder))
    except ValueError as error:
        raise user_error(str(error)) from None
    urls, expires = {}, None
    for file in files:
        link = link_path(row.run_id, row.name, sharing.write_id(row), file)
        urls[file], expires = svc.signed_url(str(request.base_url), link)
    if expires is None:  # no files: the links would have expired now
        expires = dt.datetime.now(dt.timezone.utc).timestamp()
    return {"urls": urls, "expires": dt.datetime.fromtimestamp(expires, dt.timezone.utc).isoformat()}
