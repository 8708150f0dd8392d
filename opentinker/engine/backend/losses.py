"""The losses ``forward_backward`` can apply: per-token losses, summed with per-token weights.

A loss is ``fn(logprobs, inputs, config, entropy) -> (elementwise [B, R], stats)`` where
``inputs`` are the batch's per-token tensors (``response_mask`` among them), ``config`` its
options and ``stats`` per-token statistics ``{name: [B, R]}``. The backend back-propagates ``sum(weights * elementwise)``
and reports ``sum(weights * stat)`` for each stat: with weights that normalise over a
mini-batch, those sums are the mini-batch's means however the batch is split.

Built in (the Tinker API's semantics, ``r = exp(logprobs - old_logprobs)``):

- ``cross_entropy``: ``-logp``;
- ``importance_sampling``: ``-r * A`` (``old_logprobs`` are the sampler's);
- ``ppo``: ``-min(r * A, clip(r, lo, hi) * A)`` with ``clip_low_threshold`` (0.8) and
  ``clip_high_threshold`` (1.2);
- ``cispo``: ``-sg(clip(r, lo, hi)) * logp * A``, same thresholds;
- ``dro``: ``-(logp * A - beta/2 * (logp - old_logprobs)^2)`` with ``beta`` (0.05);
- ``gspo``: PPO's clipped objective on GSPO-token's ratio, a datum's sequence ratio as the
  value and each token's own gradient (``sequence_ratio_mask`` marks the tokens it averages);
- ``stable_reinforce``: REINFORCE with a truncated importance weight,
  ``-sg(min(r, clip_high_threshold)) * logp * A`` (2.0; Tinker does not publish its objective);
- ``rl_policy``: the PPO recipe's loss: a policy loss of
  :mod:`opentinker.engine.algorithms.policy_losses` (``policy_loss``: vanilla | gspo | cispo,
  with ``clip_ratio``, ``clip_ratio_low``, ``clip_ratio_high``, ``clip_ratio_c``), plus
  ``kl_loss_coef * KL(kl_loss_type)`` to ``ref_logprobs`` when ``use_kl_loss``, minus
  ``entropy_coeff * entropy``. Without ``old_logprobs`` the ratio is 1 (on-policy). With
  ``rollout_is`` (token | sequence) the policy term of each token is multiplied by its
  truncated IS weight ``min(exp(old - rollout_logprobs), rollout_is_threshold)``, old being
  ``old_logprobs`` or, without them, this pass's own logprobs (detached): one pass, no
  recompute, when the update is a single optimizer step.
- ``value``: a value model's clipped loss against ``returns`` (``old_values``,
  ``cliprange_value``); the backend's per-token outputs are then values, not logprobs.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from opentinker.engine.algorithms.kl import kl_penalty
from opentinker.engine.algorithms.policy_losses import policy_token_losses
from opentinker.engine.algorithms.rollout_correction import rollout_correction
from opentinker.engine.batch import TokenBatch
from opentinker.tinker_losses import TINKER_LOSSES

Stats = dict[str, torch.Tensor]
LossFn = Callable[[torch.Tensor, Mapping[str, torch.Tensor], Mapping[str, Any], "torch.Tensor | None"],
                  tuple[torch.Tensor, Stats]]


@dataclass(frozen=True)
class LossSpec:
    name: str
    fn: LossFn
    inputs: tuple[str, ...]  # per-token tensors it needs besides the response mask
    options: Mapping[str, Any]  # config keys it takes, with their defaults
    needs_entropy: Callable[[Mapping[str, Any]], bool] = lambda config: False


_LOSSES: dict[str, LossSpec] = {}


def register_loss(name: str, *, inputs: tuple[str, ...] = (), options: Mapping[str, Any] | None = None,
                  needs_entropy: Callable[[Mapping[str, Any]], bool] | None = None) -> Callable[[LossFn], LossFn]:
    """Decorator adding a sum-reduced loss under ``name``. A loss the Tinker API offers takes
    its inputs and options from ``opentinker/tinker_losses.py`` (declared there, once)."""
    if name in TINKER_LOSSES:
        if inputs or options:
            raise ValueError(f"loss {name!r} is a Tinker loss: its inputs and options are declared in "
                             "opentinker/tinker_losses.py")
        inputs, options = TINKER_LOSSES[name].engine_inputs, TINKER_LOSSES[name].options

    def decorator(fn: LossFn) -> LossFn:
        _LOSSES[name] = LossSpec(name, fn, tuple(inputs), dict(options or {}),
                                 needs_entropy or (lambda config: False))
        return fn

    return decorator


def loss_names() -> list[str]:
    return sorted(_LOSSES)


def resolve_loss(name: str, config: Mapping[str, Any] | None) -> tuple[LossSpec, dict[str, Any]]:
    """The loss ``name`` and its full config (defaults filled in); ValueError naming what is
    supported for an unknown loss or option."""
    spec = _LOSSES.get(name)
    if spec is None:
        raise ValueError(f"unknown loss function {name!r}; supported: {', '.join(loss_names())}")
    config = dict(config or {})
    unknown = sorted(set(config) - set(spec.options))
    if unknown:
        known = ", ".join(sorted(spec.options)) or "none"
        raise ValueError(f"loss {name!r}: unknown option(s) {unknown}; it takes: {known}")
    return spec, {**spec.options, **config}


def check_inputs(spec: LossSpec, tensors: Mapping[str, torch.Tensor], shape: tuple[int, ...]) -> None:
    for key in spec.inputs:
        if key not in tensors:
            raise ValueError(f"loss {spec.name!r} needs the per-token input {key!r}")
    for key, tensor in tensors.items():
        if tuple(tensor.shape) != shape:
            raise ValueError(f"per-token input {key!r} has shape {tuple(tensor.shape)}, expected {shape}")


@dataclass
class WeightedLoss:
    """One ``forward_backward`` micro-batch's loss: ``loss`` (a scalar to back-propagate),
    the ``elementwise`` losses and the ``metrics`` (``"loss:sum"``, ``"<stat>:sum"``)."""

    loss: torch.Tensor
    elementwise: torch.Tensor
    metrics: dict[str, float]


def weighted_loss(spec: LossSpec, config: Mapping[str, Any], logprobs: torch.Tensor,
                  entropy: torch.Tensor | None, batch: TokenBatch, device: torch.device) -> WeightedLoss:
    """``sum(weights * elementwise)`` over the batch, and each stat summed with the same weights
    (``weights``: ``batch.tensors["weights"]``, default the response mask)."""
    inputs = {name: t.to(device) for name, t in batch.tensors.items()}
    inputs["response_mask"] = batch.response_mask.to(device)
    elementwise, stats = spec.fn(logprobs, inputs, config, entropy)
    weights = inputs.get("weights", inputs["response_mask"])
    loss = (elementwise * weights).sum()
    if entropy is not None:
        stats = {**stats, "entropy": entropy.detach()}
    metrics = {"loss:sum": float(loss.detach())}
    metrics.update({f"{name}:sum": float((value * weights).sum()) for name, value in stats.items()})
    return WeightedLoss(loss, elementwise.detach(), metrics)


def _ratio(logprobs: torch.Tensor, inputs: Mapping[str, torch.Tensor]) -> torch.Tensor:
    return torch.exp(logprobs - inputs["old_logprobs"])


@register_loss("cross_entropy")
def cross_entropy(logprobs, inputs, config, entropy):
    return -logprobs, {}


@register_loss("importance_sampling")
def importance_sampling(logprobs, inputs, config, entropy):
    return -_ratio(logprobs, inputs) * inputs["advantages"], {}


@register_loss("ppo")
def ppo(logprobs, inputs, config, entropy):
    ratio, advantages = _ratio(logprobs, inputs), inputs["advantages"]
    clipped = torch.clamp(ratio, config["clip_low_threshold"], config["clip_high_threshold"])
    objective = torch.minimum(ratio * advantages, clipped * advantages)
    return -objective, {"clipfrac": (clipped != ratio).to(logprobs.dtype)}


@register_loss("cispo")
def cispo(logprobs, inputs, config, entropy):
    ratio = _ratio(logprobs.detach(), inputs)
    weight = torch.clamp(ratio, config["clip_low_threshold"], config["clip_high_threshold"])
    return -weight * logprobs * inputs["advantages"], {"clipfrac": (weight != ratio).to(logprobs.dtype)}


@register_loss("dro")
def dro(logprobs, inputs, config, entropy):
    """Direct Reward Optimization (Richemond et al. 2024, arXiv 2405.19107), as Tinker's loss
    docs define ``dro`` (tinker-docs.thinkingmachines.ai/tinker/losses/dro):
    ``-(logp * A - beta/2 * (logp - q)^2)`` per token, ``q`` the sampler's logprob. The
    docs' example passes ``beta`` 0.05 and do not state a default; 0.05 is taken. As there,
    every token with a weight counts, so positions whose ``logprobs`` are padding (a prompt's
    0.0) add ``beta/2 * logp^2`` unless their ``weights`` are 0."""
    penalty = (logprobs - inputs["old_logprobs"]) ** 2
    return -(logprobs * inputs["advantages"] - 0.5 * config["beta"] * penalty), {"dro_penalty": penalty.detach()}


@register_loss("gspo")
def gspo(logprobs, inputs, config, entropy):
    """GSPO-token (Zheng et al. 2025, arXiv 2507.18071), as Tinker's loss docs define ``gspo``
    (tinker-docs.thinkingmachines.ai/tinker/losses/gspo). Per datum (row),
    ``s = exp(mean over the tokens M that sequence_ratio_mask marks of sg(logp) - q)``; each
    token's ratio is ``s_t = s * exp(logp - sg(logp))`` (the value of ``s``, the gradient of
    its own logprob), then PPO's ``-min(s_t * A, clip(s_t, lo, hi) * A)``. The sequence ratio
    is a row's own, so rows stay independent however a request is split into passes; a row
    that marks no token has ``s = 1``."""
    marked = (inputs["sequence_ratio_mask"] != 0).to(logprobs.dtype)
    log_ratio = ((logprobs.detach() - inputs["old_logprobs"]) * marked).sum(-1, keepdim=True)
    log_ratio = log_ratio / marked.sum(-1, keepdim=True).clamp(min=1)
    ratio = torch.exp(log_ratio + logprobs - logprobs.detach())
    advantages = inputs["advantages"]
    clipped = torch.clamp(ratio, config["clip_low_threshold"], config["clip_high_threshold"])
    objective = torch.minimum(ratio * advantages, clipped * advantages)
    return -objective, {"clipfrac": (clipped != ratio).to(logprobs.dtype)}


@register_loss("stable_reinforce")
def stable_reinforce(logprobs, inputs, config, entropy):
    """Tinker's ``stable_reinforce`` (cookbook 0.6.1's default RL loss) is "a REINFORCE
    variant that stays stable even when the sampling policy differs from the policy being
    trained" (tinker-docs.thinkingmachines.ai/tinker/losses/stable-reinforce); its objective
    is not published. This server's is REINFORCE with a truncated importance weight (TIS:
    Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL
    Training"; CISPO's one-sided clip, arXiv 2506.13585): ``-sg(min(r, c)) * logp * A``,
    ``r = exp(logp - q)``, ``c`` = ``clip_high_threshold`` (2.0, as ``rl_policy``'s
    ``rollout_is_threshold``). On-policy it is REINFORCE; off-policy the weight corrects
    towards the learner and is bounded, and the gradient never goes through it. The sampler's
    ``q`` is the datum's ``logprobs`` input: the provenance spans and sampling-time records
    Tinker adds are accepted and not used."""
    if not config["clip_high_threshold"] >= 1:
        raise ValueError(f"loss 'stable_reinforce': clip_high_threshold must be >= 1, got {config['clip_high_threshold']}")
    log_ratio = logprobs.detach() - inputs["old_logprobs"]
    # exp(min(x, log c)) == min(exp(x), c) without overflowing for a very stale token.
    weight = torch.exp(torch.clamp(log_ratio, max=math.log(config["clip_high_threshold"])))
    truncated = (log_ratio > math.log(config["clip_high_threshold"])).to(logprobs.dtype)
    return -weight * logprobs * inputs["advantages"], {"clipfrac": truncated}


_RL_POLICY_OPTIONS = {
    "policy_loss": "vanilla",
    "clip_ratio": 0.2,
    "clip_ratio_low": None,
    "clip_ratio_high": None,
    "clip_ratio_c": 3.0,
    "entropy_coeff": 0.0,
    "use_kl_loss": False,
    "kl_loss_coef": 0.001,
    "kl_loss_type": "low_var_kl",
    "rollout_is": None,  # None | token | sequence: the rollout correction's IS weights (needs rollout_logprobs)
    "rollout_is_threshold": 2.0,
}


@register_loss("rl_policy", inputs=("advantages",), options=_RL_POLICY_OPTIONS,
               needs_entropy=lambda config: bool(config["entropy_coeff"]))
def rl_policy(logprobs, inputs, config, entropy):
    token_losses = policy_token_losses(config["policy_loss"])  # any registered one (config validation's names)
    mask = inputs["response_mask"]  # GSPO's sequence ratio averages over the model tokens
    old = inputs["old_logprobs"] if "old_logprobs" in inputs else logprobs.detach()  # on-policy: ratio 1
    losses, stats, _ = token_losses(
        old, logprobs, inputs["advantages"], mask,
        clip_ratio=config["clip_ratio"], clip_ratio_low=config["clip_ratio_low"],
        clip_ratio_high=config["clip_ratio_high"], clip_ratio_c=config["clip_ratio_c"],
    )
    if config["rollout_is"] is not None:  # constants: old is the policy before this update
        if "rollout_logprobs" not in inputs:
            raise ValueError("loss 'rl_policy' with rollout_is needs the per-token input 'rollout_logprobs'")
        weights, _, _ = rollout_correction(old.detach(), inputs["rollout_logprobs"], mask,
                                           rollout_is=config["rollout_is"], is_threshold=config["rollout_is_threshold"])
        losses = losses * weights
    stats = {**stats, "pg_loss": losses.detach()}
    if config["entropy_coeff"]:
        losses = losses - config["entropy_coeff"] * entropy
    if config["use_kl_loss"]:
        if "ref_logprobs" not in inputs:
            raise ValueError("loss 'rl_policy' with use_kl_loss needs the per-token input 'ref_logprobs'")
        kl = kl_penalty(logprobs, inputs["ref_logprobs"], config["kl_loss_type"])
        losses = losses + config["kl_loss_coef"] * kl
        stats["kl"] = kl.detach()
    return losses, stats


@register_loss("value", inputs=("returns", "old_values"), options={"cliprange_value": 0.5})
def value(values, inputs, config, entropy):
    """PPO's clipped value loss (verl's ``compute_value_loss``) on a value model's outputs:
    ``0.5 * max((v - R)^2, (clip(v, v_old - c, v_old + c) - R)^2)`` with ``c`` =
    ``cliprange_value``; ``values`` come where a policy's logprobs do."""
    returns, old = inputs["returns"], inputs["old_values"]
    clipped = old + torch.clamp(values - old, -config["cliprange_value"], config["cliprange_value"])
    unclipped_loss, clipped_loss = (values - returns) ** 2, (clipped - returns) ** 2
    return 0.5 * torch.maximum(unclipped_loss, clipped_loss), {
        "vf_clipfrac": (clipped_loss > unclipped_loss).to(values.dtype), "vpred": values.detach()}
