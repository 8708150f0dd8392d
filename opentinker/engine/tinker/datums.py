"""Tinker datums as the training primitives' :class:`TokenBatch`, and the outputs back.

A Tinker datum is N model-input tokens plus per-token inputs of length N, position i
predicting ``target_tokens[i]``. The backend scores *response* tokens given a prompt, so a
datum becomes prompt = its first token and response = the rest of the input followed by the
last target: response token j is then scored given input[:j+1], exactly Tinker's position j.
That holds when the targets are the input shifted by one (what every Tinker client builds);
other targets are refused with a user error rather than scored wrongly.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from opentinker.engine.batch import TokenBatch
from opentinker.engine.tinker.datum_rules import INPUT_NAMES, Datum, DatumError, check_datum

__all__ = ["INPUT_NAMES", "Datum", "DatumError", "datum_limits", "per_datum", "token_batch"]


def datum_limits(model_path: str, trust_remote_code: bool = False) -> tuple[int, int | None]:
    """``(vocabulary size, context in positions or None)`` of a model folder: what a datum must
    fit (the API refuses longer datums at submit; the workers check again in case it could not tell)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    positions = getattr(config, "max_position_embeddings", None)
    return int(config.vocab_size), int(positions) if positions else None


def token_batch(data: Sequence[Datum], vocab_size: int | None = None, context: int | None = None) -> TokenBatch:
    """The datums as one batch; :class:`DatumError` for a datum the model cannot take: a token
    past its vocabulary, targets that are not next tokens, or more than its ``context``
    positions (the N input tokens plus the last target)."""
    prompts, responses = [], []
    for index, (tokens, inputs) in enumerate(data):
        tokens = np.asarray(tokens).tolist()
        targets = np.asarray(inputs["target_tokens"]).tolist()
        check_datum(index, tokens, targets, vocab_size, context)
        prompts.append(tokens[:1])
        responses.append(tokens[1:] + targets[-1:])
    batch = TokenBatch.from_responses(prompts, responses)
    for name, ours in INPUT_NAMES.items():
        present = [name in inputs for _, inputs in data]
        if any(present):
            if not all(present):
                raise DatumError(f"loss_fn_inputs[{name!r}] is on some datums but not all")
            batch.tensors[ours] = batch.pad_response_values([np.asarray(inputs[name], np.float32) for _, inputs in data])
    return batch


def per_datum(batch: TokenBatch, **fields: torch.Tensor) -> list[dict[str, np.ndarray]]:
    """Each ``[B, R]`` field cut back to each datum's own length, as float32 arrays."""
    lengths = [len(r) for r in batch.response_ids]
    arrays = {name: value.detach().float().cpu().numpy() for name, value in fields.items()}
    return [{name: values[row, :length].copy() for name, values in arrays.items()}
            for row, length in enumerate(lengths)]

