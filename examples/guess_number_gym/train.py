"""Multi-turn, data-free: guess-the-number served by its own env server (gym protocol).

    python examples/guess_number_gym/train.py [--steps 10]

The script starts the environment server itself on 127.0.0.1 (on a cluster, run
`python -m opentinker.environments.games guess_number --host 0.0.0.0 --port 8000` on any
machine the training server can reach, start the server with --allow-env-host for that host,
and point env_endpoint there). Rows carry no prompt:
the env's reset observation opens each chat; rewards come from the env. The embedded tiny
model is an arithmetic model and rarely wins; the GPU variant
("actor_rollout_ref.model.path": "Qwen/Qwen2.5-0.5B-Instruct", "rollout.name": "vllm") learns it.
"""

import argparse

from opentinker import GenericEnvironment, InteractionSpec
from opentinker.client.local_server import connect_or_start_local
from opentinker.environments.games import GuessNumberEnv
from opentinker.environments.server import running_env_server

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=10)
args = parser.parse_args()

with running_env_server(GuessNumberEnv, env_kwargs={"closer_bonus": 0.1}) as urls:
    env = GenericEnvironment(
        config={"actor_rollout_ref.actor.optim.lr": 3e-5, "data.max_response_length": 160,
                "actor_rollout_ref.rollout.multi_turn.max_assistant_turns": 6,
                "actor_rollout_ref.rollout.multi_turn.max_tokens_per_turn": 16, "trainer.test_freq": -1},
        interaction_specs=[InteractionSpec(name="guess", class_path="gym",
                                           config={"env_endpoint": urls[0], "max_steps": 8})],
        data_generator=lambda i: {"extra_info": {"interaction_kwargs": {"name": "guess"}}},
    )
    with connect_or_start_local() as client:
        env.setup(client)  # fails at once, naming the URL, if the server cannot reach the env
        job = client.submit(env, steps=args.steps)
        info = job.wait()
        turns = [m["metrics"].get("env/guess/turns_mean") for m in job.metrics() if m["step"] > 0]
        print(f"{info.status.value}; mean turns per episode by step: {turns}")
