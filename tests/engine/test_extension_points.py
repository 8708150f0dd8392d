"""A new advantage estimator and a new rollout engine, each added in this one file: registered,
they are valid recipe values (the door applies the estimator's needs), and the trainer trains
with them on the real tiny model."""

from __future__ import annotations

import pytest
import torch

from opentinker.config import ConfigError, build_recipe
from opentinker.engine.algorithms import register_advantage_estimator
from opentinker.engine.rollout import RolloutBuild, register_rollout_engine, rollout_engine_kind
from opentinker.engine.rollout.builtin_engines import transformers_engine
from opentinker.engine.ppo.trainer import RLTrainer
from opentinker.recipe.estimators import EstimatorNeeds

FAST = {"data.train_batch_size": 2, "actor_rollout_ref.actor.ppo_mini_batch_size": 2, "actor_rollout_ref.rollout.n": 4,
        "data.val_batch_size": 8, "trainer.progress_bar": False, "trainer.device": "cpu",
        "actor_rollout_ref.actor.optim.lr": 1e-3}
CALLS: dict[str, int] = {"estimator": 0, "generate": 0}


@register_advantage_estimator("toy_centered", needs=EstimatorNeeds(groups=True), override=True)
def toy_centered(token_rewards, response_mask, group_index, **_):
    """Each sample's score minus its group's mean, on every model token."""
    CALLS["estimator"] += 1
    scores = token_rewards.sum(-1)
    groups = {key: [i for i, g in enumerate(group_index) if g == key] for key in dict.fromkeys(group_index)}
    centered = torch.zeros_like(scores)
    for rows in groups.values():
        centered[rows] = scores[rows] - scores[rows].mean()
    advantages = centered.unsqueeze(-1) * response_mask
    return advantages, advantages, {"toy/groups": float(len(groups))}


class CountingEngine:
    """The transformers engine, counting its generate calls."""

    def __init__(self, inner):
        self.inner = inner

    def generate(self, *args, **kwargs):
        CALLS["generate"] += 1
        return self.inner.generate(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.inner, name)


@register_rollout_engine("toy_counting", samples_while_training=False, override=True)
def toy_counting(build: RolloutBuild):
    return CountingEngine(transformers_engine(build))


def test_a_registered_estimator_is_a_recipe_value_whose_needs_the_door_applies():
    build_recipe({**FAST, "algorithm.adv_estimator": "toy_centered"})
    with pytest.raises(ConfigError, match="algorithm.adv_estimator=toy_centered compares the samples of one prompt"
                       ) as error:
        build_recipe({**FAST, "algorithm.adv_estimator": "toy_centered", "actor_rollout_ref.rollout.n": 1})
    assert error.value.key == "actor_rollout_ref.rollout.n"
    with pytest.raises(ConfigError, match="did you mean 'toy_centered'"):
        build_recipe({"algorithm.adv_estimator": "toy_centred"})


def test_a_registered_rollout_engine_is_a_recipe_value_with_its_capabilities():
    assert not rollout_engine_kind("toy_counting").samples_while_training
    assert rollout_engine_kind("vllm").samples_while_training
    with pytest.raises(ValueError, match="Did you mean 'toy_counting'"):
        rollout_engine_kind("toy_countin")


def test_an_engine_that_cannot_sample_while_training_is_refused_for_asynchronous_training(tiny_model_dir):
    with pytest.raises(ConfigError, match="the rollout engine 'toy_counting' cannot") as error:
        RLTrainer(build_recipe({**FAST, "actor_rollout_ref.rollout.name": "toy_counting",
                                "async_training.max_staleness": 1}))
    assert error.value.key == "async_training.max_staleness"


def test_the_trainer_trains_with_both(tiny_model_dir):
    calls = dict(CALLS)
    trainer = RLTrainer(build_recipe({**FAST, "algorithm.adv_estimator": "toy_centered",
                                      "actor_rollout_ref.rollout.name": "toy_counting"}))
    try:
        assert isinstance(trainer.rollout, CountingEngine)
        before = {k: v.clone() for bucket in trainer.backend.weights() for k, v in bucket}
        metrics = trainer.step()
        after = {k: v for bucket in trainer.backend.weights() for k, v in bucket}
    finally:
        trainer.close()
    assert CALLS["estimator"] == calls["estimator"] + 1 and CALLS["generate"] > calls["generate"]
    assert metrics["toy/groups"] == 2.0
    if metrics["reward/std"] > 0:  # a group with different rewards: a gradient, a step
        assert any(not torch.equal(before[k], after[k]) for k in before)
