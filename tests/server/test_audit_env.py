"""The audit's findings about environment endpoints: env checks that took the server down (4)
and requests to hosts, ports and paths a client picked (5)."""

from __future__ import annotations

import socket
import threading

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
    assert job.status_code == 422 and "env_shards" in job.json()["error"]


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
    key = helpers.make_user(tmp_path, "kim")
    with live.client(key) as first, live.client(key) as second:
        thread = threading.Thread(target=_check, args=(first,), kwargs={"env_endpoint": url})
        thread.start()
        assert accepted.wait(30)
        busy = _check(second, env_endpoint=url)
        assert busy.status_code == 429 and busy.headers["Retry-After"].isdigit()
        assert "1 env checks are already running" in busy.json()["error"]
        thread.join(60)


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
        assert job.status_code == 422 and job.json()["detail"] == {"field": "interactions[0].config"}
    nothing = start_server(tmp_path / "closed", env_hosts=[])
    with nothing.client(helpers.make_user(tmp_path / "closed", "mia")) as client:
        (problem,) = _check(client, env_endpoint=url).json()["problems"]
        assert "this server allows no environment servers" in problem and "--allow-env-host" in problem
    assert seen == []  # nothing was ever sent to a host the operator did not allow


def test_5_replies_do_not_reveal_other_services(alice, recording_service):
    url, seen = recording_service
    answer = _check(alice, env_endpoint=url)
    (problem,) = answer.json()["problems"]
    assert problem.endswith(f"{url}/health: health check answered HTTP 404")
    assert "SECRET" not in answer.text
    assert [request["path"] for request in seen] == ["/health"]  # a fixed protocol path, nothing the client chose
