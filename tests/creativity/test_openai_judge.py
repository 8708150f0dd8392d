"""The OpenAI-compatible judge against a real HTTP server (``conftest.py``) through the real
``openai`` client: retries, validation, timeouts, caching, concurrency, fallbacks, metrics."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest

pytest.importorskip("openai")

from opentinker.creativity import JudgeConfigError, make_judge  # noqa: E402
from opentinker.creativity.openai_judge import OpenAIStrategyJudge  # noqa: E402

QUESTION = "What is 47 + 38?"
RESPONSES = [
    "Tens first: 40 + 30 = 70, then the ones 7 + 8 = 15, so 70 + 15 = 85.",
    "Count up from 47 by tens to 77, then by ones eight times to 85.",
    "Tens, then ones: 40 and 30 make 70, 7 and 8 make 16, total 86.",
    "Round 38 up to 40, add 47 + 40 = 87, take away the extra 2: 85.",
]
EXPECTED = ["s0", "s1", "s0", "s2"]  # tens / count / tens / round


def judge_for(server, **options) -> OpenAIStrategyJudge:
    settings = {"api_key": "test-key", "base_url": server.base_url, "model": "judge-test",
                "backoff_s": 0.01, "timeout_s": 5.0}
    settings.update(options)
    return make_judge("openai", **settings)


def group(marker: str, responses=RESPONSES) -> tuple[str, list[str]]:
    return (f"{QUESTION} [{marker}]", list(responses))


def test_valid_grouping_request_body_and_metrics(chat_server):
    judge = judge_for(chat_server)
    assert judge.label_groups([group("plain")]) == [EXPECTED]
    assert len(chat_server.requests) == 1
    body = chat_server.requests[0]
    assert body["model"] == "judge-test"
    assert body["temperature"] == 0
    assert body["response_format"] == {"type": "json_object"}
    assert chat_server.headers[0]["authorization"] == "Bearer test-key"
    roles = [message["role"] for message in body["messages"]]
    assert roles == ["system", "user"]
    user = body["messages"][1]["content"]
    assert QUESTION in user
    for number, response in enumerate(RESPONSES, start=1):
        assert f'<response number="{number}">\n{response}\n</response>' in user
    assert "JSON" in user and '"groups"' in user and '"members"' in user
    metrics = judge.pop_metrics()
    assert metrics["judge/calls"] == 1
    assert metrics["judge/groups"] == 1
    assert metrics["judge/failures"] == 0
    assert metrics["judge/fallback_groups"] == 0
    assert metrics["judge/prompt_tokens"] == chat_server.prompt_tokens > 0
    assert metrics["judge/completion_tokens"] == chat_server.completion_tokens > 0
    assert metrics["judge/latency_s_mean"] > 0
    assert judge.pop_metrics()["judge/calls"] == 0  # reset by the pop


def test_api_error_and_invalid_answers_are_retried_then_succeed(chat_server):
    chat_server.script("retry", "error500", "malformed", "wrong_count", "valid_fenced")
    judge = judge_for(chat_server, max_retries=3)
    assert judge.label_groups([group("retry")]) == [EXPECTED]
    assert chat_server.actions_taken == ["error500", "malformed", "wrong_count", "valid_fenced"]
    metrics = judge.pop_metrics()
    assert metrics["judge/calls"] == 4
    assert metrics["judge/failures"] == 3
    assert metrics["judge/invalid_outputs"] == 2
    assert metrics["judge/fallback_groups"] == 0
    # tokens of every answered request (the invalid ones cost tokens too), none for the 500
    assert len(chat_server.usages) == 3
    assert metrics["judge/prompt_tokens"] == chat_server.prompt_tokens
    assert metrics["judge/completion_tokens"] == chat_server.completion_tokens


def test_timeout_is_retried(chat_server):
    chat_server.script("slow", "slow", "valid")
    judge = judge_for(chat_server, timeout_s=0.3, max_retries=1)
    started = time.monotonic()
    assert judge.label_groups([group("slow")]) == [EXPECTED]
    assert time.monotonic() - started < chat_server.slow_s  # it did not wait for the slow answer
    metrics = judge.pop_metrics()
    assert metrics["judge/calls"] == 2 and metrics["judge/failures"] == 1


def test_fallback_to_none_after_exhausting_retries(chat_server):
    chat_server.script("broken", "error500", "malformed", "wrong_count", "valid")
    judge = judge_for(chat_server, max_retries=2, max_concurrency=2)
    labels = judge.label_groups([group("broken"), group("fine")])
    assert labels == [None, EXPECTED]
    assert list(chat_server.scripts["broken"]) == ["valid"]  # exactly 3 attempts for the broken group
    metrics = judge.pop_metrics()
    assert metrics["judge/calls"] == 4
    assert metrics["judge/failures"] == 3
    assert metrics["judge/invalid_outputs"] == 2
    assert metrics["judge/fallback_groups"] == 1
    # a failed group is not cached: asked again, it is judged again (and now succeeds)
    assert judge.label_groups([group("broken")]) == [EXPECTED]


def test_client_errors_are_not_retried(chat_server):
    chat_server.script("auth", "error401", "valid")
    judge = judge_for(chat_server, max_retries=3)
    assert judge.label_groups([group("auth")]) == [None]
    assert chat_server.actions_taken == ["error401"]
    metrics = judge.pop_metrics()
    assert metrics["judge/calls"] == 1 and metrics["judge/failures"] == 1 and metrics["judge/fallback_groups"] == 1


def test_cache_in_memory_and_on_disk(chat_server, tmp_path):
    cache_file = tmp_path / "judge_cache.json"
    judge = judge_for(chat_server, cache_path=cache_file)
    groups = [group("cache-a"), group("cache-b", RESPONSES[:3])]
    first = judge.label_groups(groups)
    assert first == [EXPECTED, EXPECTED[:3]]
    assert len(chat_server.requests) == 2
    assert judge.pop_metrics()["judge/cache_hits"] == 0

    assert judge.label_groups(groups) == first
    assert len(chat_server.requests) == 2  # no new request reached the server
    metrics = judge.pop_metrics()
    assert metrics["judge/cache_hits"] == 2 and metrics["judge/calls"] == 0

    stored = json.loads(cache_file.read_text())
    assert len(stored) == 2 and all(len(key) == 64 for key in stored)
    fresh = judge_for(chat_server, cache_path=cache_file)
    assert fresh.label_groups(groups) == first
    assert len(chat_server.requests) == 2
    assert fresh.pop_metrics()["judge/cache_hits"] == 2

    other_model = judge_for(chat_server, cache_path=cache_file, model="another-judge")
    other_model.label_groups(groups[:1])  # the model is part of the key
    assert len(chat_server.requests) == 3

    no_cache = judge_for(chat_server, cache=False)
    no_cache.label_groups(groups[:1])
    no_cache.label_groups(groups[:1])
    assert len(chat_server.requests) == 5


def test_duplicate_groups_in_one_call_share_one_request(chat_server):
    judge = judge_for(chat_server, cache=False)
    assert judge.label_groups([group("dup"), group("dup")]) == [EXPECTED, EXPECTED]
    assert len(chat_server.requests) == 1
    assert judge.pop_metrics()["judge/cache_hits"] == 1


def test_bounded_concurrency(chat_server):
    chat_server.delay_s = 0.25
    judge = judge_for(chat_server, max_concurrency=3, cache=False)
    groups = [group(f"concurrent-{index}") for index in range(8)]
    started = time.monotonic()
    labels = judge.label_groups(groups)
    elapsed = time.monotonic() - started
    assert labels == [EXPECTED] * 8
    assert len(chat_server.requests) == 8
    assert 2 <= chat_server.max_in_flight <= 3
    assert elapsed < 8 * 0.25  # requests overlapped


def test_trivial_groups_need_no_request(chat_server):
    judge = judge_for(chat_server)
    labels = judge.label_groups([
        ("q1", ["only one"]),
        ("q2", ["same answer", "same answer ", "  same answer"]),
        ("q3", []),
    ])
    assert labels == [["s0"], ["s0", "s0", "s0"], []]
    assert chat_server.requests == []
    metrics = judge.pop_metrics()
    assert metrics["judge/skipped_groups"] == 3 and metrics["judge/calls"] == 0


def test_identical_responses_are_sent_once(chat_server):
    judge = judge_for(chat_server)
    responses = [RESPONSES[1], RESPONSES[0], RESPONSES[1], RESPONSES[2]]
    assert judge.label_groups([group("dedup", responses)]) == [["s0", "s1", "s0", "s1"]]
    user = chat_server.requests[0]["messages"][1]["content"]
    assert user.count(RESPONSES[1]) == 1
    assert '<response number="3">' in user and '<response number="4">' not in user


def test_json_mode_off_and_automatic_fallback(chat_server):
    plain = judge_for(chat_server, json_mode=False)
    assert plain.label_groups([group("no-json-mode")]) == [EXPECTED]
    assert "response_format" not in chat_server.requests[-1]

    chat_server.script("rejects", "reject_json_mode", "reject_json_mode")
    judge = judge_for(chat_server, max_retries=0)
    assert judge.label_groups([group("rejects")]) == [EXPECTED]
    assert "response_format" in chat_server.requests[-2] and "response_format" not in chat_server.requests[-1]
    assert judge.json_mode is False


def test_environment_variables(chat_server, monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "env-key")
    monkeypatch.setenv("OPENAI_BASE_URL", chat_server.base_url)
    judge = make_judge("openai", model="env-judge", backoff_s=0.01)
    assert judge.label_groups([group("env")]) == [EXPECTED]
    assert chat_server.headers[-1]["authorization"] == "Bearer env-key"
    assert chat_server.requests[-1]["model"] == "env-judge"


def test_missing_api_key_is_a_configuration_error(monkeypatch):
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    with pytest.raises(JudgeConfigError, match="OPENAI_API_KEY"):
        make_judge("openai")
    with pytest.raises(JudgeConfigError, match="max_concurrency"):
        make_judge("openai", api_key="k", max_concurrency=0)


def test_callable_from_threads_and_from_inside_a_running_loop(chat_server):
    judge = judge_for(chat_server, cache=False)
    results = {}

    def worker(name):
        results[name] = judge.label_groups([group(f"thread-{name}")])

    threads = [threading.Thread(target=worker, args=(name,)) for name in ("a", "b")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert results == {"a": [EXPECTED], "b": [EXPECTED]}

    async def inside_a_loop():
        return judge.label_groups([group("in-loop")])

    assert asyncio.run(inside_a_loop()) == [EXPECTED]
    assert judge.pop_metrics()["judge/calls"] == 3


def test_unreachable_server_falls_back(chat_server):
    # a port that nothing listens on: connection errors are retried, then the group is None
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    judge = make_judge("openai", api_key="k", base_url=f"http://127.0.0.1:{port}/v1", max_retries=1,
                       backoff_s=0.01, timeout_s=2.0)
    assert judge.label_groups([group("nowhere")]) == [None]
    metrics = judge.pop_metrics()
    assert metrics["judge/calls"] == 2 and metrics["judge/failures"] == 2 and metrics["judge/fallback_groups"] == 1
