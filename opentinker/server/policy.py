"""What a job may ask for on this server: the operator's choices, applied to a client's job.

A client's config is data, never a way to reach the server's disk, code, secrets or network:

- ``actor_rollout_ref.model.path`` (and ``critic.model.path``) names one of the *served
  models* (``GET /v1/models``), never a folder; the runner maps the name to its path. ``trust_remote_code`` and
  ``trainer.default_local_dir`` are the operator's alone.
- the OpenAI-compatible strategy judge is called only at the operator's base URL and with one
  of the operator's judge models (the server's API key goes nowhere else); the ``hf`` judge
  may only load a served model;
- loggers that send data out with the server's credentials (wandb) need the operator's leave;
- numeric config values stay within the operator's limits (the ranges of ``opentinker config keys``);
- interactions are resolved against the allowlist, and their env endpoints against the
  operator's :class:`~opentinker.environments.endpoints.EndpointPolicy`.

:class:`JobPolicy` is built from the settings, checked at ``POST /v1/jobs`` (every refusal is
a :class:`PolicyError` naming the field) and shipped to the job's runner, which applies it
again when it builds the trainer: the config a runner trains with never holds a path, URL or
code switch that a client chose.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from opentinker.config import build_recipe, flatten
from opentinker.environments.endpoints import EndpointPolicy
from opentinker.images import ImageLimits
from opentinker.recipe import RecipeSpec
from opentinker.recipe.components import JobMode

TINY_MODEL_NAME = "opentinker-tiny-arith"  # engine.tiny.TINY_MODEL_NAME (not imported: no torch here)

_MODEL_KEY = "actor_rollout_ref.model.path"
_JUDGE = "algorithm.judge"
JOB_CHECKPOINTS = "checkpoints"  # a job's checkpoints: <job dir>/checkpoints/<name> (trainer.default_local_dir)


class PolicyError(ValueError):
    """A job asks for something this server does not allow; ``field`` names what (``config.<key>``)."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class ServedModel:
    """A model jobs may train. ``path`` None is the embedded tiny model (built on first use)."""

    name: str
    path: str | None = None
    trust_remote_code: bool = False


def parse_served_models(specs: Sequence[str], trust_remote_code: Sequence[str] = ()) -> tuple[ServedModel, ...]:
    """``--model`` values (``NAME=PATH`` or ``PATH``, the name then being the path) as served
    models; the embedded tiny model is always served. The first one given is the default."""
    models: list[ServedModel] = []
    trusted = set(trust_remote_code)
    for spec in specs:
        name, sep, path = spec.partition("=")
        name, path = (name.strip(), path.strip()) if sep else (spec.strip(), spec.strip())
        if not name or not path:
            raise ValueError(f"--model {spec!r}: expected NAME=PATH or PATH")
        if any(m.name == name for m in models) or name == TINY_MODEL_NAME:
            raise ValueError(f"--model {spec!r}: the name {name!r} is served twice")
        models.append(ServedModel(name, path, name in trusted))
    unknown = trusted - {m.name for m in models}
    if unknown:
        raise ValueError(f"--trust-remote-code names models that are not served: {sorted(unknown)}")
    models.append(ServedModel(TINY_MODEL_NAME))
    return tuple(models)


@dataclass(frozen=True)
class JobPolicy:
    """The operator's allowlists and limits, as a job sees them (picklable: it goes to the runner)."""

    models: tuple[ServedModel, ...] = (ServedModel(TINY_MODEL_NAME),)  # the first is the default
    judge_base_url: str | None = None  # None: the openai client's default (OPENAI_BASE_URL or OpenAI)
    judge_models: tuple[str, ...] = ()  # OpenAI-compatible judge models; the first is the default
    loggers: tuple[str, ...] = ("console",)
    limits: Mapping[str, float] = field(default_factory=dict)
    allowed_interactions: tuple[str, ...] = ()
    endpoint_policy: EndpointPolicy = field(default_factory=EndpointPolicy)
    max_env_shards: int = 16
    env_relays: bool = True  # interactions may use relay: client
    env_relay_in_flight: int = 256  # env calls one job's relay carries at once
    image_limits: ImageLimits = ImageLimits()  # pictures in rows (--max-image-bytes, ...)

    @property
    def default_model(self) -> ServedModel:
        return self.models[0]

    def model_names(self) -> list[str]:
        return [m.name for m in self.models]

    def served_model(self, name: str | None, field: str = f"config.{_MODEL_KEY}") -> ServedModel:
        if name is None:
            return self.default_model
        for model in self.models:
            if model.name == name:
                return model
        raise PolicyError(
            field,
            f"{field.removeprefix('config.')}: {name!r} is not a model served here; served models: "
            f"{', '.join(self.model_names())} (GET /v1/models)",
        )

    # the client's config ---------------------------------------------------------------

    def client_recipe(self, overrides: Mapping[str, Any], mode: JobMode = "server",
                      gpus: bool | None = None) -> RecipeSpec:
        """The recipe a client asked for (parsed once), checked against this policy, with the
        served-model and judge-model names filled in: what the job's info shows. ``mode`` and
        ``gpus`` as :func:`~opentinker.config.build_recipe` takes them. Raises PolicyError or
        ConfigError."""
        asked = flatten(overrides)
        if asked.get("trainer.default_local_dir") is not None:
            raise PolicyError(
                "config.trainer.default_local_dir",
                "config key 'trainer.default_local_dir' is set by the server (each job saves into its own "
                "folder); leave it out and use trainer.save_freq or POST /v1/jobs/{id}/checkpoints",
            )
        if asked.get("trainer.resume_mode") not in (None, "auto", "disable"):
            raise PolicyError(
                "config.trainer.resume_mode",
                "config key 'trainer.resume_mode': a job may only ask for 'auto' or 'disable' (the server "
                "resumes a job from its own checkpoints: POST /v1/jobs/{id}/resume)",
            )
        if asked.get("actor_rollout_ref.model.trust_remote_code") not in (None, False):
            raise PolicyError(
                "config.actor_rollout_ref.model.trust_remote_code",
                "config key 'actor_rollout_ref.model.trust_remote_code' is the server operator's choice per "
                "served model (opentinker-server serve --trust-remote-code NAME); leave it out",
            )
        spec = build_recipe(overrides, limits=self.limits, mode=mode, gpus=gpus)
        model = self.served_model(spec.actor_rollout_ref.model.path)
        spec = spec.replaced(_MODEL_KEY, model.name)
        if spec.critic.model.path is not None:  # a served model's name too, never a folder
            critic = self.served_model(spec.critic.model.path, "config.critic.model.path")
            if critic.path is None and model.path is not None:  # None means "the actor's model" to the trainer
                raise PolicyError("config.critic.model.path", "critic.model.path: the embedded tiny model can only "
                                  "be the critic of itself; leave critic.model.path out for the actor's model")
        spec = self._checked_judge(spec)
        refused = [name for name in spec.trainer.logger if name not in self.loggers]
        if refused:
            raise PolicyError(
                "config.trainer.logger",
                f"config key 'trainer.logger': {refused} not enabled on this server (allowed: "
                f"{', '.join(self.loggers)}); the operator enables more with --allow-logger",
            )
        return spec

    def _checked_judge(self, spec: RecipeSpec) -> RecipeSpec:
        """``spec`` with its judge checked against this server's, and the judge model named."""
        judge = spec.algorithm.judge
        if judge.kind == "openai":
            if not self.judge_models:
                raise PolicyError(
                    f"config.{_JUDGE}.kind",
                    "config key 'algorithm.judge.kind': this server offers no OpenAI-compatible judge "
                    "(its operator can add one with --judge-model); use 'lexical' or 'hf'",
                )
            if judge.model is not None and judge.model not in self.judge_models:
                raise PolicyError(
                    f"config.{_JUDGE}.model",
                    f"config key 'algorithm.judge.model': {judge.model!r} is not a judge model of this "
                    f"server; judge models: {', '.join(self.judge_models)}",
                )
            if judge.base_url is not None and judge.base_url != self.judge_base_url:
                raise PolicyError(
                    f"config.{_JUDGE}.base_url",
                    "config key 'algorithm.judge.base_url' is chosen by the server operator (the judge is "
                    "called with the server's API key); leave it out",
                )
            return spec.replaced(f"{_JUDGE}.model", judge.model or self.judge_models[0])
        if judge.kind == "hf":
            self.served_model(judge.model, f"config.{_JUDGE}.model")
        if judge.base_url is not None:
            raise PolicyError(f"config.{_JUDGE}.base_url", "config key 'algorithm.judge.base_url' is only for kind 'openai'")
        return spec

    # what the runner adds ------------------------------------------------------------------

    def server_overrides(self, spec: RecipeSpec, job_dir: str) -> dict[str, Any]:
        """What the runner sets on top of the client's recipe: the real model path and its
        trust_remote_code, the judge's endpoint and model path, the job's own folder."""
        model = self.served_model(spec.actor_rollout_ref.model.path)
        overrides: dict[str, Any] = {
            _MODEL_KEY: model.path,
            "actor_rollout_ref.model.trust_remote_code": model.trust_remote_code,
            "trainer.default_local_dir": f"{job_dir}/{JOB_CHECKPOINTS}",
            "trainer.progress_bar": False,
        }
        if spec.critic.model.path is not None:
            overrides["critic.model.path"] = self.served_model(spec.critic.model.path).path
        judge = spec.algorithm.judge
        if judge.kind == "openai":
            overrides[f"{_JUDGE}.base_url"] = self.judge_base_url
        elif judge.kind == "hf" and judge.model is not None:
            overrides[f"{_JUDGE}.model"] = self.served_model(judge.model).path
        return overrides

    def runner_recipe(self, client_overrides: Mapping[str, Any], job_dir: str, mode: JobMode = "server") -> RecipeSpec:
        """The recipe a runner trains with: the client's, checked again against this policy,
        plus the server's own values (the operator's, not checked as a client's would be)."""
        spec = self.client_recipe(client_overrides, mode=mode)
        for key, value in self.server_overrides(spec, job_dir).items():
            spec = spec.replaced(key, value)
        return spec

    def interaction_context(self, job_id: str | None, relay: Any = None):
        """What a job's interactions may reach; ``relay``: the job's RelayHub (in its runner)."""
        from opentinker.environments.interaction import InteractionContext

        refusal = None if self.env_relays else ("client relays are turned off on this server (its operator "
                                                "started it with --no-env-relay)")
        return InteractionContext(job_id=job_id, endpoint_policy=self.endpoint_policy,
                                  max_env_shards=self.max_env_shards, relay=relay, relay_refusal=refusal)
