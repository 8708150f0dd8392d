"""Rollouts ahead of the update, with bounded staleness (``async_training.max_staleness``).

Off-policy asynchronous training as verl's one-step-off-policy (k = 1) and fully-async
trainers do it: while step t updates, the rollouts of steps t+1 .. t+k are being generated
with the policy of an earlier step. Here one worker thread runs a FIFO of jobs, each either a
rollout (prompts -> scored samples) or new weights for the rollout engine; the engine itself
computes in another process (a Ray actor for the transformers engine, vLLM's engine core),
so the thread only waits, and the update in the trainer's process runs meanwhile.

Versions: the weights pushed after step s are version s (the initial weights version 0). The
rollout for step j is launched once version j-1-k has been pushed; jobs run in order, so it
samples with a version >= j-1-k and trains at step j, when the policy is version j-1:
staleness <= k. A rollout is never split across versions: weights apply between jobs.
"""

from __future__ import annotations

import collections
import concurrent.futures
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import torch

from opentinker.engine.rollout.base import RolloutEngine, WeightSource, named_tensors

Result = TypeVar("Result")


@dataclass
class LaunchedRollout(Generic[Result]):
    future: concurrent.futures.Future  # -> (result, the version it sampled with)
    loader_state: Any  # where the prompt loader stood before this rollout's prompts were drawn


class RolloutPipeline(Generic[Result]):
    """Keeps the rollouts of the next ``max_staleness + 1`` steps launched.

    ``draw()`` gives a rollout's prompts and the loader position before them (called on the
    trainer's thread, in step order); ``run(prompts)`` produces the rollout (on the worker
    thread)."""

    def __init__(self, engine: RolloutEngine, max_staleness: int, draw: Callable[[], tuple[Any, Any]],
                 run: Callable[[Any], Result]):
        if max_staleness < 1:
            raise ValueError(f"max_staleness must be >= 1 for a pipeline, got {max_staleness}")
        self.engine = engine
        self.max_staleness = max_staleness
        self._draw, self._run = draw, run
        self._worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="async-rollout")
        self._launched: collections.deque[LaunchedRollout[Result]] = collections.deque()
        self.steps_launched = 0  # rollouts launched so far, counted from step 1
        self.pushed_version = 0  # the newest version queued for the engine
        self._engine_version = 0  # the version the engine holds (worker thread only)

    def fill(self, next_step: int) -> None:
        """Launch rollouts up to step ``next_step + max_staleness``, as far as the versions
        pushed allow (step j needs version >= j - 1 - max_staleness)."""
        while (self.steps_launched < next_step + self.max_staleness
               and self.pushed_version >= self.steps_launched - self.max_staleness):
            prompts, loader_state = self._draw()
            future = self._worker.submit(self._rollout_job, prompts)
            self._launched.append(LaunchedRollout(future, loader_state))
            self.steps_launched += 1

    def next(self) -> tuple[Result, int]:
        """The oldest launched rollout (waiting for it) and the version it sampled with."""
        if not self._launched:
            raise RuntimeError("RolloutPipeline.next: no rollout launched (call fill first)")
        return self._launched.popleft().future.result()

    def push_weights(self, version: int, weights: WeightSource | None) -> None:
        """Version ``version`` for the rollouts launched from now on: ``weights`` (copied now,
        applied between jobs), or None when the policy did not change since the last push."""
        snapshot = None if weights is None else {
            name: tensor.detach().clone() for name, tensor in named_tensors(weights)}
        self._worker.submit(self._weights_job, version, snapshot)
        self.pushed_version = version

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` on the worker thread after the jobs queued before it (validation with the
        newest pushed weights; the engine's random state), waiting for its result."""
        return self._worker.submit(fn, *args).result()

    @property
    def oldest_loader_state(self) -> Any:
        """Where the loader stood before the oldest rollout not yet trained on (None: none)."""
        return self._launched[0].loader_state if self._launched else None

    @property
    def in_flight(self) -> int:
        return len(self._launched)

    def close(self) -> None:
        """Drop the rollouts not started; wait for the one running."""
        self._worker.shutdown(wait=True, cancel_futures=True)
        self._launched.clear()

    # -- on the worker thread ----------------------------------------------------------
    def _rollout_job(self, prompts: Any) -> tuple[Result, int]:
        version = self._engine_version
        return self._run(prompts), version

    def _weights_job(self, version: int, snapshot: Mapping[str, torch.Tensor] | None) -> None:
        if snapshot is not None:
            self.engine.update_weights(snapshot)
        self._engine_version = version
