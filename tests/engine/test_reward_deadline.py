"""Reward functions and env calls with a deadline: a call that hangs costs its sample, never the step."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from opentinker.config import make_config
from opentinker.engine.ppo.reward_deadline import TIMED_OUT, DeadlineScorer, RewardTimeoutError
from opentinker.engine.ppo.trainer import RLTrainer
from opentinker.environments.interaction import Interaction

NEVER = threading.Event()  # never set: a call waiting on it hangs forever


def test_calls_past_their_deadline_are_given_up_and_the_rest_scored():
    def score(x):
        if x == 3:
            NEVER.wait()
        return x * 2

    scorer = DeadlineScorer(score, timeout_s=0.5, workers=4)
    start = time.monotonic()
    assert scorer.score([(x,) for x in range(10)]) == [0, 2, 4, TIMED_OUT, 8, 10, 12, 14, 16, 18]
    assert time.monotonic() - start < 5  # one deadline, not one per call


def test_an_exception_in_the_scorer_is_raised_not_taken_for_a_timeout():
    def score(x):
        raise KeyError("no answer field")

    with pytest.raises(KeyError, match="no answer field"):
        DeadlineScorer(score, timeout_s=5).score([(1,)])


def test_a_scorer_that_keeps_hanging_fails_clearly_instead_of_piling_up_threads():
    def hang(x):
        NEVER.wait()

    scorer = DeadlineScorer(hang, timeout_s=0.05, workers=4, max_abandoned=4)
    assert scorer.score([(x,) for x in range(4)]) == [TIMED_OUT] * 4
    with pytest.raises(RewardTimeoutError, match="hang.*still running past their 0.05 s deadline"):
        scorer.score([(0,)])


def test_a_reward_function_that_hangs_on_one_sample_in_64_costs_that_sample_only(tiny_model_dir):
    from opentinker.engine.data import builtin_task

    _, _, reward = builtin_task("arithmetic", val_count=8)
    calls = iter(range(10**6))
    lock = threading.Lock()

    def sometimes_hangs(text, row):
        with lock:
            call = next(calls)
        if call == 5:  # the 6th sample of the first step
            NEVER.wait()
        return reward(text, row)

    warnings = []
    trainer = RLTrainer(make_config(["trainer.progress_bar=false", "trainer.test_freq=-1", "data.train_batch_size=8",
                                     "actor_rollout_ref.rollout.n=8", "trainer.total_training_steps=1",
                                     "reward_model.timeout_s=2"]), reward_fn=sometimes_hangs)
    trainer.on_warning = warnings.append
    start = time.monotonic()
    [metrics] = trainer.fit()
    assert time.monotonic() - start < 120  # the step finished (it would wait forever without a deadline)
    assert metrics["rollout/reward_timeouts"] == 1 and metrics["rollout/excluded_trajectories"] == 1
    assert metrics["actor/optimizer_steps"] == 1 and metrics["train/skipped"] == 0.0
    assert len(warnings) == 1 and "sometimes_hangs" in warnings[0] and "1 of 64 samples" in warnings[0]
    trainer.close()


class SometimesHangs(Interaction):
    """One turn; the third episode's step never answers."""

    def __init__(self, config=None):
        super().__init__(config)
        self.episodes = 0

    async def start_interaction(self, instance_id=None, **kwargs):
        self.episodes += 1
        if self.episodes == 3:
            self._rewards[instance_id] = None  # marks the one that hangs
        return await super().start_interaction(instance_id, **kwargs)

    async def generate_response(self, instance_id, messages, **kwargs):
        if instance_id in self._rewards and self._rewards[instance_id] is None:
            await asyncio.Event().wait()  # forever
        return True, "", 1.0, {}


def test_an_env_call_past_the_interactions_timeout_costs_that_sample_only(tiny_model_dir):
    from opentinker.environments.registry import InteractionRegistry

    with pytest.raises(ValueError, match="timeout_s of interaction 'slow'"):
        registry = InteractionRegistry()
        registry.register("hangs", SometimesHangs)
        registry.build([{"name": "slow", "class_path": "hangs", "config": {"timeout_s": -1}}])
    warnings = []
    rows = [{"prompt": [{"role": "user", "content": "1+1="}], "extra_info": {"interaction_kwargs": {"name": "slow"}}}
            for _ in range(8)]
    trainer = RLTrainer(make_config(["trainer.progress_bar=false", "trainer.test_freq=-1", "data.train_batch_size=2",
                                     "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
                                     "trainer.total_training_steps=1",
                                     "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=1"]),
                        train_rows=rows, interactions={"slow": SometimesHangs({"name": "slow", "timeout_s": 1})})
    trainer.on_warning = warnings.append
    [metrics] = trainer.fit()
    trainer.close()
    assert metrics["env/slow/env_errors"] == 1 and metrics["rollout/excluded_trajectories"] == 1
    assert metrics["actor/optimizer_steps"] == 1
    lost = [w for w in warnings if "error of the env's own" in w]
    assert lost == ["step 1: 1 of 8 episodes ended in an error of the env's own and are left out of the step "
                    "(interaction 'slow' x1; 1 ran past their interaction timeout_s); last error: environment "
                    "server interaction 'slow' failed: no answer within the interaction's deadline of 1 s (timeout_s)"]
