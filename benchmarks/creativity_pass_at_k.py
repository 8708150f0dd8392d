"""Plain GRPO vs creativity-weighted GRPO on the same seed: validation pass@1 and pass@k.

    python benchmarks/creativity_pass_at_k.py [--steps 60] [--estimator grpo_weighted_mul] [--judge lexical]

Both runs train the embedded tiny model on arithmetic with identical settings and seed; the
weighted run adds strategy labels from the judge (weight = frequency ** -0.7 among the
correct responses of a prompt). Validation samples val_n = 8 responses per held-out prompt at
temperature 1 and reports pass@k for k = 1, 2, 4, 8 (unbiased estimator), before and after.
"""

from __future__ import annotations

import argparse
import time

from opentinker.config import make_config
from opentinker.engine.ppo.trainer import RLTrainer

KS = (1, 2, 4, 8)


def run(estimator: str, steps: int, judge: str, seed: int) -> tuple[dict, dict, float]:
    classify = estimator != "grpo"
    cfg = make_config([
        f"algorithm.adv_estimator={estimator}", f"algorithm.enable_solution_classification={str(classify).lower()}",
        f"algorithm.judge.kind={judge}", "actor_rollout_ref.actor.optim.lr=3e-5",
        "actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.rollout.val_n=8",
        "actor_rollout_ref.rollout.val_temperature=1.0", "data.val_batch_size=128",
        f"trainer.total_training_steps={steps}", f"trainer.test_freq={steps}", f"trainer.seed={seed}",
        "trainer.progress_bar=false",
    ])
    started = time.perf_counter()
    trainer = RLTrainer(cfg)
    history = trainer.fit()
    trainer.close()
    return history[0], history[-1], time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--estimator", default="grpo_weighted_mul", choices=["grpo_weighted_mul", "grpo_weighted_add"])
    parser.add_argument("--judge", default="lexical", choices=["lexical", "hf", "openai"])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(f"tiny model, arithmetic, 8 prompts x 8 samples, {args.steps} steps, seed {args.seed}, "
          f"judge {args.judge}; validation: 128 held-out prompts x 8 samples at T=1", flush=True)
    rows = []
    for estimator in ("grpo", args.estimator):
        before, after, seconds = run(estimator, args.steps, args.judge, args.seed)
        rows.append((estimator, before, after, seconds))
        print(f"  {estimator} done in {seconds:.0f} s", flush=True)
    header = "estimator".ljust(20) + "".join(f"pass@{k} before->after".rjust(24) for k in KS)
    print(header)
    for estimator, before, after, _ in rows:
        cells = "".join(f"{before[f'val/pass@{k}']:.3f} -> {after[f'val/pass@{k}']:.3f}".rjust(24) for k in KS)
        print(estimator.ljust(20) + cells)
    for key in ("creativity/distinct_strategies_mean", "creativity/weight_mean", "creativity/judge_fallbacks"):
        if key in rows[1][2]:
            print(f"{args.estimator} last step {key} = {rows[1][2][key]:.3f}")


if __name__ == "__main__":
    main()
