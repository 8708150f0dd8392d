"""The Interaction base class and the in-process text interactions."""

from __future__ import annotations

import asyncio
import pickle
import uuid

import pytest

from opentinker.environments.interaction import (
    EnvironmentServerError,
    InitialObservation,
    Interaction,
    last_assistant_content,
)
from opentinker.environments.text_interactions import Gsm8kInteraction, SimpleTextEnvironment


def chat(*answers: str) -> list[dict[str, str]]:
    """A chat ending in the model's answer (earlier answers interleaved with feedback)."""
    messages = [{"role": "user", "content": "question"}]
    for i, answer in enumerate(answers):
        if i:
            messages.append({"role": "user", "content": "feedback"})
        messages.append({"role": "assistant", "content": answer})
    return messages


def run(coro):
    return asyncio.run(coro)


class Echo(Interaction):
    """A minimal subclass: reward 0.5 per turn, done after two turns."""

    async def generate_response(self, instance_id, messages, **kwargs):
        self._record_reward(instance_id, 0.5)
        turns = sum(m["role"] == "assistant" for m in messages)
        return turns >= 2, f"echo: {messages[-1]['content']}", 0.5, {"turns": turns}


def test_base_interaction_defaults():
    async def main():
        env = Echo({"name": "echo"})
        assert env.name == "echo"
        assert Echo({}).name == "Echo"
        iid = await env.start_interaction()
        uuid.UUID(iid)  # a uuid4 when none is given
        assert await env.start_interaction("mine") == "mine"
        assert await env.initial_observation(iid) is None
        assert await env.calculate_score(iid) == 0.0
        assert await env.generate_response(iid, chat("hi")) == (False, "echo: hi", 0.5, {"turns": 1})
        done, *_ = await env.generate_response(iid, chat("hi", "again"))
        assert done
        assert await env.calculate_score(iid) == 1.0
        assert await env.calculate_score("mine") == 0.0
        await env.finalize_interaction(iid)
        await env.finalize_interaction(iid)  # twice is fine
        assert await env.calculate_score(iid) == 0.0

    run(main())


def test_interaction_is_abstract():
    with pytest.raises(TypeError):
        Interaction({})  # type: ignore[abstract]


def test_initial_observation_and_error_types():
    obs = InitialObservation("look around")
    assert obs.system_prompt is None and obs.info == {}
    with pytest.raises(AttributeError):
        obs.observation = "x"  # type: ignore[misc]
    err = EnvironmentServerError("http://127.0.0.1:1/step", "HTTP 500")
    assert isinstance(err, RuntimeError)
    assert "http://127.0.0.1:1/step" in str(err) and "HTTP 500" in str(err)
    copy = pickle.loads(pickle.dumps(err))
    assert (copy.url, copy.cause, str(copy), copy.unreachable) == (err.url, err.cause, str(err), False)
    down = pickle.loads(pickle.dumps(EnvironmentServerError("http://127.0.0.1:1/reset", "ConnectError", unreachable=True)))
    assert down.unreachable and down.cause == "ConnectError"


def test_last_assistant_content():
    assert last_assistant_content(chat("a", "b")) == "b"
    assert last_assistant_content(chat("a") + [{"role": "user", "content": "u"}]) == "a"
    assert last_assistant_content([{"role": "user", "content": "u"}]) == ""


# SimpleTextEnvironment -----------------------------------------------------------------


def test_simple_text_single_attempt():
    async def main():
        env = SimpleTextEnvironment({"name": "capitals"})
        right = await env.start_interaction(ground_truth="Paris")
        assert await env.generate_response(right, chat(" paris ")) == (
            True, "Correct.", 1.0, {"attempt": 1, "correct": True},
        )
        assert await env.calculate_score(right) == 1.0
        wrong = await env.start_interaction(ground_truth="Paris")
        done, text, reward, info = await env.generate_response(wrong, chat("Lyon"))
        assert (done, reward, info["correct"]) == (True, 0.0, False)
        assert text == "That is not correct."
        assert await env.calculate_score(wrong) == 0.0
        # after the end, further calls do nothing
        assert (await env.generate_response(wrong, chat("Lyon", "Paris")))[:3] == (True, "", 0.0)

    run(main())


def test_simple_text_feedback_turns_and_rewards():
    async def main():
        env = SimpleTextEnvironment(
            {
                "scorer": "math",
                "max_attempts": 3,
                "feedback": "Nope, again.",
                "final_message": "Out of attempts.",
                "correct_reward": 2.0,
                "incorrect_reward": -0.5,
            }
        )
        iid = await env.start_interaction(ground_truth="3/4")
        assert await env.generate_response(iid, chat("0.5")) == (
            False, "Nope, again.", -0.5, {"attempt": 1, "correct": False},
        )
        assert await env.generate_response(iid, chat("0.5", r"\boxed{0.75}")) == (
            True, "Correct.", 2.0, {"attempt": 2, "correct": True},
        )
        assert await env.calculate_score(iid) == 1.5

        out = await env.start_interaction(ground_truth=7)  # non-string truths are accepted
        results = [await env.generate_response(out, chat(*["1"] * n)) for n in (1, 2, 3)]
        assert [r[0] for r in results] == [False, False, True]
        assert [r[1] for r in results] == ["Nope, again.", "Nope, again.", "Out of attempts."]
        assert await env.calculate_score(out) == -1.5
        await env.finalize_interaction(out)
        with pytest.raises(KeyError, match="unknown instance"):
            await env.generate_response(out, chat("7"))

    run(main())


def test_simple_text_scorers_and_config_errors():
    async def main():
        env = SimpleTextEnvironment({"scorer": "regex", "pattern": r"ANSWER:\s*(\w+)"})
        iid = await env.start_interaction(ground_truth="blue")
        assert (await env.generate_response(iid, chat("thinking... ANSWER: Blue")))[2] == 1.0
        contains = SimpleTextEnvironment({"scorer": "contains"})
        iid = await contains.start_interaction(ground_truth="blue")
        assert (await contains.generate_response(iid, chat("it is blue I think")))[2] == 1.0
        with pytest.raises(ValueError, match="ground_truth"):
            await env.start_interaction()

    run(main())
    with pytest.raises(ValueError, match="valid scorers"):
        SimpleTextEnvironment({"scorer": "fuzzy"})
    with pytest.raises(ValueError, match="pattern"):
        SimpleTextEnvironment({"scorer": "regex"})
    with pytest.raises(ValueError, match="max_attempts"):
        SimpleTextEnvironment({"max_attempts": 0})


# Gsm8kInteraction ----------------------------------------------------------------------


def test_gsm8k_strict_solved_first_turn():
    async def main():
        env = Gsm8kInteraction({"name": "gsm8k"})
        iid = await env.start_interaction(ground_truth="1234")
        done, text, reward, info = await env.generate_response(iid, chat("5 * 246.8 = 1234\n#### 1,234"))
        assert (done, reward) == (True, 1.0)
        assert info == {"turn": 1, "extracted": "1234", "correct": True}
        assert await env.calculate_score(iid) == 1.0
        await env.finalize_interaction(iid)
        assert await env.calculate_score(iid) == 0.0

    run(main())


def test_gsm8k_feedback_then_correct():
    async def main():
        env = Gsm8kInteraction({})
        # a full GSM8K solution as the ground truth
        iid = await env.start_interaction(ground_truth="She sold 48/2 = 24 clips.\n#### 72")
        done, text, reward, info = await env.generate_response(iid, chat("The answer is 72."))
        # strict mode: a bare number without '####' does not count
        assert (done, reward, info["extracted"]) == (False, 0.0, None)
        assert "####" in text
        done, text, reward, info = await env.generate_response(iid, chat("72", "#### 72"))
        assert (done, reward, info["turn"]) == (True, 1.0, 2)
        assert await env.calculate_score(iid) == 1.0

    run(main())


def test_gsm8k_turn_limit_and_flexible_mode():
    async def main():
        env = Gsm8kInteraction({"max_turns": 2, "final_message": "No more tries."})
        iid = await env.start_interaction(ground_truth="$1,000")
        first = await env.generate_response(iid, chat("#### 999"))
        second = await env.generate_response(iid, chat("#### 999", "#### 998"))
        assert first[:3] == (False, env.feedback, 0.0)
        assert second[:3] == (True, "No more tries.", 0.0)
        assert await env.calculate_score(iid) == 0.0

        flexible = Gsm8kInteraction({"extraction": "flexible"})
        iid = await flexible.start_interaction(ground_truth="42")
        done, _, reward, info = await flexible.generate_response(iid, chat("So it's 6*7, the answer is 42."))
        assert (done, reward, info["extracted"]) == (True, 1.0, "42")

        with pytest.raises(ValueError, match="number"):
            await flexible.start_interaction(ground_truth="forty-two")

    run(main())
    with pytest.raises(ValueError, match="extraction"):
        Gsm8kInteraction({"extraction": "loose"})


def test_text_interactions_keep_instances_apart():
    async def main():
        env = Gsm8kInteraction({"max_turns": 1})
        ids = [await env.start_interaction(ground_truth=str(i)) for i in range(16)]
        results = await asyncio.gather(
            *(env.generate_response(iid, chat(f"#### {i if i % 2 else i + 1}")) for i, iid in enumerate(ids))
        )
        assert [r[2] for r in results] == [float(i % 2) for i in range(16)]
        scores = [await env.calculate_score(iid) for iid in ids]
        assert scores == [float(i % 2) for i in range(16)]

    run(main())
