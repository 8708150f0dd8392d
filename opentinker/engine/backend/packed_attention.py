"""Attention over packed rows (``use_remove_padding``) without a mask over the whole row.

Given one row of several sequences (position ids restarting at 0) and no mask, transformers
builds a block-diagonal mask over the whole row and runs sdpa through it: every sequence
attends over the row's full length, so attention costs (sum of lengths)^2 and the mask's memory
grows the same way, which is why packing did not pay. Registered with transformers as an
attention implementation (:data:`NAME`), :func:`packed_attention` runs each sequence's own
causal attention instead, from the sequence boundaries the caller passes (``cu_seq_lens_q``,
as flash-attention's varlen kernels take them): on a GPU one varlen flash kernel
(``torch.nn.attention.varlen``, bf16/fp16), elsewhere sdpa on each sequence. A call without
boundaries (padded rows, the shared-prefix layout's KV cache) is transformers' own sdpa.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch
import torch.nn.functional as F

NAME = "opentinker_packed"


def unused_mask(device: torch.device | str = "cpu") -> torch.Tensor:
    """An ``attention_mask`` for a call whose attention takes its layout from elsewhere (the
    sequences' boundaries, a decode slot's lengths): transformers hands a 4-D mask to the
    layers as it is, for every model (a per-layer-type mapping is not: Llama's forward
    builds its mask from anything else), so no [T, T] mask is built; the attention ignores it."""
    return torch.ones((1, 1, 1, 1), dtype=torch.bool, device=device)


def packed_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                     sliding_window: int | None = None, cu_seq_lens_q: torch.Tensor | None = None,
                     max_length_q: int | None = None, cu_seq_lens_k: torch.Tensor | None = None,
                     max_length_k: int | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """[1, H, T, D] queries of one packed row -> [1, T, H, D] (transformers' attention contract)."""
    if cu_seq_lens_q is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      sliding_window=sliding_window, **kwargs)
    if sliding_window is not None or dropout:
        raise ValueError("use_remove_padding: packed attention covers full causal attention without dropout "
                         f"(this model has sliding_window={sliding_window}, attention dropout={dropout})")
    gqa = query.shape[1] != key.shape[1]
    # Under autocast the rotary embedding hands over float32 queries; sdpa would cast them.
    dtype = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else query.dtype
    if query.is_cuda and dtype in (torch.bfloat16, torch.float16):
        q, k, v = (t[0].transpose(0, 1).to(dtype) for t in (query, key, value))  # [T, heads, D]
        return causal_varlen(q, k, v, cu_seq_lens_q, max_length_q, scaling).unsqueeze(0), None
    bounds = cu_seq_lens_q.tolist()
    pieces = [F.scaled_dot_product_attention(query[:, :, start:end], key[:, :, start:end], value[:, :, start:end],
                                             is_causal=True, scale=scaling, enable_gqa=gqa)
              for start, end in zip(bounds, bounds[1:])]
    return torch.cat(pieces, dim=2).transpose(1, 2).contiguous(), None


@functools.cache
def _varlen_parameters() -> frozenset[str]:
    from torch.nn.attention.varlen import varlen_attn

    return frozenset(inspect.signature(varlen_attn).parameters)


def causal_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seq_lens: torch.Tensor, longest: int,
                  scale: float | None) -> torch.Tensor:
    """Causal attention of each packed sequence, ``[T, heads, D]`` in and out, by torch's varlen
    flash kernel, whichever of its signatures this torch has: causal is ``window_size=(-1, 0)``
    since 2.11 and ``is_causal=True`` in 2.10; without ``enable_gqa`` (2.11, seen on the GPU
    node) grouped keys and values are repeated to the queries' heads."""
    from torch.nn.attention.varlen import varlen_attn

    takes = _varlen_parameters()
    extra: dict[str, Any] = {"window_size": (-1, 0)} if "window_size" in takes else {"is_causal": True}
    if q.shape[1] != k.shape[1]:
        if "enable_gqa" in takes:
            extra["enable_gqa"] = True
        else:
            group = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    return varlen_attn(q, k, v, cu_seq_lens, cu_seq_lens, longest, longest, scale=scale, **extra)


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, packed_attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)  # the calls without boundaries get sdpa's masks


def packed_call_kwargs(model: torch.nn.Module, position_ids: torch.Tensor,
                       device: torch.device) -> dict[str, Any] | None:
    """The extra arguments of a packed forward (``position_ids`` [1, T] on the host, each
    sequence from 0; the boundaries are read there, so a GPU stream is not waited for, and
    sent to ``device``) that make its attention per sequence; the model's sdpa attention becomes :data:`NAME`,
    which answers every other call as sdpa did. None for a model on another attention
    implementation (eager, flash), or with sliding-window layers or attention dropout: it
    takes the row as transformers packs it."""
    config = model.config
    if "sliding_attention" in (getattr(config, "layer_types", None) or ()) or getattr(
            config, "attention_dropout", 0.0):
        return None
    if config._attn_implementation == "sdpa":
        _register()
        config._attn_implementation = NAME
    if config._attn_implementation != NAME:
        return None
    flat = position_ids.reshape(-1)
    cu = torch.cat([torch.nonzero(flat == 0).reshape(-1), torch.tensor([flat.numel()])]).to(torch.int32)
    longest = int((cu[1:] - cu[:-1]).max())
    cu = cu.to(device)
    return {"attention_mask": unused_mask(device), "cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest,
            "max_length_k": longest}
