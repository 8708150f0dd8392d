"""Warnings a user hears while a step goes wrong quietly: episodes lost to the env's own errors,
every reward the same, every prompt the same (an env that ignores its seed). A real trainer on
the tiny model against real env servers, and the repetition rule on its own."""

from __future__ import annotations

from opentinker.config import make_config
from opentinker.engine.agent_loop import Trajectory
from opentinker.engine.data import Prompt
from opentinker.engine.ppo.step import StepSamples
from opentinker.engine.ppo.step_warnings import REPEAT_EVERY, StepWarnings
from opentinker.engine.ppo.trainer import RLTrainer
from opentinker.environments.games import ArithmeticEnv
from opentinker.environments.gym_interaction import GymEnvironmentInteraction
from opentinker.environments.server import running_env_server

SMALL = ["trainer.progress_bar=false", "trainer.test_freq=-1", "data.max_response_length=16",
         "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=1", "data.train_batch_size=2",
         "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.rollout.n=2"]


class SeedlessEnv(ArithmeticEnv):
    """Ignores the seed it is reset with (always 2 + 3), and never rewards."""

    def reset(self, seed=None, **kwargs):
        return super().reset(a=2, b=3)

    def step(self, action):
        observation, _, done, info = super().step(action)
        return observation, 0.0, done, info


class HalfBrokenEnv(ArithmeticEnv):
    """Its own error for every other episode: the step raises (HTTP 500)."""

    count = 0

    def step(self, action):
        HalfBrokenEnv.count += 1
        if HalfBrokenEnv.count % 2:
            raise RuntimeError("the simulator tripped")
        return super().step(action)


def rows(count: int) -> list[dict]:
    return [{"extra_info": {"interaction_kwargs": {"name": "arith"}}} for _ in range(count)]


def train(env_class: type, steps: int) -> tuple[list[dict], list[str]]:
    with running_env_server(env_class) as (url,):
        with RLTrainer(make_config([*SMALL, f"trainer.total_training_steps={steps}"]), train_rows=rows(8),
                       interactions={"arith": GymEnvironmentInteraction({"env_endpoint": url, "retries": 0})}) as trainer:
            warnings: list[str] = []
            trainer.on_warning = warnings.append
            return trainer.fit(), warnings


def test_an_env_that_ignores_its_seed_and_never_rewards_is_named_while_it_happens(tiny_model_dir):
    history, warnings = train(SeedlessEnv, 3)
    assert len(history) == 3
    assert warnings == [
        "step 1: every reward is 0 (4 samples): advantages are zero and the step teaches nothing; check the reward "
        "function or the env's rewards",
        "step 1: all 2 prompts of the step are the same text; an env that writes the prompt should draw it from the "
        "seed it is reset with (each prompt gets its own)",
    ]  # said once when it began, not at every step


def test_episodes_lost_to_the_envs_own_errors_are_said_at_each_step(tiny_model_dir):
    history, warnings = train(HalfBrokenEnv, 2)
    lost = [w for w in warnings if "error of the env's own" in w]
    assert [w.split(":")[0] for w in lost] == ["step 1", "step 2"]
    assert all(" 2 of 4 episodes ended in an error of the env's own and are left out of the step "
               "(http://127.0.0.1:" in w and " x2); last error: environment server " in w
               and "HTTP 500: RuntimeError: the simulator tripped" in w for w in lost)
    assert [m["env/arith/env_errors"] for m in history] == [2, 2]


def _rollout(rewards: list[float], prompts: list[list[int]]) -> StepSamples:
    trajectories = [Trajectory(prompt_ids=ids, response_ids=[1], response_mask=[1], rollout_logprobs=[0.0],
                               reward=reward, turn_rewards=[reward], num_turns=1, stop_reason="env_done", messages=[])
                    for reward, ids in zip(rewards, prompts)]
    prompt_rows = [Prompt(uid=f"p{i // 2}", prompt_ids=ids, row={}) for i, ids in enumerate(prompts)]
    return StepSamples(prompt_rows, trajectories, [""] * len(rewards), [None] * len(rewards))


def test_a_lasting_condition_is_repeated_every_so_many_steps_and_its_end_said_once():
    said: list[str] = []
    warnings = StepWarnings(said.append)
    flat = _rollout([1.0] * 4, [[1], [1], [2], [2]])
    for step in range(1, REPEAT_EVERY + 3):
        warnings.check(step, flat)
    warnings.check(REPEAT_EVERY + 3, _rollout([1.0, 0.0, 1.0, 1.0], [[1], [1], [2], [2]]))
    assert [s.split(":")[0] for s in said] == ["step 1", f"step {REPEAT_EVERY + 1}", f"step {REPEAT_EVERY + 3}"]
    assert said[1].endswith("every reward has been the same in each step since step 1")
    assert said[2].endswith("rewards differ again")
