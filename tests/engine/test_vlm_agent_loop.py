"""Pictures from an environment: the tiny VLM plays the digit-sum env (a picture in the reset
observation and one in the next env turn) over the gym protocol on 127.0.0.1. Each turn's
pictures enter the context of the next generation, env tokens (the pictures' included) stay
mask 0, the rollout's logprobs are the training forward's, the step trains; a picture the env
should not have sent leaves its trajectory out by name, and the step goes on."""

from __future__ import annotations

import base64

import pytest

torch = pytest.importorskip("torch")

from opentinker.config import make_config  # noqa: E402
from opentinker.engine.backend.forward import ResponseScorer  # noqa: E402
from opentinker.engine.ppo.trainer import RLTrainer  # noqa: E402
from opentinker.engine.ppo.update_stage import to_batch  # noqa: E402
from opentinker.environments.games import DigitSumEnv  # noqa: E402
from opentinker.environments.gym_interaction import GymEnvironmentInteraction  # noqa: E402
from opentinker.environments.server import running_env_server  # noqa: E402

CONFIG = ["trainer.progress_bar=false", "actor_rollout_ref.model.path=tiny-vlm", "trainer.test_freq=-1",
          "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=2", "data.max_response_length=64",
          "actor_rollout_ref.rollout.multi_turn.max_tokens_per_turn=6", "data.max_prompt_length=128"]


def rows(count: int, name: str) -> list[dict]:
    return [{"extra_info": {"interaction_kwargs": {"name": name}}} for _ in range(count)]


class BadPictureEnv(DigitSumEnv):
    """Its second turn's picture is a PNG whose header says 100000 x 100000 (a bomb's shape)."""

    def step(self, action):
        observation, reward, done, info = super().step(action)
        if isinstance(observation, dict):
            header = bytes.fromhex("89504e470d0a1a0a0000000d49484452") + (100_000).to_bytes(4, "big") * 2
            observation["images"] = ["data:image/png;base64," + base64.b64encode(header + b"\0" * 64).decode()]
        return observation, reward, done, info


def test_pictures_in_env_turns_enter_the_context_and_the_step_trains(tiny_model_dir):
    with running_env_server(DigitSumEnv) as urls, RLTrainer(
            make_config([*CONFIG, "trainer.total_training_steps=2"]), train_rows=rows(64, "digits"),
            interactions={"digits": GymEnvironmentInteraction({"env_endpoint": urls[0], "retries": 0})}) as trainer:
        samples = trainer.generate(trainer.tokenize_batch(rows(2, "digits")), 2)
        image_token = trainer.pictures.layout.image_token_id
        for trajectory in samples.trajectories:
            assert trajectory.stop_reason == "env_done", trajectory.info
            assert trajectory.images is not None and trajectory.images.grids == ((1, 4, 8), (1, 4, 8))
            assert trajectory.prompt_ids.count(image_token) == 8  # the reset's picture
            in_response = [i for i, token in enumerate(trajectory.response_ids) if token == image_token]
            assert len(in_response) == 8 and all(trajectory.response_mask[i] == 0 for i in in_response)
            second_turn = next(m for m in trajectory.messages[2:] if m["role"] == "user")
            assert second_turn["content"][0]["type"] == "image"  # the env turn's picture, then its text
        batch = to_batch(samples)
        with torch.no_grad():
            trained = ResponseScorer(trainer.tokenizer.pad_token_id, torch.device("cpu"))(
                trainer.backend.model, batch, 1.0, False)[0]
        assert float(((trained - batch.tensors["rollout_logprobs"]) * batch.response_mask).abs().max()) < 1e-5
        history = trainer.fit()
    assert [m["actor/optimizer_steps"] for m in history] == [1, 1]
    assert all(m["rollout/excluded_trajectories"] == 0 for m in history)


def test_a_picture_the_env_should_not_send_leaves_its_trajectory_out(tiny_model_dir):
    with running_env_server(BadPictureEnv) as urls, RLTrainer(
            make_config([*CONFIG, "trainer.total_training_steps=1"]), train_rows=rows(64, "bad"),
            interactions={"bad": GymEnvironmentInteraction({"env_endpoint": urls[0], "retries": 0})}) as trainer:
        samples = trainer.generate(trainer.tokenize_batch(rows(2, "bad")), 2)
    for trajectory in samples.trajectories:
        assert trajectory.stop_reason == "env_error" and trajectory.excluded
        assert "a picture of the conversation: a picture" in trajectory.info["error"]


PICTURE_ENV = '''
import json, random, re, sys

from pydantic import Field
from openenv.core.env_server.http_server import create_fastapi_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State

PROBLEMS = json.loads(%r)  # [[a, b, data URL of the picture], ...]


class SumAction(Action):
    answer: str = Field(max_length=200)


class SumObservation(Observation):
    text: str = ""
    image: str = ""


class SumEnv(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self):
        super().__init__()
        self._state = State(episode_id=None, step_count=0)

    def reset(self, seed=None, episode_id=None, **kwargs):
        self.a, self.b, picture = random.Random(seed).choice(PROBLEMS)
        self._state = State(episode_id=episode_id, step_count=0)
        return SumObservation(text="What is the sum of the two digits in the picture?", image=picture)

    def step(self, action, timeout_s=None, **kwargs):
        found = re.search(r"-?\\d+", action.answer)
        right = found is not None and int(found.group(0)) == self.a + self.b
        return SumObservation(text="Right." if right else "Wrong.", reward=1.0 if right else 0.0, done=True)

    @property
    def state(self):
        return self._state


app = create_fastapi_app(SumEnv, SumAction, SumObservation, max_concurrent_envs=int(sys.argv[2]))

if __name__ == "__main__":
    import uvicorn

    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
'''


def test_an_openenv_env_with_an_image_field_trains(tiny_model_dir, tmp_path):
    """The picture comes in the observation's ``image`` field, found from /schema."""
    import json

    from opentinker.environments import digit_sum
    from opentinker.environments.openenv_interaction import OpenEnvInteraction
    from opentinker.images import image_part

    from ..environments.openenv_server import running_openenv_server

    problems = [[p.a, p.b, image_part(p.png())["image"]] for p in digit_sum.make_problems(16, digit_sum.TRAIN_SEED)]
    with running_openenv_server(tmp_path, source=PICTURE_ENV % json.dumps(problems)) as live, RLTrainer(
            make_config([*CONFIG, "trainer.total_training_steps=2",
                         "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=1"]),
            train_rows=rows(64, "sums"),
            interactions={"sums": OpenEnvInteraction({"env_endpoint": live.url})}) as trainer:
        samples = trainer.generate(trainer.tokenize_batch(rows(2, "sums")), 2)
        history = trainer.fit()
    for trajectory in samples.trajectories:
        assert trajectory.stop_reason == "env_done", trajectory.info
        assert trajectory.images is not None and trajectory.images.grids == ((1, 4, 8),)
        opening = trajectory.messages[-2]["content"]
        assert opening[0]["type"] == "image" and opening[1]["text"].startswith("What is the sum")
    assert [m["actor/optimizer_steps"] for m in history] == [1, 1]
    assert all(m["rollout/excluded_trajectories"] == 0 for m in history)
    assert sum(m["reward/mean"] for m in history) > 0  # the warm model reads some pictures right
