"""The audit's findings about environment endpoints: env checks that took the server down (4)
and requests to hosts, ports and paths a client picked (5)."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import pytest


@pytest.fixture
def tarpit():
    """Accepts connections and never answers; ``accepted`` is set once one came in."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    accepted = threading.Event()
    held: list[socket.socket] = []

    def accept():
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            held.append(conn)
            accepted.set()

    threading.Thread(target=accept, daemon=True).start()
    yield f"http://127.0.0.1:{listener.getsockname()[1]}", accepted
    listener.close()
    for conn in held:
        conn.close()


def _check(client, **config):
    return client.post("/v1/env/check", json={"interactions": [{"name": "game", "class_path": "gym", "config": config}]})


# 4 ------------------------------------------------------------------------------------


def test_4_ten_thousand_shards_are_refused_without_a_probe(alice, recording_service):
    url, seen = recording_service
    answer = _check(alice, env_endpoint=url, env_shards=10000)
    assert answer.status_code == 200 and answer.json()["ok"] is False
    (problem,) = answer.json()["problems"]
    assert problem.startswith("interactions[0] ('game'): ") and "env_shards" in problem and "16" in problem
    assert seen == []
    job = alice.post("/v1/jobs", json={"interactions": [{"name": "game", "class_path": "gym",
                                                          "config": {"env_endpoint": url, "env_shards": 10000}}]})
    assert job.status_code == 400 and "env_shards" in job.json()["error"]


def test_4_a_hanging_check_does_not_hold_up_other_clients(alice, tarpit):
    url, accepted = tarpit
    results = {}
    thread = threading.Thread(target=lambda: results.setdefault("check", _check(alice, env_endpoint=url)))
    thread.start()
    assert accepted.wait(30), "the check never reached the env server"
    with_check_running = alice.get("/v1/health")
    assert with_check_running.status_code == 200
    assert thread.is_alive()  # health answered while the probe was still waiting
    thread.join(60)
    (problem,) = results["check"].json()["problems"]
    assert "no answer within 2 s" in problem


def test_4_env_checks_are_bounded_server_wide(start_server, tmp_path, helpers, tarpit):
    url, accepted = tarpit
    live = start_server(tmp_path, max_concurrent_env_checks=1)
    kim, lee = helpers.make_user(tmp_path, "kim"), helpers.make_user(tmp_path, "lee")
    with live.client(kim) as first, live.client(lee) as second:
        thread = threading.Thread(target=_check, args=(first,), kwargs={"env_endpoint": url})
        thread.start()
        assert accepted.wait(30)
        busy = _check(second, env_endpoint=url)
        assert busy.status_code == 429 and busy.headers["Retry-After"].isdigit()
        assert "1 env checks are already running" in busy.json()["error"]
        thread.join(60)


def test_4_round2_two_hundred_interactions_at_a_tarpit_cost_their_sender_only(alice, bob, tarpit,
                                                                               recording_service):
    """The audit's round-2 request: 200 interactions pointing at a tarpit in one check (76 s
    before, and four of them took every server-wide slot). Now one probe per distinct URL,
    within the check's budget; the sender's second check is a 429 while the first runs; another
    user's check answers meanwhile."""
    url, accepted = tarpit
    healthy, _ = recording_service
    body = {"interactions": [{"name": f"game{i}", "class_path": "gym", "config": {"env_endpoint": url}}
                             for i in range(200)]}
    results = {}
    thread = threading.Thread(target=lambda: results.setdefault("check", alice.post("/v1/env/check", json=body)))
    thread.start()
    assert accepted.wait(30), "the check never reached the tarpit"
    second = alice.post("/v1/env/check", json=body)
    assert second.status_code == 429 and second.headers["Retry-After"].isdigit()
    assert "you have an env check running already" in second.json()["error"]
    other = _check(bob, env_endpoint=healthy)  # some service on loopback: probed, it answers 404
    assert other.status_code == 200 and other.json()["problems"][0].endswith("health check answered HTTP 404")
    assert thread.is_alive()  # bob's check answered while alice's was still waiting on the tarpit
    thread.join(6 + 10)  # the check's budget (env_check_budget_s), and room for a loaded machine
    assert not thread.is_alive()
    problems = results["check"].json()["problems"]
    assert len(problems) == 200 and all("no answer within 2 s" in p for p in problems)
    assert problems[0].startswith("interactions[0] ('game0'): ")


@contextlib.contextmanager
def endless_health():
    """An env server whose ``/health`` answers 200 and then sends its body for ever, a chunk
    every 0.2 s (so no read ever times out)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    stop = threading.Event()

    def serve(conn: socket.socket) -> None:
        with conn:
            conn.recv(65536)
            try:
                conn.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
                while not stop.wait(0.2):
                    conn.sendall(b"1\r\nx\r\n")
            except OSError:  # the prober hung up: what it should do
                pass

    def accept() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        stop.set()
        listener.close()


def test_4_round2_a_check_ends_within_its_budget_and_never_reads_a_reply_body(start_server, tmp_path, helpers,
                                                                                tarpit):
    """Probes still waiting when ``env_check_budget_s`` is spent are reported as not answered
    (here the per-probe timeout alone would wait 30 s), and a /health whose body never ends
    counts as answered: only its status is read."""
    url, _ = tarpit
    live = start_server(tmp_path, endpoint_check_timeout_s=30.0, env_check_budget_s=1.0)
    with live.client(helpers.make_user(tmp_path, "ola")) as client, endless_health() as endless:
        body = {"interactions": [{"name": "stuck", "class_path": "gym", "config": {"env_endpoint": url}},
                                 {"name": "endless", "class_path": "gym", "config": {"env_endpoint": endless}}]}
        started = time.monotonic()
        answer = client.post("/v1/env/check", json=body)
        elapsed = time.monotonic() - started
    assert answer.status_code == 200
    assert answer.json()["problems"] == [
        f"interactions[0] ('stuck'): {url}/health: not answered within this check's budget of 1 s"]
    assert elapsed < 10  # the 1 s budget and a loaded machine's slack, never the 30 s probe timeout


def test_4_round2_a_check_probes_a_bounded_number_of_endpoints(alice, recording_service):
    url, seen = recording_service
    many = {"interactions": [{"name": f"g{i}", "class_path": "gym", "config": {"env_endpoint": f"http://127.0.0.1:{i + 1}"}}
                             for i in range(33)]}
    answer = alice.post("/v1/env/check", json=many)
    assert answer.status_code == 400 and "33 distinct env endpoints; one check probes at most 32" in answer.json()["error"]
    too_many = {"interactions": [{"name": f"g{i}", "class_path": "gym", "config": {"env_endpoint": url}}
                                 for i in range(257)]}
    answer = alice.post("/v1/env/check", json=too_many)
    assert answer.status_code == 422 and "body.interactions" in answer.json()["error"]


# 5 ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "suffix, needle",
    [
        ("/v1/jobs?x=", "no path, query or fragment"),
        ("/reset", "no path, query or fragment"),
        ("#frag", "no path, query or fragment"),
    ],
)
def test_5_endpoints_are_base_urls_only(alice, recording_service, suffix, needle):
    url, seen = recording_service
    (problem,) = _check(alice, env_endpoint=url + suffix).json()["problems"]
    assert needle in problem
    userinfo = url.replace("http://", "http://user:pw@")
    (problem,) = _check(alice, env_endpoint=userinfo).json()["problems"]
    assert "user info" in problem
    assert seen == []


def test_5_the_operator_picks_hosts_and_ports(start_server, tmp_path, helpers, recording_service):
    url, seen = recording_service
    live = start_server(tmp_path, env_hosts=["127.0.0.1:1-2", "envs.example"])
    key = helpers.make_user(tmp_path, "liam")
    with live.client(key) as client:
        (problem,) = _check(client, env_endpoint=url).json()["problems"]
        assert f"env_endpoint {url} is not allowed on this server (allowed env hosts: 127.0.0.1:1-2, envs.example)" \
            in problem
        (own,) = _check(client, env_endpoint=live.url).json()["problems"]
        assert "is this training server's own address" in own
        job = client.post("/v1/jobs", json={"interactions": [{"name": "g", "class_path": "gym",
                                                               "config": {"env_endpoint": url}}]})
        assert job.status_code == 400 and job.json()["detail"] == {"field": "interactions[0].config"}
    nothing = start_server(tmp_path / "closed", env_hosts=[])
    with nothing.client(helpers.make_user(tmp_path / "closed", "mia")) as client:
        (problem,) = _check(client, env_endpoint=url).json()["problems"]
        assert "this server allows no environment servers" in problem and "--allow-env-host" in problem
    assert seen == []  # nothing was ever sent to a host the operator did not allow


def test_8_the_servers_own_address_is_refused_by_any_name_that_resolves_to_it(start_server, tmp_path, helpers):
    """The audit: with ``--allow-env-host vm`` and ``vm`` resolving to 127.0.0.1,
    ``http://vm:<server port>`` passed. This machine's own name resolves to one of its own
    addresses (loopback or an interface's): refused on the server's port, allowed on another."""
    name = socket.gethostname()
    live = start_server(tmp_path, env_hosts=[name, "localhost"])
    port = int(live.url.rsplit(":", 1)[1])
    key = helpers.make_user(tmp_path, "noor")
    with live.client(key) as client:
        for host in (name, "localhost"):
            own = f"http://{host}:{port}"
            (problem,) = _check(client, env_endpoint=own).json()["problems"]
            assert f"env_endpoint {own} is this training server's own address" in problem
            job = client.post("/v1/jobs", json={"interactions": [{"name": "g", "class_path": "gym",
                                                                   "config": {"env_endpoint": own}}]})
            assert job.status_code == 400 and "is this training server's own address" in job.json()["error"]
        (other,) = _check(client, env_endpoint=f"http://{name}:1").json()["problems"]
        assert "own address" not in other and "/health: unreachable" in other  # allowed, probed, nobody there


def test_5_replies_do_not_reveal_other_services(alice, recording_service):
    url, seen = recording_service
    answer = _check(alice, env_endpoint=url)
    (problem,) = answer.json()["problems"]
    assert problem.endswith(f"{url}/health: health check answered HTTP 404")
    assert "SECRET" not in answer.text
    assert [request["path"] for request in seen] == ["/health"]  # a fixed protocol path, nothing the client chose


# 12 -----------------------------------------------------------------------------------


def test_12_a_regex_scorer_pattern_is_checked_when_the_job_is_made(alice):
    """The pattern is the client's and runs in the trainer: bounded and compiled up front, so a
    bad one is a 400 naming the field, not a failure mid-training."""
    for pattern, message in (("a" * 1001, "pattern: at most 1000 characters, got 1001"),
                             ("(unclosed", "invalid regex pattern '(unclosed'")):
        spec = {"name": "quiz", "class_path": "simple_text", "config": {"scorer": "regex", "pattern": pattern}}
        job = alice.post("/v1/jobs", json={"interactions": [spec]})
        assert job.status_code == 400 and job.json()["detail"] == {"field": "interactions[0].config"}
        assert job.json()["error"].startswith("interactions[0] ('quiz'): ") and message in job.json()["error"]
        (problem,) = alice.post("/v1/env/check", json={"interactions": [spec]}).json()["problems"]
        assert message in problem
