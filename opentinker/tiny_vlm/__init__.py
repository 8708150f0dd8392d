"""The embedded tiny vision-language model, built by the project offline like the text one.

A Hugging Face folder (``AutoModelForImageTextToText`` loads it) holding transformers' own
Qwen2-VL architecture at a tiny size: the embedded tiny text model (:mod:`opentinker.tiny`) as
its language model, with Qwen2-VL's vision tokens added to its tokenizer and a chat template that
renders image parts, and a new 0.48M-parameter vision tower (14-pixel patches merged 2 x 2: a
56 x 112 picture is 8 tokens); 2.4M parameters in all. Its image processor
(``preprocessor_config.json``) is Qwen2-VL's Pillow-based one, so no torchvision is needed.

Warmed in two stages on pictures of two digits (:mod:`opentinker.environments.digit_sum`): the
vision tower alone learns to turn each digit into the language model's embedding of that digit's
token (400 steps; it then reads every digit of a batch right), then the whole model is SFT-ed
on "what is the sum of the two digits?" and "what are the two digits?" until it answers half of
held-out sum questions right (0.53 of 200), leaving RL room; text arithmetic stays where the text
model was (0.535). The build takes about 70 s on 2 cores. The folder ships in the package
(``model/``, 9.7 MB); ``python -m opentinker.tiny_vlm --rebuild`` builds it again, byte for byte
on one machine.
"""

from opentinker.tiny_vlm.folder import SHIPPED_DIR, ensure_tiny_vlm, read_tiny_vlm_report
from opentinker.tiny_vlm.recipe import DEFAULT_RECIPE, REPORT_FILE, TINY_VLM_NAME, TINY_VLM_VERSION, TinyVlmRecipe

#: The name that picks this model wherever a model path is asked for (``actor_rollout_ref.model.path``).
TINY_VLM_PRESET = "tiny-vlm"

__all__ = ["DEFAULT_RECIPE", "REPORT_FILE", "SHIPPED_DIR", "TINY_VLM_NAME", "TINY_VLM_PRESET", "TINY_VLM_VERSION",
           "TinyVlmRecipe", "ensure_tiny_vlm", "read_tiny_vlm_report"]
