"""Strategy judges for the creativity advantage estimators (``grpo_weighted_add/mul``).

A judge groups the n responses of each prompt by high-level solution strategy and returns one
label per response; the estimators weight a response by ``count(same label) ** -0.7``.

``make_judge(kind, **options)`` builds one:

* ``"openai"``: :class:`~opentinker.creativity.openai_judge.OpenAIStrategyJudge`, any
  OpenAI-compatible chat API (``OPENAI_API_KEY``, ``OPENAI_BASE_URL``);
* ``"hf"``: :class:`~opentinker.creativity.hf_judge.HFStrategyJudge`, a local Hugging Face
  causal LM (or the policy model) on the same prompt;
* ``"lexical"``: :class:`~opentinker.creativity.lexical_judge.LexicalStrategyJudge`, no model:
  TF-IDF similarity clustering, an approximation for machines without a judge model.

Importing this package imports neither openai, torch, transformers nor numpy; each judge
imports what it needs when it is built. The prompt and its JSON schema are documented in
:mod:`opentinker.creativity.prompt`.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

from opentinker.creativity.base import JudgeConfigError, JudgeMetrics, StrategyJudge
from opentinker.creativity.prompt import (
    PROMPT_VERSION,
    JudgementError,
    build_messages,
    canonical_labels,
    parse_judgement,
)

# kind -> (module, class); modules are imported only when a judge of that kind is made.
_JUDGES: dict[str, tuple[str, str]] = {
    "openai": ("opentinker.creativity.openai_judge", "OpenAIStrategyJudge"),
    "hf": ("opentinker.creativity.hf_judge", "HFStrategyJudge"),
    "lexical": ("opentinker.creativity.lexical_judge", "LexicalStrategyJudge"),
}

#: The kinds ``make_judge`` accepts.
JUDGE_KINDS: tuple[str, ...] = tuple(_JUDGES)


def judge_class(kind: str) -> type:
    """The judge class of ``kind``; ``ValueError`` listing the valid kinds otherwise."""
    key = kind.strip().lower() if isinstance(kind, str) else kind
    if key not in _JUDGES:
        valid = ", ".join(repr(name) for name in JUDGE_KINDS)
        raise ValueError(f"unknown strategy judge kind {kind!r}; valid kinds: {valid}")
    module_name, class_name = _JUDGES[key]
    return getattr(importlib.import_module(module_name), class_name)


def make_judge(kind: str, **options: Any) -> StrategyJudge:
    """A strategy judge of ``kind`` (``"openai"``, ``"hf"`` or ``"lexical"``) built with
    ``options`` (the keyword arguments of its class). Unknown kinds and unknown options raise
    ``ValueError`` naming the valid ones."""
    cls = judge_class(kind)
    parameters = inspect.signature(cls).parameters
    accepted = [name for name, parameter in parameters.items() if parameter.kind is not parameter.VAR_KEYWORD]
    unknown = sorted(set(options) - set(accepted))
    if unknown and not any(parameter.kind is parameter.VAR_KEYWORD for parameter in parameters.values()):
        raise JudgeConfigError(
            f"unknown option(s) {', '.join(map(repr, unknown))} for the {kind.strip().lower()!r} strategy judge; "
            f"valid options: {', '.join(accepted)}"
        )
    return cls(**options)


def __getattr__(name: str) -> Any:
    # The judge classes, imported on first use (keeps ``import opentinker.creativity`` light).
    for kind, (_module_name, class_name) in _JUDGES.items():
        if name == class_name:
            return judge_class(kind)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "JUDGE_KINDS",
    "PROMPT_VERSION",
    "HFStrategyJudge",
    "JudgeConfigError",
    "JudgeMetrics",
    "JudgementError",
    "LexicalStrategyJudge",
    "OpenAIStrategyJudge",
    "StrategyJudge",
    "build_messages",
    "canonical_labels",
    "judge_class",
    "make_judge",
    "parse_judgement",
]
