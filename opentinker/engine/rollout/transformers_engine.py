"""Rollout with plain transformers: a batched KV-cache decode loop (the CPU default).

Why not ``model.generate``: we need each sampled token's logprob under exactly the
distribution the trainer will score (temperature-scaled, before filtering), per-request
sampling parameters inside one batch, and to drop finished rows from the cache so a
batch with a few long completions does not pay for the short ones.

Where the time goes on CPU, and what is done about it: each distinct prompt is prefilled once
(GRPO repeats every prompt n times); the KV cache is written in place instead of re-allocated
per token (:mod:`.kv_cache`); the per-step bookkeeping is a few tensor ops, with one host
sync per step. (A hand-written decode step on the weights, skipping transformers' module
overhead, was 8-18% faster here; it was left out as a second copy of every model to keep true.)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from opentinker.engine.rollout.base import Completion, SamplingParams, WeightSource, named_tensors
from opentinker.engine.rollout.kv_cache import in_place_cache


#: ``on_tokens(rows, tokens)`` of :meth:`TransformersRolloutEngine.generate`.
TokenCallback = Callable[[list[int], list[int]], None]


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
        tokenizer: PreTrainedTokenizerBase | None = None,
    ):
        self.model = model.eval()
        self.eos_token_ids = tuple(eos_token_ids)
        self.pad_token_id = pad_token_id
        self.max_batch_size = max_batch_size
        self.device = next(model.parameters()).device
        self._generator = torch.Generator(device="cpu").manual_seed(seed)
        self.tokenizer = tokenizer  # only to match stop strings

    @classmethod
    def from_pretrained(cls, path: str, *, device: torch.device | str = "cpu", trust_remote_code: bool = False,
                        seed: int = 0) -> TransformersRolloutEngine:
        """An engine for the model folder ``path``, with its tokenizer (for stop strings) and the
        end-of-turn ids of its tokenizer and generation config."""
        from opentinker.engine.model_loading import eos_token_ids, load_causal_lm, load_tokenizer

        tokenizer = load_tokenizer(path, trust_remote_code=trust_remote_code)
        model = load_causal_lm(path, device=device, trust_remote_code=trust_remote_code)
        return cls(model, eos_token_ids(tokenizer, path), tokenizer.pad_token_id, seed=seed, tokenizer=tokenizer)

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
    def _uniforms(self, rows: list[int], generators: list[torch.Generator | None]) -> torch.Tensor:
        """One uniform number per row, from the row's own generator when its request has a
        seed (so it samples alike in any batch), else from the engine's generator."""
        shared = [i for i, row in enumerate(rows) if generators[row] is None]
        if len(shared) == len(rows):
            return torch.rand(len(rows), generator=self._generator, dtype=torch.float64)
        uniform = torch.empty(len(rows), dtype=torch.float64)
        if shared:
            uniform[shared] = torch.rand(len(shared), generator=self._generator, dtype=torch.float64)
        for i, row in enumerate(rows):
            if generators[row] is not None:
                uniform[i] = torch.rand(1, generator=generators[row], dtype=torch.float64)
        return uniform

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams],
        *,
        on_tokens: TokenCallback | None = None,
    ) -> list[Completion]:
        """One completion per prompt; ``on_tokens(rows, tokens)``, when given, hears each decode
        step's new token of every row still generating (rows index ``prompts``), as it is chosen."""
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"generate: {len(prompts)} prompts but {len(params)} sampling params")
        completions: list[Completion] = []
        for start in range(0, len(prompts), self.max_batch_size):
            end = start + self.max_batch_size
            completions.extend(self._generate_batch(prompts[start:end], params[start:end], on_tokens, start))
        return completions

    def _prefill(self, prompts: Sequence[Sequence[int]], new_tokens: int):
        """Runs each distinct prompt once (GRPO repeats every prompt n times) and copies its
        cache to the rows that share it. Returns the cache, the next-token logits [B, V], the
        attention mask for the whole generation [B, P + new_tokens] and the next positions [B]."""
        group_of: dict[tuple[int, ...], int] = {}
        group_of_row = torch.tensor([group_of.setdefault(tuple(p), len(group_of)) for p in prompts])
        distinct = list(group_of)
        width = max(len(p) for p in distinct)
        input_ids = torch.full((len(distinct), width), self.pad_token_id, dtype=torch.long)
        prompt_mask = torch.zeros((len(distinct), width), dtype=torch.long)
        for row, prompt in enumerate(distinct):
            input_ids[row, width - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
            prompt_mask[row, width - len(prompt):] = 1
        position_ids = (prompt_mask.cumsum(-1) - 1).clamp(min=0)
        device = self.device
        cache = in_place_cache(self.model.config, width + new_tokens)
        out = self.model(
            input_ids=input_ids.to(device),
            attention_mask=prompt_mask.to(device),
            position_ids=position_ids.to(device),
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        logits = out.logits[:, -1, :]
        if len(distinct) < len(prompts):
            cache.batch_select_indices(group_of_row.to(device))
            logits = logits[group_of_row.to(device)]
        # Columns past the prompt are every generated token's: a step's mask is a prefix of it.
        attention_mask = torch.cat([prompt_mask[group_of_row], prompt_mask.new_ones((len(prompts), new_tokens))], -1)
        next_position = position_ids[group_of_row, -1] + 1
        return cache, logits, attention_mask.to(device), next_position.to(device)

    @torch.no_grad()
    def _generate_batch(self, prompts: Sequence[Sequence[int]], params: Sequence[SamplingParams],
                        on_tokens: TokenCallback | None = None, first_row: int = 0) -> list[Completion]:
        if any(len(p) == 0 for p in prompts):
            raise ValueError("generate: every prompt needs at least one token")
        batch = len(prompts)
        device = self.device
        settings = _RowSettings.of(params, self.eos_token_ids, device)
        stop_texts = [p.stop for p in params]
        if not any(stop_texts):
            stop_texts = None
        elif self.tokenizer is None:
            raise ValueError("generate: stop strings need the engine's tokenizer (TransformersRolloutEngine(tokenizer=...))")
        new_tokens = max(p.max_tokens for p in params)
        cache, logits, attention_mask, next_position = self._prefill(prompts, new_tokens)
        prompt_width = attention_mask.shape[1] - new_tokens

        tokens = torch.zeros((batch, new_tokens), dtype=torch.long, device=device)
        logprobs = torch.zeros((batch, new_tokens), dtype=torch.float32, device=device)
        lengths = torch.full((batch,), new_tokens, device=device)
        stopped = torch.zeros(batch, dtype=torch.bool, device=device)
        active = torch.arange(batch, device=device)  # original row of each cache row
        rows = active.tolist()
        step = 0
        while True:
            chosen, chosen_logprobs = self._next_tokens(logits, settings, rows)
            tokens[active, step] = chosen
            logprobs[active, step] = chosen_logprobs
            if on_tokens is not None:
                on_tokens([first_row + row for row in rows], chosen.tolist())
            step += 1
            hit_stop = settings.is_stop(chosen)
            if stop_texts:
                hit_stop |= self._spelled_a_stop(tokens, rows, step, stop_texts)
            done = hit_stop | (settings.max_tokens <= step)
            if bool(done.any()):  # record the finished rows, drop them from the cache and every per-row tensor
                finished = active[done]
                lengths[finished] = step
                stopped[finished] = hit_stop[done]
                keep = (~done).nonzero().squeeze(-1)
                if len(keep) == 0:
                    break
                cache.batch_select_indices(keep)
                active, chosen, settings = active[keep], chosen[keep], settings.select(keep)
                attention_mask, next_position = attention_mask[keep], next_position[keep]
                rows = active.tolist()
            step_mask = attention_mask[:, :prompt_width + step]
            logits = self.model(
                input_ids=chosen.unsqueeze(-1),
                attention_mask=step_mask,
                position_ids=next_position.unsqueeze(-1),
                past_key_values=cache,
                use_cache=True,
            ).logits[:, -1, :]
            next_position = next_position + 1

        token_lists, logprob_lists = tokens.tolist(), logprobs.tolist()
        return [
            Completion(token_lists[r][:n], logprob_lists[r][:n], "stop" if s else "length")  # type: ignore[arg-type]
            for r, (n, s) in enumerate(zip(lengths.tolist(), stopped.tolist()))
        ]

    def _spelled_a_stop(self, tokens: torch.Tensor, rows: list[int], step: int,
                        stop_texts: list[tuple[str, ...]]) -> torch.Tensor:
        """Which of ``rows`` have text so far (special tokens left out, as vLLM does) that
        contains one of their stop strings."""
        hits = torch.zeros(len(rows), dtype=torch.bool, device=tokens.device)
        for i, row in enumerate(rows):
            if stop_texts[row]:
                text = self.tokenizer.decode(tokens[row, :step].tolist(), skip_special_tokens=True)
                hits[i] = any(stop in text for stop in stop_texts[row])
        return hits

    def _next_tokens(self, logits: torch.Tensor, settings: "_RowSettings", rows: list[int]):
        """The sampled (or greedy) token of each row and its logprob at the row's temperature,
        before top-k/top-p filtering."""
        logits = logits.float()
        if settings.scale_by_temperature:
            logits = logits / settings.temperature.unsqueeze(-1)
        token_logprobs = torch.log_softmax(logits, dim=-1)
        # Every row draws its number, greedy ones too: the engine's random stream advances the
        # same way whatever the rows' settings.
        uniform = self._uniforms(rows, settings.generators)
        if settings.all_greedy:
            chosen = logits.argmax(-1)
        else:
            sample_logits = (
                _filter_top_k_top_p(logits, settings.top_k, settings.top_p) if settings.needs_filter else logits
            )
            chosen = _inverse_cdf(sample_logits, uniform)
            if settings.any_greedy:
                chosen = torch.where(settings.greedy, sample_logits.argmax(-1), chosen)
        return chosen, token_logprobs.gather(-1, chosen.unsqueeze(-1)).squeeze(-1)


def _inverse_cdf(logits: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """The token whose cumulative-probability bin holds each row's uniform number."""
    cdf = torch.softmax(logits.double(), dim=-1).cumsum(-1)
    # Scale by the total so rounding can never leave u above the last bin.
    target = (uniform.to(cdf.device) * cdf[:, -1]).unsqueeze(-1)
    # right=True: the first bin whose cdf exceeds u, so a zero-probability token never wins.
    return torch.searchsorted(cdf, target, right=True).squeeze(-1).clamp(max=logits.shape[-1] - 1)


@dataclass
class _RowSettings:
    """The sampling settings of the rows still generating, as tensors (one entry per row)."""

    temperature: torch.Tensor  # 1 for greedy rows
    greedy: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    max_tokens: torch.Tensor
    stop_ids: torch.Tensor  # [rows, most stop ids of a row], -1 where a row has fewer
    generators: list[torch.Generator | None]  # by original row: never narrowed
    scale_by_temperature: bool
    all_greedy: bool
    any_greedy: bool
    needs_filter: bool

    @classmethod
    def of(cls, params: Sequence[SamplingParams], eos_token_ids: Sequence[int], device: torch.device) -> "_RowSettings":
        stop_sets = [sorted(set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_token_ids))) for p in params]
        stop_ids = torch.full((len(params), max(map(len, stop_sets))), -1, dtype=torch.long)
        for row, ids in enumerate(stop_sets):
            stop_ids[row, :len(ids)] = torch.tensor(ids, dtype=torch.long)
        greedy = [p.temperature == 0 for p in params]
        temperature = [1.0 if g else p.temperature for p, g in zip(params, greedy)]
        top_k = torch.tensor([p.top_k for p in params], device=device)
        top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device)
        return cls(
            temperature=torch.tensor(temperature, dtype=torch.float32, device=device),
            greedy=torch.tensor(greedy, device=device),
            top_k=top_k,
            top_p=top_p,
            max_tokens=torch.tensor([p.max_tokens for p in params], device=device),
            stop_ids=stop_ids.to(device),
            generators=[torch.Generator(device="cpu").manual_seed(p.seed) if p.seed is not None else None
                        for p in params],
            scale_by_temperature=any(t != 1.0 for t in temperature),  # x / 1.0 == x: skip the pass
            all_greedy=all(greedy),
            any_greedy=any(greedy),
            needs_filter=bool(((top_k > 0) | (top_p < 1)).any()),
        )

    def select(self, keep: torch.Tensor) -> "_RowSettings":
        narrowed = {name: getattr(self, name)[keep]
                    for name in ("temperature", "greedy", "top_k", "top_p", "max_tokens", "stop_ids")}
        return replace(self, **narrowed)

    def is_stop(self, chosen: torch.Tensor) -> torch.Tensor:
        if self.stop_ids.shape[1] == 0:
            return torch.zeros_like(chosen, dtype=torch.bool)
        return (self.stop_ids == chosen.unsqueeze(-1)).any(-1)
