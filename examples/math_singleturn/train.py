"""Single-turn math: the model answers, a SimpleTextEnvironment scores it (math equivalence).

    python examples/math_singleturn/train.py [--steps 40] [--mode client]

`--mode client` pushes every step's batch from this script's dataloader instead of uploading
the dataset. GPU variant (a server started with --model Qwen/Qwen2.5-0.5B-Instruct): add
"actor_rollout_ref.model.path": "Qwen/Qwen2.5-0.5B-Instruct",
"actor_rollout_ref.rollout.name": "vllm", "data.max_response_length": 512, and a real dataset
(a JSONL file of rows like the ones below) as `dataset="train.jsonl"`.
"""

import argparse

from opentinker import GenericEnvironment, InteractionSpec
from opentinker.client.local_server import connect_or_start_local
from opentinker.environments.arithmetic import make_problems

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=40)
parser.add_argument("--mode", choices=["server", "client"], default="server")
args = parser.parse_args()

rows = [
    {"prompt": p.messages(), "extra_info": {"interaction_kwargs": {"name": "math", "ground_truth": p.answer}}}
    for p in make_problems(1024, seed=1)
]
env = GenericEnvironment(
    config={"actor_rollout_ref.actor.optim.lr": 3e-5, "actor_rollout_ref.actor.use_kl_loss": True,
            "trainer.test_freq": 20},
    interaction_specs=[InteractionSpec(name="math", class_path="simple_text", config={"scorer": "math"})],
    dataset=rows[:960],
    val_dataset=rows[960:],
)
with connect_or_start_local() as client:
    env.setup(client)
    job = client.submit(env, steps=args.steps, mode=args.mode)
    info = job.wait()
    val = [m["metrics"]["val/accuracy"] for m in job.metrics() if "val/accuracy" in m["metrics"]]
    print(f"{info.status.value}; held-out accuracy {val[0]:.3f} -> {val[-1]:.3f}" if len(val) > 1 else info.status.value)
