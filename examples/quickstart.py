"""The Quick Start: describe an environment, set it up against a server, stream a job.

    python examples/quickstart.py

Uses OPENTINKER_BASE_URL / OPENTINKER_API_KEY when set; otherwise starts a local server with
the embedded tiny model (needs `pip install "opentinker[server]"`). On a GPU server that
serves it (`opentinker-server serve --model Qwen/Qwen2.5-0.5B-Instruct`; `opentinker models`
lists what a server serves), add "actor_rollout_ref.model.path": "Qwen/Qwen2.5-0.5B-Instruct"
and "actor_rollout_ref.rollout.name": "vllm" to the config.
"""

from opentinker import GenericEnvironment, InteractionSpec
from opentinker.client.local_server import connect_or_start_local
from opentinker.environments.arithmetic import make_problems

# Each row: the chat prompt, and which interaction grades it with what ground truth.
rows = [
    {"prompt": p.messages(), "extra_info": {"interaction_kwargs": {"name": "math", "ground_truth": p.answer}}}
    for p in make_problems(512, seed=1)
]

env = GenericEnvironment(
    config={
        "algorithm.adv_estimator": "grpo",
        "actor_rollout_ref.rollout.n": 8,
        "data.train_batch_size": 8,
        "actor_rollout_ref.actor.ppo_mini_batch_size": 8,
        "actor_rollout_ref.actor.optim.lr": 3e-5,
        "actor_rollout_ref.actor.use_kl_loss": True,
        "trainer.test_freq": 10,
    },
    interaction_specs=[InteractionSpec(name="math", class_path="simple_text", config={"scorer": "math"})],
    dataset=rows[:448],
    val_dataset=rows[448:],
)

with connect_or_start_local() as client:
    env.setup(client)  # checks the specs (and env endpoints) from the server
    info = client.fit(env, steps=30)  # streams progress with reward and kl
    print(f"job {info.job_id}: {info.status.value} after {info.step} steps")
