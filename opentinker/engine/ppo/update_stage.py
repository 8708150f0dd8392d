"""A step's learning, after its rollout: old and reference logprobs, the critic's values,
advantages, the critic's update and the actor's. Owns the actor's and the critic's update
schedules, so a checkpoint holds their state through :meth:`UpdateStage.state_dict`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from opentinker.config import ConfigError
from opentinker.engine.ppo.advantage_stage import AdvantageStage
from opentinker.engine.backend import TrainingBackend
from opentinker.engine.batch import TokenBatch
from opentinker.engine.ppo.checkpoints import ACTOR_STATE, CRITIC_STATE
from opentinker.engine.ppo.correction import sampler_gap_metrics, without_rejected
from opentinker.engine.ppo.policy_update import CriticUpdate, PPOUpdate
from opentinker.engine.ppo.step import StepSamples, Timer
from opentinker.engine.vision import images_of
from opentinker.recipe import RecipeSpec

__all__ = ["UpdateStage", "to_batch"]


def to_batch(rollout: StepSamples) -> TokenBatch:
    """The rollout's trajectories as one padded batch, with the sampler's logprobs."""
    trajectories = rollout.trajectories
    batch = TokenBatch.from_responses(
        [t.prompt_ids for t in trajectories], [t.response_ids for t in trajectories],
        [t.response_mask for t in trajectories],
        [t.images if t.images is not None else images_of(p.prompt_ids)
         for t, p in zip(trajectories, rollout.prompts)],
    )
    batch.tensors["rollout_logprobs"] = batch.pad_response_values([t.rollout_logprobs for t in trajectories])
    return batch


class UpdateStage:
    """The actor's PPO update, the critic's (GAE only) and the advantages between them."""

    def __init__(self, cfg: RecipeSpec, actor: TrainingBackend, critic: TrainingBackend | None,
                 advantages: AdvantageStage, *, asynchronous: bool):
        self.cfg = cfg
        self.ppo = PPOUpdate(actor, cfg, seed=cfg.trainer.seed)
        self.critic = None if critic is None else CriticUpdate(critic, cfg, seed=cfg.trainer.seed)
        self.advantages = advantages
        self.asynchronous = asynchronous  # samples may come from older policies: report the gap

    def run(self, batch: TokenBatch, rollout: StepSamples, timer: Timer, steps_done: int) -> dict[str, float]:
        """Fill ``batch``'s tensors, update the critic and the actor; the metrics."""
        temperature = self.cfg.actor_rollout_ref.rollout.temperature or 1.0
        self.before_logprobs(batch, timer, temperature)
        with timer.phase("advantages"):
            metrics = self.advantages.compute(batch, rollout)
        if self.critic is not None:
            with timer.phase("update_critic"):
                metrics.update(self.critic.update(batch))
        correction = self.cfg.algorithm.rollout_correction
        self.ppo.logprobs_before_update = None
        # trainer.critic_warmup: the first steps train the critic alone.
        if self.critic is None or steps_done >= self.cfg.trainer.critic_warmup:
            with timer.phase("update"):
                metrics.update(self.ppo.update(without_rejected(batch, correction), temperature=temperature))
        metrics.update(sampler_gap_metrics(batch, correction, self.asynchronous, self.ppo.logprobs_before_update))
        return metrics

    def before_logprobs(self, batch: TokenBatch, timer: Timer, temperature: float) -> None:
        """Old logprobs (when the update needs them), reference logprobs (KL loss) and the
        critic's values, as tensors on ``batch``."""
        correction = self.cfg.algorithm.rollout_correction
        if correction.bypass_mode:  # the sampler's logprobs are the old ones (no recompute)
            batch.tensors["old_logprobs"] = batch.tensors["rollout_logprobs"].clone()
        # Decided by the batch actually trained. An update of one optimizer step needs none: its
        # ratio is 1 and IS weights come from its own pass (rejection must know them before).
        elif self.ppo.needs_old_logprobs(batch) or correction.rollout_rs is not None:
            with timer.phase("old_logprob"):
                batch.tensors["old_logprobs"] = self.ppo.logprobs(batch, temperature=temperature)
        if self.cfg.actor_rollout_ref.actor.use_kl_loss:
            with timer.phase("ref_logprob"):
                batch.tensors["ref_logprobs"] = self.ppo.logprobs(batch, temperature=temperature, reference=True)
        if self.critic is not None:
            with timer.phase("values"):
                batch.tensors["old_values"] = self.critic.values(batch)

    # -- checkpoints -----------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The update schedules' positions and shuffles, under the checkpoint's keys."""
        ppo = self.ppo.state_dict()
        critic = self.critic.state_dict() if self.critic is not None else {"updates": None, "shuffle": None}
        return {"ppo_updates": ppo["updates"], "ppo_shuffle": ppo["shuffle"],
                "critic_updates": critic["updates"], "critic_shuffle": critic["shuffle"]}

    @property
    def critic_backend(self) -> TrainingBackend | None:
        return None if self.critic is None else self.critic.backend

    def load_state_dict(self, state: dict[str, Any], checkpoint: Path) -> None:
        """Continue from ``state`` (:meth:`state_dict`) and the backends' states in
        ``checkpoint`` (the actor's; the value model's with a critic)."""
        self.ppo.backend.load_state(checkpoint / ACTOR_STATE)
        self.ppo.load_state_dict({"updates": state["ppo_updates"], "shuffle": state["ppo_shuffle"]})
        if self.critic is None:
            return
        if state.get("critic_updates") is None:
            raise ConfigError(f"trainer.resume_mode: {checkpoint} was saved without a critic "
                              "(algorithm.adv_estimator was not gae)")
        self.critic.backend.load_state(checkpoint / CRITIC_STATE)
        self.critic.load_state_dict({"updates": state["critic_updates"], "shuffle": state["critic_shuffle"]})

    def close(self) -> None:
        self.ppo.backend.close()
        if self.critic is not None:
            self.critic.backend.close()
