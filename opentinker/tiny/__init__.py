"""The embedded tiny model: the default model of the project, built by the project offline.

An ordinary Hugging Face folder (``AutoModelForCausalLM`` / ``AutoTokenizer`` load it) holding

* a byte-level BPE tokenizer (vocab 1536) trained on a synthetic corpus generated in code
  (:mod:`.corpus`: arithmetic chats from :mod:`opentinker.environments.arithmetic`,
  guess-the-number dialogues, calculator tool calls, GSM8K-style answers and English from fixed
  word lists). It uses Qwen2's normalizer and pre-tokenizer, because ``AutoTokenizer`` loads any
  qwen2 folder as ``Qwen2Tokenizer`` and rebuilds them; that pre-tokenizer splits digits one per
  token, which is what makes addition learnable. ``<|im_start|>``/``<|im_end|>`` frame chat
  turns (Qwen-style template), ``<|im_end|>`` is the eos token and ``<|endoftext|>`` the pad;
* a ~1.9M-parameter Qwen2 causal LM, seeded and SFT-warmed on "What is a + b?" (:mod:`.sft`)
  until it answers a good part of held-out problems right (far from all: GRPO has room).

The SFT-warmed folder ships in the package (``model/``, 7.7 MB), so every machine trains from
the same bytes; :mod:`.build` rebuilds it (``python -m opentinker.tiny --rebuild``). A build
repeats itself byte for byte on one machine (fixed seeds, threads, deterministic kernels), not
across CPUs. The base model (random init, ``warm=False``) is built into the cache on demand.
"""

from opentinker.tiny.folder import (
    SHIPPED_DIR, cache_build_dir, default_cache_dir, ensure_tiny_model, read_tiny_report, tiny_model_dir,
)
from opentinker.tiny.recipe import (
    CHAT_TEMPLATE, DEFAULT_RECIPE, REPORT_FILE, SPECIAL_TOKENS, TINY_MODEL_NAME, TINY_MODEL_VERSION, TinyRecipe,
)

__all__ = ["CHAT_TEMPLATE", "DEFAULT_RECIPE", "REPORT_FILE", "SHIPPED_DIR", "SPECIAL_TOKENS", "TINY_MODEL_NAME",
           "TINY_MODEL_VERSION", "TinyRecipe", "cache_build_dir", "default_cache_dir", "ensure_tiny_model",
           "read_tiny_report", "tiny_model_dir"]
