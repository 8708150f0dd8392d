"""Tinker datums as the training primitives' :class:`TokenBatch`, and the outputs back.

A Tinker datum is N model-input tokens plus per-token inputs of length N, position i
predicting ``target_tokens[i]``. The backend scores *response* tokens given a prompt, so a
datum becomes prompt = its first token and response = the rest of the input followed by the
last target: response token j is then scored given input[:j+1], exactly Tinker's position j.
That holds when the targets are the input shifted by one (what every Tinker client builds);
other targets are refused with a user error rather than scored wrongly.

A vision-language model's datum may hold pictures (image chunks): its model input then holds
each picture's image tokens, and its files (``inputs[PICTURES]``) become the row's pixels and
3-D positions over the whole datum (:meth:`~opentinker.engine.vision.VisionPromptEncoder.sequence_images`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from opentinker.engine.batch import TokenBatch
from opentinker.engine.tinker.datum_rules import INPUT_NAMES, PICTURES, Datum, DatumError, check_datum
from opentinker.engine.vision import PromptImages, VisionPromptEncoder

__all__ = ["INPUT_NAMES", "Datum", "DatumError", "datum_limits", "datum_pictures", "per_datum", "token_batch"]


def datum_limits(model_path: str, trust_remote_code: bool = False) -> tuple[int, int | None]:
    """``(vocabulary size, context in positions or None)`` of a model folder: what a datum must
    fit (the API refuses longer datums at submit; the workers check again in case it could not tell)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code).get_text_config()
    positions = getattr(config, "max_position_embeddings", None)
    return int(config.vocab_size), int(positions) if positions else None


def datum_pictures(model_path: str, trust_remote_code: bool = False, limits=None) -> VisionPromptEncoder | None:
    """How a vision-language model folder reads a datum's pictures (None: a text model)."""
    return VisionPromptEncoder.for_model(model_path, None, limits, trust_remote_code)


def token_batch(data: Sequence[Datum], vocab_size: int | None = None, context: int | None = None,
                pictures: VisionPromptEncoder | None = None) -> TokenBatch:
    """The datums as one batch; :class:`DatumError` for a datum the model cannot take: a token
    past its vocabulary, targets that are not next tokens, or more than its ``context``
    positions (the N input tokens plus the last target), or pictures it cannot read."""
    prompts, responses, images = [], [], []
    image_token = pictures.layout.image_token_id if pictures is not None else None
    for index, (tokens, inputs) in enumerate(data):
        tokens = np.asarray(tokens).tolist()
        targets = np.asarray(inputs["target_tokens"]).tolist()
        check_datum(index, tokens, targets, vocab_size, context, image_token)
        prompts.append(tokens[:1])
        responses.append(tokens[1:] + targets[-1:])
        images.append(_datum_images(index, tokens + targets[-1:], inputs.get(PICTURES) or (), pictures))
    batch = TokenBatch.from_responses(prompts, responses, images=images)
    for name, ours in INPUT_NAMES.items():
        present = [name in inputs for _, inputs in data]
        if any(present):
            if not all(present):
                raise DatumError(f"loss_fn_inputs[{name!r}] is on some datums but not all")
            batch.tensors[ours] = batch.pad_response_values([np.asarray(inputs[name], np.float32) for _, inputs in data])
    return batch


def _datum_images(index: int, sequence: list[int], files: Sequence[bytes],
                  pictures: VisionPromptEncoder | None) -> PromptImages | None:
    if not files:
        return None
    if pictures is None:
        raise DatumError(f"data[{index}]: image chunks, but this model is not a vision-language model")
    try:
        return pictures.sequence_images(sequence, files)
    except ValueError as error:  # a picture refused (ImageError), or its tokens not where its chunk was
        raise DatumError(f"data[{index}]: {error}") from None


def per_datum(batch: TokenBatch, **fields: torch.Tensor) -> list[dict[str, np.ndarray]]:
    """Each ``[B, R]`` field cut back to each datum's own length, as float32 arrays."""
    lengths = [len(r) for r in batch.response_ids]
    arrays = {name: value.detach().float().cpu().numpy() for name, value in fields.items()}
    return [{name: values[row, :length].copy() for name, values in arrays.items()}
            for row, length in enumerate(lengths)]

