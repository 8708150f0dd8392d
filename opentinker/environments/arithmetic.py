"""Synthetic arithmetic: the task the embedded tiny model is warmed up and trained on.

Pure Python (no torch) so the client, the engine and the tests share one definition of
the prompt wording and of what counts as a correct answer.
"""

from __future__ import annotations

import random
import re
import zlib
from dataclasses import dataclass
from typing import Literal

QUESTION_TEMPLATE = "What is {a} + {b}?"
_FIRST_INTEGER = re.compile(r"-?\d+")


@dataclass(frozen=True)
class ArithmeticProblem:
    """One addition problem; ``answer`` is the exact integer sum as text."""

    a: int
    b: int

    @property
    def question(self) -> str:
        return QUESTION_TEMPLATE.format(a=self.a, b=self.b)

    @property
    def answer(self) -> str:
        return str(self.a + self.b)

    def messages(self) -> list[dict[str, str]]:
        """The chat the model sees: a single user turn, no system prompt."""
        return [{"role": "user", "content": self.question}]

    def as_row(self) -> dict:
        """A dataset row in the seed's format (prompt messages + reward_model ground truth)."""
        return {
            "prompt": self.messages(),
            "reward_model": {"ground_truth": self.answer},
            "data_source": "arithmetic",
        }


Split = Literal["train", "heldout"]


def is_heldout(problem: ArithmeticProblem) -> bool:
    """A fixed ~10% of all problems is held out, so evaluation never sees a trained problem."""
    return zlib.crc32(f"{problem.a}+{problem.b}".encode()) % 10 == 0


def make_problems(
    count: int, seed: int, split: Split = "train", max_operand: int = 99
) -> list[ArithmeticProblem]:
    """``count`` problems of ``split``, drawn deterministically from ``seed``."""
    rng = random.Random(seed)
    want_heldout = split == "heldout"
    problems: list[ArithmeticProblem] = []
    while len(problems) < count:
        problem = ArithmeticProblem(rng.randint(0, max_operand), rng.randint(0, max_operand))
        if is_heldout(problem) == want_heldout:
            problems.append(problem)
    return problems


def extract_answer(response: str) -> str | None:
    """The first integer in the response, or None when there is none."""
    match = _FIRST_INTEGER.search(response)
    return match.group(0) if match else None


_INTEGER = re.compile(r"\s*[-+]?\d{1,30}\s*")


def row_problem(row: dict) -> str | None:
    """Why ``score_answer`` cannot score a dataset row of this task, or None: the row needs
    ``reward_model.ground_truth``, an integer (or its text)."""
    reward_model = row.get("reward_model")
    if not isinstance(reward_model, dict) or "ground_truth" not in reward_model:
        return "needs 'reward_model': {'ground_truth': <the integer answer>} (the task scores by it)"
    truth = reward_model["ground_truth"]
    if isinstance(truth, bool) or not (isinstance(truth, int) or isinstance(truth, str) and _INTEGER.fullmatch(truth)):
        return f"'reward_model.ground_truth' must be an integer or its text, got {type(truth).__name__}"
    return None


def score_answer(response: str, ground_truth: str) -> float:
    """1.0 when the first integer of the response equals the ground truth, else 0.0."""
    answer = extract_answer(response)
    return 1.0 if answer is not None and int(answer) == int(ground_truth) else 0.0


# Seeds are kept apart so that held-out problems never share a stream with training ones.
TRAIN_SEED = 1
HELDOUT_SEED = 2
SFT_SEED = 3
