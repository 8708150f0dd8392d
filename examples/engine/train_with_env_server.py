"""Train the embedded tiny model against an HTTP environment server, in one process.

    python examples/engine/train_with_env_server.py                 # arithmetic env, 40 steps
    python examples/engine/train_with_env_server.py --env guess_number --steps 10

The environment runs as a real server on 127.0.0.1 (the same `serve_environment` helper you
would run on another machine: `python -m opentinker.environments.games arithmetic --port 8000`).
Dataset rows carry no prompt: each chat opens with the environment's reset observation, and
the reward comes from the environment. On a GPU node, add
`actor_rollout_ref.model.path=Qwen/Qwen2.5-0.5B-Instruct` to the overrides.
"""

from __future__ import annotations

import argparse

from opentinker.config import make_config
from opentinker.engine.ppo.trainer import RLTrainer
from opentinker.environments.games import BUILTIN_ENVIRONMENTS
from opentinker.environments.gym_interaction import GymEnvironmentInteraction
from opentinker.environments.server import running_env_server


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--env", choices=sorted(BUILTIN_ENVIRONMENTS), default="arithmetic")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("overrides", nargs="*", help="extra key=value config overrides")
    args = parser.parse_args()

    multi_turn = args.env not in ("arithmetic", "word_problems")  # the single-turn ones
    with running_env_server(BUILTIN_ENVIRONMENTS[args.env]) as urls:
        print(f"{args.env} environment server at {urls[0]}")
        cfg = make_config([
            f"trainer.total_training_steps={args.steps}",
            "trainer.test_freq=20",
            "data.val_batch_size=64",
            "actor_rollout_ref.actor.optim.lr=3e-5",
            "actor_rollout_ref.actor.use_kl_loss=true",
            f"actor_rollout_ref.rollout.multi_turn.max_assistant_turns={6 if multi_turn else 1}",
            f"data.max_response_length={160 if multi_turn else 16}",
            *args.overrides,
        ])
        rows = [{"extra_info": {"interaction_kwargs": {"name": args.env}}} for _ in range(512)]
        interaction = GymEnvironmentInteraction({"env_endpoint": urls[0]})
        with RLTrainer(cfg, train_rows=rows, val_rows=rows[:64], interactions={args.env: interaction}) as trainer:
            history = trainer.fit()
    rewards = [m[f"env/{args.env}/reward_mean"] for m in history if f"env/{args.env}/reward_mean" in m]
    quarter = max(1, len(rewards) // 4)
    print(f"env reward: first {quarter} steps {sum(rewards[:quarter]) / quarter:.3f} -> "
          f"last {quarter} steps {sum(rewards[-quarter:]) / quarter:.3f}")


if __name__ == "__main__":
    main()
