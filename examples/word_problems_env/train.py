"""Word problems served by an env server, learned by a real pretrained model.

    make install-pretrained
    python examples/word_problems_env/train.py [--steps 20] [--model smollm2-135m-instruct]

The same task as `data.task=word_problems` (the quickstart's `--model smollm2-135m-instruct`
recipe trains that one), here as a single-turn env (gym protocol) that draws each problem at
/reset and scores the answer at /step: the env path and the data path learn the same thing.
The script starts the env server on 127.0.0.1 (elsewhere: `python -m opentinker.environments.games
word_problems --host 0.0.0.0 --port 8000`, and `--allow-env-host` on the training server) and a
local training server that serves the model, unless OPENTINKER_BASE_URL names one (which must
serve it: `opentinker-server serve --model smollm2-135m-instruct`).
"""

import argparse

from opentinker import GenericEnvironment, InteractionSpec
from opentinker.client.local_server import connect_or_start_local
from opentinker.client.quickstart import SMOLLM2_CONFIG
from opentinker.environments.games import WordProblemsEnv
from opentinker.environments.server import running_env_server

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=20)
parser.add_argument("--model", default="smollm2-135m-instruct", help="a model the server serves")
args = parser.parse_args()

with running_env_server(WordProblemsEnv, env_kwargs={"split": "train"}) as urls:
    config = {key: value for key, value in SMOLLM2_CONFIG.items() if key != "data.task"}
    env = GenericEnvironment(
        config={**config, "actor_rollout_ref.model.path": args.model, "trainer.test_freq": -1,
                # one answer per episode, as long as the data path's
                "actor_rollout_ref.rollout.multi_turn.max_assistant_turns": 1,
                "actor_rollout_ref.rollout.multi_turn.max_tokens_per_turn": config["data.max_response_length"]},
        interaction_specs=[InteractionSpec(name="word_problems", class_path="gym",
                                           config={"env_endpoint": urls[0], "max_steps": 1})],
        # Data-free: each episode's problem comes from the env's /reset (seeded per row).
        data_generator=lambda i: {"extra_info": {"interaction_kwargs": {"name": "word_problems"}}},
    )
    with connect_or_start_local(models=[args.model]) as client:
        env.setup(client)  # fails at once, naming the URL, if the server cannot reach the env
        job = client.submit(env, steps=args.steps)
        info = job.wait(progress=True)
        rewards = [round(m["metrics"]["reward/mean"], 3) for m in job.metrics() if "reward/mean" in m["metrics"]]
        print(f"{info.status.value}; reward by step: {rewards}")
