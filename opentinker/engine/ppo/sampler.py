"""Sampling and scoring a step's responses: one batched ``generate`` of the rollout engine and
the reward function (single-turn tasks), or one agent loop per sample against the job's
interactions (multi-turn: the reward comes from the environment)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from opentinker.engine.agent_loop import AgentLoopConfig
from opentinker.engine.ppo.agent_runner import AgentLoopRunner, single_turn_trajectory
from opentinker.engine.chat import ChatTemplater
from opentinker.engine.data import Prompt, with_pictures
from opentinker.engine.ppo.env_instances import EnvInstanceJournal
from opentinker.engine.ppo.env_outage import PROBE_TIMEOUT_S, EnvOutage, unreachable_endpoints
from opentinker.engine.ppo.reward_deadline import TIMED_OUT, DeadlineScorer
from opentinker.engine.rollout import AsyncCompletions, RequestBatcher, RolloutEngine, SamplingParams
from opentinker.engine.ppo.step import StepSamples, Timer
from opentinker.engine.vision import VisionPromptEncoder
from opentinker.environments.interaction import Interaction
from opentinker.recipe import RecipeSpec

__all__ = ["RolloutSampler"]


class RolloutSampler:
    """Owns the agent loops (their threads and the interactions' connections) of a run."""

    def __init__(self, cfg: RecipeSpec, engine: RolloutEngine, tokenizer: Any, eos_ids: Any,
                 interactions: Mapping[str, Interaction], reward_scorer: DeadlineScorer | None,
                 warn: Callable[[str], None], check_cancelled: Callable[[], None],
                 pictures: VisionPromptEncoder | None = None):
        self.cfg = cfg
        self.pictures = pictures  # a vision-language model's prompt encoder
        self.engine = engine
        self.tokenizer = tokenizer
        self.reward_scorer = reward_scorer
        self.warn = warn
        self.check_cancelled = check_cancelled  # raises when the job was cancelled during an outage
        ar = cfg.actor_rollout_ref
        self.agent_loops: AgentLoopRunner | None = None
        if interactions:
            multi_turn = ar.rollout.multi_turn
            # An engine with its own continuous batching takes each turn as it comes; else
            # concurrent turns are gathered into batches.
            requests = engine if isinstance(engine, AsyncCompletions) else RequestBatcher(
                engine, max_batch_size=ar.rollout.max_batch_size)
            self.agent_loops = AgentLoopRunner(
                requests,
                tokenizer,
                ChatTemplater(tokenizer, eos_ids),
                AgentLoopConfig(
                    max_assistant_turns=multi_turn.max_assistant_turns,
                    max_user_turns=multi_turn.max_user_turns,
                    max_tokens_per_turn=multi_turn.max_tokens_per_turn,
                    max_response_length=cfg.data.max_response_length,
                    reward_mode=multi_turn.reward_mode,
                    env_error_reward=multi_turn.env_error_reward,
                    max_prompt_length=cfg.data.max_prompt_length,  # for prompts the env writes
                ),
                dict(interactions),
                # Env instances a killed process of this run left open are finalized at the start.
                EnvInstanceJournal.in_folder(cfg.trainer.default_local_dir),
                pictures,
            )

    def sampling_params(self, validation: bool = False) -> SamplingParams:
        rollout = self.cfg.actor_rollout_ref.rollout
        return SamplingParams(
            temperature=rollout.val_temperature if validation else rollout.temperature,
            top_p=1.0 if validation else rollout.top_p,
            top_k=-1 if validation else rollout.top_k,
            max_tokens=self.cfg.data.max_response_length,
            ignore_eos=False if validation else rollout.ignore_eos,
        )

    def generate(self, prompts: Sequence[Prompt], samples_per_prompt: int, validation: bool = False) -> StepSamples:
        """Sample ``samples_per_prompt`` responses to each prompt and score them.

        With interactions every sample is a (possibly multi-turn) agent loop whose reward
        comes from its environment; otherwise one batched generate call and ``reward_fn``.
        """
        prompts = with_pictures(prompts, self.tokenizer, self.pictures)  # pixels only while the step runs
        per_sample = [p for p in prompts for _ in range(samples_per_prompt)]
        params = self.sampling_params(validation)
        if self.agent_loops is not None:
            trajectories, names = self.agent_loops.run(per_sample, params)  # (step_warnings names env errors)
            texts = ["".join(m["content"] for m in t.messages if m["role"] == "assistant") for t in trajectories]
            return StepSamples(per_sample, trajectories, texts, names)
        completions = self.engine.generate([p.prompt_ids for p in per_sample], params)
        texts = self.tokenizer.batch_decode([c.token_ids for c in completions], skip_special_tokens=True)
        rewards = self.reward_scorer.score([(text, p.row) for p, text in zip(per_sample, texts)])
        trajectories = [single_turn_trajectory(p.prompt_ids, c, 0.0 if reward is TIMED_OUT else reward)
                        for p, c, reward in zip(per_sample, completions, rewards)]
        for index, completion in enumerate(completions):
            if self.pictures is not None and self.pictures.layout.image_token_id in completion.token_ids:
                trajectories[index] = dataclasses.replace(  # its pictures and image tokens would not match
                    trajectories[index], excluded=True, stop_reason="sampled_image_token",
                    info={"error": "the model sampled its image token, which only a picture may hold"})
        timed_out = [i for i, reward in enumerate(rewards) if reward is TIMED_OUT]
        for index in timed_out:  # left out of the step like a sample whose env failed
            trajectories[index] = dataclasses.replace(
                trajectories[index], excluded=True, stop_reason="reward_timeout",
                info={"error": f"reward function {self.reward_scorer.name} timed out after "
                               f"{self.reward_scorer.timeout_s:g} s"})
        if timed_out:
            self.warn(f"reward function {self.reward_scorer.name} ran past reward_model.timeout_s="
                            f"{self.reward_scorer.timeout_s:g} s on {len(timed_out)} of {len(rewards)} samples; "
                            "they are left out of this step")
        return StepSamples(per_sample, trajectories, texts, [None] * len(per_sample))

    def through_outages(self, generate: Callable[..., StepSamples], prompts: Sequence[Prompt], timer: Timer,
                        step_number: int) -> tuple[StepSamples, EnvOutage | None]:
        """Step ``step_number``'s rollout (``generate``) on its whole batch: while any of its samples
        failed because an env server could not be reached (an outage, a dropped relay, a broken
        session, a server at capacity for too long), wait until every such server's /health
        answers (:class:`EnvOutage`, at most ``trainer.env_outage_timeout_s``, then
        :class:`EnvironmentUnavailableError`) and redo the whole step. What is left out of a step
        is only what the env itself answered wrongly (its error replies), never a fault's victims:
        those are the quick episodes' survivors, a biased sample.

        A redo has the step's prompts (drawn once; env seeds follow from them) and the engine's
        random state at the first try, so it samples as the step would have without the outage.
        Checkpoints fall between steps, so none holds a half-waited step: a run resumed after an
        outage numbers and draws its steps as an unbroken one.
        """
        rng_at_start = self.engine.rng_state()
        outage: EnvOutage | None = None
        while True:
            with timer.phase("rollout"):
                full_rollout = generate(prompts, self.cfg.actor_rollout_ref.rollout.n)
            down = unreachable_endpoints(full_rollout.trajectories, full_rollout.interaction_names)
            if not down:
                break  # every sample trained, or failed by the env's own answer (redoing it would fail alike)
            if outage is None:
                outage = EnvOutage(step_number, self.cfg.trainer.env_outage_timeout_s,
                                   lambda urls: self.agent_loops.probe_health(urls, PROBE_TIMEOUT_S),
                                   self.warn, self.check_cancelled, wake=self.agent_loops.wait_for_relay)
            failed = [t for t in full_rollout.trajectories if t.info.get("env_unreachable")]
            with timer.phase("env_outage_wait"):
                outage.wait(down, failed[-1].info.get("error") or "", len(failed), len(full_rollout.trajectories))
            if rng_at_start is not None:
                self.engine.set_rng_state(rng_at_start)
        if outage is not None:
            outage.resumed()
        return full_rollout, outage

    def close(self) -> None:
        """Stop the agent-loop threads (closing the interactions' connections)."""
        if self.agent_loops is not None:
            self.agent_loops.close()
