"""Models of real shapes with random weights, built from a config in code (a GPU node reaches no hub)."""

from __future__ import annotations

import tempfile

import torch


def qwen25_05b_folder() -> str:
    """A randomly initialised model of Qwen2.5-0.5B's shape, saved with the tiny tokenizer."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    from opentinker.engine.model_loading import load_tokenizer
    from opentinker.tiny import ensure_tiny_model

    tokenizer = load_tokenizer(str(ensure_tiny_model()))
    config = Qwen2Config(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, vocab_size=151936, max_position_embeddings=4096,
                         tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id or 0,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    folder = tempfile.mkdtemp(prefix="qwen25-05b-random-")
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
