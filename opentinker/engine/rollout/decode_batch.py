"""Rows decoded together by one model, which can take new rows between decode steps.

A :class:`DecodeBatch` holds, for each row, its KV cache, the logits of its next token, the
tokens it generated so far and its sampling settings. :meth:`DecodeBatch.step` picks every
row's next token, hands back the rows that finished, and runs one forward pass for the rest.
Between steps a batch can take in another batch's rows (:meth:`absorb`: continuous batching,
the new rows' prompts prefilled on their own first), exactly: a row's numbers do not depend on
which rows it shares a batch with, beyond the float rounding of the padded attention.

Rows share the cache's columns: prompts are left-padded so that every row's newest token is in
the last column, and each step appends one column for every row. A row that joins later has
padding to the left of its prompt, masked out; :meth:`absorb` drops columns that are padding in
every row, so the width stays within the longest row's length plus the steps since the last join.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from opentinker.engine.rollout.base import Completion, SamplingParams
from opentinker.engine.rollout.kv_cache import can_restack, in_place_cache, stack_rows
from opentinker.engine.rollout.sampling import RowSettings, next_tokens
from opentinker.engine.vision import VisionLayout, images_of, prompt_key, sequence_positions, vision_kwargs

#: ``on_tokens(tags, tokens)``: each decode step's new token of every row still generating.
TokenCallback = Callable[[list[Hashable], list[int]], None]
#: ``on_forward(tags)``: called right before each forward pass with the tags of its rows (in
#: row order; in a prefill, every row's, before distinct prompts are grouped).
ForwardCallback = Callable[[list[Hashable]], None]


def check_requests(engine: Any, prompts: Sequence[Sequence[int]], params: Sequence[SamplingParams]) -> None:
    """What every decode loop refuses before any work: an empty prompt, and stop strings
    without the engine's tokenizer to read them."""
    if any(len(p) == 0 for p in prompts):
        raise ValueError("generate: every prompt needs at least one token")
    if any(p.stop for p in params) and engine.tokenizer is None:
        raise ValueError("generate: stop strings need the engine's tokenizer (TransformersRolloutEngine(tokenizer=...))")


@dataclass
class DistinctPrefill:
    """Each distinct prompt of a batch run once (GRPO repeats every prompt n times), left-padded
    so that every prompt ends in the last column."""

    cache: Any  # an in-place cache with one row per distinct prompt
    logits: torch.Tensor  # [distinct, vocab]: each distinct prompt's next-token logits
    prompt_mask: torch.Tensor  # [distinct, width], on the host: 1 = a prompt token
    position_ids: torch.Tensor  # [distinct, width], on the host: the text positions
    group_of_row: torch.Tensor  # [rows], on the host: the distinct prompt of each row
    # A vision-language model's: [rows], on the host, what a row's rotary positions add to its
    # text positions past the prompt (0 without pictures; :class:`~..vision.PromptImages`). None: a text model.
    rope_delta: torch.Tensor | None = None


def decode_positions(position: torch.Tensor, rope_delta: torch.Tensor | None) -> torch.Tensor:
    """The ``position_ids`` of one decode step of rows whose next tokens are at text ``position``
    [rows]: [rows, 1], or a vision-language model's [4, rows, 1] (text, then three rotary axes)."""
    if rope_delta is None:
        return position.unsqueeze(-1)
    rope = position + rope_delta
    return torch.stack([position, rope, rope, rope]).unsqueeze(-1)


@torch.no_grad()
def prefill_distinct(engine: Any, prompts: Sequence[Sequence[int]], extra_columns: int) -> DistinctPrefill:
    """Runs ``engine.model`` once over the distinct ``prompts`` (prompts with pictures,
    :class:`~..vision.ImagePrompt`, are told apart by them too), into an in-place cache with room
    for ``extra_columns`` more tokens."""
    group_of: dict[tuple, int] = {}
    distinct: list[Sequence[int]] = []
    rows_group = []
    for prompt in prompts:
        key = prompt_key(prompt)
        if key not in group_of:
            group_of[key] = len(distinct)
            distinct.append(prompt)
        rows_group.append(group_of[key])
    group_of_row = torch.tensor(rows_group)
    width = max(len(p) for p in distinct)
    input_ids = torch.full((len(distinct), width), engine.pad_token_id, dtype=torch.long)
    prompt_mask = torch.zeros((len(distinct), width), dtype=torch.long)
    for row, prompt in enumerate(distinct):
        input_ids[row, width - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
        prompt_mask[row, width - len(prompt):] = 1
    position_ids = (prompt_mask.cumsum(-1) - 1).clamp(min=0)
    model_positions, vision, rope_delta = position_ids, {}, None
    if VisionLayout.of(engine.model.config) is not None:
        images = [images_of(p) for p in distinct]
        model_positions = torch.zeros(4, len(distinct), width, dtype=torch.long)
        for row, (prompt, pictures) in enumerate(zip(distinct, images)):
            model_positions[:, row, width - len(prompt):] = sequence_positions(pictures, len(prompt), len(prompt))
        rope_delta = torch.tensor([i.rope_delta if i is not None else 0 for i in images])[group_of_row]
        vision = vision_kwargs(images, engine.device)
    elif any(images_of(p) is not None for p in distinct):
        raise ValueError("generate: a prompt has pictures but the model is not a vision-language model")
    cache = in_place_cache(engine.model.config, width + extra_columns)
    device = engine.device
    out = engine.model(input_ids=input_ids.to(device), attention_mask=prompt_mask.to(device),
                       position_ids=model_positions.to(device), past_key_values=cache, use_cache=True,
                       logits_to_keep=1, **vision)
    return DistinctPrefill(cache, out.logits[:, -1, :], prompt_mask, position_ids, group_of_row, rope_delta)


class DecodeBatch:
    """See the module docstring. Build one with :meth:`prefill`; ``engine`` supplies the model,
    the end-of-sequence and pad ids, the tokenizer (for stop strings), the shared generator and
    the compiled decode step (or None)."""

    def __init__(self, engine: Any, cache: Any, logits: torch.Tensor, mask: torch.Tensor, position: torch.Tensor,
                 settings: RowSettings, tokens: torch.Tensor, logprobs: torch.Tensor, generated: torch.Tensor,
                 tags: list[Hashable], prompt_lengths: list[int], stop_texts: list[tuple[str, ...]],
                 rope_delta: torch.Tensor | None = None):
        self.engine = engine
        self.cache = cache
        self.logits = logits  # [rows, vocab]: each row's next-token logits
        self.mask = mask  # [rows, capacity]: 1 = a real token; the columns past the cache's are all 1
        self.position = position  # [rows]: the position id of each row's next token
        self.rope_delta = rope_delta  # [rows] of a vision-language model (:func:`decode_positions`), else None
        self.settings = settings
        self.tokens = tokens  # [rows, most max_tokens]: generated so far (generated[r] of them)
        self.logprobs = logprobs
        self.generated = generated  # [rows]
        self.tags = tags
        self.prompt_lengths = prompt_lengths
        self.stop_texts = stop_texts
        self.on_forward: ForwardCallback | None = None

    # -- building ----------------------------------------------------------------------
    @classmethod
    @torch.no_grad()
    def prefill(cls, engine: Any, prompts: Sequence[Sequence[int]], params: Sequence[SamplingParams],
                tags: Sequence[Hashable], on_forward: ForwardCallback | None = None) -> DecodeBatch:
        """New rows: each distinct prompt is run once (GRPO repeats every prompt n times) and its
        cache copied to the rows that share it. ``on_forward`` is called before this and every
        later forward pass of the batch (rows that share a prompt must then be alike to it)."""
        check_requests(engine, prompts, params)
        stop_texts = [tuple(p.stop) for p in params]
        device = engine.device
        new_tokens = max(p.max_tokens for p in params)
        if on_forward is not None:
            on_forward(list(tags))
        prefilled = prefill_distinct(engine, prompts, new_tokens)
        cache, logits, group_of_row = prefilled.cache, prefilled.logits, prefilled.group_of_row
        prompt_mask, position_ids = prefilled.prompt_mask, prefilled.position_ids
        if len(logits) < len(prompts):
            cache.batch_select_indices(group_of_row.to(device))
            logits = logits[group_of_row.to(device)]
        # Columns past the prompt are every generated token's: a step's mask is a prefix of it.
        mask = torch.cat([prompt_mask[group_of_row], prompt_mask.new_ones((len(prompts), new_tokens))], -1)
        rows = len(prompts)
        batch = cls(engine, cache, logits, mask.to(device), (position_ids[group_of_row, -1] + 1).to(device),
                    RowSettings.of(params, engine.eos_token_ids, device),
                    torch.zeros((rows, new_tokens), dtype=torch.long, device=device),
                    torch.zeros((rows, new_tokens), dtype=torch.float32, device=device),
                    torch.zeros(rows, dtype=torch.long, device=device), list(tags), [len(p) for p in prompts],
                    stop_texts, None if prefilled.rope_delta is None else prefilled.rope_delta.to(device))
        batch.on_forward = on_forward
        return batch

    def __len__(self) -> int:
        return len(self.tags)

    @property
    def width(self) -> int:
        """Columns in the cache now."""
        return self.cache.get_seq_length()

    def remaining(self) -> torch.Tensor:
        """[rows]: the most tokens each row may still generate."""
        return self.settings.max_tokens - self.generated

    # -- decoding ----------------------------------------------------------------------
    @torch.no_grad()
    def step(self, on_tokens: TokenCallback | None = None) -> list[tuple[Hashable, Completion]]:
        """Picks every row's next token; returns ``(tag, completion)`` of the rows that ended
        (they leave the batch), then runs the forward pass that gives the others' next logits."""
        settings = self.settings
        chosen, chosen_logprobs = next_tokens(self.logits, settings, self.engine.shared_generator)
        rows = torch.arange(len(self), device=chosen.device)
        self.tokens[rows, self.generated] = chosen
        self.logprobs[rows, self.generated] = chosen_logprobs
        if on_tokens is not None:
            on_tokens(list(self.tags), chosen.tolist())
        self.generated += 1
        hit_stop = settings.is_stop(chosen)
        if any(self.stop_texts):
            hit_stop |= self._spelled_a_stop()
        done = hit_stop | (self.generated >= settings.max_tokens)
        finished: list[tuple[Hashable, Completion]] = []
        if bool(done.any()):  # one host sync per step
            finished = self._completions(done.nonzero().squeeze(-1), hit_stop)
            keep = (~done).nonzero().squeeze(-1)
            self._select(keep)
            if len(keep) == 0:
                return finished
            chosen = chosen[keep]
        width = self.width
        if self.on_forward is not None:
            self.on_forward(list(self.tags))
        compiled = self.engine.compiled_decode
        if compiled is not None and len(self) > 1:
            self.logits = compiled(chosen.unsqueeze(-1), self.mask, self.position.unsqueeze(-1), self.cache)
        else:
            self.logits = self.engine.model(
                input_ids=chosen.unsqueeze(-1),
                attention_mask=self.mask[:, :width + 1],
                position_ids=decode_positions(self.position, self.rope_delta),
                past_key_values=self.cache,
                use_cache=True,
            ).logits[:, -1, :]
        self.position = self.position + 1
        return finished

    def _completions(self, rows: torch.Tensor, hit_stop: torch.Tensor) -> list[tuple[Hashable, Completion]]:
        index = rows.tolist()
        counts = self.generated[rows].tolist()
        stopped = hit_stop[rows].tolist()
        tokens, logprobs = self.tokens[rows].tolist(), self.logprobs[rows].tolist()
        return [(self.tags[row], Completion(tokens[i][:n], logprobs[i][:n], "stop" if s else "length"))
                for i, (row, n, s) in enumerate(zip(index, counts, stopped))]

    def _spelled_a_stop(self) -> torch.Tensor:
        """Which rows have text so far (special tokens left out, as vLLM does) that contains one
        of their stop strings."""
        hits = torch.zeros(len(self), dtype=torch.bool, device=self.tokens.device)
        counts = self.generated.tolist()
        for row, stops in enumerate(self.stop_texts):
            if stops:
                text = self.engine.tokenizer.decode(self.tokens[row, :counts[row]].tolist(), skip_special_tokens=True)
                hits[row] = any(stop in text for stop in stops)
        return hits

    # -- moving rows ---------------------------------------------------------------------
    def _select(self, keep: torch.Tensor) -> None:
        """Keeps only rows ``keep`` (in that order)."""
        self.cache.batch_select_indices(keep)
        self.logits, self.mask, self.position = self.logits[keep], self.mask[keep], self.position[keep]
        if self.rope_delta is not None:
            self.rope_delta = self.rope_delta[keep]
        self.tokens, self.logprobs, self.generated = self.tokens[keep], self.logprobs[keep], self.generated[keep]
        self.settings = self.settings.select(keep)
        index = keep.tolist()
        self.tags = [self.tags[i] for i in index]
        self.prompt_lengths = [self.prompt_lengths[i] for i in index]
        self.stop_texts = [self.stop_texts[i] for i in index]

    def _first_column(self) -> int:
        """The first column that is not padding in every row."""
        used = self.mask[:, :self.width].any(0).nonzero()
        return int(used[0]) if len(used) else self.width

    def absorb(self, other: DecodeBatch) -> None:
        """Takes every row of ``other`` (whose rows are then this batch's last). Both batches'
        columns are right-aligned; columns that are padding in every row are dropped."""
        if not (can_restack(self.cache) and can_restack(other.cache)):
            raise NotImplementedError("this model's cache layers cannot be joined (not all full attention)")
        parts = [self, other]
        starts = [batch._first_column() for batch in parts]
        spans = [batch.width - start for batch, start in zip(parts, starts)]
        width = max(spans)
        capacity = width + max(int(batch.remaining().max()) for batch in parts)
        cache = stack_rows(self.engine.model.config, [(batch.cache, start) for batch, start in zip(parts, starts)],
                           capacity)
        masks = []
        for batch, start, span in zip(parts, starts, spans):
            mask = batch.mask.new_ones((len(batch), capacity))
            mask[:, :width - span] = 0
            mask[:, width - span:width] = batch.mask[:, start:start + span]
            masks.append(mask)
        most = max(batch.tokens.shape[1] for batch in parts)

        def padded(tensor: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.pad(tensor, (0, most - tensor.shape[1]))

        self.cache = cache
        self.mask = torch.cat(masks)
        self.logits = torch.cat([batch.logits for batch in parts])
        self.position = torch.cat([batch.position for batch in parts])
        if self.rope_delta is not None:  # the same model: both batches have them
            self.rope_delta = torch.cat([batch.rope_delta for batch in parts])
        self.settings = RowSettings.concat([batch.settings for batch in parts])
        self.tokens = torch.cat([padded(batch.tokens) for batch in parts])
        self.logprobs = torch.cat([padded(batch.logprobs) for batch in parts])
        self.generated = torch.cat([batch.generated for batch in parts])
        self.tags = self.tags + other.tags
        self.prompt_lengths = self.prompt_lengths + other.prompt_lengths
        self.stop_texts = self.stop_texts + other.stop_texts
        self.on_forward = self.on_forward or other.on_forward
