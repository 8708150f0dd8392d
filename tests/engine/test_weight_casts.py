"""The cached bf16 weight copies of the update (:mod:`opentinker.engine.backend.weight_casts`)
against autocast's own per-call casts, on the real tiny model under CPU bf16 autocast."""

from __future__ import annotations

import copy

import pytest
import torch

from opentinker.engine.backend.weight_casts import CastWeights


def loss_of(model, ids):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(input_ids=ids).logits
    return torch.nn.functional.cross_entropy(logits[:, :-1].float().flatten(0, 1), ids[:, 1:].flatten())


def test_cached_casts_give_autocasts_losses_and_gradients_bit_for_bit(tiny_model):
    """Two micro-batches accumulate gradients, an AdamW step, two more and a no-grad pass: the
    same losses and fp32 gradients as plain autocast, every weight cast once per step."""
    plain = tiny_model.train()
    cached_model = copy.deepcopy(plain)
    cast = CastWeights(cached_model)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (plain, cached_model)]
    generator = torch.Generator().manual_seed(0)
    batches = [torch.randint(3, 300, (3, 17), generator=generator) for _ in range(4)]
    made = []
    for step in range(2):
        for ids in batches[2 * step:2 * step + 2]:
            want, got = loss_of(plain, ids), loss_of(cast, ids)
            assert torch.equal(want, got)
            want.backward()
            got.backward()
            made.append(id(next(iter(cast.copies().values()))))
        for (name, a), b in zip(plain.named_parameters(), cached_model.parameters()):
            assert torch.equal(a.grad, b.grad), name
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    assert made[0] == made[1] and made[2] == made[3] and made[1] != made[2]  # recast after each step only
    with torch.no_grad():
        assert torch.equal(loss_of(plain, batches[0]), loss_of(cast, batches[0]))
        assert next(iter(cast.copies().values())).grad_fn is None


def test_only_linear_weights_are_cast_and_a_tied_embedding_stays_fp32(tiny_model):
    tiny_model.lm_head.weight = tiny_model.model.embed_tokens.weight  # tie them
    copies = CastWeights(tiny_model).copies()
    assert copies and all(t.dtype == torch.bfloat16 for t in copies.values())
    assert "lm_head.weight" not in copies and not any("norm" in name or "embed" in name for name in copies)
    assert any(name.endswith("q_proj.bias") for name in copies) or not any(
        name.endswith("q_proj.bias") for name, _ in tiny_model.named_parameters())
    assert tiny_model.model.embed_tokens.weight.dtype == torch.float32


@pytest.mark.parametrize("variant", ["full", "lora", "checkpointed"])
def test_local_backend_with_cached_casts_trains_as_under_autocast_alone(tiny_model_dir, monkeypatch, variant):
    """LocalBackend's path on a GPU (bf16 autocast; here CPU autocast stands in for CUDA's):
    gradients accumulated over two micro-batches, an AdamW step, two more micro-batches and a
    forward pass give what autocast's own casts give, bit for bit: full, LoRA, and with
    activation checkpointing (its recomputation runs outside the cached copies)."""
    from opentinker.engine.backend import BackendSpec, make_backend
    from opentinker.engine.backend.base import AdamParams
    from opentinker.engine.backend.forward import ResponseScorer
    from opentinker.engine.backend.spec import LoraSettings
    from opentinker.engine.batch import TokenBatch

    monkeypatch.setattr(ResponseScorer, "_autocast", lambda self: torch.autocast("cpu", dtype=torch.bfloat16))
    batch = TokenBatch.from_responses([[1, 5, 9, 12]] * 4, [[7, 8, 9], [7, 8], [4], [6, 6, 6, 6]])
    results = []
    for cached in (True, False):
        backend = make_backend(BackendSpec(model_path=str(tiny_model_dir), device="cpu",
                                           lora=LoraSettings(rank=4) if variant == "lora" else None,
                                           gradient_checkpointing=variant == "checkpointed"))
        backend.weight_casts = CastWeights(backend.model) if cached else None
        for step in range(2):
            for half in (range(2), range(2, 4)):
                backend.forward_backward(batch.select(half), "cross_entropy")
            if step == 0:
                backend.optim_step(AdamParams(lr=1e-2))
        trained = [p.grad.clone() for p in backend.model.parameters() if p.requires_grad]
        results.append([*trained, backend.forward(batch).logprobs])
    assert len(results[0]) > 2
    assert all(torch.equal(a, b) for a, b in zip(*results))
