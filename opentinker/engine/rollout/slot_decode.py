"""Decode on per-row KV slots with every step's work on the device: CUDA graphs on a GPU.

:class:`.decode_batch.DecodeBatch` decodes with shapes that change every step (the cache grows
by a column, finished rows are dropped by copying the cache) and one host round trip per token
(which rows finished). Neither can be captured in a CUDA graph, and on a GPU a small model's
decode step is mostly kernel launches and waits. Here, as in vLLM and nano-vllm:

* **Slots.** Each row owns one slot of a preallocated ``[slots, columns, kv_heads, head_dim]``
  key and value buffer per layer, filled from column 0 (no left padding). A step writes each
  row's new key and value at the row's own length; a finished row's slot is handed to a
  waiting row (continuous batching) with no copy of anyone's cache.
* **One step, no host.** A step samples every row's token from the logits of the last, records
  it, decides which rows end (stop ids, ``max_tokens``) and runs the forward pass: all on the
  device, with fixed shapes for a given number of rows. Uniform numbers come from a counter
  hash of the row's seed and token index (:func:`.sampling.counter_uniform`), so no generator
  state lives on the host. The host looks every :attr:`SlotDecoder.sync_every` steps (every step
  while a row has stop strings, which are matched on the text) to collect finished rows and
  admit new ones.
* **Graphs per row bucket.** A step runs over slots ``[0, bucket)``, bucket the smallest of
  1, 2, 4, 8, 16, 32, 48, ... that holds the highest busy slot; on CUDA each bucket's step is
  captured once as a CUDA graph and replayed. Attention reads each slot's own length only,
  through flash-attention's varlen kernel with ``seqused_k``
  (``torch.nn.attention.varlen``); elsewhere sdpa with a mask of the slot lengths.

Numbers: the same as the eager step up to float rounding (``tests/engine/test_rollout.py`` runs
the engine's tests on both). What differs is where a row without a seed gets its randomness: a
seed drawn from the engine's generator when the row is admitted.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from opentinker.engine.backend.packed_attention import unused_mask
from opentinker.engine.rollout.base import Completion, SamplingParams
from opentinker.engine.rollout.compiled_decode import can_compile
from opentinker.engine.rollout.decode_batch import check_requests, decode_positions, prefill_distinct
from opentinker.engine.rollout.sampling import choose_tokens, counter_uniform, stop_id_sets
from opentinker.engine.vision import VisionLayout

log = logging.getLogger(__name__)

#: The attention implementation of a slot-decoding model: slot attention in a slot step,
#: transformers' sdpa in every other call (the prefill).
SLOT_ATTENTION = "opentinker_slots"
#: Columns of the KV buffers come in multiples of this (a later call that fits reuses the pool and its graphs).
COLUMN_QUANTUM = 256
#: ``on_tokens(tags, tokens)``: each decode step's new token of every row still generating.
TokenCallback = Callable[[list[Hashable], list[int]], None]


def row_buckets(most: int) -> list[int]:
    """The numbers of rows a step is run (and captured) for: 1, 2, 4, 8, then every 16."""
    small = [b for b in (1, 2, 4, 8) if b < most]
    return small + list(range(16, most, 16)) + [most]


@dataclass
class SlotView:
    """What a slot step hands each layer (as the ``slot_view`` keyword, which transformers
    passes through to attention): the rows' lengths before this step's token (the column it
    is written to), and how the keys are read."""

    lengths: torch.Tensor  # [rows] int64, a view of the pool's
    used: torch.Tensor  # [rows] int32: lengths + 1, the keys each row attends to
    cu_q: torch.Tensor  # [rows + 1] int32: 0, 1, ..., rows
    cu_k: torch.Tensor  # [rows + 1] int32: 0, columns, 2 columns, ...
    columns: int  # keys read per row (all of them for varlen: it stops at ``used``)
    varlen: bool


def slot_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   attention_mask: Any, dropout: float = 0.0, scaling: float | None = None,
                   slot_view: SlotView | None = None, **kwargs: Any):
    """In a slot step, ``key``/``value`` are a layer's ``[rows, columns, kv_heads, D]`` buffers
    and ``query`` is ``[rows, heads, 1, D]``; returns ``[rows, 1, heads, D]``. Any other call
    (the prefill) is sdpa."""
    if slot_view is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    view, rows = slot_view, query.shape[0]
    gqa = query.shape[1] != key.shape[2]
    if view.varlen:
        from torch.nn.attention.varlen import varlen_attn

        columns, heads, dim = key.shape[1:]
        out = varlen_attn(query[:, :, 0], key.reshape(rows * columns, heads, dim),
                          value.reshape(rows * columns, heads, dim), view.cu_q, view.cu_k, 1, columns,
                          scale=scaling, enable_gqa=gqa, seqused_k=view.used)
        return out.unsqueeze(1), None
    columns = view.columns
    mask = torch.arange(columns, device=query.device) <= view.lengths.unsqueeze(-1)
    out = F.scaled_dot_product_attention(query, key[:, :columns].transpose(1, 2), value[:, :columns].transpose(1, 2),
                                         attn_mask=mask[:, None, None, :], scale=scaling, enable_gqa=gqa)
    return out.transpose(1, 2), None


AttentionInterface.register(SLOT_ATTENTION, slot_attention)
AttentionMaskInterface.register(SLOT_ATTENTION, sdpa_mask)


def _varlen_works(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether this torch build's varlen flash kernel takes a KV cache with per-row lengths
    (``seqused_k``) on this device; else slot attention is sdpa over a mask."""
    from torch.nn.attention.varlen import varlen_attn

    try:
        query = torch.zeros(2, 4, 64, dtype=dtype, device=device)
        key = torch.zeros(16, 2, 64, dtype=dtype, device=device)
        cu = torch.tensor([0, 1, 2], dtype=torch.int32, device=device)
        varlen_attn(query, key, key, cu, cu * 8, 1, 8, enable_gqa=True,
                    seqused_k=torch.tensor([3, 5], dtype=torch.int32, device=device))
        return True
    except Exception as error:  # noqa: BLE001 - any failure means: not here
        log.warning("slot_decode: varlen flash attention with seqused_k is unavailable (%s); using sdpa", error)
        return False


class _SlotWriter:
    """The cache a model sees in a slot step: layer ``i`` writes row ``r``'s new key and value at
    column ``lengths[r]`` of slot ``r`` and attends over its slots' buffers."""

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor], rows: torch.Tensor,
                 lengths: torch.Tensor):
        self.keys, self.values, self.rows, self.lengths = keys, values, rows, lengths

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        keys, values, count = self.keys[layer_idx], self.values[layer_idx], len(self.rows)
        keys[self.rows, self.lengths] = key_states[:, :, 0]
        values[self.rows, self.lengths] = value_states[:, :, 0]
        return keys[:count], values[:count]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0  # positions come from position_ids


class SlotPool:
    """Every tensor a slot step reads or writes, preallocated (a captured graph holds their
    addresses): the KV buffers and, per slot, its sampling settings, state and output so far."""

    def __init__(self, config: Any, slots: int, columns: int, new_tokens: int, stop_width: int,
                 dtype: torch.dtype, device: torch.device):
        self.slots, self.columns, self.new_tokens, self.stop_width = slots, columns, new_tokens, stop_width
        vision = VisionLayout.of(config) is not None
        config = config.get_text_config()  # a vision-language model's: its language model's
        heads = config.num_key_value_heads
        dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        shape = (slots, columns, heads, dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_hidden_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_hidden_layers)]

        def zeros(*size: int, dtype: torch.dtype = torch.long) -> torch.Tensor:
            return torch.zeros(size, dtype=dtype, device=device)

        self.logits = zeros(slots, config.vocab_size, dtype=torch.float32)
        self.lengths, self.generated, self.seed, self.max_tokens = (zeros(slots) for _ in range(4))
        # A vision-language model's rotary offset past each slot's prompt (decode_batch.decode_positions).
        self.rope_delta = zeros(slots) if vision else None
        self.active, self.stopped, self.greedy = (zeros(slots, dtype=torch.bool) for _ in range(3))
        self.temperature = torch.ones(slots, device=device)
        self.top_k, self.top_p = zeros(slots), torch.ones(slots, device=device)
        self.stop_ids = torch.full((slots, stop_width), -1, dtype=torch.long, device=device)
        self.tokens = zeros(slots, new_tokens)
        self.logprobs = zeros(slots, new_tokens, dtype=torch.float32)
        self.row_index = torch.arange(slots, device=device)
        self.cu = torch.arange(slots + 1, dtype=torch.int32, device=device)

    def fits(self, slots: int, columns: int, new_tokens: int, stop_width: int) -> bool:
        return (slots <= self.slots and columns <= self.columns and new_tokens <= self.new_tokens
                and stop_width <= self.stop_width)


class SlotDecoder:
    """Generates for an engine (its ``model``, ``eos_token_ids``, ``pad_token_id``, ``tokenizer``
    and ``shared_generator``) on per-row slots; see the module docstring. ``graphs``: capture
    each bucket's step as a CUDA graph (on CUDA only; None: when the model is on CUDA)."""

    def __init__(self, engine: Any, max_rows: int = 256, sync_every: int = 8, graphs: bool | None = None):
        model = engine.model
        if not can_compile(model):
            raise ValueError("slot_decode: this model has layers other than full attention "
                             f"({sorted(set(model.config.get_text_config().layer_types))}); use the eager decode")
        model.set_attn_implementation(SLOT_ATTENTION)
        self.engine, self.model = engine, model
        parameter = next(model.parameters())
        self.device, self.dtype = parameter.device, parameter.dtype
        self.max_rows, self.sync_every = max_rows, sync_every
        self.graphs_enabled = self.device.type == "cuda" if graphs is None else graphs
        self.graph_error: str | None = None  # why capturing failed, if it did
        self.varlen = self.device.type == "cuda" and self.dtype in (torch.bfloat16, torch.float16) and _varlen_works(
            self.device, self.dtype)
        self.unused_mask = unused_mask(self.device)  # one tensor: a captured graph keeps reading it
        self.pool: SlotPool | None = None
        self._graphs: dict[tuple[int, bool], Any] = {}
        self._graph_pool = None
        self._filtered = False

    # -- the step (what a graph captures) ------------------------------------------------
    def _step(self, rows: int, filtered: bool, columns: int) -> None:
        pool = self.pool
        index = pool.row_index[:rows]
        generated, active = pool.generated[:rows], pool.active[:rows]
        uniform = counter_uniform(pool.seed[:rows], generated)
        chosen, logprobs = choose_tokens(pool.logits[:rows], pool.temperature[:rows], pool.greedy[:rows],
                                         pool.top_k[:rows], pool.top_p[:rows], uniform, filtered)
        column = generated.clamp(max=pool.new_tokens - 1)
        pool.tokens[index, column] = torch.where(active, chosen, pool.tokens[index, column])
        pool.logprobs[index, column] = torch.where(active, logprobs, pool.logprobs[index, column])
        generated += active
        hit_stop = (pool.stop_ids[:rows] == chosen.unsqueeze(-1)).any(-1)
        pool.stopped[:rows] |= active & hit_stop
        active &= ~(hit_stop | (generated >= pool.max_tokens[:rows]))
        lengths = pool.lengths[:rows]
        view = SlotView(lengths, (lengths + 1).to(torch.int32), pool.cu[:rows + 1], pool.cu[:rows + 1] * pool.columns,
                        columns, self.varlen)
        writer = _SlotWriter(pool.keys, pool.values, index, lengths)
        rope_delta = pool.rope_delta[:rows] if pool.rope_delta is not None else None
        out = self.model(input_ids=chosen.unsqueeze(-1), position_ids=decode_positions(lengths, rope_delta),
                         attention_mask=self.unused_mask, slot_view=view, past_key_values=writer, use_cache=True)
        pool.logits[:rows] = out.logits[:, -1, :]
        lengths += active

    def _run(self, rows: int, columns: int) -> None:
        graph = self._graphs.get((rows, self._filtered))
        if graph is not None:
            graph.replay()
        else:
            self._step(rows, self._filtered, columns)

    def _capture(self, filtered: bool) -> None:
        """One graph per row bucket, largest first (the smaller ones reuse its memory). Runs on an
        idle pool: the warm-up step then changes no row's output (nothing is active)."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for rows in reversed(row_buckets(self.pool.slots)):
                self._step(rows, filtered, self.pool.columns)  # warm-up: lazy inits outside the graph
        torch.cuda.current_stream().wait_stream(stream)
        if self._graph_pool is None:
            self._graph_pool = torch.cuda.graph_pool_handle()
        for rows in reversed(row_buckets(self.pool.slots)):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._graph_pool, capture_error_mode="thread_local"):
                self._step(rows, filtered, self.pool.columns)
            self._graphs[(rows, filtered)] = graph
        torch.cuda.synchronize()

    # -- a call ------------------------------------------------------------------------
    def _prepare(self, prompts: Sequence[Sequence[int]], params: Sequence[SamplingParams]) -> list[tuple[int, ...]]:
        stop_sets = stop_id_sets(params, self.engine.eos_token_ids)
        wanted = min(len(prompts), self.max_rows)
        slots = next(b for b in row_buckets(self.max_rows) if b >= wanted)
        need = max(len(p) + q.max_tokens for p, q in zip(prompts, params))
        columns = -(-need // COLUMN_QUANTUM) * COLUMN_QUANTUM
        new_tokens = max(p.max_tokens for p in params)
        stop_width = max(1, max(map(len, stop_sets)))
        if self.pool is None or not self.pool.fits(slots, columns, new_tokens, stop_width):
            old = self.pool
            if old is not None:  # grow every dimension to at least what it was: calls alternate
                slots, columns = max(slots, old.slots), max(columns, old.columns)
                new_tokens, stop_width = max(new_tokens, old.new_tokens), max(stop_width, old.stop_width)
            self.pool, self._graphs = None, {}  # the old buffers and graphs go before the new ones come
            self.pool = SlotPool(self.model.config, slots, columns, new_tokens, stop_width, self.dtype, self.device)
        self.pool.active.zero_()  # a call that failed half-way may have left rows running
        self._filtered = any(p.top_k > 0 or p.top_p < 1 for p in params)
        if self.graphs_enabled and (self.pool.slots, self._filtered) not in self._graphs:
            try:
                self._capture(self._filtered)
            except Exception as error:  # the same steps, launched one kernel at a time
                self.graphs_enabled, self.graph_error = False, f"{type(error).__name__}: {error}"
                self._graphs = {}
                log.warning("slot_decode: CUDA graph capture failed (%s); decoding without graphs", self.graph_error)
        return stop_sets

    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]], params: Sequence[SamplingParams],
                 on_tokens: TokenCallback | None = None) -> list[Completion]:
        check_requests(self.engine, prompts, params)
        if not prompts:
            return []
        stop_sets = self._prepare(prompts, params)
        unseeded = [row for row, p in enumerate(params) if p.seed is None]
        drawn = torch.randint(0, 2 ** 62, (len(unseeded),), generator=self.engine.shared_generator).tolist()
        seeds = [p.seed & (2 ** 63 - 1) if p.seed is not None else 0 for p in params]
        for row, seed in zip(unseeded, drawn):
            seeds[row] = seed
        return _Call(self, prompts, params, stop_sets, seeds, on_tokens).run()


class _Call:
    """One :meth:`SlotDecoder.generate`: which row is in which slot, and the host's view of them."""

    def __init__(self, decoder: SlotDecoder, prompts, params, stop_sets, seeds, on_tokens):
        self.decoder, self.pool = decoder, decoder.pool
        self.prompts, self.params, self.stop_sets, self.seeds = prompts, params, stop_sets, seeds
        self.on_tokens = on_tokens
        self.pending = deque(range(len(prompts)))
        self.row_of: dict[int, int] = {}  # busy slot -> row of this call
        self.generated: dict[int, int] = {}  # busy slot -> tokens the host has seen
        self.bound: dict[int, int] = {}  # busy slot -> most columns it may fill by now
        self.results: list[Completion | None] = [None] * len(prompts)

    def run(self) -> list[Completion]:
        while self.pending or self.row_of:
            self._admit()
            rows = next(b for b in row_buckets(self.pool.slots) if b > max(self.row_of))
            watch_text = any(self.params[row].stop for row in self.row_of.values())
            for _ in range(1 if watch_text else self.decoder.sync_every):
                # Keys a step reads without a graph: up to the longest row's new column.
                self.decoder._run(rows, min(self.pool.columns, max(self.bound.values()) + 1))
                for slot in self.bound:
                    self.bound[slot] += 1
            self._collect(rows)
        return self.results  # type: ignore[return-value]

    def _admit(self) -> None:
        free = [slot for slot in range(self.pool.slots) if slot not in self.row_of]
        rows = [self.pending.popleft() for _ in range(min(len(free), len(self.pending)))]
        if not rows:
            return
        slots = free[:len(rows)]
        rope_deltas = self._prefill(rows, slots)
        pool, device = self.pool, self.decoder.device

        def put(target: torch.Tensor, values: list) -> None:
            target[torch.tensor(slots, device=device)] = torch.tensor(values, dtype=target.dtype, device=device)

        params = [self.params[row] for row in rows]
        put(pool.lengths, [len(self.prompts[row]) for row in rows])
        if pool.rope_delta is not None:
            put(pool.rope_delta, rope_deltas)
        put(pool.generated, [0] * len(rows))
        put(pool.seed, [self.seeds[row] for row in rows])
        put(pool.max_tokens, [p.max_tokens for p in params])
        put(pool.greedy, [p.temperature == 0 for p in params])
        put(pool.temperature, [p.temperature or 1.0 for p in params])
        put(pool.top_k, [p.top_k for p in params])
        put(pool.top_p, [p.top_p for p in params])
        put(pool.stop_ids, [list(self.stop_sets[row]) + [-1] * (pool.stop_width - len(self.stop_sets[row]))
                            for row in rows])
        put(pool.stopped, [False] * len(rows))
        put(pool.active, [True] * len(rows))
        for row, slot in zip(rows, slots):
            self.row_of[slot], self.generated[slot] = row, 0
            self.bound[slot] = len(self.prompts[row])

    def _prefill(self, rows: list[int], slots: list[int]) -> list[int]:
        """Runs each distinct prompt once and copies its keys and values to the slots of the
        rows that share it, from column 0, and its next-token logits; returns each row's rotary
        offset (a vision-language model's; [] for a text model)."""
        pool, device = self.pool, self.decoder.device
        prefilled = prefill_distinct(self.decoder.engine, [self.prompts[row] for row in rows], 0)
        width = prefilled.prompt_mask.shape[1]
        group = prefilled.group_of_row.to(device)
        target = torch.tensor(slots, device=device)
        pool.logits[target] = prefilled.logits.float()[group]
        # Row r's prompt is in its group's last len(r) columns: shift it to column 0.
        shift = torch.tensor([width - len(self.prompts[row]) for row in rows], device=device)
        source = (torch.arange(width, device=device) + shift.unsqueeze(-1)).clamp(max=width - 1)
        for layer, keys, values in zip(prefilled.cache.layers, pool.keys, pool.values):
            for cached, buffer in ((layer.keys, keys), (layer.values, values)):
                per_row = cached[group].transpose(1, 2)  # [rows, width, kv_heads, D]
                index = source[:, :, None, None].expand_as(per_row)
                buffer[target, :width] = per_row.gather(1, index)
        return prefilled.rope_delta.tolist() if prefilled.rope_delta is not None else []

    def _collect(self, rows: int) -> None:
        """Reads which rows ended (one host round trip), passes on their tokens and frees their slots."""
        pool = self.pool
        state = torch.stack([pool.active[:rows].long(), pool.generated[:rows], pool.stopped[:rows].long()]).tolist()
        active, generated, stopped = state
        busy = sorted(self.row_of)
        if self.on_tokens is not None:
            self._report(busy, generated)
        for slot in busy:
            self.generated[slot] = generated[slot]
            if active[slot] and self.params[self.row_of[slot]].stop and self._spelled_a_stop(slot):
                pool.active[slot], pool.stopped[slot] = False, True
                active[slot], stopped[slot] = 0, 1
        done = [slot for slot in busy if not active[slot]]
        if not done:
            return
        index = torch.tensor(done, device=self.decoder.device)
        tokens, logprobs = pool.tokens[index].tolist(), pool.logprobs[index].tolist()
        for i, slot in enumerate(done):
            count = generated[slot]
            self.results[self.row_of.pop(slot)] = Completion(tokens[i][:count], logprobs[i][:count],
                                                             "stop" if stopped[slot] else "length")
            del self.generated[slot], self.bound[slot]

    def _report(self, busy: list[int], generated: list[int]) -> None:
        """``on_tokens`` once per step since the last look, as the eager loop calls it."""
        first = min(self.generated[slot] for slot in busy)
        last = max(generated[slot] for slot in busy)
        if last <= first:
            return
        index = torch.tensor(busy, device=self.decoder.device)
        tokens = self.pool.tokens[index, first:last].tolist()
        for step in range(max(generated[s] - self.generated[s] for s in busy)):
            tags, chosen = [], []
            for i, slot in enumerate(busy):
                column = self.generated[slot] + step
                if column < generated[slot]:
                    tags.append(self.row_of[slot])
                    chosen.append(tokens[i][column - first])
            self.on_tokens(tags, chosen)

    def _spelled_a_stop(self, slot: int) -> bool:
        row = self.row_of[slot]
        tokens = self.pool.tokens[slot, :self.generated[slot]].tolist()
        text = self.decoder.engine.tokenizer.decode(tokens, skip_special_tokens=True)
        return any(stop in text for stop in self.params[row].stop)
