"""Rollout with vLLM (GPU). Imported only when ``actor_rollout_ref.rollout.name=vllm``.

Status: written against vLLM's offline ``LLM`` API (>= 0.10) but not yet exercised in CI,
which has no GPU; ``tests/engine/test_vllm_engine.py`` runs it where CUDA and vLLM exist.
Weights are pushed in-process, so vLLM's engine-core multiprocessing is turned off.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from opentinker.engine.rollout.base import Completion, SamplingParams, WeightSource, named_tensors


def _require_vllm():
    try:
        import vllm  # noqa: F401
    except ImportError as error:
        raise ImportError(
            "actor_rollout_ref.rollout.name=vllm needs vLLM and a CUDA GPU: pip install 'opentinker[gpu]' "
            "(on CPU use rollout.name=transformers)"
        ) from error
    if not torch.cuda.is_available():
        raise RuntimeError("actor_rollout_ref.rollout.name=vllm needs a CUDA GPU; none is visible")
    return vllm


def _load_weights_on_worker(worker, named_tensors):  # runs inside vLLM's worker via collective_rpc
    worker.model_runner.model.load_weights(weights=list(named_tensors.items()))


class VLLMRolloutEngine:
    def __init__(self, model_path: str, gpu_memory_utilization: float = 0.5, seed: int = 0, **llm_kwargs):
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        vllm = _require_vllm()
        self._vllm = vllm
        self.llm = vllm.LLM(
            model=model_path,
            gpu_memory_utilization=gpu_memory_utilization,
            seed=seed,
            enable_sleep_mode=True,
            # Temperature-scaled logprobs, the same quantity the trainer computes.
            logprobs_mode="processed_logprobs",
            **llm_kwargs,
        )

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams]
    ) -> list[Completion]:
        from vllm.inputs import TokensPrompt

        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        vllm_params = [
            self._vllm.SamplingParams(
                temperature=p.temperature,
                top_p=p.top_p,
                top_k=p.top_k if p.top_k > 0 else -1,
                max_tokens=p.max_tokens,
                stop_token_ids=list(p.stop_token_ids),
                seed=p.seed,
                ignore_eos=p.ignore_eos,
                logprobs=0,
            )
            for p in params
        ]
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], vllm_params, use_tqdm=False)
        completions = []
        for output in outputs:
            sample = output.outputs[0]
            token_ids = list(sample.token_ids)
            logprobs = [step[token].logprob for step, token in zip(sample.logprobs or [], token_ids)]
            completions.append(Completion(token_ids, logprobs, "stop" if sample.finish_reason == "stop" else "length"))
        return completions

    def update_weights(self, weights: WeightSource) -> None:
        self.llm.collective_rpc(_load_weights_on_worker, args=(dict(named_tensors(weights)),))
        self.llm.reset_prefix_cache()

    def sleep(self) -> None:
        self.llm.sleep(level=1)

    def wake(self) -> None:
        self.llm.wake_up()
