"""The rules that span several keys of a recipe, each written once: a combination that cannot
run is refused at the door, naming the key to change."""

from __future__ import annotations

from typing import TYPE_CHECKING

from opentinker.recipe.estimators import estimator_needs

if TYPE_CHECKING:
    from opentinker.recipe.spec import RecipeSpec


def cross_field_problem(spec: RecipeSpec, gpus: bool | None = None) -> tuple[str, str] | None:
    """The first rule spanning several keys that ``spec`` breaks: ``(the key to change, a message
    naming the keys)``, or None."""
    data, ar, trainer = spec.data, spec.actor_rollout_ref, spec.trainer
    rollout, actor = ar.rollout, ar.actor
    estimator = spec.algorithm.adv_estimator
    if estimator_needs(estimator).groups and rollout.n < 2:
        return "actor_rollout_ref.rollout.n", (f"algorithm.adv_estimator={estimator} compares the samples of one prompt, so it needs "
                f"actor_rollout_ref.rollout.n >= 2 (got {rollout.n}); raise rollout.n or use "
                "algorithm.adv_estimator=reinforce_plus_plus")
    if data.train_batch_size % actor.ppo_mini_batch_size:
        return "data.train_batch_size", (f"data.train_batch_size ({data.train_batch_size}) must be a multiple of "
                f"actor_rollout_ref.actor.ppo_mini_batch_size ({actor.ppo_mini_batch_size})")
    if rollout.compile_decode and rollout.slot_decode:
        return "actor_rollout_ref.rollout.slot_decode", ("actor_rollout_ref.rollout.compile_decode and "
                "actor_rollout_ref.rollout.slot_decode are two decode loops: set one of them")
    if rollout.val_n > 1 and rollout.val_temperature == 0:
        return "actor_rollout_ref.rollout.val_temperature", ("actor_rollout_ref.rollout.val_n > 1 needs actor_rollout_ref.rollout.val_temperature > 0 "
                "(greedy samples would all be the same)")
    if actor.strategy == "fsdp" and trainer.n_gpus_per_node < 1:
        return "trainer.n_gpus_per_node", ("actor_rollout_ref.actor.strategy=fsdp needs trainer.n_gpus_per_node >= 1 (ranks per node; with "
                "trainer.device=cpu, CPU processes)")
    if trainer.nnodes > 1 and actor.strategy != "fsdp":
        return "trainer.nnodes", (f"trainer.nnodes={trainer.nnodes} spreads FSDP ranks over nodes: it needs "
                "actor_rollout_ref.actor.strategy=fsdp")
    correction = spec.algorithm.rollout_correction
    if correction.rollout_rs is not None and correction.rollout_rs_threshold is None:
        return "algorithm.rollout_correction.rollout_rs_threshold", (f"algorithm.rollout_correction.rollout_rs={correction.rollout_rs} needs "
                "algorithm.rollout_correction.rollout_rs_threshold (the largest ratio kept, e.g. 2.0)")
    for key, betas in (("actor_rollout_ref.actor.optim.betas", actor.optim.betas),
                       ("critic.optim.betas", spec.critic.optim.betas)):
        if len(betas) != 2 or not all(isinstance(b, (int, float)) and not isinstance(b, bool) and 0 <= b < 1
                                      for b in betas):
            return key, f"config key '{key}' must be two numbers in [0, 1), got {list(betas)}"
    needed = data.max_prompt_length + data.max_response_length
    if rollout.max_model_len is not None and rollout.max_model_len < needed:
        return "actor_rollout_ref.rollout.max_model_len", (f"actor_rollout_ref.rollout.max_model_len ({rollout.max_model_len}) is shorter than "
                f"data.max_prompt_length + data.max_response_length ({needed}): a full sample would not fit")
    staleness = spec.async_training.max_staleness
    if staleness and spec.mode == "client":
        return "async_training.max_staleness", ("async_training.max_staleness > 0 draws each step's prompts ahead of the step, which a client-mode "
                "job cannot (its batches come one at a time): use mode='server' (the dataset uploaded with the "
                "job) or max_staleness=0")
    on_gpu = trainer.device == "cuda" or (trainer.device == "auto" and gpus is True)
    if staleness and rollout.name == "vllm" and rollout.placement == "colocated" and on_gpu:
        return "actor_rollout_ref.rollout.placement", ("async_training.max_staleness > 0 with vLLM on a GPU needs actor_rollout_ref.rollout.placement="
                "separate (a colocated engine sleeps while the update runs; an asynchronous one keeps generating)")
    return None
