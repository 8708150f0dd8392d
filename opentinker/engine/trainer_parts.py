"""Builders of a trainer's components from its recipe: the rollout engine, the critic's
backend, the strategy judge and the wandb run. Each checks what only it can (a critic's
tokenizer, the engine's placement) and says why when it refuses."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from opentinker.config import ConfigError
from opentinker.engine.backend import BackendSpec, TrainingBackend, make_backend
from opentinker.engine.model_loading import load_causal_lm, load_tokenizer, resolve_model_path
from opentinker.engine.rollout import RolloutEngine, make_rollout_engine
from opentinker.recipe import RecipeSpec

if TYPE_CHECKING:
    from opentinker.creativity import StrategyJudge

__all__ = ["critic_backend", "judge_from_config", "rollout_engine", "shared_gpu_warning", "start_wandb"]


def critic_backend(cfg: RecipeSpec, model_path: str, tokenizer: Any) -> TrainingBackend | None:
    """The value model (``algorithm.adv_estimator=gae`` only): ``critic.model.path`` (the
    actor's model by default) with a value head; it must read the actor's tokens, so its
    tokenizer must be the actor's."""
    if cfg.algorithm.adv_estimator != "gae":
        return None
    path = model_path if cfg.critic.model.path is None else resolve_model_path(cfg.critic.model.path)
    if path != model_path:
        critic_tokenizer = load_tokenizer(path, cfg.actor_rollout_ref.model.trust_remote_code)
        if critic_tokenizer.get_vocab() != tokenizer.get_vocab():
            raise ConfigError(f"critic.model.path: {cfg.critic.model.path} has another tokenizer than the "
                              "actor's model; a critic must read the actor's token ids")
    return make_backend(BackendSpec.critic_from_config(cfg, path, tokenizer.pad_token_id))


def rollout_engine(cfg: RecipeSpec, model_path: str, tokenizer: Any, eos_ids: Any, device: torch.device,
                   warnings: list[str]) -> RolloutEngine:
    """``actor_rollout_ref.rollout.name``'s engine. Asynchronous training
    (``async_training.max_staleness > 0``) with the transformers engine runs it in a process
    of its own, so that it samples while the update runs; what the user should know about
    that placement is appended to ``warnings``."""
    ar = cfg.actor_rollout_ref
    asynchronous = bool(cfg.async_training.max_staleness)
    if ar.rollout.name == "vllm":
        if asynchronous and device.type == "cuda" and ar.rollout.placement == "colocated":
            raise ConfigError("async_training.max_staleness > 0 with vLLM on a GPU needs "
                              "actor_rollout_ref.rollout.placement=separate (a colocated engine sleeps "
                              "while the update runs; an asynchronous one keeps generating)")
        return make_rollout_engine(
            "vllm", model_path=model_path, seed=cfg.trainer.seed,
            max_model_len=ar.rollout.max_model_len or cfg.data.max_prompt_length + cfg.data.max_response_length,
            gpu_memory_utilization=ar.rollout.gpu_memory_utilization,
            tensor_parallel_size=ar.rollout.tensor_model_parallel_size, replicas=ar.rollout.replicas,
            placement=ar.rollout.placement,
            training_gpus=cfg.trainer.n_gpus_per_node if device.type == "cuda" else 0,
            enable_prefix_caching=ar.rollout.enable_prefix_caching, device=device.type,
            trust_remote_code=ar.model.trust_remote_code)
    if asynchronous:
        from opentinker.engine.rollout.remote import RemoteRolloutEngine

        warning = shared_gpu_warning(device.type)
        if warning:
            warnings.append(warning)
        if device.type == "cpu":  # one core for the engine: oversubscribed OpenMP threads spin
            torch.set_num_threads(max(1, torch.get_num_threads() - 1))
        return RemoteRolloutEngine(
            str(model_path), seed=cfg.trainer.seed, max_batch_size=ar.rollout.max_batch_size, threads=1,
            device=device.type, trust_remote_code=ar.model.trust_remote_code,
            compile_decode=ar.rollout.compile_decode, slot_decode=ar.rollout.slot_decode)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = load_causal_lm(model_path, dtype=dtype, device=device, trust_remote_code=ar.model.trust_remote_code)
    return make_rollout_engine(
        "transformers", model=model, eos_token_ids=eos_ids, pad_token_id=tokenizer.pad_token_id,
        seed=cfg.trainer.seed, max_batch_size=ar.rollout.max_batch_size, tokenizer=tokenizer,
        compile_decode=ar.rollout.compile_decode, slot_decode=ar.rollout.slot_decode)


def shared_gpu_warning(device_type: str) -> str | None:
    """What an asynchronous job with the transformers engine on a GPU is told: the rollout actor
    would share the trainer's GPU, where two processes take turns instead of overlapping."""
    if device_type != "cuda":
        return None
    return ("async_training.max_staleness > 0 puts the transformers rollout engine in a process beside the "
            "trainer on the same GPU; their kernels take turns there, and such a run measured 0.65x the "
            "synchronous steps/s on an H100 (benchmarks/README.md). Give the rollout GPUs of its own: "
            "actor_rollout_ref.rollout.name=vllm with actor_rollout_ref.rollout.placement=separate")


def judge_from_config(cfg: RecipeSpec, policy_model_path: str) -> StrategyJudge:
    """``algorithm.judge``'s strategy judge (the creativity estimators group solutions by it)."""
    from opentinker.creativity import make_judge

    judge = cfg.algorithm.judge
    options: dict[str, Any] = {"max_concurrency": judge.max_concurrency, "timeout_s": judge.timeout_s,
                               "max_retries": judge.max_retries}
    if judge.kind == "openai":
        options.update({k: v for k, v in (("model", judge.model), ("base_url", judge.base_url)) if v})
    elif judge.kind == "hf":
        options = {"model": judge.model or policy_model_path}  # the policy model by default
    else:
        options = {}
    return make_judge(judge.kind, **options)


def start_wandb(cfg: RecipeSpec):
    """A wandb run named by trainer.project_name / experiment_name (``trainer.logger`` has wandb)."""
    try:
        import wandb
    except ImportError as error:
        raise ConfigError(
            "trainer.logger includes 'wandb' but wandb is not installed: pip install 'opentinker[wandb]'"
        ) from error
    return wandb.init(project=cfg.trainer.project_name, name=cfg.trainer.experiment_name,
                      config=cfg.to_tree())
