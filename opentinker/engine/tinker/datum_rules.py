"""What a Tinker datum must be for the model it trains, checked without torch: the worker
checks it when it builds a batch, and the shared worker's host checks a whole request before it
cuts it into chunks (a chunk must never fail on a datum after others trained)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from opentinker.tinker_losses import INPUT_NAMES  # Tinker's per-token input names -> the engine's

#: One datum as the server passes it: the model input's N token ids and the per-token inputs.
Datum = tuple[np.ndarray, Mapping[str, np.ndarray]]
#: The inputs key of a datum's pictures (a vision-language model's image chunks): their encoded
#: files, in the order of their runs of image tokens in the model input.
PICTURES = "pictures"


class DatumError(ValueError):
    """A datum the backend cannot train on as sent (a user error)."""


def check_datum(index: int, tokens: Sequence[int] | np.ndarray, targets: Sequence[int] | np.ndarray,
                vocab_size: int | None, context: int | None, image_token_id: int | None = None) -> None:
    """:class:`DatumError` for a datum the model cannot take: more than its ``context``
    positions (the N input tokens plus the last target), a token past its vocabulary, or
    targets that are not next tokens (a target whose next input is a picture's token is free:
    a client cannot spell it; its weight should be 0). (Array operations: a request may hold 1M
    tokens.)"""
    tokens, targets = np.asarray(tokens), np.asarray(targets)
    if context is not None and len(tokens) + 1 > context:
        raise DatumError(f"data[{index}]: {len(tokens)} model input tokens (plus the last target: "
                         f"{len(tokens) + 1} positions) are more than the model's context of {context} tokens")
    top = max(int(tokens.max(initial=0)), int(targets.max(initial=0)))
    if vocab_size is not None and top >= vocab_size:
        raise DatumError(f"data[{index}]: token id {top} is past the model's vocabulary ({vocab_size} ids)")
    differs = tokens[1:] != targets[:len(tokens) - 1]
    if image_token_id is not None:
        differs &= tokens[1:] != image_token_id
    mismatch = np.flatnonzero(differs)
    if mismatch.size:
        first = int(mismatch[0])
        raise DatumError(
            f"data[{index}]: target_tokens[{first}] is {targets[first]} but model_input[{first + 1}] is "
            f"{tokens[first + 1]}; this server trains next-token targets (target_tokens[i] == "
            "model_input[i+1], the last target free)")


def check_datums(data: Sequence[Datum], vocab_size: int | None, context: int | None,
                 image_token_id: int | None = None) -> None:
    """Every datum of a request, and that an optional input is on all datums or none."""
    for index, (tokens, inputs) in enumerate(data):
        check_datum(index, tokens, inputs["target_tokens"], vocab_size, context, image_token_id)
    for name in INPUT_NAMES:
        present = [name in inputs for _, inputs in data]
        if any(present) and not all(present):
            raise DatumError(f"loss_fn_inputs[{name!r}] is on some datums but not all")
