"""The rollout engine interface: token ids in, token ids and logprobs out.

Backends (transformers on CPU, vLLM on GPU) implement :class:`RolloutEngine`. Text never
goes through an engine: callers tokenize once and keep the ids the model produced, so
what is trained on is exactly what was sampled.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import queue
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, Union, runtime_checkable

import torch

FinishReason = Literal["stop", "length"]
#: New weights: a mapping, or an iterable of buckets of ``(name, tensor)`` pairs (what a
#: training backend's ``weights()`` yields), consumed one bucket at a time.
WeightSource = Union[Mapping[str, torch.Tensor], Iterable[Iterable[tuple[str, torch.Tensor]]]]


def named_tensors(source: WeightSource) -> Iterator[tuple[str, torch.Tensor]]:
    """The ``(name, tensor)`` pairs of a :data:`WeightSource`, in order."""
    if isinstance(source, Mapping):
        yield from source.items()
        return
    for bucket in source:
        yield from bucket


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one completion.

    ``temperature=0`` is greedy. ``top_k <= 0`` and ``top_p == 1`` disable those filters.
    ``stop_token_ids`` end a completion in addition to the engine's end-of-sequence ids
    (the stop token is kept in the output, as the model did produce it); ``stop`` strings end
    it once the decoded text contains one (the tokens that spelled it are kept). ``seed`` makes a
    request reproducible on its own; without it the engine's seeded generator is used.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 64
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    seed: int | None = None
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if self.max_tokens < 1:
            raise ValueError(f"SamplingParams.max_tokens must be >= 1, got {self.max_tokens}")


@dataclass(frozen=True)
class Completion:
    """One sampled continuation.

    ``logprobs[i]`` is the log-probability of ``token_ids[i]`` under the model's
    distribution at the sampling temperature, before top-k/top-p filtering; at
    temperature 1 it equals what the policy worker computes for the same tokens.
    """

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason


@runtime_checkable
class RolloutEngine(Protocol):
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams],
    ) -> list[Completion]:
        """One completion per prompt, in order."""

    def update_weights(self, weights: WeightSource) -> None:
        """Load new policy weights (after a training step): every tensor of the model, else an error."""

    def sleep(self) -> None:
        """Free accelerator memory between rollout phases (no-op on CPU)."""

    def wake(self) -> None:
        """Undo :meth:`sleep`."""

    def rng_state(self) -> Any:
        """The sampler's random state, for a checkpoint (a resumed run samples alike), or None
        when the engine has none to save (vLLM seeds each request)."""

    def set_rng_state(self, state: Any) -> None:
        """Restore what :meth:`rng_state` gave (None: nothing to restore)."""

    def close(self) -> None:
        """Release the engine's processes and memory; the engine is unusable afterwards."""


@runtime_checkable
class AsyncCompletions(Protocol):
    """Anything an agent loop can ask for one completion at a time: a :class:`RequestBatcher`,
    or an engine that batches concurrent requests itself (vLLM)."""

    async def agenerate(self, prompt: Sequence[int], params: SamplingParams) -> Completion: ...


@dataclass
class _Request:
    prompt: list[int]
    params: SamplingParams
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)


class RequestBatcher:
    """Batches requests that arrive concurrently into one ``engine.generate`` call.

    Agent loops each ask for one completion at a time; a single worker thread drains
    whatever is queued (waiting ``gather_window_s`` for stragglers) and generates it as one
    batch, so concurrent loops share the engine's batching. Callable from threads
    (:meth:`submit`) and from asyncio (:meth:`agenerate`).
    """

    def __init__(self, engine: RolloutEngine, max_batch_size: int = 256, gather_window_s: float = 0.005):
        self.engine = engine
        self.max_batch_size = max_batch_size
        self.gather_window_s = gather_window_s
        self._queue: queue.Queue[_Request | None] = queue.Queue()
        self._lock = threading.Lock()  # held while the engine runs, so weight updates wait
        self._thread = threading.Thread(target=self._run, name="rollout-batcher", daemon=True)
        self._thread.start()
        self.batch_sizes: list[int] = []  # observed batch sizes, for metrics and tests

    def submit(self, prompt: Sequence[int], params: SamplingParams) -> concurrent.futures.Future:
        # A prompt with pictures (an ImagePrompt, a list) goes as it is: a copy would drop them.
        request = _Request(prompt if isinstance(prompt, list) and hasattr(prompt, "images") else list(prompt), params)
        self._queue.put(request)
        return request.future

    async def agenerate(self, prompt: Sequence[int], params: SamplingParams) -> Completion:
        return await asyncio.wrap_future(self.submit(prompt, params))

    def update_weights(self, weights: WeightSource) -> None:
        with self._lock:
            self.engine.update_weights(weights)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=10)

    def _take_batch(self, first: _Request) -> tuple[list[_Request], bool]:
        batch, closing = [first], False
        while len(batch) < self.max_batch_size:
            try:
                request = self._queue.get(timeout=self.gather_window_s)
            except queue.Empty:
                break
            if request is None:
                closing = True
                break
            batch.append(request)
        return batch, closing

    def _run(self) -> None:
        while True:
            first = self._queue.get()
            if first is None:
                return
            batch, closing = self._take_batch(first)
            self.batch_sizes.append(len(batch))
            try:
                with self._lock:
                    completions = self.engine.generate([r.prompt for r in batch], [r.params for r in batch])
                for request, completion in zip(batch, completions):
                    request.future.set_result(completion)
            except BaseException as error:  # every waiter must hear about the failure
                for request in batch:
                    if not request.future.done():
                        request.future.set_exception(error)
            if closing:
                return
