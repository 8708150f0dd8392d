"""OpenEnvInteraction against real OpenEnv servers (openenv's own app, in the OpenEnv venv's
python; see ``openenv_server.py``), and the pure schema rules it applies."""

from __future__ import annotations

import asyncio
import time

import pytest

from opentinker.environments.interaction import (
    MAX_STEPS_REACHED,
    TRUNCATED,
    EnvironmentServerError,
    InteractionContext,
)
from opentinker.environments.openenv_interaction import OpenEnvInteraction
from opentinker.environments.openenv_schema import action_field_for, observation_field_for, observation_text
from opentinker.environments.registry import default_registry

from .openenv_server import OpenEnvServer, question, running_openenv_server


def run(coro):
    return asyncio.run(coro)


def turn(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": "q"}, {"role": "assistant", "content": text}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_openenv_server(tmp_path_factory.mktemp("openenv")) as live:
        yield live


def make_env(url: str, **config) -> OpenEnvInteraction:
    return OpenEnvInteraction({"name": "arith", "env_endpoint": url, **config})


# -- episodes --------------------------------------------------------------------------


def test_an_episode_resets_steps_and_closes_its_session(server):
    prompt, answer = question(3)

    async def main():
        async with make_env(server.url, reset_kwargs={"level": "easy"}) as env:
            iid = await env.start_interaction("episode-1", seed=3, topic="sums")
            first = await env.initial_observation(iid)
            assert first.observation == prompt  # the only string field of the observation
            assert env.open_sessions == 1
            done, text, reward, info = await env.generate_response(iid, turn("I think 7"))
            assert (done, text, reward, info) == (False, prompt.replace("What", "Wrong. What"), 0.0, {"step": 1})
            done, text, reward, info = await env.generate_response(iid, turn(f"It is {answer}."))
            assert (done, text, reward, info) == (True, "Correct.", 1.0, {"step": 2})
            assert await env.calculate_score(iid) == 1.0
            await env.finalize_interaction(iid)
            assert env.open_sessions == 0 and env.active_instances == 0
            await env.finalize_interaction(iid)  # twice is harmless

    run(main())
    stats = server.wait_idle()
    assert stats["live"] == 0  # the close ended the server's env instance
    # seed, episode_id (the instance id), reset_kwargs and the row's kwargs all reached reset
    assert stats["resets"]["episode-1"] == {"seed": 3, "max_tries": 3, "kwargs": {"level": "easy", "topic": "sums"}}


def test_a_multi_step_episode_keeps_its_state_across_steps(server):
    """The reason for the WebSocket: OpenEnv's HTTP /step does not share the episode of /reset."""
    prompt, answer = question(11)

    async def main():
        template = "{text} (try {tries}, step {step}, reward {reward:g})"
        async with make_env(server.url, observation_template=template, reset_kwargs={"max_tries": 5}) as env:
            iid = await env.start_interaction("multi", seed=11)
            texts = []
            for _ in range(3):
                done, text, _, _ = await env.generate_response(iid, turn("0"))
                assert not done
                texts.append(text)
            done, text, reward, _ = await env.generate_response(iid, turn(str(answer)))
            await env.finalize_interaction(iid)
            return texts, (done, text, reward)

    texts, last = run(main())
    wrong = prompt.replace("What", "Wrong. What")
    assert texts == [f"{wrong} (try {n}, step {n}, reward 0)" for n in (1, 2, 3)]  # same problem, tries counted
    assert last == (True, "Correct. (try 4, step 4, reward 1)", 1.0)


def test_max_steps_truncates_the_episode(server):
    async def main():
        async with make_env(server.url, max_steps=2, reset_kwargs={"max_tries": 10}) as env:
            iid = await env.start_interaction("trunc", seed=5)
            first = await env.generate_response(iid, turn("no"))
            second = await env.generate_response(iid, turn("no"))
            after = await env.generate_response(iid, turn("no"))
            score = await env.calculate_score(iid)
            await env.finalize_interaction(iid)
            return first, second, after, score

    first, second, after, score = run(main())
    assert first[0] is False
    done, _, reward, info = second
    assert done and reward == 0.0 and info[TRUNCATED] is True and info[MAX_STEPS_REACHED] is True
    assert after[0] is True and after[3].get("already_done") is True
    assert score == 0.0


def test_the_observation_json_is_the_turn_when_no_field_is_picked():
    schema = {"action": {"properties": {"move": {"type": "string"}}, "required": ["move"]},
              "observation": {"properties": {"board": {"type": "array"}, "score": {"type": "integer"},
                                             "metadata": {"type": "object"}, "done": {}, "reward": {}}}}
    assert observation_field_for(schema) is None
    assert observation_text({"board": [1, 2], "score": 3, "metadata": {}}, None) == '{"board": [1, 2], "score": 3}'
    assert observation_text({"board": [1, 2], "score": 3}, "score") == "3"
    assert action_field_for(schema) == "move"


# -- the schema ------------------------------------------------------------------------


def test_a_wrong_action_field_is_refused_at_check_time_naming_the_schemas_fields(server):
    async def main():
        async with make_env(server.url, action_field="reply") as env:
            problems = await env.check_schema(5.0)
            with pytest.raises(EnvironmentServerError) as err:
                await env.start_interaction("wrong-field", seed=1)
            return problems, err.value

    problems, error = run(main())
    (problem,) = problems
    assert f"{server.url}/schema" in problem
    assert "action_field 'reply' is not a field of the env's action" in problem
    assert "'answer' (string, required)" in problem and "'metadata' (object)" in problem
    assert error.unreachable is False and error.url == f"{server.url}/schema" and "'reply'" in error.cause

    async def fine():
        async with make_env(server.url, action_field="answer") as env:
            return await env.check_schema(5.0)

    assert run(fine()) == []


@pytest.mark.parametrize(("config", "expected"), [
    ({"action_field": "tries"}, "action_field 'tries' is not a string field"),
    ({"action_extra": {"hint": 1}}, "action_extra names 'hint', which the env's action does not have"),
    ({"action_field": "metadata"}, "action_field 'metadata' is not a string field"),
    ({"observation_field": "board"}, "observation_field 'board' is not a field of the env's observation"),
    ({"observation_template": "{text} {board}"}, "observation_template names {board}"),
])
def test_schema_mismatches_are_named(config, expected):
    schema = {
        "action": {"additionalProperties": False, "required": ["answer"],
                   "properties": {"answer": {"type": "string"}, "tries": {"type": "integer"},
                                  "metadata": {"type": "object"}}},
        "observation": {"properties": {"text": {"type": "string"}, "tries": {"type": "integer"},
                                       "metadata": {"type": "object"}, "done": {"type": "boolean"}}},
    }
    from opentinker.environments.templates import template_names

    with pytest.raises(ValueError, match=expected):
        action_field_for(schema, config.get("action_field"), config.get("action_extra"))
        template = config.get("observation_template")
        observation_field_for(schema, config.get("observation_field"), template_names(template) if template else [])


def test_the_action_field_is_picked_from_the_schema_or_must_be_named():
    def action(**props):
        return {"action": {"properties": props, "required": [n for n, p in props.items() if p.pop("req", False)]}}

    text = {"type": "string"}
    optional = {"anyOf": [{"type": "string"}, {"type": "null"}]}
    assert action_field_for(action(command=dict(text), metadata={"type": "object"})) == "command"
    assert action_field_for(action(code=dict(optional), x={"type": "integer"})) == "code"  # Optional[str] is text
    assert action_field_for(action(foo=dict(text), message=dict(text))) == "message"  # a usual name
    with pytest.raises(ValueError, match="several string fields"):
        action_field_for(action(foo=dict(text), bar=dict(text)))
    with pytest.raises(ValueError, match="requires 'level'"):
        action_field_for(action(message=dict(text), level={"type": "integer", "req": True}))
    assert action_field_for(action(message=dict(text), level={"type": "integer", "req": True}),
                            action_extra={"level": 2}) == "message"
    with pytest.raises(ValueError, match="is not an OpenEnv server|no 'action'"):
        action_field_for({"detail": "Not Found"})


# -- errors ----------------------------------------------------------------------------


def test_validation_and_execution_errors_are_env_errors_naming_url_and_code(server):
    async def main():
        errors = []
        async with make_env(server.url) as env:
            for reply in ("x" * 500, "crash"):
                iid = await env.start_interaction(f"err-{len(errors)}", seed=2)
                with pytest.raises(EnvironmentServerError) as err:
                    await env.generate_response(iid, turn(reply))
                errors.append(err.value)
                await env.finalize_interaction(iid)
            assert env.open_sessions == 0
        return errors

    validation, execution = run(main())
    for error in (validation, execution):
        assert error.unreachable is False and error.url == f"{server.url}/ws"
    assert "step 1 answered VALIDATION_ERROR: Invalid message (answer: String should have at most 200 characters)" \
        in validation.cause
    assert "xxx" not in validation.cause  # the model's text is never quoted back
    assert "step 1 answered EXECUTION_ERROR: the simulator crashed" in execution.cause
    assert server.wait_idle()["live"] == 0


def test_a_killed_server_is_unreachable_and_a_slow_step_breaks_the_episode(tmp_path):
    live = OpenEnvServer(tmp_path).start()
    try:
        async def main():
            async with make_env(live.url, timeout_s=1.0, retries=1, backoff_s=0.05) as env:
                slow = await env.start_interaction("slow", seed=1)
                with pytest.raises(EnvironmentServerError) as late:
                    await env.generate_response(slow, turn("sleep 3"))
                await env.finalize_interaction(slow)
                iid = await env.start_interaction("killed", seed=1)
                live.kill()
                with pytest.raises(EnvironmentServerError) as broken:
                    await env.generate_response(iid, turn("5"))
                with pytest.raises(EnvironmentServerError) as again:  # the session is gone for good
                    await env.generate_response(iid, turn("5"))
                await env.finalize_interaction(iid)
                with pytest.raises(EnvironmentServerError) as start:
                    await env.start_interaction("after", seed=1)
                with pytest.raises(EnvironmentServerError) as health:
                    await env.check_health(live.url, 2.0)
                assert env.open_sessions == 0
                return late.value, broken.value, again.value, start.value, health.value

        late, broken, again, start, health = run(main())
    finally:
        live.kill()
    assert late.unreachable and "no message within 1s" in late.cause and "cannot go on in a new session" in late.cause
    assert broken.unreachable and broken.url == f"{live.url}/ws" and "step 1: no answer (the session" in broken.cause
    assert again.unreachable and "session is gone" in again.cause
    assert start.unreachable and start.url == f"{live.url}/ws" and "after 2 attempts" in start.cause
    assert health.unreachable and health.url == f"{live.url}/health"


# -- capacity --------------------------------------------------------------------------


def test_sixteen_episodes_share_two_sessions_without_errors(tmp_path):
    """max_concurrent_envs=2: the first refusal teaches the interaction the limit; from then on
    the episodes queue here for a session instead of hammering the server."""
    with running_openenv_server(tmp_path, max_concurrent_envs=2) as live:
        async def episode(env: OpenEnvInteraction, seed: int) -> float:
            iid = await env.start_interaction(f"cap-{seed}", seed=seed)
            try:
                _, answer = question(seed)
                await env.generate_response(iid, turn("0"))
                await asyncio.sleep(0.05)
                done, _, reward, _ = await env.generate_response(iid, turn(str(answer)))
                assert done
                return reward
            finally:
                await env.finalize_interaction(iid)

        async def main():
            async with make_env(live.url) as env:
                start = time.perf_counter()
                rewards = await asyncio.gather(*(episode(env, seed) for seed in range(16)))
                return rewards, env.capacity_refusals, time.perf_counter() - start, env.sessions.limits

        rewards, refusals, took, limits = run(main())
        stats = live.wait_idle()
    print(f"16 episodes on 2 sessions: {took:.2f}s, {refusals} CAPACITY_REACHED refusals, peak {stats['peak']}")
    assert rewards == [1.0] * 16  # every episode completed, none errored
    assert stats["peak"] <= 2 and stats["created"] == 16 and stats["live"] == 0
    assert limits == {live.url: 2}
    assert refusals <= 16  # the first wave's 14; the queue kept the rest from being refused


def test_sessions_are_bounded_by_the_connection_pool(server):
    """A session keeps its pooled connection for the whole episode: more episodes than the pool
    holds wait for one (instead of timing out in the pool), and two connections stay free."""

    seen = []

    async def episode(env: OpenEnvInteraction, seed: int) -> float:
        iid = await env.start_interaction(f"pool-{seed}", seed=seed)
        seen.append(env.open_sessions)
        try:
            _, answer = question(seed)
            await asyncio.sleep(0.3)  # longer than timeout_s would let a connection wait in the pool
            await env.check_health(server.url, 2.0)  # a free connection for /health all along
            return (await env.generate_response(iid, turn(str(answer))))[2]
        finally:
            await env.finalize_interaction(iid)

    async def main():
        async with make_env(server.url, max_connections=4, timeout_s=0.25) as env:
            assert env.session_limit == 2
            return await asyncio.gather(*(episode(env, 100 + seed) for seed in range(8))), env.capacity_refusals

    rewards, refusals = run(main())
    assert rewards == [1.0] * 8 and refusals == 0
    assert max(seen) == 2 and len(seen) == 8
    assert server.wait_idle()["live"] == 0


def test_an_episode_waits_for_capacity_past_a_steps_deadline_and_gives_up_after_capacity_wait_s(tmp_path):
    """call_deadline_s (what the agent loop waits for one call) covers a start that waits
    for a session; a step's own bound is timeout_s."""
    with running_openenv_server(tmp_path, max_concurrent_envs=2) as live:
        async def main():
            async with make_env(live.url, timeout_s=0.5, retries=0, capacity_wait_s=20) as env:
                assert env.call_deadline_s() > 20 + 0.5
                held = [await env.start_interaction(f"hold-{i}", seed=i) for i in range(2)]

                async def release_later():
                    await asyncio.sleep(2.0)  # longer than a gym-style deadline (every try's timeout + 1 s)
                    for iid in held:
                        await env.finalize_interaction(iid)

                releaser = asyncio.create_task(release_later())
                start = time.perf_counter()
                iid = await asyncio.wait_for(env.start_interaction("waiter", seed=9), env.call_deadline_s())
                waited = time.perf_counter() - start
                await releaser
                await env.finalize_interaction(iid)

            async with make_env(live.url, capacity_wait_s=0.5) as env:
                held = [await env.start_interaction(f"hold2-{i}", seed=i) for i in range(2)]
                start = time.perf_counter()
                with pytest.raises(EnvironmentServerError) as err:
                    await env.start_interaction("gives-up", seed=9)
                gave_up = time.perf_counter() - start
                for iid in held:
                    await env.finalize_interaction(iid)
            return waited, gave_up, err.value

        waited, gave_up, error = run(main())
    assert waited >= 1.5
    assert gave_up < 5.0
    assert error.unreachable is True and error.url == f"{live.url}/ws"
    assert "capacity" in error.cause and "capacity_wait_s=0.5s" in error.cause


def test_a_deep_answer_is_that_episodes_env_error(server):
    """An observation nested 200 levels deep (the env's own answer) fails that episode as an env
    error of the env's own, naming the bound, instead of a RecursionError that fails the job."""

    async def main():
        async with make_env(server.url) as env:
            iid = await env.start_interaction("deep-1", seed=5)
            with pytest.raises(EnvironmentServerError) as err:
                await env.generate_response(iid, turn("deep"))
            assert env.open_sessions == 0  # the session went with the episode
            await env.finalize_interaction(iid)
            return err.value

    error = run(main())
    assert error.unreachable is False and "nested deeper than 64 levels" in error.cause
    assert server.wait_idle()["live"] == 0


def test_a_queue_that_moves_is_waited_for_past_capacity_wait_s(tmp_path):
    """One session at a time, six episodes that hold it 0.4 s each: the last waits about 2 s, more
    than capacity_wait_s=1 s, and still runs, because slots kept being freed meanwhile (waiting
    behind one's own episodes is progress, not an outage); the start has no deadline of its own."""
    with running_openenv_server(tmp_path, max_concurrent_envs=1) as live:
        async def episode(env: OpenEnvInteraction, seed: int) -> float:
            iid = await env.start_interaction(f"queue-{seed}", seed=seed)
            try:
                await asyncio.sleep(0.4)
                return (await env.generate_response(iid, turn(str(question(seed)[1]))))[2]
            finally:
                await env.finalize_interaction(iid)

        async def main():
            async with make_env(live.url, capacity_wait_s=1.0) as env:
                assert env.start_deadline_s() is None
                start = time.perf_counter()
                rewards = await asyncio.gather(*(episode(env, seed) for seed in range(6)))
                return rewards, time.perf_counter() - start

        rewards, took = run(main())
        stats = live.wait_idle()
    assert rewards == [1.0] * 6 and took > 2.0
    assert stats["peak"] == 1 and stats["live"] == 0


def test_a_schema_that_never_answers_fails_the_episodes_waiting_on_it_together():
    """Eight episodes start at once on a server whose /schema never answers: one read (with its
    retries) is made for all of them, and all fail with its error, instead of each waiting
    episode reading it again in turn (8 x the retries x timeout_s)."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    asked = []

    class Silent(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            asked.append(self.path)
            time.sleep(3.0)

        def log_message(self, *args):
            pass

    http = ThreadingHTTPServer(("127.0.0.1", 0), Silent)
    threading.Thread(target=http.serve_forever, daemon=True).start()
    try:
        async def main():
            async with make_env(f"http://127.0.0.1:{http.server_address[1]}", timeout_s=0.3, retries=1,
                                backoff_s=0.0) as env:
                return await asyncio.gather(*(env.start_interaction(f"s-{i}") for i in range(8)),
                                            return_exceptions=True)

        results = run(main())
    finally:
        http.shutdown()
    assert all(isinstance(r, EnvironmentServerError) and r.unreachable for r in results)
    assert len({str(r) for r in results}) == 1  # the same read's error
    assert asked == ["/schema", "/schema"]  # one read: a try and its retry


# -- building it -----------------------------------------------------------------------


def test_the_registry_builds_it_from_openenv_and_refuses_misspelt_keys():
    registry = default_registry()
    built = registry.build([{"name": "arith", "class_path": "openenv",
                             "config": {"env_endpoint": "http://127.0.0.1:9", "action_field": "answer"}}])
    assert isinstance(built["arith"], OpenEnvInteraction) and built["arith"].relayed is False
    assert registry.resolve("opentinker.environments.openenv_interaction.OpenEnvInteraction") is OpenEnvInteraction
    with pytest.raises(ValueError, match="unknown key"):
        registry.build([{"name": "arith", "class_path": "openenv",
                         "config": {"env_endpoint": "http://127.0.0.1:9", "action_feild": "answer"}}])
    relayed = registry.build([{"name": "arith", "class_path": "openenv",
                               "config": {"env_endpoint": "http://127.0.0.1:9", "relay": "client"}}],
                             context=InteractionContext(relay_refusal=None))
    assert relayed["arith"].relayed is True


@pytest.mark.parametrize(("config", "expected"), [
    ({"max_steps": 0}, "max_steps"),
    ({"capacity_wait_s": -1}, "capacity_wait_s"),
    ({"timeout_s": 301}, "timeout_s"),
    ({"action_extra": ["a"]}, "action_extra must be a dict"),
    ({"reset_kwargs": "x"}, "reset_kwargs must be a dict"),
    ({"action_field": ""}, "action_field must be a field name"),
    ({"observation_template": "{text.__class__}"}, "observation_template may use only"),
    ({"observation_template": "{text:>1000}"}, "widths and precisions"),
])
def test_the_config_is_bounded(config, expected):
    with pytest.raises(ValueError, match=expected):
        make_env("http://127.0.0.1:9", **config)


def test_the_schema_rules_import_without_heavy_packages(run_without_heavy_packages):
    done = run_without_heavy_packages(
        """
        from opentinker.environments.openenv_schema import action_field_for
        from opentinker.environments.registry import default_registry
        assert action_field_for({"action": {"properties": {"text": {"type": "string"}}}}) == "text"
        assert "openenv" in default_registry().allowed_paths()
        """
    )
    assert done.returncode == 0, done.stderr
