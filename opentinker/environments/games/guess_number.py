"""Guess the number: a data-free multi-turn game.

The env picks a secret integer in ``[low, high]``; each turn the model guesses and hears
"Too high." / "Too low." until it is right or runs out of attempts.

Rewards: 1.0 for the correct guess (ends the episode), 0.0 otherwise. With
``closer_bonus > 0`` a wrong guess that is strictly closer to the secret than every earlier
guess earns that bonus; keep it small (e.g. 0.05) so that solving stays dominant. An action
without a number still uses up an attempt, so every episode ends within ``max_attempts``
steps. Stepping after the episode ended returns reward 0 and ``done=True`` again.
"""

from __future__ import annotations

import random
import re

_FIRST_INTEGER = re.compile(r"-?\d+")

SYSTEM_PROMPT = (
    "You are playing a number guessing game. Each turn, reply with a single integer guess. "
    "You will be told whether your guess is too high or too low."
)


class GuessNumberEnv:
    def __init__(self, low: int = 1, high: int = 100, max_attempts: int = 8, closer_bonus: float = 0.0):
        if low > high:
            raise ValueError(f"low ({low}) must not exceed high ({high})")
        if max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {max_attempts}")
        self.low = int(low)
        self.high = int(high)
        self.max_attempts = int(max_attempts)
        self.closer_bonus = float(closer_bonus)
        self.secret: int | None = None
        self.attempts = 0
        self.done = False
        self._best_distance: int | None = None

    def reset(self, seed: int | None = None, secret: int | None = None) -> dict:
        """Start a game; ``seed`` makes the secret reproducible, ``secret`` fixes it outright."""
        if secret is not None:
            if not self.low <= int(secret) <= self.high:
                raise ValueError(f"secret {secret} is outside [{self.low}, {self.high}]")
            self.secret = int(secret)
        else:
            self.secret = random.Random(seed).randint(self.low, self.high)
        self.attempts = 0
        self.done = False
        self._best_distance = None
        return {
            "observation": (
                f"I am thinking of a number between {self.low} and {self.high}. "
                f"You have {self.max_attempts} attempts. Guess it! Answer with just the number."
            ),
            "system_prompt": SYSTEM_PROMPT,
            "info": {"low": self.low, "high": self.high, "max_attempts": self.max_attempts},
        }

    def _info(self, guess: int | None) -> dict:
        return {
            "secret": self.secret,
            "guess": guess,
            "attempts": self.attempts,
            "attempts_left": self.max_attempts - self.attempts,
        }

    def step(self, action: str) -> tuple[str, float, bool, dict]:
        if self.secret is None:
            raise RuntimeError("call reset() before step()")
        if self.done:
            return "The game is over.", 0.0, True, self._info(None)
        self.attempts += 1
        left = self.max_attempts - self.attempts
        match = _FIRST_INTEGER.search(action or "")
        guess = int(match.group(0)) if match else None

        if guess == self.secret:
            self.done = True
            return f"Correct! The number was {self.secret}.", 1.0, True, self._info(guess)

        reward = 0.0
        if guess is None:
            feedback = "Please answer with a number."
        else:
            feedback = "Too high." if guess > self.secret else "Too low."
            distance = abs(guess - self.secret)
            if self._best_distance is None or distance < self._best_distance:
                if self._best_distance is not None:
                    reward = self.closer_bonus
                self._best_distance = distance
        if left <= 0:
            self.done = True
            return (
                f"{feedback} No attempts left. The number was {self.secret}.",
                0.0,
                True,
                self._info(guess),
            )
        plural = "attempt" if left == 1 else "attempts"
        return f"{feedback} {left} {plural} left.", reward, False, self._info(guess)
