"""Train a short job, then talk to it with the official ``openai`` client (pip install openai).

    python examples/serving/chat_with_a_job.py                 # a local server with the tiny model
    OPENTINKER_BASE_URL=... OPENTINKER_API_KEY=... python examples/serving/chat_with_a_job.py --remote

The job's id is the model name: its current weights (newest checkpoint once it has stopped);
``JOB_ID/global_step_N`` names one checkpoint.
"""

from __future__ import annotations

import argparse
import contextlib
import os

from openai import OpenAI

from opentinker import GenericEnvironment, OpenTinkerClient
from opentinker.environments.arithmetic import make_problems

CONFIG = {"data.train_batch_size": 4, "actor_rollout_ref.actor.ppo_mini_batch_size": 4, "actor_rollout_ref.rollout.n": 4,
          "trainer.save_freq": 5,
          "actor_rollout_ref.actor.optim.lr": 3e-5}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--remote", action="store_true", help="use $OPENTINKER_BASE_URL instead of a local server")
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    with contextlib.ExitStack() as stack:
        if args.remote:
            url, key = os.environ["OPENTINKER_BASE_URL"], os.environ["OPENTINKER_API_KEY"]
        else:
            from opentinker.client.local_server import local_server

            url, key = stack.enter_context(local_server("opentinker-serving-example"))
        client = stack.enter_context(OpenTinkerClient(url, key))
        env = GenericEnvironment(CONFIG, dataset=[p.as_row() for p in make_problems(64, seed=1)])
        job = client.submit(env, steps=args.steps)
        job.wait()

        llm = OpenAI(base_url=f"{url}/v1", api_key=key)
        question = [{"role": "user", "content": "What is 12 + 30?"}]
        reply = llm.chat.completions.create(model=job.job_id, messages=question, temperature=0, max_tokens=32)
        print("final weights:", reply.choices[0].message.content)
        print("step 5, streamed: ", end="")
        for chunk in llm.chat.completions.create(model=f"{job.job_id}/global_step_5", messages=question,
                                                 max_tokens=32, stream=True):
            if chunk.choices and chunk.choices[0].delta.content:
                print(chunk.choices[0].delta.content, end="", flush=True)
        print(f"\nnow try: opentinker chat {job.job_id} --base-url {url} --api-key <key>")


if __name__ == "__main__":
    main()
