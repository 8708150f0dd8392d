"""One model's requests in its ``seq_id`` order (:class:`ModelSlot`): a heap by number, the
next one run when it is the next number or when a gap stayed unfilled, at most
:data:`MAX_HANDED_OVER` handed to the worker at once."""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from opentinker.server.tinker.workers import SharedAdapter

#: An operation on a model (its handle: ``workers.OwnWorker`` or ``workers.SharedAdapter``):
#: returns (payload, content type) for the future.
Operation = Callable[[Any], Awaitable[tuple[Any, str]]]


@dataclass(order=True)
class QueuedOp:
    seq: int
    arrival: int
    request_id: str = field(compare=False)
    run: Operation = field(compare=False)


#: How far past the next number a request's ``seq_id`` may be. The SDK sends a few numbers
#: ahead at once (a chunked forward_backward's chunks, first chunk last); a number further on
#: would wait for the model's whole life for the ones before it.
SEQ_WINDOW = 1024

#: A model's requests handed to its worker and not finished, at most: one running and the
#: next one queued at the worker behind it.
MAX_HANDED_OVER = 2


class ModelSlot:
    """One model's actor and its queue of requests, taken in ``seq_id`` order."""

    def __init__(self, model_id: str, user_id: int, memory_bytes: int = 0):
        self.model_id = model_id
        self.user_id = user_id
        self.memory_bytes = memory_bytes  # the admission estimate it holds while it lives
        self.actor: Any = None
        self.ready: asyncio.Future = asyncio.get_running_loop().create_future()
        self._heap: list[QueuedOp] = []
        self._arrivals = itertools.count()
        self._next_seq = 1
        self._skipped: set[int] = set()  # only numbers in [_next_seq, _next_seq + SEQ_WINDOW)
        self._changed = asyncio.Event()
        self.handed_over: dict[str, asyncio.Task] = {}  # by request id: with the worker, not finished
        self.task: asyncio.Task | None = None
        self.last_used = time.monotonic()  # when a request last came or finished

    def idle_for(self) -> float:
        """Seconds since the model last had a request waiting or running (0 while it has one)."""
        return 0.0 if self.pending else time.monotonic() - self.last_used

    @property
    def is_adapter(self) -> bool:
        """A LoRA model in its base's shared worker (an adapter there, not a process of its own)."""
        return isinstance(self.actor, SharedAdapter)

    @property
    def next_seq(self) -> int:
        """The number the model runs next."""
        return self._next_seq

    @property
    def pending(self) -> int:
        """Requests accepted and not finished: waiting in the queue, or running."""
        return len(self._heap) + len(self.handed_over)

    def seq_problem(self, seq_id: int | None) -> str | None:
        """Why a new request with ``seq_id`` cannot be queued, or None."""
        if seq_id is None:
            return None
        if seq_id < self._next_seq:
            return (f"seq_id {seq_id} is behind model {self.model_id}'s queue: it has gone on to {self._next_seq} "
                    "(a number that does not arrive within a few seconds is passed over)")
        if seq_id >= self._next_seq + SEQ_WINDOW:
            return (f"seq_id {seq_id} is too far ahead: model {self.model_id} runs {self._next_seq} next and takes "
                    f"numbers below {self._next_seq + SEQ_WINDOW}")
        return None

    def push(self, seq_id: int | None, request_id: str, run: Operation) -> None:
        # No seq_id (a caller other than the SDK): in arrival order, after what is ready to run.
        heapq.heappush(self._heap, QueuedOp(seq_id if seq_id is not None else 0, next(self._arrivals), request_id, run))
        self.last_used = time.monotonic()
        self._changed.set()

    def skip(self, seq_id: int) -> None:
        """``seq_id`` was refused at submit: nothing will come with that number (numbers
        outside the window were never waited for)."""
        if self._next_seq <= seq_id < self._next_seq + SEQ_WINDOW:
            self._skipped.add(seq_id)
            self._changed.set()

    async def next_op(self, gap_s: float) -> QueuedOp:
        while True:
            while self._next_seq in self._skipped:
                self._skipped.discard(self._next_seq)
                self._next_seq += 1
            if self._heap and self._heap[0].seq <= self._next_seq:
                op = heapq.heappop(self._heap)
                self._next_seq = max(self._next_seq, op.seq + 1)
                return op
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), gap_s if self._heap else None)
            except asyncio.TimeoutError:  # a gap nobody filled: go on with the lowest waiting
                self._next_seq = self._heap[0].seq
                self._skipped = {seq for seq in self._skipped if seq >= self._next_seq}

    def drain(self) -> list[QueuedOp]:
        ops, self._heap = self._heap, []
        return ops
