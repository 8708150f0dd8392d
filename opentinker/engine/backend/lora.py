"""LoRA adapters (peft) on a backend's model.

Only the adapter weights train (and only they go into the optimizer); the reference policy
is the base model with the adapters disabled, so there is no second copy; weight sync and
the Hugging Face export carry merged weights ``W + scaling * B @ A``, computed on the fly:
the base weights themselves are never touched (bit-identical after training). The adapter
alone is exported too (``adapter/``, loadable with ``peft``).
"""

from __future__ import annotations

import contextlib
import re
import warnings
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from opentinker.engine.backend.spec import LoraSettings

ADAPTER = "default"
_BASE = ".base_layer."


@contextlib.contextmanager
def tied_unembed_allowed():
    """peft warns when a LoRA target (``lm_head``, Tinker's ``train_unembed``) shares its weight
    with the input embedding. Wanted here: the adapter changes the output projection only, and
    it is never merged into the shared weight (samplers apply it per row, exports carry it as
    an adapter)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*tie_word_embeddings.*", category=UserWarning)
        yield


def add_adapters(model, settings: LoraSettings):
    """``model`` wrapped by peft with fresh adapters (the base weights frozen), initialised
    from ``settings.seed`` whatever the global RNG holds."""
    from peft import get_peft_model

    with torch.random.fork_rng(devices=[]), tied_unembed_allowed():
        torch.manual_seed(settings.seed)
        return get_peft_model(model, lora_config(model, settings))


def lora_config(model, settings: LoraSettings):
    """peft's config of ``settings`` for ``model``: a vision-language model's adapters go on its
    language model only (its vision tower is left out)."""
    from opentinker.engine.vision import vision_tower

    config = settings.peft_config()
    tower = vision_tower(model)
    if tower is not None:
        config.exclude_modules = rf"{re.escape(tower[0])}(\..*)?"
    return config


@dataclass(frozen=True)
class MergeEntry:
    """One tensor of the merged model: its name, the adapted model's tensors it is made of
    (the base weight, then lora_A and lora_B for an adapted layer) and the LoRA scaling."""

    name: str
    sources: tuple[str, ...]
    scaling: float | None = None


def merge_plan(peft_model) -> list[MergeEntry]:
    """The merged model's tensors, in state-dict order, under the base model's own names."""
    base = peft_model.get_base_model()
    plan = []
    for raw in base.state_dict():
        if ".lora_" in raw:
            continue
        name = raw.replace(_BASE, ".")
        if raw.endswith(_BASE + "weight"):
            path = raw[: -len(_BASE + "weight")]
            layer = base.get_submodule(path)
            plan.append(MergeEntry(name, (raw, f"{path}.lora_A.{ADAPTER}.weight", f"{path}.lora_B.{ADAPTER}.weight"),
                                   float(layer.scaling[ADAPTER])))
        else:
            plan.append(MergeEntry(name, (raw,)))
    return plan


def merged_tensor(entry: MergeEntry, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The merged value of ``entry`` from the full source tensors (a new tensor)."""
    weight = tensors[entry.sources[0]].detach()
    if entry.scaling is None:
        return weight.clone()
    lora_a, lora_b = (tensors[source].detach() for source in entry.sources[1:])
    return weight + (lora_b @ lora_a) * entry.scaling


def merged_state_dict(peft_model) -> dict[str, torch.Tensor]:
    state = peft_model.get_base_model().state_dict()
    return {entry.name: merged_tensor(entry, state) for entry in merge_plan(peft_model)}

