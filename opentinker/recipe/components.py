"""The recipe's schema: one frozen dataclass per component, each field a config key declared
once with its default, its one-line doc and its checks (``knob``). The attribute paths are
verl's dotted keys (``actor_rollout_ref.actor.optim.lr``), the wire format clients write.

``opentinker config keys`` prints every key from here, and ``docs/config_keys.md`` is generated
from it (a test keeps the page in sync). No torch: the thin client builds specs too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from opentinker.recipe.estimators import BUILTIN_ESTIMATORS
from opentinker.recipe.knobs import knob, section

JobMode = Literal["server", "client"]

INT31 = 2**31 - 1
BATCH = (1, 4096)  # rows, prompts or samples in one batch
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
WARMUP_STYLES = ("constant", "cosine")
STRATEGIES = ("local", "fsdp")


@dataclass(frozen=True)
class DataSpec:
    task: str = knob("arithmetic", "built-in dataset used when the job gives no rows (digit_sum: pictures, for a vision-language model)",
                     choices=("arithmetic", "digit_sum", "word_problems"))
    train_batch_size: int = knob(8, "prompts per step; each is sampled rollout.n times", range=BATCH)
    val_batch_size: int = knob(64, "held-out prompts per validation", range=BATCH)
    max_prompt_length: int = knob(128, "tokens a prompt may take",
                                  range=(1, 32768))
    max_response_length: int = knob(16, "tokens a response may take (in an agent loop: all its turns)",
                                    range=(1, 32768))
    shuffle: bool = knob(True, "shuffle the training rows each epoch")
    seed: int = knob(1, "seed of the shuffle and of the built-in task's problems", range=(0, INT31))


@dataclass(frozen=True)
class ModelSpec:
    path: str | None = knob(None, "model folder, .gguf file or preset; on a server, a served model's name; "
                                  "None: the embedded tiny model")
    use_remove_padding: bool = knob(True, "pack a micro-batch's rows into one row, each sequence attending to its "
                                          "own tokens (engine/backend/packed_attention.py)")
    share_prompt_prefix: bool = knob(True, "run each distinct prompt once and reuse its KV cache for its n samples "
                                           "(same logprobs and gradients)")
    enable_gradient_checkpointing: bool = knob(False, "recompute activations in the backward pass (less memory)")
    trust_remote_code: bool = knob(False, "let transformers run the model folder's own code")
    lora_rank: int = knob(0, "> 0: train rank-r LoRA adapters only (the reference is the base with them off); "
                             "0: every weight", range=(0, 1024))
    lora_alpha: int = knob(16, "LoRA scale numerator (scale = alpha / rank)", range=(0, 4096), above_low=True)
    target_modules: str = knob("all-linear", "LoRA targets: all-linear or comma-separated module names, "
                                             "e.g. q_proj,v_proj")
    train_vision: bool = knob(False, "a vision-language model: train its vision tower too (frozen by default; "
                                     "LoRA adapts the language model only either way)")


@dataclass(frozen=True)
class OptimSpec:
    lr: float = knob(1e-6, "AdamW learning rate", range=(0, 1))
    weight_decay: float = knob(0.01, "AdamW weight decay", range=(0, 10))
    betas: tuple[float, float] = knob([0.9, 0.999], "AdamW betas: two numbers in [0, 1)")
    lr_warmup_steps: int = knob(-1, "steps of linear warm-up; -1: lr_warmup_steps_ratio of the run",
                                range=(-1, 1_000_000))
    lr_warmup_steps_ratio: float = knob(0.0, "warm-up as a fraction of the run's steps", range=(0, 1))
    warmup_style: str = knob("constant", "the lr after warm-up: constant, or a cosine decay to min_lr_ratio",
                             choices=WARMUP_STYLES)
    min_lr_ratio: float = knob(0.0, "cosine: the final lr as a fraction of lr", range=(0, 1))


@dataclass(frozen=True)
class CriticOptimSpec(OptimSpec):
    lr: float = knob(1e-5, "AdamW learning rate of the value model", range=(0, 1))


@dataclass(frozen=True)
class FsdpSpec:
    param_offload: bool = knob(False, "FSDP: keep parameters on the CPU between uses")
    grad_offload: bool = knob(False, "FSDP: keep gradients on the CPU")
    optimizer_offload: bool = knob(False, "FSDP: keep the optimizer state on the CPU")


@dataclass(frozen=True)
class ActorSpec:
    strategy: str = knob("local", "local: one model in this process; fsdp: trainer.nnodes x trainer.n_gpus_per_node "
                                  "FSDP2 ranks as Ray actors (gloo CPU processes with trainer.device=cpu)",
                         choices=STRATEGIES)
    ppo_mini_batch_size: int = knob(8, "prompts per optimizer step (x rollout.n samples), as in verl", range=BATCH)
    ppo_micro_batch_size: int = knob(64, "samples per forward/backward", range=BATCH)
    ppo_epochs: int = knob(1, "passes over a step's samples", range=(1, 32))
    policy_loss: str = knob("vanilla", "the policy loss (registered losses are valid too)",
                            choices=("vanilla", "gspo", "cispo"))
    clip_ratio: float = knob(0.2, "PPO clip range on both sides", range=(0, 10), above_low=True)
    clip_ratio_low: float | None = knob(None, "the lower clip range; None: clip_ratio", range=(0, 10), above_low=True)
    clip_ratio_high: float | None = knob(None, "the upper clip range; None: clip_ratio", range=(0, 10),
                                         above_low=True)
    clip_ratio_c: float = knob(3.0, "dual-clip bound for negative advantages", range=(1, 1000))
    loss_agg_mode: str = knob("token-mean", "how token losses are averaged into the batch loss",
                              choices=LOSS_AGG_MODES)
    entropy_coeff: float = knob(0.0, "weight of the entropy bonus", range=(-10, 10))
    use_kl_loss: bool = knob(False, "add a KL term to the reference policy to the loss")
    kl_loss_coef: float = knob(0.001, "weight of the KL term", range=(0, 1000))
    kl_loss_type: str = knob("low_var_kl", "the KL estimator", choices=("k1", "kl", "abs", "k2", "mse", "k3",
                                                                         "low_var_kl"))
    grad_clip: float = knob(1.0, "gradient-norm clip (a huge value: none)", range=(0, 1e12), above_low=True)
    optim: OptimSpec = section(OptimSpec)
    fsdp_config: FsdpSpec = section(FsdpSpec)


@dataclass(frozen=True)
class RefSpec:
    log_prob_micro_batch_size: int = knob(64, "samples per reference forward", range=BATCH)


@dataclass(frozen=True)
class MultiTurnSpec:
    max_assistant_turns: int = knob(5, "model turns in one episode", range=(1, 64))
    max_user_turns: int = knob(5, "environment turns in one episode", range=(1, 64))
    max_tokens_per_turn: int = knob(64, "tokens one model turn may take (the episode's budget is "
                                        "data.max_response_length)", range=(1, 32768))
    reward_mode: str = knob("sum", "an episode's reward: the sum of its turns', the last one's, or the "
                                   "interaction's calculate_score", choices=("sum", "last", "score"))
    env_error_reward: float | None = knob(None, "None: an episode ended by an env error is left out of the loss and "
                                                "its group (and counted); a number: it gets this reward",
                                          range=(-1e6, 1e6))


@dataclass(frozen=True)
class RolloutSpec:
    name: str = knob("transformers", "the rollout engine", choices=("transformers", "vllm"))
    n: int = knob(8, "samples per prompt", range=(1, 64))
    temperature: float = knob(1.0, "sampling temperature", range=(0, 10))
    top_p: float = knob(1.0, "nucleus sampling mass", range=(0, 1), above_low=True)
    top_k: int = knob(-1, "top-k sampling; -1: off", range=(-1, 1_000_000))
    gpu_memory_utilization: float = knob(0.5, "vllm: the GPU memory fraction it may take", range=(0, 1),
                                         above_low=True)
    tensor_model_parallel_size: int = knob(1, "vllm: GPUs per engine", range=(1, 8))
    replicas: int = knob(1, "vllm: engines", range=(1, 8))
    placement: str = knob("colocated", "vllm: on the training GPUs (asleep during updates) or on GPUs of their own",
                          choices=("colocated", "separate"))
    enable_prefix_caching: bool = knob(True, "vllm: reuse the KV cache of shared prompt prefixes")
    max_model_len: int | None = knob(None, "vllm: longest sequence; None: data.max_prompt_length + "
                                           "data.max_response_length", range=(16, 131072))
    max_batch_size: int = knob(256, "concurrent sequences in one generate call", range=BATCH)
    compile_decode: bool = knob(False, "transformers: decode steps through torch.compile (rollout/compiled_decode.py)",
                                switch=True)
    slot_decode: bool = knob(False, "transformers: per-row KV slots, each decode step on the device, CUDA graphs on "
                                    "a GPU (rollout/slot_decode.py)")
    val_temperature: float = knob(0.0, "validation temperature; 0: greedy", range=(0, 10))
    val_n: int = knob(1, "samples per validation prompt; > 1 (with val_temperature > 0) reports pass@k",
                      range=(1, 64))
    ignore_eos: bool = knob(False, "always generate data.max_response_length tokens (benchmarks)")
    multi_turn: MultiTurnSpec = section(MultiTurnSpec)


@dataclass(frozen=True)
class ActorRolloutRefSpec:
    model: ModelSpec = section(ModelSpec)
    actor: ActorSpec = section(ActorSpec)
    ref: RefSpec = section(RefSpec)
    rollout: RolloutSpec = section(RolloutSpec)


@dataclass(frozen=True)
class CriticModelSpec:
    path: str | None = knob(None, "the value model; None: the actor's; on a server, a served model's name")
    lora_rank: int = knob(0, "> 0: LoRA adapters plus the value head train; 0: every weight", range=(0, 1024))
    lora_alpha: int = knob(16, "LoRA scale numerator (scale = alpha / rank)", range=(0, 4096), above_low=True)
    target_modules: str = knob("all-linear", "LoRA targets: all-linear or comma-separated module names")
    enable_gradient_checkpointing: bool = knob(False, "recompute activations in the backward pass (less memory)")


@dataclass(frozen=True)
class CriticSpec:
    """PPO's value model (algorithm.adv_estimator=gae only): a value head on the actor's model
    (or critic.model.path), trained with the clipped value loss."""

    strategy: str | None = knob(None, "local | fsdp; None: the actor's", choices=STRATEGIES)
    model: CriticModelSpec = section(CriticModelSpec)
    ppo_mini_batch_size: int = knob(8, "prompts per optimizer step (x rollout.n samples)", range=BATCH)
    ppo_micro_batch_size: int = knob(64, "samples per forward/backward", range=BATCH)
    ppo_epochs: int = knob(1, "passes over a step's samples", range=(1, 32))
    cliprange_value: float = knob(0.5, "clip range of the value loss", range=(0, 1e6), above_low=True)
    loss_agg_mode: str = knob("token-mean", "how token losses are averaged into the batch loss",
                              choices=LOSS_AGG_MODES)
    grad_clip: float = knob(1.0, "gradient-norm clip", range=(0, 1e12), above_low=True)
    optim: CriticOptimSpec = section(CriticOptimSpec)


@dataclass(frozen=True)
class RewardSpec:
    timeout_s: float = knob(60.0, "seconds one reward-function call may take; a sample past it is left out of "
                                  "the step with a warning; 0: no deadline", range=(0, 3600))


@dataclass(frozen=True)
class RolloutCorrectionSpec:
    """Importance correction of the gap between the policy that sampled (the rollout engine's
    logprobs) and the one being trained (verl's keys)."""

    rollout_is: str | None = knob(None, "weight by exp(old - rollout) per token or sequence, truncated at "
                                        "rollout_is_threshold; None: off", choices=("token", "sequence"))
    rollout_is_threshold: float = knob(2.0, "the largest importance weight", range=(1, 1e6))
    rollout_rs: str | None = knob(None, "mask tokens or sequences whose ratio leaves "
                                        "[rollout_rs_threshold_lower, rollout_rs_threshold]; None: off",
                                  choices=("token", "sequence", "geometric"))
    rollout_rs_threshold: float | None = knob(None, "the largest ratio kept; required with rollout_rs",
                                              range=(1, 1e6))
    rollout_rs_threshold_lower: float | None = knob(None, "the smallest ratio kept; None: 1 / rollout_rs_threshold",
                                                    range=(0, 1), above_low=True)
    bypass_mode: bool = knob(False, "the rollout's logprobs are the old ones (no recompute; the weights are 1)")


@dataclass(frozen=True)
class JudgeSpec:
    """The strategy judge of the creativity estimators."""

    kind: str = knob("lexical", "openai | hf | lexical (no model)", choices=("openai", "hf", "lexical"))
    model: str | None = knob(None, "openai: a chat model's name; hf: a local model folder")
    base_url: str | None = knob(None, "openai: the API's URL (among those the operator allows); None: "
                                      "OPENAI_BASE_URL")
    max_concurrency: int = knob(8, "judge calls at once", range=(1, 64))
    timeout_s: float = knob(60.0, "seconds one judge call may take", range=(0, 600), above_low=True)
    max_retries: int = knob(3, "retries of a failed judge call", range=(0, 10))


@dataclass(frozen=True)
class AlgorithmSpec:
    adv_estimator: str = knob("grpo", "the advantage estimator (registered estimators are valid too)",
                              choices=BUILTIN_ESTIMATORS)
    norm_adv_by_std_in_grpo: bool = knob(True, "GRPO: divide by the group's reward std")
    gamma: float = knob(1.0, "GAE discount", range=(0, 1))
    lam: float = knob(1.0, "GAE lambda", range=(0, 1))
    weight_power: float = knob(0.7, "creativity: weight = (same-strategy count) ** -weight_power", range=(0, 10))
    enable_solution_classification: bool = knob(False, "creativity: ask the strategy judge for labels")
    classify_only_correct: bool = knob(True, "creativity: group only responses with reward > 0; others weigh 1")
    weight_positive_only: bool = knob(False, "grpo_weighted_mul: weight positive advantages only")
    rollout_correction: RolloutCorrectionSpec = section(RolloutCorrectionSpec)
    judge: JudgeSpec = section(JudgeSpec)


@dataclass(frozen=True)
class AsyncTrainingSpec:
    max_staleness: int = knob(0, "off-policy: the next steps' rollouts run while this step updates, a sample "
                                 "training at most this many policy versions after the one that drew it; "
                                 "0: the synchronous loop", range=(0, 16))


@dataclass(frozen=True)
class TrainerSpec:
    total_training_steps: int = knob(20, "steps of the run", range=(1, 100_000))
    n_gpus_per_node: int = knob(0, "FSDP ranks per node (CPU processes with device=cpu)", range=(0, 64))
    nnodes: int = knob(1, "nodes the FSDP ranks spread over", range=(1, 1024))
    device: str = knob("auto", "auto | cpu | cuda", choices=("auto", "cpu", "cuda"))
    project_name: str = knob("opentinker", "the logger's project")
    experiment_name: str = knob("tiny-arithmetic-grpo", "the logger's run name")
    logger: tuple[str, ...] = knob(["console"], "where metrics go", choices=("console", "wandb"))
    save_freq: int = knob(-1, "steps between checkpoints; -1: only at the end when a dir is set",
                          range=(-1, 100_000))
    test_freq: int = knob(10, "steps between validations; -1: never", range=(-1, 100_000))
    val_before_train: bool = knob(True, "validate before the first step")
    default_local_dir: str | None = knob(None, "where checkpoints go; None: none")
    seed: int = knob(0, "seed of sampling and initialisation", range=(0, INT31))
    progress_bar: bool = knob(True, "show a progress bar")
    env_outage_timeout_s: float = knob(300.0, "seconds a step waits for an unreachable env server before the job "
                                              "fails (the step is then redone); 0: fail at once", range=(0, 3600))
    max_consecutive_empty_steps: int = knob(3, "steps in a row with nothing to train on (the env's own errors) "
                                               "before the job fails", range=(1, 1000))
    resume_mode: str = knob("auto", "auto: continue from the newest checkpoint in default_local_dir; disable; or a "
                                    "global_step_<k> folder's path")
    critic_warmup: int = knob(0, "steps that train only the critic before the actor's updates",
                              range=(0, 100_000))
