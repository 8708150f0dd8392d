"""The interaction interface: where the environment turns of a multi-turn rollout come from.

The method names and the ``(done, response, reward, info)`` tuple follow verl's
interaction API, so an interaction written for verl's multi-turn rollout maps onto this
one with little change. One method is added: :meth:`Interaction.initial_observation`,
for environments that need no dataset (a game, a simulator) and produce the first user
message themselves when an instance is reset.

Interactions are built with :meth:`Interaction.create`, which also receives an
:class:`InteractionContext`: the operator-side settings (the job id, which env endpoints
may be reached) that a job's client-sent config must never choose.

Pure Python: nothing here imports torch, transformers or ray.
"""

from __future__ import annotations

import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

from opentinker.environments.endpoints import EndpointPolicy

__all__ = [
    "MAX_STEPS_REACHED",
    "TRUNCATED",
    "EnvironmentServerError",
    "InitialObservation",
    "Interaction",
    "InteractionContext",
    "last_assistant_content",
]

#: ``info`` key of a ``generate_response`` answer with ``done``: the episode was cut short
#: (by the environment itself, or by the interaction's own step budget) rather than finished.
TRUNCATED = "truncated"
#: ``info`` key set (True) only by the interaction when its own step budget (``max_steps``)
#: ended the episode; the agent loop reports that as stop reason ``max_env_steps``.
MAX_STEPS_REACHED = "max_steps_reached"


class EnvironmentServerError(RuntimeError):
    """An environment server failed: HTTP 5xx, a timeout, a connection error, or a body
    that is not JSON or not of the protocol's shape.

    The agent loop catches it and ends the trajectory with stop reason ``"env_error"``
    instead of failing the whole training step.

    ``unreachable``: the server could not be reached or said it is unavailable (connection
    error, timeout, HTTP 502/503/504), as opposed to one that answered with an error of its
    own (e.g. a 500 from the env's code). A training step left with nothing to train on by
    such errors is waited out and redone rather than skipped (``trainer.env_outage_timeout_s``).
    """

    def __init__(self, url: str, cause: object = "unknown error", unreachable: bool = False):
        self.url = str(url)
        self.cause = str(cause)
        self.unreachable = bool(unreachable)
        super().__init__(f"environment server {self.url} failed: {self.cause}")

    def __reduce__(self):  # keep (url, cause, unreachable) across pickling (e.g. to another process)
        return (type(self), (self.url, self.cause, self.unreachable))


@dataclass(frozen=True)
class InteractionContext:
    """Operator-side settings of the interactions of one job; never taken from a job's config.

    ``job_id``: sent to env servers with every request; wins over any ``job_id`` in the
    interaction config or a row's interaction kwargs. ``endpoint_policy``: None means no
    policy (trusted in-process use: ``opentinker-train``, tests); a policy means every env
    endpoint must pass ``policy.check(url, field)``. ``max_env_shards``: the most env
    servers (``env_shards``) one interaction may name. ``relay`` and ``relay_refusal``: see below.
    """

    job_id: str | None = None
    endpoint_policy: EndpointPolicy | None = None
    max_env_shards: int = 64
    #: The job's client relay (a :class:`~opentinker.environments.relay.RelayHub`), which carries
    #: the calls of interactions configured with ``"relay": "client"``; None where there is none.
    relay: Any = None
    #: Why ``"relay": "client"`` is refused here (None: it is allowed).
    relay_refusal: str | None = "a client relay needs a job on an opentinker-server (its client carries the calls)"


@dataclass(frozen=True)
class InitialObservation:
    """What an environment shows at reset: the first user message and, optionally, a system prompt.
    A turn is text, or (for a vision-language model) a content list of text and picture parts
    (``opentinker/images.py``)."""

    observation: str | list[dict[str, Any]]
    system_prompt: str | None = None
    info: dict[str, Any] = field(default_factory=dict)


def last_assistant_content(messages: list[dict[str, Any]]) -> str:
    """The content of the last assistant message in ``messages``, or "" when there is none."""
    for message in reversed(messages):
        if message.get("role") == "assistant":
            content = message.get("content")
            return content if isinstance(content, str) else ""
    return ""


class Interaction(ABC):
    """Base class of all interactions (environments).

    One interaction object serves many concurrent rollout instances, each named by an
    instance id; subclasses keep per-instance state in a dict keyed by that id.

    Life cycle of one trajectory::

        iid = await env.start_interaction(str(uuid.uuid4()), **interaction_kwargs)
        first = await env.initial_observation(iid)       # data-free envs only
        while not done:
            ... model writes an assistant turn ...
            done, text, reward, info = await env.generate_response(iid, messages)
        score = await env.calculate_score(iid)
        await env.finalize_interaction(iid)   # always, also when start_interaction failed

    The caller picks the instance id, so an instance whose start failed half-way (a /reset
    whose answer was lost) can still be finalized.
    """

    #: The config keys the class reads (``name`` is always allowed): the registry refuses a
    #: spec with any other key, so a misspelt option is an error, not silently a default.
    #: None: any keys (a class that passes its config on).
    config_keys: frozenset[str] | None = None

    #: Whether an instance lives on an env server until finalized (not with a connection): a
    #: job's runner then keeps the ids of its open instances on disk, for a restart to finalize.
    keeps_instances_at_env: bool = False

    def __init__(self, config: dict[str, Any] | None = None):
        self.config: dict[str, Any] = dict(config or {})
        self.name: str = str(self.config.get("name", type(self).__name__))
        # Rewards returned by generate_response, per instance (for the default calculate_score).
        self._rewards: dict[str, list[float]] = {}

    def call_deadline_s(self) -> float | None:
        """How long one call (start, step, score, ...) may take in all, retries included,
        before the agent loop gives it up as an env error (None: no deadline). The config's
        ``timeout_s`` when given (``name`` and ``timeout_s`` are read here for every class)."""
        value = self.config.get("timeout_s")
        return None if value is None else float(value)

    def start_deadline_s(self) -> float | None:
        """How long ``start_interaction`` may take in all (None: no deadline; an interaction whose
        start may queue behind its own episodes bounds its waits itself). By default the same
        as every other call."""
        return self.call_deadline_s()

    def endpoint_for(self, instance_id: str) -> str:
        """What to name in errors about ``instance_id``'s calls (a URL for a server)."""
        return f"interaction {self.name!r}"

    @classmethod
    def create(cls, config: dict[str, Any] | None, context: InteractionContext | None = None) -> Interaction:
        """Build an instance for a job (what :class:`~opentinker.environments.registry.InteractionRegistry`
        calls). The default ignores ``context``; interactions that reach servers or carry a job
        id override it to apply the context."""
        return cls(config)

    async def start_interaction(self, instance_id: str | None = None, **kwargs: Any) -> str:
        """Create an instance and return its id (a fresh uuid4 when ``instance_id`` is None).

        ``kwargs`` are the dataset row's ``interaction_kwargs`` (e.g. ``ground_truth``)
        and trainer-supplied ones (``seed``, ``job_id``).
        """
        if instance_id is None:
            instance_id = str(uuid.uuid4())
        self._rewards.setdefault(instance_id, [])
        return instance_id

    @classmethod
    def row_problem(cls, kwargs: dict[str, Any]) -> str | None:
        """What makes a dataset row's ``interaction_kwargs`` (``name`` removed) unusable for
        this interaction, or None. The server asks before it accepts rows, so a row that
        would fail inside a running job is refused up front; the default accepts all."""
        return None

    async def initial_observation(self, instance_id: str) -> InitialObservation | None:
        """The first user message of a data-free environment; None when the prompt comes from data."""
        return None

    @abstractmethod
    async def generate_response(
        self, instance_id: str, messages: list[dict[str, str]], **kwargs: Any
    ) -> tuple[bool, str, float, dict[str, Any]]:
        """React to the model's last turn (the last message of ``messages``).

        Returns ``(done, response_text, reward, info)``; ``response_text`` becomes the
        next user turn when ``done`` is False (text, or a content list of text and picture parts
        for a vision-language model). Subclasses that use the default
        :meth:`calculate_score` record each reward with :meth:`_record_reward`.

        With ``done``, ``info[TRUNCATED] is True`` says the episode was cut short rather than
        finished, and ``info[MAX_STEPS_REACHED] is True`` that the interaction's own step
        budget cut it (the agent loop's stop reasons ``env_truncated`` / ``max_env_steps``).
        """

    async def calculate_score(self, instance_id: str, **kwargs: Any) -> float:
        """The trajectory's score; by default the sum of the rewards recorded so far (0.0 if none)."""
        return float(sum(self._rewards.get(instance_id, ())))

    async def finalize_interaction(self, instance_id: str, **kwargs: Any) -> None:
        """Release the instance's state. Safe to call for an unknown or finished instance."""
        self._rewards.pop(instance_id, None)

    async def aclose(self) -> None:
        """Release what the interaction holds between instances (connections); called when its
        event loop ends. It may be used again afterwards. By default nothing to release."""

    # Instances left open at the env by a failure: an interaction whose instances live on its
    # env server until finalized (the gym protocol) keeps those whose finalize could not reach
    # the server and finalizes them again before the next step; a job's runner keeps their ids
    # on disk (``engine/ppo/env_instances.py``), so that a restarted runner finalizes what the
    # previous process left open. By default there is nothing: an instance ends with its
    # connection (an OpenEnv session), or lives in this process.

    def unfinalized_instances(self) -> list[str]:
        """Instances whose finalize did not reach their env server (it could not be reached)."""
        return []

    def adopt_unfinalized(self, instance_ids: list[str]) -> None:
        """Take on instances a previous process of the job may have left open at the env."""

    async def finalize_leftovers(self) -> int:
        """Finalize the instances left open (one try each); how many are still open afterwards."""
        return 0

    # Helpers for subclasses -------------------------------------------------------------

    def _record_reward(self, instance_id: str, reward: float) -> None:
        self._rewards.setdefault(instance_id, []).append(float(reward))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"
