"""The generic agent loop: token in, token out, rewards from the environment.

States: PENDING -> GENERATING <-> INTERACTING -> DONE. The model's tokens are kept exactly
as sampled (mask 1, with their rollout logprobs); each environment turn is appended as the
chat template's increment (mask 0). The loop picks each instance id itself, so the
interaction is finalized whenever its start was attempted, errors (a failed reset) included.

A trajectory is ``excluded`` (left out of the loss and of its group's statistics) when its
environment failed and no ``env_error_reward`` is configured, or when an env-provided
prompt is longer than ``max_prompt_length``.

With a vision-language model, the prompt and every environment turn may hold pictures (a
content list of text and picture parts): each turn's placeholders are widened to the picture's
tokens as it is appended (still mask 0), and the trajectory carries the pixels and positions of
its whole sequence (``images``). A picture the loop cannot read is the environment's error.
"""

from __future__ import annotations

import asyncio
import enum
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from transformers import PreTrainedTokenizerBase

from opentinker.engine.chat import ChatTemplater
from opentinker.engine.rollout import Completion, SamplingParams
from opentinker.engine.conversation_pictures import ConversationPictures, Widened
from opentinker.engine.vision import PromptImages, VisionPromptEncoder
from opentinker.environments.interaction import (
    MAX_STEPS_REACHED,
    TRUNCATED,
    EnvironmentServerError,
    Interaction,
)

GenerateFn = Callable[[Sequence[int], SamplingParams], Awaitable[Completion]]
RewardMode = Literal["sum", "last", "score"]

STOP_REASONS = (
    "completed",  # single turn without an interaction: the model answered
    "env_done",  # the environment said done
    "env_truncated",  # the environment said done because it cut the episode short (gym's truncated)
    "max_env_steps",  # the interaction's own step budget (e.g. GymEnvironmentInteraction max_steps) ran out
    "max_assistant_turns",
    "max_user_turns",
    "max_response_length",  # the total response budget (model + environment tokens) ran out
    "prompt_too_long",  # an env-provided prompt exceeds max_prompt_length: ended before generation
    "env_error",  # the environment server failed (HTTP error, timeout, bad JSON)
    # a vision-language model sampled its image token, which only a picture may hold: the
    # sequence cannot be scored (its pictures and image tokens would not match)
    "sampled_image_token",
)
#: Stop reasons after which a trajectory has no reward of its own: it is excluded, or (env_error
#: with a configured env_error_reward) gets that reward.
EXCLUDABLE_STOP_REASONS = ("env_error", "prompt_too_long", "sampled_image_token")


class AgentState(enum.Enum):
    PENDING = "pending"
    GENERATING = "generating"
    INTERACTING = "interacting"
    DONE = "done"


@dataclass(frozen=True)
class AgentLoopConfig:
    """Budgets of one trajectory and how its turn rewards become one reward."""

    max_assistant_turns: int = 5
    max_user_turns: int = 5
    max_tokens_per_turn: int = 64
    max_response_length: int = 256  # model + environment tokens after the prompt
    reward_mode: RewardMode = "sum"  # sum | last | score (the interaction's calculate_score)
    # None: a trajectory ended by an env error is excluded (see Trajectory.excluded);
    # a number: it is kept with this reward.
    env_error_reward: float | None = None
    # Prompts the environment writes (data-free rows) longer than this end the trajectory
    # before generation (stop reason prompt_too_long); None: no limit.
    max_prompt_length: int | None = None


@dataclass(frozen=True)
class Trajectory:
    """One agent-loop run.

    ``response_mask[i]`` is 1 where ``response_ids[i]`` was sampled from the model (these
    tokens, and only these, carry loss) and 0 on environment/template tokens.
    ``rollout_logprobs`` is aligned with ``response_ids`` (0.0 on environment tokens). The
    scalar ``reward`` belongs on the last mask-1 token. ``excluded``: the trajectory must be
    left out of the loss and of its group's advantage statistics (its ``reward`` is then a
    placeholder 0.0); set for ``prompt_too_long`` and, without ``env_error_reward``, ``env_error``.
    """

    prompt_ids: list[int]
    response_ids: list[int]
    response_mask: list[int]
    rollout_logprobs: list[float]
    reward: float
    turn_rewards: list[float]
    num_turns: int
    stop_reason: str
    messages: list[dict[str, str]]
    info: dict[str, Any] = field(default_factory=dict)
    excluded: bool = False
    images: PromptImages | None = None  # the pictures of the prompt and env turns (a VLM's)


class AgentLoop:
    """Runs one trajectory per :meth:`run` call; many run concurrently on one event loop."""

    def __init__(
        self,
        generate: GenerateFn,
        tokenizer: PreTrainedTokenizerBase,
        templater: ChatTemplater,
        config: AgentLoopConfig,
        sampling: SamplingParams,
        pictures: VisionPromptEncoder | None = None,
    ):
        self.generate = generate
        self.tokenizer = tokenizer
        self.templater = templater
        self.config = config
        self.sampling = sampling
        self.pictures = pictures  # a vision-language model's encoder (None: a text model)

    async def run(
        self,
        messages: Sequence[dict[str, str]] | None,
        interaction: Interaction | None = None,
        interaction_kwargs: dict[str, Any] | None = None,
        instance_id: str | None = None,
    ) -> Trajectory:
        """One trajectory; ``instance_id`` names its env instance (None: a fresh uuid4), so a
        caller that must finalize instances a crash left open knows them before they start."""
        run = _Run(self, list(messages or []), interaction, dict(interaction_kwargs or {}), instance_id)
        return await run.execute()


class _Run:
    """The mutable state of one trajectory while it is being produced."""

    def __init__(self, loop: AgentLoop, messages: list[dict[str, str]], interaction: Interaction | None,
                 interaction_kwargs: dict[str, Any], instance_id: str | None = None):
        self.loop = loop
        self.cfg = loop.config
        self.messages = messages
        self.interaction = interaction
        self.interaction_kwargs = interaction_kwargs
        self.state = AgentState.PENDING
        self.chosen_instance_id = instance_id
        self.instance_id: str | None = None
        self.prompt_ids: list[int] = []
        self.response_ids: list[int] = []
        self.response_mask: list[int] = []
        self.logprobs: list[float] = []
        self.turn_rewards: list[float] = []
        self.assistant_turns = 0
        self.user_turns = 0
        self.turn_ended = True  # did the model's last turn end with its end-of-turn token?
        self.stop_reason = ""
        self.env_seconds = 0.0
        self.env_calls = 0
        self.error: str | None = None
        self.error_url: str | None = None
        self.env_unreachable = False  # the env error was an outage (EnvironmentServerError.unreachable)
        self.env_timeout = False  # a call ran past the interaction's deadline
        self.pictures = ConversationPictures(loop.pictures)

    async def execute(self) -> Trajectory:
        try:
            try:
                await self._start()
                while self.state is not AgentState.DONE:
                    if self.state is AgentState.GENERATING:
                        await self._generate()
                    else:
                        await self._interact()
            except EnvironmentServerError as error:
                self._env_failed(error)
            reward = await self._reward()  # before finalizing: a score may need the instance
        finally:
            await self._finalize()
        return self._trajectory(reward)

    # -- states --------------------------------------------------------------------
    async def _start(self) -> None:
        env_prompt = False
        if self.interaction is not None:
            # Chosen here, before the call, so a start that fails half-way is still finalized.
            self.instance_id = self.chosen_instance_id or str(uuid.uuid4())
            start = self.interaction.start_interaction(self.instance_id, **self.interaction_kwargs)
            started = await self._env_call(start, start_call=True)
            self.instance_id = started or self.instance_id
            if not any(m.get("role") == "user" for m in self.messages):  # data-free: the env opens
                env_prompt = True
                first = await self._env_call(self.interaction.initial_observation(self.instance_id))
                if first is None:
                    raise ValueError("the dataset row has no prompt and the interaction gives no initial observation")
                if first.system_prompt:
                    self.messages.insert(0, {"role": "system", "content": first.system_prompt})
                self.messages.append({"role": "user", "content": first.observation})
        if not self.messages:
            raise ValueError("an agent loop needs prompt messages or a data-free interaction")
        opening = self._with_pictures(self.messages, self.loop.templater.prompt_ids(self.messages))
        self.prompt_ids = self.pictures.keep(opening)
        limit = self.cfg.max_prompt_length
        if env_prompt and limit is not None and len(self.prompt_ids) > limit:
            self.error = (f"the environment's prompt has {len(self.prompt_ids)} tokens, "
                          f"more than max_prompt_length={limit}")
            return self._stop("prompt_too_long")
        self.state = AgentState.GENERATING

    async def _generate(self) -> None:
        budget = min(self.cfg.max_tokens_per_turn, self.cfg.max_response_length - len(self.response_ids))
        if budget <= 0:
            return self._stop("max_response_length")
        params = replace(self.loop.sampling, max_tokens=budget)
        completion = await self.loop.generate(self.pictures.context(self.prompt_ids + self.response_ids), params)
        self._append(completion.token_ids, mask=1, logprobs=completion.logprobs)
        if self.pictures.holds_image_token(completion.token_ids):
            self.error = "the model sampled its image token, which only a picture may hold"
            return self._stop("sampled_image_token")
        self.assistant_turns += 1
        self.turn_ended = completion.finish_reason == "stop"
        text = self.loop.tokenizer.decode(completion.token_ids, skip_special_tokens=True)
        self.messages.append({"role": "assistant", "content": text})
        if self.interaction is None:
            return self._stop("completed")
        self.state = AgentState.INTERACTING

    async def _interact(self) -> None:
        assert self.interaction is not None and self.instance_id is not None
        done, text, reward, info = await self._env_call(
            self.interaction.generate_response(self.instance_id, list(self.messages))
        )
        self.turn_rewards.append(float(reward))
        if done:
            if info.get(MAX_STEPS_REACHED) is True:
                return self._stop("max_env_steps")
            return self._stop("env_truncated" if info.get(TRUNCATED) is True else "env_done")
        if self.assistant_turns >= self.cfg.max_assistant_turns:
            return self._stop("max_assistant_turns")
        if self.user_turns >= self.cfg.max_user_turns:
            return self._stop("max_user_turns")
        env_turn = self._with_pictures([{"role": "user", "content": text}],
                                       self.loop.templater.turn_ids(text, "user", model_turn_ended=self.turn_ended))
        if len(self.response_ids) + len(env_turn.ids) >= self.cfg.max_response_length:
            return self._stop("max_response_length")  # no room for the env turn and a reply
        self._append(self.pictures.keep(env_turn), mask=0)
        self.user_turns += 1
        self.messages.append({"role": "user", "content": text})
        self.state = AgentState.GENERATING

    # -- helpers -------------------------------------------------------------------
    def _with_pictures(self, messages: list[dict], ids: list[int]) -> Widened:
        """``ids`` with the pictures of ``messages`` widened (kept once appended); a picture that
        cannot be read is the environment's error (it sent it, or opened the chat with it)."""
        try:
            return self.pictures.widen(messages, ids)
        except ValueError as error:
            endpoint = self.interaction.endpoint_for(self.instance_id or "") if self.interaction is not None else ""
            raise EnvironmentServerError(endpoint, f"a picture of the conversation: {error}") from None

    def _stop(self, reason: str) -> None:
        self.stop_reason = reason
        self.state = AgentState.DONE

    def _env_failed(self, error: EnvironmentServerError) -> None:
        self.error, self.error_url = str(error), error.url
        self.env_unreachable = error.unreachable
        self._stop("env_error")

    @property
    def excluded(self) -> bool:
        if self.stop_reason == "env_error":
            return self.cfg.env_error_reward is None
        return self.stop_reason in ("prompt_too_long", "sampled_image_token")

    def _append(self, ids: Sequence[int], mask: int, logprobs: Sequence[float] | None = None) -> None:
        self.response_ids.extend(ids)
        self.response_mask.extend([mask] * len(ids))
        self.logprobs.extend(logprobs if logprobs is not None else [0.0] * len(ids))

    async def _env_call(self, call: Awaitable, start_call: bool = False):
        """``call`` under the interaction's deadline (its ``start_deadline_s`` for the start, else its
        ``call_deadline_s``): one that runs past it is an env error (the trajectory is left out; the
        step goes on), naming the endpoint."""
        start = time.perf_counter()
        assert self.interaction is not None
        deadline = self.interaction.start_deadline_s() if start_call else self.interaction.call_deadline_s()
        try:
            if deadline is None:
                return await call
            try:
                return await asyncio.wait_for(call, deadline)
            except asyncio.TimeoutError:
                self.env_timeout = True
                endpoint = self.interaction.endpoint_for(self.instance_id or "")
                raise EnvironmentServerError(endpoint, f"no answer within the interaction's deadline of {deadline:g} s "
                                             "(timeout_s)") from None
        finally:
            self.env_seconds += time.perf_counter() - start
            self.env_calls += 1

    async def _finalize(self) -> None:
        if self.interaction is not None and self.instance_id is not None:
            try:  # under the same deadline as every other call: a finalize that hangs must not hold the step
                await asyncio.wait_for(self.interaction.finalize_interaction(self.instance_id),
                                       self.interaction.call_deadline_s())
            except Exception as error:  # finalizing must never hide the trajectory
                self.error = self.error or f"finalize failed: {error}"

    async def _reward(self) -> float:
        if self.stop_reason in EXCLUDABLE_STOP_REASONS:
            return self._failed_reward()
        if self.cfg.reward_mode == "score" and self.interaction is not None and self.instance_id is not None:
            try:
                return float(await self.interaction.calculate_score(self.instance_id))
            except EnvironmentServerError as error:  # the episode ran, but its score is unknown
                self._env_failed(error)
                return self._failed_reward()
        if self.cfg.reward_mode == "last":
            return self.turn_rewards[-1] if self.turn_rewards else 0.0
        return float(sum(self.turn_rewards))

    def _failed_reward(self) -> float:
        """The configured env-error reward, or 0.0 as a placeholder for an excluded trajectory."""
        if self.stop_reason == "env_error" and self.cfg.env_error_reward is not None:
            return float(self.cfg.env_error_reward)
        return 0.0

    def _trajectory(self, reward: float) -> Trajectory:
        return Trajectory(
            prompt_ids=self.prompt_ids,
            response_ids=self.response_ids,
            response_mask=self.response_mask,
            rollout_logprobs=self.logprobs,
            reward=reward,
            turn_rewards=self.turn_rewards,
            num_turns=self.assistant_turns,
            stop_reason=self.stop_reason,
            messages=self.messages,
            info={"env_seconds": self.env_seconds, "env_calls": self.env_calls, "error": self.error,
                  "error_url": self.error_url, "env_unreachable": self.env_unreachable,
                  "env_timeout": self.env_timeout},
            excluded=self.excluded,
            images=self.pictures.images(self.prompt_ids + self.response_ids),
        )
