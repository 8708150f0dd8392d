"""The arithmetic task (:mod:`opentinker.environments.arithmetic`) as a single-turn env."""

from __future__ import annotations

import random

from opentinker.environments.arithmetic import (
    ArithmeticProblem,
    Split,
    extract_answer,
    make_problems,
    score_answer,
)


class ArithmeticEnv:
    """One addition question per episode; the first step is graded and ends it.

    Same wording and grading as the offline task: the question is
    :attr:`ArithmeticProblem.question` and the reward is :func:`score_answer`.
    """

    def __init__(self, split: Split = "train", max_operand: int = 99):
        self.split = split
        self.max_operand = int(max_operand)
        self.problem: ArithmeticProblem | None = None
        self.done = False

    def reset(self, seed: int | None = None, a: int | None = None, b: int | None = None) -> dict:
        """``a`` and ``b`` pick the problem; else ``seed`` draws one reproducibly; else random."""
        if (a is None) != (b is None):
            raise ValueError("give both a and b, or neither")
        if a is not None:
            self.problem = ArithmeticProblem(int(a), int(b))
        else:
            draw_seed = seed if seed is not None else random.randrange(2**32)
            self.problem = make_problems(1, seed=draw_seed, split=self.split, max_operand=self.max_operand)[0]
        self.done = False
        return {
            "observation": self.problem.question,
            "system_prompt": None,
            "info": {"a": self.problem.a, "b": self.problem.b},
        }

    def step(self, action: str) -> tuple[str, float, bool, dict]:
        if self.problem is None:
            raise RuntimeError("call reset() before step()")
        answer = self.problem.answer
        info = {"answer": answer, "extracted": extract_answer(action or "")}
        if self.done:
            return "The episode is over.", 0.0, True, info
        self.done = True
        reward = score_answer(action or "", answer)
        observation = "Correct." if reward == 1.0 else f"Incorrect, the answer is {answer}."
        return observation, reward, True, info
