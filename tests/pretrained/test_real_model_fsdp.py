"""Two FSDP2 ranks (gloo, Ray actors) on the real SmolLM2-135M-Instruct against one process:
the same logprobs and, after an AdamW step of every weight, the same weights. Its input and
output embeddings are one tied tensor, which sharding must keep one tensor."""

from __future__ import annotations

import pytest
import torch

from opentinker.engine.backend import AdamParams, BackendSpec, LocalBackend
from opentinker.engine.batch import TokenBatch

pytest.importorskip("ray")
pytestmark = pytest.mark.heavy  # a minute or two: scheduled first (tests/conftest.py)


def all_weights(backend) -> dict[str, torch.Tensor]:
    return {name: tensor for bucket in backend.weights(bucket_bytes=64 << 20) for name, tensor in bucket}


def test_two_ranks_compute_and_train_as_one_process(ray_session, smollm2_dir, smollm2_tokenizer,
                                                    word_problem_prompt_ids):
    from opentinker.engine.backend.fsdp import FSDPBackend
    from opentinker.engine.model_loading import load_causal_lm

    pad = smollm2_tokenizer.pad_token_id
    responses = [[28, 33, 2], [1230, 6256, 30, 216, 32], [28], [33, 35, 2]]
    batch = TokenBatch.from_responses(word_problem_prompt_ids, responses)
    batch.tensors["advantages"] = torch.linspace(-1, 1, len(batch)).unsqueeze(-1) * batch.response_mask
    local = LocalBackend(load_causal_lm(str(smollm2_dir)), pad_token_id=pad)
    fsdp = FSDPBackend(BackendSpec(str(smollm2_dir), pad, strategy="fsdp", ranks=2))
    try:
        sharded, single = fsdp.forward(batch, temperature=0.7), local.forward(batch, temperature=0.7)
        assert float((sharded.logprobs - single.logprobs).abs().max()) < 1e-4

        before = {name: tensor.clone() for name, tensor in all_weights(local).items()}  # live views
        config = {"policy_loss": "vanilla", "use_kl_loss": False}
        for backend in (fsdp, local):
            backend.forward_backward(batch, "rl_policy", config)
        params = AdamParams(lr=1e-3, grad_clip=1.0, eps=1e-3)  # eps: see tests/engine/test_fsdp.py
        steps = [backend.optim_step(params) for backend in (fsdp, local)]
        assert steps[0]["grad_norm"] == pytest.approx(steps[1]["grad_norm"], rel=1e-4)
        after_fsdp, after_local = all_weights(fsdp), all_weights(local)
        assert after_fsdp.keys() == after_local.keys()
        for name, tensor in after_local.items():
            assert torch.allclose(after_fsdp[name], tensor, atol=1e-5), name
        moved = {name: float((tensor - before[name]).abs().max()) for name, tensor in after_local.items()}
        assert min(moved.values()) > 1e-4, min(moved, key=moved.get)  # every weight took the step
        # Still one tied tensor on the ranks: the output layer moved with the input embedding.
        assert float((fsdp.forward(batch).logprobs - local.forward(batch).logprobs).abs().max()) < 1e-4
    finally:
        fsdp.close()
