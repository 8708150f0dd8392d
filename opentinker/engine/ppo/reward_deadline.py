"""Reward functions with a deadline: a scorer that hangs costs one sample, never the job.

:class:`DeadlineScorer` scores a step's samples on daemon threads (at most ``workers`` at
once), each call with its own ``timeout_s`` from its start. A call still running at its
deadline is given up: its sample gets no reward (the trainer leaves it out, like a sample whose
env failed, and warns naming the scorer), its thread is abandoned (a daemon: it never holds
up the process's exit). Abandoned threads that never return are bounded: past
``max_abandoned`` of them still running, scoring fails with a clear error instead of piling up
threads. An exception in the scorer is not a timeout: it propagates as before.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

#: Samples whose scorer call timed out get this instead of a reward.
TIMED_OUT = None


class RewardTimeoutError(RuntimeError):
    """Too many reward calls hang: the scorer is broken, not slow."""


class _Call:
    def __init__(self, fn: Callable[..., float], args: tuple):
        self.done = threading.Event()
        self.value: Any = None
        self.error: BaseException | None = None
        self.started = 0.0
        self._fn, self._args = fn, args

    def run(self) -> None:
        try:
            self.value = self._fn(*self._args)
        except BaseException as error:  # noqa: BLE001 - handed to the caller
            self.error = error
        finally:
            self.done.set()


class DeadlineScorer:
    """``score(args_list)``: ``fn(*args)`` for each args, as floats, :data:`TIMED_OUT` where a
    call ran past ``timeout_s`` (0: no deadline, calls run here one after another)."""

    def __init__(self, fn: Callable[..., float], timeout_s: float, workers: int = 8, max_abandoned: int = 64):
        self.fn = fn
        self.timeout_s = float(timeout_s)
        self.workers = workers
        self.max_abandoned = max_abandoned
        self._abandoned: list[_Call] = []
        self.name = getattr(fn, "__qualname__", None) or type(fn).__name__

    def score(self, args_list: Sequence[tuple]) -> list[float | None]:
        if self.timeout_s <= 0:
            return [float(self.fn(*args)) for args in args_list]
        self._abandoned = [call for call in self._abandoned if not call.done.is_set()]
        if len(self._abandoned) >= self.max_abandoned:
            raise RewardTimeoutError(
                f"reward function {self.name}: {len(self._abandoned)} calls are still running past their "
                f"{self.timeout_s:g} s deadline (reward_model.timeout_s); it hangs")
        calls = [_Call(self.fn, tuple(args)) for args in args_list]
        pending = list(range(len(calls)))
        running: list[int] = []
        results: list[float | None] = [TIMED_OUT] * len(calls)
        while pending or running:
            while pending and len(running) < self.workers:
                index = pending.pop(0)
                calls[index].started = time.monotonic()
                threading.Thread(target=calls[index].run, daemon=True, name=f"reward-{index}").start()
                running.append(index)
            # Wait for the call closest to its deadline (or any to finish first).
            first = min(running, key=lambda i: calls[i].started)
            calls[first].done.wait(max(0.0, calls[first].started + self.timeout_s - time.monotonic()))
            now = time.monotonic()
            for index in list(running):
                call = calls[index]
                if call.done.is_set():
                    running.remove(index)
                    if call.error is not None:
                        raise call.error
                    results[index] = float(call.value)
                elif now >= call.started + self.timeout_s:
                    running.remove(index)  # given up: the sample goes without a reward
                    self._abandoned.append(call)
        return results
