"""Rollout with plain transformers: a batched KV-cache decode loop (the CPU default).

Why not ``model.generate``: we need each sampled token's logprob under exactly the
distribution the trainer will score (temperature-scaled, before filtering), per-request
sampling parameters inside one batch, and to drop finished rows from the cache so a
batch with a few long completions does not pay for the short ones.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import DynamicCache, PreTrainedModel

from opentinker.engine.rollout.base import Completion, SamplingParams, WeightSource, named_tensors


def _filter_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask (to -inf) tokens outside each row's top-k and nucleus ``top_p``."""
    sorted_logits, sorted_idx = torch.sort(logits, dim=-1, descending=True)
    vocab = logits.shape[-1]
    rank = torch.arange(vocab, device=logits.device).expand_as(sorted_logits)
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab)).clamp(max=vocab)
    drop = rank >= k.unsqueeze(-1)
    probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
    # Keep a token while the mass strictly before it is < top_p (the first token always stays).
    mass_before = torch.cumsum(probs, dim=-1) - probs
    drop |= mass_before >= top_p.unsqueeze(-1)
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, sorted_idx, sorted_logits)


class TransformersRolloutEngine:
    """Generates with a Hugging Face causal LM held in this process.

    ``model`` is this engine's own copy (weights arrive through :meth:`update_weights`).
    Prompts are left-padded so every row's next token sits in the last column.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        eos_token_ids: Sequence[int],
        pad_token_id: int,
        seed: int = 0,
        max_batch_size: int = 256,
    ):
        self.model = model.eval()
        self.eos_token_ids = tuple(eos_token_ids)
        self.pad_token_id = pad_token_id
        self.max_batch_size = max_batch_size
        self.device = next(model.parameters()).device
        self._generator = torch.Generator(device="cpu").manual_seed(seed)

    # -- weights -------------------------------------------------------------------
    @torch.no_grad()
    def update_weights(self, weights: WeightSource) -> None:
        """Copy each streamed tensor in place; every tensor of the model must come (a partial
        sync would leave a mix of old and new weights)."""
        # keep_vars: the live tensors, tied ones (lm_head = embeddings) under both names.
        targets = self.model.state_dict(keep_vars=True)
        missing = set(targets)
        for name, tensor in named_tensors(weights):
            target = targets.get(name)
            if target is None:
                raise KeyError(f"update_weights: the rollout model has no tensor named '{name}'")
            if target.data_ptr() != tensor.data_ptr():
                target.copy_(tensor)
            missing.discard(name)
        if missing:
            raise KeyError(f"update_weights: no new value for {len(missing)} tensor(s), e.g. {sorted(missing)[:3]}")

    def rng_state(self) -> torch.Tensor:
        """The sampler's random state (part of a trainer checkpoint: a resumed run samples alike)."""
        return self._generator.get_state()

    def set_rng_state(self, state: torch.Tensor) -> None:
        self._generator.set_state(state)

    def sleep(self) -> None:
        """CPU memory is not reclaimed between phases; nothing to do."""

    def wake(self) -> None:
        """See :meth:`sleep`."""

    # -- generation ----------------------------------------------------------------
    def _sample(self, logits: torch.Tensor, rows: list[int], generators: list[torch.Generator | None]) -> torch.Tensor:
        """Inverse-CDF sampling: one uniform number per row, drawn from the row's own
        generator when its request has a seed (cheap, and independent of the batch)."""
        uniform = torch.empty(len(rows), dtype=torch.float64)
        shared = [i for i, row in enumerate(rows) if generators[row] is None]
        if shared:
            uniform[shared] = torch.rand(len(shared), generator=self._generator, dtype=torch.float64)
        for i, row in enumerate(rows):
            if generators[row] is not None:
                uniform[i] = torch.rand(1, generator=generators[row], dtype=torch.float64)
        cdf = torch.softmax(logits.double(), dim=-1).cumsum(-1)
        # Scale by the total so rounding can never leave u above the last bin.
        target = (uniform.to(cdf.device) * cdf[:, -1]).unsqueeze(-1)
        # right=True: the first bin whose cdf exceeds u, so a zero-probability token never wins.
        return torch.searchsorted(cdf, target, right=True).squeeze(-1).clamp(max=logits.shape[-1] - 1)


    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams],
    ) -> list[Completion]:
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"generate: {len(prompts)} prompts but {len(params)} sampling params")
        completions: list[Completion] = []
        for start in range(0, len(prompts), self.max_batch_size):
            end = start + self.max_batch_size
            completions.extend(self._generate_batch(prompts[start:end], params[start:end]))
        return completions

    @torch.no_grad()
    def _generate_batch(self, prompts: Sequence[Sequence[int]], params: Sequence[SamplingParams]) -> list[Completion]:
        if any(len(p) == 0 for p in prompts):
            raise ValueError("generate: every prompt needs at least one token")
        batch = len(prompts)
        device = self.device
        width = max(len(p) for p in prompts)
        input_ids = torch.full((batch, width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((batch, width), dtype=torch.long)
        for row, prompt in enumerate(prompts):
            input_ids[row, width - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
            attention_mask[row, width - len(prompt):] = 1
        input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)

        temperature = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device)
        greedy = temperature == 0
        temperature = torch.where(greedy, torch.ones_like(temperature), temperature)
        top_k = torch.tensor([p.top_k for p in params], device=device)
        top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device)
        needs_filter = bool(((top_k > 0) | (top_p < 1)).any())
        generators = [
            torch.Generator(device="cpu").manual_seed(p.seed) if p.seed is not None else None for p in params
        ]
        stop_sets = [
            set(p.stop_token_ids) | (set() if p.ignore_eos else set(self.eos_token_ids)) for p in params
        ]
        max_tokens = [p.max_tokens for p in params]

        tokens: list[list[int]] = [[] for _ in range(batch)]
        logprobs: list[list[float]] = [[] for _ in range(batch)]
        finish: list[str] = ["length"] * batch
        active = torch.arange(batch, device=device)  # original row of each cache row

        cache = DynamicCache(config=self.model.config)
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        next_position = position_ids[:, -1] + 1
        while True:
            rows = active.tolist()
            logits = out.logits[:, -1, :].float() / temperature[active].unsqueeze(-1)
            token_logprobs = torch.log_softmax(logits, dim=-1)
            sample_logits = (
                _filter_top_k_top_p(logits, top_k[active], top_p[active]) if needs_filter else logits
            )
            chosen = torch.where(greedy[active], sample_logits.argmax(-1), self._sample(sample_logits, rows, generators))
            chosen_logprobs = token_logprobs.gather(-1, chosen.unsqueeze(-1)).squeeze(-1)

            keep: list[int] = []
            for i, (row, token, logprob) in enumerate(zip(rows, chosen.tolist(), chosen_logprobs.tolist())):
                tokens[row].append(token)
                logprobs[row].append(logprob)
                if token in stop_sets[row]:
                    finish[row] = "stop"
                elif len(tokens[row]) < max_tokens[row]:
                    keep.append(i)
            if not keep:
                break
            if len(keep) < len(rows):  # drop finished rows from the cache and every per-row tensor
                keep_index = torch.tensor(keep, device=device)
                cache.batch_select_indices(keep_index)
                active, chosen = active[keep_index], chosen[keep_index]
                attention_mask, next_position = attention_mask[keep_index], next_position[keep_index]
            attention_mask = torch.cat([attention_mask, attention_mask.new_ones((len(keep), 1))], dim=-1)
            out = self.model(
                input_ids=chosen.unsqueeze(-1),
                attention_mask=attention_mask,
                position_ids=next_position.unsqueeze(-1),
                past_key_values=cache,
                use_cache=True,
            )
            next_position = next_position + 1

        return [Completion(tokens[r], logprobs[r], finish[r]) for r in range(batch)]  # type: ignore[arg-type]
