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


@dataclass(frozen=True, eq=False)
class PromptImages:
    """A sequence's pictures as the model takes them, and the positions of its first tokens.

    ``positions`` covers the sequence up to at least its last picture: a prompt (RL), or a whole
    Tinker datum. Past what it covers every token is text: its rotary position is its text
    position plus :attr:`rope_delta` on all three axes (a picture of h x w merged tokens advances
    the text position by h x w but the rotary one by max(h, w)), so a response, a decode step or
    a later environment turn continues from it alone.
    """

    pixel_values: torch.Tensor  # [patches, features]: every picture's, in order
    grids: tuple[Grid, ...]
    positions: torch.Tensor  # [4, covered] (:func:`mrope_positions`)
    key: str  # a digest of the pixels and grids: two prompts are the same when tokens and key are

    @classmethod
    def of(cls, pixel_values: torch.Tensor, grids: Sequence[Grid], positions: torch.Tensor) -> PromptImages:
        import hashlib

        digest = hashlib.sha256(repr([tuple(g) for g in grids]).encode())
        digest.update(pixel_values.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
        return cls(pixel_values, tuple(tuple(int(x) for x in g) for g in grids), positions, digest.hexdigest())

    @property
    def covered(self) -> int:
        return self.positions.shape[1]

    @property
    def rope_delta(self) -> int:
        return int(self.positions[1:].max()) + 1 - self.covered


class ImagePrompt(list):
    """A prompt's token ids (a list of ints, so every path that takes token ids takes it) that
    carries its pictures in :attr:`images`."""

    def __init__(self, token_ids: Sequence[int], images: PromptImages):
        super().__init__(token_ids)
        self.images = images


def images_of(prompt: Sequence[int]) -> PromptImages | None:
    return getattr(prompt, "images", None)


def prompt_key(prompt: Sequence[int]) -> tuple:
    """What makes two prompts the same one: the tokens and, with pictures, the pictures."""
    images = images_of(prompt)
    return tuple(prompt), images.key if images is not None else None


def sequence_positions(images: PromptImages | None, prompt_length: int, length: int) -> torch.Tensor:
    """[4, length] positions of a sequence of ``length`` tokens whose prompt (``prompt_length``
    tokens) has ``images`` (their positions cover the prompt, or more)."""
    text = torch.arange(length)
    if images is None:
        return text.unsqueeze(0).expand(4, length).clone()
    covered = images.covered
    if covered < prompt_length:
        raise ValueError(f"the prompt's pictures were placed for {covered} tokens, the prompt has {prompt_length}")
    out = torch.empty(4, length, dtype=torch.long)
    out[:, :min(covered, length)] = images.positions[:, :length]
    if length > covered:
        out[0, covered:] = text[covered:]
        out[1:, covered:] = text[covered:] + images.rope_delta
    return out


def vision_kwargs(images: Sequence[PromptImages | None], device: torch.device | str = "cpu") -> dict:
    """The model's picture inputs for rows with ``images`` (in row order); {} when none has any."""
    present = [i for i in images if i is not None]
    if not present:
        return {}
    pixels = torch.cat([i.pixel_values for i in present]).to(device)
    grids = torch.tensor([g for i in present for g in i.grids], dtype=torch.long, device=device)
    return {"pixel_values": pixels, "image_grid_thw": grids}


#: The attribute a vision-language model keeps its vision encoder under (Qwen2-VL: ``model.visual``).
VISION_TOWER_NAMES = ("visual", "vision_tower", "vision_model")


def vision_tower(model: torch.nn.Module) -> tuple[str, torch.nn.Module] | None:
    """A vision-language model's vision encoder (its qualified name and module); None for a
    text model."""
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in VISION_TOWER_NAMES:
            return name, module
    return None


def freeze_vision_tower(model: torch.nn.Module) -> None:
    """No gradient (so no optimizer state) for a vision-language model's vision encoder: RL on a
    small model moves the language model, and a tower that drifts changes every picture's tokens."""
    found = vision_tower(model)
    if found is not None:
        found[1].requires_grad_(False)


class VisionPromptEncoder:
    """Chat messages with pictures -> an :class:`ImagePrompt` for a vision-language model
    folder: pictures read as untrusted input under ``limits`` (:mod:`opentinker.images`), the
    chat template's image placeholders widened to each picture's tokens, positions placed."""

    def __init__(self, folder: str, tokenizer, layout: VisionLayout, limits=None):
        from opentinker.images import ImageLimits

        self.processor = ImageProcessor(folder)
        self.tokenizer, self.layout = tokenizer, layout
        self.limits = limits if limits is not None else ImageLimits()

    @classmethod
    def for_model(cls, folder: str, tokenizer, limits=None, trust_remote_code: bool = False) -> VisionPromptEncoder | None:
        """The encoder of the model folder ``folder``, or None for a text model."""
        from transformers import AutoConfig

        layout = VisionLayout.of(AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code))
        return None if layout is None else cls(folder, tokenizer, layout, limits)

    def sequence_images(self, sequence_ids: Sequence[int], files: Sequence[bytes]) -> PromptImages:
        """The pictures (encoded ``files``, read under the limits) of a sequence that already holds
        each one's image tokens (a Tinker datum), placed over the whole sequence."""
        from opentinker.images import read_image

        pixel_values, grids = self.processor([read_image(bytes(data), self.limits) for data in files])
        return PromptImages.of(pixel_values, grids, mrope_positions(list(sequence_ids), grids, self.layout))

    def encode(self, messages: Sequence[dict], rendered_ids: Sequence[int]) -> list[int]:
        """``rendered_ids`` (``messages`` through the chat template) with the pictures of
        ``messages``: an :class:`ImagePrompt`, or the ids as they are when there is none."""
        from opentinker.images import read_message_images

        pictures = read_message_images(messages, self.limits)
        if not pictures:
            return list(rendered_ids)
        pixel_values, grids = self.processor(pictures)
        ids = expand_image_pads(rendered_ids, grids, self.layout)
        return ImagePrompt(ids, PromptImages.of(pixel_values, grids, mrope_positions(ids, grids, self.layout)))
