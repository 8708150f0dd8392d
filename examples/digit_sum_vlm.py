"""GRPO of the embedded tiny vision-language model on pictures, through the thin client.

    python examples/digit_sum_vlm.py               # one seed (make run-vlm)
    python examples/digit_sum_vlm.py --seeds 0 1 2 # the README's table

Each row is a chat whose user turn holds a picture of two digits (a PNG data URL, drawn here
with Pillow) and the question "What is the sum of the two digits in the picture?"; the server
reads the pictures under its bounds, the tiny VLM (``tiny-vlm``) samples answers from them, and
the reward is 1 for the right sum. Held-out accuracy is measured before training and at the end.

Uses OPENTINKER_BASE_URL / OPENTINKER_API_KEY when set (a server started with
``--model tiny-vlm``); otherwise starts a local server serving it.
"""

from __future__ import annotations

import argparse

from opentinker import GenericEnvironment
from opentinker.client.local_server import connect_or_start_local
from opentinker.environments import digit_sum


def environment(seed: int, steps: int) -> GenericEnvironment:
    train = [p.as_row() for p in digit_sum.make_problems(512, digit_sum.TRAIN_SEED, "train")]
    heldout = [p.as_row() for p in digit_sum.make_problems(100, digit_sum.HELDOUT_SEED, "heldout")]
    return GenericEnvironment(
        config={
            "actor_rollout_ref.model.path": "tiny-vlm",
            "data.task": "digit_sum",  # scores each answer against reward_model.ground_truth
            "data.max_response_length": 8,
            "data.val_batch_size": len(heldout),
            "actor_rollout_ref.actor.optim.lr": 3e-5,
            "trainer.test_freq": steps,
            "trainer.seed": seed,
            "data.seed": seed,
        },
        dataset=train,
        val_dataset=heldout,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    results = []
    with connect_or_start_local(models=["tiny-vlm"]) as client:
        for seed in args.seeds:
            handle = client.submit(environment(seed, args.steps), steps=args.steps, name=f"digit-sum-vlm-{seed}")
            info = handle.wait()
            accuracy = [m["metrics"]["val/accuracy"] for m in handle.metrics() if "val/accuracy" in m["metrics"]]
            results.append((seed, info.status.value, accuracy[0], accuracy[-1]))
            print(f"seed {seed}: {info.status.value}, held-out accuracy {accuracy[0]:.2f} -> {accuracy[-1]:.2f}",
                  flush=True)
    print("| seed | held-out before | after |\n|---|---|---|")
    for seed, _, before, after in results:
        print(f"| {seed} | {before:.2f} | {after:.2f} |")


if __name__ == "__main__":
    main()
