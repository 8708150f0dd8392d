"""LoRA adapters applied per row of a batch, on an unchanged base model: how the Tinker sampler
decodes rows of many users' LoRA models in one forward pass.

A :class:`LoadedAdapter` is a saved peft adapter (``adapter_config.json`` +
``adapter_model.safetensors``, what ``save_weights_for_sampler`` writes for a LoRA model) as
``{module path: (A, B, scaling)}`` on the model's device. :class:`RowAdapters` puts a forward
hook on each adapted linear layer; before a forward pass, :meth:`RowAdapters.set` says which
adapter each row of the batch uses (None: the base), and each hooked layer adds
``scaling * (x @ A.T) @ B.T`` to the rows of each adapter, as peft's LoRA layer computes it.
The base weights are never written, so rows of different adapters (and of the base model)
share a batch and no weights are swapped between them.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

ADAPTER_CONFIG_FILE = "adapter_config.json"
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"


class LoadedAdapter:
    def __init__(self, folder: str | Path, device: torch.device, dtype: torch.dtype):
        from safetensors.torch import load_file

        folder = Path(folder)
        config = json.loads((folder / ADAPTER_CONFIG_FILE).read_text())
        rank, alpha = int(config["r"]), float(config["lora_alpha"])
        scaling = alpha / (rank**0.5 if config.get("use_rslora") else rank)
        tensors = load_file(folder / ADAPTER_WEIGHTS_FILE)
        self.layers: dict[str, tuple[torch.Tensor, torch.Tensor, float]] = {}
        for key, lora_a in tensors.items():
            if key.endswith(".lora_A.weight"):
                path = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
                lora_b = tensors[key.replace(".lora_A.", ".lora_B.")]
                self.layers[path] = (lora_a.to(device, dtype), lora_b.to(device, dtype), scaling)
        self.nbytes = sum(a.numel() * a.element_size() + b.numel() * b.element_size()
                          for a, b, _ in self.layers.values())


def is_adapter_folder(folder: str | Path) -> bool:
    return (Path(folder) / ADAPTER_CONFIG_FILE).is_file()


class RowAdapters:
    """Per-row LoRA on ``model`` (see the module docstring). Used by one thread at a time."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self._hooked: set[str] = set()
        # (adapter, row indices or None for every row) for the next forward pass
        self._groups: list[tuple[LoadedAdapter, torch.Tensor | None]] = []

    def set(self, adapters: Sequence[LoadedAdapter | None]) -> None:
        """The adapter of each row of the next forward passes (until the next call). Rows of
        one adapter may be any count when it is the only one (a prefill of distinct prompts)."""
        distinct = {id(a): a for a in adapters if a is not None}
        if not distinct:
            self._groups = []
            return
        for adapter in distinct.values():
            self._hook(adapter)
        if len(distinct) == 1 and all(a is not None for a in adapters):
            self._groups = [(next(iter(distinct.values())), None)]
            return
        device = next(self.model.parameters()).device
        self._groups = [(adapter, torch.tensor([row for row, a in enumerate(adapters) if a is adapter], device=device))
                        for adapter in distinct.values()]

    def clear(self) -> None:
        self._groups = []

    def _hook(self, adapter: LoadedAdapter) -> None:
        for path in adapter.layers:
            if path not in self._hooked:
                self.model.get_submodule(path).register_forward_hook(self._adding(path))
                self._hooked.add(path)

    def _adding(self, path: str):
        def hook(module: torch.nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> torch.Tensor | None:
            if not self._groups:
                return None
            x = args[0]
            for adapter, rows in self._groups:
                layer = adapter.layers.get(path)
                if layer is None:
                    continue
                lora_a, lora_b, scaling = layer
                if rows is None:
                    output = output + (x @ lora_a.T) @ lora_b.T * scaling
                else:
                    output = output.index_add(0, rows, (x[rows] @ lora_a.T) @ lora_b.T * scaling)
            return output

        return hook
