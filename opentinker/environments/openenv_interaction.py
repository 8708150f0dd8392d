"""``OpenEnvInteraction``: train on any OpenEnv environment server, unchanged.

`OpenEnv <https://github.com/meta-pytorch/OpenEnv>`_ servers (``create_fastapi_app(env_factory,
Action, Observation, max_concurrent_envs=N)``) keep one environment instance per WebSocket
connection on ``/ws``, so an episode is one session::

    -> {"type": "reset", "data": {"seed"?, "episode_id", **reset_kwargs, **row kwargs}}
    <- {"type": "observation", "data": {"observation": {<fields>}, "reward": null, "done": false}}
    -> {"type": "step", "data": {<action_field>: <the model's turn>, **action_extra}}
    <- {"type": "observation", "data": {"observation": {...}, "reward": 1.0, "done": true}}
    -> {"type": "close"}                    (the server closes the connection)

and a failure is ``{"type": "error", "data": {"message", "code"}}``. Its HTTP ``/reset`` and
``/step`` do not share an episode, which is why the WebSocket is used. ``GET /schema`` gives
the action's and observation's JSON Schemas: before the first session with a server, it is
read once to pick (or check) the action field that takes the model's text and the observation
field that becomes the next user turn (:mod:`opentinker.environments.openenv_schema`).

Failures, as the trainer's outage rule needs them (:class:`EnvironmentServerError`):

- ``unreachable=True`` (the trainer waits for ``/health`` and redoes the step): no connection,
  a timeout, a session that broke (mid-episode too: the env's state is gone with it, and the
  redone step starts the episode again), and an env that stayed at capacity for ``capacity_wait_s``;
- ``unreachable=False`` (the env's own error: the sample is left out or gets
  ``env_error_reward``): ``VALIDATION_ERROR`` (the action does not fit the env's schema),
  ``EXECUTION_ERROR`` (the env raised), ``FACTORY_ERROR``, the other error codes, a reply
  of the wrong shape, a schema that does not fit the config.

``CAPACITY_REACHED`` (more sessions than the server's ``max_concurrent_envs``) is neither: the
episode backs off (exponentially, with jitter, capped) and connects again. Its ``max_sessions``
is learned per endpoint, and from then on this interaction opens no more sessions there at
once (the rest queue here, first come first served), so a step's 128 episodes on an env that
serves 8 run 8 at a time instead of hammering it. Retries of ``NoAnswer`` (``retries``,
``backoff_s``) apply to the schema and to opening a session and resetting it, never to a step
(a step cannot be repeated on a new session).

Error messages name the URL (the server's base URL plus ``/ws`` or ``/schema``) and the
error code, and quote at most 300 characters of the env's message (never a validation
error's input, which is the model's text).
"""

from __future__ import annotations

import asyncio
import logging
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from opentinker.images import turn_with_pictures
from opentinker.environments.env_replies import (
    MAX_ERROR_CHARS, UNAVAILABLE_STATUSES, answer_json, bounded, join_url, reply_problem,
)
from opentinker.environments.env_routing import RoutedEnvServers, env_route
from opentinker.environments.interaction import (
    MAX_STEPS_REACHED,
    TRUNCATED,
    EnvironmentServerError,
    InitialObservation,
    Interaction,
    InteractionContext,
    last_assistant_content,
)
from opentinker.environments.openenv_schema import (
    action_field_for,
    field_text,
    image_field_for,
    observation_field_for,
    observation_pictures,
    observation_text,
)
from opentinker.environments.openenv_sessions import (
    CAPACITY_MAX_DELAY_S,
    CLOSE_TIMEOUT_S,
    EXCHANGE_SLACK_S,
    SessionGate,
    SessionOpener,
    error_of,
)
from opentinker.environments.templates import checked_template, template_names
from opentinker.environments.transport import BadAnswer, NoAnswer

if TYPE_CHECKING:
    from opentinker.environments.transport import EnvSession

__all__ = ["OpenEnvInteraction"]

logger = logging.getLogger(__name__)

_MAX_NAME_CHARS = 128


@dataclass
class _Plan:
    """How to talk to one env server, from its /schema."""

    action_field: str
    observation_field: str | None
    image_field: str | None = None  # pictures for a vision-language model


@dataclass
class _Episode:
    base: str
    session: EnvSession | None = None
    gates: tuple[SessionGate, ...] = ()  # the slots it holds (its server's, the connection pool's)
    plan: _Plan | None = None
    observation: InitialObservation | None = None
    steps: int = 0
    done: bool = False


def _field_name(value: Any, key: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not 0 < len(value) <= _MAX_NAME_CHARS:
        raise ValueError(f"{key} must be a field name (a string of 1 to {_MAX_NAME_CHARS} characters)")
    return value


def _fields(value: Any, key: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ValueError(f"{key} must be a dict, got {type(value).__name__}")
    return dict(value)


def _clip(text: str) -> str:
    return text if len(text) <= MAX_ERROR_CHARS else text[:MAX_ERROR_CHARS] + "..."


def _error_text(data: Any) -> str:
    """``CODE: message`` of an OpenEnv error message's data (a validation error's field problems,
    never its input), at most ~300 characters of the env's text."""
    if not isinstance(data, dict):
        return "an error message without data"
    code = data.get("code")
    code = code[:40] if isinstance(code, str) and code else "no code"
    message = data.get("message")
    text = message if isinstance(message, str) else ""
    errors = data.get("errors")
    if isinstance(errors, list):
        problems = []
        for error in errors[:5]:
            if isinstance(error, dict):
                loc = error.get("loc")
                where = ".".join(str(part) for part in loc) if isinstance(loc, list) else ""
                what = error.get("msg") if isinstance(error.get("msg"), str) else ""
                problems.append(f"{where}: {what}" if where else what)
        if problems:
            text = f"{text} ({'; '.join(problems)})" if text else "; ".join(problems)
    return f"{code}: {_clip(text)}" if text else code


class OpenEnvInteraction(RoutedEnvServers, Interaction):
    """Client of an OpenEnv server (see the module docstring for the protocol and its failures).

    Config keys (sent by a job's client, so each is bounded):
        env_endpoint, env_shards, relay: the servers and the route, as for the gym interaction
            (an episode goes to the shard of its instance id's stable hash).
        max_steps: steps after which the episode ends (truncated); 20, in [1, 1000].
        action_field: the action field that takes the model's turn text (a string field of the
            env's action); left out, picked from /schema: the only string field, else a usual
            name ("text", "message", "content", "response", "answer", "action", ...).
        action_extra: other action fields, sent with every step (e.g. ``{"mode": "play"}``).
        observation_field: the observation field whose text is the next user turn; left out, the
            only string field, else a usual name ("text", "message", "prompt", "observation",
            "content", "feedback", ...), else the observation as JSON.
        image_field: the observation field whose pictures (data URLs or base64 PNG/JPEG, one or
            a list) open each next user turn, before its text (a vision-language model's); left
            out, the first of "image", "images", "screenshot", "screenshots", "frame", "pixels",
            "picture" the observation has as a string or a list.
        observation_template: how a step's observation becomes the next user turn; may use
            ``{observation}`` (the chosen field's text), ``{reward}``, ``{step}`` and the
            observation's own fields by name (``{board}``, as text). The reset's observation
            opens the chat as it is.
        reset_kwargs: dict merged into every reset (before the row's interaction kwargs; the
            trainer's ``seed`` and the instance id as ``episode_id`` go last).
        timeout_s: each message's timeout, 30, in (0, 300]. retries: retries of an unreachable
            server when opening a session or reading /schema, 2, in [0, 10]. backoff_s: the
            first retry's delay (doubling), 0.2, in [0, 30]. max_connections: the connection pool,
            256, in [1, 1024]; a session holds one for its whole episode, so at most
            ``max_connections - 2`` sessions are open at once (more episodes wait for one).
        capacity_wait_s: how long an episode may wait for a session of a server at capacity
            before it fails as unreachable; 300, in [0, 3600].
    """

    config_keys = frozenset({"env_endpoint", "env_shards", "relay", "max_steps", "action_field", "action_extra",
                             "observation_field", "image_field", "observation_template", "reset_kwargs", "timeout_s", "retries",
                             "backoff_s", "max_connections", "capacity_wait_s"})

    def __init__(self, config: dict[str, Any], context: InteractionContext | None = None):
        super().__init__(config)
        context = context or InteractionContext()
        cfg = self.config
        self.max_steps: int = bounded(cfg, "max_steps", 20, 1, 1000, integer=True)
        self.timeout_s: float = bounded(cfg, "timeout_s", 30.0, 0, 300, integer=False, above_low=True)
        self.retries: int = bounded(cfg, "retries", 2, 0, 10, integer=True)
        self.backoff_s: float = bounded(cfg, "backoff_s", 0.2, 0, 30, integer=False)
        self.max_connections: int = bounded(cfg, "max_connections", 256, 1, 1024, integer=True)
        self.capacity_wait_s: float = bounded(cfg, "capacity_wait_s", 300.0, 0, 3600, integer=False)
        self.action_field = _field_name(cfg.get("action_field"), "action_field")
        self.observation_field = _field_name(cfg.get("observation_field"), "observation_field")
        self.image_field = _field_name(cfg.get("image_field"), "image_field")
        self.action_extra = _fields(cfg.get("action_extra"), "action_extra")
        self.reset_kwargs = _fields(cfg.get("reset_kwargs"), "reset_kwargs")
        template = cfg.get("observation_template")
        self.observation_template = None if template is None else checked_template(template, named_fields=True)
        self._template_names = template_names(self.observation_template) if self.observation_template else []
        self.shards, self._transport = env_route(cfg, context, timeout_s=self.timeout_s,
                                                 max_connections=self.max_connections)
        self._episodes: dict[str, _Episode] = {}
        self._plans: dict[str, _Plan] = {}
        self.sessions = SessionOpener(self._transport, timeout_s=self.timeout_s, retries=self.retries,
                                      backoff_s=self.backoff_s, max_connections=self.max_connections,
                                      capacity_wait_s=self.capacity_wait_s)
        self._plan_reads: dict[str, asyncio.Task] = {}  # /schema reads under way, per server
        self._plan_loop: asyncio.AbstractEventLoop | None = None

    @property
    def capacity_refusals(self) -> int:
        """CAPACITY_REACHED answers seen (each one a session refused and tried again later)."""
        return self.sessions.capacity_refusals

    @property
    def session_limit(self) -> int:
        return self.sessions.session_limit

    @classmethod
    def create(cls, config: dict[str, Any] | None, context: InteractionContext | None = None) -> OpenEnvInteraction:
        return cls(dict(config or {}), context)

    # -- deadlines --------------------------------------------------------------------

    def start_deadline_s(self) -> None:
        """No deadline over a start as a whole: it may queue behind this interaction's own episodes
        for a session (a server that serves one at a time serves a step's episodes in turn), and
        each of its parts is bounded here: the /schema read and the opening by ``timeout_s`` and
        ``retries``, waiting for a session by ``capacity_wait_s`` without one being freed."""
        return None

    def call_deadline_s(self) -> float:
        """The longest a call may take: a start that reads /schema, waits ``capacity_wait_s`` for
        a session and opens one with every retry, plus a second. Steps are far shorter: each is
        one message, bounded here by ``timeout_s`` (plus a relay's slack)."""
        backoffs = self.backoff_s * (2 ** self.retries - 1)
        schema = (self.retries + 1) * (self.timeout_s + EXCHANGE_SLACK_S) + backoffs
        attempt = self.timeout_s + 2 * (self.timeout_s + EXCHANGE_SLACK_S) + 2 * CLOSE_TIMEOUT_S
        opening = (self.retries + 1) * attempt + backoffs
        return schema + self.capacity_wait_s + CAPACITY_MAX_DELAY_S + opening + 1.0

    # -- /schema -----------------------------------------------------------------------

    async def _fetch_schema(self, base: str, timeout_s: float, retries: int) -> Any:
        url = join_url(self._transport.describe(base), "schema")
        for attempt in range(retries + 1):
            tries = f" (after {attempt + 1} attempts)" if attempt else ""
            try:
                answer = await self._transport.request("GET", base, "schema", timeout_s)
            except NoAnswer as exc:
                if attempt < retries:
                    await asyncio.sleep(self.backoff_s * 2 ** attempt)
                    continue
                raise EnvironmentServerError(url, f"unreachable ({exc}){tries}; is the environment server running?",
                                             unreachable=True) from exc
            except (BadAnswer, ValueError) as exc:
                raise EnvironmentServerError(url, str(exc)) from exc
            if answer.status in UNAVAILABLE_STATUSES and attempt < retries:
                await asyncio.sleep(self.backoff_s * 2 ** attempt)
                continue
            if not 200 <= answer.status < 300:
                raise EnvironmentServerError(url, f"{reply_problem(answer)}{tries}; is it an OpenEnv server?",
                                             unreachable=answer.status in UNAVAILABLE_STATUSES)
            return answer_json(url, answer)
        raise AssertionError("unreachable")  # the loop returns or raises

    def _plan_from(self, schema: Any) -> _Plan:
        """ValueError when the config does not fit the schema."""
        action_field = action_field_for(schema, self.action_field, self.action_extra)
        observation_field = observation_field_for(schema, self.observation_field, self._template_names)
        return _Plan(action_field, observation_field, image_field_for(schema, self.image_field))

    async def _plan(self, base: str) -> _Plan:
        """The server's plan, from one /schema read however many episodes start at once: they
        all wait on that read, and all fail together when it fails (a later start reads again)."""
        plan = self._plans.get(base)
        if plan is not None:
            return plan
        loop = asyncio.get_running_loop()
        if self._plan_loop is not loop:  # futures belong to one loop (the agent runner's)
            self._plan_loop, self._plan_reads = loop, {}
        read = self._plan_reads.get(base)
        if read is None:
            read = self._plan_reads[base] = loop.create_task(self._read_plan(base))
            read.add_done_callback(lambda done: self._plan_read_done(base, done))
        return await asyncio.shield(read)  # an episode cancelled while waiting leaves the read to the others

    async def _read_plan(self, base: str) -> _Plan:
        schema = await self._fetch_schema(base, self.timeout_s, self.retries)
        try:
            plan = self._plan_from(schema)
        except ValueError as exc:
            raise EnvironmentServerError(join_url(self._transport.describe(base), "schema"), str(exc)) from exc
        self._plans[base] = plan
        return plan

    def _plan_read_done(self, base: str, read: asyncio.Task) -> None:
        if self._plan_reads.get(base) is read:
            del self._plan_reads[base]
        if not read.cancelled():
            read.exception()  # retrieved here too: every waiter may have been cancelled

    async def check_schema(self, timeout_s: float = 5.0, include_unreachable: bool = True) -> list[str]:
        """What keeps this config from working with its servers' ``/schema`` (an action_field the
        env's action does not have, ...), one problem per server; empty when it fits. One try per
        server, each within ``timeout_s``. ``include_unreachable=False`` leaves out servers that
        did not answer (for a check that reports those from ``/health`` already)."""

        async def one(base: str) -> str | None:
            try:
                schema = await self._fetch_schema(base, timeout_s, retries=0)
                self._plan_from(schema)
            except EnvironmentServerError as exc:
                return str(exc) if include_unreachable or not exc.unreachable else None
            except ValueError as exc:
                return f"{join_url(self._transport.describe(base), 'schema')}: {exc}"
            return None

        problems = await asyncio.gather(*(one(base) for base in self.shards))
        return [problem for problem in problems if problem]

    # -- replies -----------------------------------------------------------------------

    # -- the interaction API -------------------------------------------------------------

    async def start_interaction(self, instance_id: str | None = None, **kwargs: Any) -> str:
        """Open a session on the instance's shard and reset it (``seed`` from the kwargs when
        given, ``episode_id`` the instance id); keep its observation."""
        instance_id = await super().start_interaction(instance_id)
        episode = _Episode(self.shard_for(instance_id))
        self._episodes[instance_id] = episode  # so that finalize frees what a start cut short holds
        url = self.sessions.ws_url(episode.base)
        try:
            episode.plan = await self._plan(episode.base)
            data: dict[str, Any] = {**self.reset_kwargs, **kwargs}
            if data.get("seed") is None:  # left out rather than sent as null
                data.pop("seed", None)
            data["episode_id"] = instance_id
            reply = await self.sessions.open(episode, {"type": "reset", "data": data})
            observation = observation_data(url, reply, "reset")["observation"]
            episode.observation = InitialObservation(self._turn(url, observation, episode.plan, observation_text(
                observation, episode.plan.observation_field, episode.plan.image_field)))
        except BaseException:
            if self._episodes.get(instance_id) is episode:
                del self._episodes[instance_id]
            self._rewards.pop(instance_id, None)
            await self.sessions.release(episode)
            raise
        return instance_id

    def _episode(self, instance_id: str) -> _Episode:
        episode = self._episodes.get(instance_id)
        if episode is None or episode.observation is None:
            raise KeyError(f"unknown instance {instance_id!r} of interaction {self.name!r}: "
                           "start_interaction was not called or the instance was finalized")
        return episode

    async def initial_observation(self, instance_id: str) -> InitialObservation | None:
        """The reset's observation (its chosen field's text)."""
        return self._episode(instance_id).observation

    async def generate_response(
        self, instance_id: str, messages: list[dict[str, str]], **kwargs: Any
    ) -> tuple[bool, str, float, dict[str, Any]]:
        """Step the session with the last assistant message in the action field."""
        episode = self._episode(instance_id)
        if episode.done:
            return True, "", 0.0, {"step": episode.steps, "already_done": True}
        url = self.sessions.ws_url(episode.base)
        step = episode.steps + 1
        if episode.session is None:
            raise EnvironmentServerError(url, f"step {step}: the episode's session is gone (it broke earlier)",
                                         unreachable=True)
        assert episode.plan is not None
        action = {**self.action_extra, episode.plan.action_field: last_assistant_content(messages)}
        try:
            reply = await self.sessions.exchange(episode.session, {"type": "step", "data": action})
        except NoAnswer as exc:
            await self.sessions.release(episode)
            raise EnvironmentServerError(
                url, f"step {step}: no answer ({exc}); the episode cannot go on in a new session (its env "
                     "state was in this one)", unreachable=True) from exc
        except BadAnswer as exc:
            await self.sessions.release(episode)
            raise EnvironmentServerError(url, f"step {step}: {exc}") from exc
        data = observation_data(url, reply, f"step {step}")
        reward, done = reward_and_done(url, data)
        episode.steps = step
        self._record_reward(instance_id, reward)  # calculate_score: the sum of the step rewards
        info: dict[str, Any] = {"step": step}
        if not done and step >= self.max_steps:
            done = True
            info[TRUNCATED] = True
            info[MAX_STEPS_REACHED] = True
        episode.done = done
        observation = data["observation"]
        text = observation_text(observation, episode.plan.observation_field, episode.plan.image_field)
        if self.observation_template is not None:
            named = {name: field_text(observation.get(name)) for name in self._template_names}
            text = self.observation_template.format(**named, observation=text, reward=reward, step=step)
        return done, self._turn(url, observation, episode.plan, text), reward, info

    @staticmethod
    def _turn(url: str, observation: Any, plan: _Plan, text: str) -> str | list[dict[str, Any]]:
        """The user turn: ``text``, after the observation's pictures when it has some."""
        try:
            return turn_with_pictures(text, observation_pictures(observation, plan.image_field))
        except ValueError as error:
            raise EnvironmentServerError(url, str(error)) from None

    async def finalize_interaction(self, instance_id: str, **kwargs: Any) -> None:
        """Forget the instance; send ``close`` and close its session (never raises)."""
        episode = self._episodes.pop(instance_id, None)
        await super().finalize_interaction(instance_id)
        if episode is None:
            return
        try:
            await self.sessions.release(episode)
        except Exception as exc:  # never raise from cleanup
            logger.warning("closing the session of instance %s failed: %r", instance_id, exc)

    async def aclose(self) -> None:
        """Close every session still open and the transport's connections (the interaction can
        be used again: new ones are made)."""
        episodes, self._episodes = list(self._episodes.values()), {}
        await asyncio.gather(*(self.sessions.release(episode) for episode in episodes), return_exceptions=True)
        await self._transport.aclose()

    async def __aenter__(self) -> OpenEnvInteraction:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    @property
    def active_instances(self) -> int:
        return len(self._episodes)

    @property
    def open_sessions(self) -> int:
        """Sessions this interaction holds open now (for tests and stats)."""
        return sum(1 for episode in self._episodes.values() if episode.session is not None)


def observation_data(url: str, reply: Any, what: str) -> dict[str, Any]:
    """The data of an observation message, or EnvironmentServerError (the env's own error)."""
    error = error_of(reply)
    if error is not None:
        raise EnvironmentServerError(url, f"{what} answered {_error_text(error)}")
    if not isinstance(reply, dict):
        raise EnvironmentServerError(url, f"{what}: expected a JSON object, got {type(reply).__name__}")
    kind = reply.get("type")
    data = reply.get("data")
    if kind != "observation" or not isinstance(data, dict):
        shown = repr(kind[:40]) if isinstance(kind, str) else type(kind).__name__
        raise EnvironmentServerError(url, f"{what}: expected an observation message, got type {shown}")
    if not isinstance(data.get("observation"), dict):
        raise EnvironmentServerError(url, f"{what}: the observation message has no 'observation' object")
    return data

def reward_and_done(url: str, data: dict[str, Any]) -> tuple[float, bool]:
    """A step's ``reward`` (a finite number; null: 0) and ``done`` (a boolean; null: false)."""
    reward = data.get("reward")
    if reward is None:
        reward = 0.0
    if isinstance(reward, bool):
        reward = float(reward)
    if not isinstance(reward, (int, float)) or not math.isfinite(reward):
        raise EnvironmentServerError(url, f"step: 'reward' must be a finite number or null, got "
                                          f"{type(reward).__name__ if not isinstance(reward, float) else reward}")
    done = data.get("done")
    if done is None:
        done = False
    if not isinstance(done, bool):
        raise EnvironmentServerError(url, f"step: 'done' must be a boolean, got {type(done).__name__}")
    return float(reward), done
