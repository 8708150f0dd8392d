"""The word-problems task (:mod:`opentinker.environments.word_problems`) as a single-turn env."""

from __future__ import annotations

import random
from collections.abc import Iterable
from decimal import Decimal

from opentinker.environments.arithmetic import Split
from opentinker.environments.word_problems import (
    WordProblem,
    extract_final_number,
    make_problems,
    parse_steps,
    score_answer,
)


def _as_text(number: Decimal | None) -> str | None:
    """A Decimal for ``info`` (JSON has no Decimal): "13.0" reads back as "13"."""
    if number is None:
        return None
    return str(int(number)) if number == number.to_integral_value() else str(number)


class WordProblemsEnv:
    """One word problem per episode; the first step is graded and ends it.

    Same wording and grading as the offline task: the observation is
    :attr:`WordProblem.prompt` and the reward is :func:`score_answer` with ``format_weight``.
    ``steps`` picks one-operation problems (1), two-operation ones (2) or both ("1,2").
    """

    def __init__(self, split: Split = "train", format_weight: float = 0.0, steps: int | str | Iterable[int] = "1,2"):
        if split not in ("train", "heldout"):
            raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
        if not 0.0 <= float(format_weight) <= 1.0:
            raise ValueError(f"format_weight must be in [0, 1], got {format_weight}")
        self.split = split
        self.format_weight = float(format_weight)
        self.steps = parse_steps(steps)
        self.problem: WordProblem | None = None
        self.done = False

    def reset(self, seed: int | None = None, steps: int | str | Iterable[int] | None = None) -> dict:
        """``seed`` draws a problem reproducibly (else at random); ``steps`` overrides the
        constructor's choice for this episode."""
        draw_seed = seed if seed is not None else random.randrange(2**32)
        kinds = self.steps if steps is None else parse_steps(steps)
        self.problem = make_problems(1, seed=draw_seed, split=self.split, steps=kinds)[0]
        self.done = False
        return {
            "observation": self.problem.prompt,
            "system_prompt": None,
            "info": {"operands": list(self.problem.operands), "ops": list(self.problem.ops)},
        }

    def step(self, action: str) -> tuple[str, float, bool, dict]:
        if self.problem is None:
            raise RuntimeError("call reset() before step()")
        answer = str(self.problem.answer)
        info = {"answer": answer, "extracted": _as_text(extract_final_number(action or ""))}
        if self.done:
            return "The episode is over.", 0.0, True, info
        self.done = True
        reward = score_answer(action or "", answer, self.format_weight)
        correct = score_answer(action or "", answer) == 1.0
        observation = "Correct." if correct else f"Incorrect, the answer is {answer}."
        return observation, reward, True, info
