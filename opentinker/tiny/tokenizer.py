"""The tokenizer (a byte-level BPE with Qwen2's pipeline), the model's config, and the
settings that make a build repeat itself on one machine."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

from opentinker.tiny.corpus import tokenizer_corpus
from opentinker.tiny.recipe import (
    CHAT_TEMPLATE, DEFAULT_RECIPE, ENDOFTEXT, IM_END, SPECIAL_TOKENS, TinyRecipe,
)

# Qwen2's pre-tokenizer regex (transformers' ``Qwen2Tokenizer``). Its ``\p{N}`` alternative
# isolates every digit, so numbers are always split one digit per token.
QWEN2_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
    r"""\s*[\r\n]+|\s+(?!\S)|\s+"""
)


def _qwen2_pipeline(backend) -> None:
    """Normalizer, pre-tokenizer and decoder exactly as ``Qwen2Tokenizer`` builds them.

    ``AutoTokenizer`` always loads a ``model_type == "qwen2"`` folder as ``Qwen2Tokenizer``, which
    rebuilds this pipeline around the saved vocab and merges (ignoring the one in tokenizer.json).
    Training the BPE with that very pipeline keeps the saved file, the in-process tokenizer and
    what ``AutoTokenizer`` returns identical. (NFC normalization means text round-trips exactly
    when it is NFC, as nearly all text is.)
    """
    from tokenizers import Regex, decoders, normalizers, pre_tokenizers

    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()


def build_tokenizer(vocab_size: int = DEFAULT_RECIPE.vocab_size):
    """A byte-level BPE trained on :func:`tokenizer_corpus`, as a ``PreTrainedTokenizerFast``.

    ``<|endoftext|>`` (id 0, pad), ``<|im_start|>`` (1) and ``<|im_end|>`` (2, eos) are special
    tokens; the chat template is :data:`CHAT_TEMPLATE`.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    _qwen2_pipeline(backend)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(tokenizer_corpus(), trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        unk_token=None,
        bos_token=None,
        clean_up_tokenization_spaces=False,
        model_max_length=DEFAULT_RECIPE.max_position_embeddings,
        padding_side="right",
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


# --------------------------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------------------------


def _save_and_reload_tokenizer(tokenizer, config, out: Path):
    """Save, then load back with ``AutoTokenizer`` next to ``config``: the SFT then runs with
    exactly the tokenizer class (``Qwen2Tokenizer``) that users of the folder get."""
    from transformers import AutoTokenizer

    tokenizer.save_pretrained(out)
    # Name the class AutoTokenizer picks anyway for a qwen2 folder, so the file says what loads.
    tokenizer_config = out / "tokenizer_config.json"
    fields = json.loads(tokenizer_config.read_text())
    fields["tokenizer_class"] = "Qwen2Tokenizer"
    tokenizer_config.write_text(json.dumps(fields, indent=2, sort_keys=True) + "\n")
    config.save_pretrained(out)
    return AutoTokenizer.from_pretrained(out)


def make_config(tokenizer, recipe: TinyRecipe = DEFAULT_RECIPE):
    from transformers import Qwen2Config

    pad_id = tokenizer.convert_tokens_to_ids(ENDOFTEXT)
    eos_id = tokenizer.convert_tokens_to_ids(IM_END)
    return Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=recipe.hidden_size,
        intermediate_size=recipe.intermediate_size,
        num_hidden_layers=recipe.num_hidden_layers,
        num_attention_heads=recipe.num_attention_heads,
        num_key_value_heads=recipe.num_key_value_heads,
        max_position_embeddings=recipe.max_position_embeddings,
        rope_theta=recipe.rope_theta,
        tie_word_embeddings=True,
        use_cache=True,
        bos_token_id=pad_id,  # as Qwen2: <|endoftext|> doubles as bos; the tokenizer adds none
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        dtype="float32",
    )


@contextlib.contextmanager
def _deterministic_torch(threads: int, seed: int) -> Iterator[None]:
    """Fixed threads, deterministic kernels and a forked RNG; the caller's state comes back after."""
    import torch

    old_threads = torch.get_num_threads()
    old_deterministic = torch.are_deterministic_algorithms_enabled()
    old_warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(True)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            yield
    finally:
        torch.set_num_threads(old_threads)
        torch.use_deterministic_algorithms(old_deterministic, warn_only=old_warn_only)


@contextlib.contextmanager
def _quiet_transformers_progress() -> Iterator[None]:
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()
