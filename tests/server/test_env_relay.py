"""Envs reached through the client: a real server (real JobRunner, tiny model, Ray), the real thin
client and its relay, and env servers on loopback ports the server's allowlist refuses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest

from opentinker import GenericEnvironment, OpenTinkerClient
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
