"""A value model (PPO's critic) from a causal LM: its LM head replaced by one output per position.

verl builds its critic as ``AutoModelForTokenClassification(num_labels=1)``; the same thing here
keeps the causal LM class (``lm_head`` becomes ``Linear(hidden, 1)``), so everything that runs
a causal LM runs a value model unchanged: the scorer's ``logits_to_keep`` and shared-prompt KV
cache, FSDP's layer sharding, peft (the head trains as a ``modules_to_save`` copy under LoRA).
The value of response token t is the output at the position that predicts it (the state
before the model wrote it), as verl's critic reads it.
"""

from __future__ import annotations

import torch

HEAD = "lm_head"


def attach_value_head(model, seed: int) -> None:
    """Replaces ``model.lm_head`` with a fresh ``Linear(hidden, 1)`` (no bias), initialised
    from ``seed`` (normal, std = the model's ``initializer_range``) whatever the global RNG
    holds; unties it from the embeddings."""
    hidden = model.get_input_embeddings().weight.shape[1]
    device = model.get_input_embeddings().weight.device
    head = torch.nn.Linear(hidden, 1, bias=False, device=device, dtype=torch.float32)
    if device.type != "meta":
        generator = torch.Generator().manual_seed(seed)
        std = float(getattr(model.config, "initializer_range", 0.02))
        with torch.no_grad():
            head.weight.copy_(torch.randn(head.weight.shape, generator=generator) * std)
    setattr(model, HEAD, head)
    model.config.tie_word_embeddings = False
    model.config.vocab_size_of_head = 1  # a marker for readers of the config; HF ignores it
