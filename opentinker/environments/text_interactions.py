"""In-process interactions that grade text answers against a ground truth (no server needed).

- :class:`SimpleTextEnvironment`: any scorer from :mod:`opentinker.environments.scoring`,
  one attempt by default, optional "try again" turns.
- :class:`Gsm8kInteraction`: GSM8K answers (``#### <number>``), with feedback turns.

The ground truth comes from the dataset row's ``interaction_kwargs`` (``ground_truth``),
passed to :meth:`start_interaction`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from opentinker.environments.interaction import Interaction, last_assistant_content
from opentinker.environments.scoring import extract_gsm8k_answer, get_scorer, normalize_number

__all__ = ["Gsm8kInteraction", "SimpleTextEnvironment"]


@dataclass
class _Attempts:
    truth: str
    turns: int = 0
    solved: bool = False
    done: bool = False


def _truth_from(kwargs: dict[str, Any], who: str) -> str:
    truth = kwargs.get("ground_truth")
    if truth is None:
        raise ValueError(
            f"{who} needs a 'ground_truth' in the interaction kwargs "
            "(extra_info.interaction_kwargs.ground_truth of the dataset row)"
        )
    return str(truth)


class _GradedInteraction(Interaction):
    """Shared bookkeeping: one ground truth and an attempt counter per instance."""

    def __init__(self, config: dict[str, Any] | None = None):
        super().__init__(config)
        self._state: dict[str, _Attempts] = {}

    @classmethod
    def row_problem(cls, kwargs: dict[str, Any]) -> str | None:
        """A row must carry the ground truth this interaction grades against (checked by the
        server before it accepts the row, so a bad row never reaches a running job)."""
        truth = kwargs.get("ground_truth")
        if truth is None:
            return "needs 'extra_info.interaction_kwargs.ground_truth'"
        if isinstance(truth, bool) or not isinstance(truth, (str, int, float)):
            return f"'ground_truth' must be text or a number, got {type(truth).__name__}"
        return None

    def _normalise_truth(self, truth: str) -> str:
        return truth

    async def start_interaction(self, instance_id: str | None = None, **kwargs: Any) -> str:
        truth = self._normalise_truth(_truth_from(kwargs, type(self).__name__))
        instance_id = await super().start_interaction(instance_id)
        self._state[instance_id] = _Attempts(truth=truth)
        return instance_id


class SimpleTextEnvironment(_GradedInteraction):
    """Grade the model's answer with a named scorer.

    Config keys:
        scorer: "exact" (default) | "contains" | "regex" | "math".
        pattern: the regex of the "regex" scorer (its first group is the answer).
        max_attempts: answers the model may give, 1 (a single attempt).
        feedback: the user turn after a wrong answer with attempts left.
        correct_message: the closing turn after a right answer, "Correct.".
        final_message: the closing turn after the last wrong answer.
        correct_reward / incorrect_reward: per-answer rewards, 1.0 / 0.0.

    A rewarded answer counts as correct when the scorer returns at least 0.5.
    ``calculate_score`` is the sum of the per-answer rewards.
    """

    config_keys = frozenset({"scorer", "pattern", "max_attempts", "feedback", "correct_message", "final_message",
                             "correct_reward", "incorrect_reward"})

    def __init__(self, config: dict[str, Any] | None = None):
        super().__init__(config)
        cfg = self.config
        self.scorer_name = str(cfg.get("scorer", "exact"))
        options = {"pattern": cfg["pattern"]} if self.scorer_name == "regex" and "pattern" in cfg else {}
        self.scorer = get_scorer(self.scorer_name, **options)
        self.max_attempts = int(cfg.get("max_attempts", 1))
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {self.max_attempts}")
        self.feedback = str(cfg.get("feedback", "That is not correct. Try again."))
        self.correct_message = str(cfg.get("correct_message", "Correct."))
        self.final_message = str(cfg.get("final_message", "That is not correct."))
        self.correct_reward = float(cfg.get("correct_reward", 1.0))
        self.incorrect_reward = float(cfg.get("incorrect_reward", 0.0))

    async def generate_response(
        self, instance_id: str, messages: list[dict[str, str]], **kwargs: Any
    ) -> tuple[bool, str, float, dict[str, Any]]:
        state = _get(self._state, instance_id, self.name)
        if state.done:
            return True, "", 0.0, {"attempt": state.turns, "correct": state.solved, "already_done": True}
        answer = last_assistant_content(messages)
        state.turns += 1
        correct = self.scorer(answer, state.truth) >= 0.5
        info: dict[str, Any] = {"attempt": state.turns, "correct": correct}
        if correct:
            state.solved = state.done = True
            self._record_reward(instance_id, self.correct_reward)
            return True, self.correct_message, self.correct_reward, info
        self._record_reward(instance_id, self.incorrect_reward)
        if state.turns < self.max_attempts:
            return False, self.feedback, self.incorrect_reward, info
        state.done = True
        return True, self.final_message, self.incorrect_reward, info

    async def finalize_interaction(self, instance_id: str, **kwargs: Any) -> None:
        self._state.pop(instance_id, None)
        await super().finalize_interaction(instance_id)


class Gsm8kInteraction(_GradedInteraction):
    """GSM8K with feedback: the model answers, ending with ``#### <number>``.

    Config keys:
        extraction: "strict" (default; needs ``#### <number>``) or "flexible" (the last
            number of the answer).
        max_turns: answers the model may give, 3.
        feedback: the user turn after a wrong answer with turns left.

    A right answer ends the episode with reward 1.0; a wrong one gets 0.0 and, while
    turns are left, the feedback turn. ``calculate_score`` is 1.0 if the problem was
    solved in any turn, else 0.0. The ground truth may be a number or a full GSM8K
    solution ending in ``#### <number>``.
    """

    config_keys = frozenset({"extraction", "max_turns", "feedback", "correct_message", "final_message"})

    def __init__(self, config: dict[str, Any] | None = None):
        super().__init__(config)
        cfg = self.config
        self.extraction = str(cfg.get("extraction", "strict"))
        if self.extraction not in ("strict", "flexible"):
            raise ValueError(f"extraction must be 'strict' or 'flexible', got {self.extraction!r}")
        self.max_turns = int(cfg.get("max_turns", 3))
        if self.max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {self.max_turns}")
        self.feedback = str(
            cfg.get("feedback", "Your answer is wrong. Think again and end with '#### <number>'.")
        )
        self.correct_message = str(cfg.get("correct_message", "Your answer is correct!"))
        self.final_message = str(cfg.get("final_message", "Your answer is wrong."))

    @staticmethod
    def _normalise_truth(truth: str) -> str:
        if "####" in truth:
            extracted = extract_gsm8k_answer(truth, "strict")
            if extracted is not None:
                return extracted
        normalised = normalize_number(truth)
        if normalised is None:
            raise ValueError(f"GSM8K ground truth must be a number, got {truth!r}")
        return normalised

    async def generate_response(
        self, instance_id: str, messages: list[dict[str, str]], **kwargs: Any
    ) -> tuple[bool, str, float, dict[str, Any]]:
        state = _get(self._state, instance_id, self.name)
        if state.done:
            return True, "", 0.0, {"turn": state.turns, "correct": state.solved, "already_done": True}
        state.turns += 1
        extracted = extract_gsm8k_answer(last_assistant_content(messages), self.extraction)
        correct = extracted is not None and extracted == state.truth
        info: dict[str, Any] = {"turn": state.turns, "extracted": extracted, "correct": correct}
        if correct:
            state.solved = state.done = True
            return True, self.correct_message, 1.0, info
        if state.turns < self.max_turns:
            return False, self.feedback, 0.0, info
        state.done = True
        return True, self.final_message, 0.0, info

    async def calculate_score(self, instance_id: str, **kwargs: Any) -> float:
        state = self._state.get(instance_id)
        return 1.0 if state is not None and state.solved else 0.0

    async def finalize_interaction(self, instance_id: str, **kwargs: Any) -> None:
        self._state.pop(instance_id, None)
        await super().finalize_interaction(instance_id)


def _get(states: dict[str, _Attempts], instance_id: str, name: str) -> _Attempts:
    try:
        return states[instance_id]
    except KeyError:
        raise KeyError(
            f"unknown instance {instance_id!r} of interaction {name!r}: "
            "start_interaction was not called or the instance was finalized"
        ) from None
