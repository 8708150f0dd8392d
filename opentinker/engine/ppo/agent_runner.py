"""Runs a step's agent loops concurrently and summarizes them per environment."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
import zlib
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from transformers import PreTrainedTokenizerBase

from opentinker.engine.agent_loop import AgentLoop, AgentLoopConfig, Trajectory
from opentinker.engine.chat import ChatTemplater
from opentinker.engine.vision import VisionPromptEncoder
from opentinker.engine.ppo.env_instances import EnvInstanceJournal
from opentinker.engine.rollout import AsyncCompletions, Completion, RequestBatcher, SamplingParams
from opentinker.environments.env_routing import check_endpoint
from opentinker.environments.interaction import EnvironmentServerError, Interaction
from opentinker.environments.registry import select_interaction

if TYPE_CHECKING:
    from opentinker.engine.data import Prompt

logger = logging.getLogger(__name__)


def single_turn_trajectory(prompt_ids: list[int], completion: Completion, reward: float) -> Trajectory:
    """A plain completion as a one-turn trajectory (every response token is the model's)."""
    return Trajectory(
        prompt_ids=list(prompt_ids),
        response_ids=list(completion.token_ids),
        response_mask=[1] * len(completion.token_ids),
        rollout_logprobs=list(completion.logprobs),
        reward=reward,
        turn_rewards=[reward],
        num_turns=1,
        stop_reason="completed" if completion.finish_reason == "stop" else "max_response_length",
        messages=[],
    )


class AgentLoopRunner:
    """Owns one event loop (in a daemon thread) for every step's agent loops.

    One long-lived loop, not ``asyncio.run`` per step: interactions keep HTTP connection
    pools, and those are bound to the loop that opened them.

    Env instances a failure left open are finalized before each step: those an interaction
    could not finalize (its server was unreachable) and, through ``journal``, those a killed
    process of the same run had open (:mod:`opentinker.engine.ppo.env_instances`).
    """

    def __init__(
        self,
        requests: AsyncCompletions,
        tokenizer: PreTrainedTokenizerBase,
        templater: ChatTemplater,
        config: AgentLoopConfig,
        interactions: Mapping[str, Interaction],
        journal: EnvInstanceJournal | None = None,
        pictures: VisionPromptEncoder | None = None,
    ):
        self.requests = requests  # a RequestBatcher (owned: closed here) or an engine with agenerate
        self.pictures = pictures  # a vision-language model's encoder (pictures in prompts and env turns)
        self.tokenizer = tokenizer
        self.templater = templater
        self.config = config
        self.interactions = dict(interactions)
        self.journal = journal or EnvInstanceJournal(None)
        for name, ids in self.journal.read().items():  # left open by an earlier process of this run
            if name in self.interactions:
                self.interactions[name].adopt_unfinalized(ids)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="agent-loops", daemon=True)
        self._thread.start()

    def run(self, prompts: Sequence["Prompt"], params: SamplingParams) -> tuple[list[Trajectory], list[str]]:
        """One trajectory per prompt entry (in order) and the interaction name of each."""
        return asyncio.run_coroutine_threadsafe(self._run_all(prompts, params), self._loop).result()

    async def _run_all(self, prompts: Sequence["Prompt"], params: SamplingParams):
        await self.finalize_leftovers()
        loop = AgentLoop(self.requests.agenerate, self.tokenizer, self.templater, self.config, params, self.pictures)
        episodes = [self._episode(prompt) for prompt in prompts]
        starting: dict[str, list[str]] = defaultdict(list)
        for name, _, _, iid in episodes:
            starting[name].append(iid)
        self._journal(starting)
        try:
            trajectories = await asyncio.gather(*(
                loop.run(prompt.row.get("prompt"), interaction, kwargs, iid)
                for prompt, (_, interaction, kwargs, iid) in zip(prompts, episodes)))
        finally:
            self._journal({})
        return list(trajectories), [name for name, *_ in episodes]

    def _episode(self, prompt: "Prompt") -> tuple[str, Interaction, dict, str]:
        """The interaction of one sample (its name), its kwargs and its instance id."""
        interaction, kwargs = select_interaction(prompt.row, self.interactions)
        name = next(key for key, value in self.interactions.items() if value is interaction)
        # The n samples of a prompt share its environment seed, so GRPO compares like with like.
        kwargs.setdefault("seed", zlib.crc32(prompt.uid.encode()))
        return name, interaction, kwargs, str(uuid.uuid4())

    def _journal(self, starting: Mapping[str, list[str]]) -> None:
        """Keep on disk the instances a crash now could leave open: the leftovers and ``starting``."""
        open_ids: dict[str, list[str]] = {}
        for name, interaction in self.interactions.items():
            if interaction.keeps_instances_at_env:
                open_ids[name] = [*interaction.unfinalized_instances(), *starting.get(name, ())]
        self.journal.write(open_ids)

    async def finalize_leftovers(self) -> int:
        """Finalize what earlier steps (or processes) left open at the envs; how many are still open."""
        counts = await asyncio.gather(*(i.finalize_leftovers() for i in self.interactions.values()))
        self._journal({})
        return sum(counts)

    def probe_health(self, urls: Sequence[str], timeout_s: float) -> dict[str, str | None]:
        """``GET {url}/health`` of each env server, concurrently: ``{url: None}`` when it answered
        2xx, else the error text. Run on the loops' own event loop, like the env calls, and by the
        route of the interaction that names the server (a relayed one through the job's client)."""
        owners = {url: interaction for interaction in self.interactions.values()
                  for url in getattr(interaction, "endpoints", dict)()}

        async def probe(url: str) -> str | None:
            try:
                owner = owners.get(url)
                await (owner.check_health(url, timeout_s) if owner is not None else check_endpoint(url, timeout_s))
            except EnvironmentServerError as error:
                return str(error)
            return None

        async def probe_all() -> list[str | None]:
            return await asyncio.gather(*(probe(url) for url in urls))

        return dict(zip(urls, asyncio.run_coroutine_threadsafe(probe_all(), self._loop).result()))

    def wait_for_relay(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for a client relay of this job that is not connected to connect:
        True when one did (an outage wait then probes at once instead of at its next probe). With
        every relay connected, or none, a plain sleep and False."""
        hubs = {id(hub): hub for hub in (getattr(i, "relay_hub", None) for i in self.interactions.values()) if hub}
        detached = [hub for hub in hubs.values() if not hub.status()["connected"]]
        if not detached:
            time.sleep(timeout_s)
            return False
        return detached[0].wait_attached(timeout_s)

    def close(self) -> None:
        """Closes the interactions' connections on the loop they were opened in, then the loop."""

        async def close_interactions() -> None:
            results = await asyncio.gather(*(i.aclose() for i in self.interactions.values()), return_exceptions=True)
            for interaction, result in zip(self.interactions.values(), results):
                if isinstance(result, Exception):
                    logger.warning("closing interaction %r failed: %r", interaction.name, result)

        if self._thread.is_alive():
            try:
                asyncio.run_coroutine_threadsafe(close_interactions(), self._loop).result(timeout=10)
            except Exception as exc:  # a wedged loop must not keep the trainer from closing
                logger.warning("closing the interactions failed: %r", exc)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
        if not self._thread.is_alive():
            self._loop.close()
        if isinstance(self.requests, RequestBatcher):
            self.requests.close()


def environment_metrics(rollout) -> dict[str, float]:
    """Turns, stop reasons, env errors, exclusions and env latency, per environment (multi-turn only).

    ``reward_mean`` is over the samples that are not excluded, and absent when every one is.
    """
    by_env: dict[str, list[Trajectory]] = defaultdict(list)
    for trajectory, name in zip(rollout.trajectories, rollout.interaction_names):
        if name is not None:
            by_env[name].append(trajectory)
    metrics: dict[str, float] = {}
    for name, trajectories in by_env.items():
        count = len(trajectories)
        prefix = f"env/{name}"
        scored = [t.reward for t in trajectories if not t.excluded]
        metrics[f"{prefix}/samples"] = count
        if scored:
            metrics[f"{prefix}/reward_mean"] = sum(scored) / len(scored)
        metrics[f"{prefix}/excluded"] = count - len(scored)
        metrics[f"{prefix}/turns_mean"] = sum(t.num_turns for t in trajectories) / count
        metrics[f"{prefix}/env_errors"] = sum(t.stop_reason == "env_error" for t in trajectories)
        metrics[f"{prefix}/prompt_too_long"] = sum(t.stop_reason == "prompt_too_long" for t in trajectories)
        calls = sum(t.info.get("env_calls", 0) for t in trajectories)
        seconds = sum(t.info.get("env_seconds", 0.0) for t in trajectories)
        metrics[f"{prefix}/env_latency_s"] = seconds / calls if calls else 0.0
        reasons: dict[str, int] = defaultdict(int)
        for trajectory in trajectories:
            reasons[trajectory.stop_reason] += 1
        for reason, hits in reasons.items():
            metrics[f"{prefix}/stop/{reason}"] = hits / count
    return metrics


_PROTOCOL_PATHS = ("reset", "step", "finalize", "health", "ws", "schema")
_MAX_ENDPOINTS_NAMED = 5


def env_endpoint_of(url: str) -> str:
    """The env server's base URL of a request URL (``http://h:1/reset`` -> ``http://h:1``)."""
    base, _, last = url.rpartition("/")
    return base if last in _PROTOCOL_PATHS and "://" in base else url


def failure_summary(trajectories: Sequence[Trajectory], interaction_names: Sequence[str | None]) -> str:
    """Why none of ``trajectories`` could be trained on: their stop reasons, the env endpoints
    that failed (with the interaction using each) and the last error text."""
    reasons = Counter(t.stop_reason or "unknown" for t in trajectories)
    parts = [f"none of {len(trajectories)} samples had anything to train on "
             f"({', '.join(f'{reason} x{count}' for reason, count in reasons.most_common())})"]
    endpoints: dict[str, None] = {}  # ordered set of "url (interaction 'name')"
    last_error = None
    for trajectory, name in zip(trajectories, interaction_names):
        url = trajectory.info.get("error_url")
        if url:
            endpoints[f"{env_endpoint_of(url)}" + (f" (interaction {name!r})" if name else "")] = None
        last_error = trajectory.info.get("error") or last_error
    if endpoints:
        named = list(endpoints)
        more = f" and {len(named) - _MAX_ENDPOINTS_NAMED} more" if len(named) > _MAX_ENDPOINTS_NAMED else ""
        parts.append(f"env endpoint(s): {', '.join(named[:_MAX_ENDPOINTS_NAMED])}{more}")
    if last_error:
        parts.append(f"last error: {last_error}")
    return "; ".join(parts)
