"""``opentinker-train key=value ...``: run the trainer with verl-style dotted overrides.

Example::

    opentinker-train algorithm.adv_estimator=grpo actor_rollout_ref.rollout.n=8 \\
        data.train_batch_size=8 actor_rollout_ref.actor.optim.lr=1e-5

With no ``actor_rollout_ref.model.path`` it trains the embedded tiny model on arithmetic.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from opentinker.config import ConfigError, build_recipe


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="opentinker-train",
        description="Train an LLM with GRPO/PPO on a built-in task (default: the tiny model on arithmetic).",
        epilog="Overrides use verl's dotted keys, e.g. algorithm.adv_estimator=grpo actor_rollout_ref.rollout.n=8",
    )
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")
    parser.add_argument("--metrics-out", type=Path, help="write every step's metrics to this JSONL file")
    parser.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    return parser.parse_intermixed_args(argv)  # overrides may come before or after the flags


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    try:
        recipe = build_recipe(args.overrides)  # parsed once; the trainer takes it as it is
    except ConfigError as error:
        print(f"opentinker-train: {error}", file=sys.stderr)
        return 2
    if args.print_config:
        from omegaconf import OmegaConf

        print(OmegaConf.to_yaml(OmegaConf.create(recipe.to_tree())))
        return 0

    from opentinker.engine.model_loading import ModelLoadError
    from opentinker.engine.ppo.trainer import RLTrainer

    try:
        trainer = RLTrainer(recipe)
    except (ConfigError, ModelLoadError) as error:
        print(f"opentinker-train: {error}", file=sys.stderr)
        return 2
    try:
        history = trainer.fit()
    finally:
        trainer.close()  # stops agent-loop threads and FSDP ranks
    if args.metrics_out:
        args.metrics_out.parent.mkdir(parents=True, exist_ok=True)
        args.metrics_out.write_text("".join(json.dumps(m) + "\n" for m in history))
    _print_summary(history)
    return 0


def _print_summary(history: list[dict]) -> None:
    rewards = [m["reward/mean"] for m in history if "reward/mean" in m]
    vals = [m["val/accuracy"] for m in history if "val/accuracy" in m]
    if rewards:
        quarter = max(1, len(rewards) // 4)
        first, last = sum(rewards[:quarter]) / quarter, sum(rewards[-quarter:]) / quarter
        print(f"train reward: first {quarter} steps {first:.3f} -> last {quarter} steps {last:.3f}")
    if len(vals) >= 2:
        print(f"held-out accuracy: {vals[0]:.3f} -> {vals[-1]:.3f}")
    checkpoints = [m["checkpoint"] for m in history if "checkpoint" in m]
    if checkpoints:
        print(f"checkpoint: {checkpoints[-1]}")


if __name__ == "__main__":
    raise SystemExit(main())
