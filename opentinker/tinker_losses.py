"""The losses the Tinker API offers, declared once: the per-token inputs each needs besides
``target_tokens`` (by Tinker's names) and the options it takes, with their defaults. Torch-free:
the API process's wire decoder checks requests against it, and the engine's loss registry
(``engine/backend/losses.py``) takes each loss's inputs and options from it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

#: Tinker's per-token input names -> the engine losses' names (Tinker calls the sampler's
#: logprobs ``logprobs``; the engine, ``old_logprobs``).
INPUT_NAMES = {"weights": "weights", "logprobs": "old_logprobs", "advantages": "advantages",
               "sequence_ratio_mask": "sequence_ratio_mask"}


@dataclass(frozen=True)
class TinkerLoss:
    inputs: tuple[str, ...]  # per-token inputs it needs besides target_tokens (Tinker's names)
    options: Mapping[str, float] = field(default_factory=dict)  # the options it takes, with defaults

    @property
    def engine_inputs(self) -> tuple[str, ...]:
        return tuple(INPUT_NAMES[name] for name in self.inputs)


_CLIP = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
_SAMPLED = ("logprobs", "advantages")

TINKER_LOSSES: dict[str, TinkerLoss] = {
    "cross_entropy": TinkerLoss(()),
    "importance_sampling": TinkerLoss(_SAMPLED),
    "ppo": TinkerLoss(_SAMPLED, _CLIP),
    "cispo": TinkerLoss(_SAMPLED, _CLIP),
    "dro": TinkerLoss(_SAMPLED, {"beta": 0.05}),
    "gspo": TinkerLoss((*_SAMPLED, "sequence_ratio_mask"), _CLIP),
    "stable_reinforce": TinkerLoss(_SAMPLED, {"clip_high_threshold": 2.0}),
}
