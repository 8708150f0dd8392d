"""Agent loops with the real tiny model against real env servers on 127.0.0.1."""

from __future__ import annotations

import asyncio
import time

import pytest
from fastapi import FastAPI
from fastapi.responses import PlainTextResponse

from opentinker.engine.agent_loop import AgentLoop, AgentLoopConfig
from opentinker.engine.chat import ChatTemplater
from opentinker.engine.rollout import RequestBatcher, SamplingParams
from opentinker.engine.rollout.transformers_engine import TransformersRolloutEngine
from opentinker.environments.gym_interaction import GymEnvironmentInteraction
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


def invalid_json_app() -> FastAPI:
    app = FastAPI()
    app.state.finalized = []

    @app.post("/reset")
    async def reset(body: dict):
        return {"observation": "Hi."}

    @app.post("/step")
    async def step(body: dict):
        return PlainTextResponse("this is not json", media_type="application/json")

    @app.post("/finalize")
    async def finalize(body: dict):
        app.state.finalized.append(body["instance_id"])
        return {"ok": True}

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    return app


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


@pytest.mark.parametrize("env_error_reward", [0.0, -1.0])
def test_env_server_500_ends_with_env_error_and_finalizes(batcher, tiny_tokenizer, templater, env_error_reward):
    with running_env_server(FailingStepEnv) as urls:
        trajectory = run_loop(batcher, tiny_tokenizer, templater, urls[0],
                              config=AgentLoopConfig(env_error_reward=env_error_reward),
                              interaction_config={"retries": 0})
        health = __import__("httpx").get(f"{urls[0]}/health").json()
    assert trajectory.stop_reason == "env_error"
    assert trajectory.reward == env_error_reward
    assert "500" in trajectory.info["error"] or "crashed" in trajectory.info["error"]
    assert health["instances"] == 0  # finalized although the step failed


def test_env_server_timeout_is_an_env_error(batcher, tiny_tokenizer, templater):
    with running_env_server(SlowStepEnv) as urls:
        started = time.perf_counter()
        trajectory = run_loop(batcher, tiny_tokenizer, templater, urls[0],
                              interaction_config={"timeout_s": 0.3, "retries": 0})
        elapsed = time.perf_counter() - started
    assert trajectory.stop_reason == "env_error" and trajectory.reward == 0.0
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
