"""The policy worker on the real tiny model: logprob paths, PPO update mechanics."""

from __future__ import annotations

import pytest
import torch

from opentinker.engine.batch import TokenBatch, packed_inputs, padded_inputs
from opentinker.engine.model_loading import ModelLoadError, load_causal_lm, resolve_model_path


@pytest.fixture
def batch(arithmetic_prompt_ids):
    """Responses of different lengths, one with an environment-token hole in its mask."""
    responses = [[17, 18, 19], [20, 21, 22, 23, 24, 25], [26], [27, 28, 29, 30], [31, 32], [33, 34, 35]]
    masks = [[1, 1, 1], [1, 1, 0, 0, 1, 1], [1], [1, 1, 1, 1], [1, 1], [1, 0, 1]]
    return TokenBatch.from_responses(arithmetic_prompt_ids, responses, masks)


def assert_same_gradients(model_a, model_b) -> None:
    """Compare the last update's gradients, not the weights: Adam's first step is about
    lr * sign(g), which turns float noise in near-zero gradients into visible differences."""
    for (name, p1), (_, p2) in zip(model_a.named_parameters(), model_b.named_parameters()):
        scale = float(p1.grad.abs().max())
        assert float((p1.grad - p2.grad).abs().max()) <= 1e-4 * scale + 1e-8, name


def with_training_tensors(batch: TokenBatch, seed: int = 0) -> TokenBatch:
    generator = torch.Generator().manual_seed(seed)
    batch.tensors["advantages"] = torch.randn(len(batch), 1, generator=generator) * batch.response_mask
    return batch


def test_packed_and_padded_logprobs_agree(make_worker, batch):
    packed = make_worker("actor_rollout_ref.model.use_remove_padding=true")
    padded = make_worker("actor_rollout_ref.model.use_remove_padding=false")
    a = packed.compute_logprobs(batch, temperature=1.0, with_entropy=True)
    b = padded.compute_logprobs(batch, temperature=1.0, with_entropy=True)
    assert torch.allclose(a["logprobs"], b["logprobs"], atol=1e-5)
    assert torch.allclose(a["entropy"], b["entropy"], atol=1e-5)
    # past each response the values are exactly zero
    assert a["logprobs"][2, 1:].abs().sum() == 0
    assert (a["logprobs"][0, :3] < 0).all()


def test_packed_inputs_restart_positions_and_compute_no_padding(batch):
    packed = packed_inputs(batch)
    padded = padded_inputs(batch, pad_token_id=0)
    total_tokens = sum(len(p) + len(r) for p, r in zip(batch.prompt_ids, batch.response_ids))
    assert packed.input_ids.shape == (1, total_tokens)
    assert padded.input_ids.numel() > total_tokens
    assert (packed.position_ids == 0).sum() == len(batch)


def test_logprobs_are_independent_of_micro_batch_size(make_worker, batch):
    small = make_worker("actor_rollout_ref.actor.ppo_micro_batch_size=1").compute_logprobs(batch, temperature=1.0)
    large = make_worker("actor_rollout_ref.actor.ppo_micro_batch_size=64").compute_logprobs(batch, temperature=1.0)
    assert torch.allclose(small["logprobs"], large["logprobs"], atol=1e-5)


@pytest.mark.parametrize("agg_mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_gradient_accumulation_equals_one_big_batch(make_worker, batch, agg_mode):
    common = [
        f"actor_rollout_ref.actor.loss_agg_mode={agg_mode}",
        "actor_rollout_ref.actor.optim.lr=1e-3",
        "actor_rollout_ref.actor.grad_clip=1e9",
        "actor_rollout_ref.rollout.n=6",
        "data.train_batch_size=1",
        "actor_rollout_ref.actor.ppo_mini_batch_size=1",
    ]
    whole = make_worker(*common, "actor_rollout_ref.actor.ppo_micro_batch_size=6")
    pieces = make_worker(*common, "actor_rollout_ref.actor.ppo_micro_batch_size=2")
    for worker in (whole, pieces):
        worker.update(with_training_tensors(batch), temperature=1.0)
    assert_same_gradients(whole.model, pieces.model)


def test_update_raises_the_advantage_weighted_logprob(make_worker, batch):
    worker = make_worker("actor_rollout_ref.actor.optim.lr=1e-4", "actor_rollout_ref.rollout.n=6",
                         "data.train_batch_size=1", "actor_rollout_ref.actor.ppo_mini_batch_size=1",
                         "actor_rollout_ref.actor.optim.weight_decay=0")
    batch.tensors["advantages"] = torch.tensor([1.0, -1.0, 1.0, -1.0, 1.0, -1.0]).unsqueeze(-1) * batch.response_mask

    def surrogate() -> float:  # what a small policy-gradient step must increase
        logprobs = worker.compute_logprobs(batch, temperature=1.0)["logprobs"]
        return float((batch.tensors["advantages"] * logprobs).sum())

    before = surrogate()
    metrics = worker.update(batch, temperature=1.0)
    assert surrogate() > before
    assert metrics["actor/optimizer_steps"] == 1
    assert metrics["actor/grad_norm"] > 0


def test_grad_clip_bounds_the_step(make_worker, batch):
    worker = make_worker("actor_rollout_ref.actor.grad_clip=1e-6", "actor_rollout_ref.actor.optim.lr=1e-3",
                         "actor_rollout_ref.rollout.n=6", "data.train_batch_size=1",
                         "actor_rollout_ref.actor.ppo_mini_batch_size=1", "actor_rollout_ref.actor.optim.weight_decay=0")
    with_training_tensors(batch)
    worker.update(batch, temperature=1.0)
    grads = [p.grad for p in worker.model.parameters() if p.grad is not None]
    clipped_norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
    assert clipped_norm == pytest.approx(1e-6, rel=1e-3)


def test_ppo_epochs_and_mini_batches_count_optimizer_steps(make_worker, batch):
    worker = make_worker("actor_rollout_ref.rollout.n=2", "data.train_batch_size=3",
                         "actor_rollout_ref.actor.ppo_mini_batch_size=1", "actor_rollout_ref.actor.ppo_epochs=2")
    with_training_tensors(batch)
    batch.tensors["old_logprobs"] = worker.compute_logprobs(batch, temperature=1.0)["logprobs"]
    metrics = worker.update(batch, temperature=1.0)
    assert metrics["actor/optimizer_steps"] == 6  # 3 mini-batches of 1 prompt x 2 samples, 2 epochs


def test_learning_rate_warms_up_linearly(make_worker, batch):
    worker = make_worker("actor_rollout_ref.actor.optim.lr=1e-3", "actor_rollout_ref.actor.optim.lr_warmup_steps=4",
                         "actor_rollout_ref.rollout.n=6", "data.train_batch_size=1",
                         "actor_rollout_ref.actor.ppo_mini_batch_size=1")
    with_training_tensors(batch)
    lrs = [worker.optimizer.param_groups[0]["lr"]]
    for _ in range(5):
        worker.update(batch, temperature=1.0)
        lrs.append(worker.optimizer.param_groups[0]["lr"])
    assert lrs == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3, 1e-3])


def test_kl_loss_uses_a_frozen_reference(make_worker, batch):
    worker = make_worker("actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.actor.optim.lr=1e-3",
                         "actor_rollout_ref.rollout.n=6", "data.train_batch_size=1",
                         "actor_rollout_ref.actor.ppo_mini_batch_size=1")
    with_training_tensors(batch)
    reference_before = worker.compute_logprobs(batch, temperature=1.0, reference=True)["logprobs"]
    batch.tensors["ref_logprobs"] = reference_before
    first = worker.update(batch, temperature=1.0)
    second = worker.update(batch, temperature=1.0)
    reference_after = worker.compute_logprobs(batch, temperature=1.0, reference=True)["logprobs"]
    actor_after = worker.compute_logprobs(batch, temperature=1.0)["logprobs"]
    assert torch.equal(reference_before, reference_after)
    assert not torch.allclose(actor_after, reference_after)
    assert first["actor/kl"] == pytest.approx(0.0, abs=1e-7)  # identical weights before the first step
    assert second["actor/kl"] > 0


def test_worker_without_reference_says_so(make_worker, batch):
    with pytest.raises(RuntimeError, match="no reference model"):
        make_worker().compute_logprobs(batch, temperature=1.0, reference=True)


def test_gradient_checkpointing_gives_the_same_update(make_worker, batch):
    common = ["actor_rollout_ref.actor.optim.lr=1e-3", "actor_rollout_ref.rollout.n=6", "data.train_batch_size=1",
              "actor_rollout_ref.actor.ppo_mini_batch_size=1"]
    plain = make_worker(*common)
    checkpointed = make_worker(*common, "actor_rollout_ref.model.enable_gradient_checkpointing=true")
    for worker in (plain, checkpointed):
        worker.update(with_training_tensors(batch), temperature=1.0)
    assert_same_gradients(plain.model, checkpointed.model)


def test_checkpoint_round_trips_as_a_hugging_face_folder(make_worker, tiny_tokenizer, batch, tmp_path):
    worker = make_worker()
    path = worker.save_checkpoint(tmp_path / "actor", tiny_tokenizer)
    reloaded = load_causal_lm(str(path))
    for (name, a), b in zip(worker.model.state_dict().items(), reloaded.state_dict().values()):
        assert torch.equal(a, b), name
    assert (path / "tokenizer_config.json").exists()


def test_missing_model_path_is_a_clear_error(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        resolve_model_path(str(tmp_path / "no-such-model"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="no config.json"):
        resolve_model_path(str(tmp_path / "empty"))


def test_on_policy_shortcut_equals_stored_old_logprobs(make_worker, batch):
    """Skipping the old-logprob pass (one epoch, one mini-batch) must not change the update."""
    common = ["actor_rollout_ref.actor.optim.lr=1e-3", "actor_rollout_ref.rollout.n=6", "data.train_batch_size=1",
              "actor_rollout_ref.actor.ppo_mini_batch_size=1"]
    stored, shortcut = make_worker(*common), make_worker(*common)
    with_training_tensors(batch)
    stored_batch = batch.select(range(len(batch)))
    stored_batch.tensors["old_logprobs"] = stored.compute_logprobs(batch, temperature=1.0)["logprobs"]
    stored.update(stored_batch, temperature=1.0)
    shortcut.update(batch, temperature=1.0)
    assert_same_gradients(stored.model, shortcut.model)


@pytest.fixture
def grouped_batch(arithmetic_prompt_ids):
    """GRPO-shaped: 3 prompts x 3 samples, ragged responses, a mask hole, a one-token response."""
    prompts = [p for p in arithmetic_prompt_ids[:3] for _ in range(3)]
    responses = [[17, 18, 19], [20, 21, 22, 23, 24], [26], [27, 28], [29, 30, 31, 32], [33],
                 [34, 35, 36, 37, 38, 39], [40], [41, 42]]
    masks = [[1] * len(r) for r in responses]
    masks[1] = [1, 1, 0, 0, 1]
    return TokenBatch.from_responses(prompts, responses, masks)


PATHS = {
    "shared_prefix": ["actor_rollout_ref.model.share_prompt_prefix=true"],
    "padded": ["actor_rollout_ref.model.share_prompt_prefix=false"],
    "packed": ["actor_rollout_ref.model.use_remove_padding=true"],
}


def test_shared_prefix_padded_and_packed_logprobs_agree(make_worker, grouped_batch):
    results = {name: make_worker(*flags).compute_logprobs(grouped_batch, temperature=0.8, with_entropy=True)
               for name, flags in PATHS.items()}
    for name in ("shared_prefix", "packed"):
        assert torch.allclose(results[name]["logprobs"], results["padded"]["logprobs"], atol=1e-5), name
        assert torch.allclose(results[name]["entropy"], results["padded"]["entropy"], atol=1e-5), name


def test_shared_prefix_handles_one_token_responses(make_worker, arithmetic_prompt_ids):
    batch = TokenBatch.from_responses([arithmetic_prompt_ids[0]] * 2 + [arithmetic_prompt_ids[1]] * 2,
                                      [[5], [6], [7], [8]])
    shared = make_worker(*PATHS["shared_prefix"]).compute_logprobs(batch, temperature=1.0)["logprobs"]
    padded = make_worker(*PATHS["padded"]).compute_logprobs(batch, temperature=1.0)["logprobs"]
    assert shared.shape == (4, 1)
    assert torch.allclose(shared, padded, atol=1e-5)


def test_shared_prefix_gives_the_same_gradients(make_worker, grouped_batch):
    common = ["actor_rollout_ref.actor.grad_clip=1e9", "actor_rollout_ref.rollout.n=3", "data.train_batch_size=3",
              "actor_rollout_ref.actor.ppo_mini_batch_size=3", "actor_rollout_ref.actor.use_kl_loss=true"]
    shared = make_worker(*common, *PATHS["shared_prefix"])
    padded = make_worker(*common, *PATHS["padded"])
    with_training_tensors(grouped_batch)
    grouped_batch.tensors["ref_logprobs"] = padded.compute_logprobs(grouped_batch, temperature=1.0)["logprobs"] - 0.1
    for worker in (shared, padded):
        worker.update(grouped_batch, temperature=1.0)
    assert_same_gradients(shared.model, padded.model)
