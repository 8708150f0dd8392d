"""The PPO recipe over the training primitives: every loss_agg_mode and policy loss gives the
gradient of its definition (one pass over the whole mini-batch with the algorithms' own
functions), however the mini-batch is split; old-logprob passes decided by the batch."""

from __future__ import annotations

import math

import pytest
import torch

from opentinker.config import make_config
from opentinker.engine.algorithms import agg_loss, get_policy_loss, kl_penalty
from opentinker.engine.algorithms.policy_losses import SEQUENCE_AGGREGATED_LOSSES
from opentinker.engine.backend import LocalBackend
from opentinker.engine.batch import TokenBatch
from opentinker.engine.model_loading import load_causal_lm
from opentinker.engine.ppo.policy_update import PPOUpdate, lr_factor, loss_weights


class GradCapture(LocalBackend):
    """A LocalBackend that keeps the gradients each optimizer step was given."""

    def optim_step(self, params):
        self.captured = {n: p.grad.clone() for n, p in self.model.named_parameters() if p.grad is not None}
        return super().optim_step(params)


@pytest.fixture
def batch(arithmetic_prompt_ids):
    responses = [[17, 18, 19], [20, 21, 22, 23, 24, 25], [26], [27, 28, 29, 30], [31, 32], [33, 34, 35]]
    masks = [[1, 1, 1], [1, 1, 0, 0, 1, 1], [1], [1, 1, 1, 1], [1, 1], [1, 0, 1]]
    batch = TokenBatch.from_responses(arithmetic_prompt_ids, responses, masks)
    generator = torch.Generator().manual_seed(0)
    batch.tensors["advantages"] = torch.randn(len(batch), 1, generator=generator) * batch.response_mask
    return batch


def recipe(tiny_model_dir, tiny_tokenizer, *overrides, backend_cls=GradCapture) -> PPOUpdate:
    cfg = make_config(["actor_rollout_ref.rollout.n=6", "data.train_batch_size=1",
                       "actor_rollout_ref.actor.ppo_mini_batch_size=1", "actor_rollout_ref.actor.grad_clip=1e9",
                       *overrides])
    ar = cfg.actor_rollout_ref
    backend = backend_cls(load_causal_lm(str(tiny_model_dir)), pad_token_id=tiny_tokenizer.pad_token_id,
                          with_reference=bool(ar.actor.use_kl_loss),
                          share_prompt_prefix=bool(ar.model.share_prompt_prefix))
    return PPOUpdate(backend, cfg)


def definition_gradient(ppo: PPOUpdate, batch: TokenBatch, temperature: float) -> dict[str, torch.Tensor]:
    """The mini-batch loss as the algorithms define it, in one pass, on a twin of the model."""
    actor = ppo.actor
    twin = LocalBackend(load_causal_lm_like(ppo.backend.model), pad_token_id=ppo.backend.scorer.pad_token_id)
    logprobs, entropy = twin.scorer(twin.model, batch, temperature, True)
    mask = batch.response_mask
    old = batch.tensors.get("old_logprobs", logprobs.detach())
    agg_mode = SEQUENCE_AGGREGATED_LOSSES.get(actor.policy_loss, actor.loss_agg_mode)
    loss, _ = get_policy_loss(actor.policy_loss)(
        old, logprobs, batch.tensors["advantages"], mask, loss_agg_mode=actor.loss_agg_mode,
        clip_ratio=actor.clip_ratio, clip_ratio_c=actor.clip_ratio_c, loss_scale_factor=ppo.scale)
    if actor.entropy_coeff:
        loss = loss - actor.entropy_coeff * agg_loss(entropy, mask, agg_mode, ppo.scale)
    if actor.use_kl_loss:
        kl = kl_penalty(logprobs, batch.tensors["ref_logprobs"], actor.kl_loss_type)
        loss = loss + actor.kl_loss_coef * agg_loss(kl, mask, agg_mode, ppo.scale)
    loss.backward()
    return {n: p.grad for n, p in twin.model.named_parameters() if p.grad is not None}


def load_causal_lm_like(model):
    import copy

    return copy.deepcopy(model)


def assert_close_grads(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        scale = float(a[name].abs().max())
        assert float((a[name] - b[name]).abs().max()) <= 1e-4 * scale + 1e-8, name


@pytest.mark.parametrize("policy_loss", ["vanilla", "gspo", "cispo"])
@pytest.mark.parametrize("agg_mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_every_agg_mode_gives_the_definitions_gradient(tiny_model_dir, tiny_tokenizer, batch, agg_mode, policy_loss):
    ppo = recipe(tiny_model_dir, tiny_tokenizer, f"actor_rollout_ref.actor.loss_agg_mode={agg_mode}",
                 f"actor_rollout_ref.actor.policy_loss={policy_loss}", "actor_rollout_ref.actor.ppo_micro_batch_size=2",
                 "actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.actor.entropy_coeff=0.01",
                 "actor_rollout_ref.actor.ppo_epochs=2")
    batch.tensors["old_logprobs"] = ppo.logprobs(batch, temperature=0.9) - 0.05 * batch.response_mask
    batch.tensors["ref_logprobs"] = batch.tensors["old_logprobs"] - 0.1 * batch.response_mask
    expected = definition_gradient(ppo, batch, temperature=0.9)
    ppo.actor.ppo_epochs = 1  # one mini-batch step: the gradient is taken at the starting weights
    metrics = ppo.update(batch, temperature=0.9)
    assert_close_grads(ppo.backend.captured, expected)
    assert metrics["actor/optimizer_steps"] == 1 and metrics["actor/kl"] > 0


def test_the_on_policy_shortcut_equals_stored_old_logprobs(tiny_model_dir, tiny_tokenizer, batch):
    stored, shortcut = recipe(tiny_model_dir, tiny_tokenizer), recipe(tiny_model_dir, tiny_tokenizer)
    with_old = batch.select(range(len(batch)))
    with_old.tensors["old_logprobs"] = stored.logprobs(batch, temperature=1.0)
    assert not shortcut.needs_old_logprobs(batch)
    stored.update(with_old, temperature=1.0)
    shortcut.update(batch, temperature=1.0)
    assert_close_grads(stored.backend.captured, shortcut.backend.captured)


def test_a_batch_larger_than_one_mini_batch_needs_old_logprobs(tiny_model_dir, tiny_tokenizer, batch):
    """A client may push more rows than data.train_batch_size: the update then takes several
    optimizer steps, and all but the first are off-policy (the old shortcut trained them
    with ratio 1 and no clipping)."""
    ppo = recipe(tiny_model_dir, tiny_tokenizer, "actor_rollout_ref.rollout.n=2")  # mini-batch: 2 samples
    assert ppo.needs_old_logprobs(batch)  # 6 samples
    with pytest.raises(ValueError, match="needs 'old_logprobs'"):
        ppo.update(batch, temperature=1.0)
    batch.tensors["old_logprobs"] = ppo.logprobs(batch, temperature=1.0)
    assert ppo.update(batch, temperature=1.0)["actor/optimizer_steps"] == 3
    assert not ppo.needs_old_logprobs(batch.select([0, 1]))


def test_epochs_and_mini_batches_count_optimizer_steps(tiny_model_dir, tiny_tokenizer, batch):
    ppo = recipe(tiny_model_dir, tiny_tokenizer, "actor_rollout_ref.rollout.n=2", "data.train_batch_size=3",
                 "actor_rollout_ref.actor.ppo_epochs=2")
    batch.tensors["old_logprobs"] = ppo.logprobs(batch, temperature=1.0)
    assert ppo.update(batch, temperature=1.0)["actor/optimizer_steps"] == 6  # 3 mini-batches x 2 epochs


def test_update_raises_the_advantage_weighted_logprob(tiny_model_dir, tiny_tokenizer, batch):
    ppo = recipe(tiny_model_dir, tiny_tokenizer, "actor_rollout_ref.actor.optim.lr=1e-4",
                 "actor_rollout_ref.actor.optim.weight_decay=0")
    batch.tensors["advantages"] = torch.tensor([1.0, -1.0, 1.0, -1.0, 1.0, -1.0]).unsqueeze(-1) * batch.response_mask

    def surrogate() -> float:
        return float((batch.tensors["advantages"] * ppo.logprobs(batch, temperature=1.0)).sum())

    before = surrogate()
    metrics = ppo.update(batch, temperature=1.0)
    assert surrogate() > before and metrics["actor/grad_norm"] > 0


def test_kl_loss_uses_a_frozen_reference(tiny_model_dir, tiny_tokenizer, batch):
    ppo = recipe(tiny_model_dir, tiny_tokenizer, "actor_rollout_ref.actor.use_kl_loss=true",
                 "actor_rollout_ref.actor.optim.lr=1e-3")
    reference_before = ppo.logprobs(batch, temperature=1.0, reference=True)
    batch.tensors["ref_logprobs"] = reference_before
    first = ppo.update(batch, temperature=1.0)
    second = ppo.update(batch, temperature=1.0)
    assert torch.equal(reference_before, ppo.logprobs(batch, temperature=1.0, reference=True))
    assert not torch.allclose(ppo.logprobs(batch, temperature=1.0), reference_before)
    assert first["actor/kl"] == pytest.approx(0.0, abs=1e-7) and second["actor/kl"] > 0


def test_logprobs_are_independent_of_micro_batch_size(tiny_model_dir, tiny_tokenizer, batch):
    small = recipe(tiny_model_dir, tiny_tokenizer, "actor_rollout_ref.actor.ppo_micro_batch_size=1")
    large = recipe(tiny_model_dir, tiny_tokenizer, "actor_rollout_ref.actor.ppo_micro_batch_size=64")
    assert torch.allclose(small.logprobs(batch, temperature=1.0), large.logprobs(batch, temperature=1.0), atol=1e-5)


def test_learning_rate_warms_up_linearly(tiny_model_dir, tiny_tokenizer, batch):
    ppo = recipe(tiny_model_dir, tiny_tokenizer, "actor_rollout_ref.actor.optim.lr=1e-3",
                 "actor_rollout_ref.actor.optim.lr_warmup_steps=4")
    lrs = [ppo.update(batch, temperature=1.0)["actor/lr"] for _ in range(5)]
    assert lrs == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3])
    # cosine after 5 warm-up updates: update 15 of 20 is 2/3 of the way down to min_lr_ratio
    assert lr_factor(15, 20, 5, "cosine", 0.1) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 2 / 3)))


def test_loss_weights_implement_each_mode():
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    loss = torch.tensor([[1.0, 2.0, 9.0], [4.0, 9.0, 9.0], [9.0, 9.0, 9.0]])
    for mode in ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
        weighted = float((loss * loss_weights(mask, mode, 5.0)).sum())
        assert weighted == pytest.approx(float(agg_loss(loss, mask, mode, 5.0))), mode
    assert float(loss_weights(torch.zeros(2, 2), "token-mean", 1.0).sum()) == 0
