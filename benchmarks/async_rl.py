"""Synchronous vs asynchronous off-policy GRPO on the embedded tiny model, side by side.

Every variant trains the same number of steps from the same seed with the quickstart's settings
(lr 3e-5, a KL loss, the arithmetic task) but 64 sampled tokens per response, in this one
process, one after the other (asynchronous runs give the trainer one torch thread fewer, the
rollout actor has one):

* ``sync``: ``async_training.max_staleness=0`` (the rollout waits for the update and back);
* ``k=1`` / ``k=2``: the rollouts of the next k steps run in a Ray actor while a step updates,
  without rollout correction;
* ``k=2+IS``: k=2 with token-level truncated IS (``rollout_is=token``, threshold 2) and token
  rejection outside [0.5, 2] (``rollout_rs=token``).

``--gpu`` (a CUDA machine with Ray): PPO with a critic (GAE) on a randomly initialised
Qwen2.5-0.5B-shaped model built from a config in code, 16 prompts x 4 samples of 256 forced
tokens, ``sync`` vs ``k=1`` by default; the rollout actor takes half of the GPU beside the
trainer. Held-out accuracy is not measured there (random weights).

It prints seconds per step (the mean over the steps after the first), steps/s relative to
``sync``, tokens/s, the reward of the last 10 steps, held-out accuracy (greedy, 200 problems)
after the last step, and for the asynchronous runs the staleness and the trainer/sampler gap
(the IS-weight statistics: mean, std, effective sample size, fraction above the threshold, the
fraction rejected). Run:

    python benchmarks/async_rl.py [--steps 40] [--seed 0] [--variants sync,k=1,k=2,k=2+IS]
                                  [--override KEY=VALUE ...]
    python benchmarks/async_rl.py --gpu [--steps 6] [--variants sync,k=1]
"""

from __future__ import annotations

import argparse
import statistics
import time

SETTINGS = [
    # Rollouts of 64 tokens (as grpo_vs_trl.py forces): with the default 16-token cap the step is
    # almost all update, and there is little rollout to overlap.
    "data.max_response_length=64",
    "actor_rollout_ref.rollout.ignore_eos=true",
    "actor_rollout_ref.actor.optim.lr=3e-5",
    "actor_rollout_ref.actor.use_kl_loss=true",
    "data.val_batch_size=200",
    "trainer.val_before_train=false",
    "trainer.progress_bar=false",
    "trainer.device=cpu",
]
VARIANTS = {
    "sync": ["async_training.max_staleness=0"],
    "k=1": ["async_training.max_staleness=1"],
    "k=2": ["async_training.max_staleness=2"],
    "k=2+IS": ["async_training.max_staleness=2",
               "algorithm.rollout_correction.rollout_is=token",
               "algorithm.rollout_correction.rollout_is_threshold=2.0",
               "algorithm.rollout_correction.rollout_rs=token",
               "algorithm.rollout_correction.rollout_rs_threshold=2.0"],
}
GPU_SETTINGS = [
    "trainer.device=cuda", "algorithm.adv_estimator=gae", "data.train_batch_size=16",
    "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.ppo_mini_batch_size=16",
    "actor_rollout_ref.actor.ppo_micro_batch_size=16", "actor_rollout_ref.ref.log_prob_micro_batch_size=16",
    "critic.ppo_mini_batch_size=16", "critic.ppo_micro_batch_size=16", "data.max_response_length=256",
    "actor_rollout_ref.actor.optim.lr=1e-6", "critic.optim.lr=1e-5", "trainer.test_freq=-1",
]
GAP_STATS = ("rollout_is_mean", "rollout_is_std", "rollout_is_eff_sample_size", "rollout_is_ratio_fraction_high",
             "rollout_rs_masked_fraction", "kl")


def run(variant: str, steps: int, seed: int, extra: list[str]) -> dict[str, float]:
    from opentinker.config import make_config
    from opentinker.engine.ppo.trainer import RLTrainer

    cfg = make_config([*SETTINGS, f"trainer.total_training_steps={steps}", f"trainer.test_freq={steps}",
                       f"trainer.seed={seed}", *VARIANTS[variant], *extra])
    trainer = RLTrainer(cfg)
    try:
        started = time.perf_counter()
        history = trainer.fit()
        wall = time.perf_counter() - started
    finally:
        trainer.close()
    trained = [h for h in history if "reward/mean" in h]
    step_seconds = [h["timing_s/step"] for h in trained[1:]]
    result = {
        "s_per_step": statistics.mean(step_seconds),
        "wall_s": wall,
        "tokens_per_s": statistics.mean(h["perf/tokens_per_s"] for h in trained[1:]),
        "reward_last10": statistics.mean(h["reward/mean"] for h in trained[-10:]),
        "heldout": history[-1].get("val/accuracy", float("nan")),
        "staleness": statistics.mean(h.get("staleness/mean", 0.0) for h in trained),
        "wait_s": statistics.mean(h.get("timing_s/rollout_wait", h.get("timing_s/rollout", 0.0)) for h in trained[1:]),
    }
    result["phases"] = {key.removeprefix("timing_s/"): statistics.mean(h[key] for h in trained[1:])
                        for key in trained[-1] if key.startswith("timing_s/") and all(key in h for h in trained[1:])}
    for stat in GAP_STATS:
        values = [h[f"rollout_corr/{stat}"] for h in trained if f"rollout_corr/{stat}" in h]
        if values:
            result[stat] = statistics.mean(values)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=None, help="default 40 (6 with --gpu)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--variants", default=None, help=f"of {', '.join(VARIANTS)} (default: all; sync,k=1 with --gpu)")
    parser.add_argument("--override", action="append", default=[], help="extra config overrides for every run")
    parser.add_argument("--gpu", action="store_true", help="PPO with a critic on the Qwen2.5-0.5B shape (needs CUDA)")
    args = parser.parse_args()
    import ray
    import torch

    args.steps = args.steps or (6 if args.gpu else 40)
    args.variants = args.variants or ("sync,k=1" if args.gpu else ",".join(VARIANTS))
    if args.gpu:
        from model_shapes import qwen25_05b_folder

        args.override = [f"actor_rollout_ref.model.path={qwen25_05b_folder()}", *GPU_SETTINGS, *args.override]
        print(f"{torch.cuda.get_device_name()}: PPO + critic on the Qwen2.5-0.5B shape", flush=True)
    ray.init(num_cpus=4, num_gpus=1 if args.gpu else 0, include_dashboard=False, log_to_driver=False)
    threads = torch.get_num_threads()
    print(f"torch {torch.__version__}; {threads} torch threads (sync), {max(1, threads - 1)} + 1 in the rollout "
          f"actor (async); {args.steps} steps, seed {args.seed}", flush=True)
    results = {}
    for variant in args.variants.split(","):
        torch.set_num_threads(threads)  # an asynchronous run lowers it
        results[variant] = run(variant, args.steps, args.seed, args.override)
        print(f"  done {variant}: {results[variant]['s_per_step']:.3f} s/step", flush=True)
    base = results.get("sync")
    header = f"{'variant':<10} {'s/step':>7} {'x sync':>7} {'tok/s':>7} {'reward10':>8} {'heldout':>7} {'stale':>5} {'wait s':>6}"
    print(header)
    for variant, r in results.items():
        ratio = base["s_per_step"] / r["s_per_step"] if base else float("nan")
        print(f"{variant:<10} {r['s_per_step']:7.3f} {ratio:7.2f} {r['tokens_per_s']:7.0f} {r['reward_last10']:8.3f} "
              f"{r['heldout']:7.3f} {r['staleness']:5.2f} {r['wait_s']:6.3f}")
    print("seconds per phase (means over the steps after the first):")
    for variant, r in results.items():
        print(f"  {variant:<8} " + " ".join(f"{name}={seconds:.3f}" for name, seconds in sorted(r["phases"].items())))
    print("trainer/sampler gap (means over steps; IS statistics before truncation, token level):")
    for variant, r in results.items():
        if "rollout_is_mean" in r:
            print(f"  {variant:<8} " + " ".join(f"{stat}={r[stat]:.4f}" for stat in GAP_STATS if stat in r))


if __name__ == "__main__":
    main()
