"""The decode step of :class:`.decode_batch.DecodeBatch` compiled with ``torch.compile``.

The model code is transformers' own (no second copy to keep true); what changes is how a step
reaches the KV cache. The eager step hands the model a ``DynamicCache`` whose layers keep their
length in Python ints, which a compiled graph would bake in (a recompile per token). Here the
compiled function gets the in-place cache's preallocated buffers and writes each layer's new
key and value at the column given by the attention mask's width; widths and batch sizes are
marked dynamic, so one graph serves them all and a process compiles once: 20-34 s on 2 CPU
cores with a cold cache, 8-22 s in a later process (inductor caches its kernels on disk, but
dynamo traces transformers' model code anew). The cache's lengths move on after the call, outside the graph.
No CUDA graphs (``mode="reduce-overhead"``): they replay fixed shapes, and these change every
step; on a GPU this step is measured by ``make gpu-check``.

Attention in the compiled step is the plain ``softmax(q k^T) v`` (transformers' "eager"
attention), which inductor fuses; the prefill keeps the model's own attention (sdpa). The query
goes into it through an opaque copy (:func:`materialize`): inductor turns a one-row ``q k^T``
into a fused multiply-sum and would otherwise recompute the query's rotary embedding (a cos and
a sin per element) once per key column; as a buffer it is computed once
(``benchmarks/compiled_decode.py`` on 2 CPU cores: x1.44 over the eager step before, x1.88 after).
Numbers: the same as the eager step up to float rounding (see ``tests/engine/test_rollout.py``).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.models.llama.modeling_llama import eager_attention_forward

from opentinker.engine.rollout.kv_cache import InPlaceLayer

#: The attention the compiled model uses: matmul attention in a compiled step (inductor fuses it
#: with the softmax and the grouped heads' expansion), transformers' sdpa everywhere else.
DECODE_ATTENTION = "opentinker_decode"


# ``materialize(x)``: a copy of ``x`` that inductor cannot fuse into its consumers (an op it
# does not know), so what made ``x`` runs once, not once per read. Defined with the plain
# library API: a call costs ~8 us, a third of what ``torch.library.custom_op``'s wrapper costs.
_OPS = torch.library.Library("opentinker", "DEF")
_OPS.define("materialize(Tensor x) -> Tensor")
_OPS.impl("materialize", torch.clone, "CompositeExplicitAutograd")
_OPS.impl("materialize", torch.empty_like, "Meta")
materialize = torch.ops.opentinker.materialize.default


def _decode_attention(module, query, key, value, attention_mask, **kwargs):
    # The compiled step's masks are additive floats; transformers' own (prefill, eager step) are sdpa's booleans.
    if query.shape[-2] == 1 and attention_mask is not None and attention_mask.is_floating_point():
        return eager_attention_forward(module, materialize(query), key, value, attention_mask, **kwargs)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


AttentionInterface.register(DECODE_ATTENTION, _decode_attention)
# The masks transformers builds (the prefill's) are sdpa's; a compiled step passes its own.
AttentionMaskInterface.register(DECODE_ATTENTION, sdpa_mask)


class _ColumnWriter:
    """The cache the model sees during one compiled step: layer ``i`` writes its new key and
    value into column ``width - 1`` of its buffers and attends to columns ``[0, width)``."""

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor], width: int):
        self.keys, self.values, self.width = keys, values, width

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        keys, values, width = self.keys[layer_idx], self.values[layer_idx], self.width
        keys[:, :, width - 1:width] = key_states
        values[:, :, width - 1:width] = value_states
        return keys[:, :, :width], values[:, :, :width]


def _step(model: Any, input_ids: torch.Tensor, position_ids: torch.Tensor, mask: torch.Tensor,
          keys: list[torch.Tensor], values: list[torch.Tensor]) -> torch.Tensor:
    cache = _ColumnWriter(keys, values, mask.shape[-1])
    # A 4-D mask goes to the layers as it is, whatever the model (see unused_mask).
    return model(input_ids=input_ids, position_ids=position_ids, attention_mask=mask,
                 past_key_values=cache, use_cache=True).logits[:, -1, :]


def can_compile(model: Any) -> bool:
    """Whether this model's decode can be compiled: every layer plain full attention (a sliding
    window's cache is not an :class:`InPlaceLayer`)."""
    layer_types = getattr(model.config.get_text_config(), "layer_types", None) or ["full_attention"]
    return all(kind == "full_attention" for kind in layer_types)


class CompiledDecode:
    """``decode(input_ids, mask, position, cache) -> logits``: one decode step of ``model``, for
    two rows or more (a graph would specialise a batch of one: a second compile for little gain,
    so :class:`.decode_batch.DecodeBatch` runs such a step eagerly).

    ``mask`` is the batch's ``[rows, columns]`` 0/1 mask (at least ``cache length + 1`` columns),
    ``position`` each row's position id, ``cache`` an in-place cache (:mod:`.kv_cache`) whose
    layers are all :class:`InPlaceLayer`. The model's attention is switched to
    :data:`DECODE_ATTENTION` (the same numbers for the prefill, which goes on using sdpa).
    """

    def __init__(self, model: Any):
        if not can_compile(model):
            raise ValueError("compile_decode: this model has layers other than full attention "
                             f"({sorted(set(model.config.get_text_config().layer_types))}); use the eager decode")
        model.set_attn_implementation(DECODE_ATTENTION)
        self.model = model
        self._step = torch.compile(_step, dynamic=None)

    def __call__(self, input_ids: torch.Tensor, mask: torch.Tensor, position: torch.Tensor, cache: Any) -> torch.Tensor:
        layers = cache.layers
        if not all(isinstance(layer, InPlaceLayer) and layer.is_initialized for layer in layers):
            raise TypeError("CompiledDecode needs a prefilled in-place cache (kv_cache.in_place_cache)")
        width = layers[0].length + 1
        for layer in layers:
            layer.reserve(width)
        # Additive mask (0 = attend): the form matmul attention adds to its scores.
        blocked = torch.finfo(layers[0].dtype).min
        additive = (1 - mask[:, None, None, :width].to(layers[0].dtype)) * blocked
        keys, values = [layer.buffers[0] for layer in layers], [layer.buffers[1] for layer in layers]
        # Rows and columns vary from step to step: say so up front, or the first graph is built
        # for the first shapes only and a second compile follows. Every other size (heads,
        # hidden, vocabulary) stays fixed in the graph: faster kernels than dynamic=True's.
        for buffer in (*keys, *values):
            torch._dynamo.maybe_mark_dynamic(buffer, 0)
            torch._dynamo.maybe_mark_dynamic(buffer, 2)
        for dim in (0, 3):
            torch._dynamo.maybe_mark_dynamic(additive, dim)
        torch._dynamo.maybe_mark_dynamic(input_ids, 0)
        torch._dynamo.maybe_mark_dynamic(position, 0)
        logits = self._step(self.model, input_ids, position, additive, keys, values)
        for layer in layers:
            layer.advance_to(width)
        return logits
