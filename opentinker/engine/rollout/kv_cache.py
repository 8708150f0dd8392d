"""A KV cache for the rollout decode loop that writes each new token in place.

``DynamicCache`` grows every layer's keys and values with ``torch.cat`` at each decode step,
which allocates and copies the whole cache once per token and layer. Here each full-attention
layer owns one buffer sized for the prompt plus every token to come, and hands the model views
of its filled part. Other layer kinds (sliding windows, ...) keep transformers' own layers.
"""

from __future__ import annotations

from functools import partial

import torch
from transformers import DynamicCache, PreTrainedConfig
from transformers.cache_utils import DynamicLayer


def _rows(buffer: torch.Tensor, index: torch.Tensor, length: int) -> torch.Tensor:
    """A new buffer holding ``buffer``'s rows ``index``; only the filled ``length`` positions are copied."""
    selected = buffer.new_empty((len(index), *buffer.shape[1:]))
    selected[:, :, :length] = buffer[:, :, :length].index_select(0, index.to(buffer.device))
    return selected


class InPlaceLayer(DynamicLayer):
    """One layer's keys and values in ``[batch, heads, capacity, head_dim]`` buffers; a step
    past ``capacity`` still works (the buffers are re-allocated, doubled)."""

    def __init__(self, capacity: int):
        super().__init__()
        self.capacity = capacity
        self.length = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        batch, heads, _, _ = key_states.shape
        self._keys = key_states.new_empty((batch, heads, self.capacity, key_states.shape[-1]))
        self._values = value_states.new_empty((batch, heads, self.capacity, value_states.shape[-1]))
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.length + key_states.shape[-2]
        self.reserve(end)
        self._keys[:, :, self.length:end] = key_states
        self._values[:, :, self.length:end] = value_states
        self.advance_to(end)
        return self.keys, self.values

    @property
    def buffers(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole ``[batch, heads, capacity, head_dim]`` key and value buffers."""
        return self._keys, self._values

    def reserve(self, length: int) -> None:
        """Buffers for at least ``length`` columns (re-allocated, at least doubled, when short)."""
        if length > self._keys.shape[-2]:
            self._grow(max(length, 2 * self._keys.shape[-2]))

    def advance_to(self, length: int) -> None:
        """The first ``length`` columns hold keys and values (written by :meth:`update` or
        straight into :attr:`buffers`, as the compiled decode step does)."""
        self.length = length
        self._refresh_views()

    def _grow(self, capacity: int) -> None:
        for name in ("_keys", "_values"):
            old = getattr(self, name)
            new = old.new_empty((*old.shape[:2], capacity, old.shape[-1]))
            new[:, :, :self.length] = old[:, :, :self.length]
            setattr(self, name, new)

    def _refresh_views(self) -> None:
        self.keys = self._keys[:, :, :self.length]
        self.values = self._values[:, :, :self.length]

    def get_seq_length(self) -> int:
        return self.length

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized:
            self._keys = _rows(self._keys, indices, self.length)
            self._values = _rows(self._values, indices, self.length)
            self._refresh_views()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.batch_select_indices(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            index = torch.arange(self._keys.shape[0], device=self._keys.device).repeat_interleave(repeats)
            self.batch_select_indices(index)

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError("crop takes a negative number of tokens to remove")
        self.length = max(0, self.length + tokens_to_remove)
        if self.is_initialized:
            self._refresh_views()

    def reset(self) -> None:
        self.length = 0
        super().reset()


def in_place_cache(config: PreTrainedConfig, capacity: int) -> DynamicCache:
    """A ``DynamicCache`` for ``config`` whose plain full-attention layers write in place,
    each sized for ``capacity`` tokens."""
    cache = DynamicCache(config=config)
    if cache.layer_class_to_replicate is DynamicLayer:  # no layer list in the config: made lazily
        cache.layer_class_to_replicate = partial(InPlaceLayer, capacity)
    cache.layers = [InPlaceLayer(capacity) if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache


def can_restack(cache: DynamicCache) -> bool:
    """Whether :func:`stack_rows` can move this cache's rows: every layer writes in place."""
    return bool(cache.layers) and all(isinstance(layer, InPlaceLayer) and layer.is_initialized
                                      for layer in cache.layers)


def stack_rows(config: PreTrainedConfig, parts: list[tuple[DynamicCache, int]], capacity: int) -> DynamicCache:
    """A new cache holding the rows of several caches, one part after another.

    A part is ``(cache, start)``: its rows from column ``start`` on (the columns before it are
    padding in every row). Each part's filled columns are right-aligned, so that every row's
    newest token is in the last column; the new length is the longest part's, and the columns
    to the left of a shorter part are zeros (the caller's attention mask must exclude them).
    Buffers hold ``capacity`` columns.
    """
    spans = [cache.layers[0].length - start for cache, start in parts]
    length = max(spans)
    if length > capacity:
        raise ValueError(f"stack_rows: capacity {capacity} is below the stacked length {length}")
    merged = in_place_cache(config, capacity)
    layer_count = len(parts[0][0].layers)
    if not merged.layers:  # the config lists no layers: they are made lazily, so make them here
        merged.layers = [InPlaceLayer(capacity) for _ in range(layer_count)]
    batch = sum(len(cache.layers[0]._keys) for cache, _ in parts)
    for index in range(layer_count):
        first = parts[0][0].layers[index]
        target = merged.layers[index]
        target.dtype, target.device, target.capacity = first.dtype, first.device, capacity
        for name in ("_keys", "_values"):
            like = getattr(first, name)
            # Zeros, not garbage: padding columns are masked, but 0 x NaN would still be NaN.
            buffer = like.new_zeros((batch, like.shape[1], capacity, like.shape[-1]))
            row = 0
            for (cache, start), span in zip(parts, spans):
                source = getattr(cache.layers[index], name)
                buffer[row:row + len(source), :, length - span:length] = source[:, :, start:start + span]
                row += len(source)
            setattr(target, name, buffer)
        target.length = length
        target.is_initialized = True
        target._refresh_views()
    return merged
