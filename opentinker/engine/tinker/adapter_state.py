"""One LoRA model of the shared adapter worker (:class:`Adapter`: its peft adapter's name, its
optimizer, RNG and step) and its state on disk: checkpoints in the backends' state-file format
under a model-of-its-own's tensor names (so a model of its own loads them, and the other way
round), the adapter alone for samplers (a peft folder), and the offload file of an adapter
waiting off the device."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from opentinker.engine.backend.base import adamw_from_state, read_state_file, write_state_file
from opentinker.engine.backend.lora import ADAPTER, LoraSettings
from opentinker.engine.tinker.row_adapters import ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE

__all__ = ["Adapter", "offload", "read_adapter_state", "reload", "write_adapter_state", "write_sampler_adapter"]


@dataclass
class Adapter:
    model_id: str
    name: str  # the peft adapter's name in the shared model
    settings: LoraSettings
    optimizer: torch.optim.AdamW | None = None
    step: int = 0
    rng: torch.Tensor | None = None  # this model's own RNG state (saved with its checkpoints)
    offloaded: Path | None = None  # where its state waits while not resident
    named: list[tuple[str, torch.nn.Parameter]] = field(default_factory=list)  # its tensors while attached

    def parameters(self) -> list[torch.nn.Parameter]:
        return [p for _, p in self.named]


def write_adapter_state(adapter: Adapter, path: str) -> None:
    """The adapter, optimizer, RNG and step in ``path/backend_state.pt``."""
    weights = {name: p.detach().cpu() for name, p in adapter.named}
    write_state_file(path, strip_names(weights, adapter.name), adapter.optimizer and adapter.optimizer.state_dict(),
                     adapter.rng, adapter.step)


def read_adapter_state(adapter: Adapter, path: str, with_optimizer: bool) -> None:
    """What :func:`write_adapter_state` (or a LoRA model of its own) saved, into ``adapter``;
    ValueError when it does not fit (another rank or other targets)."""
    state = read_state_file(path)
    weights = named_for(state["model"], adapter.name)
    named = dict(adapter.named)
    if set(weights) != set(named):
        raise ValueError(f"{path}: the saved state does not fit this model (a different LoRA rank or targets)")
    with torch.no_grad():
        for name, parameter in named.items():
            if parameter.shape != weights[name].shape:
                raise ValueError(f"{path}: {name} has shape {tuple(weights[name].shape)}, this model's "
                                 f"{tuple(parameter.shape)}")
            parameter.copy_(weights[name])
            parameter.grad = None
    adapter.optimizer = None
    if with_optimizer and state["optimizer"] is not None:
        adapter.optimizer = adamw_from_state(list(named.values()), state["optimizer"])
    if state.get("rng") is not None:
        adapter.rng = state["rng"]
    adapter.step = int(state["step"])


def write_sampler_adapter(adapter: Adapter, path: str) -> int:
    """The adapter alone as a peft folder (``adapter_model.safetensors`` and
    ``adapter_config.json``); returns its size in bytes."""
    from safetensors.torch import save_file

    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    marker = f".{adapter.name}."
    tensors = {name.replace(marker, "."): p.detach().cpu().contiguous() for name, p in adapter.named}
    save_file(tensors, folder / ADAPTER_WEIGHTS_FILE)
    config = adapter.settings.peft_config().to_dict()
    config["target_modules"] = sorted(config["target_modules"]) if isinstance(
        config["target_modules"], (set, list)) else config["target_modules"]
    (folder / ADAPTER_CONFIG_FILE).write_text(json.dumps(config, default=str, indent=1))
    return sum(f.stat().st_size for f in folder.iterdir() if f.is_file())


def offload(adapter: Adapter, target: Path) -> None:
    """The adapter's weights, gradients and optimizer state into ``target`` (the caller then
    detaches it from the model)."""
    named = adapter.named
    state = {"params": {name: p.detach().cpu() for name, p in named},
             "grads": {name: p.grad.cpu() for name, p in named if p.grad is not None},
             "optimizer": None if adapter.optimizer is None else adapter.optimizer.state_dict()}
    torch.save(strip_names(state, adapter.name), target)
    adapter.offloaded = target


def reload(adapter: Adapter) -> None:
    """Back from its offload file, into the freshly attached adapter (``adapter.named``)."""
    assert adapter.offloaded is not None
    state = named_for(torch.load(adapter.offloaded, map_location="cpu", weights_only=True), adapter.name)
    with torch.no_grad():
        for name, parameter in adapter.named:
            parameter.copy_(state["params"][name])
            grad = state["grads"].get(name)
            parameter.grad = None if grad is None else grad.to(parameter.device)
    if state["optimizer"] is not None:
        adapter.optimizer = adamw_from_state(adapter.parameters(), state["optimizer"])
    adapter.offloaded.unlink(missing_ok=True)
    adapter.offloaded = None


def strip_names(state: Any, name: str) -> Any:
    """Tensor names of adapter ``name`` as a model of its own names them (peft's ``default``)."""
    if isinstance(state, dict):
        return {(key.replace(f".{name}.", f".{ADAPTER}.") if isinstance(key, str) else key): strip_names(value, name)
                for key, value in state.items()}
    return state


def named_for(state: Any, name: str) -> Any:
    """The other way: a model of its own's names as adapter ``name``'s."""
    if isinstance(state, dict):
        return {(key.replace(f".{ADAPTER}.", f".{name}.") if isinstance(key, str) else key): named_for(value, name)
                for key, value in state.items()}
    return state
