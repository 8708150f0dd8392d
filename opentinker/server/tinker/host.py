"""The Ray side of the Tinker API: every model's requests in its ``seq_id`` order, run by the
worker that holds the model, and one sampler actor per base model.

LoRA models of the same served base model share one
:class:`~opentinker.engine.tinker.adapter_worker.AdapterWorker` actor (:class:`SharedBase`;
on the ``fsdp`` strategy a
:class:`~opentinker.engine.tinker.sharded_adapters.ShardedAdapterWorker`, the base sharded
over FSDP ranks): the base weights once, each model an adapter. Fully fine-tuned models have a
worker of their own (:class:`OwnWorker`). Either way a model is driven through the same
handle methods, so the routes do not know which.

The SDK sends a training client's requests one after another, but a ``forward_backward``
split into chunks arrives concurrently, first chunk last. Each model therefore keeps a heap of
requests by ``seq_id`` and runs the next one only when it is the next number, or when a gap
has stayed unfilled for ``gap_s`` (a request refused at submit never arrives; one whose number
is known is skipped at once). Results and failures go to the :class:`FutureTable`.

A model's next request is handed to its worker as soon as the previous one is there (at most
:data:`MAX_HANDED_OVER` at once), so the worker goes from an ``optim_step`` queued behind a
``forward_backward`` straight on, without a round trip through the server between them.
The worker runs what it is handed in the order it was handed over.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import heapq
import itertools
import logging
import shutil
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray
from ray.exceptions import RayActorError, RayTaskError

from opentinker.engine.backend.spec import BackendSpec
from opentinker.engine.tinker.datum_rules import DatumError, check_datums
from opentinker.engine.tinker.pass_plan import PassLimits, cut_rows, join_pieces
from opentinker.server.jobs import ray_failure_reason
from opentinker.server.tinker.futures import JSON, FutureTable
from opentinker.server.tinker.state import TinkerState

log = logging.getLogger("opentinker.server.tinker")

#: An operation on a model (its handle: :class:`OwnWorker` or :class:`SharedAdapter`):
#: returns (payload, content type) for the future.
Operation = Callable[[Any], Awaitable[tuple[Any, str]]]


class UserError(ValueError):
    """The request cannot be done as asked; the client is told so (category ``user``)."""


def failure(error: BaseException) -> tuple[str, str]:
    """``(message, category)`` for an operation's exception: the worker's own ValueErrors
    (bad datums, unknown options, a checkpoint that does not fit) are the user's."""
    if isinstance(error, RayTaskError) and error.cause is not None:
        error = error.cause
    if isinstance(error, RayActorError):
        if error.actor_init_failed:  # e.g. a model folder that does not load
            return ray_failure_reason(error).replace("the job's runner", "the model's worker"), "server"
        return "the model's worker process died; load the model again from a checkpoint", "server"
    category = "user" if isinstance(error, (ValueError, KeyError)) else "server"
    return f"{type(error).__name__}: {error}" if category == "server" else str(error), category


async def await_ref(ref: Any) -> Any:
    return await asyncio.wrap_future(ref.future())


#: Of a GPU, what each Tinker actor asks Ray for: the GPU is shared (the sampler, the shared
#: base workers, models of their own); how many models fit is the memory admission's call.
GPU_SHARE = 0.1


def _gpus() -> float:
    return GPU_SHARE if ray.cluster_resources().get("GPU", 0) > 0 else 0


class OwnWorker:
    """A model with a worker actor of its own (:class:`TinkerModelWorker`). Each method hands
    its call to the actor before its first wait (Ray runs one caller's calls to a
    one-at-a-time actor in the order they were made); ``calls_sent`` counts them."""

    def __init__(self, actor: Any):
        self.actor = actor
        self.calls_sent = 0

    def _call(self, method: str, *args: Any) -> Awaitable[Any]:
        self.calls_sent += 1
        return await_ref(getattr(self.actor, method).remote(*args))

    async def forward_backward(self, data, loss_fn: str, loss_config, forward_only: bool) -> dict[str, Any]:
        return await self._call("forward_backward", data, loss_fn, loss_config, forward_only)

    async def optim_step(self, adam) -> dict[str, float]:
        return await self._call("optim_step", adam)

    async def save_state(self, path: str) -> None:
        await self._call("save_state", path)

    async def load_state(self, path: str, with_optimizer: bool) -> None:
        await self._call("load_state", path, with_optimizer)

    async def save_sampler_weights(self, path: str) -> int:
        return await self._call("save_sampler_weights", path)

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            ray.kill(self.actor, no_restart=True)


class SharedAdapter:
    """A LoRA model living as an adapter in its base model's :class:`SharedBase`. Each method
    joins the base's queue before its first wait (the base keeps each model's requests in
    that order); ``calls_sent`` counts them."""

    def __init__(self, base: "SharedBase", model_id: str, user_id: int):
        self.base = base
        self.model_id = model_id
        self.user_id = user_id
        self.calls_sent = 0

    def _op(self, method: str, *args: Any) -> asyncio.Future:
        self.calls_sent += 1
        return self.base.op(method, self.model_id, *args, user_id=self.user_id)

    async def forward_backward(self, data, loss_fn: str, loss_config, forward_only: bool) -> dict[str, Any]:
        from opentinker.engine.tinker.calls import ForwardBackwardCall

        self.calls_sent += 1
        return await self.base.forward_backward(
            ForwardBackwardCall(self.model_id, data, loss_fn, dict(loss_config), forward_only), self.user_id)

    async def optim_step(self, adam) -> dict[str, float]:
        return await self._op("optim_step", adam)

    async def save_state(self, path: str) -> None:
        await self._op("save_state", path)

    async def load_state(self, path: str, with_optimizer: bool) -> None:
        await self._op("load_state", path, with_optimizer)

    async def save_sampler_weights(self, path: str) -> int:
        return await self._op("save_sampler_weights", path)

    async def close(self) -> None:
        await self.base.remove(self.model_id)


@dataclass
class _Waiting:
    """A request for the shared worker: a forward/backward call (or a chunk of one) or another
    operation."""

    model_id: str
    user_id: int | None
    is_call: bool  # a ForwardBackwardCall (batched with the cycle's others), else (method, model_id, args)
    item: Any
    future: asyncio.Future
    cost: float = 0.0  # a call's share of a cycle (HostSettings.cycle_limits); 0 for other operations


@dataclass
class _Cycle:
    models: set[str]
    futures: list[asyncio.Future]
    task: asyncio.Task | None = None  # awaits the worker, then settles ``futures``


class SharedBase:
    """One :class:`AdapterWorker` actor (a base model and its LoRA models) and the loop that
    feeds it cycles, fair between users: each cycle takes, of every user with work waiting, the
    first waiting request of each of their models (each model's in its order) while that user's
    share of the cycle stays within one ``cycle_limits`` (the first always), so every busy user
    is served in every cycle, each with about the same work, however much they sent. A
    ``forward_backward`` bigger than one share is cut into chunks of at most one share (rows of
    similar length together, as the worker cuts passes), each in a cycle of its own; its loss is
    a sum over rows, so its gradients and summed metrics are those of one call, and its result
    is put back together in its rows' order. A small request thus waits for at most about one
    cycle of bounded size, whoever else sends what. The cycle's forward/backward requests run
    as batched passes in the worker.

    A cycle is sent when the worker is idle, or, while one runs, as soon as a request of a
    model in it is waiting (that one cannot join the running cycle anyway): Ray queues it at
    the worker, which then goes straight on. At most two cycles are out at once."""

    def __init__(self, key: BackendSpec, memory_bytes: int = 0):
        self.key = key  # the base's spec (BackendSpec.shared_base()): what the worker is built from
        self.memory_bytes = memory_bytes  # the base's admission estimate, held while it lives
        self.actor: Any = None
        self.models: set[str] = set()
        self.cycle_limits = PassLimits()
        self.limits: dict[str, Any] = {}  # the model's vocabulary and context, from the worker
        self.offload_dir: Path | None = None
        self._waiting: list[_Waiting] = []  # in arrival order
        self._cycles: list[_Cycle] = []  # sent to the worker, not settled
        self._wake = asyncio.Event()
        self._loop_task: asyncio.Task | None = None
        self.started: asyncio.Future | None = None
        self.dead_error: BaseException | None = None  # the worker died: every later request fails with this

    async def start(self, settings: "HostSettings") -> None:
        if settings.offload_dir is not None:  # one folder per base, cleared by the worker at its start
            digest = hashlib.sha256(repr(self.key).encode()).hexdigest()[:16]
            self.offload_dir = Path(settings.offload_dir) / f"base-{digest}"
        self.cycle_limits = settings.cycle_limits
        args = (self.key, settings.max_resident_adapters, None if self.offload_dir is None else str(self.offload_dir),
                settings.pass_limits)
        if self.key.strategy == "fsdp":  # the base sharded over FSDP ranks (each rank asks for its own GPU)
            from opentinker.engine.tinker.sharded_adapters import ShardedAdapterWorker

            self.actor = ray.remote(ShardedAdapterWorker).options(num_cpus=0, max_concurrency=1).remote(*args)
        else:
            from opentinker.engine.tinker.adapter_worker import AdapterWorker

            self.actor = ray.remote(AdapterWorker).options(num_cpus=0, num_gpus=_gpus(), max_concurrency=1).remote(
                *args)
        self.limits = await await_ref(self.actor.ready.remote())
        self._loop_task = asyncio.create_task(self._serve())

    def forward_backward(self, call: Any, user_id: int | None = None) -> asyncio.Future:
        """The call's result; a call bigger than one cycle share runs as chunks (see the class)."""
        lengths = [len(tokens) + 1 for tokens, _ in call.data]  # N input tokens and the last target
        groups = cut_rows(lengths, self.cycle_limits)
        if len(groups) == 1:
            return self._enqueue(call.model_id, user_id, True, call, self.cycle_limits.rows_cost(lengths))
        future = asyncio.get_running_loop().create_future()
        try:  # before any chunk trains: a chunk must not fail on a datum after others trained
            check_datums(call.data, self.limits.get("vocab_size"), self.limits.get("context"))
        except DatumError as error:
            future.set_exception(UserError(str(error)))
            return future
        chunks = []
        for rows in map(sorted, groups):
            chunk = dataclasses.replace(call, data=[call.data[row] for row in rows])
            chunks.append((rows, self._enqueue(call.model_id, user_id, True, chunk,
                                               self.cycle_limits.rows_cost([lengths[row] for row in rows]))))
        asyncio.ensure_future(_join_chunks(chunks, future))
        # The caller gone (its model unloaded): the chunks not run yet are dropped.
        future.add_done_callback(lambda done: done.cancelled() and [chunk.cancel() for _, chunk in chunks])
        return future

    def op(self, method: str, model_id: str, *args: Any, user_id: int | None = None) -> asyncio.Future:
        return self._enqueue(model_id, user_id, False, (method, model_id, args))

    async def remove(self, model_id: str) -> None:
        self.models.discard(model_id)
        if self._loop_task is None:  # the worker never came up: the model was never added
            return
        with contextlib.suppress(Exception):
            await self.op("remove_model", model_id)

    def _enqueue(self, model_id: str, user_id: int | None, is_call: bool, item: Any,
                 cost: float = 0.0) -> asyncio.Future:
        future = asyncio.get_running_loop().create_future()
        if self.dead_error is not None:
            future.set_exception(self.dead_error)
        else:
            self._waiting.append(_Waiting(model_id, user_id, is_call, item, future, cost))
            self._wake.set()
        return future

    def _take_cycle(self) -> list[_Waiting]:
        """Of each user, the first waiting request of each of their models, while the user's
        share stays within one (their first is always taken); the rest wait for a later cycle.
        Requests whose caller is gone (a model unloaded, a chunked call that failed) are dropped."""
        taken, later, models = [], [], set()
        share: dict[int | None, float] = {}
        for request in self._waiting:
            if request.future.done():
                continue
            user_share = share.get(request.user_id)
            fits = user_share is None or user_share + request.cost <= 1.0
            if request.model_id in models or not fits:
                later.append(request)
            else:
                taken.append(request)
                share[request.user_id] = (user_share or 0.0) + request.cost
            models.add(request.model_id)  # a model's later requests wait behind this one
        self._waiting = later
        return taken

    def _send(self, requests: list[_Waiting]) -> _Cycle:
        calls = [r for r in requests if r.is_call]
        ops = [r for r in requests if not r.is_call]
        cycle = _Cycle({r.model_id for r in requests}, [r.future for r in calls + ops])  # the worker's answer order
        ref = self.actor.cycle.remote([r.item for r in calls], [r.item for r in ops])
        cycle.task = asyncio.create_task(self._settle(cycle, ref))
        self._cycles.append(cycle)
        return cycle

    async def _settle(self, cycle: _Cycle, ref: Any) -> None:
        try:
            fb, done = await await_ref(ref)
        except Exception as error:  # the worker died (or a Ray failure): every request of the cycle
            if isinstance(error, RayActorError):  # its models are lost; a new LoRA model starts a new worker
                self.dead_error = error
            for future in cycle.futures:
                if not future.done():
                    future.set_exception(error)
            return
        finally:
            self._cycles.remove(cycle)
            self._wake.set()
        for future, outcome in zip(cycle.futures, list(fb) + list(done)):
            if future.done():  # its model was unloaded meanwhile
                continue
            if "result" in outcome:
                future.set_result(outcome["result"])
            elif outcome["category"] == "user":
                future.set_exception(UserError(outcome["error"]))
            else:
                future.set_exception(RuntimeError(outcome["error"]))

    async def _serve(self) -> None:
        running: _Cycle | None = None
        while True:
            self._wake.clear()
            if running is not None and running.task.done():
                running = None
            if self.dead_error is not None:
                for request in self._waiting:
                    if not request.future.done():  # else its model was unloaded meanwhile
                        request.future.set_exception(self.dead_error)
                self._waiting = []
            elif self._waiting and (running is None or any(r.model_id in running.models for r in self._waiting)):
                requests = self._take_cycle()
                if not requests:  # only callers that are gone were waiting
                    continue
                sent = self._send(requests)
                if running is not None:  # the next one is formed once the worker has started this one
                    await running.task
                running = sent
                continue
            await self._wake.wait()

    async def stop(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
        waiting = [future for cycle in self._cycles for future in cycle.futures]
        for future in waiting + [request.future for request in self._waiting]:
            if not future.done():
                future.set_exception(RuntimeError("the base model's worker stopped"))
        if self.actor is not None:
            with contextlib.suppress(Exception):
                ray.kill(self.actor, no_restart=True)
        if self.offload_dir is not None:  # its models' offloaded adapters went with them
            shutil.rmtree(self.offload_dir, ignore_errors=True)


async def _join_chunks(chunks: list[tuple[list[int], asyncio.Future]], future: asyncio.Future) -> None:
    """``future`` gets the chunks' results as one call's: outputs in the call's row order, metrics
    summed (every Tinker metric is a sum); or the first chunk's failure, when the chunks not
    started yet are dropped (their futures cancelled)."""
    results = []
    try:
        for rows, chunk in chunks:
            results.append((rows, await chunk))
    except BaseException as error:  # noqa: BLE001 - reported to the caller
        for _, chunk in chunks:
            chunk.cancel()
        ran = len(results)
        if not future.done():
            if isinstance(error, asyncio.CancelledError):
                future.cancel()
            elif ran and type(error) in (UserError, RuntimeError):  # the worker's answer: say what trained
                future.set_exception(type(error)(f"{error} (in chunk {ran + 1} of {len(chunks)} of this request; "
                                                 f"the {ran} before it trained: their gradients are accumulated)"))
            else:
                future.set_exception(error)
        return
    if not future.done():
        future.set_result(join_pieces(results))


@dataclass(order=True)
class _Op:
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
        self._heap: list[_Op] = []
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
        heapq.heappush(self._heap, _Op(seq_id if seq_id is not None else 0, next(self._arrivals), request_id, run))
        self.last_used = time.monotonic()
        self._changed.set()

    def skip(self, seq_id: int) -> None:
        """``seq_id`` was refused at submit: nothing will come with that number (numbers
        outside the window were never waited for)."""
        if self._next_seq <= seq_id < self._next_seq + SEQ_WINDOW:
            self._skipped.add(seq_id)
            self._changed.set()

    async def next_op(self, gap_s: float) -> _Op:
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

    def drain(self) -> list[_Op]:
        ops, self._heap = self._heap, []
        return ops


@dataclass
class HostSettings:
    gap_s: float = 5.0  # how long a hole in a model's seq_ids is waited for
    strategy: str = "local"  # the backend of every model: local | fsdp
    device: str = "auto"
    ranks: int = 1  # FSDP ranks of a shared LoRA base worker or a fully fine-tuned model
    max_resident_adapters: int | None = None  # per shared base worker; the rest wait on disk
    offload_dir: str | None = None  # where (None: a temporary folder)
    # What one batched pass of a shared base worker may hold (its memory), and one user's share
    # of a cycle (how long others wait behind it); both in padded tokens and attention cells.
    pass_limits: PassLimits = field(default_factory=lambda: PassLimits.for_tokens(4096))
    cycle_limits: PassLimits = field(default_factory=lambda: PassLimits.for_tokens(1024))
    # The sampler's batch caps (engine/tinker/sample_scheduler.SchedulerLimits fields) and its
    # LoRA adapter cache's bytes (adapter_cache_bytes, which TinkerSampler takes out); what may
    # wait for it is bounded per user by the API (TinkerSettings.max_pending_*).
    sampler_limits: dict[str, float] = field(default_factory=dict)


class TinkerHost:
    def __init__(self, state: TinkerState, futures: FutureTable, settings: HostSettings):
        self.state = state
        self.futures = futures
        self.settings = settings
        self._models: dict[str, ModelSlot] = {}
        self._bases: dict[BackendSpec, SharedBase] = {}  # by the base's spec (BackendSpec.shared_base())
        self._base_memory: dict[BackendSpec, int] = {}  # admitted, worker not made yet
        self._samplers: dict[str, asyncio.Future] = {}
        if settings.offload_dir is not None:  # what workers of an earlier server process left there
            shutil.rmtree(settings.offload_dir, ignore_errors=True)

    # -- models ------------------------------------------------------------------------
    def start_model(self, model_id: str, user_id: int, spec: BackendSpec, request_id: str,
                    answer: dict[str, Any], load: tuple[str, bool] | None = None, memory_bytes: int = 0) -> None:
        """Start the model's backend in the background (a ``multi_adapter`` spec: its adapter in
        its base's shared worker; otherwise an actor of its own); the create future gets
        ``answer`` once it is up (and, with ``load``, has loaded that checkpoint folder). The
        model holds ``memory_bytes`` of the admission budget until it is gone."""
        slot = ModelSlot(model_id, user_id, memory_bytes)
        self._models[model_id] = slot
        slot.task = asyncio.create_task(self._serve(slot, spec, request_id, answer, load))

    async def _start(self, slot: ModelSlot, spec: BackendSpec, load: tuple[str, bool] | None) -> None:
        if spec.multi_adapter:
            base = self._shared_base(spec)
            base.models.add(slot.model_id)  # from now on the worker stays up for it
            try:
                await asyncio.shield(base.started)
                await base.op("add_model", slot.model_id, spec.lora, user_id=slot.user_id)
            except BaseException:  # it failed, or the model was unloaded while it came up
                await self._release(base, slot.model_id)
                raise
            slot.actor = SharedAdapter(base, slot.model_id, slot.user_id)
        else:
            from opentinker.engine.tinker.model_worker import TinkerModelWorker

            gpus = _gpus() if spec.strategy == "local" else 0
            slot.actor = OwnWorker(ray.remote(TinkerModelWorker).options(
                num_cpus=0, num_gpus=gpus, max_concurrency=1).remote(spec))
            await await_ref(slot.actor.actor.ready.remote())
        if load is not None:
            await slot.actor.load_state(*load)

    def shared_base_started(self, spec: BackendSpec) -> bool:
        """Whether the base's weights are held (or admitted) already."""
        key = spec.shared_base()
        return key in self._bases or key in self._base_memory

    def _shared_base(self, spec: BackendSpec) -> SharedBase:
        """The shared worker of the model's base (started by the first LoRA model of it; the
        last model to leave stops it)."""
        key = spec.shared_base()
        base = self._bases.get(key)
        if base is not None and base.dead_error is not None:  # its models learn it at their next request
            self._base_memory[key] = base.memory_bytes
            self._bases.pop(key)
            asyncio.ensure_future(base.stop())
            base = None
        if base is None:
            base = self._bases[key] = SharedBase(key, self._base_memory.pop(key, 0))
            base.started = asyncio.ensure_future(base.start(self.settings))
            base.started.add_done_callback(lambda done: done.cancelled() or done.exception())  # awaited by models
        return base

    def reserve_base_memory(self, spec: BackendSpec, memory_bytes: int) -> None:
        """The admission estimate of the base weights a new shared worker will hold."""
        key = spec.shared_base()
        if key not in self._bases:
            self._base_memory[key] = memory_bytes

    def shared_bases(self) -> list[SharedBase]:
        return list(self._bases.values())

    def base_memory_bytes(self) -> int:
        """What the shared workers' base weights hold of the admission budget (started or starting)."""
        return sum(base.memory_bytes for base in self._bases.values()) + sum(self._base_memory.values())

    async def _release(self, base: SharedBase, model_id: str) -> None:
        """``model_id`` leaves ``base``; the last model to leave stops the worker."""
        await base.remove(model_id)
        if not base.models and self._bases.get(base.key) is base:
            self._bases.pop(base.key, None)
            await base.stop()

    async def _serve(self, slot: ModelSlot, spec: BackendSpec, request_id: str, answer: dict[str, Any],
                     load: tuple[str, bool] | None) -> None:
        try:
            await self._start(slot, spec, load)
        except Exception as error:  # the model never came up: its create future and queue fail
            message, category = failure(error)
            self.state.set_model_state(slot.model_id, "failed", message)
            self.futures.fail(request_id, message, category)
            slot.ready.set_exception(UserError(message))
            self._fail_queue(slot, message)
            await self._close(slot)
            self._models.pop(slot.model_id, None)  # it holds no admission any more
            return
        self.state.set_model_state(slot.model_id, "ready")
        self.futures.resolve(request_id, answer)
        slot.ready.set_result(True)
        while True:
            while len(slot.handed_over) >= MAX_HANDED_OVER:
                await asyncio.wait(list(slot.handed_over.values()), return_when=asyncio.FIRST_COMPLETED)
            op = await slot.next_op(self.settings.gap_s)
            before = slot.actor.calls_sent
            running = slot.handed_over[op.request_id] = asyncio.create_task(self._run(slot, op))
            await asyncio.sleep(0)  # the op's first step hands its call to the worker
            if slot.actor.calls_sent == before:  # it has not (yet): the next one must not overtake it
                await asyncio.wait([running])

    async def _run(self, slot: ModelSlot, op: _Op) -> None:
        try:
            payload, content_type = await op.run(slot.actor)
        except UserError as error:
            self.futures.fail(op.request_id, str(error), "user")
            return
        except Exception as error:
            message, category = failure(error)
            self.futures.fail(op.request_id, message, category)
            if isinstance(error, RayActorError) and self._models.get(slot.model_id) is slot:
                self.state.set_model_state(slot.model_id, "lost", message)
                slot.task.cancel()  # nothing more is handed over; what was fails with the worker
                self._fail_queue(slot, message)
                self._models.pop(slot.model_id, None)
            return
        finally:
            slot.handed_over.pop(op.request_id, None)
            slot.last_used = time.monotonic()
        self.futures.resolve(op.request_id, payload, content_type)
        self.state.touch_model(slot.model_id)

    def _fail_queue(self, slot: ModelSlot, message: str) -> None:
        for op in slot.drain():
            self.futures.fail(op.request_id, message, "server")

    def slot(self, model_id: str) -> ModelSlot | None:
        return self._models.get(model_id)

    def live_models(self) -> list[ModelSlot]:
        """Every model that holds an actor (loading or ready), whoever's."""
        return list(self._models.values())

    def user_pending(self, user_id: int) -> int:
        """Requests of ``user_id``'s models accepted and not finished."""
        return sum(slot.pending for slot in self._models.values() if slot.user_id == user_id)

    def submit(self, model_id: str, seq_id: int | None, request_id: str, run: Operation) -> None:
        self._models[model_id].push(seq_id, request_id, run)

    def skip(self, model_id: str, seq_id: int | None) -> None:
        slot = self._models.get(model_id)
        if slot is not None and seq_id is not None:
            slot.skip(seq_id)

    async def unload(self, model_id: str, reason: str = "the model was unloaded") -> None:
        slot = self._models.pop(model_id, None)
        if slot is None:
            return
        if slot.task is not None:
            slot.task.cancel()
            with contextlib.suppress(BaseException):
                await slot.task
        for request_id, running in list(slot.handed_over.items()):
            running.cancel()
            self.futures.fail(request_id, reason, "server")
        self._fail_queue(slot, reason)
        await self._close(slot)
        self.state.set_model_state(model_id, "unloaded", reason)

    async def _close(self, slot: ModelSlot) -> None:
        """The model's worker stops, or its adapter leaves the shared one."""
        if isinstance(slot.actor, SharedAdapter):
            await self._release(slot.actor.base, slot.model_id)
        elif slot.actor is not None:
            await slot.actor.close()

    # -- samplers ----------------------------------------------------------------------
    async def sampler(self, base_model: str, model_path: str, trust_remote_code: bool) -> Any:
        """The sampler actor for ``base_model`` (started on first use, then shared)."""
        pending = self._samplers.get(base_model)
        if pending is None:
            pending = asyncio.ensure_future(self._start_sampler(model_path, trust_remote_code))
            self._samplers[base_model] = pending
        try:
            return await asyncio.shield(pending)
        except Exception:
            self._samplers.pop(base_model, None)  # the next request tries again
            raise

    def started_samplers(self) -> dict[str, Any]:
        """The sampler actors that are up, by base model name."""
        return {name: pending.result() for name, pending in self._samplers.items()
                if pending.done() and not pending.cancelled() and pending.exception() is None}

    async def _start_sampler(self, model_path: str, trust_remote_code: bool) -> Any:
        from opentinker.engine.tinker.sampler_worker import TinkerSampler

        gpus = _gpus()
        # An async actor: every waiting call is a coroutine, its rows wait in the scheduler (not in
        # Ray's queue), so no thread count caps how many users are served fairly.
        actor = ray.remote(TinkerSampler).options(num_cpus=0, num_gpus=gpus, max_concurrency=100_000).remote(
            model_path, trust_remote_code, 0, self.settings.device, dict(self.settings.sampler_limits))
        await await_ref(actor.ready.remote())
        return actor

    async def shutdown(self) -> None:
        for model_id in list(self._models):
            await self.unload(model_id, "the server is shutting down")
        for pending in self._samplers.values():
            if pending.done() and not pending.exception():
                with contextlib.suppress(Exception):
                    ray.kill(pending.result(), no_restart=True)
            else:
                pending.cancel()
        self._samplers.clear()
        for base in list(self._bases.values()):
            await base.stop()
        self._bases.clear()


def json_result(payload: Any) -> tuple[Any, str]:
    return payload, JSON
