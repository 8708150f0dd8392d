"""Logprobs of the target tokens (and the entropy) from [..., V] logits, a few rows at a time.

``log_softmax(logits / T).gather(target)`` through autograd makes several [B, R, V] temporaries
(the scaled logits, the log-softmax, the gather's zero-filled gradient, the log-softmax's
gradient), each written and read through main memory. Here the forward keeps nothing but the
logits, the backward recomputes the softmax and writes the logits' gradient
``(onehot - softmax) * g / T`` straight into one buffer, and every other temporary is one chunk
of rows that stays in cache. The values are the plain log-softmax's (it is row-wise).
The entropy comes out as a statistic without a gradient (a loss that is differentiated
through the entropy takes the plain path, :func:`logprobs_and_entropy`).
"""

from __future__ import annotations

import torch

from opentinker.engine.algorithms import entropy_from_logits

CHUNK_ELEMENTS = 1 << 20  # logits per chunk on CPU (4 MiB in float32: stays in cache)
# On a GPU each chunk costs a few kernel launches: with a 152k vocab, 4 MiB chunks are 6 rows,
# and an update of 10k tokens spent more time launching than computing (benchmarks/README.md).
GPU_CHUNK_ELEMENTS = 1 << 26  # 256 MiB in float32: temporaries small beside the logits


def _chunks(rows: int, vocab: int, device: torch.device):
    step = max(1, (CHUNK_ELEMENTS if device.type == "cpu" else GPU_CHUNK_ELEMENTS) // vocab)
    return ((start, min(start + step, rows)) for start in range(0, rows, step))


class _TokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, temperature: float, with_entropy: bool):
        vocab = logits.shape[-1]
        flat, flat_targets = logits.reshape(-1, vocab), targets.reshape(-1, 1)
        rows = flat.shape[0]
        dtype = torch.promote_types(logits.dtype, torch.float32)  # bf16 logits are scored in float32
        logprobs = torch.empty(rows, dtype=dtype, device=logits.device)
        entropy = torch.empty_like(logprobs) if with_entropy else None
        for start, end in _chunks(rows, vocab, logits.device):
            chunk_logprobs = torch.log_softmax(_scaled(flat[start:end], dtype, temperature), dim=-1)
            logprobs[start:end] = chunk_logprobs.gather(-1, flat_targets[start:end]).squeeze(-1)
            if entropy is not None:  # -sum(p * log p): no cancellation of large terms
                entropy[start:end] = -chunk_logprobs.exp().mul_(chunk_logprobs).sum(-1)
        ctx.save_for_backward(logits, targets)
        ctx.temperature = temperature
        shape = targets.shape
        if entropy is None:
            return logprobs.view(shape), None
        entropy = entropy.view(shape)
        ctx.mark_non_differentiable(entropy)
        return logprobs.view(shape), entropy

    @staticmethod
    def backward(ctx, grad_logprobs: torch.Tensor, _grad_entropy):
        logits, targets = ctx.saved_tensors
        temperature = ctx.temperature
        vocab = logits.shape[-1]
        flat, flat_targets = logits.reshape(-1, vocab), targets.reshape(-1, 1)
        dtype = torch.promote_types(logits.dtype, torch.float32)
        grad_rows = grad_logprobs.reshape(-1, 1).to(dtype)
        if temperature != 1.0:
            grad_rows = grad_rows / temperature  # d(z / T) / dz
        grad = torch.empty(flat.shape, dtype=dtype, device=logits.device)
        for start, end in _chunks(flat.shape[0], vocab, logits.device):
            out, g = grad[start:end], grad_rows[start:end]
            # d logp_t / dz = onehot(t) - softmax(z), the softmax recomputed into the gradient's rows
            torch.log_softmax(_scaled(flat[start:end], dtype, temperature), dim=-1, out=out).exp_().mul_(-g)
            out.scatter_add_(-1, flat_targets[start:end], g)
        return grad.view(logits.shape).to(logits.dtype), None, None, None


def _scaled(logits: torch.Tensor, dtype: torch.dtype, temperature: float) -> torch.Tensor:
    logits = logits.to(dtype)
    return logits / temperature if temperature != 1.0 else logits  # x / 1.0 == x: skip the pass


def logprobs_and_entropy(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float, with_entropy: bool, entropy_grad: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``log_softmax(logits / temperature)`` at ``targets`` ([..., V] -> [...]), and the entropy
    of that distribution when ``with_entropy`` (differentiable only with ``entropy_grad``)."""
    if with_entropy and entropy_grad:
        scaled = logits.float() / temperature
        logprobs = torch.log_softmax(scaled, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        return logprobs, entropy_from_logits(scaled)
    return _TokenLogprobs.apply(logits, targets, float(temperature), with_entropy)
