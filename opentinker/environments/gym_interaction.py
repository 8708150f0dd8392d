"""``GymEnvironmentInteraction``: an interaction whose turns come from an environment server.

The server speaks a small gym-like HTTP protocol (field names are fixed; existing
servers speak them, and ignore the fields they do not know)::

    POST {url}/reset     {"instance_id", "job_id"?, "seed"?, **env_kwargs, **kwargs}
                         -> {"observation": str, "images"?: [str], "system_prompt"?: str, "info"?: dict}
    POST {url}/step      {"instance_id", "action": str, "step": int, "job_id"?}
                         -> {"observation": str, "images"?: [str], "reward": float, "done": bool, "info"?: dict}
    POST {url}/finalize  {"instance_id", "job_id"?}
    GET  {url}/health

``url`` is a base URL ``scheme://host[:port]`` (no path: the protocol's paths are fixed),
or one of several shards; an instance always goes to the same shard (a stable hash of its
id). ``step`` is the number of steps already applied to the instance (0 for the first).
Every failure surfaces as :class:`~opentinker.environments.interaction.EnvironmentServerError`.
``images`` (for a vision-language model) are pictures as ``data:image/...;base64,`` URLs: the
next user turn shows them, then the observation's text (the agent loop reads each under the
server's picture bounds).

The config comes from a job's client, so it is bounded and checked; what the operator
decides (the job id, which endpoints may be reached, how many shards) comes from the
:class:`~opentinker.environments.interaction.InteractionContext` given to :meth:`create`.

Retries: connection errors, timeouts and 5xx answers are retried ``retries`` times with
exponential backoff; 4xx answers, redirects (never followed) and malformed bodies are
not. A retried ``/step`` carries the same ``step`` index, so a server built with
:func:`~opentinker.environments.server.serve_environment` answers a retry whose first
answer was lost with that stored answer instead of stepping twice. A server that ignores
the index may still apply a retried step twice; keep ``retries`` at 0 for those where
that matters. When the retries are spent, ``EnvironmentServerError.unreachable`` says
whether the server could not be reached (connection error, timeout, 502/503/504) rather
than answered with an error of its own: a training step waits the former out.

Error messages quote an answer's text only when it has the protocol's error shape
``{"error": "<text>", ...}`` (truncated); otherwise they give its status, content type and
size, so an endpoint pointed at some other service cannot be read through job events.
"""

from __future__ import annotations

import asyncio
import logging
import math
from dataclasses import dataclass
from typing import Any

from tenacity import (
    AsyncRetrying,
    RetryCallState,
    RetryError,
    retry_if_exception_type,
    stop_after_attempt,
    wait_exponential,
)

from opentinker.images import turn_with_pictures
from opentinker.environments.env_replies import UNAVAILABLE_STATUSES, answer_json, bounded, join_url, reply_problem
from opentinker.environments.interaction import (
    MAX_STEPS_REACHED,
    TRUNCATED,
    EnvironmentServerError,
    InitialObservation,
    Interaction,
    InteractionContext,
    last_assistant_content,
)
from opentinker.environments.env_routing import RoutedEnvServers, env_route, probe_health
from opentinker.environments.templates import checked_template as _checked_template
from opentinker.environments.transport import BadAnswer, NoAnswer


__all__ = ["GymEnvironmentInteraction"]

logger = logging.getLogger(__name__)

MAX_LEFTOVERS = 100_000  # instances kept to be finalized again (an env expires the oldest itself)


@dataclass
class _Instance:
    url: str
    observation: InitialObservation
    job_id: str | None = None
    steps: int = 0
    done: bool = False


class _Retryable(Exception):
    """A failure worth retrying; ``unreachable`` as in EnvironmentServerError."""

    def __init__(self, message: str, unreachable: bool):
        super().__init__(message)
        self.unreachable = unreachable


class GymEnvironmentInteraction(RoutedEnvServers, Interaction):
    """HTTP client of an environment server (see the module docstring for the protocol).

    Config keys (sent by a job's client, so each is bounded):
        env_endpoint: base URL of the server, e.g. ``"http://127.0.0.1:8000"`` (no path).
        env_shards: optional list of base URLs, or an int N (N consecutive ports from
            env_endpoint's port); at most the context's ``max_env_shards``.
        max_steps: steps after which the episode ends (done=True, info["truncated"] and
            info["max_steps_reached"]); 20, in [1, 1000].
        observation_template: how an observation becomes the next user turn;
            ``"{observation}"``; may use only the plain fields ``{observation}``,
            ``{reward}``, ``{step}`` (format specs such as ``{reward:.2f}`` are fine).
        timeout_s: per-request timeout, 30, in (0, 300].
        retries: retries of connection errors / timeouts / 5xx, 2, in [0, 10].
        backoff_s: first retry delay (doubles each retry), 0.2, in [0, 30].
        env_kwargs: dict merged into every /reset body.
        job_id: sent to the server unless the row's interaction kwargs give one; the
            context's job id, when it has one, replaces both.
        max_connections: connection pool size, 256, in [1, 1024].
        relay: ``"client"``: the env servers are on the machine of the job's client, which
            carries the calls (no connection from the server; see ``environments/relay.py``).

    Requests never read proxy settings from the environment and never follow redirects.
    """

    config_keys = frozenset({"env_endpoint", "env_shards", "max_steps", "observation_template", "timeout_s",
                             "retries", "backoff_s", "max_connections", "env_kwargs", "trust_env", "job_id", "relay"})
    keeps_instances_at_env = True  # from /reset until /finalize

    def __init__(self, config: dict[str, Any], context: InteractionContext | None = None):
        super().__init__(config)
        context = context or InteractionContext()
        cfg = self.config
        self.max_steps: int = bounded(cfg, "max_steps", 20, 1, 1000, integer=True)
        self.observation_template = _checked_template(cfg.get("observation_template", "{observation}"))
        self.timeout_s: float = bounded(cfg, "timeout_s", 30.0, 0, 300, integer=False, above_low=True)
        self.retries: int = bounded(cfg, "retries", 2, 0, 10, integer=True)
        self.backoff_s: float = bounded(cfg, "backoff_s", 0.2, 0, 30, integer=False)
        self.max_connections: int = bounded(cfg, "max_connections", 256, 1, 1024, integer=True)
        env_kwargs = cfg.get("env_kwargs") or {}
        if not isinstance(env_kwargs, dict):
            raise ValueError(f"env_kwargs must be a dict, got {type(env_kwargs).__name__}")
        self.env_kwargs: dict[str, Any] = dict(env_kwargs)
        if cfg.get("trust_env"):
            raise ValueError("trust_env is not supported: env requests never use proxy settings from the environment")
        # The context's job id is the operator's word; a client-sent one is only a default.
        self._job_id_fixed = context.job_id is not None
        self.job_id: str | None = context.job_id if self._job_id_fixed else _job_id(cfg.get("job_id"), "job_id")
        self._instances: dict[str, _Instance] = {}
        # instance id -> (its server, its job id): those whose finalize did not reach the env
        self._leftovers: dict[str, tuple[str, str | None]] = {}
        self.shards, self._transport = env_route(cfg, context, timeout_s=self.timeout_s,
                                                 max_connections=self.max_connections)

    @classmethod
    def create(
        cls, config: dict[str, Any] | None, context: InteractionContext | None = None
    ) -> GymEnvironmentInteraction:
        """The interaction with ``context`` applied: endpoints checked against its policy,
        at most ``context.max_env_shards`` shards, and its job id on every request."""
        return cls(dict(config or {}), context)

    # HTTP plumbing ---------------------------------------------------------------------

    async def aclose(self) -> None:
        """Close the connections (the interaction can still be used; new ones are made)."""
        await self._transport.aclose()

    async def __aenter__(self) -> GymEnvironmentInteraction:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def call_deadline_s(self) -> float:
        """Every try's timeout plus every backoff sleep, and a second of slack: past it a call
        (a server trickling its answer defeats httpx's per-phase timeouts) is given up."""
        return self.timeout_s * (self.retries + 1) + self.backoff_s * (2 ** self.retries - 1) + 1.0

    async def _request_once(self, base: str, path: str, body: dict[str, Any]) -> Any:
        url = join_url(self._transport.describe(base), path)
        try:
            answer = await self._transport.request("POST", base, path, self.timeout_s, body)
        except NoAnswer as exc:
            raise _Retryable(str(exc), True) from exc
        except (BadAnswer, ValueError) as exc:
            raise EnvironmentServerError(url, str(exc)) from exc
        if answer.status >= 500:
            raise _Retryable(reply_problem(answer), answer.status in UNAVAILABLE_STATUSES)
        if 300 <= answer.status < 400:
            raise EnvironmentServerError(url, f"HTTP {answer.status}: redirects are not followed")
        if answer.status == 404 and path == "step":
            # The server no longer has the episode (it restarted, or expired it): not the env's
            # answer to this episode but a broken one, like a dropped session. The step is redone.
            raise EnvironmentServerError(url, f"{reply_problem(answer)}: the env server no longer has this episode "
                                              "(it restarted or expired it)", unreachable=True)
        if answer.status >= 400:
            raise EnvironmentServerError(url, reply_problem(answer))
        return answer_json(url, answer)

    async def _post(self, base: str, path: str, body: dict[str, Any], retries: int | None = None) -> Any:
        url = join_url(self._transport.describe(base), path)
        retries = self.retries if retries is None else retries

        def log_retry(state: RetryCallState) -> None:
            logger.warning("%s failed (%s); retry %d/%d in %.2fs", url, state.outcome.exception(),
                           state.attempt_number, retries, state.upcoming_sleep)

        retrying = AsyncRetrying(
            retry=retry_if_exception_type(_Retryable),
            stop=stop_after_attempt(retries + 1),
            wait=wait_exponential(multiplier=self.backoff_s),  # backoff_s * 2**k before retry k + 1
            before_sleep=log_retry,
        )
        try:
            return await retrying(self._request_once, base, path, body)
        except RetryError as spent:
            exc, attempts = spent.last_attempt.exception(), spent.last_attempt.attempt_number
            tries = f" (after {attempts} attempts)" if attempts > 1 else ""
            raise EnvironmentServerError(url, f"{exc}{tries}", unreachable=exc.unreachable) from exc.__cause__

    # Interaction API ---------------------------------------------------------------

    async def start_interaction(self, instance_id: str | None = None, **kwargs: Any) -> str:
        """POST /reset on the instance's shard and keep its first observation."""
        instance_id = await super().start_interaction(instance_id)
        base = self.shard_for(instance_id)
        body: dict[str, Any] = {**self.env_kwargs, **kwargs}
        row_job_id = body.pop("job_id", None)
        job_id = self.job_id if self._job_id_fixed or row_job_id is None else _job_id(row_job_id, "job_id")
        if body.get("seed") is None:  # left out rather than sent as null
            body.pop("seed", None)
        if job_id is not None:
            body["job_id"] = job_id
        body["instance_id"] = instance_id
        try:
            data = await self._post(base, "reset", body)
            observation = self._parse_reset(join_url(self._transport.describe(base), "reset"), data)
        except BaseException:
            self._rewards.pop(instance_id, None)
            raise
        self._instances[instance_id] = _Instance(url=base, observation=observation, job_id=job_id)
        return instance_id

    @staticmethod
    def _parse_reset(url: str, data: Any) -> InitialObservation:
        observation = _observation_of(url, data)
        system_prompt = data.get("system_prompt")
        if system_prompt is not None and not isinstance(system_prompt, str):
            raise EnvironmentServerError(url, f"'system_prompt' must be a string, got {type(system_prompt).__name__}")
        info = data.get("info") or {}
        if not isinstance(info, dict):
            raise EnvironmentServerError(url, f"'info' must be an object, got {type(info).__name__}")
        return InitialObservation(observation=with_pictures(url, data, observation), system_prompt=system_prompt,
                                  info=info)

    async def initial_observation(self, instance_id: str) -> InitialObservation | None:
        """The observation (and system prompt) the server gave at /reset."""
        return self._instance(instance_id).observation

    def _instance(self, instance_id: str) -> _Instance:
        try:
            return self._instances[instance_id]
        except KeyError:
            raise KeyError(
                f"unknown instance {instance_id!r} of interaction {self.name!r}: "
                "start_interaction was not called or the instance was finalized"
            ) from None

    async def generate_response(
        self, instance_id: str, messages: list[dict[str, str]], **kwargs: Any
    ) -> tuple[bool, str, float, dict[str, Any]]:
        """POST /step with the last assistant message; return the formatted observation."""
        state = self._instance(instance_id)
        if state.done:
            return True, "", 0.0, {"step": state.steps, "already_done": True}
        action = last_assistant_content(messages)
        # The step index lets the server answer a retry of an applied step without stepping again.
        body: dict[str, Any] = {"instance_id": instance_id, "action": action, "step": state.steps}
        if state.job_id is not None:
            body["job_id"] = state.job_id
        data = await self._post(state.url, "step", body)
        url = join_url(self._transport.describe(state.url), "step")
        observation, reward, done, info = self._parse_step(url, data)
        state.steps += 1
        self._record_reward(instance_id, reward)  # calculate_score: the sum of the step rewards
        info = dict(info)
        info.pop(MAX_STEPS_REACHED, None)  # only this interaction's own budget may say so
        info.setdefault("step", state.steps)
        if not done and state.steps >= self.max_steps:
            done = True
            info[TRUNCATED] = True
            info[MAX_STEPS_REACHED] = True
        state.done = done
        text = self.observation_template.format(observation=observation, reward=reward, step=state.steps)
        return done, with_pictures(url, data, text), reward, info

    @staticmethod
    def _parse_step(url: str, data: Any) -> tuple[str, float, bool, dict[str, Any]]:
        observation = _observation_of(url, data)
        reward = data.get("reward")
        if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
            raise EnvironmentServerError(
                url, f"'reward' must be a finite number, got {_describe(reward, 'reward' in data)}"
            )
        done = data.get("done")
        if not isinstance(done, bool):
            raise EnvironmentServerError(url, f"'done' must be a boolean, got {_describe(done, 'done' in data)}")
        info = data.get("info") or {}
        if not isinstance(info, dict):
            raise EnvironmentServerError(url, f"'info' must be an object, got {type(info).__name__}")
        return observation, float(reward), done, info

    async def finalize_interaction(self, instance_id: str, **kwargs: Any) -> None:
        """Forget the instance and POST /finalize (one attempt; errors are logged, never raised).

        The request is sent even for an instance unknown here (e.g. a /reset whose answer
        was lost), since the shard follows from the id; calling it twice is harmless. One that
        cannot reach the server is kept and sent again before the next step
        (:meth:`finalize_leftovers`), so an outage leaves no instance open at the env.
        """
        state = self._instances.pop(instance_id, None)
        await super().finalize_interaction(instance_id)
        base, job_id = ((state.url, state.job_id) if state is not None else
                        self._leftovers.get(instance_id, (self.shard_for(instance_id), self.job_id)))
        await self._send_finalize(instance_id, base, job_id, quiet=state is None)

    async def _send_finalize(self, instance_id: str, base: str, job_id: str | None, quiet: bool = False) -> bool:
        """POST /finalize once; False (and the instance kept as a leftover) when the server could not be reached."""
        body: dict[str, Any] = {"instance_id": instance_id}
        if job_id is not None:
            body["job_id"] = job_id
        try:
            await self._post(base, "finalize", body, retries=0)
        except EnvironmentServerError as exc:
            if exc.unreachable:
                self._keep_leftover(instance_id, base, job_id)
                logger.log(logging.DEBUG if quiet else logging.WARNING,
                           "finalize of instance %s did not reach the env; sent again before the next step: %s",
                           instance_id, exc)
                return False
            logger.log(logging.DEBUG if quiet else logging.WARNING, "finalize of instance %s failed: %s",
                       instance_id, exc)
        except Exception as exc:  # never raise from cleanup
            logger.warning("finalize of instance %s failed: %r", instance_id, exc)
        self._leftovers.pop(instance_id, None)
        return True

    def _keep_leftover(self, instance_id: str, base: str, job_id: str | None) -> None:
        if instance_id not in self._leftovers and len(self._leftovers) >= MAX_LEFTOVERS:
            dropped = next(iter(self._leftovers))  # the oldest: its env has most likely expired it by now
            del self._leftovers[dropped]
            logger.warning("more than %d instances wait to be finalized at %s; instance %s is forgotten",
                           MAX_LEFTOVERS, self.name, dropped)
        self._leftovers[instance_id] = (base, job_id)

    def unfinalized_instances(self) -> list[str]:
        return list(self._leftovers)

    def adopt_unfinalized(self, instance_ids: list[str]) -> None:
        for instance_id in instance_ids:
            if instance_id not in self._instances and instance_id not in self._leftovers:
                self._keep_leftover(instance_id, self.shard_for(instance_id), self.job_id)

    async def finalize_leftovers(self) -> int:
        """POST /finalize for every instance whose finalize did not reach its server (concurrently,
        within the connection pool); how many still could not be finalized."""
        leftovers = list(self._leftovers.items())
        await asyncio.gather(*(self._send_finalize(iid, base, job_id, quiet=True)
                               for iid, (base, job_id) in leftovers))
        return len(self._leftovers)

    async def check_endpoints(self, timeout_s: float = 5.0) -> None:
        """``GET /health`` of every shard by this interaction's route, concurrently."""
        await asyncio.gather(*(probe_health(self._transport, url, timeout_s) for url in self.shards))

    @property
    def active_instances(self) -> int:
        return len(self._instances)


def _job_id(value: Any, key: str) -> str | None:
    if value is None or isinstance(value, str):
        return value
    raise ValueError(f"{key} must be a string, got {type(value).__name__}")


def _observation_of(url: str, data: Any) -> str:
    """The ``observation`` string of a /reset or /step answer, or EnvironmentServerError."""
    if not isinstance(data, dict):
        raise EnvironmentServerError(url, f"expected a JSON object, got {type(data).__name__}")
    observation = data.get("observation")
    if not isinstance(observation, str):
        raise EnvironmentServerError(
            url, f"'observation' must be a string, got {_describe(observation, 'observation' in data)}"
        )
    return observation


def with_pictures(url: str, data: dict, text: str) -> str | list[dict]:
    """The turn ``text`` with the answer's ``images`` before it (a content list of parts), or
    ``text`` as it is when the answer has none."""
    pictures = data.get("images")
    if pictures is None:
        return text
    if not isinstance(pictures, list) or not all(isinstance(p, str) and p.startswith("data:image/") for p in pictures):
        raise EnvironmentServerError(url, "'images' must be a list of data:image/...;base64, URLs")
    return turn_with_pictures(text, pictures)


def _describe(value: Any, present: bool) -> str:
    return type(value).__name__ if present else "nothing (field missing)"
