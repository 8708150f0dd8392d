"""A strategy judge that runs a local Hugging Face causal LM (a dedicated judge model, or the
policy model itself) on the same prompt as the API judge.

Each group that needs a model becomes one chat prompt (the tokenizer's chat template, with the
system message folded into the user message when the template rejects a system role; a plain
text layout when the tokenizer has no template). Prompts are left-padded into batches of
``batch_size`` and decoded greedily with ``model.generate``; each answer is parsed with
:func:`parse_judgement`. Greedy decoding is deterministic, so an invalid answer is not retried:
that group comes back as ``None`` (the trainer falls back to weight 1). torch and transformers
are imported when a judge is built, never when this module is imported.

A small model often fails to produce a valid grouping: watch ``judge/fallback_groups``. Budget
``max_new_tokens`` at roughly 20 tokens per strategy group plus its description. On a busy CPU
machine, torch's intra-op threads can make token-by-token decoding of a small model very slow;
``torch.set_num_threads`` is process-wide and left to the caller.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from typing import Any

from opentinker.creativity.base import DedupedGroup, Group, JudgeConfigError, JudgeMetrics, JudgementCache, cache_key
from opentinker.creativity.prompt import PROMPT_VERSION, JudgementError, build_messages, parse_judgement

logger = logging.getLogger(__name__)


class HFStrategyJudge:
    """Strategy labels from a local causal LM.

    Args:
        model: a model folder or hub name (loaded with ``AutoModelForCausalLM``), or a loaded
            ``PreTrainedModel`` (e.g. the policy model, unwrapped; it is put in eval mode during
            generation and back in train mode afterwards if it was training).
        tokenizer: required with a model object; loaded from ``model`` when that is a path.
        max_new_tokens: answer length limit.
        batch_size: groups per ``generate`` call.
        device: where a model loaded from a path goes (default: cuda if available, else cpu).
            A model object stays where it is.
        dtype: dtype for a model loaded from a path (default: the checkpoint's).
        max_prompt_tokens: longer prompts are not run (that group fails). Default: the model's
            ``max_position_embeddings`` minus ``max_new_tokens``, when the config has it.
        max_response_chars: each response is cut to about this many characters in the prompt.
        cache: remember valid judgements in memory (only sensible for a frozen judge model,
            not for the policy model whose weights change).
        trust_remote_code: passed to ``from_pretrained``.
        generate_kwargs: extra keyword arguments for ``model.generate`` (they may override the
            defaults ``do_sample=False``, ``use_cache=True``, ``max_new_tokens``, ``pad_token_id``,
            ``eos_token_id``).

    ``judge/calls`` counts ``generate`` calls (one per batch); ``judge/prompt_tokens`` and
    ``judge/completion_tokens`` count real (unpadded) prompt tokens and generated tokens up to
    the first end-of-turn token. ``last_raw_outputs`` holds the decoded answers of the last call.
    """

    metric_keys = (
        "groups", "calls", "failures", "invalid_outputs", "prompt_too_long", "fallback_groups",
        "cache_hits", "skipped_groups", "prompt_tokens", "completion_tokens",
    )

    def __init__(
        self,
        model: Any,
        tokenizer: Any = None,
        *,
        max_new_tokens: int = 512,
        batch_size: int = 8,
        device: str | None = None,
        dtype: Any = None,
        max_prompt_tokens: int | None = None,
        max_response_chars: int | None = 2000,
        cache: bool = False,
        trust_remote_code: bool = False,
        generate_kwargs: dict[str, Any] | None = None,
    ):
        try:
            import torch
            from transformers import AutoModelForCausalLM, AutoTokenizer
        except ImportError as error:
            raise ImportError(
                "the 'hf' strategy judge needs torch and transformers: pip install 'opentinker[server]'"
            ) from error
        if max_new_tokens < 1:
            raise JudgeConfigError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if batch_size < 1:
            raise JudgeConfigError(f"batch_size must be >= 1, got {batch_size}")
        if model is None:
            raise JudgeConfigError("the 'hf' strategy judge needs model=<folder, hub name or loaded model>")
        self._torch = torch
        if isinstance(model, (str, os.PathLike)):
            name = os.fspath(model)
            try:
                loaded_tokenizer = tokenizer or AutoTokenizer.from_pretrained(name, trust_remote_code=trust_remote_code)
                loaded_model = AutoModelForCausalLM.from_pretrained(
                    name, dtype=dtype if dtype is not None else "auto", trust_remote_code=trust_remote_code
                )
            except OSError as error:
                raise JudgeConfigError(f"cannot load the judge model '{name}': {error}") from error
            target = device or ("cuda" if torch.cuda.is_available() else "cpu")
            self.model = loaded_model.to(target).eval()
            self.tokenizer = loaded_tokenizer
            self.model_name = name
        else:
            if tokenizer is None:
                raise JudgeConfigError(
                    "the 'hf' strategy judge needs tokenizer=... when model is a loaded model object"
                )
            if not hasattr(model, "generate"):
                raise JudgeConfigError(
                    f"model must be a Hugging Face causal LM with .generate(), got {type(model).__name__}"
                )
            self.model = model
            self.tokenizer = tokenizer
            self.model_name = str(getattr(getattr(model, "config", None), "name_or_path", "") or type(model).__name__)
        self.max_new_tokens = int(max_new_tokens)
        self.batch_size = int(batch_size)
        self.max_response_chars = max_response_chars
        if max_prompt_tokens is None:
            positions = getattr(getattr(self.model, "config", None), "max_position_embeddings", None)
            if isinstance(positions, int) and positions > self.max_new_tokens:
                max_prompt_tokens = positions - self.max_new_tokens
        self.max_prompt_tokens = max_prompt_tokens
        self.generate_kwargs = dict(generate_kwargs or {})
        self._cache = JudgementCache() if cache else None
        self._metrics = JudgeMetrics(self.metric_keys)
        self.last_raw_outputs: list[str] = []

    def __repr__(self) -> str:
        return f"HFStrategyJudge(model={self.model_name!r})"

    # ------------------------------------------------------------------ prompt

    def build_prompt(self, question: str, responses: Sequence[str]) -> str:
        """The text the model continues: the judge messages through the chat template."""
        messages = build_messages(question, responses, max_response_chars=self.max_response_chars)
        if not getattr(self.tokenizer, "chat_template", None):
            return f"{messages[0]['content']}\n\n{messages[1]['content']}\n\nAnswer:\n"
        try:
            return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception:  # noqa: BLE001 - templates raise TemplateError etc. for a system role
            merged = [{"role": "user", "content": f"{messages[0]['content']}\n\n{messages[1]['content']}"}]
            return self.tokenizer.apply_chat_template(merged, tokenize=False, add_generation_prompt=True)

    # ------------------------------------------------------------------ public API

    def label_groups(self, groups: Sequence[Group]) -> list[list[str] | None]:
        deduped = [DedupedGroup.of(question, responses) for question, responses in groups]
        results: list[list[str] | None] = [None] * len(deduped)
        work: list[tuple[int, str | None, list[int]]] = []  # (group index, cache key, prompt ids)
        for index, group in enumerate(deduped):
            self._metrics.add("groups")
            trivial = group.trivial_labels
            if trivial is not None:
                results[index] = trivial
                self._metrics.add("skipped_groups")
                continue
            key = None
            if self._cache is not None:
                key = cache_key(
                    self.model_name, PROMPT_VERSION, self.max_response_chars, group.question, list(group.unique)
                )
                cached = self._cache.get(key)
                if cached is not None and len(cached) == len(group.unique):
                    results[index] = group.expand(cached)
                    self._metrics.add("cache_hits")
                    continue
            ids = self._encode(self.build_prompt(group.question, group.unique))
            if self.max_prompt_tokens is not None and len(ids) > self.max_prompt_tokens:
                logger.warning(
                    "strategy judge prompt has %d tokens, more than max_prompt_tokens=%d; group not judged",
                    len(ids), self.max_prompt_tokens,
                )
                self._metrics.add("failures")
                self._metrics.add("prompt_too_long")
                self._metrics.add("fallback_groups")
                continue
            work.append((index, key, ids))
        self.last_raw_outputs = []
        for start in range(0, len(work), self.batch_size):
            batch = work[start : start + self.batch_size]
            outputs = self._generate([ids for _index, _key, ids in batch])
            self.last_raw_outputs.extend(outputs)
            for (index, key, _ids), text in zip(batch, outputs):
                group = deduped[index]
                try:
                    unique_labels = parse_judgement(text, len(group.unique))
                except JudgementError as error:
                    logger.warning("strategy judge answer is no valid grouping: %s", error)
                    self._metrics.add("failures")
                    self._metrics.add("invalid_outputs")
                    self._metrics.add("fallback_groups")
                    continue
                results[index] = group.expand(unique_labels)
                if self._cache is not None and key is not None:
                    self._cache.put(key, unique_labels)
        return results

    def pop_metrics(self) -> dict[str, float]:
        return self._metrics.pop()

    # ------------------------------------------------------------------ generation

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _stop_ids(self) -> list[int]:
        ids: set[int] = set()
        if self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        configured = getattr(getattr(self.model, "generation_config", None), "eos_token_id", None)
        if isinstance(configured, int):
            ids.add(configured)
        elif configured:
            ids.update(int(value) for value in configured)
        return sorted(ids)

    def _generate(self, prompts: list[list[int]]) -> list[str]:
        """Greedy answers (decoded, special tokens skipped) to left-padded ``prompts``."""
        torch = self._torch
        stop_ids = self._stop_ids()
        pad_id = self.tokenizer.pad_token_id
        if pad_id is None:
            pad_id = stop_ids[0] if stop_ids else 0
        width = max(len(ids) for ids in prompts)
        input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
        attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, ids in enumerate(prompts):
            input_ids[row, width - len(ids):] = torch.tensor(ids, dtype=torch.long)
            attention_mask[row, width - len(ids):] = 1
        device = next(self.model.parameters()).device
        options: dict[str, Any] = {
            "max_new_tokens": self.max_new_tokens,
            "do_sample": False,
            "use_cache": True,  # a policy model may have use_cache=False in its config (training)
            "temperature": None,
            "top_p": None,
            "top_k": None,
            "pad_token_id": pad_id,
            "eos_token_id": stop_ids or None,
        }
        options.update(self.generate_kwargs)
        was_training = bool(getattr(self.model, "training", False))
        self.model.eval()
        started = time.perf_counter()
        try:
            with torch.inference_mode():
                output = self.model.generate(
                    input_ids=input_ids.to(device), attention_mask=attention_mask.to(device), **options
                )
        finally:
            if was_training:
                self.model.train()
            self._metrics.add("calls")
            self._metrics.add_latency(time.perf_counter() - started)
        sequences = output.sequences if hasattr(output, "sequences") else output
        new_tokens = sequences[:, width:].tolist()
        self._metrics.add("prompt_tokens", sum(len(ids) for ids in prompts))
        texts = []
        stops = set(stop_ids)
        for tokens in new_tokens:
            end = next((position + 1 for position, token in enumerate(tokens) if token in stops), len(tokens))
            self._metrics.add("completion_tokens", end)
            texts.append(self.tokenizer.decode(tokens[:end], skip_special_tokens=True))
        return texts
