"""Does training still learn? Reward before vs after, per environment and estimator, with seeds,
an lr = 0 control, and optionally the same at an older commit side by side.

For each environment (``arithmetic``: the built-in single-turn task; ``arithmetic_env``: the
same task as an env served over HTTP and played by the agent loop, which the tiny model can
already solve half the time, so the multi-turn path has a signal to learn from;
``guess_number`` and ``calculator``: multi-turn envs served over HTTP on 127.0.0.1, data-free
rows) and estimator
(``grpo``, ``gae``), ``--seeds`` runs of ``--steps`` steps with the quickstart's settings
(lr 3e-5, a KL loss) and one run with lr 0 (what the reward does when nothing learns: the
sampler's noise and the data's order). Each run is its own process. Printed per row: the mean
training reward of the first 10 and the last 10 steps (mean over seeds, with the spread across
seeds), their difference, and the lr = 0 control's difference.

``--compare-with REV`` runs the same grid on ``git worktree`` checkout of REV (same Python
environment, that commit's ``opentinker`` on the path) and prints it beside; a combination the
older code refuses (e.g. ``gae`` before the critic existed) shows ``n/a``. Run:

    python benchmarks/learning.py [--envs arithmetic,arithmetic_env,guess_number,calculator] [--estimators grpo,gae]
                                  [--seeds 3] [--steps 40] [--compare-with REV] [--override KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from _server import checkout  # noqa: E402

SETTINGS = ["actor_rollout_ref.actor.optim.lr=3e-5", "actor_rollout_ref.actor.use_kl_loss=true",
            "trainer.test_freq=-1", "trainer.val_before_train=false", "trainer.progress_bar=false",
            "trainer.device=cpu"]
# Multi-turn episodes: a few turns, a response budget that fits them.
MULTI_TURN = ["actor_rollout_ref.rollout.multi_turn.max_assistant_turns=4", "data.max_response_length=128",
              "data.max_prompt_length=512"]  # the calculator's system prompt is long
# The benchmark's env names -> the served env (games.BUILTIN_ENVIRONMENTS) each plays.
SERVED = {"arithmetic_env": "arithmetic", "guess_number": "guess_number", "calculator": "calculator"}
ESTIMATORS = {"grpo": ["algorithm.adv_estimator=grpo"],
              "gae": ["algorithm.adv_estimator=gae", "critic.optim.lr=1e-4"]}

# One run, in a fresh interpreter with the checkout under test first on the path. It uses only
# names that have existed since the agent loop landed, so older commits run it too.
RUN = r"""
import json, sys
spec = json.loads(sys.argv[1])
sys.path.insert(0, spec["root"])
from opentinker.config import make_config
try:
    from opentinker.engine.ppo.trainer import RLTrainer
except ImportError:  # --compare-with a commit from before engine/ppo/
    from opentinker.engine.trainer import RLTrainer

def rewards(trainer):
    try:
        return [m["reward/mean"] for m in trainer.fit() if "reward/mean" in m]
    finally:
        getattr(trainer, "close", lambda: None)()  # older commits had no close()

if spec["env"] == "arithmetic":
    result = rewards(RLTrainer(make_config(spec["overrides"])))
else:
    from opentinker.environments.games import BUILTIN_ENVIRONMENTS
    from opentinker.environments.gym_interaction import GymEnvironmentInteraction
    from opentinker.environments.server import running_env_server
    with running_env_server(BUILTIN_ENVIRONMENTS[spec["served"]]) as urls:
        rows = [{"extra_info": {"interaction_kwargs": {"name": "env"}}} for _ in range(512)]
        interaction = GymEnvironmentInteraction({"env_endpoint": urls[0]})
        result = rewards(RLTrainer(make_config(spec["overrides"]), train_rows=rows, interactions={"env": interaction}))
print("RESULT " + json.dumps(result))
"""


def run_one(root: Path, env: str, overrides: list[str], timeout_s: float) -> list[float] | str:
    """The run's rewards per step, or why it has none (the older code refused the config...)."""
    spec = {"root": str(root), "env": env, "served": SERVED.get(env), "overrides": overrides}
    try:
        done = subprocess.run([sys.executable, "-c", RUN, json.dumps(spec)], capture_output=True, text=True,
                              timeout=timeout_s, cwd=root)
    except subprocess.TimeoutExpired:
        return f"timed out after {timeout_s:g} s"
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    last = (done.stderr.strip().splitlines() or ["no output"])[-1]
    return f"failed: {last[:160]}"


def window_delta(rewards: list[float]) -> tuple[float, float]:
    width = min(10, len(rewards) // 2)
    return statistics.mean(rewards[:width]), statistics.mean(rewards[-width:])


def grid(root: Path, args, label: str) -> dict[tuple[str, str], dict]:
    results = {}
    for env in args.envs.split(","):
        for estimator in args.estimators.split(","):
            base = [*SETTINGS, *(MULTI_TURN if env != "arithmetic" else []), *ESTIMATORS[estimator],
                    f"trainer.total_training_steps={args.steps}", *args.override]
            runs = [run_one(root, env, [*base, f"trainer.seed={seed}", f"data.seed={seed}"], args.timeout)
                    for seed in range(args.seeds)]
            # lr = 0: the policy never moves (a critic may learn: it does not change what is sampled).
            control = run_one(root, env, [*base, "trainer.seed=0", "data.seed=0",
                                          "actor_rollout_ref.actor.optim.lr=0.0"], args.timeout)
            results[(env, estimator)] = {"runs": runs, "control": control}
            print(f"  [{label}] {env} {estimator}: done", flush=True)
    return results


def summary(entry: dict) -> str:
    runs = [r for r in entry["runs"] if isinstance(r, list)]
    if not runs:
        return f"n/a ({entry['runs'][0]})"
    firsts, lasts = zip(*(window_delta(r) for r in runs))
    deltas = [last - first for first, last in zip(firsts, lasts)]
    spread = statistics.stdev(deltas) if len(deltas) > 1 else 0.0
    control = entry["control"]
    control_text = f"{window_delta(control)[1] - window_delta(control)[0]:+.3f}" if isinstance(control, list) else "n/a"
    return (f"{statistics.mean(firsts):.3f} -> {statistics.mean(lasts):.3f} ({statistics.mean(deltas):+.3f} "
            f"± {spread:.3f}, {len(runs)} seeds; lr=0: {control_text})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--envs", default="arithmetic,arithmetic_env,guess_number,calculator")
    parser.add_argument("--estimators", default="grpo,gae")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--compare-with", default=None, help="a git revision to run side by side")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per run")
    parser.add_argument("--override", action="append", default=[], help="extra config overrides for every run")
    parser.add_argument("--no-head", action="store_true", help="only the --compare-with column")
    args = parser.parse_args()
    unknown = sorted(set(args.envs.split(",")) - {"arithmetic", *SERVED})
    if unknown:
        parser.error(f"--envs: unknown {', '.join(unknown)} (known: arithmetic, {', '.join(SERVED)})")
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    print(f"{args.steps} steps x {args.seeds} seeds (+1 at lr=0) per row; first-10 -> last-10 mean training reward",
          flush=True)
    columns = {} if args.no_head else {f"HEAD {head}": grid(ROOT, args, "HEAD")}
    if args.compare_with:
        with checkout(args.compare_with) as worktree:
            columns[args.compare_with] = grid(worktree, args, args.compare_with)
    for (env, estimator) in next(iter(columns.values())):
        print(f"{env} / {estimator}")
        for label, results in columns.items():
            print(f"  {label:<14} {summary(results[(env, estimator)])}")


if __name__ == "__main__":
    main()
