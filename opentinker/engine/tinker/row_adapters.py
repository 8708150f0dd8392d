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

:class:`AdapterCache` keeps loaded adapters by folder (a snapshot's every write has a folder
of its own, so a folder names its content), bounded in bytes and in count.
"""

from __future__ import annotations

import asyncio
import json
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
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


def adapter_bytes(folder: str | Path, dtype: torch.dtype) -> int:
    """What :class:`LoadedAdapter` of ``folder`` will hold in ``dtype``, from the weights
    file's header (shapes only: no tensor is read)."""
    from safetensors import safe_open

    element = torch.empty((), dtype=dtype).element_size()
    total = 0
    with safe_open(Path(folder) / ADAPTER_WEIGHTS_FILE, framework="pt") as weights:
        for key in weights.keys():
            if key.endswith((".lora_A.weight", ".lora_B.weight")):
                count = 1
                for dim in weights.get_slice(key).get_shape():
                    count *= dim
                total += count * element
    return total


@dataclass
class CachedAdapter:
    """An adapter in :class:`AdapterCache`: ``adapter`` once loaded; ``holders`` calls use it."""

    folder: str
    nbytes: int  # counted in the cache's bytes: the header's figure while loading, then the tensors'
    ready: asyncio.Future
    holders: int = 0
    dropped: bool = False  # out of the cache (evicted or failed) while held: uncounted at its last release

    @property
    def adapter(self) -> LoadedAdapter:
        return self.ready.result()


class AdapterCache:
    """Loaded LoRA adapters by folder, least recently used first: at most ``max_bytes`` of
    tensors and ``max_count`` adapters, held ones included. A sampling call holds its adapter
    from before it is queued until it is done (:meth:`acquire`, :meth:`release`); a held
    adapter is never evicted, and a call whose adapter does not fit beside the held ones waits
    for a release. An adapter larger than the whole budget is refused, naming ``flag``.
    Used on one asyncio loop (the sampler actor's); loading runs in a thread."""

    def __init__(self, max_bytes: int, max_count: int, load: Callable[[str], LoadedAdapter],
                 size: Callable[[str], int], flag: str = "the adapter cache's byte budget"):
        self.max_bytes = max_bytes
        self.max_count = max_count
        self.flag = flag
        self._load = load
        self._size = size
        self._entries: OrderedDict[str, CachedAdapter] = OrderedDict()
        self.nbytes = 0  # of every entry in the cache, and of dropped ones still held
        self.peak_bytes = 0  # the most ``nbytes`` has been
        self._changed: asyncio.Event | None = None

    def stats(self) -> dict[str, int]:
        return {"adapters": len(self._entries), "bytes": self.nbytes, "peak_bytes": self.peak_bytes,
                "max_bytes": self.max_bytes, "held": sum(1 for entry in self._entries.values() if entry.holders)}

    async def acquire(self, folder: str) -> CachedAdapter:
        """``folder``'s adapter, loaded if it is not (waiting for room if need be), held
        until :meth:`release`."""
        while True:
            entry = self._entries.get(folder)
            if entry is not None:
                break
            need = await asyncio.to_thread(self._size, folder)
            if need > self.max_bytes:
                raise ValueError(f"this sampler snapshot's adapter takes {need / 2**20:.1f} MiB loaded, more than the "
                                 f"sampler's whole adapter cache of {self.max_bytes / 2**20:.1f} MiB ({self.flag})")
            if folder in self._entries:  # another call started loading it meanwhile
                continue
            self._make_room(need)
            if self.nbytes + need <= self.max_bytes and len(self._entries) < self.max_count:
                entry = self._start_loading(folder, need)
                break
            await self._wait()
        entry.holders += 1
        self._entries.move_to_end(folder)
        try:
            if not entry.ready.done():
                await asyncio.shield(entry.ready)  # a call cancelled meanwhile leaves the load to the others
            entry.ready.result()
        except BaseException:
            self.release(entry)
            raise
        return entry

    def release(self, entry: CachedAdapter) -> None:
        entry.holders -= 1
        if entry.holders == 0 and entry.dropped:
            entry.dropped = False
            self.nbytes -= entry.nbytes
        self._notify()

    def evict(self, folder: str) -> None:
        """``folder`` was deleted: its adapter leaves the cache (once no call holds it)."""
        entry = self._entries.get(folder)
        if entry is not None:
            self._drop(entry)
            self._notify()

    def _start_loading(self, folder: str, need: int) -> CachedAdapter:
        entry = CachedAdapter(folder, need, asyncio.get_running_loop().create_future())
        entry.ready.add_done_callback(lambda done: done.cancelled() or done.exception())  # read by its holders
        self._entries[folder] = entry
        self._count(need)
        asyncio.ensure_future(self._fill(entry))
        return entry

    async def _fill(self, entry: CachedAdapter) -> None:
        try:
            adapter = await asyncio.to_thread(self._load, entry.folder)
        except BaseException as error:
            if self._entries.get(entry.folder) is entry:
                self._drop(entry)
            entry.ready.set_exception(error)
            self._notify()
            return
        if entry.dropped or self._entries.get(entry.folder) is entry:  # counted: the real bytes replace the estimate
            self._count(adapter.nbytes - entry.nbytes)
        entry.nbytes = adapter.nbytes
        entry.ready.set_result(adapter)
        self._notify()

    def _count(self, change: int) -> None:
        self.nbytes += change
        self.peak_bytes = max(self.peak_bytes, self.nbytes)

    def _drop(self, entry: CachedAdapter) -> None:
        del self._entries[entry.folder]
        if entry.holders:
            entry.dropped = True
        else:
            self.nbytes -= entry.nbytes

    def _make_room(self, need: int) -> None:
        """Evicts unheld adapters, least recently used first, until ``need`` more bytes and
        one more adapter fit (or none is left to evict)."""
        for entry in list(self._entries.values()):
            if self.nbytes + need <= self.max_bytes and len(self._entries) < self.max_count:
                return
            if not entry.holders:
                self._drop(entry)

    async def _wait(self) -> None:
        if self._changed is None:
            self._changed = asyncio.Event()
        await self._changed.wait()

    def _notify(self) -> None:
        if self._changed is not None:
            self._changed.set()
            self._changed = None


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
