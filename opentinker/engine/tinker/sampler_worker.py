"""Sampling for the Tinker API: one :class:`TinkerSampler` Ray actor per served base model.

A request names the weights to sample from: the base model, or a sampler snapshot (a file of
full weights that a training client saved with ``save_weights_for_sampler``). Concurrent
requests queue here and one thread serves them: all waiting requests for the same weights go
into one ``generate`` call (the cookbook sends one request per rollout), and weights are
swapped only between such batches. Prompt logprobs (and top-k) come from one forward pass.
"""

from __future__ import annotations

import concurrent.futures
import math
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from opentinker.engine.rollout.base import Completion, SamplingParams
from opentinker.engine.tinker.model_worker import SAMPLER_WEIGHTS_FILE

BASE = ""  # the snapshot key of the base model's own weights
DEFAULT_MAX_TOKENS = 1024


@dataclass
class SampleCall:
    """One ``asample``: ``num_samples`` completions of ``prompt`` from ``snapshot`` (a folder,
    or ``BASE``), and optionally the prompt's logprobs (``last_n``: only the last N scored)."""

    snapshot: str
    prompt: list[int]
    params: SamplingParams
    num_samples: int = 1
    prompt_logprobs: bool = False
    topk_prompt: int = 0
    last_n: int | None = None
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)


class TinkerSampler:
    def __init__(self, model_path: str | None, trust_remote_code: bool = False, seed: int = 0, device: str = "auto"):
        from opentinker.engine.model_loading import pick_device, resolve_model_path
        from opentinker.engine.rollout.transformers_engine import TransformersRolloutEngine
        from opentinker.engine.serving import context_length

        model_path = resolve_model_path(model_path)  # None: the embedded tiny model
        self.engine = TransformersRolloutEngine.from_pretrained(
            model_path, device=pick_device(device), trust_remote_code=trust_remote_code, seed=seed)
        model = self.engine.model
        self.max_length = context_length(self.engine)
        self.vocab_size = int(model.config.vocab_size)
        # The base weights stay at hand so that a base-model request after a snapshot's is
        # served without reading the model folder again.
        self._base = {name: tensor.detach().cpu().clone() for name, tensor in model.state_dict().items()}
        self.loaded = BASE
        self._pending: list[SampleCall] = []
        self._wake = threading.Condition()
        threading.Thread(target=self._serve, name="tinker-sampler", daemon=True).start()

    def ready(self) -> dict[str, Any]:
        return {"max_length": self.max_length, "vocab_size": self.vocab_size}

    def sample(self, request: dict[str, Any]) -> dict[str, Any]:
        """Serves one ``SampleCall`` given as a dict (``params``: ``SamplingParams`` fields;
        ``max_tokens`` None: up to the context's end, at most ``DEFAULT_MAX_TOKENS``). Blocks
        until served: the actor is threaded, many calls wait at once."""
        params = dict(request["params"])
        if params.get("max_tokens") is None:
            params["max_tokens"] = max(1, min(DEFAULT_MAX_TOKENS, self.max_length - len(request["prompt"])))
        call = SampleCall(**{**request, "params": SamplingParams(**params)})
        if call.prompt and max(call.prompt) >= self.vocab_size:
            raise ValueError(f"prompt: token id {max(call.prompt)} is past the model's vocabulary "
                             f"({self.vocab_size} ids)")
        length = len(call.prompt) + call.params.max_tokens
        if length > self.max_length:
            raise ValueError(f"prompt ({len(call.prompt)} tokens) + max_tokens ({call.params.max_tokens}) is "
                             f"{length}, past the model's context of {self.max_length} tokens")
        with self._wake:
            self._pending.append(call)
            self._wake.notify()
        return call.future.result()

    # -- the serving thread ----------------------------------------------------------
    def _serve(self) -> None:
        while True:
            with self._wake:
                while not self._pending:
                    self._wake.wait()
                key = self._pending[0].snapshot
                batch = [c for c in self._pending if c.snapshot == key]
                self._pending = [c for c in self._pending if c.snapshot != key]
            try:
                self._load(key)
                results = self._run(batch)
            except BaseException as error:  # every waiter hears of it; the thread goes on
                for call in batch:
                    call.future.set_exception(error)
                continue
            for call, result in zip(batch, results):
                call.future.set_result(result)

    def _load(self, snapshot: str) -> None:
        if snapshot == self.loaded:
            return
        if snapshot == BASE:
            self.engine.update_weights(self._base)
        else:
            self.engine.update_weights(torch.load(Path(snapshot) / SAMPLER_WEIGHTS_FILE, map_location="cpu",
                                                   weights_only=True, mmap=True))
        self.loaded = snapshot

    def _run(self, batch: list[SampleCall]) -> list[dict[str, Any]]:
        prompts, params = [], []
        for call in batch:
            for index in range(call.num_samples):  # a seeded request's samples differ: seed, seed+1, ...
                seed = None if call.params.seed is None else call.params.seed + index
                prompts.append(call.prompt)
                params.append(SamplingParams(**{**call.params.__dict__, "seed": seed}))
        completions: list[Completion] = self.engine.generate(prompts, params)
        results, start = [], 0
        for call in batch:
            mine = completions[start:start + call.num_samples]
            start += call.num_samples
            result: dict[str, Any] = {"sequences": [(c.token_ids, c.logprobs, c.finish_reason) for c in mine]}
            if call.prompt_logprobs or call.topk_prompt:
                result.update(self._prompt_scores(call))
            results.append(result)
        return results

    @torch.no_grad()
    def _prompt_scores(self, call: SampleCall) -> dict[str, Any]:
        """Logprob of each prompt token given the ones before it (NaN at 0 and before the last
        ``last_n``) and, with ``topk_prompt`` K, the K most likely tokens at each position."""
        model = self.engine.model
        ids = torch.tensor([call.prompt], device=self.engine.device)
        logits = model(input_ids=ids, use_cache=False).logits[0, :-1].float()
        logprobs = torch.log_softmax(logits, dim=-1)
        scored = logprobs.gather(-1, ids[0, 1:, None])[:, 0].cpu()
        first = 1 if call.last_n is None else len(call.prompt) - call.last_n
        values = [math.nan] * len(call.prompt)
        for position in range(max(first, 1), len(call.prompt)):
            values[position] = float(scored[position - 1])
        out: dict[str, Any] = {"prompt_logprobs": values} if call.prompt_logprobs else {}
        if call.topk_prompt:
            k = min(call.topk_prompt, logprobs.shape[-1])
            top = torch.topk(logprobs, k, dim=-1)
            token_ids = torch.zeros((len(call.prompt), call.topk_prompt), dtype=torch.int32)
            top_logprobs = torch.full((len(call.prompt), call.topk_prompt), -99999.0)
            token_ids[1:, :k] = top.indices.cpu().to(torch.int32)
            top_logprobs[1:, :k] = top.values.cpu()
            token_ids[:max(first, 1)] = 0
            top_logprobs[:max(first, 1)] = -99999.0
            out["topk_prompt"] = (token_ids.numpy(), top_logprobs.numpy())
        return out
