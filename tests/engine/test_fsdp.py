"""FSDPBackend: 2 FSDP2 ranks (gloo, Ray actors) against LocalBackend on the same batches:
same logprobs, same weights after an update, same ``weights()``, state and export.

``opentinker-train`` with two CPU ranks in a process of its own is run (and checked: every step
trains, one optimizer step each) by the fsdp-2-ranks GRPO test in test_trainer.py."""

from __future__ import annotations

import pytest
import torch

from opentinker.engine.backend import AdamParams, BackendSpec, LocalBackend
from opentinker.engine.batch import TokenBatch
from opentinker.engine.model_loading import load_causal_lm

pytest.importorskip("ray")


@pytest.fixture(scope="module")
def fsdp(ray_session, tiny_model_dir, tiny_tokenizer):
    from opentinker.engine.backend.fsdp import FSDPBackend

    backend = FSDPBackend(BackendSpec(str(tiny_model_dir), tiny_tokenizer.pad_token_id, strategy="fsdp", ranks=2,
                                       with_reference=True))
    yield backend
    backend.close()


@pytest.fixture
def local(tiny_model_dir, tiny_tokenizer):
    return LocalBackend(load_causal_lm(str(tiny_model_dir)), pad_token_id=tiny_tokenizer.pad_token_id,
                        with_reference=True)


@pytest.fixture
def batch(arithmetic_prompt_ids):
    prompts = [p for p in arithmetic_prompt_ids[:3] for _ in range(2)] + [arithmetic_prompt_ids[3]]
    responses = [[17, 18, 19], [20, 21, 22, 23, 24], [26], [27, 28], [29, 30, 31, 32], [33], [34, 35]]
    masks = [[1] * len(r) for r in responses]
    masks[1] = [1, 1, 0, 0, 1]
    batch = TokenBatch.from_responses(prompts, responses, masks)
    batch.tensors["advantages"] = torch.linspace(-1, 1, len(batch)).unsqueeze(-1) * batch.response_mask
    batch.tensors["weights"] = batch.response_mask / batch.response_mask.sum()
    return batch


def all_weights(backend) -> dict[str, torch.Tensor]:
    return {name: tensor for bucket in backend.weights(bucket_bytes=1 << 16) for name, tensor in bucket}


def test_logprobs_match_the_local_backend(fsdp, local, batch):
    for reference in (False, True):
        sharded = fsdp.forward(batch, temperature=0.8, reference=reference, with_entropy=True)
        single = local.forward(batch, temperature=0.8, reference=reference, with_entropy=True)
        assert torch.allclose(sharded.logprobs, single.logprobs, atol=1e-5)
        assert torch.allclose(sharded.entropy, single.entropy, atol=1e-5)
    one_row = batch.select([2])  # fewer rows than ranks: the idle rank computes a zero-weight row
    assert torch.allclose(fsdp.forward(one_row).logprobs, local.forward(one_row).logprobs, atol=1e-5)
    # Rank 0 gets two samples of one prompt (prompt-once layout), rank 1 one row (padded): the
    # ranks must still run the same model calls (this hung before the driver chose one layout).
    mixed = batch.select([0, 1, 6])
    assert torch.allclose(fsdp.forward(mixed).logprobs, local.forward(mixed).logprobs, atol=1e-5)
    # Loss values without gradients (forward_loss) agree too.
    sharded, single = fsdp.forward_loss(batch, "cross_entropy"), local.forward_loss(batch, "cross_entropy")
    assert torch.allclose(sharded.elementwise_loss, single.elementwise_loss, atol=1e-5)
    assert sharded.metrics["loss:sum"] == pytest.approx(single.metrics["loss:sum"], rel=1e-5)


def test_one_update_gives_the_same_weights_and_weight_stream(fsdp, local, batch, tmp_path):
    fsdp.save_state(tmp_path / "before")  # the module's backend goes back to its start below
    before = all_weights(fsdp)
    assert before.keys() == all_weights(local).keys()
    assert all(torch.equal(before[name], t) for name, t in all_weights(local).items())
    config = {"policy_loss": "vanilla", "use_kl_loss": True}
    batch.tensors["ref_logprobs"] = local.forward(batch, reference=True).logprobs - 0.1 * batch.response_mask
    outputs = [backend.forward_backward(batch, "rl_policy", config, with_entropy=True) for backend in (fsdp, local)]
    assert outputs[0].metrics.keys() == outputs[1].metrics.keys()
    for key in outputs[0].metrics:
        assert outputs[0].metrics[key] == pytest.approx(outputs[1].metrics[key], abs=1e-5), key
    assert torch.allclose(outputs[0].elementwise_loss, outputs[1].elementwise_loss, atol=1e-5)
    # Adam's first step is lr * g / (|g| + eps): with the default eps it turns float noise in
    # near-zero gradients (|g| ~ 1e-8, summed in another order on two ranks) into visible
    # weight differences; a larger eps keeps the step a smooth function of the gradient.
    params = AdamParams(lr=1e-3, weight_decay=0.01, grad_clip=1.0, eps=1e-3)
    steps = [backend.optim_step(params) for backend in (fsdp, local)]
    assert steps[0]["grad_norm"] == pytest.approx(steps[1]["grad_norm"], rel=1e-5)
    after_fsdp, after_local = all_weights(fsdp), all_weights(local)
    for name, tensor in after_local.items():
        assert torch.allclose(after_fsdp[name], tensor, atol=1e-5), name
    assert any(not torch.equal(after_fsdp[name], before[name]) for name in before)
    fsdp.load_state(tmp_path / "before")
    restored = all_weights(fsdp)  # once: each call gathers every tensor from the ranks
    assert all(torch.equal(restored[name], t) for name, t in before.items())


def test_state_round_trip_and_export(fsdp, batch, tmp_path, tiny_tokenizer):
    fsdp.forward_backward(batch, "cross_entropy")
    fsdp.optim_step(AdamParams(lr=1e-3))
    fsdp.save_state(tmp_path / "state")
    saved, step = all_weights(fsdp), fsdp.step
    fsdp.forward_backward(batch, "cross_entropy")
    fsdp.optim_step(AdamParams(lr=1e-3))
    fsdp.load_state(tmp_path / "state")
    loaded = all_weights(fsdp)  # once: each call gathers every tensor from the ranks
    assert fsdp.step == step and all(torch.equal(loaded[n], t) for n, t in saved.items())
    exported = load_causal_lm(str(fsdp.export_hf(tmp_path / "hf", tiny_tokenizer)))
    for name, tensor in exported.state_dict().items():
        assert torch.equal(tensor, saved[name]), name


def _write_sharded_format(rank, path: str) -> None:
    """What an FSDP rank wrote before the one state file (dcp shards and rank{N}.pt), run on
    the rank by the test: checkpoints of that format must still load."""
    from pathlib import Path

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(rank.model, [rank.optimizer] if rank.optimizer else [])
    dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=str(Path(path) / "dcp"))
    torch.save({"rng": torch.get_rng_state(), "step": rank.step, "has_optimizer": rank.optimizer is not None},
               Path(path) / f"rank{rank.rank}.pt")


def test_a_checkpoint_moves_between_two_ranks_and_one_process(fsdp, local, batch, tmp_path):
    """One state file for every backend: what 2 ranks save, one process loads (weights,
    optimizer moments, step) and trains on exactly as the ranks do; and back."""
    import ray

    from opentinker.engine.backend.base import STATE_FILE

    params = AdamParams(lr=1e-3, eps=1e-3)
    fsdp.forward_backward(batch, "cross_entropy")
    fsdp.optim_step(params)
    fsdp.save_state(tmp_path / "ranks")
    assert sorted(p.name for p in (tmp_path / "ranks").iterdir()) == [STATE_FILE]
    local.load_state(tmp_path / "ranks")
    assert local.step == fsdp.step and local.optimizer is not None
    saved = all_weights(fsdp)
    assert all(torch.equal(saved[name], t) for name, t in all_weights(local).items())
    for backend in (fsdp, local):  # the moments came along: the next step is the same step
        backend.forward_backward(batch, "cross_entropy")
        backend.optim_step(params)
    after = all_weights(fsdp)
    assert all(torch.allclose(after[name], t, atol=1e-5) for name, t in all_weights(local).items())
    local.save_state(tmp_path / "one")
    fsdp.load_state(tmp_path / "ranks")
    fsdp.load_state(tmp_path / "one")
    restored = all_weights(fsdp)
    assert fsdp.step == local.step and all(torch.equal(restored[name], t) for name, t in all_weights(local).items())
    # The per-rank sharded format written before the state file still loads.
    ray.get([rank.__ray_call__.remote(_write_sharded_format, str(tmp_path / "sharded")) for rank in fsdp._ranks])
    fsdp.load_state(tmp_path / "ranks")
    fsdp.load_state(tmp_path / "sharded")
    assert fsdp.step == local.step and all(torch.equal(t, restored[name]) for name, t in all_weights(fsdp).items())


def test_more_ranks_than_the_cluster_has_fail_fast_naming_the_resource(ray_session, tiny_model_dir, tiny_tokenizer):
    from opentinker.engine.backend.fsdp import FSDPBackend

    with pytest.raises(RuntimeError, match=r"cannot place 64 FSDP ranks of 1 CPU each .* CPU available: \d"):
        FSDPBackend(BackendSpec(str(tiny_model_dir), tiny_tokenizer.pad_token_id, strategy="fsdp", ranks=64),
                    placement_timeout_s=2)


def test_lora_on_two_ranks_matches_lora_in_one_process(ray_session, tiny_model_dir, tiny_tokenizer, batch, tmp_path):
    pytest.importorskip("peft")
    from opentinker.engine.backend.fsdp import FSDPBackend
    from opentinker.engine.backend.lora import LoraSettings

    lora = LoraSettings(rank=8)
    local = LocalBackend(load_causal_lm(str(tiny_model_dir)), pad_token_id=tiny_tokenizer.pad_token_id,
                         with_reference=True, lora=lora)
    sharded = FSDPBackend(BackendSpec(str(tiny_model_dir), tiny_tokenizer.pad_token_id, strategy="fsdp", ranks=2,
                                      with_reference=True, lora=lora))
    try:
        for backend in (local, sharded):
            backend.forward_backward(batch, "cross_entropy")
            backend.optim_step(AdamParams(lr=1e-2, eps=1e-3))
        merged_local, merged_sharded = all_weights(local), all_weights(sharded)
        assert merged_local.keys() == merged_sharded.keys()
        for name, tensor in merged_local.items():
            assert torch.allclose(merged_sharded[name], tensor, atol=1e-5), name
        assert torch.allclose(sharded.forward(batch, reference=True).logprobs,
                              local.forward(batch, reference=True).logprobs, atol=1e-5)
        exported = load_causal_lm(str(sharded.export_hf(tmp_path / "hf", tiny_tokenizer)))
        assert all(torch.equal(t, merged_sharded[n]) for n, t in exported.state_dict().items())
        assert (tmp_path / "hf" / "adapter" / "adapter_config.json").exists()
        # The adapters' state moves between the two: saved by one process, the ranks go on from it.
        local.save_state(tmp_path / "one")
        sharded.load_state(tmp_path / "one")
        for backend in (local, sharded):
            backend.forward_backward(batch, "cross_entropy")
            backend.optim_step(AdamParams(lr=1e-2, eps=1e-3))
        merged_local, merged_sharded = all_weights(local), all_weights(sharded)
        for name, tensor in merged_local.items():
            assert torch.allclose(merged_sharded[name], tensor, atol=1e-5), name
        sharded.save_state(tmp_path / "ranks")
        assert set(torch.load(tmp_path / "ranks" / "backend_state.pt", weights_only=False)["model"]) == {
            name for name, param in local.model.named_parameters() if param.requires_grad}
    finally:
        sharded.close()
