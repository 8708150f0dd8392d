"""Identity tokens, projects and the session search through the official ``tinker`` SDK
(unmodified) against a real server on 127.0.0.1: the SDK trades its key for a token and
``whoami`` reads it; revoking the key stops its tokens at once (a held long poll too); an
expired or altered token is a 401 ``invalid_token`` the SDK recovers from by trading again;
``assign_session_project`` moves only one's own sessions (another user's is a 404 left in the
audit log); ``search_sessions`` filters and pages; a user's projects are bounded."""

from __future__ import annotations

import os
import threading
import time

import httpx
import pytest

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402
from tinker.lib.experimental import ExperimentalWarning  # noqa: E402

from opentinker.server import auth  # noqa: E402
from opentinker.server.store import Store  # noqa: E402
from opentinker.server.tinker.identity import IdentityTokens, looks_like_token  # noqa: E402

os.environ.setdefault("TINKER_TELEMETRY", "0")
TINY = "opentinker-tiny-arith"
INVALID_TOKEN = 'Bearer error="invalid_token"'


def _raw(server, credential: str) -> httpx.Client:
    """Plain HTTP to the Tinker API with ``credential`` (``tml-<key>`` or a token) as X-API-Key."""
    return httpx.Client(base_url=f"{server.url}/api/v1", headers={"X-API-Key": credential}, timeout=60,
                        trust_env=False)


def _token(server, key: str) -> str:
    with _raw(server, "tml-" + key) as raw:
        answer = raw.post("/auth/token", json={})
    assert answer.status_code == 200, answer.text
    return answer.json()["jwt"]


def _user(server, name: str):
    return server.app.state.store.get_user(name)


def _search(rest, **fields) -> types.SessionSearchResponse:
    with pytest.warns(ExperimentalWarning):  # search_sessions is experimental in SDK 0.38
        return rest.search_sessions(types.SessionSearchRequest(**fields)).result()


def _search_all(rest, **fields) -> list[types.SessionSummary]:
    """Every page of a search, following next_cursor."""
    found, cursor = [], None
    while True:
        page = _search(rest, cursor=cursor, **fields)
        found += page.sessions
        if page.next_cursor is None:
            return found
        cursor = page.next_cursor


def test_whoami_names_the_user_and_every_request_goes_with_a_token(server, data_dir, helpers):
    key = helpers.make_user(data_dir, "ida")
    rest = tinker.RestClient(base_url=server.url, api_key="tml-" + key)
    who = rest.whoami().result()
    assert who.user_urn == "tml:user:ida"
    assert who.org_urn == f"tml:organization:{server.app.state.store.server_id()}"
    assert who.email is None
    assert rest.list_sessions().result().sessions == []  # sent with the token the SDK holds

    token = _token(server, key)
    assert looks_like_token(token)
    claims = server.app.state.tinker_identity.verify(token)
    assert claims.subject == "tml:user:ida" and claims.key_sha256 == auth.hash_key(key)
    assert claims.expires_at - claims.issued_at == server.app.state.tinker.settings.identity_token_s
    with _raw(server, token) as raw:
        assert raw.get("/sessions").status_code == 200
        # A token buys no token: only the key does.
        refused = raw.post("/auth/token", json={})
        assert refused.status_code == 401 and "API key itself" in refused.json()["error"], refused.text


def test_revoking_a_key_stops_its_tokens_at_once_and_ends_their_long_polls(server, data_dir, helpers):
    key = helpers.make_user(data_dir, "rita")
    rest = tinker.RestClient(base_url=server.url, api_key="tml-" + key)
    rest.list_sessions().result()
    token = _token(server, key)
    with _raw(server, token) as raw:
        session_id = raw.post("/create_session", json={"tags": [], "sdk_version": "raw"}).json()["session_id"]
        sampler = raw.post("/create_sampling_session", json={"session_id": session_id, "sampling_session_seq_id": 0,
                                                             "base_model": TINY}).json()["sampling_session_id"]
    # A long poll held under the token (nothing is sampled: it waits its whole timeout).
    poll: dict = {}

    def hold():
        with _raw(server, token) as raw:
            answer = raw.post("/retrieve_futures", json={"target": {"type": "sampling_session",
                                                                    "sampling_session_id": sampler}, "timeout": 40})
        poll.update(status=answer.status_code, body=answer.json(), at=time.monotonic())

    holder = threading.Thread(target=hold, daemon=True)
    holder.start()
    watched = server.app.state.credential_watch._watched
    helpers.wait_for(lambda: any(c.digest == auth.hash_key(key) for c in watched), 30, "the poll to be held")

    store = Store(data_dir / "opentinker.db")  # another connection to the file, as `admin revoke-key` is
    try:
        assert auth.revoke_api_key(store, key)
    finally:
        store.close()
    revoked_at = time.monotonic()
    with _raw(server, token) as raw:
        answer = raw.get("/sessions")
    assert answer.status_code == 401 and answer.headers["WWW-Authenticate"] == INVALID_TOKEN, answer.text
    assert "revoked" in answer.json()["error"]
    with pytest.raises(tinker.AuthenticationError):  # the SDK trades again, and the key itself is refused
        rest.list_sessions().result()
    holder.join(15)
    assert poll.get("status") == 401 and poll["at"] - revoked_at < 10, poll
    assert poll["body"]["error"].startswith("the API key was revoked")


def test_an_expired_or_altered_token_is_invalid_and_the_sdk_trades_its_key_again(server, data_dir, helpers):
    key = helpers.make_user(data_dir, "eve-token")
    user = _user(server, "eve-token")
    store = server.app.state.store
    past = IdentityTokens(store.secret("identity_tokens"), store.server_id(), 60, clock=lambda: time.time() - 120)
    fresh = _token(server, key)
    head, claims, signature = fresh.split(".")
    other = IdentityTokens(b"\0" * 32, store.server_id(), 60).mint(user, auth.hash_key(key))  # another server's
    altered = f"{head}.{claims}.{signature[:-2]}{'AB' if signature[-2:] != 'AB' else 'CD'}"
    cases = [("expired", past.mint(user, auth.hash_key(key))), ("signature does not match", altered),
             ("signature does not match", other), ("not a JWT", "eyJhbGciOiJIUzI1NiJ9.e30"),
             ("longer than", "eyJ" + "A" * 5000)]
    for expected, token in cases:
        with _raw(server, token) as raw:
            answer = raw.get("/sessions")
        assert answer.status_code == 401, (expected, answer.text)
        assert answer.headers["WWW-Authenticate"] == INVALID_TOKEN
        assert expected in answer.json()["error"], answer.text

    # The SDK holds a token the server rejects before its exp: it trades its key again and
    # sends the request once more.
    rest = tinker.RestClient(base_url=server.url, api_key="tml-" + key)
    rest.whoami().result()
    provider = rest.holder._default_auth
    provider._token = altered
    assert rest.list_sessions().result().sessions == []
    assert provider._token != altered and server.app.state.tinker_identity.verify(provider._token)


def test_a_session_is_created_in_a_project_and_moved_only_by_its_owner(server, data_dir, helpers):
    key = helpers.make_user(data_dir, "pia")
    other_key = helpers.make_user(data_dir, "quinn")
    service = tinker.ServiceClient(project_id="alpha", display_name="Nightly Sweep 7", user_metadata={"team": "rl"},
                                   base_url=server.url, api_key="tml-" + key)
    rest = tinker.RestClient(base_url=server.url, api_key="tml-" + key)
    try:
        training = service.create_lora_training_client(base_model=TINY, rank=4).result()
        saved = training.save_state("kept").result()
        [found] = _search(rest, project_ids=["alpha"]).sessions
        assert (found.project_id, found.display_name, found.owner) == ("alpha", "Nightly Sweep 7", "pia")
        assert found.user_metadata == {"team": "rl"} and found.status == types.SessionActive()
        assert found.checkpoints_count == 1 and found.checkpoint_storage_bytes > 0
        session_id = found.session_id
        assert saved.path.startswith(f"tinker://{session_id}:")

        rest.assign_session_project(session_id, "beta").result()
        assert [s.session_id for s in _search(rest, project_ids=["beta"]).sessions] == [session_id]
        assert _search(rest, project_ids=["alpha"]).sessions == []
        moved = server.app.state.audit.entries(user_id=_user(server, "pia").id, events=("session_project_set",))
        assert moved[0].details == {"session_id": session_id, "project_id": "beta", "previous_project_id": "alpha"}

        with pytest.raises(tinker.UnprocessableEntityError, match="project_id"):
            rest.assign_session_project(session_id, "no spaces").result()
    finally:
        service.close("errored").result()
    [ended] = _search(rest, session_id=session_id).sessions
    assert ended.status == types.ClientSessionFinished(reason=types.ClientSessionFinishErrored())

    # Another user's session reads as a missing one, and the attempt is in the owner's audit log
    # (not the asker's: their own log must not tell them the session exists).
    stranger = tinker.RestClient(base_url=server.url, api_key="tml-" + other_key)
    for target in (session_id, "no-such-session"):
        with pytest.raises(tinker.NotFoundError):
            stranger.assign_session_project(target, "mine").result()
    denied = server.app.state.audit.entries(user_id=_user(server, "pia").id, events=("access_denied",))
    assert [(e.user_name, e.details) for e in denied] == [
        ("pia", {"asker": "quinn", "resource": f"session:{session_id}", "action": "session_project_set"})]
    assert not server.app.state.audit.entries(user_id=_user(server, "quinn").id, events=("access_denied",))
    assert _search(rest, project_ids=["beta"]).sessions[0].project_id == "beta"  # not moved
    assert _search(stranger, session_id=session_id).sessions == []


def test_search_filters_statuses_and_pages_newest_first(server, data_dir, helpers):
    key = helpers.make_user(data_dir, "sam")
    other_key = helpers.make_user(data_dir, "sol")
    admin_key = helpers.make_user(data_dir, "ada")
    assert server.app.state.store.set_admin("ada", True)
    made = []
    with _raw(server, "tml-" + key) as raw:
        for i in range(7):
            answer = raw.post("/create_session", json={
                "tags": [], "sdk_version": "raw", "user_metadata": {"team": "rl" if i % 2 else "sft", "i": str(i),
                                                                     "odd key \"'.$": "x"},
                "display_name": f"Sweep {i} NIGHTLY", "project_id": "grid" if i < 4 else None})
            assert answer.status_code == 200, answer.text
            made.append(answer.json()["session_id"])
        for session_id, reason in ((made[0], "success"), (made[1], "errored"), (made[2], "interrupted")):
            assert raw.post(f"/sessions/{session_id}/finish", json={"reason": {"type": reason}}).status_code == 204
    # What housekeeping does to a session without heartbeats for --tinker-session-timeout.
    server.app.state.tinker.state.end_session(made[3], "expired")
    with _raw(server, "tml-" + other_key) as raw:
        others = raw.post("/create_session", json={"tags": [], "sdk_version": "raw", "display_name": "Sweep"}
                          ).json()["session_id"]
    rest = tinker.RestClient(base_url=server.url, api_key="tml-" + key)
    newest_first = made[::-1]

    def ids(**fields):
        return [s.session_id for s in _search(rest, **fields).sessions]

    everything = _search_all(rest, limit=3)
    assert [s.session_id for s in everything] == newest_first  # three pages, no repeats, others' left out
    assert [s.created_at for s in everything] == sorted((s.created_at for s in everything), reverse=True)
    assert ids(user_metadata={"team": "rl"}) == [made[5], made[3], made[1]]
    assert ids(user_metadata={"team": "rl", "i": "5"}) == [made[5]]
    assert ids(user_metadata={"odd key \"'.$": "x"}) == newest_first
    assert ids(display_name="nightly sweep 4") == [made[4]]  # every word, any case, any order
    assert ids(display_name="sweep 2", session_id=made[6]) == [made[6], made[2]]  # either one
    assert ids(project_ids=["grid"]) == newest_first[3:] and ids(project_ids=["default"]) == newest_first[:3]
    assert ids(statuses=[types.ActiveSessionStatusQuery()]) == newest_first[:3]
    assert ids(statuses=[types.ClientFinishedSessionStatusQuery()]) == [made[2], made[1], made[0]]
    assert ids(statuses=[types.ClientFinishedSessionStatusQuery(reasons=["errored", "interrupted"])]) == [
        made[2], made[1]]
    assert ids(statuses=[types.CancelledSessionStatusQuery()]) == [made[3]]
    assert ids(statuses=[types.FailedSessionStatusQuery()]) == []
    by_id = {s.session_id: s for s in everything}
    assert by_id[made[1]].status == types.ClientSessionFinished(reason=types.ClientSessionFinishErrored())
    assert isinstance(by_id[made[3]].status, types.SessionCancelled)
    assert by_id[made[0]].checkpoints_count == 0 and by_id[made[0]].owner == "sam"

    # Only an admin searches (and lists) other users' sessions.
    assert ids(owner=types.AccessibleSearchOwner(), limit=200) == newest_first
    assert ids(owner=types.UserSearchOwner(owner_urns=["tml:user:sol"])) == []
    admin = tinker.RestClient(base_url=server.url, api_key="tml-" + admin_key)
    assert [s.session_id for s in _search(admin, owner=types.UserSearchOwner(owner_urns=["tml:user:sol"])).sessions
            ] == [others]
    seen = [s.session_id for s in _search_all(admin, owner=types.AccessibleSearchOwner(), limit=200)]
    assert seen[:8] == [others, *newest_first]
    assert rest.list_sessions(limit=1000, access_scope="accessible").result().sessions == newest_first
    assert set(admin.list_sessions(limit=1000, access_scope="accessible").result().sessions) >= {others, *made}

    with _raw(server, "tml-" + key) as raw:
        for body, field in (({"limit": 201}, "limit"), ({"project_ids": ["a b"]}, "project_ids"),
                            ({"user_metadata": {str(i): "x" for i in range(33)}}, "user_metadata")):
            answer = raw.post("/sessions/search", json=body)
            assert answer.status_code == 422 and field in answer.json()["error"], answer.text


def test_a_users_projects_are_bounded(server, data_dir, helpers, monkeypatch):
    monkeypatch.setattr(server.app.state.tinker.settings, "max_projects_per_user", 2)
    key = helpers.make_user(data_dir, "pat")
    with _raw(server, "tml-" + key) as raw:
        def create(project_id):
            return raw.post("/create_session", json={"tags": [], "sdk_version": "raw", "project_id": project_id})

        first, second = create("p1").json()["session_id"], create("p2").json()["session_id"]
        refused = create("p3")
        assert refused.status_code == 400 and "--max-projects-per-user" in refused.json()["error"], refused.text
        assert create(None).status_code == 200 and create("p1").status_code == 200  # default, and a known one
        assert raw.put(f"/sessions/{second}/project", json={"project_id": "p1"}).status_code == 204
        # p2 is empty now, so it no longer counts: a new project fits again.
        assert raw.put(f"/sessions/{first}/project", json={"project_id": "p3"}).status_code == 204
        refused = raw.put(f"/sessions/{first}/project", json={"project_id": "p4"})
        assert refused.status_code == 400 and "--max-projects-per-user" in refused.json()["error"], refused.text
        bad = create("x" * 65)
        assert bad.status_code == 422 and "project_id" in bad.json()["error"], bad.text
