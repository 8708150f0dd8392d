"""The word-problems task: generation, splits, grading, the env (directly and over HTTP)."""

from __future__ import annotations

import random
import re
from decimal import Decimal

import httpx
import pytest

from opentinker.environments import arithmetic
from opentinker.environments.games import BUILTIN_ENVIRONMENTS, WordProblemsEnv
from opentinker.environments.server import running_env_server
from opentinker.environments.word_problems import (
    ANSWER_INSTRUCTION,
    HELDOUT_SEED,
    TRAIN_SEED,
    WordProblem,
    draw_problem,
    extract_final_number,
    is_heldout,
    make_problems,
    parse_steps,
    row_problem,
    score_answer,
)

pytestmark = pytest.mark.timeout(60)


def solve_from_text(problem: WordProblem) -> int:
    """The answer recomputed from the numbers written in the question, in order, with the
    problem's ops applied left to right; fails on an inexact division or a negative result."""
    numbers = [int(n) for n in re.findall(r"\d+", problem.question)]
    assert len(numbers) == len(problem.ops) + 1, problem.question
    value = numbers[0]
    for op, number in zip(problem.ops, numbers[1:]):
        if op == "/":
            assert value % number == 0, problem.question
        value = {"+": value + number, "-": value - number, "*": value * number, "/": value // number}[op]
        assert value >= 0, problem.question
    return value


# --------------------------------------------------------------------------- generation


def test_every_stated_answer_is_correct_and_small():
    problems = make_problems(1500, seed=0) + make_problems(500, seed=1, split="heldout")
    for problem in problems:
        assert solve_from_text(problem) == problem.answer
        assert [int(n) for n in re.findall(r"\d+", problem.question)] == list(problem.operands)
        assert problem.answer >= 0
        # operands are 2..20, but a one-step division states its dividend (a product, <= 200)
        first_high = 200 if problem.ops == ("/",) else 20
        assert 2 <= problem.operands[0] <= first_high
        assert all(2 <= n <= 20 for n in problem.operands[1:])
        for i, op in enumerate(problem.ops):
            if op == "*":
                assert problem.operands[i] * problem.operands[i + 1] <= 200
        assert problem.question.endswith("?") and ANSWER_INSTRUCTION not in problem.question
        assert problem.prompt == f"{problem.question} {ANSWER_INSTRUCTION}"
    # every kind of problem is generated
    assert {p.ops for p in problems} == {
        ("+",), ("-",), ("*",), ("/",), ("+", "-"), ("-", "+"), ("*", "+"), ("*", "-"), ("+", "/"),
    }


def test_generation_is_deterministic_from_the_seed():
    assert make_problems(50, seed=7) == make_problems(50, seed=7)
    assert make_problems(50, seed=7) != make_problems(50, seed=8)
    assert make_problems(20, seed=7, split="heldout") == make_problems(20, seed=7, split="heldout")
    assert len({p.question for p in make_problems(200, seed=3)}) > 190
    assert TRAIN_SEED != HELDOUT_SEED


def test_steps_choose_one_two_or_an_even_mix():
    assert {p.steps for p in make_problems(100, seed=0, steps=1)} == {1}
    assert {p.steps for p in make_problems(100, seed=0, steps=(2,))} == {2}
    mixed = make_problems(101, seed=0, steps="1,2")
    counts = [sum(p.steps == s for p in mixed) for s in (1, 2)]
    assert sorted(counts) == [50, 51]
    # a single draw is not always of the same kind
    assert {make_problems(1, seed=s)[0].steps for s in range(20)} == {1, 2}
    assert parse_steps("2, 1") == parse_steps([1, 2, 2]) == (1, 2)
    for bad in ("", "3", "1,x", 0, (), [1, 3], True):
        with pytest.raises(ValueError, match="steps"):
            parse_steps(bad)
    with pytest.raises(ValueError, match="split"):
        make_problems(1, seed=0, split="test")


def test_heldout_split_is_a_disjoint_tenth():
    train = make_problems(3000, seed=TRAIN_SEED)
    heldout = make_problems(1000, seed=HELDOUT_SEED, split="heldout")
    assert not any(is_heldout(p) for p in train) and all(is_heldout(p) for p in heldout)
    assert not {p.question for p in train} & {p.question for p in heldout}
    rng = random.Random(0)
    drawn = [draw_problem(rng, 1 + i % 2) for i in range(5000)]
    assert 0.07 < sum(map(is_heldout, drawn)) / len(drawn) < 0.13


def test_rows_have_the_arithmetic_format():
    problem = make_problems(1, seed=5)[0]
    row = problem.as_row()
    assert row == {
        "prompt": [{"role": "user", "content": problem.prompt}],
        "reward_model": {"ground_truth": str(problem.answer)},
        "data_source": "word_problems",
    }
    assert row_problem(row) is None
    assert row_problem is arithmetic.row_problem
    assert "ground_truth" in row_problem({"prompt": row["prompt"], "reward_model": {"ground_truth": "ten"}})


# --------------------------------------------------------------------------- grading


@pytest.mark.parametrize(
    "response, expected",
    [
        ("First 3 + 4 = 7, then 7 * 2 = 14. The answer is 14.", 14),
        ("They have 1,200 marbles", 1200),
        ("12,345,678", 12345678),
        ("13.", 13),
        ("13.0", 13),
        ("It is -5 now", -5),
        ("8-3", 3),
        ("**42**", 42),
    ],
)
def test_extract_final_number(response, expected):
    assert extract_final_number(response) == expected


def test_extract_final_number_keeps_fractions_and_none():
    assert extract_final_number("13.5") == Decimal("13.5") != 13
    assert extract_final_number("no number here") is None
    assert extract_final_number("") is None


def test_score_answer_exact():
    assert score_answer("The answer is 13.", "13") == 1.0
    assert score_answer("13 apples", 13) == 1.0
    assert score_answer("13.0", "13") == 1.0
    assert score_answer("13.5", "13") == 0.0
    assert score_answer("13 plus 2 is 15", "13") == 0.0  # the last number counts
    assert score_answer("I don't know", "13") == 0.0


def test_score_answer_with_format_weight():
    assert score_answer("The answer is 13.", "13", format_weight=0.2) == 1.0
    assert score_answer("13 apples in total", "13", format_weight=0.2) == pytest.approx(0.8)
    assert score_answer("The answer is 12.", "13", format_weight=0.2) == pytest.approx(0.2)
    assert score_answer("no idea", "13", format_weight=0.2) == 0.0
    assert score_answer("12 apples", "13", format_weight=0.2) == 0.0
    for bad in (-0.1, 1.5):
        with pytest.raises(ValueError, match="format_weight"):
            score_answer("13", "13", format_weight=bad)


# --------------------------------------------------------------------------- the env


def test_env_is_registered_and_grades_one_step():
    assert BUILTIN_ENVIRONMENTS["word_problems"] is WordProblemsEnv
    env = WordProblemsEnv()
    expected = make_problems(1, seed=9)[0]
    first = env.reset(seed=9)
    assert first == {
        "observation": expected.prompt,
        "system_prompt": None,
        "info": {"operands": list(expected.operands), "ops": list(expected.ops)},
    }
    observation, reward, done, info = env.step(f"So it is {expected.answer}.")
    assert (observation, reward, done) == ("Correct.", 1.0, True)
    assert info == {"answer": str(expected.answer), "extracted": str(expected.answer)}
    assert env.step(str(expected.answer))[:3] == ("The episode is over.", 0.0, True)

    env.reset(seed=9)
    observation, reward, done, info = env.step(f"{expected.answer + 1}.0")
    assert (observation, reward, done) == (f"Incorrect, the answer is {expected.answer}.", 0.0, True)
    assert info["extracted"] == str(expected.answer + 1)


def test_env_options():
    env = WordProblemsEnv(split="heldout", format_weight=0.5, steps=2)
    for seed in range(10):
        first = env.reset(seed=seed)
        assert len(first["info"]["ops"]) == 2 and is_heldout(env.problem)
    answer = env.problem.answer
    assert env.step(f"{answer} items")[:2] == ("Correct.", 0.5)
    env.reset(seed=0, steps="1")
    assert len(env.problem.ops) == 1
    with pytest.raises(RuntimeError):
        WordProblemsEnv().step("1")
    for field, value in (("split", "dev"), ("format_weight", 2), ("steps", "3")):
        with pytest.raises(ValueError, match=field):
            WordProblemsEnv(**{field: value})


def test_env_over_http():
    with running_env_server(WordProblemsEnv, env_kwargs={"steps": [2]}) as urls:
        with httpx.Client(base_url=urls[0], timeout=5.0, trust_env=False) as client:
            reset = client.post("/reset", json={"instance_id": "w", "seed": 4}).json()
            assert reset["observation"].endswith(ANSWER_INSTRUCTION) and len(reset["info"]["ops"]) == 2
            numbers = [int(n) for n in re.findall(r"\d+", reset["observation"])]
            assert numbers == reset["info"]["operands"]
            answer = make_problems(1, seed=4, steps=2)[0].answer
            step = client.post("/step", json={"instance_id": "w", "action": f"{answer}"}).json()
            assert (step["reward"], step["done"], step["info"]["answer"]) == (1.0, True, str(answer))
            reset = client.post("/reset", json={"instance_id": "w", "seed": 4, "steps": 1}).json()
            assert len(reset["info"]["ops"]) == 1


def test_module_imports_without_heavy_packages(run_without_heavy_packages):
    result = run_without_heavy_packages(
        "from opentinker.environments.word_problems import make_problems\n"
        "from opentinker.environments.games import WordProblemsEnv\n"
        "print(len(make_problems(3, seed=1)))\n"
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "3"


# --------------------------------------------------------------------------- the built-in task


def test_builtin_task_rows_pass_the_servers_row_check():
    from opentinker.engine.data import builtin_task
    from opentinker.server.validation import RowRules
    from opentinker.server.validation import row_problem as server_row_problem

    train, val, reward = builtin_task("word_problems", train_count=200, val_count=20)
    assert len(train) == 200 and len(val) == 20
    assert [r["prompt"] for r in train] == [p.as_row()["prompt"] for p in make_problems(200, TRAIN_SEED)]
    assert not {r["prompt"][0]["content"] for r in train} & {r["prompt"][0]["content"] for r in val}
    rules = RowRules(max_prompt_length=512, task="word_problems")
    assert all(server_row_problem(row, rules) is None for row in train + val)
    bad = {**train[0], "reward_model": {"ground_truth": "12.5"}}
    assert "ground_truth" in server_row_problem(bad, rules)
    truth = train[0]["reward_model"]["ground_truth"]
    assert reward(f"The answer is {truth}", train[0]) == 1.0
    assert reward(f"{truth} apples", train[0]) == 1.0  # the task rewards correctness only
    assert reward(f"{int(truth) + 1}", train[0]) == 0.0
