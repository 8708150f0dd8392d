"""LoRA on the training backend: only adapters train, the base stays bit-identical, the
reference is the base with adapters disabled, sync and export are merged, GRPO improves."""

from __future__ import annotations


import pytest
import torch

pytest.importorskip("peft")

from opentinker.engine.backend import AdamParams, LocalBackend  # noqa: E402
from opentinker.engine.backend.lora import LoraSettings  # noqa: E402
from opentinker.engine.batch import TokenBatch  # noqa: E402
from opentinker.engine.model_loading import load_causal_lm  # noqa: E402
from opentinker.engine.rollout.transformers_engine import TransformersRolloutEngine  # noqa: E402


@pytest.fixture
def batch(arithmetic_prompt_ids):
    responses = [[17, 18, 19], [20, 21, 22, 23], [26], [27, 28], [29, 30, 31], [33, 34]]
    return TokenBatch.from_responses(arithmetic_prompt_ids, responses)


@pytest.fixture
def lora_backend(tiny_model_dir, tiny_tokenizer):
    return LocalBackend(load_causal_lm(str(tiny_model_dir)), pad_token_id=tiny_tokenizer.pad_token_id,
                        with_reference=True, lora=LoraSettings(rank=8))


def train(backend, batch, steps=3):
    for _ in range(steps):
        backend.forward_backward(batch, "cross_entropy")
        backend.optim_step(AdamParams(lr=1e-2))


def base_tensors(backend) -> dict[str, torch.Tensor]:
    return {name: t.clone() for name, t in backend.model.get_base_model().state_dict().items() if ".lora_" not in name}


def test_only_the_adapters_train_and_the_base_stays_bit_identical(lora_backend, batch):
    before = base_tensors(lora_backend)
    merged_before = {n: t for bucket in lora_backend.weights() for n, t in bucket}
    train(lora_backend, batch)
    trainable = [n for n, p in lora_backend.model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    optimized = {id(p) for group in lora_backend.optimizer.param_groups for p in group["params"]}
    assert optimized == {id(p) for p in lora_backend.model.parameters() if p.requires_grad}
    assert all(torch.equal(t, before[n]) for n, t in base_tensors(lora_backend).items())
    merged_after = {n: t for bucket in lora_backend.weights() for n, t in bucket}
    assert merged_after.keys() == merged_before.keys() == set(load_causal_lm_keys(lora_backend))
    assert any(not torch.equal(merged_after[n], merged_before[n]) for n in merged_after)


def load_causal_lm_keys(backend):
    return [name.replace(".base_layer.", ".") for name in backend.model.get_base_model().state_dict()
            if ".lora_" not in name]


def test_the_reference_is_the_base_with_adapters_disabled(lora_backend, batch, tiny_model_dir, tiny_tokenizer):
    plain = LocalBackend(load_causal_lm(str(tiny_model_dir)), pad_token_id=tiny_tokenizer.pad_token_id)
    train(lora_backend, batch)
    assert lora_backend.reference is None  # no second copy
    reference = lora_backend.forward(batch, reference=True).logprobs
    assert torch.equal(reference, plain.forward(batch).logprobs)
    assert not torch.allclose(lora_backend.forward(batch).logprobs, reference)


def test_merged_weights_sync_into_a_plain_rollout_model(lora_backend, batch, tiny_model_dir, tiny_tokenizer):
    train(lora_backend, batch)
    engine = TransformersRolloutEngine(load_causal_lm(str(tiny_model_dir)), eos_token_ids=[tiny_tokenizer.eos_token_id],
                                       pad_token_id=tiny_tokenizer.pad_token_id)
    engine.update_weights(lora_backend.weights(bucket_bytes=1 << 16))
    synced = LocalBackend(engine.model, pad_token_id=tiny_tokenizer.pad_token_id)
    assert torch.allclose(synced.forward(batch).logprobs, lora_backend.forward(batch).logprobs, atol=1e-5)


def test_export_loads_merged_with_transformers_and_as_an_adapter_with_peft(lora_backend, batch, tmp_path,
                                                                           tiny_model_dir, tiny_tokenizer):
    from peft import PeftModel

    train(lora_backend, batch)
    path = lora_backend.export_hf(tmp_path / "actor", tiny_tokenizer)
    expected = lora_backend.forward(batch).logprobs
    merged = LocalBackend(load_causal_lm(str(path)), pad_token_id=tiny_tokenizer.pad_token_id)
    assert torch.allclose(merged.forward(batch).logprobs, expected, atol=1e-5)
    adapter = PeftModel.from_pretrained(load_causal_lm(str(tiny_model_dir)), str(path / "adapter"))
    with_adapter = LocalBackend(adapter, pad_token_id=tiny_tokenizer.pad_token_id)
    assert torch.allclose(with_adapter.forward(batch).logprobs, expected, atol=1e-5)


def test_state_holds_only_the_adapters_and_round_trips(lora_backend, batch, tmp_path, tiny_model_dir, tiny_tokenizer):
    train(lora_backend, batch, steps=2)
    lora_backend.save_state(tmp_path / "state")
    saved = torch.load(tmp_path / "state" / "backend_state.pt", weights_only=False)["model"]
    assert saved and all(".lora_" in name for name in saved)
    restored = LocalBackend(load_causal_lm(str(tiny_model_dir)), pad_token_id=tiny_tokenizer.pad_token_id,
                            lora=LoraSettings(rank=8, seed=99))  # other initial adapters: all replaced
    restored.load_state(tmp_path / "state")
    for backend in (lora_backend, restored):
        train(backend, batch, steps=1)
    assert torch.equal(restored.forward(batch).logprobs, lora_backend.forward(batch).logprobs)


def test_grpo_with_lora_raises_the_reward_of_the_tiny_model(tiny_model_dir, heldout_run):
    history = heldout_run("actor_rollout_ref.model.lora_rank=8", lr=3e-4)
    before, after = history[0]["val/accuracy"], history[-1]["val/accuracy"]
    print(f"LoRA rank 8: held-out greedy accuracy {before:.3f} -> {after:.3f}")
    assert after >= before + 0.1
    rewards = [m["reward/mean"] for m in history if "reward/mean" in m]
    assert sum(rewards[-15:]) / 15 > sum(rewards[:15]) / 15
