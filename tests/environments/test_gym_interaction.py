"""GymEnvironmentInteraction against real HTTP servers (uvicorn on 127.0.0.1, no mocks).

A test "farm" serves one "counter" environment per behaviour, each on its own port (an env
endpoint is a bare ``scheme://host:port``), and all of a farm's servers share one record of
the requests they saw: ``farm.url("err500")`` is a misbehaving environment server and
``farm.app.state.attempts[("err500", "reset", iid)]`` counts what reached it.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import socket
import time
from collections import Counter
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, RedirectResponse, Response

from opentinker.environments.endpoints import EndpointError, EndpointPolicy
from opentinker.environments.env_routing import check_endpoint, shard_urls
from opentinker.environments.gym_interaction import GymEnvironmentInteraction
from opentinker.environments import env_http
from opentinker.environments.interaction import EnvironmentServerError, InitialObservation, InteractionContext
from opentinker.environments.server import create_env_app, running_app_servers

from ..tcp_proxy import TcpProxy

SLOW_SECONDS = 1.0
SECRET = "SECRET-TOKEN-of-another-service"
MODES = ("ok", "flaky", "flakystep", "err500", "err400", "slow", "badjson", "list", "missing", "missingstep",
         "html500", "proto400", "longerror", "redirect", "err503", "huge", "deep")


def make_app(server_id: str, mode: str, state: SimpleNamespace) -> FastAPI:
    """A counter environment: the action "add N" adds N to the count, reward N; done at 10 or on "stop"."""
    app = FastAPI()

    def error(status: int, detail: str) -> JSONResponse:
        return JSONResponse({"detail": detail}, status_code=status)

    async def misbehave(mode: str, route: str, iid: str) -> Response | None:
        attempt = state.attempts[(mode, route, iid)]
        fails_once = mode == "flaky" or (mode == "flakystep" and route == "step")
        if mode == "err500" or (fails_once and attempt == 1):
            return error(500, "internal error")
        if mode == "err400":
            return error(400, "bad request")
        if mode == "err503":  # e.g. a proxy whose env server is gone
            return error(503, "service unavailable")
        if mode == "html500":  # some other service behind an allowed endpoint
            return Response(f"<html><body>{SECRET}</body></html>", status_code=500, media_type="text/html")
        if mode == "proto400":  # the env protocol's own error shape
            return JSONResponse({"error": "seed must be positive", "instance_id": iid}, status_code=400)
        if mode == "longerror":
            return JSONResponse({"error": "x" * 1000 + SECRET}, status_code=422)
        if mode == "redirect":
            return RedirectResponse(f"{state.redirect_to}/{route}", status_code=307)
        if mode == "slow":
            await asyncio.sleep(SLOW_SECONDS)
        if mode == "badjson":
            return Response(f"this is {{not json {SECRET}", media_type="application/json")
        if mode == "list":
            return JSONResponse([1, 2, 3])
        if mode == "deep":  # JSON nested 100,000 levels: json.loads alone would raise RecursionError
            return Response("[" * 100_000 + "]" * 100_000, media_type="application/json")
        if mode == "huge":  # one byte over what is read of an answer
            return Response(b"x" * (env_http.MAX_ANSWER_BYTES + 1), media_type="application/json")
        if mode == "missing" and route == "reset":
            return JSONResponse({"obs": "no observation key"})
        if mode == "missing" and route == "step":
            return JSONResponse({"observation": "x", "reward": 1.0})  # no "done"
        return None

    @app.get("/health")
    async def health():
        if mode == "err500" and state.started:  # healthy while the farm starts up
            return error(500, "unhealthy")
        if mode == "redirect" and state.started:
            return RedirectResponse(f"{state.redirect_to}/health", status_code=307)
        return {"status": "ok", "server": server_id}

    @app.post("/reset")
    async def reset(request: Request):
        body = await request.json()
        iid = body["instance_id"]
        state.attempts[(mode, "reset", iid)] += 1
        if mode == "missing":  # reset is broken, step is tested separately via "missingstep"
            return JSONResponse({"obs": "no observation key"})
        bad = await misbehave(mode, "reset", iid) if mode != "missingstep" else None
        if bad is not None:
            return bad
        state.resets.append(body)
        state.instances[iid] = 0
        return {
            "observation": f"count=0 on {server_id}",
            "system_prompt": "You are counting.",
            "info": {"server": server_id},
        }

    @app.post("/step")
    async def step(request: Request):
        body = await request.json()
        iid = body["instance_id"]
        state.attempts[(mode, "step", iid)] += 1
        state.steps.append(body)
        bad = await misbehave("missing" if mode == "missingstep" else mode, "step", iid)
        if bad is not None:
            return bad
        if iid not in state.instances:
            return error(404, f"unknown instance {iid}")
        action = body["action"]
        reward = 0.0
        if action.startswith("add "):
            reward = float(action[4:])
            state.instances[iid] += int(reward)
        count = state.instances[iid]
        done = action == "stop" or count >= 10
        return {"observation": f"count={count}", "reward": reward, "done": done, "info": {"server": server_id}}

    @app.post("/finalize")
    async def finalize(request: Request):
        body = await request.json()
        iid = body["instance_id"]
        state.attempts[(mode, "finalize", iid)] += 1
        state.finalize_bodies.append(body)
        if mode == "err500":
            return error(500, "cannot finalize")
        state.finalized.append(iid)
        state.instances.pop(iid, None)
        return {"ok": True}

    return app


class Farm:
    """Base URLs by behaviour, and ``app.state``: the requests all of them saw."""

    def __init__(self, urls: dict[str, str], state: SimpleNamespace):
        self.urls = urls
        self.app = SimpleNamespace(state=state)

    def url(self, mode: str = "ok") -> str:
        return self.urls[mode]


@contextlib.contextmanager
def farm(server_id: str, modes: tuple[str, ...]):
    state = SimpleNamespace(instances={}, resets=[], steps=[], finalized=[], finalize_bodies=[],
                            attempts=Counter(), redirect_to=None, started=False)
    with running_app_servers([make_app(server_id, mode, state) for mode in modes]) as urls:
        state.redirect_to = urls[0]  # the "ok" server: a followed redirect would reach it
        state.started = True
        yield Farm(dict(zip(modes, urls)), state)


@pytest.fixture(scope="module")
def servers():
    with farm("A", MODES) as a, farm("B", ("ok",)) as b:
        yield [a, b]


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
            assert results[-1][3]["truncated"] is True and results[-1][3]["max_steps_reached"] is True
            assert "max_steps_reached" not in results[0][3]
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
    with pytest.raises(ValueError, match="job_id must be a string"):
        GymEnvironmentInteraction({"env_endpoint": "http://127.0.0.1:1", "job_id": {"a": 1}})


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("timeout_s", 0, "timeout_s must be > 0 and <= 300, got 0.0"),
        ("timeout_s", 301, "timeout_s must be > 0 and <= 300, got 301.0"),
        ("timeout_s", math.nan, "timeout_s must be > 0 and <= 300, got nan"),
        ("timeout_s", math.inf, "timeout_s must be > 0 and <= 300, got inf"),
        ("timeout_s", "5", "timeout_s must be a number, got str"),
        ("timeout_s", True, "timeout_s must be a number, got bool"),
        ("retries", -1, "retries must be >= 0 and <= 10, got -1"),
        ("retries", 11, "retries must be >= 0 and <= 10, got 11"),
        ("retries", 1.5, "retries must be a whole number, got 1.5"),
        ("backoff_s", -0.1, "backoff_s must be >= 0 and <= 30, got -0.1"),
        ("backoff_s", 31, "backoff_s must be >= 0 and <= 30, got 31.0"),
        ("max_steps", 0, "max_steps must be >= 1 and <= 1000, got 0"),
        ("max_steps", 1001, "max_steps must be >= 1 and <= 1000, got 1001"),
        ("max_connections", 0, "max_connections must be >= 1 and <= 1024, got 0"),
        ("max_connections", 1025, "max_connections must be >= 1 and <= 1024, got 1025"),
    ],
)
def test_numeric_config_keys_are_bounded(key, value, message):
    with pytest.raises(ValueError) as err:
        GymEnvironmentInteraction({"env_endpoint": "http://127.0.0.1:1", key: value})
    assert str(err.value) == message


def test_numeric_config_keys_accept_their_bounds():
    env = GymEnvironmentInteraction({"env_endpoint": "http://127.0.0.1:1", "timeout_s": 300, "retries": 10,
                                     "backoff_s": 30, "max_steps": 1000, "max_connections": 1024})
    assert (env.timeout_s, env.retries, env.backoff_s, env.max_steps, env.max_connections) == (300.0, 10, 30.0, 1000, 1024)
    env = GymEnvironmentInteraction({"env_endpoint": "http://127.0.0.1:1", "retries": 0, "backoff_s": 0,
                                     "max_steps": 1, "max_connections": 1, "timeout_s": 0.001})
    assert (env.retries, env.backoff_s, env.max_steps, env.max_connections) == (0, 0.0, 1, 1)


def test_trust_env_is_not_client_settable_and_proxy_settings_are_never_read(server, monkeypatch):
    with pytest.raises(ValueError, match="trust_env is not supported"):
        GymEnvironmentInteraction({"env_endpoint": "http://127.0.0.1:1", "trust_env": True})
    # A proxy nobody listens on: a request that read these settings would fail.
    for name in ("HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.setenv(name, dead_url())
    for name in ("NO_PROXY", "no_proxy"):
        monkeypatch.delenv(name, raising=False)

    async def main():
        async with make_env(server.url(), trust_env=False, retries=0) as env:
            iid = await env.start_interaction()
            assert (await env.initial_observation(iid)).observation == "count=0 on A"

    run(main())


@pytest.mark.parametrize(
    "template",
    ["{observation.__class__}", "{observation.__class__.__init__.__globals__}", "{step[0]}", "{reward.real}",
     "{}", "{0}", "{obs}", "{reward:{step}}", "{observation:>1000000000}", "{observation:d}", "{observation",
     "x" * 2001],
)
def test_observation_template_allows_only_the_plain_fields(template):
    with pytest.raises(ValueError, match="observation_template"):
        GymEnvironmentInteraction({"env_endpoint": "http://127.0.0.1:1", "observation_template": template})


def test_observation_template_format_specs_are_fine(server):
    async def main():
        template = "[{step:03d}] {observation!r} {reward:.2f} {{literal}}"
        async with make_env(server.url(), observation_template=template) as env:
            iid = await env.start_interaction()
            assert (await env.generate_response(iid, assistant("add 2")))[1] == "[001] 'count=2' 2.00 {literal}"
            await env.finalize_interaction(iid)

    run(main())


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
            assert not err.value.unreachable  # the env's own error: a training step is not waited out

    run(main())


def test_4xx_not_retried(server):
    async def main():
        async with make_env(server.url("err400"), retries=3) as env:
            with pytest.raises(EnvironmentServerError, match="HTTP 400") as err:
                await env.start_interaction("four-hundred")
            assert not err.value.unreachable
            assert server.app.state.attempts[("err400", "reset", "four-hundred")] == 1

    run(main())


def test_timeout_is_an_error_quickly(server):
    async def main():
        async with make_env(server.url("slow"), timeout_s=0.2, retries=1) as env:
            start = time.monotonic()
            with pytest.raises(EnvironmentServerError, match="timed out") as err:
                await env.start_interaction("sleepy")
            assert time.monotonic() - start < SLOW_SECONDS
            assert "2 attempts" in str(err.value) and err.value.unreachable

    run(main())


def test_connection_error(server):
    url = dead_url()

    async def main():
        async with make_env(url, retries=2) as env:
            with pytest.raises(EnvironmentServerError) as err:
                await env.start_interaction()
            assert url in str(err.value) and "3 attempts" in str(err.value) and err.value.unreachable

    run(main())


def test_503_is_retried_and_counts_as_unreachable(server):
    async def main():
        async with make_env(server.url("err503"), retries=1) as env:
            with pytest.raises(EnvironmentServerError, match="HTTP 503") as err:
                await env.start_interaction("unavailable")
            assert server.app.state.attempts[("err503", "reset", "unavailable")] == 2
            assert err.value.unreachable  # a training step waits for the server (trainer.env_outage_timeout_s)

    run(main())


@pytest.mark.parametrize(
    "mode, message",
    [("badjson", "invalid JSON"), ("list", "JSON object"), ("missing", "observation"),
     ("deep", "answer JSON nested deeper than 64 levels")],
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


def test_error_messages_quote_only_the_env_protocols_error_text(server):
    async def failure(mode: str) -> str:
        async with make_env(server.url(mode), retries=0) as env:
            with pytest.raises(EnvironmentServerError) as err:
                await env.start_interaction(f"quote-{mode}")
        return str(err.value)

    async def main():
        html = await failure("html500")
        size = len(f"<html><body>{SECRET}</body></html>")
        assert html.endswith(f"/reset failed: HTTP 500 (text/html, {size} bytes)")
        assert await failure("proto400") == (
            f"environment server {server.url('proto400')}/reset failed: HTTP 400: seed must be positive"
        )
        long = await failure("longerror")
        assert long.endswith("HTTP 422: " + "x" * 300 + "...") and SECRET not in long
        assert (await failure("err400")).endswith("HTTP 400 (application/json, 24 bytes)")  # {"detail":"bad request"}
        bad = await failure("badjson")
        assert bad.endswith(f"invalid JSON in answer (application/json, {len('this is {not json ' + SECRET)} bytes)")
        for text in (html, bad):
            assert SECRET not in text

    run(main())


def test_redirects_are_not_followed(server):
    async def main():
        async with make_env(server.url("redirect"), retries=2) as env:
            with pytest.raises(EnvironmentServerError) as err:
                await env.start_interaction("redirected")
        assert str(err.value).endswith("/reset failed: HTTP 307: redirects are not followed")
        assert server.app.state.attempts[("redirect", "reset", "redirected")] == 1  # not retried
        assert server.app.state.attempts[("ok", "reset", "redirected")] == 0  # never reached the target
        # the health check does not follow one either: a redirect is not healthy
        with pytest.raises(EnvironmentServerError, match="health check answered HTTP 307"):
            await check_endpoint(server.url("redirect"))

    run(main())


def test_an_answer_past_the_size_bound_is_refused_unread(server):
    async def main():
        async with make_env(server.url("huge"), retries=2) as env:
            with pytest.raises(EnvironmentServerError) as err:
                await env.start_interaction("huge")
        assert str(err.value).endswith(f"/reset failed: answer larger than {env_http.MAX_ANSWER_BYTES} bytes (HTTP 200)")
        assert server.app.state.attempts[("huge", "reset", "huge")] == 1  # not retried

    run(main())


def test_steps_carry_their_index_and_every_request_the_job_id(server):
    async def main():
        context = InteractionContext(job_id="job-from-operator")
        config = {"env_endpoint": server.url(), "job_id": "job-from-client", "backoff_s": 0.01}
        async with GymEnvironmentInteraction.create(config, context) as env:
            iid = await env.start_interaction("indexed", job_id="job-from-row", seed=3)
            for _ in range(3):
                await env.generate_response(iid, assistant("add 1"))
            await env.finalize_interaction(iid)
            await env.finalize_interaction("never-started")
        state = server.app.state
        reset = next(b for b in state.resets if b["instance_id"] == iid)
        assert reset == {"instance_id": iid, "job_id": "job-from-operator", "seed": 3}
        steps = [b for b in state.steps if b["instance_id"] == iid]
        assert steps == [{"instance_id": iid, "action": "add 1", "step": k, "job_id": "job-from-operator"}
                         for k in range(3)]
        finals = [b for b in state.finalize_bodies if b["instance_id"] in (iid, "never-started")]
        assert finals == [{"instance_id": iid, "job_id": "job-from-operator"},
                          {"instance_id": "never-started", "job_id": "job-from-operator"}]

    run(main())


class CountingEnv:
    """Counts its own step calls: a step applied twice shows in the count."""

    def reset(self, **kwargs):
        self.calls = 0
        return "count=0"

    def step(self, action):
        self.calls += 1
        return f"calls={self.calls}", float(self.calls), False, {}


def lossy_proxy(upstream: str, state: SimpleNamespace) -> FastAPI:
    """Forwards everything to ``upstream``; the first /step of each instance is applied
    upstream but its answer is lost (the client gets a 502)."""
    app = FastAPI()

    @app.api_route("/{path}", methods=["GET", "POST"])
    async def forward(path: str, request: Request):
        body = await request.body()
        async with httpx.AsyncClient(trust_env=False) as client:
            answer = await client.request(request.method, f"{upstream}/{path}", content=body,
                                          headers={"content-type": "application/json"})
        if path == "step":
            iid = (await request.json())["instance_id"]
            state.step_attempts[iid] += 1
            if state.step_attempts[iid] == 1:
                return JSONResponse({"error": "bad gateway"}, status_code=502)
        return Response(answer.content, status_code=answer.status_code, media_type="application/json")

    return app


def test_a_retried_step_whose_answer_was_lost_is_not_applied_twice():
    env_app = create_env_app(CountingEnv)
    state = SimpleNamespace(step_attempts=Counter())
    with running_app_servers([env_app]) as (upstream,):
        with running_app_servers([lossy_proxy(upstream, state)]) as (proxy,):

            async def main():
                async with make_env(proxy, retries=1, job_id="job-7") as env:
                    iid = await env.start_interaction("lossy")
                    first = await env.generate_response(iid, assistant("a"))
                    second = await env.generate_response(iid, assistant("b"))
                    await env.finalize_interaction(iid)
                return first, second

            first, second = asyncio.run(main())
            health = httpx.get(f"{upstream}/health", trust_env=False).json()
    assert state.step_attempts["lossy"] == 3  # two steps, the first sent again ...
    assert (first[1], first[2]) == ("calls=1", 1.0)  # ... and answered without stepping again
    assert (second[1], second[2]) == ("calls=2", 2.0)
    assert env_app.state.stats.steps == 2 and env_app.state.stats.replayed_steps == 1
    assert health["jobs"]["job-7"]["replayed_steps"] == 1 and health["jobs"]["job-7"]["steps"] == 2


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


def test_a_finalize_that_cannot_reach_its_server_is_sent_again_later(server):
    """The env server stays up but the way to it breaks (a proxy that refuses, as a dropped relay or
    a network fault would): the finalize is kept and sent again by finalize_leftovers once the way
    is back, so the env is left with no open instance; one answered (even with an error) is done."""
    port = int(server.url().rsplit(":", 1)[1])
    with TcpProxy(port) as proxy:
        async def main():
            async with make_env(proxy.url, retries=0) as env:
                iids = [await env.start_interaction(f"left-{i}") for i in range(3)]
                proxy.refuse()
                for iid in iids:
                    await env.finalize_interaction(iid)
                assert sorted(env.unfinalized_instances()) == sorted(iids) and env.active_instances == 0
                assert await env.finalize_leftovers() == 3  # still unreachable: kept
                proxy.accept()
                assert await env.finalize_leftovers() == 0
                assert env.unfinalized_instances() == []
                env.adopt_unfinalized(["from-a-crashed-process"])  # a journal's ids: unknown here, finalized too
                assert await env.finalize_leftovers() == 0
                return iids

        iids = run(main())
    state = server.app.state
    assert all(iid in state.finalized and iid not in state.instances for iid in iids)
    assert "from-a-crashed-process" in state.finalized


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


def test_shard_urls_are_normalised_base_urls():
    assert shard_urls("http://127.0.0.1:8000/") == ["http://127.0.0.1:8000"]
    assert shard_urls("HTTP://LocalHost", 2) == ["http://localhost:80", "http://localhost:81"]  # 80 is implied
    assert shard_urls("http://127.0.0.1:8000", 3) == [
        "http://127.0.0.1:8000", "http://127.0.0.1:8001", "http://127.0.0.1:8002",
    ]
    assert shard_urls("http://[::1]:9000", 2) == ["http://[::1]:9000", "http://[::1]:9001"]
    assert shard_urls(None, ["http://a:1", "http://b:2/"]) == ["http://a:1", "http://b:2"]
    with pytest.raises(ValueError, match="duplicate"):
        shard_urls(None, ["http://a:1", "http://A:1/"])
    with pytest.raises(ValueError, match="past port 65535"):
        shard_urls("http://a:65535", 2)


@pytest.mark.parametrize(
    "endpoint, shards, field, message",
    [
        ("http://127.0.0.1:8000/env", None, "env_endpoint", "no path, query or fragment"),
        ("http://127.0.0.1:8000/?q=1", None, "env_endpoint", "no path, query or fragment"),
        ("http://127.0.0.1:8000#frag", None, "env_endpoint", "no path, query or fragment"),
        ("http://user:pw@127.0.0.1:8000", None, "env_endpoint", "user info"),
        ("ftp://127.0.0.1", None, "env_endpoint", "http:// or https://"),
        (None, ["http://a:1", "http://b:2/admin"], r"env_shards\[1\]", "no path"),
        ("http://a:1/x", 2, "env_endpoint", "no path"),
    ],
)
def test_endpoints_with_a_path_query_fragment_or_user_info_are_refused(endpoint, shards, field, message):
    with pytest.raises(EndpointError, match=f"^{field}.*{message}"):
        shard_urls(endpoint, shards)
    with pytest.raises(EndpointError, match=f"^{field}"):
        GymEnvironmentInteraction({"env_endpoint": endpoint, "env_shards": shards})


def test_shard_count_is_bounded():
    assert len(shard_urls("http://127.0.0.1:8000", 64, max_shards=64)) == 64
    with pytest.raises(ValueError, match="^env_shards: at most 64 .*got 65"):
        shard_urls("http://127.0.0.1:8000", 65, max_shards=64)
    with pytest.raises(ValueError, match="^env_shards: at most 2 .*got 3"):
        shard_urls(None, ["http://a:1", "http://a:2", "http://a:3"], max_shards=2)
    # the interaction applies the context's bound (64 by default) ...
    with pytest.raises(ValueError, match="^env_shards: at most 64 .*got 65"):
        GymEnvironmentInteraction({"env_endpoint": "http://127.0.0.1:8000", "env_shards": 65})
    with pytest.raises(ValueError, match="^env_shards: at most 1 .*got 2"):
        GymEnvironmentInteraction.create({"env_endpoint": "http://127.0.0.1:8000", "env_shards": 2},
                                         InteractionContext(max_env_shards=1))
    # ... and checks the count before building a URL per shard
    started = time.perf_counter()
    with pytest.raises(ValueError, match="got 1000000"):
        GymEnvironmentInteraction({"env_shards": ["http://a:1"] * 1_000_000})
    assert time.perf_counter() - started < 1.0


def test_context_policy_checks_every_endpoint_naming_its_field():
    policy = EndpointPolicy.from_strings(["127.0.0.1:8000-8001"])
    context = InteractionContext(endpoint_policy=policy)
    env = GymEnvironmentInteraction.create({"env_endpoint": "http://127.0.0.1:8000", "env_shards": 2}, context)
    assert env.shards == ["http://127.0.0.1:8000", "http://127.0.0.1:8001"]
    with pytest.raises(EndpointError, match=r"^env_shards\[2\] http://127.0.0.1:8002 is not allowed"):
        GymEnvironmentInteraction.create({"env_endpoint": "http://127.0.0.1:8000", "env_shards": 3}, context)
    with pytest.raises(EndpointError, match=r"^env_shards\[1\] http://10.0.0.1:8000 is not allowed"):
        GymEnvironmentInteraction.create({"env_shards": ["http://127.0.0.1:8000", "http://10.0.0.1:8000"]}, context)
    with pytest.raises(EndpointError, match="^env_endpoint http://127.0.0.1:9 is not allowed"):
        GymEnvironmentInteraction.create({"env_endpoint": "http://127.0.0.1:9"}, context)
    # an IP in another spelling is the same IP to the policy
    with pytest.raises(EndpointError, match="^env_endpoint http://127.0.0.1:9 is not allowed"):
        GymEnvironmentInteraction.create({"env_endpoint": "http://2130706433:9"}, context)
    # the policy applies through create(); direct construction is the trusted in-process path
    assert GymEnvironmentInteraction({"env_endpoint": "http://127.0.0.1:9"}).shards == ["http://127.0.0.1:9"]
    with pytest.raises(EndpointError, match="allows no environment servers"):
        GymEnvironmentInteraction.create({"env_endpoint": "http://127.0.0.1:8000"},
                                         InteractionContext(endpoint_policy=EndpointPolicy()))


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
