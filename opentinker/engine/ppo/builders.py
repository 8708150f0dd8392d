"""Builders of a trainer's components from its recipe: the rollout engine (by its registered
builder), the critic's backend, the strategy judge and the wandb run. Each checks what only it can (a critic's
tokenizer, the engine's placement) and says why when it refuses."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from opentinker.config import ConfigError
from opentinker.engine.backend import BackendSpec, TrainingBackend, make_backend
from opentinker.engine.model_loading import load_tokenizer, resolve_model_path
from opentinker.engine.rollout import RolloutBuild, RolloutEngine, rollout_engine_kind
from opentinker.recipe import RecipeSpec
from opentinker.recipe.estimators import estimator_needs

if TYPE_CHECKING:
    from opentinker.creativity import StrategyJudge

__all__ = ["critic_backend", "judge_from_config", "rollout_engine", "start_wandb"]


def critic_backend(cfg: RecipeSpec, model_path: str, tokenizer: Any) -> TrainingBackend | None:
    """The value model (an estimator that needs a critic: gae): ``critic.model.path`` (the
    actor's model by default) with a value head; it must read the actor's tokens, so its
    tokenizer must be the actor's."""
    if not estimator_needs(cfg.algorithm.adv_estimator).critic:
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
    """``actor_rollout_ref.rollout.name``'s engine, built by its registered builder
    (``engine/rollout/builtin_engines.py``); what the user should know about its placement is
    appended to ``warnings``."""
    name = cfg.actor_rollout_ref.rollout.name
    kind = rollout_engine_kind(name)
    if cfg.async_training.max_staleness and not kind.samples_while_training:
        raise ConfigError(f"async_training.max_staleness > 0 runs rollouts while the update runs, which the rollout "
                          f"engine '{name}' cannot; use actor_rollout_ref.rollout.name=transformers or vllm, or "
                          "max_staleness=0", key="async_training.max_staleness")
    return kind.build(RolloutBuild(cfg, model_path, tokenizer, eos_ids, device, warnings))


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
