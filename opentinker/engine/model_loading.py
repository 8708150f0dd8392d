"""Load a causal LM (or a vision-language model, which is one with pictures in its prompts) and its
tokenizer from a local folder or a hub name, with clear errors."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from transformers import (
    AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer, PreTrainedModel,
    PreTrainedTokenizerBase,
)

if TYPE_CHECKING:
    from opentinker.engine.backend.spec import BackendSpec


class ModelLoadError(ValueError):
    """The model path or name cannot be loaded; the message says which and why."""


def resolve_model_path(path: str | None) -> str:
    """The Hugging Face folder (or hub name) to load: ``None`` is the embedded tiny model (the
    folder shipped in the package), a preset name (``smollm2-135m-instruct``) or a ``.gguf``
    file is converted once into a folder in the cache (:mod:`opentinker.pretrained`)."""
    if path is None:
        from opentinker.tiny import ensure_tiny_model

        return str(ensure_tiny_model())
    from opentinker.tiny_vlm import TINY_VLM_PRESET, ensure_tiny_vlm

    if path == TINY_VLM_PRESET:
        return str(ensure_tiny_vlm())
    from opentinker.pretrained import PretrainedModelError
    from opentinker.pretrained.convert import converted_folder

    try:
        converted = converted_folder(str(path))
    except PretrainedModelError as error:
        raise ModelLoadError(f"actor_rollout_ref.model.path: {error}") from error
    if converted is not None:
        return str(converted)
    expanded = os.path.expanduser(str(path))
    looks_local = expanded.startswith((".", "/", "~")) or os.sep in expanded and os.path.exists(
        expanded.split(os.sep)[0]
    )
    if looks_local and not Path(expanded).exists():
        raise ModelLoadError(
            f"actor_rollout_ref.model.path: the folder '{path}' does not exist "
            "(give a local Hugging Face model folder, a .gguf file, a preset such as 'smollm2-135m-instruct', "
            "a hub name such as 'Qwen/Qwen2.5-0.5B-Instruct', 'tiny-vlm' for the embedded tiny vision-language model, "
            "or leave it unset for the embedded tiny model)"
        )
    if Path(expanded).exists() and not (Path(expanded) / "config.json").exists():
        raise ModelLoadError(f"actor_rollout_ref.model.path: '{path}' has no config.json, so it is not a model folder")
    return expanded


def resolved_spec(spec: BackendSpec) -> BackendSpec:
    """``spec`` with its model folder resolved and, where it names none, its tokenizer's pad id:
    what a spec built without torch (the Tinker API's) leaves to the process that loads the model."""
    path = resolve_model_path(spec.model_path)
    pad = spec.pad_token_id
    if pad is None:
        pad = load_tokenizer(path, trust_remote_code=spec.trust_remote_code).pad_token_id
    return replace(spec, model_path=path, pad_token_id=pad)


def load_tokenizer(path: str, trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except OSError as error:
        raise ModelLoadError(f"cannot load a tokenizer from '{path}': {error}") from error
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_causal_lm(
    path: str,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    trust_remote_code: bool = False,
) -> PreTrainedModel:
    try:
        auto = AutoModelForImageTextToText if is_vision_language(path, trust_remote_code) else AutoModelForCausalLM
        model = auto.from_pretrained(path, dtype=dtype, trust_remote_code=trust_remote_code)
    except OSError as error:
        raise ModelLoadError(
            f"cannot load a model from '{path}': {error}. A hub name needs network access or a "
            "local copy in the Hugging Face cache."
        ) from error
    return model.to(device)


def is_vision_language(path: str, trust_remote_code: bool = False) -> bool:
    """Whether the model folder ``path`` holds a vision-language model (its config has a vision
    tower and an image token)."""
    from opentinker.engine.vision import VisionLayout

    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except OSError:
        return False  # the model load that follows says why
    return VisionLayout.of(config) is not None


def enable_gradient_checkpointing(model: PreTrainedModel) -> None:
    """Recompute activations in backward instead of keeping them (and no KV cache in training)."""
    # transformers 5 renamed gradient_checkpointing_enable; accept either.
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable()
    model.config.use_cache = False


def pick_device(requested: str = "auto") -> torch.device:
    if requested == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError("trainer.device=cuda but no CUDA device is available")
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(requested)


def eos_token_ids(tokenizer: PreTrainedTokenizerBase, model_path: str) -> list[int]:
    """Every id that ends an assistant turn: the tokenizer's eos and the generation config's."""
    from transformers import GenerationConfig

    ids: set[int] = set()
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    try:
        generation_eos = GenerationConfig.from_pretrained(model_path).eos_token_id
    except OSError:  # no generation_config.json: the tokenizer's eos is all there is
        generation_eos = None
    if isinstance(generation_eos, int):
        ids.add(generation_eos)
    elif generation_eos:
        ids.update(generation_eos)
    return sorted(ids)
