"""The Ray side of the Tinker API: one model worker actor per training client, run strictly in
its ``seq_id`` order, and one sampler actor per base model.

The SDK sends a training client's requests one after another, but a ``forward_backward``
split into chunks arrives concurrently, first chunk last. Each model therefore keeps a heap of
requests by ``seq_id`` and runs the next one only when it is the next number, or when a gap
has stayed unfilled for ``gap_s`` (a request refused at submit never arrives; one whose number
is known is skipped at once). Results and failures go to the :class:`FutureTable`.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.exceptions import RayActorError, RayTaskError

from opentinker.server.jobs import ray_failure_reason
from opentinker.server.tinker.futures import JSON, FutureTable
from opentinker.server.tinker.state import TinkerState

log = logging.getLogger("opentinker.server.tinker")

#: An operation on a model's actor: returns (payload, content type) for the future.
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
        self.running = False
        self.task: asyncio.Task | None = None

    @property
    def next_seq(self) -> int:
        """The number the model runs next."""
        return self._next_seq

    @property
    def pending(self) -> int:
        """Requests accepted and not finished: waiting in the queue, or running."""
        return len(self._heap) + int(self.running)

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
    ranks: int = 1  # FSDP ranks per model
    # The sampler's batch caps (engine/tinker/sample_scheduler.SchedulerLimits fields); what may
    # wait for it is bounded per user by the API (TinkerSettings.max_pending_*).
    sampler_limits: dict[str, float] = field(default_factory=dict)


class TinkerHost:
    def __init__(self, state: TinkerState, futures: FutureTable, settings: HostSettings):
        self.state = state
        self.futures = futures
        self.settings = settings
        self._models: dict[str, ModelSlot] = {}
        self._samplers: dict[str, asyncio.Future] = {}

    # -- models ------------------------------------------------------------------------
    def start_model(self, model_id: str, user_id: int, worker_spec: Any, request_id: str,
                    answer: dict[str, Any], load: tuple[str, bool] | None = None, memory_bytes: int = 0) -> None:
        """Start the model's actor in the background; the create future gets ``answer``
        once it is up (and, with ``load``, has loaded that checkpoint folder). The model
        holds ``memory_bytes`` of the admission budget until it is gone."""
        slot = ModelSlot(model_id, user_id, memory_bytes)
        self._models[model_id] = slot
        slot.task = asyncio.create_task(self._serve(slot, worker_spec, request_id, answer, load))

    async def _start(self, slot: ModelSlot, worker_spec: Any, load: tuple[str, bool] | None) -> None:
        from opentinker.engine.tinker.model_worker import TinkerModelWorker

        gpus = 1 if self.settings.strategy == "local" and ray.cluster_resources().get("GPU", 0) > 0 else 0
        slot.actor = ray.remote(TinkerModelWorker).options(num_cpus=0, num_gpus=gpus, max_concurrency=1).remote(
            worker_spec)
        await await_ref(slot.actor.ready.remote())
        if load is not None:
            await await_ref(slot.actor.load_state.remote(*load))

    async def _serve(self, slot: ModelSlot, worker_spec: Any, request_id: str, answer: dict[str, Any],
                     load: tuple[str, bool] | None) -> None:
        try:
            await self._start(slot, worker_spec, load)
        except Exception as error:  # the model never came up: its create future and queue fail
            message, category = failure(error)
            self.state.set_model_state(slot.model_id, "failed", message)
            self.futures.fail(request_id, message, category)
            slot.ready.set_exception(UserError(message))
            self._fail_queue(slot, message)
            self._kill(slot)
            self._models.pop(slot.model_id, None)  # it holds no admission any more
            return
        self.state.set_model_state(slot.model_id, "ready")
        self.futures.resolve(request_id, answer)
        slot.ready.set_result(True)
        while True:
            op = await slot.next_op(self.settings.gap_s)
            slot.running = True
            try:
                payload, content_type = await op.run(slot.actor)
            except UserError as error:
                self.futures.fail(op.request_id, str(error), "user")
                continue
            except Exception as error:
                message, category = failure(error)
                self.futures.fail(op.request_id, message, category)
                if isinstance(error, RayActorError):
                    self.state.set_model_state(slot.model_id, "lost", message)
                    self._fail_queue(slot, message)
                    self._models.pop(slot.model_id, None)
                    return
                continue
            finally:
                slot.running = False
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
        self._fail_queue(slot, reason)
        self._kill(slot)
        self.state.set_model_state(model_id, "unloaded", reason)

    @staticmethod
    def _kill(slot: ModelSlot) -> None:
        if slot.actor is not None:
            with contextlib.suppress(Exception):
                ray.kill(slot.actor, no_restart=True)

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

        gpus = 1 if ray.cluster_resources().get("GPU", 0) > 0 else 0
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


def json_result(payload: Any) -> tuple[Any, str]:
    return payload, JSON
