"""Digit sums as an environment with pictures (for a vision-language model): each round shows a
picture of two digits and asks their sum; the answer is graded and the next round's picture
follows in the same turn, until ``rounds`` rounds are played. Reward 1 per right sum.

    python -m opentinker.environments.games digit_sum --port 8011
"""

from __future__ import annotations

import random

from opentinker.environments.digit_sum import QUESTION, DigitSumProblem, score

SYSTEM_PROMPT = "Answer with just the number."


class DigitSumEnv:
    def __init__(self, rounds: int = 2, variants: int = 1000):
        if rounds < 1:
            raise ValueError(f"rounds must be >= 1, got {rounds}")
        self.rounds, self.variants = int(rounds), int(variants)
        self.problems: list[DigitSumProblem] = []
        self.played = 0

    def _observation(self, text: str) -> dict:
        return {"text": text, "images": [self.problems[self.played].png()]}

    def reset(self, seed: int | None = None) -> dict:
        rng = random.Random(seed)
        self.problems = [DigitSumProblem(rng.randint(0, 9), rng.randint(0, 9), rng.randrange(self.variants))
                         for _ in range(self.rounds)]
        self.played = 0
        return {"observation": self._observation(QUESTION), "system_prompt": SYSTEM_PROMPT,
                "info": {"rounds": self.rounds}}

    def step(self, action: str):
        reward = score(action, self.problems[self.played].answer)
        self.played += 1
        info = {"round": self.played, "right": bool(reward)}
        if self.played >= self.rounds:
            return "", reward, True, info
        verdict = "Right." if reward else f"No, it was {self.problems[self.played - 1].answer}."
        return self._observation(f"{verdict} {QUESTION}"), reward, False, info
