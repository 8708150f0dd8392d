"""The shipped environments, directly and through a real env server."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from opentinker.environments.arithmetic import make_problems
from opentinker.environments.games import (
    BUILTIN_ENVIRONMENTS,
    ArithmeticEnv,
    CalculatorEnv,
    DigitSumEnv,
    GuessNumberEnv,
    WordProblemsEnv,
)
from opentinker.environments.games.calculator_env import CalcError, make_word_problem, safe_calc
from opentinker.environments.server import running_env_server

pytestmark = pytest.mark.timeout(60)


def test_builtin_registry():
    assert BUILTIN_ENVIRONMENTS == {
        "guess_number": GuessNumberEnv,
        "arithmetic": ArithmeticEnv,
        "calculator": CalculatorEnv,
        "word_problems": WordProblemsEnv,
        "digit_sum": DigitSumEnv,
    }


# --------------------------------------------------------------------------- guess the number


def binary_search_episode(env: GuessNumberEnv, observation: str):
    low, high = env.low, env.high
    transcript = []
    while True:
        guess = (low + high) // 2
        observation, reward, done, info = env.step(f"My guess is {guess}.")
        transcript.append((guess, observation, reward, done, info))
        if done:
            return transcript
        if observation.startswith("Too high"):
            high = guess - 1
        else:
            assert observation.startswith("Too low")
            low = guess + 1


def test_guess_number_binary_search_wins():
    env = GuessNumberEnv()
    first = env.reset(seed=123)
    assert "between 1 and 100" in first["observation"] and "number" in first["observation"]
    assert first["system_prompt"]
    transcript = binary_search_episode(env, first["observation"])
    guess, observation, reward, done, info = transcript[-1]
    assert observation.startswith("Correct!") and reward == 1.0 and done
    assert info["secret"] == guess and info["attempts"] == len(transcript) <= 7
    assert all(r == 0.0 for _, _, r, _, _ in transcript[:-1])


def test_guess_number_is_seeded():
    a, b = GuessNumberEnv(), GuessNumberEnv()
    a.reset(seed=5)
    b.reset(seed=5)
    assert a.secret == b.secret
    secrets = set()
    for s in range(20):
        env = GuessNumberEnv()
        env.reset(seed=s)
        secrets.add(env.secret)
    assert len(secrets) > 5


def test_guess_number_runs_out_of_attempts():
    env = GuessNumberEnv(max_attempts=3)
    env.reset(secret=42)
    assert env.step("10") == ("Too low. 2 attempts left.", 0.0, False, env._info(10))
    observation, reward, done, _ = env.step("90")
    assert observation == "Too high. 1 attempt left." and not done
    observation, reward, done, info = env.step("80")
    assert done and reward == 0.0
    assert "42" in observation and "No attempts left" in observation
    assert info["attempts_left"] == 0
    assert env.step("42")[1:3] == (0.0, True)  # over is over


def test_guess_number_non_number_action_uses_an_attempt():
    env = GuessNumberEnv(max_attempts=2)
    env.reset(secret=7)
    observation, reward, done, info = env.step("I don't know")
    assert observation.startswith("Please answer with a number.")
    assert reward == 0.0 and not done and info["guess"] is None and info["attempts"] == 1


def test_guess_number_closer_bonus_is_small_and_optional():
    env = GuessNumberEnv(closer_bonus=0.05)
    env.reset(secret=50)
    assert env.step("10")[1] == 0.0  # nothing to compare with yet
    assert env.step("30")[1] == 0.05  # closer
    assert env.step("20")[1] == 0.0  # farther
    assert env.step("50")[1] == 1.0


# --------------------------------------------------------------------------- arithmetic


def test_arithmetic_env_right_and_wrong():
    env = ArithmeticEnv()
    first = env.reset(a=12, b=30)
    assert first["observation"] == "What is 12 + 30?"
    assert env.step("The answer is 42.") == ("Correct.", 1.0, True, {"answer": "42", "extracted": "42"})
    env.reset(a=12, b=30)
    observation, reward, done, info = env.step("41")
    assert (observation, reward, done) == ("Incorrect, the answer is 42.", 0.0, True)


def test_arithmetic_env_seed_matches_the_task_module():
    env = ArithmeticEnv()
    expected = make_problems(1, seed=9)[0]
    assert env.reset(seed=9)["observation"] == expected.question
    assert env.step(expected.answer)[1] == 1.0
    with pytest.raises(ValueError):
        env.reset(a=1)


# --------------------------------------------------------------------------- calculator


def test_calculator_tool_call_then_final_answer():
    env = CalculatorEnv()
    first = env.reset(question="Tom has 12 apples and buys 7 more. How many apples?", answer="19")
    assert "apples" in first["observation"] and "<tool_call>" in first["system_prompt"]
    observation, reward, done, info = env.step("Let me compute. <tool_call>calc(12 + 7)</tool_call>")
    assert (observation, reward, done) == ("<tool_response>19</tool_response>", 0.0, False)
    assert info["tool_calls"] == 1
    observation, reward, done, _ = env.step("So the answer is\n#### 19")
    assert (observation, reward, done) == ("Correct.", 1.0, True)


def test_calculator_wrong_final_answer():
    env = CalculatorEnv()
    env.reset(question="q", answer=1200)
    observation, reward, done, _ = env.step("#### 1,100")
    assert (reward, done) == (0.0, True) and "1200" in observation
    env.reset(question="q", answer=1200)
    assert env.step("#### 1,200")[1] == 1.0


def test_calculator_tool_forms_and_arithmetic():
    env = CalculatorEnv()
    env.reset(question="q", answer="3.5")
    observation, *_ = env.step(
        "<tool_call>calc((2 + 3) * 4 - 10 / 4)</tool_call> and "
        '<tool_call>{"name": "calc", "arguments": {"expression": "2 ** 10 // 3 % 7"}}</tool_call>'
    )
    assert observation == "<tool_response>17.5</tool_response>\n<tool_response>5</tool_response>"
    assert safe_calc("-(3 - 10)") == 7
    assert safe_calc("2^8") == 256
    assert env.step("#### 3.5")[1] == 1.0


@pytest.mark.parametrize(
    "expression",
    [
        "__import__('os').system('x')",
        "(1).__class__",
        "().__class__.__bases__[0].__subclasses__()",
        "open('/etc/passwd').read()",
        "x + 1",
        "[1, 2]",
        "lambda: 1",
        "'a' * 3",
        "10 ** 1000",
        "9 ** 99 ** 99",
        "1 / 0",
    ],
)
def test_calculator_rejects_unsafe_or_unbounded_expressions(expression):
    with pytest.raises(CalcError):
        safe_calc(expression)
    env = CalculatorEnv()
    env.reset(question="q", answer="1")
    observation, reward, done, _ = env.step(f"<tool_call>calc({expression})</tool_call>")
    assert observation.startswith("<tool_response>Error:") and reward == 0.0 and not done


def test_calculator_executes_nothing(tmp_path: Path):
    target = tmp_path / "pwned"
    env = CalculatorEnv()
    env.reset(question="q", answer="1")
    observation, *_ = env.step(f"<tool_call>calc(__import__('pathlib').Path({str(target)!r}).touch())</tool_call>")
    assert "Error" in observation
    assert not target.exists()


def test_calculator_nudge_and_turn_limit():
    env = CalculatorEnv(max_turns=3)
    env.reset(seed=4)
    observation, reward, done, _ = env.step("hmm, let me think")
    assert "#### N" in observation and reward == 0.0 and not done
    assert env.step("<tool_call>calc(1+1)</tool_call>")[2] is False
    observation, reward, done, info = env.step("still thinking")
    assert done and reward == 0.0 and info["turns"] == 3
    assert env.answer in observation and "No turns left" in observation


def test_calculator_templates_are_seeded_and_consistent():
    assert make_word_problem(3) == make_word_problem(3)
    questions = {make_word_problem(s)[0] for s in range(50)}
    assert len(questions) == 50
    for s in range(50):
        question, answer = make_word_problem(s)
        assert int(answer) >= 0 and question.endswith("?")
    env = CalculatorEnv()
    assert env.reset(seed=11)["observation"] == make_word_problem(11)[0]


# --------------------------------------------------------------------------- over HTTP


def test_games_over_http():
    with running_env_server(GuessNumberEnv, env_kwargs={"max_attempts": 10}) as urls:
        with httpx.Client(base_url=urls[0], timeout=5.0, trust_env=False) as client:
            reset = client.post("/reset", json={"instance_id": "g", "seed": 3}).json()
            assert "10 attempts" in reset["observation"] and reset["system_prompt"]
            low, high = 1, 100
            for _ in range(10):
                guess = (low + high) // 2
                step = client.post("/step", json={"instance_id": "g", "action": str(guess)}).json()
                if step["done"]:
                    break
                low, high = (low, guess - 1) if step["observation"].startswith("Too high") else (guess + 1, high)
            assert step["observation"].startswith("Correct!") and step["reward"] == 1.0
            assert step["info"]["secret"] == guess

    with running_env_server(CalculatorEnv) as urls:
        with httpx.Client(base_url=urls[0], timeout=5.0, trust_env=False) as client:
            client.post("/reset", json={"instance_id": "c", "question": "6 boxes of 7?", "answer": "42"})
            step = client.post("/step", json={"instance_id": "c", "action": "<tool_call>calc(6*7)</tool_call>"})
            assert step.json()["observation"] == "<tool_response>42</tool_response>"
            assert client.post("/step", json={"instance_id": "c", "action": "#### 42"}).json()["reward"] == 1.0


def test_module_entry_serves_a_builtin_env():
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "opentinker.environments.games", "arithmetic", "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    try:
        url = None
        deadline = time.monotonic() + 30
        while url is None and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            match = re.search(r"listening on (http://127\.0\.0\.1:\d+)", line)
            url = match.group(1) if match else None
        assert url, "no URL printed"
        health = httpx.get(f"{url}/health", timeout=5.0, trust_env=False).json()
        assert health == {"status": "ok", "instances": 0, "env": "ArithmeticEnv", "jobs": {}}
        reset = httpx.post(f"{url}/reset", json={"instance_id": "m", "a": 2, "b": 3}, trust_env=False).json()
        assert reset["observation"] == "What is 2 + 3?"
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()


def test_the_digit_sum_env_shows_a_picture_each_round_over_the_protocol():
    import httpx

    from opentinker.environments.digit_sum import DigitSumProblem

    with running_env_server(DigitSumEnv, env_kwargs={"rounds": 2}) as urls:
        reset = httpx.post(f"{urls[0]}/reset", json={"instance_id": "a", "seed": 3}, trust_env=False).json()
        assert reset["observation"].startswith("What is the sum") and len(reset["images"]) == 1
        assert reset["images"][0].startswith("data:image/png;base64,")
        env = DigitSumEnv(rounds=2)
        env.reset(seed=3)
        first: DigitSumProblem = env.problems[0]
        step = httpx.post(f"{urls[0]}/step", json={"instance_id": "a", "action": first.answer, "step": 0},
                          trust_env=False).json()
        assert step["reward"] == 1.0 and not step["done"] and len(step["images"]) == 1
        assert step["observation"].startswith("Right.")
        last = httpx.post(f"{urls[0]}/step", json={"instance_id": "a", "action": "-1", "step": 1},
                          trust_env=False).json()
        assert last["done"] and last["reward"] == 0.0 and "images" not in last
