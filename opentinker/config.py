"""Typed training config with verl-style dotted keys.

One tree of defaults (``DEFAULTS``) is the single source of truth: every valid key is a
key of that tree, so an override such as ``actor_rollout_ref.actor.optim.lr=1e-5`` is
checked against it, and a typo is an error naming the bad key and the closest valid one.
No torch here: the client validates configs before sending them.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

ADV_ESTIMATORS_NEEDING_GROUPS = (
    "grpo",
    "grpo_weighted_add",
    "grpo_weighted_mul",
    "rloo",
)

DEFAULTS: dict[str, Any] = {
    "data": {
        "task": "arithmetic",  # built-in dataset used when no rows are given
        "train_batch_size": 8,  # prompts per step; each is sampled rollout.n times
        "val_batch_size": 64,  # held-out prompts per validation
        "max_prompt_length": 128,
        "max_response_length": 16,
        "shuffle": True,
        "seed": 1,
    },
    "actor_rollout_ref": {
        "model": {
            "path": None,  # None -> the embedded tiny model
            # Packed sequences skip pad tokens, but only a varlen attention kernel (flash-attn on
            # GPU) exploits that; with sdpa on CPU one long masked row is far slower than padding.
            "use_remove_padding": False,
            # Run each distinct prompt once and reuse its KV cache for its n samples
            # (padded path only; same logprobs and gradients, far fewer tokens computed).
            "share_prompt_prefix": True,
            "enable_gradient_checkpointing": False,
            "trust_remote_code": False,
        },
        "actor": {
            "strategy": "local",  # "local" (one in-process worker); FSDP comes later
            "ppo_mini_batch_size": 8,  # in prompts, as in verl (x rollout.n samples)
            "ppo_micro_batch_size": 64,  # in samples, per forward/backward
            "ppo_epochs": 1,
            "policy_loss": "vanilla",
            "clip_ratio": 0.2,
            "clip_ratio_low": None,
            "clip_ratio_high": None,
            "clip_ratio_c": 3.0,
            "loss_agg_mode": "token-mean",
            "entropy_coeff": 0.0,
            "use_kl_loss": False,
            "kl_loss_coef": 0.001,
            "kl_loss_type": "low_var_kl",
            "grad_clip": 1.0,
            "optim": {
                "lr": 1e-6,
                "weight_decay": 0.01,
                "betas": [0.9, 0.999],
                "lr_warmup_steps": -1,  # -1: use lr_warmup_steps_ratio
                "lr_warmup_steps_ratio": 0.0,
                "warmup_style": "constant",  # constant | cosine
                "min_lr_ratio": 0.0,
            },
            "fsdp_config": {
                "param_offload": False,
                "grad_offload": False,
                "optimizer_offload": False,
            },
        },
        "ref": {
            "log_prob_micro_batch_size": 64,
        },
        "rollout": {
            "name": "transformers",  # transformers | vllm
            "n": 8,
            "temperature": 1.0,
            "top_p": 1.0,
            "top_k": -1,
            "gpu_memory_utilization": 0.5,
            "max_batch_size": 256,  # concurrent sequences in one generate call
            "val_temperature": 0.0,  # greedy validation
            "val_n": 1,  # samples per validation prompt; > 1 (with val_temperature > 0) reports pass@k
            "ignore_eos": False,  # always generate data.max_response_length tokens (benchmarks)
            "multi_turn": {  # agent loops; the total response budget is data.max_response_length
                "max_assistant_turns": 5,
                "max_user_turns": 5,
                "max_tokens_per_turn": 64,
                "reward_mode": "sum",  # sum | last | score (the interaction's calculate_score)
                "env_error_reward": 0.0,
            },
        },
    },
    "algorithm": {
        "adv_estimator": "grpo",
        "norm_adv_by_std_in_grpo": True,
        "gamma": 1.0,
        "lam": 1.0,
        # Creativity (grpo_weighted_add / grpo_weighted_mul): weight = (same-strategy count) ** -weight_power.
        "weight_power": 0.7,
        "enable_solution_classification": False,  # ask the strategy judge for labels
        "classify_only_correct": True,  # only responses with reward > 0 are grouped; others weigh 1
        "weight_positive_only": False,  # mul: weight positive advantages only
        "judge": {
            "kind": "lexical",  # openai | hf | lexical (no model)
            "model": None,  # openai: chat model name; hf: a local model folder or hub name
            "base_url": None,  # openai: OPENAI_BASE_URL by default
            "max_concurrency": 8,
            "timeout_s": 60.0,
            "max_retries": 3,
        },
    },
    "trainer": {
        "total_training_steps": 20,
        "n_gpus_per_node": 0,
        "nnodes": 1,
        "device": "auto",  # auto | cpu | cuda
        "project_name": "opentinker",
        "experiment_name": "tiny-arithmetic-grpo",
        "logger": ["console"],
        "save_freq": -1,  # steps between checkpoints; -1 = only at the end when a dir is set
        "test_freq": 10,  # steps between validations; -1 = never
        "val_before_train": True,
        "default_local_dir": None,  # where checkpoints go; None = no checkpoints
        "seed": 0,
        "progress_bar": True,
    },
}


class ConfigError(ValueError):
    """A config key or value is invalid; the message names the key."""


def _flat_keys(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(_flat_keys(value, dotted + "."))
        else:
            flat[dotted] = value
    return flat


VALID_KEYS: dict[str, Any] = _flat_keys(DEFAULTS)
_SECTIONS = {key.rsplit(".", 1)[0] for key in VALID_KEYS if "." in key}


def closest_key(key: str) -> str | None:
    """The valid key most similar to ``key`` (or None when nothing is close)."""
    candidates = list(VALID_KEYS)
    leaf = key.rsplit(".", 1)[-1]
    same_leaf = [k for k in candidates if k.rsplit(".", 1)[-1] == leaf]
    if same_leaf:  # the right name in the wrong section
        return same_leaf[0]
    match = difflib.get_close_matches(key, candidates, n=1, cutoff=0.5)
    if match:
        return match[0]
    leaf_matches = difflib.get_close_matches(leaf, [k.rsplit(".", 1)[-1] for k in candidates], n=1)
    if leaf_matches:
        return next(k for k in candidates if k.endswith("." + leaf_matches[0]))
    return None


def _check_key(key: str) -> None:
    if key in VALID_KEYS:
        return
    if key in _SECTIONS:
        raise ConfigError(f"config key '{key}' is a section, not a value; set one of its keys, e.g. "
                          f"'{next(k for k in VALID_KEYS if k.startswith(key + '.'))}'")
    hint = closest_key(key)
    suffix = f"; did you mean '{hint}'?" if hint else ""
    raise ConfigError(f"unknown config key '{key}'{suffix}")


def _check_tree(tree: Mapping[str, Any]) -> None:
    for key, value in _flat_keys(tree).items():
        _check_key(key)


def _parse_override(item: str) -> tuple[str, Any]:
    if "=" not in item:
        raise ConfigError(f"override '{item}' is not of the form key=value")
    key, raw = item.split("=", 1)
    key = key.strip().lstrip("+")
    # YAML scalars: numbers, booleans, null and [lists] parse as in verl's Hydra overrides.
    try:
        value = OmegaConf.to_container(OmegaConf.create(f"v: {raw}"))["v"]
    except Exception:  # not valid YAML (e.g. "a: b"): keep the raw text
        value = raw
    return key, value


def _set_dotted(tree: dict[str, Any], key: str, value: Any) -> None:
    node = tree
    *sections, leaf = key.split(".")
    for section in sections:
        node = node.setdefault(section, {})
    node[leaf] = value


def parse_overrides(items: Iterable[str]) -> dict[str, Any]:
    """``["a.b=1", "c=x"]`` -> nested dict, every key checked against ``DEFAULTS``."""
    tree: dict[str, Any] = {}
    for item in items:
        key, value = _parse_override(item)
        _check_key(key)
        _set_dotted(tree, key, value)
    return tree


def _check_type(key: str, default: Any, value: Any) -> None:
    if default is None or value is None:
        return
    if isinstance(default, bool):
        ok = isinstance(value, bool)
    elif isinstance(default, int):
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif isinstance(default, float):
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    elif isinstance(default, (list, ListConfig)):
        ok = isinstance(value, (list, ListConfig))
    else:
        ok = isinstance(value, type(default))
    if not ok:
        raise ConfigError(f"config key '{key}' expects {type(default).__name__}, got {value!r}")


def expand_dotted(mapping: Mapping[str, Any]) -> dict[str, Any]:
    """``{"a.b": 1, "c": {"d": 2}}`` -> ``{"a": {"b": 1}, "c": {"d": 2}}`` (both forms may mix)."""
    tree: dict[str, Any] = {}
    for key, value in mapping.items():
        if isinstance(value, Mapping):
            value = expand_dotted(value)
        node = tree
        *sections, leaf = str(key).split(".")
        for section in sections:
            node = node.setdefault(section, {})
        if isinstance(value, dict) and isinstance(node.get(leaf), dict):
            node[leaf].update(value)
        else:
            node[leaf] = value
    return tree


def make_config(*overrides: Mapping[str, Any] | Iterable[str] | None) -> DictConfig:
    """Defaults, then each override in order: a mapping (nested and/or dotted keys) or a
    list of ``key=value`` strings."""
    merged = OmegaConf.create(DEFAULTS)
    for override in overrides:
        if override is None:
            continue
        if isinstance(override, Mapping):
            tree = expand_dotted(override)
            _check_tree(tree)
        else:
            tree = parse_overrides(override)
        merged = OmegaConf.merge(merged, tree)
    validate(merged)
    return merged


def _positive(cfg: DictConfig, key: str) -> None:
    value = OmegaConf.select(cfg, key)
    if value is None or value <= 0:
        raise ConfigError(f"config key '{key}' must be > 0, got {value!r}")


def validate(cfg: DictConfig) -> None:
    """Types of every key, then the cross-field rules a run would otherwise trip over late."""
    flat = _flat_keys(OmegaConf.to_container(cfg, resolve=True))
    for key, value in flat.items():
        _check_key(key)
        _check_type(key, VALID_KEYS[key], value)

    for key in (
        "data.train_batch_size",
        "data.val_batch_size",
        "data.max_prompt_length",
        "data.max_response_length",
        "actor_rollout_ref.rollout.n",
        "actor_rollout_ref.actor.ppo_mini_batch_size",
        "actor_rollout_ref.actor.ppo_micro_batch_size",
        "actor_rollout_ref.actor.ppo_epochs",
        "actor_rollout_ref.ref.log_prob_micro_batch_size",
        "actor_rollout_ref.rollout.max_batch_size",
        "actor_rollout_ref.rollout.val_n",
        "trainer.total_training_steps",
    ):
        _positive(cfg, key)
    if cfg.actor_rollout_ref.actor.optim.lr < 0:
        raise ConfigError("config key 'actor_rollout_ref.actor.optim.lr' must be >= 0")

    estimator = cfg.algorithm.adv_estimator
    n = cfg.actor_rollout_ref.rollout.n
    if estimator in ADV_ESTIMATORS_NEEDING_GROUPS and n < 2:
        raise ConfigError(
            f"algorithm.adv_estimator={estimator} compares the samples of one prompt, so it needs "
            f"actor_rollout_ref.rollout.n >= 2 (got {n}); raise rollout.n or use "
            "algorithm.adv_estimator=reinforce_plus_plus"
        )
    mini = cfg.actor_rollout_ref.actor.ppo_mini_batch_size
    if cfg.data.train_batch_size % mini:
        raise ConfigError(
            f"data.train_batch_size ({cfg.data.train_batch_size}) must be a multiple of "
            f"actor_rollout_ref.actor.ppo_mini_batch_size ({mini})"
        )
    if cfg.actor_rollout_ref.rollout.temperature < 0:
        raise ConfigError("config key 'actor_rollout_ref.rollout.temperature' must be >= 0")
    top_p = cfg.actor_rollout_ref.rollout.top_p
    if not 0 < top_p <= 1:
        raise ConfigError(f"config key 'actor_rollout_ref.rollout.top_p' must be in (0, 1], got {top_p}")
    if cfg.actor_rollout_ref.rollout.name not in ("transformers", "vllm"):
        raise ConfigError(
            f"config key 'actor_rollout_ref.rollout.name' must be 'transformers' or 'vllm', "
            f"got {cfg.actor_rollout_ref.rollout.name!r}"
        )
    if cfg.actor_rollout_ref.rollout.val_n > 1 and cfg.actor_rollout_ref.rollout.val_temperature == 0:
        raise ConfigError(
            "actor_rollout_ref.rollout.val_n > 1 needs actor_rollout_ref.rollout.val_temperature > 0 "
            "(greedy samples would all be the same)"
        )
    if cfg.algorithm.judge.kind not in ("openai", "hf", "lexical"):
        raise ConfigError(f"config key 'algorithm.judge.kind' must be openai, hf or lexical, got {cfg.algorithm.judge.kind!r}")
    multi_turn = cfg.actor_rollout_ref.rollout.multi_turn
    for key in ("max_assistant_turns", "max_user_turns", "max_tokens_per_turn"):
        _positive(cfg, f"actor_rollout_ref.rollout.multi_turn.{key}")
    if multi_turn.reward_mode not in ("sum", "last", "score"):
        raise ConfigError(
            "config key 'actor_rollout_ref.rollout.multi_turn.reward_mode' must be sum, last or score, "
            f"got {multi_turn.reward_mode!r}"
        )
    if cfg.trainer.device not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"config key 'trainer.device' must be auto, cpu or cuda, got {cfg.trainer.device!r}")


def to_dotted(cfg: DictConfig) -> dict[str, Any]:
    """The config as flat ``{dotted.key: value}`` (for logging and the wire)."""
    return _flat_keys(OmegaConf.to_container(cfg, resolve=True))
