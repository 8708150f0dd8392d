"""Sampling for the Tinker API: one :class:`TinkerSampler` Ray actor per served base model.

A request names the weights to sample from: the base model, or a sampler snapshot that a
training client saved with ``save_weights_for_sampler``: a LoRA model's adapter alone, applied
to that call's rows only (:mod:`.row_adapters`: rows of many users' adapters are decoded in one
batch on the unchanged base weights), or a fully fine-tuned model's full weights (loaded when
their turn comes). Each request's samples are rows of continuously batched decode loops
(:mod:`.sample_scheduler`): they join a running batch at the next step, users are served in
turn by the time their decoding took, and full weights are swapped between steps when another
snapshot's user is due (the rows of the one swapped out wait, their caches kept). Prompt logprobs (and top-k) come from one forward pass
of the prompt, as do the draws of ``prompt_alt_tokens_k``; the top-k of sampled tokens come from
each decode step's logits (:mod:`.token_alternatives`).

Snapshots are named by folder: every save writes a folder of its own (a name saved again,
after a delete or with ``overwrite``, gets a new one), so a folder's content never changes and
the loaded adapters (:class:`~.row_adapters.AdapterCache`, bounded in bytes) and full weights
are kept by folder.
"""

from __future__ import annotations

import asyncio
import math
import threading
from pathlib import Path
from typing import Any

import torch

from opentinker.engine.cpu_threads import use_node_cores
from opentinker.engine.rollout.base import SamplingParams
from opentinker.engine.tinker import default_max_tokens
from opentinker.engine.tinker.model_worker import SAMPLER_WEIGHTS_FILE
from opentinker.engine.tinker.row_adapters import (
    AdapterCache,
    LoadedAdapter,
    RowAdapters,
    adapter_bytes,
    is_adapter_folder,
)
from opentinker.engine.tinker.datums import datum_pictures
from opentinker.engine.tinker.sample_scheduler import SampleScheduler, SampleWork, SchedulerLimits
from opentinker.engine.tinker.token_alternatives import SampleTopk, draws_generator, prompt_alternatives
from opentinker.engine.vision import ImagePrompt, images_of, sequence_positions, vision_kwargs
from opentinker.images import ImageLimits

BASE = ""  # the snapshot key of the base model's own weights
ADAPTERS_KEPT = 256  # LoRA snapshots kept loaded at most, however small
ADAPTER_CACHE_BYTES = 2**30  # ... and their bytes at most (the server: --tinker-sampler-adapter-cache-mb)


class TinkerSampler:
    """``limits``: the scheduler's caps (:class:`SchedulerLimits` fields) and
    ``adapter_cache_bytes``, the budget of loaded LoRA adapters."""

    def __init__(self, model_path: str | None, trust_remote_code: bool = False, seed: int = 0, device: str = "auto",
                 limits: dict[str, Any] | None = None):
        from opentinker.engine.model_loading import pick_device, resolve_model_path
        from opentinker.engine.rollout.transformers_engine import TransformersRolloutEngine
        from opentinker.engine.serving import context_length

        use_node_cores()
        model_path = resolve_model_path(model_path)  # None: the embedded tiny model
        self.engine = TransformersRolloutEngine.from_pretrained(
            model_path, device=pick_device(device), trust_remote_code=trust_remote_code, seed=seed)
        model = self.engine.model
        self.max_length = context_length(self.engine)
        self.vocab_size = int(model.config.get_text_config().vocab_size)
        # A vision-language model's: prompts' pictures, already read under the server's bounds.
        self.pictures = datum_pictures(model_path, trust_remote_code, ImageLimits.checked_upstream())
        # The base weights stay at hand so that a base-model request after a snapshot's is
        # served without reading the model folder again.
        self._base = {name: tensor.detach().cpu().clone() for name, tensor in model.state_dict().items()}
        self.loaded = BASE
        self.row_adapters = RowAdapters(model)  # used on the scheduler's thread only
        limits = dict(limits or {})
        self.adapters = AdapterCache(
            int(limits.pop("adapter_cache_bytes", ADAPTER_CACHE_BYTES)), ADAPTERS_KEPT,
            lambda folder: LoadedAdapter(folder, model.device, model.dtype),
            lambda folder: adapter_bytes(folder, model.dtype), flag="--tinker-sampler-adapter-cache-mb")
        self.scheduler = SampleScheduler(self.engine, self._load, self._prompt_scores,
                                         SchedulerLimits(**limits), apply_adapters=self.row_adapters.set)
        threading.Thread(target=self.scheduler.serve_forever, name="tinker-sampler", daemon=True).start()

    def ready(self) -> dict[str, Any]:
        return {"max_length": self.max_length, "vocab_size": self.vocab_size}

    def stats(self) -> dict[str, Any]:
        """What the scheduler holds now, and this process's memory (for operators and tests)."""
        import psutil

        scheduler = self.scheduler  # counters only: the scheduler's thread owns its structures
        return {"live_rows": scheduler.live_rows, "live_tokens": scheduler.live_tokens,
                "waiting_samples": scheduler.waiting_samples, "decode_steps": scheduler.steps,
                "lanes": len(scheduler.lanes),
                "limits": dict(scheduler.limits.__dict__), "adapter_cache": self.adapters.stats(),
                "rss_bytes": psutil.Process().memory_info().rss}

    async def sample(self, request: dict[str, Any]) -> dict[str, Any]:
        """Serves one call: ``snapshot`` (a folder, or ``BASE``), ``prompt``, ``num_samples``,
        ``params`` (``SamplingParams`` fields; ``max_tokens`` None: up to the context's end, at
        most ``DEFAULT_MAX_TOKENS``), ``prompt_logprobs``, ``topk_prompt``, ``last_n``,
        ``topk_sample`` (top-k of each sampled token), ``alt_k`` (draws at each prompt position)
        and ``user`` (whose share of the batch it takes). Sample i uses seed+i when seeded."""
        prompt = list(request["prompt"])
        files = request.get("pictures") or ()
        if files:
            if self.pictures is None:
                raise ValueError("prompt: image chunks, but this model is not a vision-language model")
            prompt = ImagePrompt(prompt, self.pictures.sequence_images(prompt, files))
        params = dict(request["params"])
        if params.get("max_tokens") is None:
            params["max_tokens"] = default_max_tokens(len(prompt), self.max_length)
        base = SamplingParams(**params)
        if prompt and max(prompt) >= self.vocab_size:
            raise ValueError(f"prompt: token id {max(prompt)} is past the model's vocabulary ({self.vocab_size} ids)")
        length = len(prompt) + base.max_tokens
        if length > self.max_length:
            raise ValueError(f"prompt ({len(prompt)} tokens) + max_tokens ({base.max_tokens}) is {length}, past the "
                             f"model's context of {self.max_length} tokens")
        per_sample = [SamplingParams(**{**base.__dict__, "seed": None if base.seed is None else base.seed + i})
                      for i in range(int(request.get("num_samples", 1)))]
        loop = asyncio.get_running_loop()
        done: asyncio.Future = loop.create_future()

        def on_done(outcome: Any) -> None:  # called on the scheduler's thread
            loop.call_soon_threadsafe(_settle, done, outcome)

        scored = {name: request.get(name) for name in ("prompt_logprobs", "topk_prompt", "last_n", "alt_k")}
        scored.update(temperature=base.temperature, seed=base.seed)
        topk_sample = int(request.get("topk_sample") or 0)
        sample_topk = SampleTopk(topk_sample, len(per_sample)) if topk_sample else None
        snapshot = request.get("snapshot") or BASE
        held = await self.adapters.acquire(snapshot) if snapshot != BASE and is_adapter_folder(snapshot) else None
        try:
            work = SampleWork(user=request.get("user"), snapshot=BASE if held is not None else snapshot,
                              prompt=prompt, params=per_sample, on_done=on_done,
                              adapter=None if held is None else held.adapter, sample_topk=sample_topk,
                              prompt_options=scored if scored["prompt_logprobs"] or scored["topk_prompt"]
                              or scored["alt_k"] else None)
            self.scheduler.submit(work)
            completions, scores = await done
        finally:
            if held is not None:
                self.adapters.release(held)
        result: dict[str, Any] = {"sequences": [(c.token_ids, c.logprobs, c.finish_reason) for c in completions]}
        if sample_topk is not None:
            result["sample_topk"] = [sample_topk.matrices(i, len(c.token_ids)) for i, c in enumerate(completions)]
        result.update(scores or {})
        return result

    async def evict(self, folder: str) -> None:
        """A deleted snapshot's adapter leaves the cache (once no call holds it)."""
        self.adapters.evict(folder)

    # -- on the scheduler's thread ------------------------------------------------------
    def _load(self, snapshot: str) -> None:
        if snapshot == self.loaded:
            return
        if snapshot == BASE:
            self.engine.update_weights(self._base)
        else:
            self.engine.update_weights(torch.load(Path(snapshot) / SAMPLER_WEIGHTS_FILE, map_location="cpu",
                                                   weights_only=True, mmap=True))
        self.loaded = snapshot

    @torch.no_grad()
    def _prompt_scores(self, work: SampleWork) -> dict[str, Any]:
        """Logprob of each prompt token given the ones before it (NaN at 0 and before the last
        ``last_n``), with ``topk_prompt`` K the K most likely tokens at each position and, with
        ``alt_k`` K, K draws at each position from 1 on (at the request's ``temperature``, from
        its ``seed``'s own stream or else the engine's shared one)."""
        options = work.prompt_options or {}
        prompt, last_n, topk = work.prompt, options.get("last_n"), int(options.get("topk_prompt") or 0)
        model = self.engine.model
        ids = torch.tensor([prompt], device=self.engine.device)
        self.row_adapters.set([work.adapter])
        images = images_of(prompt)
        pictures = {} if images is None else {
            "position_ids": sequence_positions(images, len(prompt), len(prompt)).unsqueeze(1).to(ids.device),
            **vision_kwargs([images], ids.device)}
        logits = model(input_ids=ids, use_cache=False, **pictures).logits[0, :-1].float()
        logprobs = torch.log_softmax(logits, dim=-1)
        scored = logprobs.gather(-1, ids[0, 1:, None])[:, 0].cpu()
        first = 1 if last_n is None else len(prompt) - last_n
        values = [math.nan] * len(prompt)
        for position in range(max(first, 1), len(prompt)):
            values[position] = float(scored[position - 1])
        out: dict[str, Any] = {"prompt_logprobs": values} if options.get("prompt_logprobs") else {}
        if topk:
            k = min(topk, logprobs.shape[-1])
            top = torch.topk(logprobs, k, dim=-1)
            token_ids = torch.zeros((len(prompt), topk), dtype=torch.int32)
            top_logprobs = torch.full((len(prompt), topk), -99999.0)
            token_ids[1:, :k] = top.indices.cpu().to(torch.int32)
            top_logprobs[1:, :k] = top.values.cpu()
            token_ids[:max(first, 1)] = 0
            top_logprobs[:max(first, 1)] = -99999.0
            out["topk_prompt"] = (token_ids.numpy(), top_logprobs.numpy())
        alt_k = int(options.get("alt_k") or 0)
        if alt_k:
            seed = options.get("seed")
            generator = self.engine.shared_generator if seed is None else draws_generator(seed)
            out["prompt_alt"] = prompt_alternatives(logits, alt_k, float(options.get("temperature") or 0.0), generator)
        return out


def _settle(future: asyncio.Future, outcome: Any) -> None:
    if future.done():
        return
    if isinstance(outcome, BaseException):
        future.set_exception(outcome)
    else:
        future.set_result(outcome)
