"""Seconds per GRPO step: opentinker's RLTrainer vs TRL's GRPOTrainer, same model, same work.

Both trainers run in this one process, on CPU in float32 (``--device cuda``: on a GPU, fp32
weights under bf16 autocast for both), with the same settings:

* the same tiny model (the embedded one by default, ``--model PATH`` to override);
* the same prompts: rows of a built-in task (``--task``: arithmetic by default, word_problems for
  a real chat model), taken in order (no shuffling), so step k of both trainers sees the very
  same 8 questions, scored by the task's own reward function;
* 8 prompts x 8 samples = 64 completions per step, temperature 1.0, at most 64 new tokens;
  by default both are forced to generate exactly 64 tokens (ours: ``rollout.ignore_eos``;
  TRL: ``min_new_tokens=64``), ``--natural-stop`` lets both stop at eos;
* one optimizer update per step on all 64 completions (ours: ppo_mini_batch_size = train_batch_size,
  one epoch; TRL: per_device_train_batch_size=64, gradient_accumulation_steps=1,
  steps_per_generation=1, num_iterations=1);
* GRPO advantages (r - group mean) / group std, token-mean loss over the batch (TRL: ``dapo``),
  clip 0.2, a k3 KL loss against a frozen reference with the same coefficient (TRL ``beta``),
  AdamW with the same lr / weight decay / betas, grad-norm clip 1.0, constant lr;
* every weight trained, or (``--lora RANK``) LoRA adapters of that rank, alpha 2 x rank, on every
  linear layer of the decoder (ours: ``model.lora_rank``; TRL: a peft ``LoraConfig`` with
  ``target_modules="all-linear"``); with LoRA both take the reference logprobs from the base
  model with the adapters switched off instead of a second copy;
* the same number of torch threads.

Each trainer does one untimed warm-up step, then ``--steps`` timed steps. Run:

    python benchmarks/grpo_vs_trl.py [--steps 5] [--model PATH|PRESET] [--task arithmetic|word_problems]
                                     [--lora RANK] [--natural-stop] [--threads N]
                                     [--only ours|trl] [--ours-override KEY=VALUE ...] [--device cuda]

Needs ``trl`` (``pip install trl``), which pulls accelerate and datasets.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_DISABLED", "true")
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import argparse  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from collections import defaultdict  # noqa: E402

import torch  # noqa: E402

# Settings shared by both trainers.
PROMPTS_PER_STEP = 8
SAMPLES_PER_PROMPT = 8
MAX_NEW_TOKENS = 64
LR = 1e-5
KL_COEF = 0.04
CLIP = 0.2
WEIGHT_DECAY = 0.01
BETAS = (0.9, 0.999)
GRAD_CLIP = 1.0
TEMPERATURE = 1.0
SEED = 0


def say(*parts: object) -> None:
    print(*parts, flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=5, help="timed steps per trainer (after 1 warm-up step)")
    parser.add_argument("--model", default=None,
                        help="HF model folder, .gguf file or preset (default: the embedded tiny model)")
    parser.add_argument("--task", choices=["arithmetic", "word_problems"], default="arithmetic",
                        help="the built-in task whose train rows both trainers take in order")
    parser.add_argument("--lora", type=int, default=0, metavar="RANK",
                        help="train LoRA adapters of this rank on every linear layer (default 0: every weight)")
    parser.add_argument(
        "--natural-stop", action="store_true", help="let completions stop at eos instead of forcing 64 tokens"
    )
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--threads", type=int, default=None, help="torch threads for both (default: CPU count)")
    parser.add_argument(
        "--only", choices=["ours", "trl"], default=None, help="run one side only (for profiling)"
    )
    parser.add_argument(
        "--ours-override",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra config override for our trainer, applied last (repeatable), "
        "e.g. actor_rollout_ref.model.use_remove_padding=false",
    )
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error("--steps must be >= 1")
    if args.lora < 0:
        parser.error("--lora must be >= 0")
    return args


def summarize(seconds: list[float]) -> dict[str, float]:
    return {
        "mean": statistics.fmean(seconds),
        "median": statistics.median(seconds),
        "min": min(seconds),
        "max": max(seconds),
    }


def fmt_times(seconds: list[float]) -> str:
    return "[" + ", ".join(f"{s:.3f}" for s in seconds) + "]"


# -- ours -------------------------------------------------------------------------------
def run_ours(model_path: str, rows: list[dict], reward_fn, args: argparse.Namespace) -> dict:
    from opentinker.config import make_config
    from opentinker.engine.ppo.trainer import RLTrainer

    total = args.steps + 1
    overrides = [
        f"actor_rollout_ref.model.path={model_path}",
        "algorithm.adv_estimator=grpo",
        "algorithm.norm_adv_by_std_in_grpo=true",
        f"data.train_batch_size={PROMPTS_PER_STEP}",
        "data.shuffle=false",
        f"data.max_response_length={MAX_NEW_TOKENS}",
        f"actor_rollout_ref.rollout.n={SAMPLES_PER_PROMPT}",
        f"actor_rollout_ref.rollout.temperature={TEMPERATURE}",
        "actor_rollout_ref.rollout.top_p=1.0",
        "actor_rollout_ref.rollout.top_k=-1",
        f"actor_rollout_ref.rollout.ignore_eos={'false' if args.natural_stop else 'true'}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={PROMPTS_PER_STEP}",
        f"actor_rollout_ref.actor.ppo_micro_batch_size={PROMPTS_PER_STEP * SAMPLES_PER_PROMPT}",
        f"actor_rollout_ref.ref.log_prob_micro_batch_size={PROMPTS_PER_STEP * SAMPLES_PER_PROMPT}",
        "actor_rollout_ref.actor.ppo_epochs=1",
        "actor_rollout_ref.actor.loss_agg_mode=token-mean",
        f"actor_rollout_ref.actor.clip_ratio={CLIP}",
        "actor_rollout_ref.actor.use_kl_loss=true",
        f"actor_rollout_ref.actor.kl_loss_coef={KL_COEF}",
        "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
        "actor_rollout_ref.actor.entropy_coeff=0.0",
        f"actor_rollout_ref.actor.grad_clip={GRAD_CLIP}",
        f"actor_rollout_ref.actor.optim.lr={LR}",
        f"actor_rollout_ref.actor.optim.weight_decay={WEIGHT_DECAY}",
        f"actor_rollout_ref.actor.optim.betas=[{BETAS[0]},{BETAS[1]}]",
        "actor_rollout_ref.actor.optim.warmup_style=constant",
        *([f"actor_rollout_ref.model.lora_rank={args.lora}", f"actor_rollout_ref.model.lora_alpha={2 * args.lora}"]
          if args.lora else []),
        f"trainer.device={args.device}",
        f"trainer.seed={SEED}",
        f"trainer.total_training_steps={total}",
        "trainer.progress_bar=false",
        "trainer.test_freq=-1",
        "trainer.val_before_train=false",
        *args.ours_override,
    ]
    cfg = make_config(overrides)
    trainer = RLTrainer(cfg, train_rows=rows, val_rows=[], reward_fn=reward_fn)

    seconds: list[float] = []
    lengths: list[float] = []
    phases: dict[str, list[float]] = defaultdict(list)
    for step in range(total):
        start = time.perf_counter()
        metrics = trainer.step()
        elapsed = time.perf_counter() - start
        timed = step > 0
        if metrics.get("actor/optimizer_steps", 1) + metrics.get("actor/skipped_nonfinite_steps", 0) != 1:
            raise RuntimeError(f"ours made {metrics.get('actor/optimizer_steps')} optimizer steps in one step")
        say(
            f"  ours step {step + 1}/{total}{'' if timed else ' (warm-up)'}: {elapsed:.3f}s  "
            f"len={metrics['response_length/mean']:.1f}  reward={metrics['reward/mean']:.3f}  "
            f"kl={metrics.get('actor/kl', float('nan')):.5f}"
        )
        if timed:
            seconds.append(elapsed)
            lengths.append(metrics["response_length/mean"])
            for key, value in metrics.items():
                if key.startswith("timing_s/"):
                    phases[key.removeprefix("timing_s/")].append(value)
    return {"seconds": seconds, "lengths": lengths, "phases": {k: statistics.fmean(v) for k, v in phases.items()}}


# -- TRL --------------------------------------------------------------------------------
def run_trl(model_path: str, rows: list[dict], reward_fn, args: argparse.Namespace) -> dict:
    from datasets import Dataset
    from transformers import AutoTokenizer, PrinterCallback, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    total = args.steps + 1
    completions_per_step = PROMPTS_PER_STEP * SAMPLES_PER_PROMPT
    dataset = Dataset.from_list(
        [{"prompt": row["prompt"], "ground_truth": row["reward_model"]["ground_truth"]} for row in rows]
    )

    def task_reward(completions, ground_truth, **_):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [reward_fn(text, {"reward_model": {"ground_truth": truth}}) for text, truth in zip(texts, ground_truth)]

    class StepTimer(TrainerCallback):
        """Timestamps each optimizer step and snapshots the step's metrics (TRL clears them on log)."""

        def __init__(self):
            self.trainer = None
            self.begins: list[float] = []
            self.ends: list[float] = []
            self.step_metrics: list[dict[str, float]] = []

        def on_step_begin(self, args, state, control, **kwargs):
            self.begins.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kwargs):
            self.ends.append(time.perf_counter())
            logged = self.trainer._metrics["train"] if self.trainer is not None else {}
            self.step_metrics.append({key: values[-1] for key, values in logged.items() if values})

    class TimedGRPOTrainer(GRPOTrainer):
        """GRPOTrainer that records how long generation and scoring take (not a behaviour change)."""

        phase_seconds: dict[str, list[float]]

        def _generate(self, prompts):
            start = time.perf_counter()
            try:
                return super()._generate(prompts)
            finally:
                self.phase_seconds["generate"].append(time.perf_counter() - start)

        def _generate_and_score_completions(self, inputs):
            start = time.perf_counter()
            try:
                return super()._generate_and_score_completions(inputs)
            finally:
                self.phase_seconds["generate_and_score"].append(time.perf_counter() - start)

    generation_kwargs = None if args.natural_stop else {"min_new_tokens": MAX_NEW_TOKENS}
    output_dir = tempfile.mkdtemp(prefix="grpo_vs_trl_")
    config = GRPOConfig(
        output_dir=output_dir,
        # batch geometry: one generation of 64 completions, one optimizer step on all of them
        per_device_train_batch_size=completions_per_step,
        gradient_accumulation_steps=1,
        steps_per_generation=1,
        num_generations=SAMPLES_PER_PROMPT,
        num_iterations=1,
        max_steps=total,
        max_completion_length=MAX_NEW_TOKENS,
        generation_kwargs=generation_kwargs,
        temperature=TEMPERATURE,
        top_p=1.0,
        top_k=0,
        shuffle_dataset=False,
        # loss: GRPO advantages scaled by the group std, token-mean over the batch, k3 KL
        loss_type="dapo",
        scale_rewards="group",
        beta=KL_COEF,
        epsilon=CLIP,
        mask_truncated_completions=False,
        # optimizer: plain AdamW, constant lr, same clip
        learning_rate=LR,
        weight_decay=WEIGHT_DECAY,
        adam_beta1=BETAS[0],
        adam_beta2=BETAS[1],
        max_grad_norm=GRAD_CLIP,
        optim="adamw_torch",
        lr_scheduler_type="constant",
        warmup_steps=0,
        # float32 weights (bf16 autocast on a GPU), no checkpointing / vLLM / logging / saving
        use_cpu=args.device == "cpu",
        bf16=args.device == "cuda",
        fp16=False,
        gradient_checkpointing=False,
        use_vllm=False,
        model_init_kwargs={"dtype": "float32"},
        report_to="none",
        logging_strategy="no",
        save_strategy="no",
        eval_strategy="no",
        log_completions=False,
        disable_tqdm=True,
        dataloader_num_workers=0,
        dataloader_pin_memory=False,
        seed=SEED,
    )
    tokenizer = AutoTokenizer.from_pretrained(model_path, padding_side="left")
    peft_config = None
    if args.lora:
        from peft import LoraConfig

        peft_config = LoraConfig(r=args.lora, lora_alpha=2 * args.lora, lora_dropout=0.0, target_modules="all-linear",
                                 task_type="CAUSAL_LM")
    timer = StepTimer()
    trainer = TimedGRPOTrainer(
        model=model_path,
        reward_funcs=task_reward,
        args=config,
        peft_config=peft_config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[timer],
    )
    trainer.phase_seconds = defaultdict(list)
    timer.trainer = trainer
    trainer.remove_callback(PrinterCallback)  # the end-of-train metrics dict; we print our own
    torch.set_num_threads(args.threads)  # the Trainer must not have changed it; re-assert anyway
    say(f"  TRL ref model loaded: {trainer.ref_model is not None}, model dtype {trainer.model.dtype}, "
        f"gradient checkpointing {trainer.model.is_gradient_checkpointing}")
    start = time.perf_counter()
    trainer.train()
    train_seconds = time.perf_counter() - start

    if len(timer.ends) != total:
        raise RuntimeError(f"TRL ran {len(timer.ends)} optimizer steps, expected {total}")
    generations = len(trainer.phase_seconds["generate"])
    if generations != total:
        raise RuntimeError(f"TRL generated {generations} times in {total} steps; expected one generation per step")
    # Step i takes from the end of step i-1 to the end of step i: the whole loop (data, generation,
    # scoring, forward/backward, optimizer, callbacks), like one call of our trainer.step().
    step_ends = timer.ends
    seconds = [step_ends[i] - step_ends[i - 1] for i in range(1, total)]
    inner = [e - b for b, e in zip(timer.begins, timer.ends)]
    nan = float("nan")
    lengths = [m.get("completions/mean_length", nan) for m in timer.step_metrics]
    warmup_seconds = step_ends[0] - timer.begins[0]
    for step, m in enumerate(timer.step_metrics):
        elapsed = warmup_seconds if step == 0 else seconds[step - 1]
        say(
            f"  TRL  step {step + 1}/{total}{'' if step else ' (warm-up)'}: {elapsed:.3f}s  "
            f"len={lengths[step]:.1f}  reward={m.get('reward', nan):.3f}  kl={m.get('kl', nan):.5f}"
        )
    phase = {name: statistics.fmean(values[1:]) for name, values in trainer.phase_seconds.items() if len(values) > 1}
    phase["optimizer_step (callback begin->end)"] = statistics.fmean(inner[1:])
    return {
        "seconds": seconds,
        "lengths": lengths[1:],
        "phases": phase,
        "train_seconds": train_seconds,
    }


# -- main -------------------------------------------------------------------------------
def main(argv: list[str] | None = None, results: dict[str, dict] | None = None) -> int:
    """Runs the comparison and prints it; ``results`` (when given) receives each side's
    ``seconds`` per timed step, ``lengths`` and ``phases``."""
    args = parse_args(argv)
    args.threads = args.threads or os.cpu_count() or 1
    torch.set_num_threads(args.threads)
    torch.manual_seed(SEED)
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning)

    import transformers

    transformers.utils.logging.disable_progress_bar()  # no "Loading weights" bars
    from opentinker.engine.data import builtin_task
    from opentinker.engine.model_loading import resolve_model_path

    model_path = resolve_model_path(args.model)
    train_rows, _, reward_fn = builtin_task(args.task)
    rows = train_rows[: PROMPTS_PER_STEP * (args.steps + 1)]  # taken in order by both trainers

    try:
        import trl

        trl_version = trl.__version__
    except ImportError:
        trl_version = None

    n_params = None
    try:
        from transformers import AutoConfig, AutoModelForCausalLM

        with torch.device("meta"):
            meta = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_path))
        n_params = sum(p.numel() for p in meta.parameters())
    except Exception:  # noqa: BLE001 - only informational
        pass

    say("GRPO step time: opentinker RLTrainer vs TRL GRPOTrainer")
    say("settings:")
    say(f"  model                 {model_path}" + (f"  ({n_params / 1e6:.2f}M params)" if n_params else ""))
    dtype = "fp32 weights, bf16 autocast" if args.device == "cuda" else "float32"
    say(f"  device / dtype        {args.device} / {dtype}, torch threads {args.threads} (os.cpu_count()={os.cpu_count()})")
    say(f"  batch                 {PROMPTS_PER_STEP} prompts x {SAMPLES_PER_PROMPT} samples = "
        f"{PROMPTS_PER_STEP * SAMPLES_PER_PROMPT} completions/step, 1 optimizer update/step")
    say(f"  generation            max {MAX_NEW_TOKENS} new tokens, temperature {TEMPERATURE}, top_p 1.0, top_k off, "
        + ("stop at eos (--natural-stop)" if args.natural_stop else f"forced to exactly {MAX_NEW_TOKENS} tokens"))
    say(f"  loss                  GRPO (r-mean)/std per group, token-mean, clip {CLIP}, k3 KL coef {KL_COEF}")
    say(f"  optimizer             AdamW lr {LR} wd {WEIGHT_DECAY} betas {BETAS}, grad clip {GRAD_CLIP}, constant lr")
    say(f"  prompts               {args.task} train rows 0..{len(rows) - 1} in order (same per step in both)")
    say("  trained               " + (f"LoRA rank {args.lora}, alpha {2 * args.lora}, every linear layer; reference = "
                                      "the base with adapters off" if args.lora else "every weight; a frozen reference copy"))
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    say(f"  machine load          {load:.2f} (1-min load average before starting; >0.5 means another process "
        "competes for the CPU and timings are noisy)")
    if load > 0.5 and args.threads > 1:
        say(f"  WARNING               the machine is busy and {args.threads} torch threads will fight the other "
            "process for cores (OpenMP spinning can make steps 10x+ slower); consider --threads 1")
    if args.ours_override:
        say(f"  ours overrides        {' '.join(args.ours_override)}")
    say(f"  steps                 1 warm-up (untimed) + {args.steps} timed, each trainer")
    say(f"  versions              python {platform.python_version()}, torch {torch.__version__}, "
        f"transformers {transformers.__version__}, trl {trl_version}")

    results = {} if results is None else results
    if args.only in (None, "ours"):
        say("\n[ours] opentinker RLTrainer")
        torch.set_num_threads(args.threads)
        results["ours"] = run_ours(model_path, rows, reward_fn, args)
    if args.only in (None, "trl"):
        if trl_version is None:
            say("\n[TRL] not installed (pip install trl); skipped")
        else:
            say("\n[TRL] trl GRPOTrainer")
            torch.set_num_threads(args.threads)
            results["trl"] = run_trl(model_path, rows, reward_fn, args)

    say("\nresults (seconds per step over the timed steps):")
    for name, label in (("ours", "ours"), ("trl", "TRL ")):
        if name not in results:
            continue
        res = results[name]
        stats = summarize(res["seconds"])
        say(
            f"  {label}  mean {stats['mean']:.3f}s  median {stats['median']:.3f}s  "
            f"min {stats['min']:.3f}s  max {stats['max']:.3f}s  steps {fmt_times(res['seconds'])}  "
            f"mean completion length {statistics.fmean(res['lengths']):.1f} tokens"
        )
        say("        phases (mean s): " + ", ".join(f"{k} {v:.3f}" for k, v in res["phases"].items()))
    if "ours" in results and "trl" in results:
        ours, theirs = results["ours"], results["trl"]
        mean_ratio = statistics.fmean(theirs["seconds"]) / statistics.fmean(ours["seconds"])
        median_ratio = statistics.median(theirs["seconds"]) / statistics.median(ours["seconds"])
        say(f"\nTRL/ours time ratio: mean {mean_ratio:.2f}, median {median_ratio:.2f}")
        say(f"ours is {median_ratio:.1f}x faster per step (median; {mean_ratio:.1f}x by mean)"
            if median_ratio >= 1 else f"ours is {1 / median_ratio:.1f}x slower per step (median)")
        len_ours, len_trl = statistics.fmean(ours["lengths"]), statistics.fmean(theirs["lengths"])
        if abs(len_ours - len_trl) > 0.1 * max(len_ours, len_trl):
            say(f"note: mean completion lengths differ ({len_ours:.1f} vs {len_trl:.1f}); the work was not equal")
    return 0


if __name__ == "__main__":
    sys.exit(main())
