"""The PPO/GRPO recipe: a trainer made of components that each own their state and rules,
built from a :class:`~opentinker.recipe.RecipeSpec` on the engine's primitives (backends,
rollout engines, algorithms).

- ``step.py``: the nouns a step passes along (Prompt, Trajectory, StepSamples, TokenBatch,
  Timer), with how a step uses them;
- ``trainer.py``: ``RLTrainer`` (``step``, ``fit``, checkpoints) and ``builders.py``, which
  builds its parts from the recipe (rollout engine, critic, judge, wandb);
- rollouts: ``rollout_sources.py`` (the synchronous loop, or ``async_rollouts.py``'s pipeline
  running steps ahead), ``sampler.py`` (one batched generate and the reward, or
  ``agent_runner.py``'s agent loops; ``env_outage.py`` waits out an unreachable env and
  ``env_instances.py`` remembers open episodes), ``reward_deadline.py``;
- the update: ``update_stage.py`` (old/ref logprobs, values, ``advantage_stage.py``,
  ``correction.py``, then ``policy_update.py``'s actor and critic updates);
- around a step: ``step_metrics.py``, ``step_warnings.py``, ``checkpoints.py``,
  ``fit_loop.py`` (``fit``'s progress and loggers) and ``cli.py`` (``opentinker-train``).

``RLTrainer`` and ``train`` load on first use (torch): ``from opentinker.engine.ppo import RLTrainer``."""

from __future__ import annotations

from typing import Any

__all__ = ["RLTrainer", "train"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from opentinker.engine.ppo import trainer

        return getattr(trainer, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
