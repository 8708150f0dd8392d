"""What determines the tiny VLM: its name and version, its chat format and its build recipe."""

from __future__ import annotations

from dataclasses import dataclass

TINY_VLM_NAME = "opentinker-tiny-vlm-digits"
# Part of the cache folder name: bump it whenever the recipe (model, data, SFT) changes.
TINY_VLM_VERSION = "v1"
REPORT_FILE = "opentinker_tiny_vlm.json"

VIDEO_PAD = "<|video_pad|>"  # Qwen2-VL's config names a video token; this model never sees one

# The text model's ChatML (opentinker.tiny.recipe.CHAT_TEMPLATE) where a message's content may
# also be a list of parts: text parts are their text, each image part (HF-style {"type":
# "image"} or OpenAI-style {"type": "image_url"}) one <|vision_start|><|image_pad|><|vision_end|>
# that the engine widens to the picture's token count.
CHAT_TEMPLATE = (
    "{%- macro render(content) -%}"
    "{%- if content is none -%}{{ '' }}"
    "{%- elif content is string -%}{{ content }}"
    "{%- else -%}{%- for part in content -%}"
    "{%- if part['type'] in ('image', 'image_url') -%}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif part['type'] == 'text' -%}{{ part['text'] }}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{%- endmacro -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'assistant' -%}"
    "{{ '<|im_start|>assistant\\n' }}"
    "{%- generation -%}{{ render(message['content']) + '<|im_end|>' }}{%- endgeneration -%}"
    "{{ '\\n' }}"
    "{%- else -%}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + render(message['content']) + '<|im_end|>\\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)


@dataclass(frozen=True)
class TinyVlmRecipe:
    """Everything that determines the built folder (with ``seed``). The language model is the
    shipped tiny text model's (it already adds numbers); the vision tower is new."""

    # Qwen2-VL vision tower: 14-pixel patches, 2 x 2 merged, so a 56 x 112 picture is 8 tokens.
    vision_depth: int = 2
    vision_embed_dim: int = 96
    vision_heads: int = 4
    vision_mlp_ratio: int = 2
    patch_size: int = 14
    merge_size: int = 2
    temporal_patch_size: int = 2
    mrope_section: tuple[int, int, int] = (8, 8, 8)  # of the text head's 24 rotary frequencies
    min_pixels: int = 56 * 56
    max_pixels: int = 56 * 56 * 16  # the processor shrinks larger pictures to at most 64 tokens
    # The vision warm-up: the vision tower alone learns to turn each digit into the language
    # model's embedding of that digit's token (build.py: _align_vision).
    align_steps: int = 400
    # SFT: pictures of two digits, half asked for their sum and half for the digits themselves
    # (a direct signal for the vision tower), with a text-arithmetic batch every
    # ``arithmetic_every`` steps so the language model keeps adding.
    sft_steps: int = 3000  # at most; see stop_at_accuracy
    batch_size: int = 64
    learning_rate: float = 1e-3
    warmup_steps: int = 50
    weight_decay: float = 0.01
    arithmetic_every: int = 4
    # SFT stops as soon as greedy accuracy on ``stop_check_problems`` validation pictures (their
    # own seed) reaches ``stop_at_accuracy``: some skill, and room for RL.
    stop_at_accuracy: float = 0.4
    stop_check_problems: int = 100
    stop_check_every: int = 25
    threads: int = 2
    eval_problems: int = 200


DEFAULT_RECIPE = TinyVlmRecipe()
