"""Projects and the session search, over the Tinker tables (state.py).

A project is a name in one user's own namespace (alice's ``nightly`` and bob's are two
projects; nothing is shared between users). It exists while a remembered session is in it
(ended sessions past a user's newest ``keep_ended_sessions`` are forgotten, and so are the
projects only they were in); ``default`` holds every session created without one and is not
counted against ``max_projects_per_user``.

The search reads one page in one bounded query: every filter, the order (newest first, by
creation time in microseconds, then session id) and the keyset cursor are SQL, and the
checkpoint counts are computed for the page's rows only.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from opentinker.server.store import Store
from opentinker.server.tinker.state import DEFAULT_PROJECT

PROJECT_NAME = r"^[A-Za-z0-9._-]{1,64}$"
# A session's creation time as whole microseconds: what a cursor carries back exactly.
_CREATED_US = "CAST(ROUND(s.created_at * 1000000) AS INTEGER)"


def project_count(store: Store, user_id: int) -> int:
    """How many projects the user has, ``default`` not counted."""
    rows = store.query("SELECT COUNT(DISTINCT project_id) AS n FROM tinker_sessions WHERE user_id = ? "
                       "AND project_id != ?", (user_id, DEFAULT_PROJECT))
    return int(rows[0]["n"])


def has_project(store: Store, user_id: int, project_id: str) -> bool:
    return project_id == DEFAULT_PROJECT or bool(store.query(
        "SELECT 1 FROM tinker_sessions WHERE user_id = ? AND project_id = ? LIMIT 1", (user_id, project_id)))


def project_problem(store: Store, user_id: int, project_id: str, limit: int) -> str | None:
    """Why the user may not put a session into ``project_id`` (a new project past ``limit``), or None."""
    if has_project(store, user_id, project_id) or project_count(store, user_id) < limit:
        return None
    return (f"project_id: {project_id!r} would be a new project, and you have {limit} projects, the most this server "
            "allows per user (--max-projects-per-user); use one of your projects, or let the sessions of one end")


def set_session_project(store: Store, session_id: str, project_id: str) -> str | None:
    """Moves the session into ``project_id``; the project it was in (None: no such session)."""
    with store.transaction() as conn:
        row = conn.execute("SELECT project_id FROM tinker_sessions WHERE session_id = ?", (session_id,)).fetchone()
        conn.execute("UPDATE tinker_sessions SET project_id = ? WHERE session_id = ?", (project_id, session_id))
    return None if row is None else row["project_id"]


@dataclass(frozen=True)
class SessionFilter:
    """What a search matches; every field that is set must hold. ``owners``: user names (None:
    every user's; the caller decides who may ask for that). ``states``: (state, finish
    reasons or None for any) pairs, any of which may match; an empty tuple matches nothing."""

    owners: tuple[str, ...] | None
    session_id: str | None = None
    display_words: tuple[str, ...] = ()  # with session_id: either one matches
    project_ids: tuple[str, ...] | None = None
    user_metadata: dict[str, str] = field(default_factory=dict)
    states: tuple[tuple[str, tuple[str, ...] | None], ...] | None = None


@dataclass(frozen=True)
class SessionHit:
    session_id: str
    created_us: int  # microseconds since the epoch
    owner: str
    project_id: str
    state: str  # active | finished | expired
    finish_reason: str | None
    display_name: str | None
    user_metadata: dict[str, Any]
    checkpoints_count: int
    checkpoint_storage_bytes: int


def _where(query: SessionFilter, after: tuple[int, str] | None) -> tuple[str, list[Any]]:
    conditions: list[str] = []
    params: list[Any] = []
    if query.owners is not None:
        conditions.append(f"u.name IN ({', '.join('?' * len(query.owners))})" if query.owners else "0")
        params += query.owners
    named: list[str] = []  # session_id or display_name: either one
    if query.session_id is not None:
        named.append("s.session_id = ?")
        params.append(query.session_id)
    if query.display_words:
        # lower() folds ASCII letters only: other letters must match in case.
        named.append("(" + " AND ".join("instr(lower(s.display_name), lower(?)) > 0" for _ in query.display_words)
                     + ")")
        params += query.display_words
    if named:
        conditions.append("(" + " OR ".join(named) + ")")
    if query.project_ids is not None:
        conditions.append(f"s.project_id IN ({', '.join('?' * len(query.project_ids))})" if query.project_ids else "0")
        params += query.project_ids
    for key, value in query.user_metadata.items():
        # json_each, not a JSON path: any key matches exactly, whatever characters it has.
        conditions.append("EXISTS (SELECT 1 FROM json_each(s.metadata_json) j WHERE j.key = ? AND j.type = 'text' "
                          "AND j.value = ?)")
        params += [key, value]
    if query.states is not None:
        alternatives = []
        for state, reasons in query.states:
            if reasons is None:
                alternatives.append("s.state = ?")
                params.append(state)
            else:  # a session finished before reasons were kept counts as a success
                alternatives.append(f"(s.state = ? AND COALESCE(s.finish_reason, 'success') IN "
                                    f"({', '.join('?' * len(reasons))}))")
                params += [state, *reasons]
        conditions.append("(" + " OR ".join(alternatives) + ")" if alternatives else "0")
    if after is not None:
        conditions.append(f"({_CREATED_US} < ? OR ({_CREATED_US} = ? AND s.session_id < ?))")
        params += [after[0], after[0], after[1]]
    return " AND ".join(conditions) or "1", params


def search(store: Store, query: SessionFilter, limit: int, after: tuple[int, str] | None = None,
           ) -> tuple[list[SessionHit], tuple[int, str] | None]:
    """A page of at most ``limit`` sessions, newest first, that come after ``after`` (the
    previous page's last (created_us, session_id)); and the cursor of the next page, None
    when there is none."""
    where, params = _where(query, after)
    rows = store.query(
        "SELECT page.*, "
        "(SELECT COUNT(*) FROM tinker_models m JOIN tinker_checkpoints c ON c.run_id = m.model_id "
        " WHERE m.session_id = page.session_id) AS checkpoints_count, "
        "(SELECT COALESCE(SUM(c.size_bytes), 0) FROM tinker_models m JOIN tinker_checkpoints c "
        " ON c.run_id = m.model_id WHERE m.session_id = page.session_id) AS checkpoint_bytes "
        f"FROM (SELECT s.session_id, {_CREATED_US} AS created_us, u.name AS owner, s.project_id, s.state, "
        "s.finish_reason, s.display_name, s.metadata_json FROM tinker_sessions s JOIN users u ON u.id = s.user_id "
        f"WHERE {where} ORDER BY created_us DESC, s.session_id DESC LIMIT ?) page "
        "ORDER BY created_us DESC, session_id DESC", params + [limit + 1])
    hits = [SessionHit(r["session_id"], int(r["created_us"]), r["owner"], r["project_id"], r["state"],
                       r["finish_reason"], r["display_name"], json.loads(r["metadata_json"]),
                       int(r["checkpoints_count"]), int(r["checkpoint_bytes"])) for r in rows[:limit]]
    more = len(rows) > limit
    return hits, ((hits[-1].created_us, hits[-1].session_id) if more else None)
