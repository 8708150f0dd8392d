"""The training primitives on the real tiny model (LocalBackend): logprob paths, sum-reduced
losses, the optimizer step, weights and state."""

from __future__ import annotations

import math

import pytest
import torch

from opentinker.engine.backend import AdamParams, LocalBackend
from opentinker.engine.batch import TokenBatch, packed_inputs, padded_inputs
from opentinker.engine.model_loading import ModelLoadError, load_causal_lm, resolve_model_path


@pytest.fixture
def batch(arithmetic_prompt_ids):
    """Responses of different lengths, one with an environment-token hole in its mask."""
    responses = [[17, 18, 19], [20, 21, 22, 23, 24, 25], [26], [27, 28, 29, 30], [31, 32], [33, 34, 35]]
    masks = [[1, 1, 1], [1, 1, 0, 0, 1, 1], [1], [1, 1, 1, 1], [1, 1], [1, 0, 1]]
    return TokenBatch.from_responses(arithmetic_prompt_ids, responses, masks)


@pytest.fixture
def grouped_batch(arithmetic_prompt_ids):
    """GRPO-shaped: 3 prompts x 3 samples, ragged responses, a mask hole, a one-token response."""
    prompts = [p for p in arithmetic_prompt_ids[:3] for _ in range(3)]
    responses = [[17, 18, 19], [20, 21, 22, 23, 24], [26], [27, 28], [29, 30, 31, 32], [33],
                 [34, 35, 36, 37, 38, 39], [40], [41, 42]]
    masks = [[1] * len(r) for r in responses]
    masks[1] = [1, 1, 0, 0, 1]
    return TokenBatch.from_responses(prompts, responses, masks)


PATHS = {  # each layout alone (by default a micro-batch takes the cheaper of packed and shared prefix)
    "shared_prefix": ["actor_rollout_ref.model.share_prompt_prefix=true", "actor_rollout_ref.model.use_remove_padding=false"],
    "padded": ["actor_rollout_ref.model.share_prompt_prefix=false", "actor_rollout_ref.model.use_remove_padding=false"],
    "packed": ["actor_rollout_ref.model.use_remove_padding=true", "actor_rollout_ref.model.share_prompt_prefix=false"],
}


def grads(model) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def assert_close_grads(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        scale = float(a[name].abs().max())
        assert float((a[name] - b[name]).abs().max()) <= 1e-4 * scale + 1e-8, name


# -- forward -------------------------------------------------------------------------


def test_shared_prefix_padded_and_packed_logprobs_agree(make_backend, grouped_batch):
    results = {name: make_backend(*flags).forward(grouped_batch, temperature=0.8, with_entropy=True)
               for name, flags in PATHS.items()}
    for name in ("shared_prefix", "packed"):
        assert torch.allclose(results[name].logprobs, results["padded"].logprobs, atol=1e-5), name
        assert torch.allclose(results[name].entropy, results["padded"].entropy, atol=1e-5), name
    padded = results["padded"].logprobs
    assert padded[2, 1:].abs().sum() == 0 and (padded[0, :3] < 0).all()  # exactly zero past a response


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_token_logprobs_match_log_softmax(monkeypatch, temperature):
    """Row chunk by row chunk (several chunks here), the logprobs, the entropy and the logits'
    gradient are those of log_softmax through autograd; the entropy is a statistic only."""
    from opentinker.engine.backend import token_logprobs

    monkeypatch.setattr(token_logprobs, "CHUNK_ELEMENTS", 40)
    torch.manual_seed(0)
    logits = torch.randn(3, 5, 11, dtype=torch.float64) * 4
    targets = torch.randint(0, 11, (3, 5))
    weights = torch.randn(3, 5, dtype=torch.float64)
    ours = logits.clone().requires_grad_()
    logprobs, entropy = token_logprobs.logprobs_and_entropy(ours, targets, temperature, True, entropy_grad=False)
    plain = logits.clone().requires_grad_()
    log_softmax = torch.log_softmax(plain / temperature, dim=-1)
    expected = log_softmax.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(logprobs, expected)
    torch.testing.assert_close(entropy, -(log_softmax.exp() * log_softmax).sum(-1).detach())
    assert not entropy.requires_grad
    (logprobs * weights).sum().backward()
    (expected * weights).sum().backward()
    torch.testing.assert_close(ours.grad, plain.grad)
    assert torch.autograd.gradcheck(
        lambda x: token_logprobs.logprobs_and_entropy(x, targets, temperature, False)[0],
        (logits.clone().requires_grad_(),))


def test_entropy_in_the_loss_keeps_its_gradient():
    from opentinker.engine.backend.token_logprobs import logprobs_and_entropy

    logits = torch.randn(2, 3, 7, requires_grad=True)
    _, entropy = logprobs_and_entropy(logits, torch.zeros(2, 3, dtype=torch.long), 1.0, True, entropy_grad=True)
    entropy.sum().backward()
    assert logits.grad is not None and float(logits.grad.abs().sum()) > 0


def test_shared_prefix_handles_one_token_responses(make_backend, arithmetic_prompt_ids):
    batch = TokenBatch.from_responses([arithmetic_prompt_ids[0]] * 2 + [arithmetic_prompt_ids[1]] * 2,
                                      [[5], [6], [7], [8]])
    shared = make_backend(*PATHS["shared_prefix"]).forward(batch).logprobs
    padded = make_backend(*PATHS["padded"]).forward(batch).logprobs
    assert shared.shape == (4, 1) and torch.allclose(shared, padded, atol=1e-5)


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_packed_attention_is_each_sequences_own_causal_attention(kv_heads):
    """Per sequence, with no [T, T] mask: the values and gradients of sdpa through the
    block-diagonal causal mask transformers builds for a packed row (GQA included)."""
    from opentinker.engine.backend.packed_attention import packed_attention

    torch.manual_seed(0)
    lengths = [5, 1, 7, 3]
    total = sum(lengths)
    query = torch.randn(1, 4, total, 8, dtype=torch.float64, requires_grad=True)
    key = torch.randn(1, kv_heads, total, 8, dtype=torch.float64, requires_grad=True)
    value = torch.randn(1, kv_heads, total, 8, dtype=torch.float64, requires_grad=True)
    cu = torch.tensor([0, 5, 6, 13, 16], dtype=torch.int32)
    ours, _ = packed_attention(torch.nn.Module(), query, key, value, None, scaling=0.3, cu_seq_lens_q=cu,
                               max_length_q=7)
    document = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    mask = (document[:, None] == document[None, :]) & torch.ones(total, total, dtype=torch.bool).tril()
    expected = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=0.3,
                                                                enable_gqa=kv_heads != 4).transpose(1, 2)
    torch.testing.assert_close(ours, expected)
    weights = torch.randn_like(expected)
    ours_grads = torch.autograd.grad((ours * weights).sum(), (query, key, value))
    expected_grads = torch.autograd.grad((expected * weights).sum(), (query, key, value))
    for mine, theirs in zip(ours_grads, expected_grads):
        torch.testing.assert_close(mine, theirs)


def _varlen_of(version: str):
    """A stand-in for torch's varlen flash kernel (CUDA only) with the signature ``version`` had,
    computing what that kernel does: per-sequence attention, causal only when asked."""
    F = torch.nn.functional

    def attend(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, causal=False, gqa=False):
        if q.shape[1] != k.shape[1] and not gqa:
            raise RuntimeError(f"{version}: Hq={q.shape[1]} != Hkv={k.shape[1]} without enable_gqa")
        bounds = cu_q.tolist()
        return torch.cat([F.scaled_dot_product_attention(*(t[a:b].transpose(0, 1) for t in (q, k, v)), is_causal=causal,
                                                         scale=scale, enable_gqa=gqa).transpose(0, 1)
                          for a, b in zip(bounds, bounds[1:])])

    if version == "2.10":
        def varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, *, is_causal=False, return_aux=None, scale=None):
            return attend(q, k, v, cu_q, cu_k, max_q, max_k, scale=scale, causal=is_causal)
    elif version == "2.11":
        def varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, *, return_aux=None, scale=None, window_size=(-1, -1)):
            return attend(q, k, v, cu_q, cu_k, max_q, max_k, scale=scale, causal=tuple(window_size) == (-1, 0))
    else:
        def varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, *, return_aux=None, scale=None, window_size=(-1, -1),
                        enable_gqa=False, seqused_k=None):
            return attend(q, k, v, cu_q, cu_k, max_q, max_k, scale=scale, causal=tuple(window_size) == (-1, 0),
                          gqa=enable_gqa)
    return varlen_attn


@pytest.mark.parametrize("version", ["2.10", "2.11", "2.13"])
def test_packed_flash_call_fits_each_torch_signature(monkeypatch, version):
    """The varlen kernel's keywords changed between torch releases (causal: ``is_causal`` then
    ``window_size``; GQA: ``enable_gqa`` only from 2.12): the H200's torch 2.11 refused
    ``enable_gqa``. Each signature gets causal attention of each sequence, GQA included."""
    import torch.nn.attention.varlen as varlen_module

    from opentinker.engine.backend import packed_attention as packing

    monkeypatch.setattr(varlen_module, "varlen_attn", _varlen_of(version))
    packing._varlen_parameters.cache_clear()
    try:
        torch.manual_seed(0)
        lengths, total = [5, 1, 7, 3], 16
        q, k, v = torch.randn(total, 4, 8), torch.randn(total, 2, 8), torch.randn(total, 2, 8)
        cu = torch.tensor([0, 5, 6, 13, 16], dtype=torch.int32)
        ours = packing.causal_varlen(q, k, v, cu, 7, 0.3)
    finally:
        packing._varlen_parameters.cache_clear()
    document = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    mask = (document[:, None] == document[None, :]) & torch.ones(total, total, dtype=torch.bool).tril()
    expected = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=0.3, enable_gqa=True)
    torch.testing.assert_close(ours, expected.transpose(0, 1))


@pytest.mark.parametrize("lora", [[], ["actor_rollout_ref.model.lora_rank=4"]])
def test_packed_rows_give_the_padded_rows_loss_and_gradients(make_backend, grouped_batch, monkeypatch, lora):
    """use_remove_padding: the micro-batch's rows packed into one row, each sequence's attention
    its own (no mask over the row), give the padded rows' logprobs, loss and gradients."""
    from opentinker.engine.backend import packed_attention as packing

    seen = []
    plain = packing.packed_attention

    def spy(module, query, key, value, attention_mask, **kwargs):
        # No [T, T] mask over the packed row: at most the one-element placeholder (unused_mask).
        seen.append((kwargs.get("cu_seq_lens_q") is not None, attention_mask is None or attention_mask.numel() == 1))
        return plain(module, query, key, value, attention_mask, **kwargs)

    monkeypatch.setattr(packing, "packed_attention", spy)
    padded = make_backend(*PATHS["padded"], *lora)
    packed = make_backend(*PATHS["packed"], *lora)
    config = {"policy_loss": "vanilla", "clip_ratio": 0.2}
    grouped_batch.tensors["advantages"] = torch.linspace(-1, 1, len(grouped_batch)).unsqueeze(-1) * (
        grouped_batch.response_mask)
    grouped_batch.tensors["weights"] = grouped_batch.response_mask / grouped_batch.response_mask.sum()
    grouped_batch.tensors["old_logprobs"] = padded.forward(grouped_batch).logprobs - 0.05 * grouped_batch.response_mask
    outputs = [backend.forward_backward(grouped_batch, "rl_policy", config) for backend in (padded, packed)]
    # One packed forward: every layer's attention per sequence, no mask (the padded backend's is sdpa's).
    assert seen == [(True, True)] * packed.model.config.num_hidden_layers
    torch.testing.assert_close(outputs[1].elementwise_loss, outputs[0].elementwise_loss, atol=1e-5, rtol=1e-5)
    assert outputs[1].metrics["loss:sum"] == pytest.approx(outputs[0].metrics["loss:sum"], rel=1e-5)
    assert_close_grads(grads(padded.model), grads(packed.model))


def test_with_both_layouts_on_each_micro_batch_takes_the_one_that_computes_fewer_tokens():
    from opentinker.engine.backend.forward import ResponseScorer

    both = ResponseScorer(0, torch.device("cpu"), use_remove_padding=True, share_prompt_prefix=True)
    long_prompt = list(range(3, 103))
    # 8 samples of a 100-token prompt, short responses: the prompt once (100 + 8 x 4 < 8 x 105).
    short = TokenBatch.from_responses([long_prompt] * 8, [[7] * 5] * 8)
    # Ragged responses up to 300 tokens after a 10-token prompt: packed (10 + 8 x 299 > sum of rows).
    ragged = TokenBatch.from_responses([long_prompt[:10]] * 8, [[7] * n for n in (300, 5, 9, 12, 3, 40, 7, 2)])
    assert both.shares_prefix(short) and not both.shares_prefix(ragged)
    assert not ResponseScorer(0, torch.device("cpu"), share_prompt_prefix=False,
                              use_remove_padding=True).shares_prefix(short)
    assert ResponseScorer(0, torch.device("cpu")).shares_prefix(ragged)  # not packing: padded rows cost more


def test_packed_inputs_restart_positions_and_compute_no_padding(batch):
    packed = packed_inputs(batch)
    padded = padded_inputs(batch, pad_token_id=0)
    total_tokens = sum(len(p) + len(r) for p, r in zip(batch.prompt_ids, batch.response_ids))
    assert packed.input_ids.shape == (1, total_tokens)
    assert padded.input_ids.numel() > total_tokens
    assert (packed.position_ids == 0).sum() == len(batch)


def test_backend_without_reference_says_so(make_backend, batch):
    with pytest.raises(RuntimeError, match="no reference model"):
        make_backend().forward(batch, reference=True)


# -- forward_backward: sum-reduced losses ---------------------------------------------


def _tinker_inputs(batch: TokenBatch, logprobs: torch.Tensor) -> TokenBatch:
    generator = torch.Generator().manual_seed(3)
    batch.tensors["advantages"] = torch.randn(batch.response_mask.shape, generator=generator) * batch.response_mask
    batch.tensors["old_logprobs"] = (logprobs + 0.3 * torch.randn(logprobs.shape, generator=generator)) * batch.response_mask
    batch.tensors["weights"] = batch.response_mask * torch.rand(batch.response_mask.shape, generator=generator)
    # GSPO's sequence ratio over all but each row's first position (as if that were a prompt's).
    batch.tensors["sequence_ratio_mask"] = batch.response_mask.clone()
    batch.tensors["sequence_ratio_mask"][:, 0] = 0
    return batch


@pytest.mark.parametrize("loss_fn", ["cross_entropy", "importance_sampling", "ppo", "cispo", "dro", "gspo",
                                     "stable_reinforce"])
def test_tinker_losses_are_weighted_sums_over_tokens(make_backend, batch, loss_fn):
    backend = make_backend()
    logprobs = backend.forward(batch).logprobs
    _tinker_inputs(batch, logprobs)
    w, adv, old = batch.tensors["weights"], batch.tensors["advantages"], batch.tensors["old_logprobs"]
    ratio = torch.exp(logprobs - old)
    marked = batch.tensors["sequence_ratio_mask"]
    sequence_ratio = torch.exp(((logprobs - old) * marked).sum(-1, keepdim=True) / marked.sum(-1, keepdim=True).clamp(min=1))
    expected_elementwise = {
        "cross_entropy": -logprobs,
        "importance_sampling": -ratio * adv,
        "ppo": -torch.minimum(ratio * adv, ratio.clamp(0.8, 1.2) * adv),
        "cispo": -ratio.clamp(0.8, 1.2) * logprobs * adv,
        "dro": -(logprobs * adv - 0.025 * (logprobs - old) ** 2),
        "gspo": -torch.minimum(sequence_ratio * adv, sequence_ratio.clamp(0.8, 1.2) * adv),
        "stable_reinforce": -ratio.clamp(max=2.0) * logprobs * adv,
    }[loss_fn]
    out = backend.forward_backward(batch, loss_fn)
    assert torch.allclose(out.logprobs, logprobs, atol=1e-5)
    assert torch.allclose(out.elementwise_loss * batch.response_mask, expected_elementwise * batch.response_mask,
                          atol=1e-5)
    assert out.metrics["loss:sum"] == pytest.approx(float((expected_elementwise * w).sum()), abs=1e-4)


def test_cispo_gradient_treats_the_clipped_ratio_as_a_constant(make_backend, batch):
    """d/d(logp) of -sg(clip(r)) * logp * A is -clip(r) * A: compare with the cross-entropy
    gradient weighted by clip(r) * A, which is the same function of the model's weights."""
    cispo, reference = make_backend(), make_backend()
    logprobs = cispo.forward(batch).logprobs
    _tinker_inputs(batch, logprobs)
    cispo.forward_backward(batch, "cispo")
    ratio = torch.exp(logprobs - batch.tensors["old_logprobs"])
    weighted = batch.select(range(len(batch)))
    weighted.tensors = {"weights": batch.tensors["weights"] * ratio.clamp(0.8, 1.2) * batch.tensors["advantages"]}
    reference.forward_backward(weighted, "cross_entropy")
    assert_close_grads(grads(cispo.model), grads(reference.model))


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_rollout_is_weights_scale_each_tokens_policy_term_not_the_kl(make_backend, batch, level):
    """rl_policy with rollout_is: each token's policy loss times min(exp(old - rollout), 1.5),
    old being the old_logprobs or, without them, the pass's own logprobs; the KL term to the
    reference is not weighted."""
    backend = make_backend()
    logprobs = backend.forward(batch).logprobs
    _tinker_inputs(batch, logprobs)
    mask = batch.response_mask
    generator = torch.Generator().manual_seed(5)
    batch.tensors["rollout_logprobs"] = (logprobs + 0.3 * torch.randn(logprobs.shape, generator=generator)) * mask
    batch.tensors["ref_logprobs"] = batch.tensors["old_logprobs"] - 0.1
    config = {"use_kl_loss": True, "kl_loss_coef": 0.1, "kl_loss_type": "k1"}
    kl = 0.1 * (logprobs - batch.tensors["ref_logprobs"])
    for old in (batch.tensors["old_logprobs"], None):
        if old is None:
            del batch.tensors["old_logprobs"]
            old = logprobs
        plain = backend.forward_backward(batch, "rl_policy", config)
        weighted = backend.forward_backward(batch, "rl_policy", {**config, "rollout_is": level,
                                                                 "rollout_is_threshold": 1.5})
        log_ratio = (old - batch.tensors["rollout_logprobs"]) * mask
        ratio = log_ratio.exp() if level == "token" else log_ratio.sum(-1, keepdim=True).exp().expand_as(mask)
        expected = (plain.elementwise_loss - kl) * ratio.clamp(max=1.5) + kl
        assert torch.allclose(weighted.elementwise_loss * mask, expected * mask, atol=1e-5)
        assert not torch.allclose(weighted.elementwise_loss * mask, plain.elementwise_loss * mask, atol=1e-3)


def test_gradients_accumulate_across_calls_until_the_step(make_backend, batch):
    whole, pieces = make_backend(), make_backend()
    whole.forward_backward(batch, "cross_entropy")
    for part in batch.split(2):
        pieces.forward_backward(part, "cross_entropy")
    assert_close_grads(grads(whole.model), grads(pieces.model))
    whole.optim_step(AdamParams(lr=1e-3))
    assert grads(whole.model) == {}  # cleared by the step


def test_gspos_sequence_ratio_is_per_row_so_split_requests_give_the_same_gradients(make_backend, batch):
    whole, pieces = make_backend(), make_backend()
    _tinker_inputs(batch, whole.forward(batch).logprobs)
    whole.forward_backward(batch, "gspo")
    for part in batch.split(2):
        pieces.forward_backward(part, "gspo")
    assert_close_grads(grads(whole.model), grads(pieces.model))


def test_loss_errors_name_what_is_supported(make_backend, batch):
    backend = make_backend()
    with pytest.raises(ValueError, match="unknown loss function 'dpo'; supported: cispo, cross_entropy, dro"):
        backend.forward_backward(batch, "dpo")
    with pytest.raises(ValueError, match="loss 'ppo': unknown option"):
        backend.forward_backward(batch, "ppo", {"clip_ratio": 0.3})
    with pytest.raises(ValueError, match="loss 'importance_sampling' needs the per-token input 'old_logprobs'"):
        backend.forward_backward(batch, "importance_sampling")


# -- optim_step ---------------------------------------------------------------------


def test_optim_step_clips_then_takes_one_adamw_step(make_backend, batch, tiny_model_dir):
    backend = make_backend()
    backend.forward_backward(batch, "cross_entropy")
    raw = grads(backend.model)
    norm = math.sqrt(sum(float(g.pow(2).sum()) for g in raw.values()))
    # The same step by hand: gradients scaled to the clip norm, then torch's AdamW.
    twin = load_causal_lm(str(tiny_model_dir))
    for name, p in twin.named_parameters():
        p.grad = raw[name] * (1e-3 / (norm + 1e-6))
    torch.optim.AdamW(twin.parameters(), lr=1e-2, weight_decay=0.1).step()
    metrics = backend.optim_step(AdamParams(lr=1e-2, weight_decay=0.1, grad_clip=1e-3))
    assert metrics["grad_norm"] == pytest.approx(norm, rel=1e-5) and metrics["skipped_nonfinite"] == 0
    for (name, a), b in zip(backend.model.named_parameters(), twin.parameters()):
        assert torch.allclose(a, b, atol=1e-7), name
    assert backend.step == 1


def test_a_nonfinite_gradient_skips_the_step(make_backend, batch):
    backend = make_backend()
    before = {k: v.clone() for bucket in backend.weights() for k, v in bucket}
    backend.forward_backward(batch, "cross_entropy")
    next(backend.model.parameters()).grad[0, 0] = float("nan")
    metrics = backend.optim_step(AdamParams(lr=1e-2))
    assert metrics["skipped_nonfinite"] == 1 and backend.step == 0
    assert all(torch.equal(before[k], v) for bucket in backend.weights() for k, v in bucket)


def test_gradient_checkpointing_gives_the_same_gradients(make_backend, batch):
    plain = make_backend()
    checkpointed = make_backend("actor_rollout_ref.model.enable_gradient_checkpointing=true")
    for backend in (plain, checkpointed):
        backend.forward_backward(batch, "cross_entropy")
    assert_close_grads(grads(plain.model), grads(checkpointed.model))


# -- weights and state ---------------------------------------------------------------


def test_weights_stream_in_size_bounded_buckets(make_backend):
    backend = make_backend()
    state = backend.model.state_dict()
    buckets = list(backend.weights(bucket_bytes=1 << 16))
    assert [name for bucket in buckets for name, _ in bucket] == list(state)
    for bucket in buckets:
        if len(bucket) > 1:
            assert sum(t.numel() * t.element_size() for _, t in bucket) <= 1 << 16
    assert all(torch.equal(t, state[name]) for bucket in buckets for name, t in bucket)


def test_state_round_trips_weights_optimizer_rng_and_step(make_backend, batch, tmp_path):
    trained = make_backend()
    trained.forward_backward(batch, "cross_entropy")
    trained.optim_step(AdamParams(lr=1e-2))
    torch.manual_seed(123)
    trained.save_state(tmp_path / "state")
    expected_rng = torch.rand(3)
    restored = make_backend()
    restored.load_state(tmp_path / "state")
    assert torch.equal(torch.rand(3), expected_rng) and restored.step == 1
    for backend in (trained, restored):  # the next step is the same step
        backend.forward_backward(batch, "cross_entropy")
        backend.optim_step(AdamParams(lr=1e-2))
    for (name, a), b in zip(trained.model.state_dict().items(), restored.model.state_dict().values()):
        assert torch.equal(a, b), name


def test_export_round_trips_as_a_hugging_face_folder(make_backend, tiny_tokenizer, tmp_path):
    backend = make_backend()
    path = backend.export_hf(tmp_path / "actor", tiny_tokenizer)
    reloaded = load_causal_lm(str(path))
    for (name, a), b in zip(backend.model.state_dict().items(), reloaded.state_dict().values()):
        assert torch.equal(a, b), name
    assert (path / "tokenizer_config.json").exists()


def test_missing_model_path_is_a_clear_error(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        resolve_model_path(str(tmp_path / "no-such-model"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="no config.json"):
        resolve_model_path(str(tmp_path / "empty"))


def test_local_backend_is_the_configured_default(make_backend):
    assert isinstance(make_backend(), LocalBackend)


def test_a_backend_spec_refuses_what_no_backend_can_build(tiny_model_dir):
    from opentinker.config import make_config
    from opentinker.engine.backend import BackendSpec

    for fields, field in (({"strategy": "ddp"}, "strategy"), ({"ranks": 2}, "ranks"),
                          ({"strategy": "fsdp", "ranks": 0}, "ranks"), ({"device": "tpu"}, "device")):
        with pytest.raises(ValueError, match=f"^{field}: "):
            BackendSpec(str(tiny_model_dir), 0, **fields)
    # A PPO config's spec: 2 nodes x 2 ranks, LoRA seeded by the trainer's seed, the KL reference on.
    cfg = make_config(["actor_rollout_ref.actor.strategy=fsdp", "trainer.nnodes=2", "trainer.n_gpus_per_node=2",
                       "actor_rollout_ref.model.lora_rank=4", "trainer.seed=7", "actor_rollout_ref.actor.use_kl_loss=true"])
    spec = BackendSpec.from_config(cfg, str(tiny_model_dir), 0)
    assert (spec.strategy, spec.ranks, spec.lora.rank, spec.lora.seed, spec.with_reference) == ("fsdp", 4, 4, 7, True)


def test_a_multi_adapter_spec_names_its_shared_base_and_is_not_a_backend_of_its_own():
    from opentinker.engine.backend import BackendSpec, LoraSettings, make_backend
    from opentinker.engine.tinker.calls import model_backend_spec

    a = model_backend_spec(None, lora_rank=4, seed=1, device="cpu")
    b = model_backend_spec(None, lora_rank=8, seed=2, train_mlp=False, device="cpu")
    assert a.multi_adapter and a.lora != b.lora
    assert a.shared_base() == b.shared_base() and a.shared_base().lora is None  # one worker holds both
    assert model_backend_spec(None, lora_rank=4, device="cuda").shared_base() != a.shared_base()
    with pytest.raises(ValueError, match="^multi_adapter: the model trains in its base's shared AdapterWorker"):
        make_backend(a)
    with pytest.raises(ValueError, match="^multi_adapter: a shared base trains policy adapters only"):
        BackendSpec(None, lora=LoraSettings(4), multi_adapter=True, value_head=True)
    with pytest.raises(ValueError, match="^shared_base: only a multi_adapter spec"):
        BackendSpec(None).shared_base()
    with pytest.raises(ValueError, match="^lora rank: 0"):
        LoraSettings(0)
    with pytest.raises(ValueError, match="^lora_config: train_attn, train_mlp and train_unembed are all false"):
        model_backend_spec(None, lora_rank=4, train_attn=False, train_mlp=False, train_unembed=False)


def test_forward_loss_gives_forward_backwards_outputs_and_leaves_the_gradients(make_backend, batch):
    backend = make_backend()
    _tinker_inputs(batch, backend.forward(batch).logprobs)
    only = backend.forward_loss(batch, "ppo", {"clip_low_threshold": 0.9})
    assert all(p.grad is None for p in backend.model.parameters())
    full = backend.forward_backward(batch, "ppo", {"clip_low_threshold": 0.9})
    assert torch.allclose(only.logprobs, full.logprobs, atol=1e-6)
    assert torch.allclose(only.elementwise_loss, full.elementwise_loss, atol=1e-6)
    assert only.metrics == pytest.approx(full.metrics, rel=1e-5)
    with pytest.raises(ValueError, match="unknown loss function 'nope'"):
        backend.forward_loss(batch, "nope")
