"""Projects and the session search: ``RestClient.assign_session_project`` and
``RestClient.search_sessions`` (what a project is: :mod:`..projects`)."""

from __future__ import annotations

import datetime as dt
from typing import Annotated, Any, Literal, Union

from fastapi import Depends, Path, Request, Response
from pydantic import AwareDatetime, BeforeValidator, Field

from opentinker.server.errors import not_found
from opentinker.server.store import User
from opentinker.server.tinker import projects
from opentinker.server.tinker.identity import URN_PREFIX
from opentinker.server.tinker.openapi import errors
from opentinker.server.tinker.routes.common import service, tinker_router, tinker_user, user_error
from opentinker.server.tinker.schemas import _Body
from opentinker.server.tinker.service import TinkerService

router = tinker_router()
ProjectName = Annotated[str, Field(pattern=projects.PROJECT_NAME, description="1-64 of A-Z a-z 0-9 . _ -")]
_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.timezone.utc)
_MICROSECOND = dt.timedelta(microseconds=1)


class ProjectRef(_Body):
    project_id: ProjectName


@router.put("/sessions/{session_id}/project", status_code=204, responses=errors(400, 404))
async def assign_session_project(request: Request, body: ProjectRef, session_id: str = Path(max_length=256),
                                 user: User = Depends(tinker_user),
                                 svc: TinkerService = Depends(service)) -> Response:
    """Moves one of your sessions into one of your projects (a new name makes a new project,
    up to --max-projects-per-user). Another user's session reads as a missing one (404)."""
    owner = svc.state.session_owner(session_id)
    if owner != user.id:
        if owner is not None:
            svc.audit.record_denied(request, user, owner, resource=f"session:{session_id}",
                                    action="session_project_set")
        raise not_found(f"session {session_id!r}")
    problem = projects.project_problem(svc.state.store, user.id, body.project_id, svc.settings.max_projects_per_user)
    if problem:
        raise user_error(problem)
    previous = projects.set_session_project(svc.state.store, session_id, body.project_id)
    svc.audit.record_request(request, "session_project_set", user, session_id=session_id,
                             project_id=body.project_id, previous_project_id=previous)
    return Response(status_code=204)


# The search request, as the SDK's types.SessionSearchRequest, bounded.
class OwnOwner(_Body):
    type: Literal["own"]


class AccessibleOwner(_Body):
    type: Literal["accessible"]


class UsersOwner(_Body):
    type: Literal["user"]
    owner_urns: list[Annotated[str, Field(max_length=256)]] = Field(min_length=1, max_length=10)


class ActiveStatus(_Body):
    type: Literal["active"]


class CancelledStatus(_Body):
    type: Literal["cancelled"]


class FailedStatus(_Body):
    type: Literal["failed"]


class ClientFinishedStatus(_Body):
    type: Literal["client_finished"]
    reasons: list[Literal["success", "errored", "interrupted"]] | None = Field(None, min_length=1, max_length=3)


def _iso_text(value: Any) -> Any:
    if not isinstance(value, str):  # not a number of seconds: the document says a date-time string
        raise ValueError("expected an ISO 8601 date-time string with a time zone, as next_cursor gave it")
    return value


class SearchCursor(_Body):
    last_created_at: Annotated[AwareDatetime, BeforeValidator(_iso_text)]
    last_session_id: str = Field(max_length=256)


class SessionSearch(_Body):
    session_id: str | None = Field(None, max_length=256)
    project_ids: list[ProjectName] | None = Field(None, max_length=200)
    user_metadata: Annotated[dict[Annotated[str, Field(max_length=256)], Annotated[str, Field(max_length=1024)]],
                             Field(max_length=32)] = {}
    display_name: str | None = Field(None, min_length=1, max_length=256)
    owner: Annotated[Union[OwnOwner, AccessibleOwner, UsersOwner], Field(discriminator="type")] = OwnOwner(type="own")
    statuses: list[Annotated[Union[ActiveStatus, CancelledStatus, FailedStatus, ClientFinishedStatus],
                             Field(discriminator="type")]] | None = Field(None, min_length=1, max_length=8)
    limit: int = Field(50, ge=1, le=200)
    cursor: SearchCursor | None = None


def _owners(owner: OwnOwner | AccessibleOwner | UsersOwner, user: User) -> tuple[str, ...] | None:
    """The user names a search may match (None: everyone's). Only an admin (User.is_admin)
    searches other users' sessions: for anyone else ``accessible`` is their own sessions, and
    ``user`` their own if their URN is listed (nothing is shared between users here)."""
    if isinstance(owner, OwnOwner):
        return (user.name,)
    if isinstance(owner, AccessibleOwner):
        return None if user.is_admin else (user.name,)
    names = tuple(urn.removeprefix(URN_PREFIX) for urn in owner.owner_urns if urn.startswith(URN_PREFIX))
    return names if user.is_admin else tuple(name for name in names if name == user.name)


def _states(statuses: list | None) -> tuple[tuple[str, tuple[str, ...] | None], ...] | None:
    """The SDK's statuses as this server's session states: ``active``; ``finished`` (the client
    said so: client_finished, with its reason); ``expired`` (no heartbeat: the server ended
    it, shown as cancelled). This server never fails a session: ``failed`` matches none."""
    if statuses is None:
        return None
    states = []
    for status in statuses:
        if isinstance(status, ActiveStatus):
            states.append(("active", None))
        elif isinstance(status, CancelledStatus):
            states.append(("expired", None))
        elif isinstance(status, ClientFinishedStatus):
            states.append(("finished", None if status.reasons is None else tuple(status.reasons)))
    return tuple(states)


def _status(hit: projects.SessionHit, timeout_s: float) -> dict[str, Any]:
    if hit.state == "active":
        return {"type": "active"}
    if hit.state == "finished":
        return {"type": "client_finished", "reason": {"type": hit.finish_reason or "success"}}
    return {"type": "cancelled", "detail": f"ended by the server: no heartbeat for {timeout_s:.0f} s"}


def _summary(hit: projects.SessionHit, timeout_s: float) -> dict[str, Any]:
    return {"session_id": hit.session_id, "created_at": (_EPOCH + hit.created_us * _MICROSECOND).isoformat(),
            "owner": hit.owner, "project_id": hit.project_id, "status": _status(hit, timeout_s),
            "checkpoints_count": hit.checkpoints_count, "display_name": hit.display_name,
            "user_metadata": {k: v for k, v in hit.user_metadata.items() if isinstance(v, str)},
            "checkpoint_storage_bytes": hit.checkpoint_storage_bytes}


@router.post("/sessions/search")
async def search_sessions(body: SessionSearch, user: User = Depends(tinker_user),
                          svc: TinkerService = Depends(service)) -> dict[str, Any]:
    """A page of sessions, newest first; ``next_cursor`` continues it. Projects named in
    ``project_ids`` are the searcher's own (an admin's ``accessible`` search: anyone's of that
    name); a name nobody uses matches nothing."""
    query = projects.SessionFilter(
        owners=_owners(body.owner, user), session_id=body.session_id,
        display_words=tuple(body.display_name.split()) if body.display_name else (),
        project_ids=None if body.project_ids is None else tuple(body.project_ids),
        user_metadata=body.user_metadata, states=_states(body.statuses))
    after = None if body.cursor is None else (
        (body.cursor.last_created_at - _EPOCH) // _MICROSECOND, body.cursor.last_session_id)
    hits, following = projects.search(svc.state.store, query, body.limit, after)
    timeout_s = svc.settings.session_timeout_s
    return {"sessions": [_summary(hit, timeout_s) for hit in hits],
            "next_cursor": None if following is None else {
                "last_created_at": (_EPOCH + following[0] * _MICROSECOND).isoformat(),
                "last_session_id": following[1]}}
