"""A training batch of token sequences and the two ways to feed it to a model.

``TokenBatch`` keeps ragged token lists (exactly what rollout produced) plus response-aligned
tensors [B, R], right-padded to the longest response R. The model sees either a padded
[B, L] matrix or, with ``use_remove_padding``, one packed row where position ids restart at
each sequence, so no compute is spent on pad tokens. Both give the same logprobs.

A batch of a vision-language model carries each row's pictures (``images``: the prompt's
:class:`~opentinker.engine.vision.PromptImages`, None for a text row); its layouts then hold the
pixel values and grids of the rows they run (``vision``) and [4, rows, T] positions (the text
positions, then the three rotary axes).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from opentinker.engine.vision import PromptImages, sequence_positions, vision_kwargs


@dataclass
class TokenBatch:
    """B sequences of ``prompt_ids[i] + response_ids[i]``.

    ``response_mask[i, j]`` is 1 where ``response_ids[i][j]`` is a model token to train on,
    0 on environment tokens and on padding past the response. ``tensors`` holds other
    response-aligned [B, R] values (old/ref logprobs, advantages) under their names.
    ``images[i]``: row i's prompt pictures (None: text only; the field None: no row has any).
    """

    prompt_ids: list[list[int]]
    response_ids: list[list[int]]
    response_mask: torch.Tensor
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    images: list[PromptImages | None] | None = None

    def __post_init__(self) -> None:
        if len(self.prompt_ids) != len(self.response_ids):
            raise ValueError("TokenBatch: prompt_ids and response_ids differ in length")
        width = max((len(r) for r in self.response_ids), default=0)
        if tuple(self.response_mask.shape) != (len(self), width):
            raise ValueError(
                f"TokenBatch: response_mask has shape {tuple(self.response_mask.shape)}, "
                f"expected ({len(self)}, {width})"
            )
        if self.images is not None and len(self.images) != len(self):
            raise ValueError(f"TokenBatch: {len(self.images)} rows of images for {len(self)} rows")
        if self.images is not None and all(i is None for i in self.images):
            self.images = None

    def __len__(self) -> int:
        return len(self.prompt_ids)

    @property
    def response_width(self) -> int:
        return self.response_mask.shape[1]

    @classmethod
    def from_responses(
        cls,
        prompt_ids: Sequence[Sequence[int]],
        response_ids: Sequence[Sequence[int]],
        response_masks: Sequence[Sequence[int]] | None = None,
        images: Sequence[PromptImages | None] | None = None,
    ) -> "TokenBatch":
        """Right-pad ragged responses; without masks every response token is a model token."""
        width = max((len(r) for r in response_ids), default=0)
        mask = torch.zeros((len(response_ids), width), dtype=torch.float32)
        for row, response in enumerate(response_ids):
            row_mask = response_masks[row] if response_masks is not None else [1] * len(response)
            if len(row_mask) != len(response):
                raise ValueError(f"TokenBatch: response_mask of row {row} does not match its response length")
            mask[row, : len(response)] = torch.tensor(row_mask, dtype=torch.float32)
        return cls([list(p) for p in prompt_ids], [list(r) for r in response_ids], mask,
                   images=list(images) if images is not None else None)

    def pad_response_values(self, values: Sequence[Sequence[float]]) -> torch.Tensor:
        """Ragged per-token values -> [B, R] aligned with ``response_mask`` (0 beyond each row)."""
        out = torch.zeros((len(self), self.response_width), dtype=torch.float32)
        for row, row_values in enumerate(values):
            out[row, : len(row_values)] = torch.tensor(row_values, dtype=torch.float32)
        return out

    def select(self, indices: Sequence[int] | torch.Tensor) -> "TokenBatch":
        """A sub-batch; response tensors are trimmed to the sub-batch's longest response."""
        index = torch.as_tensor(indices, dtype=torch.long)
        rows = index.tolist()
        width = max((len(self.response_ids[r]) for r in rows), default=0)
        return TokenBatch(
            [self.prompt_ids[r] for r in rows],
            [self.response_ids[r] for r in rows],
            self.response_mask[index, :width],
            {name: t[index, :width] for name, t in self.tensors.items()},
            [self.images[r] for r in rows] if self.images is not None else None,
        )

    def row_images(self) -> list[PromptImages | None]:
        return self.images if self.images is not None else [None] * len(self)

    def row_cost(self, row: int) -> int:
        """What row ``row`` costs a pass, in positions: its tokens, plus its pictures' patches
        (each goes through the vision tower as a position of its own, before the merge)."""
        images = self.row_images()[row]
        patches = 0 if images is None else int(images.pixel_values.shape[0])
        return len(self.prompt_ids[row]) + len(self.response_ids[row]) + patches

    def pictures_past_prompts(self) -> bool:
        """Whether some row has pictures after its prompt (a Tinker datum's prompt is its first
        token): the shared-prompt layout, whose response pass takes no pixels, cannot run it."""
        return any(images is not None and images.covered > len(prompt)
                   for prompt, images in zip(self.prompt_ids, self.row_images()))

    def prompt_keys(self) -> list[tuple]:
        """What tells the rows' prompts apart: their tokens and their pictures."""
        return [(tuple(p), images.key if images is not None else None)
                for p, images in zip(self.prompt_ids, self.row_images())]

    def positions(self, row: int) -> torch.Tensor:
        """[4, T] positions of row ``row``'s prompt and response (pictures or not)."""
        prompt = len(self.prompt_ids[row])
        return sequence_positions(self.row_images()[row], prompt, prompt + len(self.response_ids[row]))

    def split(self, size: int) -> list["TokenBatch"]:
        return [self.select(range(start, min(start + size, len(self)))) for start in range(0, len(self), size)]


@dataclass
class ModelInputs:
    """What one forward pass takes, plus where each response token's logit lives.

    ``logit_rows``/``logit_cols`` index the flattened [rows, positions] grid of the forward
    pass: entry (i, j) of the response grid is predicted at position ``logit_cols`` of row
    ``logit_rows`` (the position before the token). ``valid`` is False past each response.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    attention_mask: torch.Tensor | None
    logit_rows: torch.Tensor
    logit_cols: torch.Tensor
    targets: torch.Tensor
    valid: torch.Tensor
    vision: dict[str, torch.Tensor] = field(default_factory=dict)  # pixel_values, image_grid_thw


def _response_grid(batch: TokenBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, R] response token ids (0 past the end) and the validity mask."""
    targets = torch.zeros((len(batch), batch.response_width), dtype=torch.long)
    valid = torch.zeros_like(targets, dtype=torch.bool)
    for row, response in enumerate(batch.response_ids):
        targets[row, : len(response)] = torch.tensor(response, dtype=torch.long)
        valid[row, : len(response)] = True
    return targets, valid


def padded_inputs(batch: TokenBatch, pad_token_id: int) -> ModelInputs:
    """[B, L] right-padded sequences with an attention mask."""
    sequences = [p + r for p, r in zip(batch.prompt_ids, batch.response_ids)]
    length = max(len(s) for s in sequences)
    input_ids = torch.full((len(batch), length), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(batch), length), dtype=torch.long)
    for row, sequence in enumerate(sequences):
        input_ids[row, : len(sequence)] = torch.tensor(sequence, dtype=torch.long)
        attention_mask[row, : len(sequence)] = 1
    position_ids = torch.arange(length).expand(len(batch), length).contiguous()
    if batch.images is not None:  # [4, B, L]: pads at 0, as above
        position_ids = torch.zeros(4, len(batch), length, dtype=torch.long)
        for row, sequence in enumerate(sequences):
            position_ids[:, row, : len(sequence)] = batch.positions(row)
    targets, valid = _response_grid(batch)
    width = batch.response_width
    prompt_lengths = torch.tensor([len(p) for p in batch.prompt_ids])
    cols = (prompt_lengths.unsqueeze(-1) - 1 + torch.arange(width)).clamp(max=length - 1)
    rows = torch.arange(len(batch)).unsqueeze(-1).expand(len(batch), width)
    return ModelInputs(input_ids, position_ids, attention_mask, rows, cols, targets, valid,
                       vision_kwargs(batch.row_images()))


def packed_inputs(batch: TokenBatch) -> ModelInputs:
    """One [1, total] row; position ids restart at 0 for each sequence (no attention mask)."""
    sequences = [p + r for p, r in zip(batch.prompt_ids, batch.response_ids)]
    input_ids = torch.tensor([token for s in sequences for token in s], dtype=torch.long).unsqueeze(0)
    if batch.images is not None:  # [4, 1, total]
        position_ids = torch.cat([batch.positions(row) for row in range(len(batch))], dim=1).unsqueeze(1)
    else:
        position_ids = torch.cat([torch.arange(len(s)) for s in sequences]).unsqueeze(0)
    targets, valid = _response_grid(batch)
    width = batch.response_width
    starts = torch.tensor([0] + [len(s) for s in sequences[:-1]]).cumsum(0)
    prompt_lengths = torch.tensor([len(p) for p in batch.prompt_ids])
    total = input_ids.shape[1]
    cols = (starts.unsqueeze(-1) + prompt_lengths.unsqueeze(-1) - 1 + torch.arange(width)).clamp(max=total - 1)
    rows = torch.zeros_like(cols)
    return ModelInputs(input_ids, position_ids, None, rows, cols, targets, valid, vision_kwargs(batch.row_images()))


@dataclass
class SharedPrefixInputs:
    """Each distinct prompt once, then only the response tokens of every sample.

    GRPO samples n responses per prompt, so most rows repeat their prompt; running it once
    and reusing its KV cache cuts the tokens computed in the logprob and update passes.
    Prompts are left-padded ([G, P]) so each one ends in the last column, whose logits
    predict the first response token. ``group_of_row[i]`` is row i's prompt; the response
    pass takes every response token but the last ([B, R-1]), positions continuing from the
    prompt, attending to the prompt's cache through ``attention_mask`` ([B, P + R - 1]).
    """

    prompt_ids: torch.Tensor
    prompt_attention_mask: torch.Tensor
    prompt_position_ids: torch.Tensor
    group_of_row: torch.Tensor
    response_input_ids: torch.Tensor
    response_position_ids: torch.Tensor
    attention_mask: torch.Tensor
    targets: torch.Tensor
    valid: torch.Tensor
    vision: dict[str, torch.Tensor] = field(default_factory=dict)


def shared_prefix_inputs(batch: TokenBatch, pad_token_id: int) -> SharedPrefixInputs:
    group_of: dict[tuple, int] = {}
    first_row: list[int] = []  # a row of each distinct prompt
    for row, key in enumerate(batch.prompt_keys()):
        if key not in group_of:
            group_of[key] = len(group_of)
            first_row.append(row)
    group_of_row = torch.tensor([group_of[key] for key in batch.prompt_keys()])
    prompts = [batch.prompt_ids[row] for row in first_row]
    width = max(len(p) for p in prompts)
    prompt_ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
    prompt_mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        prompt_ids[row, width - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
        prompt_mask[row, width - len(prompt):] = 1
    prompt_positions = (prompt_mask.cumsum(-1) - 1).clamp(min=0)

    targets, valid = _response_grid(batch)
    response_inputs = targets[:, :-1]  # the last token predicts nothing we score
    prompt_lengths = torch.tensor([len(p) for p in batch.prompt_ids])
    response_positions = prompt_lengths.unsqueeze(-1) + torch.arange(response_inputs.shape[1])
    attention_mask = torch.cat([prompt_mask[group_of_row], valid[:, :-1].long()], dim=-1)
    vision: dict[str, torch.Tensor] = {}
    if batch.images is not None:
        images = [batch.images[row] for row in first_row]
        prompt_positions = torch.zeros(4, len(prompts), width, dtype=torch.long)
        for row, prompt in enumerate(prompts):
            prompt_positions[:, row, width - len(prompt):] = sequence_positions(images[row], len(prompt), len(prompt))
        delta = torch.tensor([i.rope_delta if i is not None else 0 for i in batch.images])
        rope = response_positions + delta.unsqueeze(-1)
        response_positions = torch.stack([response_positions, rope, rope, rope])
        vision = vision_kwargs(images)
    return SharedPrefixInputs(
        prompt_ids, prompt_mask, prompt_positions, group_of_row, response_inputs, response_positions,
        attention_mask, targets, valid, vision,
    )

