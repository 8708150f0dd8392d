"""The OpenAI API over trained models: the real ``openai`` client against a real server whose
jobs train the tiny model in Ray actors (the real JobRunner). Every answer is checked against
the same weights loaded here: a checkpoint's folder, or the base model for a job at step 0."""

from __future__ import annotations

import io
import json

import httpx
import pytest

openai = pytest.importorskip("openai")

from opentinker.client.cli import main as cli_main  # noqa: E402
from opentinker.engine.data import chat_prompt_ids  # noqa: E402
from opentinker.engine.rollout.base import SamplingParams  # noqa: E402
from opentinker.engine.rollout.transformers_engine import TransformersRolloutEngine  # noqa: E402
from opentinker.environments.arithmetic import make_problems  # noqa: E402

SMALL = {"data.train_batch_size": 2, "actor_rollout_ref.actor.ppo_mini_batch_size": 2,
         "actor_rollout_ref.rollout.n": 4, "trainer.test_freq": -1, "trainer.save_freq": 1,
         "actor_rollout_ref.actor.optim.lr": 1e-3}  # a large step, so checkpoints answer differently
QUESTION = [{"role": "user", "content": "What is 12 + 30?"}]


def rows(count: int, seed: int = 1) -> list[dict]:
    return [p.as_row() for p in make_problems(count, seed)]


def answer_from(folder, *, messages=None, prompt=None, max_tokens=24, temperature=0.0, seed=None) -> tuple[str, int]:
    """What the weights in ``folder`` answer, generated here: (text, prompt tokens)."""
    engine = TransformersRolloutEngine.from_pretrained(str(folder))
    tokenizer = engine.tokenizer
    ids = chat_prompt_ids(tokenizer, messages) if messages else tokenizer(prompt, add_special_tokens=False)["input_ids"]
    completion = engine.generate([ids], SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=seed))[0]
    return tokenizer.decode(completion.token_ids, skip_special_tokens=True), len(ids)


@pytest.fixture(scope="module")
def live(ray_cluster, tmp_path_factory, helpers):
    data = tmp_path_factory.mktemp("serving")
    keys = {name: helpers.make_user(data, name) for name in ("alice", "bob")}
    server = helpers.LiveServer(helpers.test_settings(data, serve_max_tokens=64), runner_cls=None).start()
    yield server, keys
    server.stop()


@pytest.fixture(scope="module")
def alice(live):
    server, keys = live
    with server.client(keys["alice"]) as client:
        yield client


@pytest.fixture(scope="module")
def openai_client(live):
    server, keys = live
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=keys["alice"], max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def finished_job(alice, helpers) -> str:
    job_id = helpers.create_job(alice, "serve-me", steps=2, config={**SMALL, "trainer.total_training_steps": 2},
                                dataset=rows(16))
    helpers.wait_status(alice, job_id, "completed", timeout=300)
    metrics = [e["data"]["metrics"] for e in helpers.all_events(alice, job_id) if e["type"] == "metrics"]
    assert len(metrics) == 2 and not any("checkpoint" in m for m in metrics)  # no server path published
    return job_id


def checkpoint_folder(live, job_id: str, name: str) -> str:
    return live[0].app.state.store.get_checkpoint(job_id, name).path


def test_a_finished_job_answers_with_its_newest_checkpoint(live, openai_client, finished_job):
    expected, prompt_tokens = answer_from(checkpoint_folder(live, finished_job, "global_step_2"), messages=QUESTION,
                                          temperature=1.0, seed=7)
    answer = openai_client.chat.completions.create(model=finished_job, messages=QUESTION, temperature=1.0, seed=7,
                                                   max_tokens=24)
    assert answer.choices[0].message.content == expected
    assert answer.choices[0].message.role == "assistant"
    assert answer.choices[0].finish_reason in ("stop", "length")
    assert answer.model == finished_job and answer.object == "chat.completion"
    assert answer.usage.prompt_tokens == prompt_tokens and answer.usage.completion_tokens >= 1


def test_a_named_checkpoint_answers_with_its_own_weights(live, openai_client, finished_job):
    step_1 = checkpoint_folder(live, finished_job, "global_step_1")
    expected, _ = answer_from(step_1, messages=QUESTION, temperature=1.0, seed=11)
    answer = openai_client.chat.completions.create(model=f"{finished_job}/global_step_1", messages=QUESTION,
                                                   temperature=1.0, seed=11, max_tokens=24)
    assert answer.choices[0].message.content == expected
    greedy = [openai_client.chat.completions.create(model=f"{finished_job}/{name}", messages=QUESTION,
                                                    temperature=0, max_tokens=24).choices[0].message.content
              for name in ("global_step_1", "global_step_2")]
    assert greedy == [answer_from(checkpoint_folder(live, finished_job, name), messages=QUESTION)[0]
                      for name in ("global_step_1", "global_step_2")]


def test_streaming_gives_the_same_text_in_pieces(openai_client, finished_job):
    whole = openai_client.chat.completions.create(model=finished_job, messages=QUESTION, temperature=1.0, seed=3,
                                                  max_tokens=24)
    chunks = list(openai_client.chat.completions.create(
        model=finished_job, messages=QUESTION, temperature=1.0, seed=3, max_tokens=24, stream=True,
        stream_options={"include_usage": True}))
    pieces = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert "".join(pieces) == whole.choices[0].message.content
    assert len(pieces) >= 2  # sent as decoded, not in one piece at the end
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == whole.usage.total_tokens


def test_text_completions_plain_and_streamed(live, openai_client, finished_job):
    expected, prompt_tokens = answer_from(checkpoint_folder(live, finished_job, "global_step_2"),
                                          prompt="Tom has 3 apples", temperature=1.0, seed=5, max_tokens=16)
    answer = openai_client.completions.create(model=finished_job, prompt="Tom has 3 apples", temperature=1.0, seed=5,
                                              max_tokens=16)
    assert answer.choices[0].text == expected and answer.usage.prompt_tokens == prompt_tokens
    streamed = openai_client.completions.create(model=finished_job, prompt="Tom has 3 apples", temperature=1.0,
                                                seed=5, max_tokens=16, stream=True)
    assert "".join(chunk.choices[0].text for chunk in streamed) == expected


def test_several_choices_are_seeded_one_after_another(live, openai_client, finished_job):
    folder = checkpoint_folder(live, finished_job, "global_step_2")
    answer = openai_client.chat.completions.create(model=finished_job, messages=QUESTION, temperature=1.0, seed=20,
                                                   n=3, max_tokens=12)
    assert [c.index for c in answer.choices] == [0, 1, 2]
    assert [c.message.content for c in answer.choices] == [
        answer_from(folder, messages=QUESTION, temperature=1.0, seed=20 + i, max_tokens=12)[0] for i in range(3)]


def test_a_running_job_answers_with_its_current_weights(live, alice, openai_client, tiny_model_dir, helpers):
    job_id = helpers.create_job(alice, "live-weights", mode="client", steps=2,
                                config={**SMALL, "trainer.total_training_steps": 2})
    try:
        helpers.wait_status(alice, job_id, "running", timeout=120)

        def ask():
            return openai_client.chat.completions.create(model=job_id, messages=QUESTION, temperature=1.0, seed=9,
                                                         max_tokens=24).choices[0].message.content

        # No checkpoint yet: only the job's own rollout engine can answer, with the base weights.
        answer = helpers.wait_for(lambda: _served(ask), 120, "the job's model to load")
        assert answer == answer_from(tiny_model_dir, messages=QUESTION, temperature=1.0, seed=9)[0]
        pushed = alice.post(f"/v1/jobs/{job_id}/steps", json={"step": 1, "rows": rows(2, seed=4)})
        assert pushed.status_code == 202, pushed.text
        helpers.wait_for(lambda: alice.get(f"/v1/jobs/{job_id}").json()["step"] == 1, 120, "step 1")
        # The engine now holds the weights of step 1, exactly as exported to that checkpoint.
        assert ask() == answer_from(checkpoint_folder(live, job_id, "global_step_1"), messages=QUESTION,
                                    temperature=1.0, seed=9)[0]
    finally:
        alice.post(f"/v1/jobs/{job_id}/cancel")


def _served(ask):
    try:
        return ask()
    except openai.APIStatusError as error:  # 503 while the runner loads its model
        assert error.status_code == 503, error
        return None


def test_errors_name_what_is_wrong(live, openai_client, finished_job):
    server, keys = live
    bob = openai.OpenAI(base_url=f"{server.url}/v1", api_key=keys["bob"], max_retries=0)
    for client, model in ((bob, finished_job), (openai_client, "0" * 32), (openai_client, "not-a-job"),
                          (openai_client, f"{finished_job}/global_step_9")):
        with pytest.raises(openai.NotFoundError):
            client.chat.completions.create(model=model, messages=QUESTION, max_tokens=4)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="ot-made-up", max_retries=0).chat.completions.create(
            model=finished_job, messages=QUESTION)
    cases = [({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
             ({"logprobs": True}, "logprobs"),
             ({"max_tokens": 65}, "max_tokens"),
             ({"temperature": 3}, "temperature"),
             ({"messages": [{"role": "user", "content": "x" * 4000}]}, "context"),
             ({"messages": [{"role": "user", "content": "x" * 200_001}]}, "content"),
             ({"stop": ["a", "b", "c", "d", "e"]}, "at most 4 items")]  # a bound the document states
    for extra, word in cases:
        body = {"model": finished_job, "messages": QUESTION, **extra}
        response = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60,
                              headers={"Authorization": f"Bearer {keys['alice']}"})
        assert response.status_code in (400, 422) and word in response.text, (extra, response.text)


def test_opentinker_chat_prints_the_reply(live, finished_job, monkeypatch, capsys):
    server, keys = live
    expected, _ = answer_from(checkpoint_folder(live, finished_job, "global_step_2"), messages=QUESTION)
    code = cli_main(["chat", finished_job, "-m", QUESTION[0]["content"], "--temperature", "0", "--max-tokens", "24",
                     "--base-url", server.url, "--api-key", keys["alice"]])
    assert code == 0 and capsys.readouterr().out == expected + "\n"
    # A conversation: two questions from stdin, then an empty line.
    monkeypatch.setattr("sys.stdin", io.StringIO("What is 12 + 30?\nAnd 1 + 1?\n\n"))
    code = cli_main(["chat", finished_job, "--temperature", "0", "--max-tokens", "8",
                     "--base-url", server.url, "--api-key", keys["alice"]])
    out = capsys.readouterr().out
    assert code == 0 and out.count("model> ") == 2 and expected[:8] in out
    code = cli_main(["chat", "0" * 32, "-m", "hi", "--base-url", server.url, "--api-key", keys["alice"]])
    assert code == 1 and "not found" in capsys.readouterr().err.lower()


def test_the_routes_are_in_the_openapi_document(live):
    """The routes are in the OpenAPI document with OpenAI's field names."""
    schema = json.loads(httpx.get(f"{live[0].url}/openapi.json").text)
    assert {"/v1/chat/completions", "/v1/completions"} <= set(schema["paths"])
