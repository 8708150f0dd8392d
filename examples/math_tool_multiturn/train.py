"""Multi-turn tool use: word problems with a calculator tool served by an env server.

    python examples/math_tool_multiturn/train.py [--steps 10]

The model may write <tool_call>calc(12*7)</tool_call>; the env answers
<tool_response>84</tool_response> (evaluated safely, never with eval) and grades the final
"#### N". Only the model's tokens carry loss. GPU variant (served with --model
Qwen/Qwen2.5-1.5B-Instruct): "actor_rollout_ref.model.path": "Qwen/Qwen2.5-1.5B-Instruct", "actor_rollout_ref.rollout.name": "vllm",
"data.max_response_length": 1024.
"""

import argparse

from opentinker import GenericEnvironment, InteractionSpec
from opentinker.client.local_server import connect_or_start_local
from opentinker.environments.games import CalculatorEnv
from opentinker.environments.server import running_env_server

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=10)
args = parser.parse_args()

with running_env_server(CalculatorEnv) as urls:
    env = GenericEnvironment(
        config={"actor_rollout_ref.actor.optim.lr": 3e-5, "data.max_response_length": 192,
                "actor_rollout_ref.rollout.multi_turn.max_assistant_turns": 4,
                "actor_rollout_ref.rollout.multi_turn.max_tokens_per_turn": 48, "trainer.test_freq": -1},
        interaction_specs=[InteractionSpec(name="calc", class_path="gym", config={"env_endpoint": urls[0]})],
        data_generator=lambda i: {"extra_info": {"interaction_kwargs": {"name": "calc"}}},
    )
    with connect_or_start_local() as client:
        env.setup(client)
        info = client.fit(env, steps=args.steps)
        print(f"{info.status.value} after {info.step} steps")
