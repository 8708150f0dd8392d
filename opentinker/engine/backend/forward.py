"""Response-token logprobs (and entropy) of a causal LM on a :class:`TokenBatch`.

Three input layouts give the same numbers: padded rows, one packed row (``use_remove_padding``:
no compute on pad tokens; each sequence's attention its own, see :mod:`.packed_attention`) and a shared prompt
prefix (GRPO's n samples of a prompt: the prompt runs once and its KV cache is expanded,
differentiably, to every sample). Only the positions that predict response tokens go
through the LM head.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from opentinker.engine.backend.packed_attention import packed_call_kwargs
from opentinker.engine.backend.token_logprobs import logprobs_and_entropy
from opentinker.engine.batch import ModelInputs, TokenBatch, packed_inputs, padded_inputs, shared_prefix_inputs


@dataclass(frozen=True)
class ResponseScorer:
    pad_token_id: int
    device: torch.device
    use_remove_padding: bool = False
    share_prompt_prefix: bool = True  # not with activation checkpointing (it re-runs layers without a cache)

    def __call__(
        self, model: PreTrainedModel, batch: TokenBatch, temperature: float, with_entropy: bool,
        entropy_grad: bool = True, share_prefix: bool | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logprobs (and entropy) of each response token, [B, R]; 0 past each response. The
        entropy is differentiable only with ``entropy_grad`` (a loss term, not a statistic).
        ``share_prefix``: the layout decided by the caller (None: :meth:`shares_prefix`)."""
        with self._autocast():
            pieces, targets, valid = self._response_logits(model, batch, share_prefix)
        targets, valid = targets.to(self.device), valid.to(self.device)
        logprobs, entropy, start = [], [], 0
        for logits in pieces:  # consecutive spans of response positions
            end = start + logits.shape[1]
            piece_logprobs, piece_entropy = logprobs_and_entropy(
                logits, targets[:, start:end], temperature, with_entropy, entropy_grad)
            logprobs.append(piece_logprobs)
            entropy.append(piece_entropy)
            start = end
        entropy_out = torch.cat(entropy, dim=1) * valid if with_entropy else None
        return torch.cat(logprobs, dim=1) * valid, entropy_out

    def _autocast(self):
        if self.device.type == "cuda":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return nullcontext()

    def _inputs(self, batch: TokenBatch) -> ModelInputs:
        return packed_inputs(batch) if self.use_remove_padding else padded_inputs(batch, self.pad_token_id)

    def shares_prefix(self, batch: TokenBatch) -> bool:
        """Whether ``batch`` runs with its prompts once (two model calls: the prompts, then the
        responses, padded, on their KV cache) rather than in one call: only when enabled, some
        prompt repeats and some response has more than one token, and, when rows may be packed
        too, only if that computes fewer tokens than the packed row (many samples of long
        prompts: the prompts once; ragged responses: the packed row). Never with pictures past a
        prompt (the response pass takes no pixels)."""
        prompts = set(batch.prompt_keys())
        if not (self.share_prompt_prefix and len(prompts) < len(batch) and batch.response_width > 1):
            return False
        if batch.pictures_past_prompts():
            return False
        if not self.use_remove_padding:
            return True
        shared = len(prompts) * max(len(p) for p, _ in prompts) + len(batch) * (batch.response_width - 1)
        packed = sum(len(p) + len(r) for p, r in zip(batch.prompt_ids, batch.response_ids))
        return shared < packed

    def _response_logits(self, model: PreTrainedModel, batch: TokenBatch, share_prefix: bool | None = None):
        """The logits at the positions that predict each response token: [B, r_i, V] pieces
        that together span the R response positions (kept apart: joining them copies [B, R, V])."""
        if (self.shares_prefix(batch) if share_prefix is None else share_prefix) and not batch.pictures_past_prompts():
            return self._shared_prefix_logits(model, batch)
        inputs = self._inputs(batch)
        # A 1-D logits_to_keep (columns kept in every row) is what every transformers 5.x
        # accepts; per-row columns are gathered afterwards.
        if inputs.attention_mask is None:  # one packed row: its columns are the response slots
            first, keep = 0, inputs.logit_cols.reshape(-1)
        else:  # padded rows: the span of columns any row needs
            first = int(inputs.logit_cols.min())
            keep = torch.arange(first, int(inputs.logit_cols.max()) + 1)
        if inputs.attention_mask is None:  # each sequence attends to itself only, with no [T, T] mask
            text_positions = inputs.position_ids[0] if inputs.position_ids.dim() == 3 else inputs.position_ids
            extra = packed_call_kwargs(model, text_positions, self.device) or {"attention_mask": None}
        else:
            extra = {"attention_mask": inputs.attention_mask.to(self.device)}
        extra.update({name: value.to(self.device) for name, value in inputs.vision.items()})
        logits = model(
            input_ids=inputs.input_ids.to(self.device),
            position_ids=inputs.position_ids.to(self.device),
            logits_to_keep=keep.to(self.device),
            use_cache=False,
            **extra,
        ).logits
        if inputs.attention_mask is None:
            return [logits.reshape(len(batch), batch.response_width, -1)], inputs.targets, inputs.valid
        columns = (inputs.logit_cols - first).to(self.device)
        return [torch.take_along_dim(logits, columns.unsqueeze(-1), dim=1)], inputs.targets, inputs.valid

    def _shared_prefix_logits(self, model: PreTrainedModel, batch: TokenBatch):
        inputs = shared_prefix_inputs(batch, self.pad_token_id)
        device = self.device
        prompt_out = model(
            input_ids=inputs.prompt_ids.to(device),
            attention_mask=inputs.prompt_attention_mask.to(device),
            position_ids=inputs.prompt_position_ids.to(device),
            use_cache=True,
            logits_to_keep=1,
            **{name: value.to(device) for name, value in inputs.vision.items()},
        )
        group_of_row = inputs.group_of_row.to(device)
        first = prompt_out.logits[:, -1][group_of_row].unsqueeze(1)  # predicts response token 0
        if inputs.response_input_ids.shape[1] == 0:
            return [first], inputs.targets, inputs.valid
        cache = prompt_out.past_key_values
        cache.batch_select_indices(group_of_row)
        rest = model(
            input_ids=inputs.response_input_ids.to(device),
            attention_mask=inputs.attention_mask.to(device),
            position_ids=inputs.response_position_ids.to(device),
            past_key_values=cache,
            use_cache=True,
        ).logits
        return [first, rest], inputs.targets, inputs.valid


class ValueScorer(ResponseScorer):
    """A value model's output at each response token's position (see ``value_head``): [B, R],
    0 past each response. Same call as :class:`ResponseScorer`; no temperature, no entropy."""

    def __call__(self, model: PreTrainedModel, batch: TokenBatch, temperature: float, with_entropy: bool,
                 entropy_grad: bool = True, share_prefix: bool | None = None) -> tuple[torch.Tensor, None]:
        with self._autocast():
            pieces, _, valid = self._response_logits(model, batch, share_prefix)
        values = torch.cat([piece[..., 0].float() for piece in pieces], dim=1)
        return values * valid.to(self.device), None


def scorer_for(value_head: bool, *args, **kwargs) -> ResponseScorer:
    return (ValueScorer if value_head else ResponseScorer)(*args, **kwargs)


def pad_to(values: torch.Tensor, width: int) -> torch.Tensor:
    return torch.nn.functional.pad(values, (0, width - values.shape[1]))
