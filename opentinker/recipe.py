"""One typed recipe: the training config as frozen dataclasses per component, checked once.

``config.py`` keeps the verl-style dotted keys, their defaults, types, choices and ranges (the
wire format, which clients and verl users write). :class:`RecipeSpec` is the same tree typed: a
dataclass per component (data, model, actor, reference, rollout, critic, reward, algorithm,
asynchronous training, trainer) whose attributes mirror the config's sections, so code written
as ``cfg.actor_rollout_ref.actor.optim.lr`` reads a spec unchanged. :meth:`RecipeSpec.build`
checks every key (``config.validate``) and then every rule that spans keys
(:func:`cross_field_problem`), and is what the client, ``POST /v1/jobs`` and the trainer call:
a combination that cannot run is refused at the door, naming the key, before a job is queued.

No torch: the thin client builds specs too.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from omegaconf import DictConfig, OmegaConf

from opentinker.config import ADV_ESTIMATORS_NEEDING_GROUPS, VALID_KEYS, ConfigError, make_config

__all__ = ["RecipeSpec", "cross_field_problem"]

JobMode = Literal["server", "client"]


@dataclass(frozen=True)
class DataSpec:
    task: str
    train_batch_size: int
    val_batch_size: int
    max_prompt_length: int
    max_response_length: int
    shuffle: bool
    seed: int


@dataclass(frozen=True)
class ModelSpec:
    path: str | None
    use_remove_padding: bool
    share_prompt_prefix: bool
    enable_gradient_checkpointing: bool
    trust_remote_code: bool
    lora_rank: int
    lora_alpha: float
    target_modules: str


@dataclass(frozen=True)
class OptimSpec:
    lr: float
    weight_decay: float
    betas: tuple[float, float]
    lr_warmup_steps: int
    lr_warmup_steps_ratio: float
    warmup_style: str
    min_lr_ratio: float


@dataclass(frozen=True)
class FsdpSpec:
    param_offload: bool
    grad_offload: bool
    optimizer_offload: bool


@dataclass(frozen=True)
class ActorSpec:
    strategy: str
    ppo_mini_batch_size: int
    ppo_micro_batch_size: int
    ppo_epochs: int
    policy_loss: str
    clip_ratio: float
    clip_ratio_low: float | None
    clip_ratio_high: float | None
    clip_ratio_c: float
    loss_agg_mode: str
    entropy_coeff: float
    use_kl_loss: bool
    kl_loss_coef: float
    kl_loss_type: str
    grad_clip: float
    optim: OptimSpec
    fsdp_config: FsdpSpec


@dataclass(frozen=True)
class RefSpec:
    log_prob_micro_batch_size: int


@dataclass(frozen=True)
class MultiTurnSpec:
    max_assistant_turns: int
    max_user_turns: int
    max_tokens_per_turn: int
    reward_mode: str
    env_error_reward: float | None


@dataclass(frozen=True)
class RolloutSpec:
    name: str
    n: int
    temperature: float
    top_p: float
    top_k: int
    gpu_memory_utilization: float
    tensor_model_parallel_size: int
    replicas: int
    placement: str
    enable_prefix_caching: bool
    max_model_len: int | None
    max_batch_size: int
    compile_decode: bool
    slot_decode: bool
    val_temperature: float
    val_n: int
    ignore_eos: bool
    multi_turn: MultiTurnSpec


@dataclass(frozen=True)
class ActorRolloutRefSpec:
    model: ModelSpec
    actor: ActorSpec
    ref: RefSpec
    rollout: RolloutSpec


@dataclass(frozen=True)
class CriticModelSpec:
    path: str | None
    lora_rank: int
    lora_alpha: float
    target_modules: str
    enable_gradient_checkpointing: bool


@dataclass(frozen=True)
class CriticSpec:
    strategy: str | None
    model: CriticModelSpec
    ppo_mini_batch_size: int
    ppo_micro_batch_size: int
    ppo_epochs: int
    cliprange_value: float
    loss_agg_mode: str
    grad_clip: float
    optim: OptimSpec


@dataclass(frozen=True)
class RewardSpec:
    timeout_s: float


@dataclass(frozen=True)
class RolloutCorrectionSpec:
    rollout_is: str | None
    rollout_is_threshold: float
    rollout_rs: str | None
    rollout_rs_threshold: float | None
    rollout_rs_threshold_lower: float | None
    bypass_mode: bool


@dataclass(frozen=True)
class JudgeSpec:
    kind: str
    model: str | None
    base_url: str | None
    max_concurrency: int
    timeout_s: float
    max_retries: int


@dataclass(frozen=True)
class AlgorithmSpec:
    adv_estimator: str
    norm_adv_by_std_in_grpo: bool
    gamma: float
    lam: float
    weight_power: float
    enable_solution_classification: bool
    classify_only_correct: bool
    weight_positive_only: bool
    rollout_correction: RolloutCorrectionSpec
    judge: JudgeSpec


@dataclass(frozen=True)
class AsyncTrainingSpec:
    max_staleness: int


@dataclass(frozen=True)
class TrainerSpec:
    total_training_steps: int
    n_gpus_per_node: int
    nnodes: int
    device: str
    project_name: str
    experiment_name: str
    logger: tuple[str, ...]
    save_freq: int
    test_freq: int
    val_before_train: bool
    default_local_dir: str | None
    seed: int
    progress_bar: bool
    env_outage_timeout_s: float
    max_consecutive_empty_steps: int
    resume_mode: str
    critic_warmup: int


@dataclass(frozen=True)
class RecipeSpec:
    """A whole training recipe; attribute paths are the config's dotted keys."""

    data: DataSpec
    actor_rollout_ref: ActorRolloutRefSpec
    critic: CriticSpec
    reward_model: RewardSpec
    algorithm: AlgorithmSpec
    async_training: AsyncTrainingSpec
    trainer: TrainerSpec
    mode: JobMode = field(default="server", compare=False)  # how the job gets its batches

    @classmethod
    def build(cls, *overrides: Mapping[str, Any] | None, limits: Mapping[str, float] | None = None,
              mode: JobMode = "server", gpus: bool | None = None) -> RecipeSpec:
        """The spec of ``overrides`` (nested or dotted, applied in order over the defaults):
        every key checked (ConfigError naming it), then every cross-field rule. ``gpus``: whether
        the machine that will train has GPUs (None: unknown, e.g. on a client)."""
        return cls.from_config(make_config(*overrides, limits=limits), mode=mode, gpus=gpus)

    @classmethod
    def from_config(cls, cfg: DictConfig | Mapping[str, Any], *, mode: JobMode = "server",
                    gpus: bool | None = None) -> RecipeSpec:
        """The spec of a config already checked key by key (``make_config``), with the
        cross-field rules applied; ConfigError naming the key when one fails."""
        tree = OmegaConf.to_container(cfg, resolve=False) if isinstance(cfg, DictConfig) else dict(cfg)
        spec = _typed(cls, {**tree, "mode": mode})
        problem = cross_field_problem(spec, gpus=gpus)
        if problem is not None:
            key, message = problem
            raise ConfigError(message, key=key)
        return spec

    def to_tree(self) -> dict[str, Any]:
        """The spec as the config's nested dict (lists where the config has them)."""
        tree: dict[str, Any] = {}
        for key, value in self.to_dotted().items():
            node = tree
            *sections, leaf = key.split(".")
            for section in sections:
                node = node.setdefault(section, {})
            node[leaf] = value
        return tree

    def replaced(self, key: str, value: Any) -> RecipeSpec:
        """A copy with the dotted ``key`` set to ``value`` (not checked again: for values the
        server sets itself, e.g. where a job resumes from)."""
        section, _, rest = key.partition(".")
        if not rest:
            return dataclasses.replace(self, **{section: value})
        return dataclasses.replace(self, **{section: _replaced(getattr(self, section), rest, value)})

    def to_dotted(self) -> dict[str, Any]:
        """The spec as the wire's flat ``{dotted.key: value}`` (lists where the config has them)."""
        flat: dict[str, Any] = {}

        def walk(node: Any, prefix: str) -> None:
            for item in dataclasses.fields(node):
                if item.name == "mode" and prefix == "":
                    continue
                value = getattr(node, item.name)
                if dataclasses.is_dataclass(value):
                    walk(value, f"{prefix}{item.name}.")
                else:
                    flat[f"{prefix}{item.name}"] = list(value) if isinstance(value, tuple) else value

        walk(self, "")
        return flat


def _replaced(node: Any, key: str, value: Any) -> Any:
    name, _, rest = key.partition(".")
    if not hasattr(node, name):
        raise KeyError(f"no config key {key!r} here")
    return dataclasses.replace(node, **{name: _replaced(getattr(node, name), rest, value) if rest else value})


def _typed(cls: type, tree: Mapping[str, Any]) -> Any:
    """``cls`` (a spec dataclass) from its section of the config tree; lists become tuples."""
    values = {}
    for item in dataclasses.fields(cls):
        if item.name not in tree:
            continue  # only ``mode`` has a default
        value = tree[item.name]
        kind = item.type if isinstance(item.type, type) else _SPECS.get(item.type)
        if kind is not None and dataclasses.is_dataclass(kind):
            value = _typed(kind, value)
        elif isinstance(value, list):
            value = tuple(value)
        values[item.name] = value
    return cls(**values)


_SPECS = {cls.__name__: cls for cls in (
    DataSpec, ModelSpec, OptimSpec, FsdpSpec, ActorSpec, RefSpec, MultiTurnSpec, RolloutSpec, ActorRolloutRefSpec,
    CriticModelSpec, CriticSpec, RewardSpec, RolloutCorrectionSpec, JudgeSpec, AlgorithmSpec, AsyncTrainingSpec,
    TrainerSpec)}


def spec_keys() -> set[str]:
    """Every dotted key a spec has (a test keeps it equal to ``config.VALID_KEYS``)."""
    keys: set[str] = set()

    def walk(cls: type, prefix: str) -> None:
        for item in dataclasses.fields(cls):
            kind = _SPECS.get(item.type) if isinstance(item.type, str) else item.type
            if kind is not None and dataclasses.is_dataclass(kind):
                walk(kind, f"{prefix}{item.name}.")
            elif not (cls is RecipeSpec and item.name == "mode"):
                keys.add(f"{prefix}{item.name}")

    walk(RecipeSpec, "")
    return keys


def cross_field_problem(spec: RecipeSpec, gpus: bool | None = None) -> tuple[str, str] | None:
    """The first rule spanning several keys that ``spec`` breaks: ``(the key to change, a message
    naming the keys)``, or None."""
    data, ar, trainer = spec.data, spec.actor_rollout_ref, spec.trainer
    rollout, actor = ar.rollout, ar.actor
    estimator = spec.algorithm.adv_estimator
    if estimator in ADV_ESTIMATORS_NEEDING_GROUPS and rollout.n < 2:
        return "actor_rollout_ref.rollout.n", (f"algorithm.adv_estimator={estimator} compares the samples of one prompt, so it needs "
                f"actor_rollout_ref.rollout.n >= 2 (got {rollout.n}); raise rollout.n or use "
                "algorithm.adv_estimator=reinforce_plus_plus")
    if data.train_batch_size % actor.ppo_mini_batch_size:
        return "data.train_batch_size", (f"data.train_batch_size ({data.train_batch_size}) must be a multiple of "
                f"actor_rollout_ref.actor.ppo_mini_batch_size ({actor.ppo_mini_batch_size})")
    if rollout.compile_decode and rollout.slot_decode:
        return "actor_rollout_ref.rollout.slot_decode", ("actor_rollout_ref.rollout.compile_decode and "
                "actor_rollout_ref.rollout.slot_decode are two decode loops: set one of them")
    if rollout.val_n > 1 and rollout.val_temperature == 0:
        return "actor_rollout_ref.rollout.val_temperature", ("actor_rollout_ref.rollout.val_n > 1 needs actor_rollout_ref.rollout.val_temperature > 0 "
                "(greedy samples would all be the same)")
    if actor.strategy == "fsdp" and trainer.n_gpus_per_node < 1:
        return "trainer.n_gpus_per_node", ("actor_rollout_ref.actor.strategy=fsdp needs trainer.n_gpus_per_node >= 1 (ranks per node; with "
                "trainer.device=cpu, CPU processes)")
    if trainer.nnodes > 1 and actor.strategy != "fsdp":
        return "trainer.nnodes", (f"trainer.nnodes={trainer.nnodes} spreads FSDP ranks over nodes: it needs "
                "actor_rollout_ref.actor.strategy=fsdp")
    correction = spec.algorithm.rollout_correction
    if correction.rollout_rs is not None and correction.rollout_rs_threshold is None:
        return "algorithm.rollout_correction.rollout_rs_threshold", (f"algorithm.rollout_correction.rollout_rs={correction.rollout_rs} needs "
                "algorithm.rollout_correction.rollout_rs_threshold (the largest ratio kept, e.g. 2.0)")
    for key, betas in (("actor_rollout_ref.actor.optim.betas", actor.optim.betas),
                       ("critic.optim.betas", spec.critic.optim.betas)):
        if len(betas) != 2 or not all(isinstance(b, (int, float)) and not isinstance(b, bool) and 0 <= b < 1
                                      for b in betas):
            return key, f"config key '{key}' must be two numbers in [0, 1), got {list(betas)}"
    needed = data.max_prompt_length + data.max_response_length
    if rollout.max_model_len is not None and rollout.max_model_len < needed:
        return "actor_rollout_ref.rollout.max_model_len", (f"actor_rollout_ref.rollout.max_model_len ({rollout.max_model_len}) is shorter than "
                f"data.max_prompt_length + data.max_response_length ({needed}): a full sample would not fit")
    staleness = spec.async_training.max_staleness
    if staleness and spec.mode == "client":
        return "async_training.max_staleness", ("async_training.max_staleness > 0 draws each step's prompts ahead of the step, which a client-mode "
                "job cannot (its batches come one at a time): use mode='server' (the dataset uploaded with the "
                "job) or max_staleness=0")
    on_gpu = trainer.device == "cuda" or (trainer.device == "auto" and gpus is True)
    if staleness and rollout.name == "vllm" and rollout.placement == "colocated" and on_gpu:
        return "actor_rollout_ref.rollout.placement", ("async_training.max_staleness > 0 with vLLM on a GPU needs actor_rollout_ref.rollout.placement="
                "separate (a colocated engine sleeps while the update runs; an asynchronous one keeps generating)")
    return None


assert spec_keys() == set(VALID_KEYS), "RecipeSpec and config.DEFAULTS must name the same keys"
