"""A server serving the embedded tiny VLM (``--model tiny-vlm``): a GRPO job whose rows carry
pictures trains through the thin client, and the door refuses bad pictures by name before any
job exists (the operator's bounds), as it refuses pictures for a text model."""

from __future__ import annotations

import io

import pytest

from opentinker import GenericEnvironment, OpenTinkerClient
from opentinker.client.errors import DatasetError, ValidationError
from opentinker.environments import digit_sum
from opentinker.images import image_part

PIL = pytest.importorskip("PIL")

CONFIG = {"actor_rollout_ref.model.path": "tiny-vlm", "data.task": "digit_sum", "data.max_response_length": 8,
          "data.train_batch_size": 4, "actor_rollout_ref.rollout.n": 4, "actor_rollout_ref.actor.ppo_mini_batch_size": 4,
          "trainer.test_freq": 3, "data.val_batch_size": 16, "trainer.save_freq": 3}


def _rows(count: int, seed: int = digit_sum.TRAIN_SEED, split: str = "train") -> list[dict]:
    return [p.as_row() for p in digit_sum.make_problems(count, seed, split)]


def _with_picture(row: dict, picture: dict, copies: int = 1) -> dict:
    text = row["prompt"][0]["content"][-1]
    return {**row, "prompt": [{"role": "user", "content": [picture] * copies + [text]}]}


@pytest.fixture
def server(ray_cluster, tmp_path, helpers):
    """A live server with the real job runner."""
    live = helpers.LiveServer(helpers.test_settings(tmp_path, models=["tiny-vlm"], max_image_pixels=100 * 100,
                                                    max_images_per_row=2), runner_cls=None).start()
    try:
        yield live
    finally:
        live.stop()


def test_a_job_with_pictures_trains_and_bad_pictures_are_refused_at_the_door(server, tmp_path, helpers):
    key = helpers.make_user(tmp_path, "vera")
    with OpenTinkerClient(server.url, key) as client:
        handle = client.submit(GenericEnvironment(CONFIG, dataset=_rows(32),
                                                  val_dataset=_rows(16, digit_sum.HELDOUT_SEED, "heldout")), steps=3)
        info = handle.wait(progress=False)
        assert info.status.value == "completed", info
        metrics = [m["metrics"] for m in handle.metrics()]
        assert [m["val/accuracy"] for m in metrics if "val/accuracy" in m][0] > 0.2  # the warm model reads them
        assert all(0 <= m["reward/mean"] <= 1 for m in metrics if "reward/mean" in m)

        good = _rows(1)[0]
        big = io.BytesIO()
        PIL.Image.new("RGB", (200, 120), "white").save(big, format="PNG")
        cases = [
            (_with_picture(good, image_part(big.getvalue())), "200 x 120 = 24,000 pixels is over the limit of "
                                                              "10,000 (the server's --max-image-pixels)"),
            (_with_picture(good, good["prompt"][0]["content"][0], copies=3),
             "3 pictures are over the limit of 2 per row (the server's --max-images-per-row)"),
            (_with_picture(good, image_part(digit_sum.DigitSumProblem(1, 2, 0).png()[:120])),  # truncated
             "could not be decoded"),
        ]
        for row, needle in cases:
            with pytest.raises(ValidationError) as refused:
                client.submit(GenericEnvironment(CONFIG, dataset=[good, row]), steps=1)
            assert needle in str(refused.value) and "dataset[1]" in str(refused.value), str(refused.value)
        fetch = _with_picture(good, {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}})
        with pytest.raises(DatasetError, match=r"dataset row 1: 'prompt\[0\].content\[0\]': a picture must be a data: URL"):
            client.submit(GenericEnvironment(CONFIG, dataset=[good, fetch]), steps=1)  # the client's own check
        with pytest.raises(ValidationError, match="a picture must be a data: URL"):  # and the server's
            client.request("POST", "/v1/jobs", json={"config": CONFIG, "dataset": [good, fetch]})
        with pytest.raises(ValidationError, match="not a vision-language model"):
            client.submit(GenericEnvironment({**CONFIG, "actor_rollout_ref.model.path": "opentinker-tiny-arith"},
                                             dataset=[good]), steps=1)
        assert len(client.list_jobs()) == 1  # nothing refused became a job
        _serves_pictures(server, key, info.job_id)


def _serves_pictures(server, key: str, job_id: str) -> None:
    """The finished job's checkpoint answers OpenAI chat requests with pictures (image_url data
    URLs); bad pictures are refused by name."""
    import httpx

    def ask(problem=None, url=None):
        picture = url or image_part(problem.png())["image"]
        message = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": picture}},
                                               {"type": "text", "text": digit_sum.QUESTION}]}
        return httpx.post(f"{server.url}/v1/chat/completions", timeout=120, trust_env=False,
                          headers={"Authorization": f"Bearer {key}"},
                          json={"model": job_id, "messages": [message], "max_tokens": 4, "temperature": 0})

    problems = digit_sum.make_problems(8, digit_sum.HELDOUT_SEED, "heldout")
    answers = []
    for problem in problems:
        response = ask(problem)
        assert response.status_code == 200, response.text
        answers.append(response.json()["choices"][0]["message"]["content"])
        assert response.json()["usage"]["prompt_tokens"] > 8  # the picture's 8 tokens, widened
    assert len(set(answers)) > 1 and sum(digit_sum.score(a, p.answer) for a, p in zip(answers, problems)) >= 2
    fetch = ask(url="https://example.com/digits.png")
    assert fetch.status_code == 400 and "data:" in fetch.text
    big = io.BytesIO()
    PIL.Image.new("RGB", (200, 120), "white").save(big, format="PNG")
    over = ask(url=image_part(big.getvalue())["image"])
    assert over.status_code == 400 and "--max-image-pixels" in over.text, over.text


def test_an_env_with_pictures_trains_direct_and_through_the_client_relay(server, tmp_path, helpers, monkeypatch):
    """The digit-sum env (a picture in each turn) on 127.0.0.1: one job reaches it itself, one
    through the thin client's relay (the pictures ride in the relayed answers)."""
    from opentinker.environments.games import DigitSumEnv
    from opentinker.environments.registry import InteractionSpec
    from opentinker.environments.server import running_env_server

    monkeypatch.setenv("OPENTINKER_STATE_DIR", str(tmp_path))
    key = helpers.make_user(tmp_path, "vic")
    config = {"actor_rollout_ref.model.path": "tiny-vlm", "data.max_prompt_length": 128,
              "data.max_response_length": 48, "actor_rollout_ref.rollout.multi_turn.max_assistant_turns": 2,
              "actor_rollout_ref.rollout.multi_turn.max_tokens_per_turn": 6, "data.train_batch_size": 2,
              "actor_rollout_ref.actor.ppo_mini_batch_size": 2, "actor_rollout_ref.rollout.n": 2,
              "trainer.test_freq": -1}
    rows = [{"extra_info": {"interaction_kwargs": {"name": "digits"}}} for _ in range(8)]
    with running_env_server(DigitSumEnv) as urls, OpenTinkerClient(server.url, key) as client:
        for relay in (False, True):
            spec = InteractionSpec(name="digits", class_path="gym", config={
                "env_endpoint": urls[0], **({"relay": "client"} if relay else {})})
            handle = client.submit(GenericEnvironment(config, [spec], dataset=rows), steps=2)
            assert (handle.relay is not None) == relay
            info = handle.wait(progress=False)
            assert info.status.value == "completed", info
            metrics = [m["metrics"] for m in handle.metrics() if "reward/mean" in m["metrics"]]
            assert len(metrics) == 2 and all(m["env/digits/env_errors"] == 0 for m in metrics), metrics


def test_an_openenv_env_with_pictures_trains_through_the_client_relay(server, tmp_path, helpers, monkeypatch):
    """A real OpenEnv server whose observation has an ``image`` field, reached through the thin
    client's relay (each episode's WebSocket session carried by the client)."""
    import json

    from opentinker.environments.registry import InteractionSpec

    from ..engine.test_vlm_agent_loop import PICTURE_ENV
    from ..environments.openenv_server import running_openenv_server

    monkeypatch.setenv("OPENTINKER_STATE_DIR", str(tmp_path))
    key = helpers.make_user(tmp_path, "olga")
    problems = [[p.a, p.b, image_part(p.png())["image"]] for p in digit_sum.make_problems(8, digit_sum.TRAIN_SEED)]
    config = {"actor_rollout_ref.model.path": "tiny-vlm", "data.max_prompt_length": 128,
              "data.max_response_length": 8, "actor_rollout_ref.rollout.multi_turn.max_assistant_turns": 1,
              "data.train_batch_size": 2, "actor_rollout_ref.actor.ppo_mini_batch_size": 2,
              "actor_rollout_ref.rollout.n": 2, "trainer.test_freq": -1}
    rows = [{"extra_info": {"interaction_kwargs": {"name": "sums"}}} for _ in range(8)]
    with running_openenv_server(tmp_path, source=PICTURE_ENV % json.dumps(problems)) as live, \
            OpenTinkerClient(server.url, key) as client:
        spec = InteractionSpec(name="sums", class_path="openenv", config={"env_endpoint": live.url, "relay": "client"})
        handle = client.submit(GenericEnvironment(config, [spec], dataset=rows), steps=2)
        assert handle.relay is not None
        info = handle.wait(progress=False)
        metrics = [m["metrics"] for m in handle.metrics() if "reward/mean" in m["metrics"]]
    assert info.status.value == "completed", info
    assert len(metrics) == 2 and all(m["env/sums/env_errors"] == 0 for m in metrics), metrics
