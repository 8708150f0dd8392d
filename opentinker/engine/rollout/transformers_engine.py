"""Rollout with plain transformers: a batched KV-cache decode loop (the CPU default).

Why not ``model.generate``: we need each sampled token's logprob under exactly the
distribution the trainer will score (temperature-scaled, before filtering), per-request
sampling parameters inside one batch, and to drop finished rows from the cache so a
batch with a few long completions does not pay for the short ones.

Where the time goes on CPU, and what is done about it: each distinct prompt is prefilled once
(GRPO repeats every prompt n times); the KV cache is written in place instead of re-allocated
per token (:mod:`.kv_cache`); the per-step bookkeeping is a few tensor ops, with one host
sync per step. The decode loop itself is :class:`.decode_batch.DecodeBatch`, which the Tinker
sampler also drives directly to let requests join a running batch. (A hand-written decode step on the weights, skipping transformers' module
overhead, was 8-18% faster here; it was left out as a second copy of every model to keep true.)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from opentinker.engine.rollout.base import Completion, SamplingParams, WeightSource, named_tensors
from opentinker.engine.rollout.compiled_decode import CompiledDecode
from opentinker.engine.rollout.decode_batch import DecodeBatch
from opentinker.engine.rollout.slot_decode import SlotDecoder
from opentinker.engine.vision import VisionLayout

#: ``on_tokens(rows, tokens)`` of :meth:`TransformersRolloutEngine.generate`.
TokenCallback = Callable[[list[int], list[int]], None]


class TransformersRolloutEngine:
    """Generates with a Hugging Face causal LM held in this process.

    ``model`` is this engine's own copy (weights arrive through :meth:`update_weights`).
    Prompts are left-padded so every row's next token sits in the last column. A
    vision-language model's prompts may carry pictures (:class:`~..vision.ImagePrompt`).
    """

    def __init__(
        self,
        model: PreTrainedModel,
        eos_token_ids: Sequence[int],
        pad_token_id: int,
        seed: int = 0,
        max_batch_size: int = 256,
        tokenizer: PreTrainedTokenizerBase | None = None,
        compile_decode: bool = False,
        slot_decode: bool = False,
    ):
        if compile_decode and slot_decode:
            raise ValueError("TransformersRolloutEngine: compile_decode and slot_decode are two decode loops; pick one")
        if compile_decode and VisionLayout.of(model.config) is not None:
            raise ValueError("TransformersRolloutEngine: compile_decode takes text models; a vision-language model "
                             "decodes with the eager step or slot_decode")
        self.model = model.eval()
        # torch.compile'd decode steps (:mod:`.compiled_decode`); None: the eager step.
        self.compiled_decode = CompiledDecode(self.model) if compile_decode else None
        self.eos_token_ids = tuple(eos_token_ids)
        self.pad_token_id = pad_token_id
        self.max_batch_size = max_batch_size
        self.device = next(model.parameters()).device
        self._generator = torch.Generator(device="cpu").manual_seed(seed)
        self.tokenizer = tokenizer  # only to match stop strings
        # Per-row KV slots, one device-side step per token, CUDA graphs on a GPU (:mod:`.slot_decode`).
        self.slot_decoder = SlotDecoder(self, max_rows=max_batch_size) if slot_decode else None

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

    def close(self) -> None:
        """The model lives in this process and goes with it; nothing to release."""

    # -- generation ----------------------------------------------------------------
    @property
    def shared_generator(self) -> torch.Generator:
        """The random stream of rows whose request has no seed of its own."""
        return self._generator

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
        if self.slot_decoder is not None:
            return self.slot_decoder.generate(prompts, params, on_tokens)
        completions: list[Completion | None] = [None] * len(prompts)
        for start in range(0, len(prompts), self.max_batch_size):
            end = min(start + self.max_batch_size, len(prompts))
            batch = DecodeBatch.prefill(self, prompts[start:end], params[start:end], range(start, end))
            while len(batch):
                for row, completion in batch.step(on_tokens):
                    completions[row] = completion
        return completions  # type: ignore[return-value]
