"""The RL trainer: one function per phase, read top to bottom.

A step is: rollout (n samples per prompt) -> rewards -> old/ref logprobs -> advantages ->
update -> weight sync -> metrics. Everything heavy sits behind two objects: the
``TrainingBackend`` (the training primitives: forward, forward_backward, optim_step,
weights) that the PPO recipe (``engine/ppo/policy_update.py``) drives, and the ``RolloutEngine`` (sampling).

Samples that cannot be trained on (excluded trajectories: errors of the env's own without an
``env_error_reward``, env prompts that are too long; and any whose env failed before the
model spoke) leave the batch before advantages. A step any of whose samples failed because an
env server could not be reached is waited out and redone whole, never trained on the rest
(``engine/ppo/env_outage.py``; ``trainer.env_outage_timeout_s``). A step left with nothing for any
other reason (the env answered with errors of its own, prompts too long) is skipped: it still counts
(``global_step`` advances; ``train/skipped``, ``skip_reason``), and
``trainer.max_consecutive_empty_steps`` skipped steps in a row raise
:class:`EnvironmentUnavailableError`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from omegaconf import DictConfig, OmegaConf

from opentinker.config import build_recipe
from opentinker.engine.ppo.advantage_stage import AdvantageStage
from opentinker.engine.ppo.agent_runner import environment_metrics, failure_summary
from opentinker.engine.algorithms import get_advantage_estimator
from opentinker.engine.backend import BackendSpec, TrainingBackend, make_backend
from opentinker.engine.batch import TokenBatch
from opentinker.engine.ppo.checkpoints import find_checkpoint, read_trainer_state, write_checkpoint
from opentinker.engine.data import Prompt, PromptLoader, RewardFn, builtin_task, tokenize_rows
from opentinker.engine.ppo.env_outage import EnvironmentUnavailableError, EnvOutage
from opentinker.engine.model_loading import eos_token_ids, load_tokenizer, pick_device, resolve_model_path
from opentinker.engine.ppo.reward_deadline import DeadlineScorer
from opentinker.engine.rollout import RolloutEngine
from opentinker.engine.ppo.rollout_sources import PipelinedRollouts, RolloutSource, StepRollouts
from opentinker.engine.ppo.sampler import RolloutSampler
from opentinker.engine.ppo.step_metrics import rollout_metrics, token_count, validation_metrics
from opentinker.engine.ppo.step import StepSamples, Timer
from opentinker.engine.ppo.step_warnings import StepWarnings
from opentinker.engine.ppo.fit_loop import fit_loop
from opentinker.engine.ppo.builders import critic_backend, judge_from_config, rollout_engine, start_wandb
from opentinker.engine.vision import VisionPromptEncoder
from opentinker.engine.ppo.update_stage import UpdateStage, to_batch
from opentinker.environments.interaction import Interaction
from opentinker.images import ImageLimits
from opentinker.protocol import step_checkpoint_name
from opentinker.recipe import RecipeSpec


if TYPE_CHECKING:
    from opentinker.creativity import StrategyJudge

__all__ = ["EnvironmentUnavailableError", "RLTrainer", "config_summary", "find_checkpoint", "train"]

StepCallback = Callable[[int, dict[str, float]], None]


class RLTrainer:
    """Trains a causal LM with PPO-style updates on rewards from ``reward_fn``.

    Made of components that own their state: the prompt loader, the rollout source (the
    synchronous or the asynchronous loop), the sampler (agent loops, reward), the update
    stage (actor and critic updates, advantages); a checkpoint is their ``state_dict``s.
    """

    def __init__(
        self,
        cfg: RecipeSpec | DictConfig,
        *,
        train_rows: Sequence[dict] | None = None,
        val_rows: Sequence[dict] | None = None,
        reward_fn: RewardFn | None = None,
        strategy_judge: StrategyJudge | None = None,
        interactions: Mapping[str, Interaction] | None = None,
        image_limits: ImageLimits | None = None,
    ):
        # The typed recipe (a checked config is typed here; its attributes are the dotted keys),
        # its rules checked again now that the device is known (vLLM asynchronous on a GPU).
        cfg = cfg if isinstance(cfg, RecipeSpec) else RecipeSpec.from_config(cfg)
        self.device = pick_device(cfg.trainer.device)
        cfg = cfg.for_job(cfg.mode, gpus=self.device.type == "cuda")
        self.cfg = cfg
        torch.manual_seed(cfg.trainer.seed)
        self.interactions = dict(interactions or {})
        train_rows, val_rows, reward_fn = _task_defaults(cfg, train_rows, val_rows, reward_fn, bool(self.interactions))
        self.reward_fn = reward_fn
        self.reward_scorer = None if reward_fn is None else DeadlineScorer(reward_fn, cfg.reward_model.timeout_s)

        ar = cfg.actor_rollout_ref
        self.model_path = resolve_model_path(ar.model.path)
        self.tokenizer = load_tokenizer(self.model_path, ar.model.trust_remote_code)
        self.eos_ids = eos_token_ids(self.tokenizer, self.model_path)
        # A vision-language model's: pictures in prompts -> pixels and image tokens (None: a text model).
        self.pictures = VisionPromptEncoder.for_model(self.model_path, self.tokenizer, image_limits,
                                                      trust_remote_code=ar.model.trust_remote_code)
        self._load_prompts(train_rows, val_rows)
        # Set by the driver (the job runner: warning events; a cancel raises) for env outage waits.
        self.on_warning: Callable[[str], None] = _print_warning
        self.check_cancelled: Callable[[], None] = lambda: None
        # Why a checkpoint due now would not be kept (the server's bounds on checkpoint bytes, which
        # name the operator's flag), or None: a due checkpoint is then skipped with a warning.
        self.checkpoint_refusal: Callable[[], str | None] = lambda: None
        self._startup_warnings: list[str] = []  # found while building, said at the first step

        self.backend: TrainingBackend = make_backend(
            BackendSpec.from_config(cfg, self.model_path, self.tokenizer.pad_token_id))
        critic = critic_backend(cfg, self.model_path, self.tokenizer)  # PPO with GAE learns a value model
        self.rollout: RolloutEngine = rollout_engine(cfg, self.model_path, self.tokenizer, self.eos_ids,
                                                     self.device, self._startup_warnings)
        if strategy_judge is None and cfg.algorithm.enable_solution_classification:
            strategy_judge = judge_from_config(cfg, self.model_path)
        self.advantages = AdvantageStage(cfg.algorithm, get_advantage_estimator(cfg.algorithm.adv_estimator),
                                         strategy_judge)
        # async_training.max_staleness > 0: rollouts run ahead of the update (RolloutPipeline).
        self.max_staleness = int(cfg.async_training.max_staleness)
        self.update = UpdateStage(cfg, self.backend, critic, self.advantages, asynchronous=bool(self.max_staleness))
        # Samples and scores responses: one batched generate and the reward function, or agent loops.
        self.sampler = RolloutSampler(cfg, self.rollout, self.tokenizer, self.eos_ids, self.interactions,
                                      self.reward_scorer, warn=lambda message: self.on_warning(message),
                                      check_cancelled=lambda: self.check_cancelled(), pictures=self.pictures)
        self.agent_loops = self.sampler.agent_loops
        self.step_warnings = StepWarnings(lambda message: self.on_warning(message))  # lost episodes, no signal
        # Where each step's rollout comes from: made in the step, or launched steps ahead.
        self.rollouts: RolloutSource = (
            PipelinedRollouts(self.max_staleness, self.loader, self.rollout_through_outages, self.rollout,
                              self.backend.weights) if self.max_staleness else
            StepRollouts(self.loader, self.rollout_through_outages, self.rollout, self.backend.weights))
        self.global_step = 0
        self.skipped_steps = 0  # steps with nothing to train on, in all
        self.consecutive_skipped_steps = 0
        self.resumed_from: Path | None = None
        self.wandb_run = start_wandb(cfg) if "wandb" in cfg.trainer.logger else None
        checkpoint = find_checkpoint(cfg.trainer.resume_mode, cfg.trainer.default_local_dir)
        if checkpoint is not None:
            self.resume(checkpoint)

    def _load_prompts(self, train_rows: Sequence[dict], val_rows: Sequence[dict] | None) -> None:
        data = self.cfg.data
        data_free = bool(self.interactions)  # an env writes the prompts; rows need no prompt
        self.train_prompts = tokenize_rows(train_rows, self.tokenizer, data.max_prompt_length, "train", data_free,
                                           self.pictures)
        self.val_prompts = tokenize_rows(val_rows or [], self.tokenizer, data.max_prompt_length, "val", data_free,
                                         self.pictures)
        self.loader = iter(PromptLoader(self.train_prompts, data.train_batch_size, data.shuffle, data.seed))

    # -- phases --------------------------------------------------------------------
    def generate(self, prompts: Sequence[Prompt], samples_per_prompt: int, validation: bool = False) -> StepSamples:
        """Sample ``samples_per_prompt`` responses to each prompt and score them (the sampler's)."""
        return self.sampler.generate(prompts, samples_per_prompt, validation)

    # The advantage stage owns this; kept here for callers (and tests) that use it by this name.
    token_rewards = staticmethod(AdvantageStage.token_rewards)

    def sync_weights(self) -> None:
        """Stream the backend's weights into the rollout engine, bucket by bucket."""
        self.rollout.update_weights(self.backend.weights())

    def rollout_through_outages(self, prompts: Sequence[Prompt], timer: Timer) -> tuple[StepSamples, EnvOutage | None]:
        """The step's rollout, env outages waited out and the step redone (the sampler's)."""
        return self.sampler.through_outages(self.generate, prompts, timer, self.global_step + 1)

    # -- one step ------------------------------------------------------------------
    def step(self, rows: Sequence[dict] | None = None) -> dict[str, Any]:
        """One training step on ``rows`` (a client-pushed batch) or on the next loader batch.

        A step with nothing to train on because an env server could not be reached is
        redone once it answers again (:meth:`rollout_through_outages`); one with no trainable
        sample for another reason is skipped (see :meth:`skip_step`). The metrics always have
        ``train/skipped`` (1.0 or 0.0), ``train/skipped_total`` and ``train/env_outage_wait_s``.
        """
        timer = Timer()
        with timer.phase("step"):
            pushed = None if rows is None else self.tokenize_batch(rows)
            full_rollout, outage, version = self.rollouts.rollout(pushed, timer, self.global_step)
            self.step_warnings.check(self.global_step + 1, full_rollout)
            # Removed before advantages, so excluded samples never shift a group's mean or std.
            rollout = full_rollout.keep(full_rollout.trainable())
            if rollout.trajectories:
                batch, train_metrics = self.train_on(rollout, timer)
        waited = timer.seconds.get("env_outage_wait", 0.0)  # sleeping and probing, not the failed tries
        outage_metrics = {"train/env_outage_wait_s": waited,
                          "train/env_outage_retries": float(outage.tries if outage else 0)}
        # Policy versions between the one that sampled and the one this step started from.
        staleness = {"staleness/mean": float(self.global_step - version),
                     "staleness/max": float(self.global_step - version)}
        if not rollout.trajectories:
            return {**self.skip_step(full_rollout, timer), **outage_metrics, **staleness}
        self.global_step += 1
        self.consecutive_skipped_steps = 0
        return {
            **rollout_metrics(rollout, batch),
            **environment_metrics(full_rollout),
            **train_metrics,
            **{f"timing_s/{name}": seconds for name, seconds in timer.seconds.items()},
            "perf/tokens_per_s": token_count(batch) / (timer.seconds["step"] - waited),  # the wait is no work
            "rollout/excluded_trajectories": float(len(full_rollout.trajectories) - len(rollout.trajectories)),
            "rollout/reward_timeouts": float(sum(t.stop_reason == "reward_timeout" for t in full_rollout.trajectories)),
            "train/skipped": 0.0,
            "train/skipped_total": float(self.skipped_steps),
            **outage_metrics,
            **staleness,
        }

    def train_on(self, rollout: StepSamples, timer: Timer) -> tuple[TokenBatch, dict[str, float]]:
        """The update stage on ``rollout``, between the rollout source's two hooks (the
        engine sleeps through the update, or keeps sampling; then it gets the new weights)."""
        batch = to_batch(rollout)
        self.rollouts.before_update()
        metrics = self.update.run(batch, rollout, timer, self.global_step)
        with timer.phase("sync"):
            self.rollouts.after_update(self.global_step + 1)
        return batch, metrics

    def skip_step(self, full_rollout: StepSamples, timer: Timer) -> dict[str, Any]:
        """A step with nothing to train on though its env servers answer (they answered with
        errors of their own, e.g. HTTP 500 from a broken env; or every prompt was too long):
        counted as a step (client-mode jobs index steps by number) with ``train/skipped`` 1.0
        and ``skip_reason`` (a string naming the env endpoints and the last error); the
        ``max_consecutive_empty_steps``-th in a row raises :class:`EnvironmentUnavailableError`
        instead. Redoing such a step would fail the same way; an outage is waited out instead
        (:meth:`rollout_through_outages`)."""
        reason = failure_summary(full_rollout.trajectories, full_rollout.interaction_names)
        self.consecutive_skipped_steps += 1
        limit = self.cfg.trainer.max_consecutive_empty_steps
        if self.consecutive_skipped_steps >= limit:
            raise EnvironmentUnavailableError(
                f"{self.consecutive_skipped_steps} training steps in a row had nothing to train on "
                f"(trainer.max_consecutive_empty_steps={limit}): {reason}"
            )
        self.global_step += 1
        self.skipped_steps += 1
        self.rollouts.after_skip(self.global_step)
        return {
            **environment_metrics(full_rollout),
            **{f"timing_s/{name}": seconds for name, seconds in timer.seconds.items()},
            "rollout/excluded_trajectories": float(len(full_rollout.trajectories)),
            "train/skipped": 1.0,
            "train/skipped_total": float(self.skipped_steps),
            "skip_reason": reason,
        }

    def tokenize_batch(self, rows: Sequence[dict]) -> list[Prompt]:
        """A pushed batch; uids are unique per step so GRPO groups stay within this batch."""
        split = f"step{self.global_step + 1}"
        return tokenize_rows(rows, self.tokenizer, self.cfg.data.max_prompt_length, split, bool(self.interactions),
                             self.pictures)

    # -- validation and checkpoints -------------------------------------------------
    def validate(self) -> dict[str, float]:
        """Accuracy (mean of reward > 0) on the held-out prompts; with ``rollout.val_n > 1``
        also pass@k for k = 1, 2, 4, ... up to val_n (unbiased estimator).

        Excluded samples (e.g. env errors) are left out and counted in ``val/excluded``; a
        metric with no sample to average over is absent rather than a division by zero.
        """
        if not self.val_prompts:
            return {}
        samples = self.cfg.actor_rollout_ref.rollout.val_n
        rollout = self.rollouts.validation_rollout(self.generate, self.val_prompts, samples, True)
        return validation_metrics(rollout, samples)

    def save_checkpoint(self) -> Path | None:
        """``<default_local_dir>/global_step_<k>/`` (:func:`write_checkpoint`); returns its
        ``actor`` folder (a Hugging Face folder)."""
        root = self.cfg.trainer.default_local_dir
        if not root:
            return None
        return write_checkpoint(Path(root), self.global_step, self.backend, self.tokenizer,
                                self.update.critic_backend, self.trainer_state(), self.model_path)

    def trainer_state(self) -> dict[str, Any]:
        """What, besides the backends' state, a run needs to continue exactly as it would have:
        each component's own ``state_dict``."""
        return {
            "global_step": self.global_step,
            "skipped_steps": self.skipped_steps,
            "consecutive_skipped_steps": self.consecutive_skipped_steps,
            "loader": self.rollouts.loader_state(),
            "rollout_rng": self.rollouts.rng_state(),
            **self.update.state_dict(),
        }

    def resume(self, checkpoint: Path) -> None:
        """Continue from ``checkpoint`` (a ``global_step_<k>`` folder): the backends' state,
        the components', and the rollout engine's weights."""
        state = read_trainer_state(checkpoint)
        self.update.load_state_dict(state, checkpoint)
        self.global_step = int(state["global_step"])
        self.skipped_steps = int(state["skipped_steps"])
        self.consecutive_skipped_steps = int(state["consecutive_skipped_steps"])
        self.loader.load_state_dict(state["loader"])
        if state["rollout_rng"] is not None:
            self.rollout.set_rng_state(state["rollout_rng"])
        self.sync_weights()
        self.resumed_from = checkpoint

    # -- the loop ------------------------------------------------------------------
    def train_step(self, rows: Sequence[dict] | None = None, *, save: bool = False) -> dict[str, Any]:
        """:meth:`step`, then validation and a checkpoint when the schedule (or ``save``) asks."""
        trainer_cfg = self.cfg.trainer
        while self._startup_warnings:  # said once, where the driver hears warnings (set after __init__)
            self.on_warning(self._startup_warnings.pop(0))
        metrics: dict[str, Any] = {"step": self.global_step + 1, **self.step(rows)}
        done = self.global_step == trainer_cfg.total_training_steps
        if trainer_cfg.test_freq > 0 and (self.global_step % trainer_cfg.test_freq == 0 or done):
            metrics.update(self.validate())
        if save or done or (trainer_cfg.save_freq > 0 and self.global_step % trainer_cfg.save_freq == 0):
            refusal = self.checkpoint_refusal()
            if refusal is not None:  # the step is trained and reported all the same
                self.on_warning(f"checkpoint {step_checkpoint_name(self.global_step)} was not saved: {refusal}")
            elif (path := self.save_checkpoint()) is not None:
                metrics["checkpoint"] = str(path)
        return metrics

    def initial_validation(self) -> dict[str, float]:
        """Validation before the first step (not again when resuming)."""
        trainer_cfg = self.cfg.trainer
        wanted = trainer_cfg.val_before_train and trainer_cfg.test_freq > 0 and self.resumed_from is None
        return self.validate() if wanted else {}

    def fit(self, on_step: StepCallback | None = None) -> list[dict[str, Any]]:
        """Train for ``trainer.total_training_steps``; returns every step's metrics."""
        return fit_loop(self, on_step)

    def __enter__(self) -> RLTrainer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop the rollout pipeline, the agent-loop threads (closing the interactions'
        connections), the wandb run and the backends (the trainer is unusable afterwards)."""
        self.rollouts.close()
        self.sampler.close()
        self.rollout.close()
        if self.wandb_run is not None:
            self.wandb_run.finish()
        self.update.close()


def _task_defaults(cfg: RecipeSpec, train_rows: Sequence[dict] | None, val_rows: Sequence[dict] | None,
                   reward_fn: RewardFn | None, has_interactions: bool):
    """The rows and reward of ``data.task`` wherever the caller gave none (an env's interactions
    score instead of a reward function)."""
    if train_rows is None or (reward_fn is None and not has_interactions):
        task_train, task_val, task_reward = builtin_task(cfg.data.task, val_count=cfg.data.val_batch_size)
        train_rows = task_train if train_rows is None else train_rows
        val_rows = task_val if val_rows is None else val_rows
        reward_fn = reward_fn or task_reward
    return train_rows, val_rows, reward_fn


def _print_warning(message: str) -> None:
    from tqdm.auto import tqdm

    tqdm.write(f"warning: {message}")  # above a progress bar, if one is drawn


def train(overrides: Sequence[str] | dict | None = None, **trainer_kwargs) -> list[dict[str, float]]:
    """Build the recipe from defaults + ``overrides`` and run :meth:`RLTrainer.fit`."""
    return RLTrainer(build_recipe(overrides), **trainer_kwargs).fit()


def config_summary(cfg: RecipeSpec) -> str:
    return OmegaConf.to_yaml(OmegaConf.create(cfg.to_tree()))
