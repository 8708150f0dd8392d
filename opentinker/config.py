"""Typed training config with verl-style dotted keys.

One tree of defaults (``DEFAULTS``) is the single source of truth: every valid key is a
key of that tree, so an override such as ``actor_rollout_ref.actor.optim.lr=1e-5`` is
checked against it, and a typo is an error naming the bad key and the closest valid one.
Values are checked too: types (``TYPES`` where the default is None), named choices
(``CHOICES``, with the closest valid value) and numeric ranges (``RANGES``, whose upper
bounds a server operator may lower or raise with ``limits``). Values are plain data:
OmegaConf's ``${...}`` interpolation and resolvers are refused, so a config can never read
the environment or other keys of the machine that resolves it.
No torch here: the client validates configs before sending them.
"""

from __future__ import annotations

import difflib
import math
import re
from collections.abc import Iterable, Iterator, Mapping
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
            # Pack each micro-batch's rows into one row without padding, each sequence's attention
            # its own (engine/backend/packed_attention.py: varlen flash on GPU, sdpa per sequence on CPU).
            "use_remove_padding": True,
            # Run each distinct prompt once and reuse its KV cache for its n samples (same
            # logprobs and gradients). With both on, each micro-batch takes whichever computes
            # fewer tokens: the prompts once (long prompts, short responses) or the packed row.
            "share_prompt_prefix": True,
            "enable_gradient_checkpointing": False,
            "trust_remote_code": False,
            # LoRA (peft): > 0 trains rank-r adapters only; the reference policy is the base
            # model with them disabled, and weight sync and exports are merged.
            "lora_rank": 0,
            "lora_alpha": 16,
            "target_modules": "all-linear",  # or comma-separated module names, e.g. "q_proj,v_proj"
        },
        "actor": {
            # local: one model in this process; fsdp: trainer.nnodes x trainer.n_gpus_per_node FSDP2
            # ranks as Ray actors (with trainer.device=cpu, that many CPU processes on gloo)
            "strategy": "local",
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
            # vllm: engines x GPUs each, on the training GPUs (asleep during updates) or after them.
            "tensor_model_parallel_size": 1,
            "replicas": 1,
            "placement": "colocated",  # colocated | separate
            "enable_prefix_caching": True,
            "max_model_len": None,  # vllm: None = data.max_prompt_length + data.max_response_length
            "max_batch_size": 256,  # concurrent sequences in one generate call
            # transformers engine: decode steps through torch.compile (one graph per run, cached
            # on disk); false: the eager step (debugging). See rollout/compiled_decode.py.
            "compile_decode": False,
            # transformers engine: per-row KV slots, each decode step on the device, CUDA graphs on
            # a GPU (rollout/slot_decode.py); not with compile_decode.
            "slot_decode": False,
            "val_temperature": 0.0,  # greedy validation
            "val_n": 1,  # samples per validation prompt; > 1 (with val_temperature > 0) reports pass@k
            "ignore_eos": False,  # always generate data.max_response_length tokens (benchmarks)
            "multi_turn": {  # agent loops; the total response budget is data.max_response_length
                "max_assistant_turns": 5,
                "max_user_turns": 5,
                "max_tokens_per_turn": 64,
                "reward_mode": "sum",  # sum | last | score (the interaction's calculate_score)
                # None: a trajectory ended by an environment error is left out of the loss and
                # of its group's statistics (and counted); a number: it gets this reward.
                "env_error_reward": None,
            },
        },
    },
    # PPO's value model (algorithm.adv_estimator=gae only; verl's keys): a value head on the
    # actor's model (or critic.model.path), trained with the clipped value loss.
    "critic": {
        "strategy": None,  # None: the actor's (local | fsdp, on the same ranks setting)
        "model": {
            "path": None,  # None: the actor's model; on a server, a served model's name
            "lora_rank": 0,  # > 0: LoRA adapters plus the value head train; 0: every weight
            "lora_alpha": 16,
            "target_modules": "all-linear",
            "enable_gradient_checkpointing": False,
        },
        "ppo_mini_batch_size": 8,  # in prompts (x rollout.n samples), as the actor's
        "ppo_micro_batch_size": 64,  # in samples
        "ppo_epochs": 1,
        "cliprange_value": 0.5,
        "loss_agg_mode": "token-mean",
        "grad_clip": 1.0,
        "optim": {
            "lr": 1e-5,
            "weight_decay": 0.01,
            "betas": [0.9, 0.999],
            "lr_warmup_steps": -1,  # -1: use lr_warmup_steps_ratio
            "lr_warmup_steps_ratio": 0.0,
            "warmup_style": "constant",
            "min_lr_ratio": 0.0,
        },
    },
    "reward_model": {
        # Seconds one reward-function call may take (single-turn tasks); a sample whose call
        # runs longer is left out of the step, like one whose env failed, with a warning naming
        # the function. 0: no deadline.
        "timeout_s": 60.0,
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
        # Importance correction of the gap between the policy that sampled (the rollout engine's
        # logprobs) and the one being trained (verl's keys): weights exp(old - rollout), token
        # or sequence level, truncated at rollout_is_threshold (rollout_is), and/or tokens or
        # sequences whose ratio leaves [rollout_rs_threshold_lower, rollout_rs_threshold]
        # masked out of the loss (rollout_rs). bypass_mode: the rollout's logprobs are the old
        # ones (no recompute; the weights are then 1).
        "rollout_correction": {
            "rollout_is": None,  # None | token | sequence
            "rollout_is_threshold": 2.0,
            "rollout_rs": None,  # None | token | sequence | geometric
            "rollout_rs_threshold": None,  # upper bound of the ratio kept; required with rollout_rs
            "rollout_rs_threshold_lower": None,  # None: 1 / rollout_rs_threshold
            "bypass_mode": False,
        },
        "judge": {
            "kind": "lexical",  # openai | hf | lexical (no model)
            "model": None,  # openai: chat model name; hf: a local model folder or hub name
            "base_url": None,  # openai: OPENAI_BASE_URL by default
            "max_concurrency": 8,
            "timeout_s": 60.0,
            "max_retries": 3,
        },
    },
    # Off-policy asynchronous training (verl's one-step-off-policy / fully-async trainers): the
    # rollouts of the next max_staleness steps run in their own process while this step
    # updates; a sample trains at most max_staleness policy versions after the one that drew it.
    # 0: the synchronous loop.
    "async_training": {
        "max_staleness": 0,
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
        # A step with nothing to train on because an env server could not be reached
        # (connection refused, timeout, 502/503/504) is redone once its /health answers; the
        # job fails after waiting this long for it (seconds; 0 = fail at once).
        "env_outage_timeout_s": 300.0,
        # A step with nothing to train on though its env servers answer (errors of the env's
        # own, e.g. HTTP 500; prompts too long) is skipped and counted; this many in a row
        # fail the job, naming the env error.
        "max_consecutive_empty_steps": 3,
        # auto: continue from the newest checkpoint in default_local_dir, if any; disable;
        # or the path of a global_step_<k> folder (verl's key)
        "resume_mode": "auto",
        # With a critic: steps that train only the critic before the actor's updates begin.
        "critic_warmup": 0,
    },
}


class ConfigError(ValueError):
    """A config key or value is invalid; the message names the key, and ``key`` is it (the dotted
    key; None when no single key is at fault)."""

    def __init__(self, message: str, key: str | None = None):
        super().__init__(message)
        if key is None:  # the per-key checks say "config key '<key>'"
            named = re.search(r"config key '([A-Za-z0-9_.]+)'", message)
            key = named.group(1) if named else None
        self.key = key

    def __reduce__(self):  # the key survives pickling (a runner's error crossing to the server)
        return (type(self), (str(self), self.key))


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

#: The type of each key whose default is None (the others take their default's type).
TYPES: dict[str, type] = {
    "actor_rollout_ref.model.path": str,
    "actor_rollout_ref.actor.clip_ratio_low": float,
    "actor_rollout_ref.actor.clip_ratio_high": float,
    "actor_rollout_ref.rollout.multi_turn.env_error_reward": float,
    "actor_rollout_ref.rollout.max_model_len": int,
    "algorithm.judge.model": str,
    "algorithm.judge.base_url": str,
    "trainer.default_local_dir": str,
    "critic.strategy": str,
    "critic.model.path": str,
    "algorithm.rollout_correction.rollout_is": str,
    "algorithm.rollout_correction.rollout_rs": str,
    "algorithm.rollout_correction.rollout_rs_threshold": float,
    "algorithm.rollout_correction.rollout_rs_threshold_lower": float,
}

#: Keys whose value is one of a few names (for a list-valued key: each item). Registries of
#: the engine add the names registered there (``register_choice``), so a custom advantage
#: estimator or policy loss registered in-process is a valid value too.
CHOICES: dict[str, list[str]] = {
    "data.task": ["arithmetic", "word_problems"],
    "actor_rollout_ref.actor.strategy": ["local", "fsdp"],
    "actor_rollout_ref.actor.policy_loss": ["vanilla", "gspo", "cispo"],
    "actor_rollout_ref.actor.loss_agg_mode": [
        "token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm",
    ],
    "actor_rollout_ref.actor.kl_loss_type": ["k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl"],
    "actor_rollout_ref.actor.optim.warmup_style": ["constant", "cosine"],
    "critic.strategy": ["local", "fsdp"],
    "critic.loss_agg_mode": [
        "token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm",
    ],
    "critic.optim.warmup_style": ["constant", "cosine"],
    "actor_rollout_ref.rollout.name": ["transformers", "vllm"],
    "actor_rollout_ref.rollout.placement": ["colocated", "separate"],
    "actor_rollout_ref.rollout.multi_turn.reward_mode": ["sum", "last", "score"],
    "algorithm.adv_estimator": [
        "gae", "grpo", "grpo_weighted_add", "grpo_weighted_mul", "rloo",
        "reinforce_plus_plus", "reinforce_plus_plus_baseline",
    ],
    "algorithm.judge.kind": ["openai", "hf", "lexical"],
    "algorithm.rollout_correction.rollout_is": ["token", "sequence"],
    "algorithm.rollout_correction.rollout_rs": ["token", "sequence", "geometric"],
    "trainer.device": ["auto", "cpu", "cuda"],
    "trainer.logger": ["console", "wandb"],
}

_INT31 = 2**31 - 1

#: Boolean keys whose cost the client does not pay (compile_decode: a compile of 8-34 s of CPU
#: in every rollout process). An operator turns one off with ``limits={key: 0}``
#: (``opentinker-server serve --limit KEY=0``); a job that asks for it then gets a ConfigError.
SWITCHES: tuple[str, ...] = ("actor_rollout_ref.rollout.compile_decode",)

#: ``key: (low, high)``, both inclusive (None: no bound on that side). The upper bounds are
#: sanity limits a server operator may change (``limits=`` of :func:`make_config`); keys in
#: ``_ABOVE_LOW`` must be strictly greater than their low bound.
RANGES: dict[str, tuple[float | None, float | None]] = {
    "data.train_batch_size": (1, 4096),
    "data.val_batch_size": (1, 4096),
    "data.max_prompt_length": (1, 32768),
    "data.max_response_length": (1, 32768),
    "data.seed": (0, _INT31),
    "actor_rollout_ref.model.lora_rank": (0, 1024),
    "actor_rollout_ref.model.lora_alpha": (0, 4096),
    "actor_rollout_ref.actor.ppo_mini_batch_size": (1, 4096),
    "actor_rollout_ref.actor.ppo_micro_batch_size": (1, 4096),
    "actor_rollout_ref.actor.ppo_epochs": (1, 32),
    "actor_rollout_ref.actor.clip_ratio": (0, 10),
    "actor_rollout_ref.actor.clip_ratio_low": (0, 10),
    "actor_rollout_ref.actor.clip_ratio_high": (0, 10),
    "actor_rollout_ref.actor.clip_ratio_c": (1, 1000),
    "actor_rollout_ref.actor.entropy_coeff": (-10, 10),
    "actor_rollout_ref.actor.kl_loss_coef": (0, 1000),
    "actor_rollout_ref.actor.grad_clip": (0, 1e12),  # a huge value: no clipping in effect
    "actor_rollout_ref.actor.optim.lr": (0, 1),
    "actor_rollout_ref.actor.optim.weight_decay": (0, 10),
    "actor_rollout_ref.actor.optim.lr_warmup_steps": (-1, 1_000_000),
    "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio": (0, 1),
    "actor_rollout_ref.actor.optim.min_lr_ratio": (0, 1),
    "actor_rollout_ref.ref.log_prob_micro_batch_size": (1, 4096),
    "actor_rollout_ref.rollout.n": (1, 64),
    "actor_rollout_ref.rollout.temperature": (0, 10),
    "actor_rollout_ref.rollout.top_p": (0, 1),
    "actor_rollout_ref.rollout.top_k": (-1, 1_000_000),
    "actor_rollout_ref.rollout.gpu_memory_utilization": (0, 1),
    "actor_rollout_ref.rollout.max_batch_size": (1, 4096),
    "actor_rollout_ref.rollout.tensor_model_parallel_size": (1, 8),
    "actor_rollout_ref.rollout.replicas": (1, 8),
    "actor_rollout_ref.rollout.max_model_len": (16, 131072),
    "actor_rollout_ref.rollout.val_temperature": (0, 10),
    "actor_rollout_ref.rollout.val_n": (1, 64),
    "actor_rollout_ref.rollout.multi_turn.max_assistant_turns": (1, 64),
    "actor_rollout_ref.rollout.multi_turn.max_user_turns": (1, 64),
    "actor_rollout_ref.rollout.multi_turn.max_tokens_per_turn": (1, 32768),
    "actor_rollout_ref.rollout.multi_turn.env_error_reward": (-1e6, 1e6),
    "critic.model.lora_rank": (0, 1024),
    "critic.model.lora_alpha": (0, 4096),
    "critic.ppo_mini_batch_size": (1, 4096),
    "critic.ppo_micro_batch_size": (1, 4096),
    "critic.ppo_epochs": (1, 32),
    "critic.cliprange_value": (0, 1e6),
    "critic.grad_clip": (0, 1e12),
    "critic.optim.lr": (0, 1),
    "critic.optim.weight_decay": (0, 10),
    "critic.optim.lr_warmup_steps": (-1, 1_000_000),
    "critic.optim.lr_warmup_steps_ratio": (0, 1),
    "critic.optim.min_lr_ratio": (0, 1),
    "trainer.critic_warmup": (0, 100_000),
    "reward_model.timeout_s": (0, 3600),
    "algorithm.gamma": (0, 1),
    "algorithm.lam": (0, 1),
    "algorithm.weight_power": (0, 10),
    "algorithm.judge.max_concurrency": (1, 64),
    "algorithm.judge.timeout_s": (0, 600),
    "algorithm.judge.max_retries": (0, 10),
    "algorithm.rollout_correction.rollout_is_threshold": (1, 1e6),
    "algorithm.rollout_correction.rollout_rs_threshold": (1, 1e6),
    "algorithm.rollout_correction.rollout_rs_threshold_lower": (0, 1),
    "async_training.max_staleness": (0, 16),
    "trainer.total_training_steps": (1, 100_000),
    "trainer.n_gpus_per_node": (0, 64),
    "trainer.nnodes": (1, 1024),
    "trainer.save_freq": (-1, 100_000),
    "trainer.test_freq": (-1, 100_000),
    "trainer.seed": (0, _INT31),
    "trainer.max_consecutive_empty_steps": (1, 1000),
    "trainer.env_outage_timeout_s": (0, 3600),  # a job holds its GPUs while it waits
}
_ABOVE_LOW = {
    "actor_rollout_ref.model.lora_alpha",
    "actor_rollout_ref.actor.clip_ratio",
    "actor_rollout_ref.actor.clip_ratio_low",
    "actor_rollout_ref.actor.clip_ratio_high",
    "actor_rollout_ref.actor.grad_clip",
    "critic.model.lora_alpha",
    "critic.cliprange_value",
    "critic.grad_clip",
    "actor_rollout_ref.rollout.top_p",
    "actor_rollout_ref.rollout.gpu_memory_utilization",
    "algorithm.judge.timeout_s",
    "algorithm.rollout_correction.rollout_rs_threshold_lower",
}
MAX_STRING_CHARS = 1024  # any string value
MAX_LIST_ITEMS = 16  # any list value


def register_choice(key: str, name: str) -> None:
    """Make ``name`` a valid value of ``key`` (called by the engine's registries)."""
    names = CHOICES[key]
    if name not in names:
        names.append(name)


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


def _check_plain(key: str, value: Any) -> None:
    """No interpolation: ``${...}`` would let OmegaConf read environment variables (``oc.env``)
    or other keys when the config is resolved, on whatever machine resolves it."""
    if isinstance(value, str) and "${" in value:
        raise ConfigError(
            f"config key '{key}': '${{...}}' interpolation is not supported; give a plain value"
        )
    if isinstance(value, (list, tuple, ListConfig)):
        for item in value:
            _check_plain(key, item)


def _check_tree(tree: Mapping[str, Any]) -> None:
    for key, value in _flat_keys(tree).items():
        _check_key(key)
        _check_plain(key, value)


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
        _check_plain(key, value)
        _set_dotted(tree, key, value)
    return tree


def _type_ok(expected: Any, value: Any) -> bool:
    if expected is bool:
        return isinstance(value, bool)
    if expected is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if expected is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if expected is list:
        return isinstance(value, (list, ListConfig))
    return isinstance(value, expected)


def _check_type(key: str, default: Any, value: Any) -> None:
    expected = TYPES.get(key) or (type(default) if default is not None else None)
    if expected is ListConfig:
        expected = list
    if value is None:
        # null is a value only where it is the default (and so means something); elsewhere it
        # would reach the trainer as a number or name that is not there.
        if default is None:
            return
        raise ConfigError(f"config key '{key}' expects {expected.__name__}, got null (only keys whose default "
                          f"is null accept null; leave the key out for its default, {default!r})")
    if expected is None:
        return
    if not _type_ok(expected, value):
        raise ConfigError(f"config key '{key}' expects {expected.__name__}, got {value!r}")
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"config key '{key}' must be a finite number, got {value!r}")
    if isinstance(value, str) and len(value) > MAX_STRING_CHARS:
        raise ConfigError(f"config key '{key}': at most {MAX_STRING_CHARS} characters, got {len(value)}")
    if isinstance(value, (list, ListConfig)) and len(value) > MAX_LIST_ITEMS:
        raise ConfigError(f"config key '{key}': at most {MAX_LIST_ITEMS} items, got {len(value)}")


def _check_choice(key: str, value: Any) -> None:
    names = CHOICES.get(key)
    if names is None or value is None:
        return
    for item in value if isinstance(value, (list, ListConfig)) else [value]:
        if item not in names:
            close = difflib.get_close_matches(str(item), names, n=1, cutoff=0.5)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            raise ConfigError(f"config key '{key}': unknown value {item!r}{hint} (valid: {', '.join(names)})")


def _bound_text(low: float | None, high: float | None, above_low: bool) -> str:
    parts = []
    if low is not None:
        parts.append(f"{'>' if above_low else '>='} {low:g}")
    if high is not None:
        parts.append(f"<= {high:g}")
    return " and ".join(parts)


def _check_range(key: str, value: Any, limits: Mapping[str, float]) -> None:
    if key in SWITCHES:
        if value is True and limits.get(key, 1) < 1:
            raise ConfigError(f"config key '{key}' is turned off on this server (a limit of this server); "
                              "leave it out or set it to false")
        return
    if key not in RANGES or value is None or isinstance(value, bool):
        return
    low, high = RANGES[key]
    high = limits.get(key, high)
    above_low = key in _ABOVE_LOW
    too_low = low is not None and (value <= low if above_low else value < low)
    too_high = high is not None and value > high
    if too_low or too_high:
        where = " (a limit of this server)" if too_high and key in limits else ""
        raise ConfigError(f"config key '{key}' must be {_bound_text(low, high, above_low)}{where}, got {value!r}")


def check_limits(limits: Mapping[str, float]) -> dict[str, float]:
    """Operator limits as ``{key: upper bound}``; raises ConfigError for a key without a range."""
    checked = {}
    for key, high in limits.items():
        if key in SWITCHES and float(high) not in (0.0, 1.0):
            raise ConfigError(f"config key '{key}' is a switch: its limit is 0 (off) or 1 (allowed), got {high!r}")
        if key not in RANGES and key not in SWITCHES:
            _check_key(key)
            raise ConfigError(f"config key '{key}' has no numeric range to limit; limitable: "
                              f"{', '.join([*RANGES, *SWITCHES])}")
        checked[key] = float(high)
    return checked


def _leaves(mapping: Mapping[str, Any], path: tuple[str, ...] = (), keys: tuple[str, ...] = ()
            ) -> Iterator[tuple[tuple[str, ...], tuple[str, ...], Any]]:
    """``(dotted path, keys as written from the top, value)`` of each value under ``mapping``
    (an empty mapping is one: an empty section)."""
    for key, value in mapping.items():
        here, written = (*path, *str(key).split(".")), (*keys, str(key))
        if isinstance(value, Mapping) and value:
            yield from _leaves(value, here, written)
        else:
            yield here, written, value


def _given_twice(path: tuple[str, ...], first: tuple[bool, tuple[str, ...]], then: tuple[bool, tuple[str, ...]]
                 ) -> ConfigError:
    """The error for a key placed twice; ``first``/``then``: (as a section, the keys written)."""
    key = ".".join(path)

    def spelled(keys: tuple[str, ...]) -> str:
        return "".join(f"[{k!r}]" for k in keys)

    if first[0] == then[0]:  # two values (two sections merge)
        return ConfigError(f"config key '{key}' is given twice, as {spelled(first[1])} and as {spelled(then[1])}; "
                           "give it once", key=key)
    as_value, as_section = (first, then) if then[0] else (then, first)
    return ConfigError(f"config key '{key}' is given both as a value ({spelled(as_value[1])}) and as a section "
                       f"({spelled(as_section[1])}); give it one way", key=key)


def expand_dotted(mapping: Mapping[str, Any]) -> dict[str, Any]:
    """``{"a.b": 1, "c": {"d": 2}}`` -> ``{"a": {"b": 1}, "c": {"d": 2}}`` (both forms may mix).

    Each key is given once: the same key spelled twice in ``mapping`` (dotted and nested, two
    dotted spellings, a value where a section is) is a ConfigError naming the key and both
    spellings, never a silent pick of one. Different keys of a section may be given either
    way (``{"a": {"b": 1}, "a.c": 2}``); separate overrides (``make_config``'s) still stack."""
    placed: dict[tuple[str, ...], tuple[bool, tuple[str, ...]]] = {}  # path -> (a section?, keys first written)
    tree: dict[str, Any] = {}
    for path, keys, value in _leaves(mapping):
        section = isinstance(value, Mapping)  # an empty one
        for depth in range(1, len(path) + 1):
            here, now = path[:depth], (section or depth < len(path), keys)
            before = placed.setdefault(here, now)
            if before is not now and not (before[0] and now[0]):  # only sections may meet
                raise _given_twice(here, before, now)
        node = tree
        for part in path[:-1]:
            node = node.setdefault(part, {})
        if section:
            node.setdefault(path[-1], {})
        else:
            node[path[-1]] = value
    return tree


def flatten(overrides: Mapping[str, Any]) -> dict[str, Any]:
    """Nested and/or dotted overrides as flat ``{dotted.key: value}`` (keys not checked)."""
    return _flat_keys(expand_dotted(overrides))


def make_config(
    *overrides: Mapping[str, Any] | Iterable[str] | None, limits: Mapping[str, float] | None = None
) -> DictConfig:
    """Defaults, then each override in order: a mapping (nested and/or dotted keys) or a
    list of ``key=value`` strings. ``limits`` replaces upper bounds of ``RANGES``."""
    merged = OmegaConf.create(DEFAULTS)
    for override in overrides:
        if override is None:
            continue
        if isinstance(override, Mapping):
            tree = expand_dotted(override)
            _check_tree(tree)
        else:
            tree = parse_overrides(override)
        try:
            merged = OmegaConf.merge(merged, tree)
        except Exception as exc:  # OmegaConf refuses some value shapes (e.g. a dict for a list)
            raise ConfigError(f"config: {exc}") from exc
    validate(merged, limits)
    return merged


def validate(cfg: DictConfig, limits: Mapping[str, float] | None = None) -> None:
    """Types, choices and ranges of every key, then the cross-field rules a run would
    otherwise trip over late (``recipe.cross_field_problem``)."""
    limits = dict(limits or {})
    # resolve=False: never evaluate an interpolation, even one that slipped past the checks.
    flat = _flat_keys(OmegaConf.to_container(cfg, resolve=False))
    for key, value in flat.items():
        _check_key(key)
        _check_plain(key, value)
        _check_type(key, VALID_KEYS[key], value)
        _check_choice(key, value)
        _check_range(key, value, limits)

    # The rules that span keys are the typed recipe's (one place for them; it imports this module).
    from opentinker.recipe import RecipeSpec

    RecipeSpec.from_config(cfg)


def to_dotted(cfg: DictConfig) -> dict[str, Any]:
    """The config as flat ``{dotted.key: value}`` (for logging and the wire)."""
    return _flat_keys(OmegaConf.to_container(cfg, resolve=False))
