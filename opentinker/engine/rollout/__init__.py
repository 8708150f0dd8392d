"""Rollout engines: token ids in, token ids + logprobs out (see :mod:`.base`); the engines a
recipe may name are registered in :mod:`.registry` (the built-in ones in :mod:`.builtin_engines`)."""

from opentinker.engine.rollout import builtin_engines as _builtin_engines  # noqa: F401 - registers them
from opentinker.engine.rollout.base import AsyncCompletions, Completion, RequestBatcher, RolloutEngine, SamplingParams
from opentinker.engine.rollout.registry import (
    RolloutBuild, RolloutEngineKind, register_rollout_engine, rollout_engine_kind, rollout_engine_names,
)

__all__ = ["AsyncCompletions", "Completion", "RequestBatcher", "RolloutBuild", "RolloutEngine", "RolloutEngineKind",
           "SamplingParams", "register_rollout_engine", "rollout_engine_kind", "rollout_engine_names"]
