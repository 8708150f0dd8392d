"""The nouns of one training step, in the order a step makes them.

1. :class:`Prompt` (``engine/data.py``): one row of the dataset, its chat messages as token ids
   and what scores it (the ground truth, or the interaction that plays it).
2. :class:`Trajectory` (``engine/agent_loop.py``): one sample of a prompt: the response's token
   ids with a ``response_mask`` (1 = the model's own token, 0 = an environment's), the rollout
   engine's logprobs, the reward, and whether it is ``excluded`` (an env error of its own).
3. :class:`StepSamples`: the step's samples, n per prompt in prompt-major order, with their
   texts and which interaction made each; ``trainable()`` is what goes into the loss.
4. :class:`TokenBatch` (``engine/batch.py``): the trainable samples as ragged prompt and
   response ids plus [B, R] tensors aligned to the responses (``response_mask``,
   ``old_logprobs``, ``ref_logprobs``, ``advantages``, ...), which the update reads.
5. :class:`Timer`: where the step's seconds went, per phase (``timing_s/<phase>``).

How ``RLTrainer.step`` (``trainer.py``) passes them along::

    timer = Timer()
    samples, outage, version = self.rollouts.rollout(pushed, timer, step)  # StepSamples
    kept = samples.keep(samples.trainable())        # left out before advantages: groups stay fair
    batch = to_batch(kept)                          # TokenBatch (update_stage.py)
    metrics = self.update.run(batch, kept, timer, step)   # old/ref logprobs, advantages, the update
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from opentinker.engine.agent_loop import Trajectory
from opentinker.engine.batch import TokenBatch
from opentinker.engine.data import Prompt

__all__ = ["Prompt", "StepSamples", "Timer", "TokenBatch", "Trajectory"]


@dataclass
class StepSamples:
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

    def keep(self, indices: Sequence[int]) -> StepSamples:
        return StepSamples(*([field[i] for i in indices] for field in
                             (self.prompts, self.trajectories, self.texts, self.interaction_names)))


class Timer:
    """Seconds per phase of a step (``with timer.phase("rollout"): ...``)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def phase(self, name: str):
        start = time.perf_counter()
        yield
        self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start
