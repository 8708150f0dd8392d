"""Fair continuous batching for the Tinker sampler: many users' requests share one model.

Every sample of every ``asample`` call is one row of a :class:`DecodeBatch`. The scheduler
runs one decode step at a time and, between steps:

- **admits** waiting samples into the running batch (prefilled on their own, then joined), so a
  request starts at the next step instead of behind whatever is running;
- shares the batch's rows **fairly between users**: each user's share is the max-min fair split
  of ``max_rows`` over what the users want (rows running, parked and waiting). A user over
  their share has their newest rows *parked* (moved out of the batch with their KV cache, so
  nothing is recomputed) until there is room again; a user under it gets parked rows back
  first, then new ones. One user's 1,024 samples therefore never make another user's single
  sample wait for them;
- **switches weights** when another snapshot (a sampler checkpoint: another model) has work:
  the loaded snapshot keeps the model for at most ``slice_s`` while others wait, then its rows
  are parked and the next user in rotation with work elsewhere gets theirs loaded.

Bounds: the running batch holds at most ``max_rows`` rows and ``max_batch_tokens`` reserved
tokens (prompt + max_tokens of each row: what its cache may grow to); every row prefilled and
not finished (running or parked) counts against ``max_live_rows`` / ``max_live_tokens``, so
memory is bounded whatever is queued. What may wait is bounded before it gets here (the API's
per-user budget of pending sampled tokens).

The scheduler owns the model: one thread calls :meth:`SampleScheduler.run_once` in a loop;
other threads only :meth:`~SampleScheduler.submit`.
"""

from __future__ import annotations

import collections
import itertools
import logging
import threading
import time
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, field
from typing import Any

from opentinker.engine.rollout.base import Completion, SamplingParams
from opentinker.engine.rollout.decode_batch import DecodeBatch
from opentinker.engine.rollout.kv_cache import can_restack

log = logging.getLogger("opentinker.engine.tinker")


def fair_shares(demands: Mapping[Hashable, int], capacity: int) -> dict[Hashable, int]:
    """Max-min fair split of ``capacity`` over ``demands`` (water-filling): nobody gets more
    than they want, and what one does not want is split evenly among the others. Ties in the
    last unit go to the keys listed first."""
    shares = {key: 0 for key in demands}
    wanting = [key for key, demand in demands.items() if demand > 0]
    left = capacity
    while wanting and left > 0:
        each, extra = divmod(left, len(wanting))
        if each == 0:  # fewer units than users: one each, in order
            for key in wanting[:left]:
                shares[key] += 1
            break
        still = []
        for index, key in enumerate(wanting):
            grant = min(demands[key] - shares[key], each + (1 if index < extra else 0))
            shares[key] += grant
            left -= grant
            if shares[key] < demands[key]:
                still.append(key)
        if len(still) == len(wanting):  # everyone took a full portion: capacity is used up
            break
        wanting = still
    return shares


@dataclass
class SchedulerLimits:
    max_rows: int = 128  # rows in the running batch (one forward pass)
    max_batch_tokens: int = 131_072  # reserved tokens (prompt + max_tokens) of the running batch's rows
    max_live_rows: int = 512  # rows prefilled and not finished, running or parked
    max_live_tokens: int = 524_288
    max_prefill_tokens: int = 16_384  # prompt tokens prefilled between two decode steps
    slice_s: float = 0.25  # how long one snapshot keeps the model while another waits


@dataclass
class SampleWork:
    """One ``asample`` call: ``len(params)`` samples of ``prompt`` from weights ``snapshot``.
    With ``prompt_options`` (what to score), the prompt is scored too. ``on_done`` gets
    ``(completions, prompt_scores)`` or the exception that failed it."""

    user: Hashable
    snapshot: str
    prompt: list[int]
    params: list[SamplingParams]  # one per sample
    on_done: Callable[[Any], None]
    prompt_options: dict[str, Any] | None = None
    work_id: int = 0
    arrived: float = field(default_factory=time.monotonic)
    admitted: int = 0  # samples prefilled so far
    in_flight: int = 0  # of those, rows not finished (running or parked)
    completions: list[Completion | None] = field(default_factory=list)
    prompt_scores: Any = None
    failed: bool = False

    def __post_init__(self) -> None:
        self.completions = [None] * len(self.params)

    def row_tokens(self, index: int) -> int:
        """What one sample's cache may grow to."""
        return len(self.prompt) + self.params[index].max_tokens

    @property
    def waiting(self) -> int:
        return len(self.params) - self.admitted


class SampleScheduler:
    """See the module docstring. ``load(snapshot)`` puts a snapshot's weights into the engine's
    model; ``score_prompt(work)`` computes a call's prompt logprobs with them (both run on the
    scheduling thread, between decode steps)."""

    def __init__(self, engine: Any, load: Callable[[str], None], score_prompt: Callable[[SampleWork], Any],
                 limits: SchedulerLimits | None = None, clock: Callable[[], float] = time.monotonic):
        self.engine = engine
        self.load = load
        self.score_prompt = score_prompt
        self.limits = limits or SchedulerLimits()
        self.clock = clock
        self.works: dict[int, SampleWork] = {}
        self.queues: dict[Hashable, collections.deque[SampleWork]] = {}  # per user, samples not all admitted
        self.rotation: collections.deque[Hashable] = collections.deque()  # users, least recently switched to first
        self.running: DecodeBatch | None = None
        self.parked: dict[str, DecodeBatch] = {}
        self.loaded: str | None = None
        self.loaded_at = 0.0
        self.joinable: bool | None = None  # known after the first prefill: can rows move between batches?
        self.live_rows = 0
        self.live_tokens = 0
        self.waiting_samples = 0  # samples of accepted calls not yet prefilled
        self._ids = itertools.count(1)
        self._inbox: list[SampleWork] = []
        self._wake = threading.Condition()
        self.steps = 0  # decode steps run (for tests and metrics)

    # -- from other threads ------------------------------------------------------------
    def submit(self, work: SampleWork) -> None:
        with self._wake:
            work.work_id = next(self._ids)
            self._inbox.append(work)
            self._wake.notify()

    def serve_forever(self) -> None:
        while True:
            if not self.run_once():
                with self._wake:
                    while not self._inbox:
                        self._wake.wait()

    # -- one scheduling round ----------------------------------------------------------
    def run_once(self) -> bool:
        """Admits, rebalances and runs one decode step; False when there is nothing to do."""
        self._take_inbox()
        if not self.works:
            return False
        self._pick_snapshot()
        if self.loaded is not None:
            self._rebalance()
        if self.running is not None and len(self.running):
            try:
                finished = self.running.step()
            except Exception as error:  # noqa: BLE001 - every waiter hears of it; serving goes on
                self._fail_batch(self.running, error)
                self.running = None
                return True
            self.steps += 1
            for (work_id, index), completion in finished:
                self._finish_row(work_id, index, completion)
        return True

    def _take_inbox(self) -> None:
        with self._wake:
            arrived, self._inbox = self._inbox, []
        for work in arrived:
            self.works[work.work_id] = work
            if work.user not in self.queues:
                self.queues[work.user] = collections.deque()
                self.rotation.append(work.user)
            self.queues[work.user].append(work)
            self.waiting_samples += work.waiting

    # -- which weights are loaded ----------------------------------------------------
    def _busy_here(self) -> bool:
        return bool((self.running is not None and len(self.running)) or self.loaded in self.parked
                    or any(w.snapshot == self.loaded for q in self.queues.values() for w in q))

    def _elsewhere(self, user: Hashable) -> str | None:
        """The snapshot of ``user``'s oldest work on weights other than the loaded ones."""
        candidates = [w for w in self.works.values() if w.user == user and w.snapshot != self.loaded]
        return min(candidates, key=lambda w: w.work_id).snapshot if candidates else None

    def _pick_snapshot(self) -> None:
        busy = self.loaded is not None and self._busy_here()
        if busy and self.clock() - self.loaded_at < self.limits.slice_s:
            return
        if busy and not self.joinable and self.running is not None and len(self.running):
            return  # rows that cannot be parked finish first
        for _ in range(len(self.rotation)):
            user = self.rotation[0]
            self.rotation.rotate(-1)
            target = self._elsewhere(user)
            if target is not None:
                self._switch(target)
                return
        if busy:
            self.loaded_at = self.clock()  # nobody else waits: a new slice

    def _switch(self, snapshot: str) -> None:
        if self.running is not None and len(self.running):
            self._park(self.loaded, self.running)
        self.running = None
        try:
            self.load(snapshot)
        except Exception as error:  # noqa: BLE001 - a snapshot that does not load fails its own works only
            self.loaded = None
            self._fail_batch(self.parked.pop(snapshot, None), error)
            for work in [w for w in self.works.values() if w.snapshot == snapshot]:
                self._fail(work, error)
            return
        self.loaded, self.loaded_at = snapshot, self.clock()
        self.running = self.parked.pop(snapshot, None)

    def _park(self, snapshot: str, batch: DecodeBatch) -> None:
        if snapshot in self.parked:
            self.parked[snapshot].absorb(batch)
        else:
            self.parked[snapshot] = batch

    # -- who runs ----------------------------------------------------------------------
    def _user_rows(self, batch: DecodeBatch | None) -> collections.Counter:
        return collections.Counter(self.works[work_id].user for work_id, _ in batch.tags) if batch else \
            collections.Counter()

    def _positions(self, batch: DecodeBatch, user: Hashable) -> list[int]:
        """Where ``user``'s rows are in ``batch``, oldest admitted first."""
        return [i for i, (work_id, _) in enumerate(batch.tags) if self.works[work_id].user == user]

    def _batch_tokens(self, batch: DecodeBatch | None) -> int:
        return sum(self.works[w].row_tokens(i) for w, i in batch.tags) if batch else 0

    def _rebalance(self) -> None:
        here = self.loaded
        running, parked = self._user_rows(self.running), self._user_rows(self.parked.get(here))
        waiting = collections.Counter()
        for user, queue in self.queues.items():
            waiting[user] = sum(w.waiting for w in queue if w.snapshot == here)
        users = [u for u in self.rotation if running[u] or parked[u] or waiting[u]]
        shares = fair_shares({u: running[u] + parked[u] + waiting[u] for u in users}, self.limits.max_rows)
        if self.joinable:
            over = [row for u in users if running[u] > shares[u]
                    for row in self._positions(self.running, u)[shares[u]:]]
            if over:  # the newest rows of users over their share wait, cache and all
                self._park(here, self.running.take(over))
            self._unpark(users, shares)
        elif self.running is not None and len(self.running):
            return  # a batch whose rows cannot move runs to its end before others join
        self._admit(users, shares)

    def _unpark(self, users: list, shares: dict) -> None:
        parked = self.parked.get(self.loaded)
        if parked is None:
            return
        running = self._user_rows(self.running)
        rows, tokens = len(self.running or ()), self._batch_tokens(self.running)
        back = []
        for user in users:
            for row in self._positions(parked, user)[:max(shares[user] - running[user], 0)]:
                work_id, index = parked.tags[row]
                cost = self.works[work_id].row_tokens(index)
                if rows and tokens + cost > self.limits.max_batch_tokens:
                    break
                back.append(row)
                rows, tokens = rows + 1, tokens + cost
        if back:
            self._join(self.parked.pop(self.loaded) if len(back) == len(parked) else parked.take(back))

    def _admit(self, users: list, shares: dict) -> None:
        """New rows for users under their share, one sample per user per pass, so that the caps
        cut fairly; all prefilled together, then joined to the running batch."""
        running, parked = self._user_rows(self.running), self._user_rows(self.parked.get(self.loaded))
        room = {u: shares[u] - running[u] - parked[u] for u in users}
        rows, tokens = len(self.running or ()), self._batch_tokens(self.running)
        prefill: list[tuple[SampleWork, int]] = []
        prefill_tokens = 0
        progress = True
        while progress:
            progress = False
            for user in users:
                work = next((w for w in self.queues[user] if w.snapshot == self.loaded), None) \
                    if room[user] > 0 else None
                if work is None:
                    continue
                cost = work.row_tokens(work.admitted)
                full = rows >= self.limits.max_rows or self.live_rows >= self.limits.max_live_rows or \
                    (rows and tokens + cost > self.limits.max_batch_tokens) or \
                    (self.live_rows and self.live_tokens + cost > self.limits.max_live_tokens) or \
                    (prefill and prefill_tokens + len(work.prompt) > self.limits.max_prefill_tokens)
                if full:
                    progress = False
                    break
                if work.admitted == 0 and work.prompt_options is not None and not self._score(work):
                    progress = True
                    continue
                prefill.append((work, work.admitted))
                work.admitted += 1
                self.waiting_samples -= 1
                work.in_flight += 1
                if not work.waiting:
                    self.queues[user].remove(work)
                room[user] -= 1
                rows, tokens, prefill_tokens = rows + 1, tokens + cost, prefill_tokens + len(work.prompt)
                self.live_rows += 1
                self.live_tokens += cost
                progress = True
        if prefill:
            self._prefill(prefill)

    def _score(self, work: SampleWork) -> bool:
        """The call's prompt logprobs, with its weights loaded (now); False if that failed."""
        try:
            work.prompt_scores = self.score_prompt(work)
        except Exception as error:  # noqa: BLE001 - this call fails, the others go on
            self._fail(work, error)
            return False
        return True

    def _prefill(self, rows: list[tuple[SampleWork, int]]) -> None:
        try:
            batch = DecodeBatch.prefill(self.engine, [w.prompt for w, _ in rows], [w.params[i] for w, i in rows],
                                        [(w.work_id, i) for w, i in rows])
        except Exception as error:  # noqa: BLE001 - e.g. out of memory: these calls fail, others go on
            for work, index in rows:
                self._row_gone(work, index)
            for work, _ in rows:
                self._fail(work, error)
            return
        if self.joinable is None:
            self.joinable = can_restack(batch.cache)
        self._join(batch)

    def _join(self, batch: DecodeBatch) -> None:
        if self.running is None or not len(self.running):
            self.running = batch
        else:
            self.running.absorb(batch)

    # -- results -------------------------------------------------------------------------
    def _row_gone(self, work: SampleWork, index: int) -> None:
        """A row left the live set (finished, or failed with its batch)."""
        self.live_rows -= 1
        self.live_tokens -= work.row_tokens(index)
        work.in_flight -= 1
        if work.in_flight == 0 and (work.failed or not work.waiting):
            self.works.pop(work.work_id, None)

    def _finish_row(self, work_id: int, index: int, completion: Completion) -> None:
        work = self.works[work_id]
        work.completions[index] = completion
        self._row_gone(work, index)
        if not work.failed and all(c is not None for c in work.completions):
            work.on_done((work.completions, work.prompt_scores))

    def _fail(self, work: SampleWork, error: BaseException) -> None:
        """The call fails (once); rows of it still decoding run out and are dropped."""
        if work.failed:
            return
        work.failed = True
        queue = self.queues.get(work.user)
        if queue is not None and work in queue:
            queue.remove(work)
            self.waiting_samples -= work.waiting
        if work.in_flight == 0:
            self.works.pop(work.work_id, None)
        work.on_done(error)

    def _fail_batch(self, batch: DecodeBatch | None, error: BaseException) -> None:
        if batch is None:
            return
        log.warning("tinker sampler: a batch of %d rows failed: %s", len(batch), error)
        works = {}
        for work_id, index in batch.tags:
            works[work_id] = self.works[work_id]
            self._row_gone(works[work_id], index)
        for work in works.values():
            self._fail(work, error)
