"""The workers that hold Tinker models, behind one handle interface: a fully fine-tuned model's
own actor (:class:`OwnWorker`) or an adapter in its base model's shared worker
(:class:`SharedAdapter` of a :class:`SharedBase`, which gathers its models' requests into
fair cycles of batched passes). Also how an operation's failure is told to the client
(:func:`failure`)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import shutil
from collections.abc import Awaitable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import ray
from ray.exceptions import RayActorError, RayTaskError

from opentinker.engine.backend.spec import BackendSpec
from opentinker.engine.tinker.datum_rules import DatumError, check_datums
from opentinker.engine.tinker.pass_plan import PassLimits, cut_rows, join_pieces
from opentinker.server.runner_reports import ray_failure_reason

if TYPE_CHECKING:
    from opentinker.server.tinker.host import HostSettings

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

    async def start(self, settings: HostSettings) -> None:
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
        lengths = [len(tokens) + 1 + self._picture_patches(tokens) for tokens, _ in call.data]  # N inputs, the last target
        groups = cut_rows(lengths, self.cycle_limits)
        if len(groups) == 1:
            return self._enqueue(call.model_id, user_id, True, call, self.cycle_limits.rows_cost(lengths))
        future = asyncio.get_running_loop().create_future()
        try:  # before any chunk trains: a chunk must not fail on a datum after others trained
            check_datums(call.data, self.limits.get("vocab_size"), self.limits.get("context"),
                         self.limits.get("image_token_id"))
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

    def _picture_patches(self, tokens: Any) -> int:
        """The vision tower's positions of a datum's pictures (0 for a text model): a cycle's
        share and a chunk's cut count them as the worker's passes do."""
        image_token = self.limits.get("image_token_id")
        if image_token is None:
            return 0
        return int((np.asarray(tokens) == image_token).sum()) * int(self.limits.get("patches_per_image_token") or 0)

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
