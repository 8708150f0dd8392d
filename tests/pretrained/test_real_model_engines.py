"""The engines on the real SmolLM2-135M-Instruct (a 49k vocabulary, 30 layers, GQA, tied
embeddings): what the rollout reports equals what training computes, in float32."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from opentinker.engine.batch import TokenBatch
from opentinker.engine.rollout import SamplingParams

# The bar for the real model: rollout and training forward agree to 1e-4 in fp32.
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def smollm2_model(smollm2_dir):
    from opentinker.engine.model_loading import load_causal_lm

    return load_causal_lm(str(smollm2_dir)).eval()


@pytest.fixture(scope="module")
def smollm2_backend(smollm2_dir, smollm2_tokenizer):
    from opentinker.config import make_config
    from opentinker.engine.backend import BackendSpec, make_backend

    cfg = make_config(["trainer.device=cpu"])
    return make_backend(BackendSpec.from_config(cfg, str(smollm2_dir), smollm2_tokenizer.pad_token_id))


def logprob_gap(backend, prompts, completions, temperature: float) -> float:
    batch = TokenBatch.from_responses(prompts, [c.token_ids for c in completions])
    trained = backend.forward(batch, temperature=temperature).logprobs
    reported = batch.pad_response_values([c.logprobs for c in completions])
    return float(((trained - reported) * batch.response_mask).abs().max())


@pytest.mark.parametrize("slot_decode", [False, True], ids=["eager", "slots"])
def test_rollout_logprobs_equal_the_training_forward(smollm2_model, smollm2_tokenizer, smollm2_dir, smollm2_backend,
                                                     word_problem_prompt_ids, slot_decode):
    from opentinker.engine.model_loading import eos_token_ids
    from opentinker.engine.rollout.transformers_engine import TransformersRolloutEngine

    engine = TransformersRolloutEngine(smollm2_model, eos_token_ids(smollm2_tokenizer, str(smollm2_dir)),
                                       smollm2_tokenizer.pad_token_id, seed=0, tokenizer=smollm2_tokenizer,
                                       slot_decode=slot_decode)
    completions = engine.generate(word_problem_prompt_ids, SamplingParams(temperature=1.0, max_tokens=24))
    assert all(len(c.token_ids) > 0 for c in completions)
    assert logprob_gap(smollm2_backend, word_problem_prompt_ids, completions, 1.0) < TOLERANCE
    greedy = engine.generate(word_problem_prompt_ids[:2], SamplingParams(temperature=0, max_tokens=40))
    text = smollm2_tokenizer.decode(greedy[0].token_ids, skip_special_tokens=True)
    assert any(ch.isdigit() for ch in text), text  # a chat model answering a word problem


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed (make install-vllm)")
@pytest.mark.heavy
def test_vllm_serves_the_converted_folder_with_the_training_logprobs(smollm2_dir, smollm2_backend,
                                                                      word_problem_prompt_ids):
    from opentinker.engine.rollout.vllm_engine import VLLMRolloutEngine

    engine = VLLMRolloutEngine(str(smollm2_dir), max_model_len=512)
    try:
        completions = engine.generate(word_problem_prompt_ids, SamplingParams(temperature=1.0, max_tokens=24))
    finally:
        engine.close()
    # vLLM's CPU kernels sum in another order than torch's (tests/engine/test_vllm_rollout.py).
    assert logprob_gap(smollm2_backend, word_problem_prompt_ids, completions, 1.0) < 2e-4


def test_lora_starts_as_the_base_model_and_trains_only_its_adapters(smollm2_dir, smollm2_tokenizer, smollm2_backend,
                                                                    word_problem_prompt_ids):
    from opentinker.config import make_config
    from opentinker.engine.backend import AdamParams, BackendSpec, make_backend

    cfg = make_config(["trainer.device=cpu", "actor_rollout_ref.model.lora_rank=8"])
    lora = make_backend(BackendSpec.from_config(cfg, str(smollm2_dir), smollm2_tokenizer.pad_token_id))
    responses = [[28, 33, 2]] * len(word_problem_prompt_ids)
    batch = TokenBatch.from_responses(word_problem_prompt_ids, responses)
    base = smollm2_backend.forward(batch).logprobs
    assert torch.allclose(lora.forward(batch).logprobs, base, atol=TOLERANCE)
    lora.forward_backward(batch, "cross_entropy")
    lora.optim_step(AdamParams(lr=1e-3))
    assert float((lora.forward(batch).logprobs - base).abs().max()) > 1e-3
