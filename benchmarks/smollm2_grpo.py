"""Does a real pretrained model learn? SmolLM2-135M-Instruct, GRPO with LoRA on word problems:
held-out accuracy before -> after, over seeds, beside an lr = 0 control.

Each run is the quickstart's recipe (``opentinker.client.quickstart.SMOLLM2_CONFIG``: LoRA rank
16, 8 prompts x 8 samples a step at temperature 0.7, answers up to 96 tokens, 64 held-out
problems scored greedily) run in-process by the trainer in a fresh interpreter, with
``trainer.seed`` and ``data.seed`` set to the seed. The control is the same run with lr 0: what
the held-out accuracy does when nothing learns (greedy validation of unchanged weights: it must
not move). Printed per run: accuracy before, after, the difference and the minutes it took;
then the mean difference over seeds with its spread. Needs ``make install-pretrained``.

    python benchmarks/smollm2_grpo.py [--seeds 1 2 3] [--steps 20] [--no-control] [--override KEY=VALUE ...]
    python benchmarks/smollm2_grpo.py --base   # the untrained model: accuracy greedy and sampled
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

RUN = r"""
import json, sys
spec = json.loads(sys.argv[1])
from opentinker.client.quickstart import SMOLLM2_CONFIG
from opentinker.config import make_config
from opentinker.engine.ppo.trainer import RLTrainer

config = {**SMOLLM2_CONFIG, "trainer.total_training_steps": spec["steps"], "trainer.test_freq": spec["steps"],
          "trainer.seed": spec["seed"], "data.seed": spec["seed"], "actor_rollout_ref.actor.optim.lr": spec["lr"],
          "trainer.progress_bar": False, "trainer.device": "cpu"}
overrides = [f"{key}={json.dumps(value) if isinstance(value, (bool, list)) else value}" for key, value in config.items()]
with RLTrainer(make_config(overrides + spec["overrides"])) as trainer:
    history = trainer.fit()
print("RESULT " + json.dumps({
    "accuracy": [m["val/accuracy"] for m in history if "val/accuracy" in m],
    "rewards": [m["reward/mean"] for m in history if "reward/mean" in m],
}))
"""


def base_accuracy(temperatures: tuple[float, ...] = (0.0, 0.7, 1.0)) -> None:
    """The untrained model on the held-out problems: accuracy (one- and two-step apart), answer
    length and seconds to answer all 64, at each temperature (the slot decode, as in training)."""
    from opentinker.client.quickstart import SMOLLM2_CONFIG
    from opentinker.engine.data import chat_prompt_ids
    from opentinker.engine.model_loading import eos_token_ids, load_causal_lm, load_tokenizer, resolve_model_path
    from opentinker.engine.rollout import SamplingParams
    from opentinker.engine.rollout.transformers_engine import TransformersRolloutEngine
    from opentinker.environments import word_problems

    path = resolve_model_path(SMOLLM2_CONFIG["actor_rollout_ref.model.path"])
    tokenizer = load_tokenizer(path)
    engine = TransformersRolloutEngine(load_causal_lm(path).eval(), eos_token_ids(tokenizer, path),
                                       tokenizer.pad_token_id, seed=0, tokenizer=tokenizer, slot_decode=True)
    problems = word_problems.make_problems(SMOLLM2_CONFIG["data.val_batch_size"], word_problems.HELDOUT_SEED, "heldout")
    prompts = [chat_prompt_ids(tokenizer, p.messages()) for p in problems]
    print(f"{'temperature':>11} {'accuracy':>8} {'one-step':>8} {'two-step':>8} {'tokens':>6} {'seconds':>7}")
    for temperature in temperatures:
        started = time.monotonic()
        answers = engine.generate(prompts, SamplingParams(temperature=temperature,
                                                          max_tokens=SMOLLM2_CONFIG["data.max_response_length"]))
        seconds = time.monotonic() - started
        scores = [word_problems.score_answer(tokenizer.decode(a.token_ids, skip_special_tokens=True), p.answer)
                  for a, p in zip(answers, problems)]

        def mean_of(steps: int) -> float:
            return statistics.fmean(s for s, p in zip(scores, problems) if p.steps == steps)

        tokens = statistics.fmean(len(a.token_ids) for a in answers)
        print(f"{temperature:>11} {statistics.fmean(scores):>8.3f} {mean_of(1):>8.3f} {mean_of(2):>8.3f} "
              f"{tokens:>6.1f} {seconds:>7.1f}", flush=True)


def run(seed: int, lr: float, steps: int, overrides: list[str]) -> dict:
    spec = {"seed": seed, "lr": lr, "steps": steps, "overrides": overrides}
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", RUN, json.dumps(spec)], cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"seed {seed} lr {lr} failed:\n{done.stderr[-3000:]}")
    line = next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))
    result = json.loads(line.removeprefix("RESULT "))
    result["minutes"] = (time.monotonic() - started) / 60
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--lr", type=float, default=None, help="default: the quickstart's")
    parser.add_argument("--no-control", action="store_true", help="skip the lr = 0 run")
    parser.add_argument("--override", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--base", action="store_true", help="only the untrained model's accuracy, greedy and sampled")
    args = parser.parse_args(argv)
    if args.base:
        base_accuracy()
        return 0
    from opentinker.client.quickstart import SMOLLM2_CONFIG

    lr = args.lr if args.lr is not None else SMOLLM2_CONFIG["actor_rollout_ref.actor.optim.lr"]
    plan = [(seed, lr) for seed in args.seeds] + ([] if args.no_control else [(args.seeds[0], 0.0)])
    print(f"SmolLM2-135M-Instruct, GRPO + LoRA on word problems, {args.steps} steps a run; 64 held-out problems, greedy")
    print(f"{'seed':>4} {'lr':>8} {'before':>7} {'after':>7} {'delta':>7} {'reward first5->last5':>22} {'minutes':>8}",
          flush=True)
    deltas = []
    for seed, run_lr in plan:
        result = run(seed, run_lr, args.steps, args.override)
        before, after = result["accuracy"][0], result["accuracy"][-1]
        rewards = result["rewards"]
        first, last = statistics.fmean(rewards[:5]), statistics.fmean(rewards[-5:])
        print(f"{seed:>4} {run_lr:>8.0e} {before:>7.3f} {after:>7.3f} {after - before:>+7.3f} "
              f"{first:>10.3f} -> {last:<9.3f} {result['minutes']:>8.1f}", flush=True)
        if run_lr > 0:
            deltas.append(after - before)
    if deltas:
        spread = f" (min {min(deltas):+.3f}, max {max(deltas):+.3f})" if len(deltas) > 1 else ""
        print(f"mean held-out gain over {len(deltas)} seed(s): {statistics.fmean(deltas):+.3f}{spread}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
