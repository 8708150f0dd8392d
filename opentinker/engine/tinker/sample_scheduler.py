"""Fair continuous batching for the Tinker sampler: many users' requests share one model.

Every sample of every ``asample`` call is one row of a decode batch (:class:`DecodeBatch`).
Rows live in *lanes*, one batch each: a user with many samples on some weights gets a lane of
their own; users with a few (at most ``shared_rows``) share one lane per weights, so that light
users are decoded together. Each round the scheduler:

1. picks a user by **service time**: every forward pass is timed and charged to the users of
   its lane (split by rows), and the user served least so far goes next. A user who arrives,
   or comes back from idle, starts ``idle_credit_s`` ahead of the scheduler's *virtual time*
   (the least service of a busy user, which never goes back, also while nobody is busy): no
   credit for the idle time, enough to finish a short call in one go, and no debt for service
   had before (else a newcomer would start at zero and have the model to itself until it
   caught up with everyone served before it came). A request that needs little therefore
   finishes in about its own time whatever else is queued: one user's 512 x 1,000-token call
   costs another user's 2-token call about one forward pass of the big lane;
2. loads that user's weights if they are not the ones loaded, unless a user on the loaded
   weights is within ``switch_after_s`` of service of the least served (so weights are not
   swapped every step). A LoRA model's rows need the base weights and carry their adapter
   (``SampleWork.adapter``, applied per row by ``apply_adapters`` before every forward pass),
   so rows of many users' adapters share lanes and no weights are swapped between them;
3. admits waiting samples into the lane (prefilled on their own, then joined: a request starts
   at the next step instead of after whatever is running);
4. runs one decode step of that lane (first noting the top-k of rows whose call asked for it,
   :mod:`.token_alternatives`) and hands back the samples that ended.

Bounds: one lane holds at most ``max_rows`` rows and ``max_batch_tokens`` reserved tokens
(prompt + max_tokens of each row: what its cache may grow to), which bounds the cost of one
forward pass, so also how long anyone waits for the one in progress; a user's live rows hold
at most ``max_user_tokens`` and all live rows at most ``max_live_rows`` / ``max_live_tokens``,
so memory is bounded whatever is queued. What may be queued is bounded before it gets here
(the API's per-user budget of pending sampled tokens).

The scheduler owns the model: one thread calls :meth:`SampleScheduler.run_once` in a loop;
other threads only :meth:`~SampleScheduler.submit`.
"""

from __future__ import annotations

import collections
import itertools
import logging
import threading
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from opentinker.engine.rollout.base import Completion, SamplingParams
from opentinker.engine.rollout.decode_batch import DecodeBatch
from opentinker.engine.tinker.token_alternatives import SampleTopk, record_step_topk

log = logging.getLogger("opentinker.engine.tinker")

SHARED = object()  # the owner of a lane that light users share


@dataclass
class SchedulerLimits:
    max_rows: int = 64  # rows of one lane: one forward pass
    max_batch_tokens: int = 16_384  # reserved tokens (prompt + max_tokens) of one lane's rows: a forward's cost
    max_user_tokens: int = 32_768  # reserved tokens of one user's live rows, over all their lanes
    max_live_rows: int = 512  # rows prefilled and not finished, all lanes
    max_live_tokens: int = 131_072
    max_prefill_tokens: int = 16_384  # prompt tokens prefilled in one round
    shared_rows: int = 8  # a user with at most this many samples on some weights shares a lane there
    switch_after_s: float = 0.1  # loaded weights stay while a user on them is this close to the least served
    idle_credit_s: float = 0.02  # a user back from idle starts this far ahead of the least served busy user


@dataclass
class SampleWork:
    """One ``asample`` call: ``len(params)`` samples of ``prompt`` from weights ``snapshot``.
    With ``prompt_options`` (what to score), the prompt is scored too. ``on_done`` gets
    ``(completions, prompt_scores)`` or the exception that failed it."""

    user: Hashable
    snapshot: str  # the weights the model must hold (a LoRA model's rows: the base's)
    prompt: list[int]
    params: list[SamplingParams]  # one per sample
    on_done: Callable[[Any], None]
    prompt_options: dict[str, Any] | None = None
    adapter: Any = None  # applied to this call's rows only (``apply_adapters``), on top of ``snapshot``
    sample_topk: SampleTopk | None = None  # filled before each decode step of its rows, when asked for
    work_id: int = 0
    admitted: int = 0  # samples prefilled so far
    in_flight: int = 0  # of those, rows not finished
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


class LaneKey(NamedTuple):
    snapshot: str
    owner: Any  # a user, or SHARED


@dataclass
class UserState:
    served_s: float = 0.0  # service time charged so far (the "virtual time" of fair queuing)
    queue: collections.deque = field(default_factory=collections.deque)  # works with samples to admit
    rows: collections.Counter = field(default_factory=collections.Counter)  # live rows per lane
    live_tokens: int = 0

    @property
    def busy(self) -> bool:
        return bool(self.queue) or sum(self.rows.values()) > 0


class SampleScheduler:
    """See the module docstring. ``load(snapshot)`` puts a snapshot's weights into the engine's
    model; ``score_prompt(work)`` computes a call's prompt logprobs with them (both run on the
    scheduling thread, between decode steps)."""

    def __init__(self, engine: Any, load: Callable[[str], None], score_prompt: Callable[[SampleWork], Any],
                 limits: SchedulerLimits | None = None, clock: Callable[[], float] = time.perf_counter,
                 apply_adapters: Callable[[list[Any]], None] | None = None):
        self.engine = engine
        self.load = load
        self.score_prompt = score_prompt
        self.apply_adapters = apply_adapters  # each row's adapter, before each forward pass
        self.limits = limits or SchedulerLimits()
        self.clock = clock
        self.works: dict[int, SampleWork] = {}
        self.users: dict[Hashable, UserState] = {}
        self.lanes: dict[LaneKey, DecodeBatch] = {}
        self.loaded: str | None = None
        self.virtual_s = 0.0  # fair queuing's clock: the least service of a busy user, never going back
        self.live_rows = 0
        self.live_tokens = 0
        self.waiting_samples = 0  # samples of accepted calls not yet prefilled
        self.steps = 0  # decode steps run
        self._ids = itertools.count(1)
        self._inbox: list[SampleWork] = []
        self._wake = threading.Condition()

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

    # -- one round -----------------------------------------------------------------------
    def run_once(self) -> bool:
        """Picks a user and a lane, admits, runs one decode step; False when there is nothing to do."""
        self._take_inbox()
        choice = self._pick()
        if choice is None:
            return False
        user, key = choice
        started = self.clock()
        if key.snapshot != self.loaded and not self._switch(key.snapshot):
            return True
        self._admit(key)
        lane = self.lanes.get(key)
        if lane is None:
            self._charge({user: 1.0}, self.clock() - started)
            return True
        shares = collections.Counter(self.works[work_id].user for work_id, _ in lane.tags)
        try:
            record_step_topk(lane, self.works)
            finished = lane.step()
        except Exception as error:  # noqa: BLE001 - every waiter hears of it; serving goes on
            del self.lanes[key]
            self._fail_lane(key, lane, error)
            return True
        self.steps += 1
        rows = sum(shares.values())
        self._charge({u: n / rows for u, n in shares.items()}, self.clock() - started)
        for (work_id, index), completion in finished:
            self._finish_row(key, work_id, index, completion)
        if not len(lane):
            del self.lanes[key]
        return True

    def _take_inbox(self) -> None:
        with self._wake:
            arrived, self._inbox = self._inbox, []
        for work in arrived:
            state = self.users.get(work.user)
            if state is None:
                state = self.users[work.user] = UserState()
            if not state.busy:  # new, or back from idle: see the module docstring
                self._advance_virtual_time()
                state.served_s = max(state.served_s, self.virtual_s - self.limits.idle_credit_s)
            state.queue.append(work)
            self.works[work.work_id] = work
            self.waiting_samples += work.waiting

    def _charge(self, shares: dict[Hashable, float], seconds: float) -> None:
        for user, share in shares.items():
            self.users[user].served_s += share * seconds
        self._advance_virtual_time()

    def _advance_virtual_time(self) -> None:
        busy = [state.served_s for state in self.users.values() if state.busy]
        if busy:
            self.virtual_s = max(self.virtual_s, min(busy))

    # -- choosing ----------------------------------------------------------------------
    def _lane_for(self, user: Hashable, snapshot: str) -> LaneKey:
        """Where a user's new rows on ``snapshot`` go: their own lane if they want many rows there."""
        state = self.users[user]
        wanted = sum(n for key, n in state.rows.items() if key.snapshot == snapshot) + \
            sum(w.waiting for w in state.queue if w.snapshot == snapshot)
        return LaneKey(snapshot, user if wanted > self.limits.shared_rows else SHARED)

    def _can_admit(self, state: UserState, cost: int) -> bool:
        limits = self.limits
        return (self.live_rows < limits.max_live_rows
                and (not self.live_rows or self.live_tokens + cost <= limits.max_live_tokens)
                and (not state.live_tokens or state.live_tokens + cost <= limits.max_user_tokens))

    def _options(self, user: Hashable) -> list[LaneKey]:
        """The lanes a round for ``user`` could run: those holding its rows, then where its oldest
        waiting sample would go (if it may be admitted now)."""
        state = self.users[user]
        keys = [key for key, n in state.rows.items() if n > 0]
        if state.queue:
            work = state.queue[0]
            key = self._lane_for(user, work.snapshot)
            lane = self.lanes.get(key)
            if key not in keys and (lane is None or len(lane) < self.limits.max_rows) and \
                    self._can_admit(state, work.row_tokens(work.admitted)):
                keys.append(key)
        return keys

    def _pick(self) -> tuple[Hashable, LaneKey] | None:
        options = {user: keys for user in self.users if (keys := self._options(user))}
        if not options:
            return None
        least = min(options, key=lambda u: self.users[u].served_s)
        floor = self.users[least].served_s
        on_loaded = [(self.users[u].served_s, u, key) for u, keys in options.items() for key in keys
                     if key.snapshot == self.loaded]
        if on_loaded:
            served, user, key = min(on_loaded, key=lambda item: item[0])
            if served <= floor + self.limits.switch_after_s:
                return user, key
        return least, options[least][0]

    def _switch(self, snapshot: str) -> bool:
        try:
            self.load(snapshot)
        except Exception as error:  # noqa: BLE001 - a snapshot that does not load fails its own calls only
            self.loaded = None
            for key in [k for k in self.lanes if k.snapshot == snapshot]:
                self._fail_lane(key, self.lanes.pop(key), error)
            for work in [w for w in self.works.values() if w.snapshot == snapshot]:
                self._fail(work, error)
            return False
        self.loaded = snapshot
        return True

    # -- admitting -----------------------------------------------------------------------
    def _admit(self, key: LaneKey) -> None:
        """Waiting samples for lane ``key`` (its owner's, or every light user's), least served
        user first, one sample per user per pass; prefilled together, then joined to the lane."""
        limits = self.limits
        lane = self.lanes.get(key)
        users = [key.owner] if key.owner is not SHARED else [u for u in self.users if self.users[u].queue]
        users.sort(key=lambda u: self.users[u].served_s)
        rows = len(lane) if lane is not None else 0
        tokens = sum(self.works[w].row_tokens(i) for w, i in lane.tags) if lane is not None else 0
        picked: list[tuple[SampleWork, int]] = []
        prefill_tokens = 0
        progress = True
        while progress:
            progress = False
            for user in users:
                state = self.users[user]
                work = next((w for w in state.queue if self._lane_for(user, w.snapshot) == key), None)
                if work is None:
                    continue
                cost = work.row_tokens(work.admitted)
                if rows >= limits.max_rows or (rows and tokens + cost > limits.max_batch_tokens) or \
                        (picked and prefill_tokens + len(work.prompt) > limits.max_prefill_tokens):
                    progress = False
                    break
                if not self._can_admit(state, cost):
                    continue
                if work.admitted == 0 and work.prompt_options is not None and not self._score(work):
                    progress = True
                    continue
                picked.append((work, work.admitted))
                work.admitted += 1
                work.in_flight += 1
                if not work.waiting:
                    state.queue.remove(work)
                state.rows[key] += 1
                state.live_tokens += cost
                self.live_rows += 1
                self.live_tokens += cost
                self.waiting_samples -= 1
                rows, tokens, prefill_tokens = rows + 1, tokens + cost, prefill_tokens + len(work.prompt)
                progress = True
        if picked:
            self._prefill(key, picked)

    def _score(self, work: SampleWork) -> bool:
        """The call's prompt logprobs, with its weights loaded (now); False if that failed."""
        try:
            work.prompt_scores = self.score_prompt(work)
        except Exception as error:  # noqa: BLE001 - this call fails, the others go on
            self._fail(work, error)
            return False
        return True

    def _prefill(self, key: LaneKey, rows: list[tuple[SampleWork, int]]) -> None:
        # Rows of different adapters are prefilled apart (rows sharing a prompt share its forward).
        by_adapter: dict[int, list[tuple[SampleWork, int]]] = collections.defaultdict(list)
        for work, index in rows:
            by_adapter[id(work.adapter)].append((work, index))
        for group in by_adapter.values():
            self._prefill_group(key, group)

    def _prefill_group(self, key: LaneKey, rows: list[tuple[SampleWork, int]]) -> None:
        try:
            batch = DecodeBatch.prefill(self.engine, [w.prompt for w, _ in rows], [w.params[i] for w, i in rows],
                                        [(w.work_id, i) for w, i in rows], self._on_forward)
        except Exception as error:  # noqa: BLE001 - e.g. out of memory: these calls fail, others go on
            for work, index in rows:
                self._row_gone(key, work, index)
            for work, _ in rows:
                self._fail(work, error)
            return
        lane = self.lanes.get(key)
        if lane is None or not len(lane):
            self.lanes[key] = batch
        else:
            lane.absorb(batch)

    def _on_forward(self, tags: list[tuple[int, int]]) -> None:
        if self.apply_adapters is not None:
            self.apply_adapters([self.works[work_id].adapter for work_id, _ in tags])

    # -- results -------------------------------------------------------------------------
    def _row_gone(self, key: LaneKey, work: SampleWork, index: int) -> None:
        """A row left the live set (finished, or failed with its lane)."""
        cost = work.row_tokens(index)
        state = self.users[work.user]
        state.rows[key] -= 1
        if state.rows[key] <= 0:
            del state.rows[key]
        state.live_tokens -= cost
        self.live_rows -= 1
        self.live_tokens -= cost
        work.in_flight -= 1
        if work.in_flight == 0 and (work.failed or not work.waiting):
            self.works.pop(work.work_id, None)

    def _finish_row(self, key: LaneKey, work_id: int, index: int, completion: Completion) -> None:
        work = self.works[work_id]
        work.completions[index] = completion
        self._row_gone(key, work, index)
        if not work.failed and not work.waiting and work.in_flight == 0:
            work.on_done((work.completions, work.prompt_scores))

    def _fail(self, work: SampleWork, error: BaseException) -> None:
        """The call fails (once); rows of it still decoding run out and are dropped."""
        if work.failed:
            return
        work.failed = True
        state = self.users[work.user]
        if work in state.queue:
            state.queue.remove(work)
            self.waiting_samples -= work.waiting
        if work.in_flight == 0:
            self.works.pop(work.work_id, None)
        work.on_done(error)

    def _fail_lane(self, key: LaneKey, lane: DecodeBatch, error: BaseException) -> None:
        log.warning("tinker sampler: a batch of %d rows failed: %s", len(lane), error)
        works = {}
        for work_id, index in lane.tags:
            works[work_id] = self.works[work_id]
            self._row_gone(key, works[work_id], index)
        for work in works.values():
            self._fail(work, error)
