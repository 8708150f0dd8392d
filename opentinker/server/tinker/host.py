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
:data:`~opentinker.server.tinker.model_slot.MAX_HANDED_OVER` at once), so the worker goes from an ``optim_step`` queued behind a
``forward_backward`` straight on, without a round trip through the server between them.
The worker runs what it is handed in the order it was handed over.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import time
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.exceptions import RayActorError

from opentinker.engine.backend.spec import BackendSpec
from opentinker.engine.tinker.pass_plan import PassLimits
from opentinker.server.tinker.futures import JSON, FutureTable
from opentinker.server.tinker.model_slot import MAX_HANDED_OVER, ModelSlot, Operation, QueuedOp
from opentinker.server.tinker.state import TinkerState
from opentinker.server.tinker.workers import (
    OwnWorker, SharedAdapter, SharedBase, UserError, _gpus, await_ref, failure,
)

__all__ = ["HostSettings", "TinkerHost", "json_result"]


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

    async def _run(self, slot: ModelSlot, op: QueuedOp) -> None:
        self.futures.started(op.request_id)  # handed to the worker: its trace's start
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
