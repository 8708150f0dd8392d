"""Warnings about a step's samples that a user should hear while it happens, not find later.

- **Lost episodes**: samples that are env errors of the env's own (an error reply, a malformed
  or over-deep answer, a call past the interaction's deadline). They are left out of the step
  (the outage rule redoes a step for anything else), so the step trains on fewer samples than
  asked: said at every step it happens, with the count per endpoint, how many ran past their
  interaction's ``timeout_s``, and the last error.
- **Constant rewards**: every trained sample of the step got the same reward, so GRPO-style
  advantages are all zero and the step teaches nothing.
- **Identical prompts**: several distinct prompts of the step, and every one the same text (an
  env that ignores the seed it is reset with writes the same first observation every time).

The last two can hold for many steps in a row (a task too hard at first): each is said when it
starts, then at most every ``REPEAT_EVERY`` steps while it lasts, and once when it ends.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from opentinker.engine.ppo.agent_runner import env_endpoint_of
from opentinker.engine.ppo.step import StepSamples
from opentinker.engine.vision import prompt_key
from opentinker.images import message_images

__all__ = ["StepWarnings"]

REPEAT_EVERY = 20  # steps between two warnings about the same lasting condition
_MAX_ERROR_CHARS = 300


class _Condition:
    """One condition that may last for steps: when to speak about it."""

    def __init__(self) -> None:
        self.since: int | None = None  # the step it began at (None: it does not hold)
        self.said_at = 0

    def update(self, holds: bool, step: int) -> str | None:
        """"began", "lasts" or "ended" when the step should say so, else None."""
        if not holds:
            if self.since is None:
                return None
            self.since = None
            return "ended"
        if self.since is None:
            self.since = self.said_at = step
            return "began"
        if step - self.said_at >= REPEAT_EVERY:
            self.said_at = step
            return "lasts"
        return None


class StepWarnings:
    """Looks at each step's samples and says what went wrong through ``warn``."""

    def __init__(self, warn: Callable[[str], None]):
        self.warn = warn
        self._constant = _Condition()
        self._identical = _Condition()

    def check(self, step: int, rollout: StepSamples) -> None:
        self._lost_episodes(step, rollout)
        self._constant_rewards(step, rollout)
        self._identical_prompts(step, rollout)

    def _lost_episodes(self, step: int, rollout: StepSamples) -> None:
        failed = [t for t in rollout.trajectories if t.stop_reason == "env_error"]
        if not failed:
            return
        kept = "kept with env_error_reward" if not failed[0].excluded else "left out of the step"
        where = Counter(env_endpoint_of(str(t.info.get("error_url") or "an env")) for t in failed)
        timed_out = sum(bool(t.info.get("env_timeout")) for t in failed)
        last = str(failed[-1].info.get("error") or "no error text")
        if len(last) > _MAX_ERROR_CHARS:
            last = last[:_MAX_ERROR_CHARS] + "..."
        self.warn(f"step {step}: {len(failed)} of {len(rollout.trajectories)} episodes ended in an error of the env's "
                  f"own and are {kept} ({', '.join(f'{url} x{count}' for url, count in where.most_common(5))}"
                  f"{f'; {timed_out} ran past their interaction timeout_s' if timed_out else ''}); last error: {last}")

    def _constant_rewards(self, step: int, rollout: StepSamples) -> None:
        rewards = [rollout.trajectories[i].reward for i in rollout.trainable()]
        value = rewards[0] if rewards else None
        said = self._constant.update(len(rewards) > 1 and all(r == value for r in rewards), step)
        if said == "began":
            self.warn(f"step {step}: every reward is {value:g} ({len(rewards)} samples): advantages are zero and the "
                      "step teaches nothing; check the reward function or the env's rewards")
        elif said == "lasts":
            self.warn(f"step {step}: every reward has been the same in each step since step {self._constant.since}")
        elif said == "ended":
            self.warn(f"step {step}: rewards differ again")

    def _identical_prompts(self, step: int, rollout: StepSamples) -> None:
        by_uid = {prompt.uid: i for i, prompt in enumerate(rollout.prompts)}
        # A prompt with pictures is told apart by them too (the same question on other pictures).
        texts = {(tuple(rollout.trajectories[i].prompt_ids), prompt_key(rollout.prompts[i].prompt_ids)[1],
                  _prompt_pictures(rollout.trajectories[i].messages))
                 for i in by_uid.values() if rollout.trajectories[i].prompt_ids}
        said = self._identical.update(len(by_uid) > 1 and len(texts) == 1, step)
        if said == "began":
            self.warn(f"step {step}: all {len(by_uid)} prompts of the step are the same text; an env that writes the "
                      "prompt should draw it from the seed it is reset with (each prompt gets its own)")
        elif said == "lasts":
            self.warn(f"step {step}: every prompt has been the same text in each step since step "
                      f"{self._identical.since}")
        elif said == "ended":
            self.warn(f"step {step}: prompts differ again")


def _prompt_pictures(messages: list[dict]) -> tuple[str, ...]:
    """The pictures of a conversation's opening turns (before the model's first), as their URLs."""
    opening = []
    for message in messages:
        if message.get("role") == "assistant":
            break
        opening.append(message)
    return tuple(message_images(opening))
