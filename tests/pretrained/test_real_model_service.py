"""The real SmolLM2-135M-Instruct through the whole service: `opentinker-server serve --model
smollm2-135m-instruct` (a real process), a GRPO job with LoRA on word problems through the thin
client, and the official tinker SDK's SFT loop and sampling on it."""

from __future__ import annotations

import os

import pytest

from opentinker import GenericEnvironment, OpenTinkerClient
from opentinker.client.local_server import local_server

pytestmark = pytest.mark.heavy  # minutes: scheduled first (tests/conftest.py)

SMOLLM2 = "smollm2-135m-instruct"
SMALL_LORA_GRPO = {
    "actor_rollout_ref.model.path": SMOLLM2,
    "actor_rollout_ref.model.lora_rank": 8,
    "data.task": "word_problems",
    "data.train_batch_size": 2,
    "actor_rollout_ref.rollout.n": 2,
    "actor_rollout_ref.actor.ppo_mini_batch_size": 2,
    "actor_rollout_ref.actor.optim.lr": 1e-4,
    "data.max_prompt_length": 192,
    "data.max_response_length": 16,
    "data.val_batch_size": 4,
    "trainer.test_freq": 2,
}


@pytest.fixture(scope="module")
def server(smollm2_dir, tmp_path_factory):
    with local_server(tmp_path_factory.mktemp("server"), models=[SMOLLM2]) as (url, key):
        yield url, key


def test_the_server_serves_the_preset_as_its_default_model(server):
    with OpenTinkerClient(*server) as client:
        listed = client.models().models
    assert [(m.name, m.default) for m in listed] == [(SMOLLM2, True), ("opentinker-tiny-arith", False)]


def test_a_lora_grpo_job_on_word_problems_completes_with_validation(server):
    with OpenTinkerClient(*server) as client:
        job = client.submit(GenericEnvironment(SMALL_LORA_GRPO), steps=2)
        final = job.wait()
        assert final.status.value == "completed", final
        metrics = [m["metrics"] for m in job.metrics()]
    assert len([m for m in metrics if "reward/mean" in m]) == 2
    accuracy = [m["val/accuracy"] for m in metrics if "val/accuracy" in m]
    assert len(accuracy) == 2 and all(0.0 <= a <= 1.0 for a in accuracy)  # before training, then at step 2
    assert all(m["response_length/mean"] > 1 for m in metrics if "response_length/mean" in m)


def test_the_tinker_sdk_trains_and_samples_the_real_model(server, smollm2_tokenizer):
    tinker = pytest.importorskip("tinker")
    from tinker import types

    os.environ.setdefault("TINKER_TELEMETRY", "0")
    url, key = server
    service = tinker.ServiceClient(base_url=url, api_key="tml-" + key)
    try:
        training = service.create_lora_training_client(base_model=SMOLLM2, rank=8, seed=0).result()
        chat = [{"role": "user", "content": "What is 7 + 8?"}, {"role": "assistant", "content": "7 + 8 = 15."}]
        tokens = smollm2_tokenizer.apply_chat_template(chat, tokenize=True, return_dict=False)
        prompt_len = len(smollm2_tokenizer.apply_chat_template(chat[:1], add_generation_prompt=True, tokenize=True,
                                                                return_dict=False))
        weights = [0.0] * (prompt_len - 1) + [1.0] * (len(tokens) - prompt_len)
        datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                            loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights})
        losses = []
        for _ in range(4):
            losses.append(training.forward_backward([datum], "cross_entropy").result().metrics["loss:sum"])
            training.optim_step(types.AdamParams(learning_rate=1e-3)).result()
        assert losses[-1] < 0.7 * losses[0], losses

        sampler = training.save_weights_and_get_sampling_client().result()
        prompt = tokens[:prompt_len]
        result = sampler.sample(prompt=types.ModelInput.from_ints(prompt), num_samples=1,
                                sampling_params=types.SamplingParams(max_tokens=12, temperature=0.0)).result()
        text = smollm2_tokenizer.decode(result.sequences[0].tokens, skip_special_tokens=True)
        assert "15" in text, text  # the trained answer, as text
    finally:
        service.close("success").result()
