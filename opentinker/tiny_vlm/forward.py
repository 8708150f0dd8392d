"""Chats with pictures as model inputs, the SFT loss and a short greedy answer: what the tiny
VLM's build needs (the engine has its own batched paths)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from opentinker.engine.vision import Grid, VisionLayout, batch_positions, expand_image_pads, mrope_positions
from opentinker.tiny.recipe import IM_END


@dataclass(frozen=True)
class EncodedChat:
    ids: list[int]
    loss_mask: list[bool]  # True on the answer's tokens (and its <|im_end|>)
    positions: torch.Tensor  # [4, len(ids)] (opentinker.engine.vision.mrope_positions)


def encode_chat(tokenizer, layout: VisionLayout, messages: list[dict], answer: str | None,
                grids: Sequence[Grid]) -> EncodedChat:
    """The chat's prompt (ready for the assistant's turn, its image pads widened to ``grids``),
    then ``answer`` and <|im_end|> when given."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = expand_image_pads(tokenizer(text, add_special_tokens=False)["input_ids"], grids, layout)
    mask = [False] * len(ids)
    if answer is not None:
        reply = tokenizer(answer, add_special_tokens=False)["input_ids"] + [tokenizer.convert_tokens_to_ids(IM_END)]
        ids, mask = ids + reply, mask + [True] * len(reply)
    return EncodedChat(ids, mask, mrope_positions(ids, grids, layout))


def pad_rows(rows: Sequence[EncodedChat], pad_id: int):
    """Right-padded ``input_ids``, ``attention_mask``, ``labels`` (-100 where no loss), as the
    tiny text model's SFT pads them, and ``position_ids`` [4, rows, T]."""
    from opentinker.tiny.sft import _pad_batch

    input_ids, attention_mask, labels = _pad_batch([(row.ids, row.loss_mask) for row in rows], pad_id)
    return input_ids, attention_mask, labels, batch_positions([row.positions for row in rows], input_ids.shape[1])


def _hidden(model, input_ids, attention_mask, positions, pixel_values, grids):
    grid = torch.tensor(grids, dtype=torch.long) if grids else None
    return model.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions,
                       pixel_values=pixel_values, image_grid_thw=grid).last_hidden_state


def masked_lm_loss(model, input_ids, attention_mask, labels, positions, *, pixel_values=None, grids=None):
    """Next-token cross-entropy where ``labels`` != -100, the LM head applied only there."""
    hidden = _hidden(model, input_ids, attention_mask, positions, pixel_values, grids)
    targets = labels[:, 1:]
    keep = targets != -100
    logits = model.lm_head(hidden[:, :-1][keep])
    return F.cross_entropy(logits.float(), targets[keep])


@torch.no_grad()
def answer_greedily(model, tokenizer, prompts: Sequence[EncodedChat], *, pixel_values=None, grids=None,
                    max_new_tokens: int = 4) -> list[str]:
    """Each prompt's greedy continuation (a few tokens, no cache: each step runs the whole
    left-padded batch again), decoded without special tokens."""
    eos = tokenizer.convert_tokens_to_ids(IM_END)
    pad = tokenizer.pad_token_id
    rows = [list(p.ids) for p in prompts]
    positions = [p.positions for p in prompts]
    answers: list[list[int]] = [[] for _ in prompts]
    done = [False] * len(prompts)
    for _ in range(max_new_tokens):
        width = max(len(r) for r in rows)
        left = [width - len(r) for r in rows]
        input_ids = torch.tensor([[pad] * n + r for n, r in zip(left, rows)])
        attention_mask = torch.tensor([[0] * n + [1] * len(r) for n, r in zip(left, rows)])
        hidden = _hidden(model, input_ids, attention_mask, batch_positions(positions, width, left), pixel_values, grids)
        chosen = model.lm_head(hidden[:, -1]).argmax(-1).tolist()
        for i, token in enumerate(chosen):
            if done[i]:
                token = pad
            else:
                answers[i].append(token)
                done[i] = token == eos
            rows[i].append(token)
            step = positions[i][:, -1:] + 1
            positions[i] = torch.cat([positions[i], step], dim=1)
        if all(done):
            break
    return [tokenizer.decode(a, skip_special_tokens=True) for a in answers]
