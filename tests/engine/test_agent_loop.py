"""Agent loops with the real tiny model against real env servers on 127.0.0.1."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from fastapi import FastAPI
from fastapi.responses import JSONResponse, PlainTextResponse

from opentinker.engine.agent_loop import STOP_REASONS, AgentLoop, AgentLoopConfig
from opentinker.engine.chat import ChatTemplater
from opentinker.engine.rollout import RequestBatcher, SamplingParams
from opentinker.engine.rollout.transformers_engine import TransformersRolloutEngine
from opentinker.environments.gym_interaction import GymEnvironmentInteraction
from opentinker.environments.interaction import EnvironmentServerError, Interaction
from opentinker.environments.server import running_app_servers, running_env_server

QUESTION = [{"role": "user", "content": "What is 12 + 30?"}]


class ChattyEnv:
    """Never done; answers every action with a fixed line and reward 0.5."""

    def reset(self, **kwargs):
        return {"observation": "Talk to me.", "system_prompt": "You are a test agent."}

    def step(self, action):
        return "Tell me more, please.", 0.5, False, {"chars": len(action)}


class FinishesOnSecondTurnEnv:
    def reset(self, **kwargs):
        self.turn = 0
        return "Start."

    def step(self, action):
        self.turn += 1
        return ("Good.", 1.0, True, {}) if self.turn == 2 else ("Once more.", 0.25, False, {})


class FailingStepEnv:
    def reset(self, **kwargs):
        return "Hi."

    def step(self, action):
        raise RuntimeError("the simulator crashed")


class SlowStepEnv:
    def reset(self, **kwargs):
        return "Hi."

    def step(self, action):
        time.sleep(2.0)
        return "Late.", 1.0, True, {}


def recording_env_app(reset, step=None) -> FastAPI:
    """An env server app with the given /reset (and /step) handlers; /finalize records the
    instance ids it is sent (``app.state.finalized``), /health answers ok."""
    app = FastAPI()
    app.state.finalized = []
    app.post("/reset")(reset)
    if step is not None:
        app.post("/step")(step)

    @app.post("/finalize")
    async def finalize(body: dict):
        app.state.finalized.append(body["instance_id"])
        return {"ok": True}

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    return app


def invalid_json_app() -> FastAPI:
    async def reset(body: dict):
        return {"observation": "Hi."}

    async def step(body: dict):
        return PlainTextResponse("this is not json", media_type="application/json")

    return recording_env_app(reset, step)


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    from opentinker.engine.model_loading import load_causal_lm, load_tokenizer

    tokenizer = load_tokenizer(str(tiny_model_dir))
    model = load_causal_lm(str(tiny_model_dir))
    return TransformersRolloutEngine(model, [tokenizer.eos_token_id], tokenizer.pad_token_id, seed=0)


@pytest.fixture(scope="module")
def batcher(engine):
    batcher = RequestBatcher(engine)
    yield batcher
    batcher.close()


@pytest.fixture
def templater(tiny_tokenizer):
    return ChatTemplater(tiny_tokenizer, [tiny_tokenizer.eos_token_id])


def run_loop(batcher, tokenizer, templater, url, *, messages=QUESTION, config=AgentLoopConfig(),
             sampling=SamplingParams(temperature=1.0, max_tokens=16, seed=0), interaction_config=None,
             record=None, kwargs=None):
    """Run one agent loop; the interaction lives inside the event loop that uses it."""

    async def generate(prompt_ids, params):
        completion = await batcher.agenerate(prompt_ids, params)
        if record is not None:
            record.append((list(prompt_ids), completion))
        return completion

    async def main():
        interaction = GymEnvironmentInteraction({"env_endpoint": url, **(interaction_config or {})})
        try:
            loop = AgentLoop(generate, tokenizer, templater, config, sampling)
            return await loop.run(messages, interaction, kwargs or {})
        finally:
            await interaction.aclose()

    return asyncio.run(main())


def runs_of(mask, values):
    """Split ``values`` into maximal runs of equal mask: [(mask, [values...]), ...]."""
    runs = []
    for m, v in zip(mask, values):
        if runs and runs[-1][0] == m:
            runs[-1][1].append(v)
        else:
            runs.append((m, [v]))
    return runs


def test_masks_separate_model_text_from_environment_text(batcher, tiny_tokenizer, templater):
    with running_env_server(ChattyEnv) as urls:
        trajectory = run_loop(batcher, tiny_tokenizer, templater, urls[0],
                              config=AgentLoopConfig(max_assistant_turns=3, max_user_turns=5))
    assert trajectory.num_turns == 3 and trajectory.stop_reason == "max_assistant_turns"
    runs = runs_of(trajectory.response_mask, trajectory.response_ids)
    assert [m for m, _ in runs] == [1, 0, 1, 0, 1]
    assistant_texts = [m["content"] for m in trajectory.messages if m["role"] == "assistant"]
    env_texts = [m["content"] for m in trajectory.messages if m["role"] == "user"][1:]
    assert [tiny_tokenizer.decode(ids, skip_special_tokens=True) for m, ids in runs if m == 1] == assistant_texts
    for (_, ids), text in zip([r for r in runs if r[0] == 0], env_texts):
        decoded = tiny_tokenizer.decode(ids, skip_special_tokens=True)
        assert decoded.strip().splitlines()[0] == "user"  # the template's role header, then the text
        assert text in decoded and "You are a test agent." not in decoded  # increment only
    assert trajectory.turn_rewards == [0.5, 0.5, 0.5] and trajectory.reward == 1.5
    assert len(trajectory.rollout_logprobs) == len(trajectory.response_ids)
    assert all(lp == 0.0 for lp, m in zip(trajectory.rollout_logprobs, trajectory.response_mask) if m == 0)


def test_trained_tokens_are_exactly_what_the_engine_produced(batcher, tiny_tokenizer, templater):
    record = []
    with running_env_server(ChattyEnv) as urls:
        trajectory = run_loop(batcher, tiny_tokenizer, templater, urls[0], record=record,
                              config=AgentLoopConfig(max_assistant_turns=3))
    model_runs = [ids for m, ids in runs_of(trajectory.response_mask, trajectory.response_ids) if m == 1]
    assert [c.token_ids for _, c in record] == model_runs
    # each call saw exactly the trajectory so far: no re-rendered or re-tokenized context
    full = trajectory.prompt_ids + trajectory.response_ids
    for context, completion in record:
        assert full[: len(context)] == context
        assert full[len(context): len(context) + len(completion.token_ids)] == completion.token_ids


def test_data_free_row_opens_with_the_reset_observation(batcher, tiny_tokenizer, templater):
    with running_env_server(ChattyEnv) as urls:
        trajectory = run_loop(batcher, tiny_tokenizer, templater, urls[0], messages=None,
                              config=AgentLoopConfig(max_assistant_turns=1))
    assert trajectory.messages[:2] == [{"role": "system", "content": "You are a test agent."},
                                       {"role": "user", "content": "Talk to me."}]
    assert trajectory.prompt_ids == templater.prompt_ids(trajectory.messages[:2])


def test_env_done_ends_the_loop_and_rewards_combine_as_configured(batcher, tiny_tokenizer, templater):
    with running_env_server(FinishesOnSecondTurnEnv) as urls:
        total = run_loop(batcher, tiny_tokenizer, templater, urls[0], config=AgentLoopConfig(reward_mode="sum"))
        last = run_loop(batcher, tiny_tokenizer, templater, urls[0], config=AgentLoopConfig(reward_mode="last"))
        score = run_loop(batcher, tiny_tokenizer, templater, urls[0], config=AgentLoopConfig(reward_mode="score"))
    assert total.stop_reason == "env_done" and total.num_turns == 2
    assert total.reward == 1.25 and last.reward == 1.0 and score.reward == 1.25


def test_budgets(batcher, tiny_tokenizer, templater):
    forced = SamplingParams(temperature=1.0, max_tokens=64, seed=0, ignore_eos=True)
    with running_env_server(ChattyEnv) as urls:
        url = urls[0]
        users = run_loop(batcher, tiny_tokenizer, templater, url, config=AgentLoopConfig(max_user_turns=1))
        per_turn = run_loop(batcher, tiny_tokenizer, templater, url, sampling=forced,
                            config=AgentLoopConfig(max_assistant_turns=3, max_tokens_per_turn=4))
        total = run_loop(batcher, tiny_tokenizer, templater, url, sampling=forced,
                         config=AgentLoopConfig(max_tokens_per_turn=8, max_response_length=30))
    assert users.stop_reason == "max_user_turns" and users.num_turns == 2
    assert [len(ids) for m, ids in runs_of(per_turn.response_mask, per_turn.response_ids) if m == 1] == [4, 4, 4]
    assert total.stop_reason == "max_response_length" and len(total.response_ids) <= 30
    # a model turn cut off before its end-of-turn token is closed by the template, as an env token
    closing = templater.turn_ids("x", model_turn_ended=False)
    assert closing[0] == tiny_tokenizer.eos_token_id


@pytest.mark.parametrize("env_error_reward, excluded, reward", [(None, True, 0.0), (-1.0, False, -1.0)])
def test_env_server_500_ends_with_env_error_and_finalizes(batcher, tiny_tokenizer, templater, env_error_reward,
                                                          excluded, reward):
    with running_env_server(FailingStepEnv) as urls:
        trajectory = run_loop(batcher, tiny_tokenizer, templater, urls[0],
                              config=AgentLoopConfig(env_error_reward=env_error_reward),
                              interaction_config={"retries": 0})
        health = httpx.get(f"{urls[0]}/health", trust_env=False).json()
    assert trajectory.stop_reason == "env_error"
    # None (the default): left out of the loss, the reward a placeholder; a number: kept with it
    assert trajectory.excluded is excluded and trajectory.reward == reward
    assert trajectory.info["error"].endswith("/step failed: HTTP 500: RuntimeError: the simulator crashed")
    assert trajectory.info["error_url"] == f"{urls[0]}/step"
    assert health["instances"] == 0  # finalized although the step failed


def test_env_server_timeout_is_an_env_error(batcher, tiny_tokenizer, templater):
    with running_env_server(SlowStepEnv) as urls:
        started = time.perf_counter()
        trajectory = run_loop(batcher, tiny_tokenizer, templater, urls[0],
                              interaction_config={"timeout_s": 0.3, "retries": 0})
        elapsed = time.perf_counter() - started
    assert trajectory.stop_reason == "env_error" and trajectory.excluded
    assert elapsed < 10


def test_env_server_invalid_json_is_an_env_error(batcher, tiny_tokenizer, templater):
    app = invalid_json_app()
    with running_app_servers([app]) as (url,):
        trajectory = run_loop(batcher, tiny_tokenizer, templater, url, interaction_config={"retries": 0})
    assert trajectory.stop_reason == "env_error"
    assert len(app.state.finalized) == 1  # no instance left behind


QWEN25_STYLE_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if not (message.role == 'system' and loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def test_qwen25_style_template_appends_increments_without_repeating_the_system_prompt(
    batcher, tiny_model_dir, templater
):
    from opentinker.engine.model_loading import load_tokenizer

    tokenizer = load_tokenizer(str(tiny_model_dir))
    tokenizer.chat_template = QWEN25_STYLE_TEMPLATE
    qwen_templater = ChatTemplater(tokenizer, [tokenizer.eos_token_id])
    with running_env_server(ChattyEnv) as urls:
        trajectory = run_loop(batcher, tokenizer, qwen_templater, urls[0],
                              sampling=SamplingParams(temperature=0, max_tokens=16),
                              config=AgentLoopConfig(max_assistant_turns=3))
    text = tokenizer.decode(trajectory.prompt_ids + trajectory.response_ids)
    assert text.count("You are Qwen") == 1
    assert text.count("<|im_start|>user") == 3  # the question and two env turns
    # The incremental sequence reads exactly like the template rendering the whole chat, with
    # each model turn as the model wrote it (raw tokens, its end-of-turn token removed).
    model_turns = [ids for m, ids in runs_of(trajectory.response_mask, trajectory.response_ids) if m == 1]
    env_turns = iter(m["content"] for m in trajectory.messages[1:] if m["role"] == "user")
    chat = list(QUESTION)
    for ids in model_turns:
        raw = tokenizer.decode(ids[:-1] if ids[-1] == tokenizer.eos_token_id else ids)
        chat.append({"role": "assistant", "content": raw})
        chat.extend({"role": "user", "content": t} for t in [next(env_turns, None)] if t is not None)
    rendered = tokenizer.apply_chat_template(chat, tokenize=False)
    assert text + ("\n" if trajectory.response_ids[-1] == tokenizer.eos_token_id else "<|im_end|>\n") == rendered


def failing_reset_app(answer: str) -> FastAPI:
    """/reset answers 500 (``answer="500"``) or applies the reset and answers garbage
    (``"garbage"``: an answer lost on the way); /finalize records what it got."""
    resets: list[str] = []

    async def reset(body: dict):
        resets.append(body["instance_id"])
        if answer == "500":
            return JSONResponse({"error": "RuntimeError: the simulator is down"}, status_code=500)
        return PlainTextResponse("<html>proxy error</html>", media_type="text/html")

    app = recording_env_app(reset)
    app.state.resets = resets
    return app


@pytest.mark.parametrize("answer, error", [
    ("500", "/reset failed: HTTP 500: RuntimeError: the simulator is down"),
    ("garbage", "/reset failed: invalid JSON in answer (text/html, 24 bytes)"),
])
def test_a_failed_reset_is_still_finalized(batcher, tiny_tokenizer, templater, answer, error):
    app = failing_reset_app(answer)
    record = []
    with running_app_servers([app]) as (url,):
        trajectory = run_loop(batcher, tiny_tokenizer, templater, url, messages=None, record=record,
                              interaction_config={"retries": 0})
    assert trajectory.stop_reason == "env_error" and trajectory.excluded
    assert trajectory.info["error"].endswith(error)
    assert record == [] and trajectory.response_ids == []  # the model never spoke
    assert len(app.state.resets) == 1
    assert app.state.finalized == app.state.resets  # the id the loop picked, finalized once


class TruncatingEnv:
    """A gymnasium env whose episode is cut (truncated, not terminated) at its second step."""

    def reset(self, **kwargs):
        self.turn = 0
        return "Start.", {}

    def step(self, action):
        self.turn += 1
        return "Go on.", 0.5, False, self.turn == 2, {}


def test_truncation_by_max_steps_and_by_the_env_have_their_own_stop_reasons(batcher, tiny_tokenizer, templater):
    assert {"max_env_steps", "env_truncated", "prompt_too_long"} <= set(STOP_REASONS)
    config = AgentLoopConfig(max_assistant_turns=5, max_user_turns=5)
    with running_env_server(ChattyEnv) as urls:
        cut = run_loop(batcher, tiny_tokenizer, templater, urls[0], config=config,
                       interaction_config={"max_steps": 2})
    with running_env_server(TruncatingEnv) as urls:
        truncated = run_loop(batcher, tiny_tokenizer, templater, urls[0], config=config)
    with running_env_server(FinishesOnSecondTurnEnv) as urls:
        done = run_loop(batcher, tiny_tokenizer, templater, urls[0], config=config)
    assert (cut.stop_reason, cut.num_turns, cut.turn_rewards) == ("max_env_steps", 2, [0.5, 0.5])
    assert (truncated.stop_reason, truncated.num_turns) == ("env_truncated", 2)
    assert (done.stop_reason, done.num_turns) == ("env_done", 2)
    assert not any(t.excluded for t in (cut, truncated, done))


class LongPromptEnv(ChattyEnv):
    def reset(self, **kwargs):
        return {"observation": "word " * 200}


def test_an_env_prompt_longer_than_max_prompt_length_ends_before_generation(batcher, tiny_tokenizer, templater):
    record = []
    with running_env_server(LongPromptEnv) as urls:
        long = run_loop(batcher, tiny_tokenizer, templater, urls[0], messages=None, record=record,
                        config=AgentLoopConfig(max_prompt_length=64))
        health = httpx.get(f"{urls[0]}/health", trust_env=False).json()
        fits = run_loop(batcher, tiny_tokenizer, templater, urls[0], messages=None,
                        config=AgentLoopConfig(max_prompt_length=len(long.prompt_ids), max_assistant_turns=1))
    assert long.stop_reason == "prompt_too_long" and long.excluded
    assert len(long.prompt_ids) > 64 and long.response_ids == [] and record == []  # no generate call
    assert long.info["error"] == f"the environment's prompt has {len(long.prompt_ids)} tokens, more than max_prompt_length=64"
    assert health["instances"] == 0  # finalized
    assert fits.stop_reason == "max_assistant_turns" and not fits.excluded and fits.response_ids


class RemoteScoreInteraction(Interaction):
    """One turn, scored by a remote grader that is down."""

    def __init__(self, config=None):
        super().__init__(config)
        self.finalized = []

    async def generate_response(self, instance_id, messages, **kwargs):
        return True, "", 1.0, {}

    async def calculate_score(self, instance_id, **kwargs):
        raise EnvironmentServerError("http://127.0.0.1:9/score", "ConnectError: grader down")

    async def finalize_interaction(self, instance_id, **kwargs):
        self.finalized.append(instance_id)


@pytest.mark.parametrize("env_error_reward, excluded, reward", [(None, True, 0.0), (-2.0, False, -2.0)])
def test_a_score_that_cannot_be_computed_is_an_env_error(batcher, tiny_tokenizer, templater, env_error_reward,
                                                          excluded, reward):
    interaction = RemoteScoreInteraction()
    loop = AgentLoop(batcher.agenerate, tiny_tokenizer, templater,
                     AgentLoopConfig(reward_mode="score", env_error_reward=env_error_reward),
                     SamplingParams(temperature=1.0, max_tokens=8, seed=0))
    trajectory = asyncio.run(loop.run(QUESTION, interaction, {}))
    assert (trajectory.stop_reason, trajectory.excluded, trajectory.reward) == ("env_error", excluded, reward)
    assert trajectory.info["error_url"] == "http://127.0.0.1:9/score" and trajectory.response_ids
    assert len(interaction.finalized) == 1
