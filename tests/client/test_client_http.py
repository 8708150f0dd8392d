"""OpenTinkerClient against the protocol test server: config, errors, retries and idempotency."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from opentinker.client import (
    AuthenticationError,
    ConfigurationError,
    ConflictError,
    ConnectionFailedError,
    NotFoundError,
    OpenTinkerClient,
    ServerError,
    ValidationError,
)
from opentinker.client.errors import parse_retry_after
from opentinker.protocol import JobCreate


def test_base_url_and_key_come_from_the_environment(proto, monkeypatch):
    monkeypatch.setenv("OPENTINKER_BASE_URL", proto.url + "/v1/")
    monkeypatch.setenv("OPENTINKER_API_KEY", proto.api_key)
    with OpenTinkerClient() as client:
        assert client.base_url == proto.url
        assert client.health().status == "ok"
        assert client.version()["version"] == "test"
        assert client.list_jobs() == []


@pytest.mark.parametrize("missing", ["OPENTINKER_BASE_URL", "OPENTINKER_API_KEY"])
def test_missing_configuration_names_both_variables(monkeypatch, missing):
    monkeypatch.setenv("OPENTINKER_BASE_URL", "http://127.0.0.1:1")
    monkeypatch.setenv("OPENTINKER_API_KEY", "k")
    monkeypatch.delenv(missing)
    with pytest.raises(ConfigurationError) as info:
        OpenTinkerClient()
    message = str(info.value)
    assert f"missing {missing}" in message
    assert "OPENTINKER_BASE_URL" in message and "OPENTINKER_API_KEY" in message


def test_explicit_arguments_beat_the_environment(proto, monkeypatch):
    monkeypatch.setenv("OPENTINKER_BASE_URL", "http://127.0.0.1:1")
    monkeypatch.setenv("OPENTINKER_API_KEY", "wrong")
    with OpenTinkerClient(proto.url, proto.api_key) as client:
        assert client.list_jobs() == []


def test_wrong_key_is_an_authentication_error_and_health_needs_no_key(proto):
    with OpenTinkerClient(proto.url, "not-the-key", backoff=0.01) as client:
        assert client.health().status == "ok"
        with pytest.raises(AuthenticationError) as info:
            client.list_jobs()
    assert info.value.status_code == 401
    assert "invalid or missing API key" in str(info.value)
    assert len([r for r in proto.state.requests if r.path == "/v1/jobs"]) == 1  # a 401 is not retried


def test_error_statuses_map_to_typed_errors(client, proto):
    with pytest.raises(NotFoundError):
        client.get_job("nope")
    with pytest.raises(ValidationError) as info:
        client.request("POST", "/jobs", json={"mode": "sideways"})
    assert info.value.status_code == 422
    assert str(info.value).startswith("invalid request: mode")  # the server's `error`, verbatim
    job = client.create_job(JobCreate(mode="server"))
    with pytest.raises(ConflictError) as conflict:
        job.push_step(1, [{"prompt": [{"role": "user", "content": "hi"}]}])
    assert "server mode" in str(conflict.value)


def test_5xx_is_retried_with_the_same_idempotency_key(client, proto):
    proto.state.inject[("POST", "/v1/jobs")] = [503, 502]
    job = client.create_job(JobCreate(name="retried"))
    posts = proto.state.posts("/v1/jobs")
    assert len(posts) == 3
    keys = {p.headers.get("idempotency-key") for p in posts}
    assert len(keys) == 1 and None not in keys
    assert list(proto.state.jobs) == [job.job_id]


def test_a_lost_answer_does_not_create_a_second_job(client, proto):
    proto.state.lose_create_answers = 1  # the job is created, the answer is a 504
    job = client.create_job(JobCreate(name="once"))
    posts = proto.state.posts("/v1/jobs")
    assert len(posts) == 2
    assert posts[0].headers["idempotency-key"] == posts[1].headers["idempotency-key"]
    assert list(proto.state.jobs) == [job.job_id]  # the retry got the same job back


def test_every_post_carries_a_fresh_key_per_logical_request(client, proto):
    client.create_job(JobCreate(name="a"))
    client.create_job(JobCreate(name="b"))
    keys = [p.headers.get("idempotency-key") for p in proto.state.posts("/v1/jobs")]
    assert len(keys) == 2 and all(keys) and keys[0] != keys[1]
    assert len(proto.state.jobs) == 2


def test_retries_run_out_into_typed_errors(proto):
    proto.state.inject[("GET", "/v1/jobs")] = [503] * 10
    with OpenTinkerClient(proto.url, proto.api_key, retries=2, backoff=0.01) as client:
        with pytest.raises(ServerError) as info:
            client.list_jobs()
    assert info.value.status_code == 503
    assert len([r for r in proto.state.requests if r.path == "/v1/jobs"]) == 3


def test_500_is_not_retried(client, proto):
    proto.state.inject[("POST", "/v1/jobs")] = [500]
    with pytest.raises(ServerError):
        client.create_job(JobCreate())
    assert len(proto.state.posts("/v1/jobs")) == 1


class HangUpServer:
    """A TCP server that reads each request's head and hangs up without answering."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.heads: list[str] = []
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                data = b""
                while b"\r\n\r\n" not in data:
                    chunk = conn.recv(65536)
                    if not chunk:
                        break
                    data += chunk
                self.heads.append(data.split(b"\r\n\r\n")[0].decode("latin-1"))

    def keys(self) -> list[str | None]:
        found = []
        for head in self.heads:
            lines = [line.split(":", 1) for line in head.split("\r\n")[1:]]
            found.append(next((v.strip() for k, v in lines if k.lower() == "idempotency-key"), None))
        return found

    def close(self) -> None:
        self.sock.close()


def test_dropped_connections_resend_a_post_only_with_its_key():
    server = HangUpServer()
    try:
        with OpenTinkerClient(server.url, "k", retries=2, backoff=0.01) as client:
            with pytest.raises(ConnectionFailedError) as info:
                client.create_job(JobCreate(name="x"))
            assert "after 3 attempts" in str(info.value)
            time.sleep(0.05)
            assert len(server.heads) == 3
            assert all(head.startswith("POST /v1/jobs ") for head in server.heads)
            keys = server.keys()
            assert None not in keys and len(set(keys)) == 1
            assert client.may_resend("POST", {}) is False  # the rule the retry loop checks
            assert client.may_resend("POST", {"Idempotency-Key": "k"}) is True
            assert client.may_resend("GET", {}) is True
    finally:
        server.close()


def test_unreachable_server_is_a_connection_error(closed_url):
    with OpenTinkerClient(closed_url, "k", retries=1, backoff=0.01) as client:
        with pytest.raises(ConnectionFailedError) as info:
            client.list_jobs()
    assert closed_url in str(info.value)


def test_retry_after_parsing():
    assert parse_retry_after("2") == 2.0
    assert parse_retry_after("0.25") == 0.25
    assert parse_retry_after(None) is None
    assert parse_retry_after("soon") is None
    assert parse_retry_after("Wed, 21 Oct 2015 07:28:00 GMT") == 0.0  # a date in the past
