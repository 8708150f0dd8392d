"""The pictures of one multi-turn conversation, for an agent loop: each turn's picture
placeholders widened as the turn is appended, and the pixels and positions of the whole context
so far for the next generation (a vision-language model's; a text model's conversations have none)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from opentinker.engine.vision import (
    Grid, ImagePrompt, PromptImages, VisionPromptEncoder, expand_image_pads, mrope_positions,
)


@dataclass
class Widened:
    """A turn's ids with its pictures' placeholders widened, and those pictures."""

    ids: list[int]
    pixel_values: torch.Tensor | None = None
    grids: list[Grid] = field(default_factory=list)


class ConversationPictures:
    """The pictures of one multi-turn conversation (the prompt's and every environment turn's),
    for an agent loop: each turn's picture placeholders widened as the turn is appended, and the
    pixels and positions of the whole context so far for the next generation."""

    def __init__(self, encoder: VisionPromptEncoder | None):
        self.encoder = encoder
        self._pixels: list[torch.Tensor] = []
        self._grids: list[Grid] = []

    def widen(self, messages: Sequence[dict], ids: Sequence[int]) -> Widened:
        """``ids`` (``messages`` rendered by the chat template) with the pictures of ``messages``
        read (under the encoder's limits, counting every picture of the conversation) and their
        placeholders widened; :meth:`keep` it once its ids are appended. ValueError (an
        ImageError for a bad picture) when it cannot."""
        from opentinker.images import message_images, read_message_images

        if not any(True for _ in message_images(messages)):
            return Widened(list(ids))
        if self.encoder is None:
            raise ValueError("the conversation has pictures but the model is not a vision-language model")
        pixel_values, grids = self.encoder.processor(
            read_message_images(messages, self.encoder.limits, earlier=len(self._grids)))
        return Widened(expand_image_pads(ids, grids, self.encoder.layout), pixel_values, grids)

    def keep(self, widened: Widened) -> list[int]:
        """Count ``widened``'s pictures in the conversation (its ids were appended); its ids."""
        if widened.grids:
            self._pixels.append(widened.pixel_values)
            self._grids.extend(widened.grids)
        return widened.ids

    def holds_image_token(self, token_ids: Sequence[int]) -> bool:
        """Whether model-sampled ``token_ids`` hold the image token (a text model's never do)."""
        return self.encoder is not None and self.encoder.layout.image_token_id in token_ids

    def context(self, ids: Sequence[int]) -> Sequence[int]:
        """The context ``ids`` (prompt and response so far) with its pictures: an
        :class:`ImagePrompt`, or the ids when the conversation has none."""
        images = self.images(ids)
        return list(ids) if images is None else ImagePrompt(ids, images)

    def images(self, ids: Sequence[int]) -> PromptImages | None:
        if not self._grids:
            return None
        return PromptImages.of(torch.cat(self._pixels), self._grids,
                               mrope_positions(list(ids), self._grids, self.encoder.layout))
