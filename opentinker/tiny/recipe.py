"""What determines the tiny model: its name and version, the chat format and the build recipe."""

from __future__ import annotations

from dataclasses import dataclass

# Problems that decide when SFT stops: train split, a seed of their own (the arithmetic module's
# seeds are 1-3), so neither the SFT stream nor the held-out evaluation is reused.
VALIDATION_SEED = 4

TINY_MODEL_NAME = "opentinker-tiny-arith"
# Part of the cache folder name: bump it whenever the recipe (corpus, tokenizer, model, SFT)
# changes, so that an old cached build is never mistaken for the new one.
TINY_MODEL_VERSION = "v1"
REPORT_FILE = "opentinker_tiny.json"

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)

# Qwen-style ChatML. All text sits inside {{ }} because transformers renders templates with
# trim_blocks/lstrip_blocks. The {% generation %} block marks what an assistant turn produces
# (content + <|im_end|>), so ``return_assistant_tokens_mask=True`` works.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- set content = message['content'] if message['content'] is not none else '' -%}"
    "{%- if message['role'] == 'assistant' -%}"
    "{{ '<|im_start|>assistant\\n' }}"
    "{%- generation -%}{{ content + '<|im_end|>' }}{%- endgeneration -%}"
    "{{ '\\n' }}"
    "{%- else -%}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + content + '<|im_end|>\\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)


@dataclass(frozen=True)
class TinyRecipe:
    """Everything that determines the built folder (together with ``seed``)."""

    vocab_size: int = 1536
    hidden_size: int = 192
    intermediate_size: int = 512
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 1024
    rope_theta: float = 10000.0
    # SFT warm-up on arithmetic (loss on the answer and <|im_end|> only) ...
    sft_steps: int = 1000  # at most; see stop_at_accuracy
    batch_size: int = 64
    learning_rate: float = 1e-3
    warmup_steps: int = 50
    weight_decay: float = 0.01
    # SFT stops as soon as greedy accuracy on ``stop_check_problems`` validation problems (train
    # split, their own seed) reaches ``stop_at_accuracy``: learning addition goes from ~5% to ~90%
    # within a few dozen steps, and stopping on a measurement (rather than at a fixed step) lands
    # in the middle of that jump on any CPU. Checks start once the running loss is below
    # ``stop_check_below_loss`` and then run every ``stop_check_every`` steps.
    stop_at_accuracy: float = 0.4
    stop_check_problems: int = 100
    stop_check_every: int = 10
    stop_check_below_loss: float = 1.0
    # ... with a small language-model batch of English chats every ``english_every`` steps.
    english_every: int = 4
    english_batch_size: int = 16
    threads: int = 2
    eval_problems: int = 200


DEFAULT_RECIPE = TinyRecipe()
