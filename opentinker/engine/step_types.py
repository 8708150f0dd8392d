"""What a training step passes between its stages: the step's samples (:class:`Rollout`) and
where its time went (:class:`Timer`)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from opentinker.engine.agent_loop import Trajectory
from opentinker.engine.data import Prompt

__all__ = ["Rollout", "Timer"]


@dataclass
class Rollout:
    """The samples of one step, in prompt-major order (n consecutive samples per prompt)."""

    prompts: list[Prompt]  # one entry per sample
    trajectories: list[Trajectory]
    texts: list[str]  # the model's text of each sample (all its turns)
    interaction_names: list[str | None]  # which environment produced each sample

    @property
    def rewards(self) -> list[float]:
        return [t.reward for t in self.trajectories]

    def trainable(self) -> list[int]:
        """Indices of the samples that go into the loss: not excluded, and the model spoke."""
        return [i for i, t in enumerate(self.trajectories) if not t.excluded and t.response_ids]

    def keep(self, indices: Sequence[int]) -> "Rollout":
        return Rollout(*([field[i] for i in indices] for field in
                         (self.prompts, self.trajectories, self.texts, self.interaction_names)))


class Timer:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def phase(self, name: str):
        start = time.perf_counter()
        yield
        self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start
