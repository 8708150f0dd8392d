"""What a Qwen2-VL-style model needs beside token ids: each picture's patches and grid, one
``<|image_pad|>`` per merged patch in the sequence, and 3-D rotary positions.

The positions are computed here, not by transformers (whose ``get_rope_index`` has changed its
arguments between releases), from a sequence's own tokens and its pictures' grids, so that the
rollout, the reference, the update, packed rows and a cached decode all use the same ones:
text tokens count up one by one on all three axes; a picture's tokens sit at (start, start +
row, start + column) of its merged grid, and the text after it resumes at start + the longer
side. A forward takes them as ``position_ids`` of shape [4, rows, T]: the text positions first
(0, 1, 2, ... per sequence, which the attention mask of packed rows is built from), then the
three rotary axes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

VISION_START, IMAGE_PAD, VISION_END = "<|vision_start|>", "<|image_pad|>", "<|vision_end|>"

Grid = tuple[int, int, int]  # (temporal, height, width) in patches, before the merge


@dataclass(frozen=True)
class VisionLayout:
    """A vision-language model's constants, read from its config."""

    image_token_id: int
    merge: int  # spatial_merge_size: merge x merge patches become one token

    @classmethod
    def of(cls, config) -> VisionLayout | None:
        """The layout of a model config, or None for a text-only model."""
        vision = getattr(config, "vision_config", None)
        image_token_id = getattr(config, "image_token_id", None)
        if vision is None or image_token_id is None:
            return None
        return cls(int(image_token_id), int(vision.spatial_merge_size))

    def tokens_of(self, grid: Grid) -> int:
        """How many ``<|image_pad|>`` tokens a picture of ``grid`` takes."""
        t, h, w = grid
        return t * h * w // (self.merge * self.merge)


def expand_image_pads(token_ids: Sequence[int], grids: Sequence[Grid], layout: VisionLayout) -> list[int]:
    """A prompt rendered with one ``<|image_pad|>`` per picture, with each one repeated to the
    picture's token count (as the model's processor does)."""
    pads = [i for i, token in enumerate(token_ids) if token == layout.image_token_id]
    if len(pads) != len(grids):
        raise ValueError(f"the prompt has {len(pads)} image placeholder(s) for {len(grids)} image(s)")
    out: list[int] = []
    cursor = 0
    for index, grid in zip(pads, grids):
        out.extend(token_ids[cursor:index])
        out.extend([layout.image_token_id] * layout.tokens_of(grid))
        cursor = index + 1
    out.extend(token_ids[cursor:])
    return out


def mrope_positions(token_ids: Sequence[int], grids: Sequence[Grid], layout: VisionLayout) -> torch.Tensor:
    """[4, T] positions of one sequence whose pictures (in order) have ``grids``: row 0 the text
    positions 0..T-1, rows 1-3 the rotary (temporal, height, width) positions."""
    length = len(token_ids)
    rope = torch.empty(3, length, dtype=torch.long)
    position = index = 0
    pictures = iter(grids)
    while index < length:
        if token_ids[index] != layout.image_token_id:
            rope[:, index] = position
            position += 1
            index += 1
            continue
        grid = next(pictures, None)
        if grid is None:
            raise ValueError(f"image token at {index} has no image left (there are {len(grids)})")
        t, h, w = grid[0], grid[1] // layout.merge, grid[2] // layout.merge
        count = t * h * w
        if token_ids[index:index + count] != [layout.image_token_id] * count:
            raise ValueError(f"an image of grid {tuple(grid)} needs {count} image tokens from {index}")
        steps = torch.arange(count)
        rope[0, index:index + count] = position + steps // (h * w)
        rope[1, index:index + count] = position + (steps // w) % h
        rope[2, index:index + count] = position + steps % w
        position += max(h, w)
        index += count
    if next(pictures, None) is not None:
        raise ValueError(f"{len(grids)} images but fewer image-token runs in the sequence")
    return torch.cat([torch.arange(length).unsqueeze(0), rope])


def batch_positions(rows: Sequence[torch.Tensor], width: int, left_pad: Sequence[int] | None = None) -> torch.Tensor:
    """[4, rows, width] from each row's [4, T] positions, placed right-padded (or after
    ``left_pad[i]`` pad columns); pads get position 0."""
    out = torch.zeros(4, len(rows), width, dtype=torch.long)
    for i, positions in enumerate(rows):
        start = left_pad[i] if left_pad is not None else 0
        out[:, i, start:start + positions.shape[1]] = positions
    return out


class ImageProcessor:
    """A model folder's image processor (``preprocessor_config.json``): pictures -> patches and
    grids. Qwen2-VL's Pillow-based processor, so torchvision is not needed."""

    def __init__(self, folder: str):
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        self._processor = Qwen2VLImageProcessorPil.from_pretrained(folder)

    def __call__(self, images: Sequence) -> tuple[torch.Tensor, list[Grid]]:
        """``pixel_values`` [patches, features] of all ``images`` (PIL) in order, and each one's grid."""
        out = self._processor(images=list(images), return_tensors="pt")
        return out["pixel_values"], [tuple(int(x) for x in grid) for grid in out["image_grid_thw"].tolist()]
