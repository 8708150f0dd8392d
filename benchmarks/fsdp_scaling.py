"""Seconds per GRPO step: one LocalBackend vs FSDP ranks, in the same run; on a GPU, the MFU
of the update phase.

    python benchmarks/fsdp_scaling.py [--steps 12] [--ranks 2]          # CPU: tiny model, gloo ranks
    python benchmarks/fsdp_scaling.py --gpu [--steps 6] [--ranks N]      # a GPU node

CPU: the embedded tiny model, the same seeded settings, first with ``strategy=local`` and then
with ``strategy=fsdp trainer.device=cpu trainer.n_gpus_per_node=<ranks>``; prints the median
seconds per step of each (the first two steps, warm-up, left out) and the ratio, with the
update phase on its own. On 2 CPU cores FSDP ranks mostly add communication: the point of
this run is that the cost is measured, not hidden.

GPU (``--gpu``): a randomly initialised Qwen2.5-0.5B-shaped model built from a config in
code (no download) in bf16, FSDP over ``--ranks`` GPUs, long responses (``ignore_eos``) so
the update is compute-bound; prints the update phase's model FLOP utilisation,
``6 * parameters * trained tokens / update seconds``, as a fraction of the GPUs' dense bf16
peak (attention FLOPs are left out, so it is an underestimate).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from model_shapes import qwen25_05b_folder

from opentinker.config import make_config
from opentinker.engine.ppo.trainer import RLTrainer

CPU_SETTINGS = [
    "data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=8", "actor_rollout_ref.rollout.n=8",
    "actor_rollout_ref.actor.optim.lr=3e-5", "actor_rollout_ref.actor.use_kl_loss=true", "trainer.test_freq=-1",
    "trainer.progress_bar=false", "trainer.seed=0",
]
# Dense bf16 peak of one GPU, by a substring of torch.cuda.get_device_name().
PEAK_BF16_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12}


def timed_run(overrides: list[str], steps: int) -> tuple[list[dict], RLTrainer]:
    trainer = RLTrainer(make_config([*overrides, f"trainer.total_training_steps={steps}"]))
    history = []
    try:
        for _ in range(steps):
            history.append(trainer.train_step())
    finally:
        trainer.close()
    return history, trainer


def median_after_warmup(history: list[dict], key: str) -> float:
    values = [m[key] for m in history[2:]] or [m[key] for m in history]
    return statistics.median(values)


def cpu(steps: int, ranks: int) -> None:
    runs = {
        "local": [],
        f"fsdp x{ranks}": ["actor_rollout_ref.actor.strategy=fsdp", "trainer.device=cpu",
                           f"trainer.n_gpus_per_node={ranks}"],
    }
    results = {}
    for name, extra in runs.items():
        history, _ = timed_run([*CPU_SETTINGS, *extra], steps)
        results[name] = (median_after_warmup(history, "timing_s/step"), median_after_warmup(history, "timing_s/update"),
                         history[-1]["reward/mean"])
        print(f"{name:<10} step {results[name][0]:.3f} s  update {results[name][1]:.3f} s  "
              f"(last reward {results[name][2]:.3f})", flush=True)
    (local_step, local_update, _), (fsdp_step, fsdp_update, _) = results.values()
    print(f"fsdp / local: step x{fsdp_step / local_step:.2f}, update x{fsdp_update / local_update:.2f} "
          f"(median of steps 3..{steps}, {torch.get_num_threads()} torch threads per process)")


def gpu(steps: int, ranks: int) -> None:
    name = torch.cuda.get_device_name()
    peak = next((flops for key, flops in PEAK_BF16_FLOPS.items() if key in name), None)
    folder = qwen25_05b_folder()
    params = sum(p.numel() for p in __import__("transformers").AutoModelForCausalLM.from_pretrained(folder).parameters())
    settings = [
        f"actor_rollout_ref.model.path={folder}", "actor_rollout_ref.actor.strategy=fsdp", "trainer.device=cuda",
        f"trainer.n_gpus_per_node={ranks}", "data.train_batch_size=16", "actor_rollout_ref.actor.ppo_mini_batch_size=16",
        "actor_rollout_ref.rollout.n=8", "data.max_response_length=512", "actor_rollout_ref.rollout.ignore_eos=true",
        "actor_rollout_ref.actor.ppo_micro_batch_size=16", "trainer.test_freq=-1", "trainer.progress_bar=false",
        "actor_rollout_ref.actor.optim.lr=1e-6",
    ]
    history, _ = timed_run(settings, steps)
    update_s = median_after_warmup(history, "timing_s/update")
    tokens = median_after_warmup(history, "response_length/mean") * 16 * 8
    flops = 6 * params * tokens / update_s
    print(f"{name} x{ranks}: {params / 1e6:.0f} M parameters, update {update_s:.2f} s for {tokens:.0f} trained "
          f"tokens: {flops / 1e12:.1f} TFLOP/s")
    if peak:
        print(f"MFU of the update phase: {flops / (peak * ranks):.1%} of {peak * ranks / 1e12:.0f} TFLOP/s bf16 peak")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--gpu", action="store_true", help="the GPU MFU run (needs CUDA)")
    args = parser.parse_args()
    start = time.perf_counter()
    if args.gpu:
        gpu(args.steps, args.ranks)
    else:
        cpu(args.steps, args.ranks)
    print(f"[fsdp_scaling] {time.perf_counter() - start:.0f} s in all")


if __name__ == "__main__":
    main()
