"""Envs reached through the client: a real server (real JobRunner, tiny model, Ray), the real thin
client and its relay, and env servers on loopback ports the server's allowlist refuses."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import textwrap
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from opentinker import GenericEnvironment, OpenTinkerClient
from opentinker.client.cli import format_job
from opentinker.protocol import JobInfo
from opentinker.environments.registry import InteractionSpec

from ..engine.test_trainer_env_outage import free_port, kill, start_env_server

SMALL = {"trainer.progress_bar": False, "trainer.test_freq": -1, "data.max_response_length": 16,
         "actor_rollout_ref.rollout.multi_turn.max_assistant_turns": 1, "data.train_batch_size": 2,
         "actor_rollout_ref.actor.ppo_mini_batch_size": 2, "actor_rollout_ref.rollout.n": 2,
         "trainer.env_outage_timeout_s": 300}


def data_free_rows(count: int, name: str = "arith") -> list[dict]:
    return [{"extra_info": {"interaction_kwargs": {"name": name}}} for _ in range(count)]


def relayed_env(port: int, relay: bool = True, name: str = "arith") -> GenericEnvironment:
    config = {"env_endpoint": f"http://127.0.0.1:{port}", **({"relay": "client"} if relay else {})}
    return GenericEnvironment(SMALL, [InteractionSpec(name=name, class_path="gym", config=config)],
                              dataset=data_free_rows(16, name))


@pytest.fixture(scope="module")
def live(ray_cluster, tiny_model_dir, tmp_path_factory, helpers):
    """A server with the real runner whose allowlist lets jobs reach only ports 1-2 of loopback."""
    data = tmp_path_factory.mktemp("relay-server")
    server = helpers.LiveServer(helpers.test_settings(data, env_hosts=["127.0.0.1:1-2"]), runner_cls=None).start()
    server.keys = {name: helpers.make_user(data, name) for name in ("carol", "dave")}
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def env_server():
    port = free_port()
    process = start_env_server(port)
    try:
        yield port
    finally:
        kill(process)


def test_an_env_the_server_may_not_reach_trains_through_the_client_relay(live, env_server, monkeypatch, tmp_path):
    monkeypatch.setenv("OPENTINKER_STATE_DIR", str(tmp_path))
    direct = relayed_env(env_server, relay=False).job_create(steps=3).model_dump(mode="json")
    with httpx.Client(base_url=live.url, headers={"Authorization": f"Bearer {live.keys['carol']}"},
                      trust_env=False) as raw:
        refused = raw.post("/v1/jobs", json=direct)
    assert refused.status_code == 400
    assert f"env_endpoint http://127.0.0.1:{env_server} is not allowed on this server" in refused.text
    assert 'set \\"relay\\": \\"client\\" in the interaction\'s config' in refused.text  # the user's own fix

    with OpenTinkerClient(live.url, live.keys["carol"]) as client:
        handle = client.submit(relayed_env(env_server), steps=3)
        assert handle.relay is not None
        info = handle.wait(progress=False)
        events = handle.events()
    assert info.status.value == "completed" and info.step == 3
    metrics = [e.data["metrics"] for e in events if e.type == "metrics"]
    assert [e.data["step"] for e in events if e.type == "progress"] == [1, 2, 3]
    assert all(m["env/arith/env_errors"] == 0 and m["env/arith/samples"] == 4 for m in metrics)
    assert handle.relay.calls >= 3 * 4 * 3  # reset, step and finalize of every sample
    assert handle.relay.refused == 0
    assert info.relay is not None and info.relay.interactions == ["arith"]


def test_env_setup_says_a_refused_endpoint_is_refused_and_how_the_user_can_reach_it(live, env_server):
    """An env that answers but that the server's policy may not reach is not called "unreachable":
    env.setup names it as refused, with the operator's fix and the user's own (the relay)."""
    from opentinker.client.errors import EnvironmentSetupError

    with OpenTinkerClient(live.url, live.keys["carol"]) as client:
        with pytest.raises(EnvironmentSetupError) as refused:
            relayed_env(env_server, relay=False).setup(client)
    message = str(refused.value)
    assert f"env endpoint(s) this server may not reach: http://127.0.0.1:{env_server}" in message
    assert "--allow-env-host" in message and '"relay": "client"' in message
    assert "unreachable env endpoint" not in message


CLIENT_SCRIPT = textwrap.dedent("""
    import sys
    from opentinker import GenericEnvironment, OpenTinkerClient
    from opentinker.environments.registry import InteractionSpec

    url, key, port, what = sys.argv[1:5]
    with OpenTinkerClient(url, key) as client:
        if what == "start":
            spec = InteractionSpec(name="arith", class_path="gym",
                                   config={"env_endpoint": f"http://127.0.0.1:{port}", "relay": "client"})
            env = GenericEnvironment(__SMALL__, [spec], dataset=[{"extra_info": {"interaction_kwargs": {}}}] * 16)
            handle = client.submit(env, steps=int(sys.argv[5]))
            print(handle.job_id, flush=True)
            handle.wait(progress=False)
        else:  # attach: the specs come from what the first process kept on this machine
            info = client.get_job(what).attach(progress=False)
            print(info.status.value, info.step, flush=True)
""").replace("__SMALL__", repr(SMALL))


def _client_process(tmp_path: Path, *args: str) -> subprocess.Popen:
    script = tmp_path / "client.py"
    script.write_text(CLIENT_SCRIPT)
    environment = {**os.environ, "OPENTINKER_STATE_DIR": str(tmp_path / "state")}
    return subprocess.Popen([sys.executable, str(script), *args], stdout=subprocess.PIPE, text=True, env=environment)


def _events(raw: httpx.Client, job_id: str) -> list[dict]:
    return raw.get(f"/v1/jobs/{job_id}/events", params={"stream": "false"}).json()["events"]


def test_a_killed_client_is_waited_for_and_attach_carries_on_with_no_step_lost(live, env_server, tmp_path, helpers):
    """The client that started the job is SIGKILLed after step 2 of 6: the job waits for its env (the
    relay is an env outage) and says so; a new process attaches from the specs the first one kept
    on this machine, and the job trains every step once, skipping none."""
    steps = 6
    first = _client_process(tmp_path, live.url, live.keys["carol"], str(env_server), "start", str(steps))
    job_id = first.stdout.readline().strip()
    with httpx.Client(base_url=live.url, headers={"Authorization": f"Bearer {live.keys['carol']}"},
                      trust_env=False, timeout=30) as raw:
        helpers.wait_for(lambda: raw.get(f"/v1/jobs/{job_id}").json()["step"] >= 2, timeout=300, what="step 2")
        kill(first)
        helpers.wait_for(lambda: not raw.get(f"/v1/jobs/{job_id}").json()["relay"]["connected"], timeout=30,
                         what="the relay to show disconnected")

        def waiting() -> bool:
            return any(e["type"] == "log" and "client relay is not connected" in e["data"]["message"]
                       for e in _events(raw, job_id))

        helpers.wait_for(waiting, timeout=120, what="the job to say it waits for its client")
        info = JobInfo.model_validate(raw.get(f"/v1/jobs/{job_id}").json())
        assert info.status.value == "running"
        assert "relay    not connected (its env calls wait" in format_job(info)  # `opentinker jobs show`
        second = _client_process(tmp_path, live.url, live.keys["carol"], str(env_server), job_id)
        helpers.wait_for(lambda: raw.get(f"/v1/jobs/{job_id}").json()["relay"]["connected"], timeout=60,
                         what="the relay to reconnect")
        out, _ = second.communicate(timeout=300)
        assert out.split() == ["completed", str(steps)]
        events = _events(raw, job_id)
    assert [e["data"]["step"] for e in events if e["type"] == "progress"] == list(range(1, steps + 1))
    logs = [e["data"]["message"] for e in events if e["type"] == "log"]
    assert sum(message.startswith("client relay connected") for message in logs) == 2
    assert sum(message.startswith("client relay disconnected") for message in logs) == 1
    assert not any(" skipped: " in message for message in logs)
    assert any("answered again" in message and "nothing was skipped" in message for message in logs)
    # The first process kept the specs under its state folder; the job's end let the second forget them.
    assert not list((tmp_path / "state").rglob("*.json"))


class _RecordingGymEnv(BaseHTTPRequestHandler):
    """A gym-protocol env that records the path and job id of every call (``seen`` per server)."""

    def do_GET(self):  # noqa: N802
        self._answer({} if self.path == "/health" else None)

    def do_POST(self):  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        self.server.seen.append((self.path, body.get("job_id")))
        if self.path == "/reset":
            self._answer({"observation": "What is 2 + 3?"})
        elif self.path == "/step":
            self._answer({"observation": "", "reward": float("5" in body.get("action", "")), "done": True})
        else:
            self._answer({} if self.path == "/finalize" else None)

    def _answer(self, data):
        payload = json.dumps(data if data is not None else {"error": "no such path"}).encode()
        self.send_response(200 if data is not None else 404)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args):
        pass


def _recording_env() -> ThreadingHTTPServer:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _RecordingGymEnv)
    server.seen = []
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def test_two_users_relays_never_receive_each_others_calls(live, monkeypatch, tmp_path):
    """Carol's and Dave's jobs train at once, each through its own client's relay to its own env:
    every call an env gets carries its own user's job id, and both jobs train every step."""
    monkeypatch.setenv("OPENTINKER_STATE_DIR", str(tmp_path))
    envs = {name: _recording_env() for name in ("carol", "dave")}
    try:
        handles = {}
        for name, env in envs.items():
            client = OpenTinkerClient(live.url, live.keys[name])
            handles[name] = client.submit(relayed_env(env.server_address[1]), steps=3)
        infos = {name: handle.wait(progress=False) for name, handle in handles.items()}
    finally:
        for env in envs.values():
            env.shutdown()
    for name, env in envs.items():
        assert infos[name].status.value == "completed" and infos[name].step == 3
        job_ids = {job_id for _, job_id in env.seen}
        assert job_ids == {handles[name].job_id}, (name, job_ids)
        assert {path for path, _ in env.seen} == {"/reset", "/step", "/finalize"}
        assert len([p for p, _ in env.seen if p == "/step"]) == 3 * 4  # 3 steps of 2 prompts x 2 samples
        handles[name].client.close()


def test_relays_are_the_operators_choice(start_server, tmp_path, helpers):
    """--no-env-relay refuses relayed jobs (400 naming the flag) and relay connections (4403);
    --max-env-relays-per-user bounds the relays one user holds (4429); a job without a relayed
    interaction has none (4409); another user's job is not found (4404)."""
    from websockets.exceptions import ConnectionClosed
    from websockets.sync.client import connect

    spec = {"name": "arith", "class_path": "gym", "config": {"env_endpoint": "http://127.0.0.1:9", "relay": "client"}}
    off = start_server(tmp_path / "off", env_relays=False)
    alice = helpers.make_user(off.settings.data_dir, "alice")
    with off.client(alice) as raw:
        refused = raw.post("/v1/jobs", json={"config": {}, "interactions": [spec]})
    assert refused.status_code == 400 and "--no-env-relay" in refused.text

    def close_code(live, key, job_id) -> int:
        url = live.url.replace("http", "ws") + f"/v1/jobs/{job_id}/relay"
        with connect(url, additional_headers={"Authorization": f"Bearer {key}"}, proxy=None) as socket:
            try:
                while True:
                    socket.recv(timeout=10)
            except ConnectionClosed as closed:
                return closed.rcvd.code

    on = start_server(tmp_path / "on", max_env_relays_per_user=1)
    bob, eve = (helpers.make_user(on.settings.data_dir, name) for name in ("bob", "eve"))
    with on.client(bob) as raw:
        relayed = [helpers.create_job(raw, f"hold-{i}", mode="client", interactions=[spec]) for i in range(2)]
        plain = helpers.create_job(raw, "hold-plain", mode="client")
    with connect(on.url.replace("http", "ws") + f"/v1/jobs/{relayed[0]}/relay",
                 additional_headers={"Authorization": f"Bearer {bob}"}, proxy=None) as first:
        assert json.loads(first.recv(timeout=10)) == {"type": "hello", "job_id": relayed[0], "interactions": ["arith"]}
        with on.client(bob) as raw:
            helpers.wait_for(lambda: raw.get(f"/v1/jobs/{relayed[0]}").json()["relay"]["connected"], what="connected")
            assert raw.get(f"/v1/jobs/{plain}").json()["relay"] is None
        assert close_code(on, bob, relayed[1]) == 4429
        assert close_code(on, bob, plain) == 4409
        assert close_code(on, eve, relayed[0]) == 4404
        assert close_code(on, "ot-not-a-key", relayed[0]) == 4401
    with on.client(bob) as raw:
        helpers.wait_for(lambda: not raw.get(f"/v1/jobs/{relayed[0]}").json()["relay"]["connected"],
                         what="disconnected")
        for job_id in (*relayed, plain):
            raw.post(f"/v1/jobs/{job_id}/cancel")


def test_a_compromised_server_cannot_use_the_relay_as_a_proxy(tmp_path, monkeypatch, recording_service):
    """A server that sends whatever it likes down the relay gets the env protocol's calls to the
    user's configured endpoint and nothing else: other paths, hosts (a URL in the call is ignored),
    shards, interactions, methods and operations are refused, and the service next door sees nothing."""
    from websockets.asyncio.server import serve

    from opentinker.client.relay import EnvRelay

    monkeypatch.setenv("OPENTINKER_STATE_DIR", str(tmp_path))
    env = _recording_env()
    canary_url, canary_seen = recording_service
    hostile = [
        {"op": "http", "interaction": "arith", "shard": 0, "method": "GET", "path": "admin"},
        {"op": "http", "interaction": "arith", "shard": 0, "method": "POST", "path": "../reset", "body": {}},
        {"op": "http", "interaction": "arith", "shard": 0, "method": "POST", "path": "reset?x=1", "body": {}},
        {"op": "http", "interaction": "arith", "shard": 1, "method": "POST", "path": "reset", "body": {}},
        {"op": "http", "interaction": "elsewhere", "shard": 0, "method": "POST", "path": "reset", "body": {}},
        {"op": "http", "interaction": "arith", "shard": 0, "method": "DELETE", "path": "reset"},
        {"op": "http", "interaction": "arith", "shard": 0, "method": "GET", "path": "health", "body": {"x": 1}},
        {"op": "ws_open", "interaction": "arith", "shard": 0, "path": "ws", "session": "s1"},
        {"op": "tcp", "host": "127.0.0.1", "port": 22},
    ]
    legit = [  # a URL smuggled into a call is not read: the call still goes to the configured endpoint
        {"op": "http", "interaction": "arith", "shard": 0, "method": "GET", "path": "health", "url": canary_url},
        {"op": "http", "interaction": "arith", "shard": 0, "method": "POST", "path": "reset",
         "body": {"instance_id": "i", "job_id": "J"}},
    ]
    answers: dict[int, dict] = {}

    async def fake_server(socket):
        await socket.send(json.dumps({"type": "hello", "job_id": "J", "interactions": ["arith"]}))
        for i, call in enumerate(hostile + legit):
            await socket.send(json.dumps({"type": "call", "id": i, "timeout_s": 5, **call}))
        while len(answers) < len(hostile) + len(legit):
            answer = json.loads(await socket.recv())
            answers[answer["id"]] = answer

    async def main():
        async with serve(fake_server, "127.0.0.1", 0) as server:
            port = server.sockets[0].getsockname()[1]
            client = OpenTinkerClient(f"http://127.0.0.1:{port}", "ot-fake")
            spec = InteractionSpec(name="arith", class_path="gym", config={
                "env_endpoint": f"http://127.0.0.1:{env.server_address[1]}", "relay": "client"})
            relay = EnvRelay(client, "J", [spec]).start()
            try:
                for _ in range(200):
                    if len(answers) == len(hostile) + len(legit):
                        break
                    await asyncio.sleep(0.05)
            finally:
                relay.stop()
            return relay

    try:
        relay = asyncio.run(main())
    finally:
        env.shutdown()
    for i in range(len(hostile)):
        assert answers[i]["error"] == "refused", (hostile[i], answers[i])
    health, reset = answers[len(hostile)], answers[len(hostile) + 1]
    assert health["status"] == 200 and reset["status"] == 200 and "2 + 3" in reset["body"]
    assert relay.refused == len(hostile)
    assert env.seen == [("/reset", "J")]
    assert canary_seen == []


def test_an_openenv_server_on_the_users_machine_trains_through_the_relay(live, monkeypatch, tmp_path):
    """OpenEnv's WebSocket sessions multiplexed over the relay: every episode one session, the
    env's reward comes back, none fails; env.setup reads the env's /schema from this machine."""
    from opentinker.client.errors import EnvironmentSetupError

    from ..environments.openenv_server import running_openenv_server

    monkeypatch.setenv("OPENTINKER_STATE_DIR", str(tmp_path))
    with running_openenv_server(tmp_path) as env_server:
        def env(**config) -> GenericEnvironment:
            spec = InteractionSpec(name="arith", class_path="openenv",
                                   config={"env_endpoint": env_server.url, "relay": "client", **config})
            return GenericEnvironment(SMALL, [spec], dataset=data_free_rows(16))

        with OpenTinkerClient(live.url, live.keys["dave"]) as client:
            with pytest.raises(EnvironmentSetupError, match="action_field 'reply' is not a field of the env's action"):
                env(action_field="reply").setup(client)
            handle = client.submit(env(), steps=2)
            info = handle.wait(progress=False)
            events = handle.events()
        stats = env_server.wait_idle()
    assert info.status.value == "completed" and info.step == 2
    metrics = [e.data["metrics"] for e in events if e.type == "metrics"]
    assert all(m["env/arith/env_errors"] == 0 and m["env/arith/samples"] == 4 for m in metrics)
    assert stats["live"] == 0 and len(stats["resets"]) >= 2 * 4  # one session (episode) per sample


def test_a_revoked_key_ends_the_relay(start_server, tmp_path, helpers, monkeypatch):
    """The relay is held open under its key: revoking the key ends it within the credential
    watch's interval, and the client stops for good (4401) instead of reconnecting."""
    from opentinker.client.relay import EnvRelay
    from opentinker.server import auth
    from opentinker.server.store import Store

    monkeypatch.setenv("OPENTINKER_STATE_DIR", str(tmp_path))
    live = start_server(tmp_path / "server")
    key = helpers.make_user(live.settings.data_dir, "frank")
    spec = InteractionSpec(name="arith", class_path="gym", config={"env_endpoint": "http://127.0.0.1:9", "relay": "client"})
    with live.client(key) as raw:
        job_id = helpers.create_job(raw, "hold-revoked", mode="client", interactions=[spec.model_dump()])
    with OpenTinkerClient(live.url, key) as client:
        relay = EnvRelay(client, job_id, [spec]).start()
        try:
            assert relay.wait_connected(30)
            store = Store(live.settings.data_dir / "opentinker.db")
            try:
                assert auth.revoke_api_key(store, key)
            finally:
                store.close()
            helpers.wait_for(lambda: not relay.running, timeout=20, what="the relay to end")
        finally:
            relay.stop()
    assert relay.error is not None and relay.error.startswith("the API key was refused")
    assert relay.connections == 1
