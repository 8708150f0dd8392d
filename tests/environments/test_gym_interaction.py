"""GymEnvironmentInteraction against real HTTP servers (uvicorn on 127.0.0.1, no mocks).

Each test server hosts one "counter" environment under several path prefixes; the prefix
picks a behaviour (``/ok``, ``/flaky``, ``/err500``, ``/slow``, ...), so a base URL such
as ``http://127.0.0.1:PORT/err500`` is a misbehaving environment server.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections import Counter
from typing import Any

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from opentinker.environments.gym_interaction import (
    GymEnvironmentInteraction,
    check_endpoint,
    shard_urls,
)
from opentinker.environments.interaction import EnvironmentServerError, InitialObservation

SLOW_SECONDS = 1.0


def make_app(server_id: str) -> FastAPI:
    """A counter environment: the action "add N" adds N to the count, reward N; done at 10 or on "stop"."""
    app = FastAPI()
    app.state.instances = {}  # instance id -> count
    app.state.resets = []  # reset bodies
    app.state.finalized = []  # instance ids
    app.state.attempts = Counter()  # (mode, route, instance id) -> requests

    def error(status: int, detail: str) -> JSONResponse:
        return JSONResponse({"detail": detail}, status_code=status)

    async def misbehave(mode: str, route: str, iid: str) -> Response | None:
        attempt = app.state.attempts[(mode, route, iid)]
        fails_once = mode == "flaky" or (mode == "flakystep" and route == "step")
        if mode == "err500" or (fails_once and attempt == 1):
            return error(500, "internal error")
        if mode == "err400":
            return error(400, "bad request")
        if mode == "slow":
            await asyncio.sleep(SLOW_SECONDS)
        if mode == "badjson":
            return Response("this is {not json", media_type="application/json")
        if mode == "list":
            return JSONResponse([1, 2, 3])
        if mode == "missing" and route == "reset":
            return JSONResponse({"obs": "no observation key"})
        if mode == "missing" and route == "step":
            return JSONResponse({"observation": "x", "reward": 1.0})  # no "done"
        return None

    @app.get("/{mode}/health")
    async def health(mode: str):
        if mode == "err500":
            return error(500, "unhealthy")
        return {"status": "ok", "server": server_id}

    @app.post("/{mode}/reset")
    async def reset(mode: str, request: Request):
        body = await request.json()
        iid = body["instance_id"]
        app.state.attempts[(mode, "reset", iid)] += 1
        if mode == "missing":  # reset is broken, step is tested separately via "missingstep"
            return JSONResponse({"obs": "no observation key"})
        bad = await misbehave(mode, "reset", iid) if mode != "missingstep" else None
        if bad is not None:
            return bad
        app.state.resets.append(body)
        app.state.instances[iid] = 0
        return {
            "observation": f"count=0 on {server_id}",
            "system_prompt": "You are counting.",
            "info": {"server": server_id},
        }

    @app.post("/{mode}/step")
    async def step(mode: str, request: Request):
        body = await request.json()
        iid = body["instance_id"]
        app.state.attempts[(mode, "step", iid)] += 1
        bad = await misbehave("missing" if mode == "missingstep" else mode, "step", iid)
        if bad is not None:
            return bad
        if iid not in app.state.instances:
            return error(404, f"unknown instance {iid}")
        action = body["action"]
        reward = 0.0
        if action.startswith("add "):
            reward = float(action[4:])
            app.state.instances[iid] += int(reward)
        count = app.state.instances[iid]
        done = action == "stop" or count >= 10
        return {"observation": f"count={count}", "reward": reward, "done": done, "info": {"server": server_id}}

    @app.post("/{mode}/finalize")
    async def finalize(mode: str, request: Request):
        body = await request.json()
        iid = body["instance_id"]
        app.state.attempts[(mode, "finalize", iid)] += 1
        if mode == "err500":
            return error(500, "cannot finalize")
        app.state.finalized.append(iid)
        app.state.instances.pop(iid, None)
        return {"ok": True}

    return app


class ServerThread:
    """uvicorn serving ``app`` on an already-bound 127.0.0.1 socket, in a daemon thread."""

    def __init__(self, app: FastAPI):
        self.app = app
        # proto=IPPROTO_TCP matters: asyncio sets TCP_NODELAY on accepted connections only
        # when the listening socket says so; without it every answer waits ~40 ms for a
        # delayed ACK (uvicorn writes headers and body separately).
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        config = uvicorn.Config(
            app, log_level="warning", access_log=False, lifespan="off", timeout_graceful_shutdown=2
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def url(self, mode: str = "ok") -> str:
        return f"http://127.0.0.1:{self.port}/{mode}"

    def start(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("test environment server did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()


@pytest.fixture(scope="module")
def servers():
    started = [ServerThread(make_app("A")).start(), ServerThread(make_app("B")).start()]
    yield started
    for server in started:
        server.stop()


@pytest.fixture(scope="module")
def server(servers):
    return servers[0]


def dead_url() -> str:
    """A 127.0.0.1 URL on which nothing listens."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def assistant(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": "count"}, {"role": "assistant", "content": text}]


def make_env(url: str, **config: Any) -> GymEnvironmentInteraction:
    return GymEnvironmentInteraction({"env_endpoint": url, "backoff_s": 0.01, **config})


def run(coro):
    return asyncio.run(coro)


# Round trips ---------------------------------------------------------------------------


def test_reset_step_finalize_round_trip(server):
    async def main():
        async with make_env(server.url(), name="counter", job_id="job-1", env_kwargs={"level": 2}) as env:
            iid = await env.start_interaction(ground_truth="10", seed=7)
            assert await env.initial_observation(iid) == InitialObservation(
                "count=0 on A", "You are counting.", {"server": "A"}
            )
            reset_body = next(b for b in server.app.state.resets if b["instance_id"] == iid)
            assert reset_body == {"instance_id": iid, "job_id": "job-1", "seed": 7, "level": 2, "ground_truth": "10"}

            assert await env.generate_response(iid, assistant("add 3")) == (
                False, "count=3", 3.0, {"server": "A", "step": 1},
            )
            # the action is the last assistant message, even with a user turn after it
            messages = assistant("add 4") + [{"role": "user", "content": "ignored"}]
            assert (await env.generate_response(iid, messages))[:3] == (False, "count=7", 4.0)
            done, text, reward, info = await env.generate_response(iid, assistant("stop"))
            assert (done, text, reward) == (True, "count=7", 0.0)
            assert "truncated" not in info
            assert await env.calculate_score(iid) == 7.0
            # after the end no more requests are sent
            steps_before = server.app.state.attempts[("ok", "step", iid)]
            assert (await env.generate_response(iid, assistant("add 1")))[0] is True
            assert server.app.state.attempts[("ok", "step", iid)] == steps_before

            await env.finalize_interaction(iid)
            assert iid in server.app.state.finalized
            assert await env.calculate_score(iid) == 0.0
            await env.finalize_interaction(iid)  # twice: no error
            with pytest.raises(KeyError, match="unknown instance"):
                await env.generate_response(iid, assistant("add 1"))

    run(main())


def test_job_id_from_kwargs_and_none_values_left_out(server):
    async def main():
        async with make_env(server.url(), job_id="config-job") as env:
            a = await env.start_interaction(job_id="row-job", seed=None)
            b = await env.start_interaction("fixed-id")
            assert b == "fixed-id"
            bodies = {x["instance_id"]: x for x in server.app.state.resets}
            assert bodies[a] == {"instance_id": a, "job_id": "row-job"}
            assert bodies[b] == {"instance_id": b, "job_id": "config-job"}
            for iid in (a, b):
                await env.finalize_interaction(iid)

    run(main())


def test_observation_template_and_max_steps(server):
    async def main():
        template = "Step {step}: {observation} (reward {reward:g})"
        async with make_env(server.url(), observation_template=template, max_steps=3) as env:
            iid = await env.start_interaction()
            results = [await env.generate_response(iid, assistant("add 1")) for _ in range(3)]
            assert [r[1] for r in results] == [f"Step {i}: count={i} (reward 1)" for i in (1, 2, 3)]
            assert [r[0] for r in results] == [False, False, True]
            assert results[-1][3]["truncated"] is True
            assert await env.calculate_score(iid) == 3.0
            await env.finalize_interaction(iid)

    run(main())
    with pytest.raises(ValueError, match="observation_template"):
        make_env(server.url(), observation_template="{obs}")


def test_config_validation():
    with pytest.raises(ValueError, match="env_endpoint"):
        GymEnvironmentInteraction({})
    with pytest.raises(ValueError, match="env_endpoint"):
        GymEnvironmentInteraction({"env_endpoint": "ftp://127.0.0.1"})
    with pytest.raises(ValueError, match="env_shards"):
        GymEnvironmentInteraction({"env_endpoint": "http://127.0.0.1:1", "env_shards": 0})
    with pytest.raises(ValueError, match="max_steps"):
        GymEnvironmentInteraction({"env_endpoint": "http://127.0.0.1:1", "max_steps": 0})


# Retries and failures ----------------------------------------------------------------


def test_retry_after_a_500_succeeds(server):
    async def main():
        async with make_env(server.url("flaky"), retries=2) as env:
            iid = await env.start_interaction()
            assert server.app.state.attempts[("flaky", "reset", iid)] == 2
            await env.finalize_interaction(iid)
        async with make_env(server.url("flakystep"), retries=1) as env:
            iid = await env.start_interaction()
            assert (await env.generate_response(iid, assistant("add 2")))[1] == "count=2"
            assert server.app.state.attempts[("flakystep", "step", iid)] == 2
            await env.finalize_interaction(iid)

    run(main())


def test_5xx_retried_then_error(server):
    async def main():
        async with make_env(server.url("err500"), retries=2) as env:
            with pytest.raises(EnvironmentServerError) as err:
                await env.start_interaction("five-hundred")
            assert server.app.state.attempts[("err500", "reset", "five-hundred")] == 3
            assert "HTTP 500" in str(err.value) and server.url("err500") + "/reset" in str(err.value)
            assert env.active_instances == 0

    run(main())


def test_4xx_not_retried(server):
    async def main():
        async with make_env(server.url("err400"), retries=3) as env:
            with pytest.raises(EnvironmentServerError, match="HTTP 400"):
                await env.start_interaction("four-hundred")
            assert server.app.state.attempts[("err400", "reset", "four-hundred")] == 1

    run(main())


def test_timeout_is_an_error_quickly(server):
    async def main():
        async with make_env(server.url("slow"), timeout_s=0.2, retries=1) as env:
            start = time.monotonic()
            with pytest.raises(EnvironmentServerError, match="timed out") as err:
                await env.start_interaction("sleepy")
            assert time.monotonic() - start < SLOW_SECONDS
            assert "2 attempts" in str(err.value)

    run(main())


def test_connection_error(server):
    url = dead_url()

    async def main():
        async with make_env(url, retries=2) as env:
            with pytest.raises(EnvironmentServerError) as err:
                await env.start_interaction()
            assert url in str(err.value) and "3 attempts" in str(err.value)

    run(main())


@pytest.mark.parametrize(
    "mode, message",
    [("badjson", "invalid JSON"), ("list", "JSON object"), ("missing", "observation")],
)
def test_malformed_reset_answers(server, mode, message):
    async def main():
        async with make_env(server.url(mode), retries=2) as env:
            with pytest.raises(EnvironmentServerError, match=message):
                await env.start_interaction(f"malformed-{mode}")
            # a malformed answer is not retried
            assert server.app.state.attempts[(mode, "reset", f"malformed-{mode}")] == 1

    run(main())


def test_malformed_step_answer(server):
    async def main():
        async with make_env(server.url("missingstep")) as env:
            iid = await env.start_interaction()
            with pytest.raises(EnvironmentServerError, match="'done'"):
                await env.generate_response(iid, assistant("add 1"))
            await env.finalize_interaction(iid)

    run(main())


def test_finalize_never_raises(server):
    async def main():
        async with make_env(server.url("ok")) as env:
            iid = await env.start_interaction()
            # point the instance at a failing server: finalize logs and forgets
            env._instances[iid].url = server.url("err500")
            await env.finalize_interaction(iid)
            assert env.active_instances == 0
            assert server.app.state.attempts[("err500", "finalize", iid)] == 1  # one attempt, no retries
        async with make_env(dead_url()) as env:
            await env.finalize_interaction("never-started")

    run(main())


def test_check_endpoint(server):
    async def main():
        await check_endpoint(server.url())
        url = dead_url()
        with pytest.raises(EnvironmentServerError) as err:
            await check_endpoint(url, timeout_s=1)
        assert f"{url}/health" in str(err.value) and "running" in str(err.value)
        with pytest.raises(EnvironmentServerError, match="HTTP 500"):
            await check_endpoint(server.url("err500"))
        async with make_env(server.url(), env_shards=[server.url(), url]) as env:
            with pytest.raises(EnvironmentServerError, match=url):
                await env.check_endpoints(timeout_s=1)

    run(main())


# Sharding and concurrency ------------------------------------------------------------


def test_shard_urls():
    assert shard_urls("http://127.0.0.1:8000/") == ["http://127.0.0.1:8000"]
    assert shard_urls("http://127.0.0.1:8000/env", 3) == [
        "http://127.0.0.1:8000/env",
        "http://127.0.0.1:8001/env",
        "http://127.0.0.1:8002/env",
    ]
    assert shard_urls("http://localhost", 2) == ["http://localhost", "http://localhost:81"]  # 80 is implied
    assert shard_urls(None, ["http://a:1", "http://b:2/"]) == ["http://a:1", "http://b:2"]
    with pytest.raises(ValueError, match="duplicate"):
        shard_urls(None, ["http://a:1", "http://a:1/"])


def test_sharding_is_stable_and_spreads(servers):
    a, b = servers

    async def main():
        async with make_env(a.url(), env_shards=[a.url(), b.url()]) as env:
            ids = [f"shard-test-{i}" for i in range(16)]
            assert [env.shard_for(i) for i in ids] == [env.shard_for(i) for i in ids]
            for iid in ids:
                await env.start_interaction(iid)
            on = {iid: ("A" if env.shard_for(iid) == a.url() else "B") for iid in ids}
            assert set(on.values()) == {"A", "B"}
            for iid in ids:
                obs = await env.initial_observation(iid)
                assert obs.info["server"] == on[iid]
                _, _, _, info = await env.generate_response(iid, assistant("add 1"))
                assert info["server"] == on[iid]
                await env.finalize_interaction(iid)
            for server, name in ((a, "A"), (b, "B")):
                mine = {i for i in ids if on[i] == name}
                assert mine <= set(server.app.state.finalized)
                assert not mine & {x["instance_id"] for x in (a if name == "B" else b).app.state.resets}

    run(main())


def test_concurrent_instances_keep_separate_state(servers):
    a, b = servers

    async def episode(env: GymEnvironmentInteraction, i: int) -> tuple[str, float, str]:
        iid = await env.start_interaction(f"concurrent-{i}")
        text = ""
        for _ in range(i % 3 + 1):
            _, text, _, _ = await env.generate_response(iid, assistant(f"add {i % 5}"))
        score = await env.calculate_score(iid)
        await env.finalize_interaction(iid)
        return iid, score, text

    async def main():
        async with make_env(a.url(), env_shards=[a.url(), b.url()], max_steps=10) as env:
            results = await asyncio.gather(*(episode(env, i) for i in range(32)))
            assert env.active_instances == 0
        for i, (iid, score, text) in enumerate(results):
            expected = (i % 5) * (i % 3 + 1)
            assert score == float(expected)
            assert text == f"count={expected}"

    run(main())
