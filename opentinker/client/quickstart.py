"""``opentinker quickstart``: the whole service on one machine, end to end, in a few minutes.

Starts ``opentinker-server`` on a free loopback port with the embedded tiny model, creates a
user and an API key, trains a short GRPO job on arithmetic through the thin client (with a
progress bar), writes the reward curve as a PNG, downloads the final checkpoint, and shuts
the server down. Needs the server extra (``pip install "opentinker[server]"``); the PNG needs
matplotlib, the ``plot`` extra (without it the quickstart says how to get it and goes on).
"""

from __future__ import annotations

from pathlib import Path

from opentinker.client.client import OpenTinkerClient
from opentinker.client.environment import GenericEnvironment
from opentinker.client.local_server import local_server
from opentinker.client.plot import PlotUnavailableError, write_curve_png

# Tuned for the embedded tiny model (the config defaults are verl's, sized for real LLMs).
QUICKSTART_CONFIG = {
    "algorithm.adv_estimator": "grpo",
    "actor_rollout_ref.rollout.n": 8,
    "data.train_batch_size": 8,
    "actor_rollout_ref.actor.ppo_mini_batch_size": 8,
    "actor_rollout_ref.actor.optim.lr": 3e-5,
    "actor_rollout_ref.actor.use_kl_loss": True,
    "trainer.test_freq": 25,
    "data.val_batch_size": 200,
}


def run_quickstart(steps: int = 150, out_dir: str | Path = "opentinker-quickstart", port: int | None = None) -> Path:
    out = Path(out_dir).resolve()
    with local_server(out / "server", port=port) as (url, api_key):
        return _train(url, api_key, steps, out)


def _train(url: str, api_key: str, steps: int, out: Path) -> Path:
    client = OpenTinkerClient(url, api_key)
    env = GenericEnvironment({**QUICKSTART_CONFIG, "trainer.total_training_steps": steps})
    print(f"[quickstart] training the tiny model with GRPO on arithmetic for {steps} steps", flush=True)
    job = client.submit(env)
    final = job.wait(progress=True)
    metrics = job.metrics()
    points = [(m["step"], m["metrics"]["reward/mean"]) for m in metrics
              if m.get("step", 0) > 0 and isinstance(m["metrics"].get("reward/mean"), (int, float))]
    steps, rewards = [step for step, _ in points], [reward for _, reward in points]
    accuracy = [m["metrics"]["val/accuracy"] for m in metrics if "val/accuracy" in m["metrics"]]
    try:
        curve: Path | str = write_curve_png(rewards, out / "reward_curve.png", steps=steps,
                                            metric="reward/mean", title=f"GRPO on arithmetic, job {final.job_id}")
    except PlotUnavailableError as error:
        curve = f"not drawn: {error}"
    checkpoint = job.download_checkpoint(dest=out / "checkpoint")
    quarter = max(1, len(rewards) // 4)
    print(f"[quickstart] job {final.job_id}: {final.status.value} after {final.step} steps")
    print(f"[quickstart] train reward: first {quarter} steps {sum(rewards[:quarter]) / quarter:.3f} -> "
          f"last {quarter} steps {sum(rewards[-quarter:]) / quarter:.3f}")
    if len(accuracy) >= 2:
        print(f"[quickstart] held-out accuracy: {accuracy[0]:.3f} -> {accuracy[-1]:.3f}")
    print(f"[quickstart] reward curve: {curve}")
    print(f"[quickstart] checkpoint (a Hugging Face folder): {checkpoint}")
    return checkpoint
