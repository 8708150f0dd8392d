"""The RL trainer: one function per phase, read top to bottom.

A step is: rollout (n samples per prompt) -> rewards -> old/ref logprobs -> advantages ->
update -> weight sync -> metrics. Everything heavy sits behind two objects: the
``TrainingBackend`` (the training primitives: forward, forward_backward, optim_step,
weights) that the PPO recipe (``engine/ppo.py``) drives, and the ``RolloutEngine`` (sampling).

Samples that cannot be trained on (excluded trajectories: env errors without an
``env_error_reward``, env prompts that are too long; and any whose env failed before the
model spoke) leave the batch before advantages. A step left with nothing because an env
server could not be reached is waited out and redone, not skipped (``engine/env_outage.py``;
``trainer.env_outage_timeout_s``). A step left with nothing for any other reason (the env
answered with errors of its own, prompts too long) is skipped: it still counts
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

from opentinker.config import ConfigError, make_config
from opentinker.engine.advantage_stage import AdvantageStage
from opentinker.engine.agent_runner import environment_metrics, failure_summary
from opentinker.engine.algorithms import get_advantage_estimator
from opentinker.engine.backend import BackendSpec, TrainingBackend, make_backend
from opentinker.engine.batch import TokenBatch
from opentinker.engine.checkpoints import CRITIC_STATE, find_checkpoint, read_trainer_state, write_checkpoint
from opentinker.engine.correction import sampler_gap_metrics, without_rejected
from opentinker.engine.data import Prompt, PromptLoader, RewardFn, builtin_task, tokenize_rows
from opentinker.engine.env_outage import (
    PROBE_TIMEOUT_S, EnvironmentUnavailableError, EnvOutage, unreachable_endpoints,
)
from opentinker.engine.model_loading import (
    eos_token_ids,
    load_causal_lm,
    load_tokenizer,
    pick_device,
    resolve_model_path,
)
from opentinker.engine.ppo import CriticUpdate, PPOUpdate
from opentinker.engine.reward_deadline import DeadlineScorer
from opentinker.engine.rollout import RolloutEngine, make_rollout_engine
from opentinker.engine.rollout_sources import PipelinedRollouts, RolloutSource, StepRollouts
from opentinker.engine.sampling import RolloutSampler
from opentinker.engine.step_metrics import rollout_metrics, token_count, validation_metrics
from opentinker.engine.step_types import Rollout, Timer
from opentinker.environments.interaction import Interaction
from opentinker.recipe import RecipeSpec


if TYPE_CHECKING:
    from opentinker.creativity import StrategyJudge

StepCallback = Callable[[int, dict[str, float]], None]


class RLTrainer:
    """Trains a causal LM with PPO-style updates on rewards from ``reward_fn``."""

    def __init__(
        self,
        cfg: RecipeSpec | DictConfig,
        *,
        train_rows: Sequence[dict] | None = None,
        val_rows: Sequence[dict] | None = None,
        reward_fn: RewardFn | None = None,
        strategy_judge: "StrategyJudge | None" = None,
        interactions: Mapping[str, Interaction] | None = None,
    ):
        # The typed recipe (a checked config is typed here; its attributes are the dotted keys).
        cfg = cfg if isinstance(cfg, RecipeSpec) else RecipeSpec.from_config(cfg)
        self.cfg = cfg
        self.estimator = get_advantage_estimator(cfg.algorithm.adv_estimator)
        self.strategy_judge = strategy_judge
        torch.manual_seed(cfg.trainer.seed)

        self.interactions = dict(interactions or {})
        if train_rows is None or (reward_fn is None and not self.interactions):
            task_train, task_val, task_reward = builtin_task(cfg.data.task, val_count=cfg.data.val_batch_size)
            train_rows = task_train if train_rows is None else train_rows
            val_rows = task_val if val_rows is None else val_rows
            reward_fn = reward_fn or task_reward
        self.reward_fn = reward_fn
        self.reward_scorer = None if reward_fn is None else DeadlineScorer(reward_fn, cfg.reward_model.timeout_s)

        ar = cfg.actor_rollout_ref
        self.device = pick_device(cfg.trainer.device)
        self.model_path = resolve_model_path(ar.model.path)
        self.tokenizer = load_tokenizer(self.model_path, ar.model.trust_remote_code)
        data_free = bool(self.interactions)
        self.train_prompts = tokenize_rows(train_rows, self.tokenizer, cfg.data.max_prompt_length, "train", data_free)
        self.val_prompts = tokenize_rows(val_rows or [], self.tokenizer, cfg.data.max_prompt_length, "val", data_free)
        self.loader = iter(PromptLoader(self.train_prompts, cfg.data.train_batch_size, cfg.data.shuffle, cfg.data.seed))

        self.eos_ids = eos_token_ids(self.tokenizer, self.model_path)
        self.backend: TrainingBackend = make_backend(
            BackendSpec.from_config(cfg, self.model_path, self.tokenizer.pad_token_id))
        self.ppo = PPOUpdate(self.backend, cfg, seed=cfg.trainer.seed)
        # PPO with GAE learns a value model beside the policy (the critic).
        self.critic = self._make_critic() if cfg.algorithm.adv_estimator == "gae" else None
        # async_training.max_staleness > 0: rollouts run ahead of the update (RolloutPipeline).
        self.max_staleness = int(cfg.async_training.max_staleness)
        self._startup_warnings: list[str] = []  # found while building, said at the first step
        self.rollout: RolloutEngine = self._make_rollout_engine()
        # Where each step's rollout comes from: made in the step, or launched steps ahead.
        self.rollouts: RolloutSource = (
            PipelinedRollouts(self.max_staleness, self.loader, self.rollout_through_outages, self.rollout,
                              self.backend.weights) if self.max_staleness else
            StepRollouts(self.loader, self.rollout_through_outages, self.rollout, self.backend.weights))
        # Samples and scores responses: one batched generate and the reward function, or agent loops.
        self.sampler = RolloutSampler(cfg, self.rollout, self.tokenizer, self.eos_ids, self.interactions,
                                      self.reward_scorer, warn=lambda message: self.on_warning(message))
        self.agent_loops = self.sampler.agent_loops
        self.global_step = 0
        self.skipped_steps = 0  # steps with nothing to train on, in all
        self.consecutive_skipped_steps = 0
        self.resumed_from: Path | None = None
        # Set by whoever drives the trainer (the job runner: warning events; cancel raises):
        # a step waiting out an env outage warns and checks for a cancel while it waits.
        self.on_warning: Callable[[str], None] = _print_warning
        self.check_cancelled: Callable[[], None] = lambda: None
        self.wandb_run = start_wandb(cfg) if "wandb" in cfg.trainer.logger else None
        if self.strategy_judge is None and cfg.algorithm.enable_solution_classification:
            self.strategy_judge = judge_from_config(cfg, self.model_path)
        self.advantages = AdvantageStage(cfg.algorithm, self.estimator, self.strategy_judge)
        checkpoint = find_checkpoint(cfg.trainer.resume_mode, cfg.trainer.default_local_dir)
        if checkpoint is not None:
            self.resume(checkpoint)

    def _make_critic(self) -> CriticUpdate:
        """The value model: ``critic.model.path`` (the actor's model by default) with a value
        head; it must read the actor's tokens, so its tokenizer must be the actor's."""
        cfg = self.cfg
        path = self.model_path if cfg.critic.model.path is None else resolve_model_path(cfg.critic.model.path)
        if path != self.model_path:
            critic_tokenizer = load_tokenizer(path, cfg.actor_rollout_ref.model.trust_remote_code)
            if critic_tokenizer.get_vocab() != self.tokenizer.get_vocab():
                raise ConfigError(f"critic.model.path: {cfg.critic.model.path} has another tokenizer than the "
                                  "actor's model; a critic must read the actor's token ids")
        spec = BackendSpec.critic_from_config(cfg, path, self.tokenizer.pad_token_id)
        return CriticUpdate(make_backend(spec), cfg, seed=cfg.trainer.seed)

    def _make_rollout_engine(self) -> RolloutEngine:
        ar = self.cfg.actor_rollout_ref
        if ar.rollout.name == "vllm":
            if self.max_staleness and self.device.type == "cuda" and ar.rollout.placement == "colocated":
                raise ConfigError("async_training.max_staleness > 0 with vLLM on a GPU needs "
                                  "actor_rollout_ref.rollout.placement=separate (a colocated engine sleeps "
                                  "while the update runs; an asynchronous one keeps generating)")
            return make_rollout_engine(
                "vllm",
                model_path=self.model_path,
                seed=self.cfg.trainer.seed,
                max_model_len=ar.rollout.max_model_len or self.cfg.data.max_prompt_length + self.cfg.data.max_response_length,
                gpu_memory_utilization=ar.rollout.gpu_memory_utilization,
                tensor_parallel_size=ar.rollout.tensor_model_parallel_size,
                replicas=ar.rollout.replicas,
                placement=ar.rollout.placement,
                training_gpus=self.cfg.trainer.n_gpus_per_node if self.device.type == "cuda" else 0,
                enable_prefix_caching=ar.rollout.enable_prefix_caching,
                device=self.device.type,
                trust_remote_code=ar.model.trust_remote_code,
            )
        if self.max_staleness:  # in a process of its own, so that it runs during the update
            from opentinker.engine.rollout.remote import RemoteRolloutEngine

            warning = shared_gpu_warning(self.device.type)
            if warning:
                self._startup_warnings.append(warning)

            if self.device.type == "cpu":  # one core for the engine: oversubscribed OpenMP threads spin
                torch.set_num_threads(max(1, torch.get_num_threads() - 1))
            return RemoteRolloutEngine(
                str(self.model_path), seed=self.cfg.trainer.seed, max_batch_size=ar.rollout.max_batch_size,
                threads=1, device=self.device.type, trust_remote_code=ar.model.trust_remote_code,
                compile_decode=ar.rollout.compile_decode)
        dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        model = load_causal_lm(self.model_path, dtype=dtype, device=self.device, trust_remote_code=ar.model.trust_remote_code)
        return make_rollout_engine(
            "transformers",
            model=model,
            eos_token_ids=self.eos_ids,
            pad_token_id=self.tokenizer.pad_token_id,
            seed=self.cfg.trainer.seed,
            max_batch_size=ar.rollout.max_batch_size,
            tokenizer=self.tokenizer,
            compile_decode=ar.rollout.compile_decode,
        )

    # -- phases --------------------------------------------------------------------
    def generate(self, prompts: Sequence[Prompt], samples_per_prompt: int, validation: bool = False) -> Rollout:
        """Sample ``samples_per_prompt`` responses to each prompt and score them (the sampler's)."""
        return self.sampler.generate(prompts, samples_per_prompt, validation)

    def to_batch(self, rollout: Rollout) -> TokenBatch:
        trajectories = rollout.trajectories
        batch = TokenBatch.from_responses(
            [t.prompt_ids for t in trajectories], [t.response_ids for t in trajectories],
            [t.response_mask for t in trajectories],
        )
        batch.tensors["rollout_logprobs"] = batch.pad_response_values([t.rollout_logprobs for t in trajectories])
        return batch

    # The advantage stage owns this; kept here for callers (and tests) that spy on a step's advantages.
    token_rewards = staticmethod(AdvantageStage.token_rewards)

    def compute_advantages(self, batch: TokenBatch, rollout: Rollout) -> dict[str, float]:
        return self.advantages.compute(batch, rollout)

    def sync_weights(self) -> None:
        """Stream the backend's weights into the rollout engine, bucket by bucket."""
        self.rollout.update_weights(self.backend.weights())

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

    def rollout_through_outages(self, prompts: Sequence[Prompt], timer: Timer) -> tuple[Rollout, EnvOutage | None]:
        """The step's rollout; while it has nothing to train on because env servers could not
        be reached, wait until their /health answers (:class:`EnvOutage`, at most
        ``trainer.env_outage_timeout_s``, then :class:`EnvironmentUnavailableError`) and redo it.

        A redo has the step's prompts (drawn once by :meth:`step`; env seeds follow from them)
        and the sampler's random state at the first try, so it samples as the step would have
        without the outage. Checkpoints fall between steps, so none holds a half-waited step:
        a run resumed after an outage numbers and draws its steps as an unbroken one.
        """
        rng_at_start = self.rollout.rng_state()
        outage: EnvOutage | None = None
        while True:
            with timer.phase("rollout"):
                full_rollout = self.generate(prompts, self.cfg.actor_rollout_ref.rollout.n)
            if full_rollout.trainable():
                break
            down = unreachable_endpoints(full_rollout.trajectories, full_rollout.interaction_names)
            if not down:
                break  # empty, but the envs answered: redoing it would fail alike (skip_step)
            if outage is None:
                outage = EnvOutage(self.global_step + 1, self.cfg.trainer.env_outage_timeout_s,
                                   lambda urls: self.agent_loops.probe_health(urls, PROBE_TIMEOUT_S),
                                   self.on_warning, self.check_cancelled)
            last_error = next((t.info["error"] for t in reversed(full_rollout.trajectories)
                               if t.info.get("env_unreachable")), "")
            with timer.phase("env_outage_wait"):
                outage.wait(down, last_error)
            if rng_at_start is not None:
                self.rollout.set_rng_state(rng_at_start)
        if outage is not None:
            outage.resumed()
        return full_rollout, outage

    def train_on(self, rollout: Rollout, timer: Timer) -> tuple[TokenBatch, dict[str, float]]:
        """Old/ref logprobs, advantages, the update and the weight sync for ``rollout``."""
        cfg = self.cfg
        temperature = cfg.actor_rollout_ref.rollout.temperature or 1.0
        batch = self.to_batch(rollout)
        self.rollouts.before_update()
        correction = cfg.algorithm.rollout_correction
        if correction.bypass_mode:  # the sampler's logprobs are the old ones (no recompute)
            batch.tensors["old_logprobs"] = batch.tensors["rollout_logprobs"].clone()
        # Decided by the batch actually trained. An update of one optimizer step needs none: its
        # ratio is 1 and IS weights come from its own pass (rejection must know them before).
        elif self.ppo.needs_old_logprobs(batch) or correction.rollout_rs is not None:
            with timer.phase("old_logprob"):
                batch.tensors["old_logprobs"] = self.ppo.logprobs(batch, temperature=temperature)
        if cfg.actor_rollout_ref.actor.use_kl_loss:
            with timer.phase("ref_logprob"):
                batch.tensors["ref_logprobs"] = self.ppo.logprobs(batch, temperature=temperature, reference=True)
        if self.critic is not None:
            with timer.phase("values"):
                batch.tensors["old_values"] = self.critic.values(batch)
        with timer.phase("advantages"):
            adv_metrics = self.compute_advantages(batch, rollout)
        update_metrics: dict[str, float] = {}
        if self.critic is not None:
            with timer.phase("update_critic"):
                update_metrics.update(self.critic.update(batch))
        actor_batch = without_rejected(batch, cfg.algorithm.rollout_correction)
        # trainer.critic_warmup: the first steps train the critic alone.
        self.ppo.logprobs_before_update = None
        if self.critic is None or self.global_step >= cfg.trainer.critic_warmup:
            with timer.phase("update"):
                update_metrics.update(self.ppo.update(actor_batch, temperature=temperature))
        correction_metrics = sampler_gap_metrics(batch, cfg.algorithm.rollout_correction,
                                                 bool(self.max_staleness), self.ppo.logprobs_before_update)
        with timer.phase("sync"):
            self.rollouts.after_update(self.global_step + 1)
        return batch, {**adv_metrics, **correction_metrics, **update_metrics}

    def skip_step(self, full_rollout: Rollout, timer: Timer) -> dict[str, Any]:
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
        return tokenize_rows(rows, self.tokenizer, self.cfg.data.max_prompt_length, split, bool(self.interactions))

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
        """``<default_local_dir>/global_step_<k>/``: ``actor/`` (a Hugging Face folder),
        ``state/`` (the backend's weights, optimizer and RNG) and ``trainer_state.pt`` (step,
        data position, schedules, RNG); the file ``latest_checkpointed_iteration.txt`` names
        the newest complete one. Returns the ``actor`` folder."""
        root = self.cfg.trainer.default_local_dir
        if not root:
            return None
        critic = self.critic.backend if self.critic is not None else None
        return write_checkpoint(Path(root), self.global_step, self.backend, self.tokenizer, critic,
                                self.trainer_state())

    def trainer_state(self) -> dict[str, Any]:
        """What, besides the backend's state, a run needs to continue exactly as it would have."""
        ppo = self.ppo.state_dict()
        critic = self.critic.state_dict() if self.critic is not None else {"updates": None, "shuffle": None}
        return {
            "global_step": self.global_step,
            "ppo_updates": ppo["updates"],
            "ppo_shuffle": ppo["shuffle"],
            "skipped_steps": self.skipped_steps,
            "consecutive_skipped_steps": self.consecutive_skipped_steps,
            "loader": self.rollouts.loader_state(),
            "rollout_rng": self.rollouts.rng_state(),
            "critic_updates": critic["updates"],
            "critic_shuffle": critic["shuffle"],
        }

    def resume(self, checkpoint: Path) -> None:
        """Continue from ``checkpoint`` (a ``global_step_<k>`` folder): the backend's state,
        the trainer's, and the rollout engine's weights."""
        state = read_trainer_state(checkpoint)
        self.backend.load_state(checkpoint / "state")
        self.global_step = int(state["global_step"])
        self.ppo.load_state_dict({"updates": state["ppo_updates"], "shuffle": state["ppo_shuffle"]})
        self.skipped_steps = int(state["skipped_steps"])
        self.consecutive_skipped_steps = int(state["consecutive_skipped_steps"])
        self.loader.load_state_dict(state["loader"])
        if self.critic is not None:
            if state.get("critic_updates") is None:
                raise ConfigError(f"trainer.resume_mode: {checkpoint} was saved without a critic "
                                  "(algorithm.adv_estimator was not gae)")
            self.critic.backend.load_state(checkpoint / CRITIC_STATE)
            self.critic.load_state_dict({"updates": state["critic_updates"], "shuffle": state["critic_shuffle"]})
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
            path = self.save_checkpoint()
            if path is not None:
                metrics["checkpoint"] = str(path)
        return metrics

    def initial_validation(self) -> dict[str, float]:
        """Validation before the first step (not again when resuming)."""
        trainer_cfg = self.cfg.trainer
        wanted = trainer_cfg.val_before_train and trainer_cfg.test_freq > 0 and self.resumed_from is None
        return self.validate() if wanted else {}

    def fit(self, on_step: StepCallback | None = None) -> list[dict[str, Any]]:
        """Train for ``trainer.total_training_steps``; returns every step's metrics."""
        total = self.cfg.trainer.total_training_steps
        history: list[dict[str, Any]] = []
        progress = _progress_bar(total, self.cfg.trainer.progress_bar)
        last_val = self.initial_validation()
        if last_val:
            history.append({"step": 0, **last_val})
            progress.write(f"step 0: {_format(last_val)}")
            self._log_wandb(history[-1], step=0)
        while self.global_step < total:
            metrics = self.train_step()
            if "skip_reason" in metrics:
                progress.write(f"step {self.global_step}: skipped, nothing to train on: {metrics['skip_reason']}")
            val = {k: v for k, v in metrics.items() if k.startswith("val/")}
            if val:
                last_val = val
                progress.write(f"step {self.global_step}: {_format(last_val)}")
            history.append(metrics)
            progress.set_postfix(
                reward=f"{metrics.get('reward/mean', float('nan')):.3f}",
                kl=f"{metrics.get('actor/kl', 0.0):.4f}",
                val=f"{last_val.get('val/accuracy', float('nan')):.3f}",
            )
            progress.update(1)
            self._log_wandb(metrics, step=self.global_step)
            if on_step is not None:
                on_step(self.global_step, metrics)
        progress.close()
        return history

    def _log_wandb(self, metrics: dict[str, Any], step: int) -> None:
        """Every numeric metric of a step to the wandb run, at that step (skip_reason and
        checkpoint are strings and stay out)."""
        if self.wandb_run is not None:
            self.wandb_run.log({k: v for k, v in metrics.items() if isinstance(v, (int, float))}, step=step)

    def __enter__(self) -> RLTrainer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop the rollout pipeline, the agent-loop threads (closing the interactions'
        connections) and the wandb run (the trainer is unusable afterwards)."""
        self.rollouts.close()
        self.sampler.close()
        self.rollout.close()
        if self.wandb_run is not None:
            self.wandb_run.finish()
        self.backend.close()
        if self.critic is not None:
            self.critic.backend.close()


def judge_from_config(cfg: RecipeSpec, policy_model_path: str) -> "StrategyJudge":
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


def shared_gpu_warning(device_type: str) -> str | None:
    """What an asynchronous job with the transformers engine on a GPU is told: the rollout actor
    would share the trainer's GPU, where two processes take turns instead of overlapping."""
    if device_type != "cuda":
        return None
    return ("async_training.max_staleness > 0 puts the transformers rollout engine in a process beside the "
            "trainer on the same GPU; their kernels take turns there, and such a run measured 0.65x the "
            "synchronous steps/s on an H100 (benchmarks/README.md). Give the rollout GPUs of its own: "
            "actor_rollout_ref.rollout.name=vllm with actor_rollout_ref.rollout.placement=separate")


def _print_warning(message: str) -> None:
    from tqdm.auto import tqdm

    tqdm.write(f"warning: {message}")  # above a progress bar, if one is drawn


def _format(metrics: dict[str, float]) -> str:
    return " ".join(f"{k}={v:.4f}" for k, v in metrics.items())


def _progress_bar(total: int, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="GRPO steps", unit="step", disable=not enabled, dynamic_ncols=True)


def train(overrides: Sequence[str] | dict | None = None, **trainer_kwargs) -> list[dict[str, float]]:
    """Build the config from defaults + ``overrides`` and run :meth:`RLTrainer.fit`."""
    cfg = make_config(overrides)
    return RLTrainer(cfg, **trainer_kwargs).fit()


def config_summary(cfg: RecipeSpec) -> str:
    return OmegaConf.to_yaml(OmegaConf.create(cfg.to_tree()))
