"""Runs inside vLLM's worker process: receives streamed weight buckets and reloads them in place.

vLLM loads a ``worker_extension_cls`` into each worker and exposes its methods to
``collective_rpc``. A weight sync is three calls: :meth:`begin_weight_sync` starts vLLM's own
in-place reload (``reload_weights``) on a thread whose weight iterator reads a queue of one,
:meth:`receive_weight_bucket` hands it one bucket at a time, :meth:`finish_weight_sync` ends
the iterator and waits. The reload consumes buckets as they come, so the worker never holds
more than a bucket or two beyond the model, and nothing touches the disk.

vLLM's RPC encoder sends tensors without their type, so buckets travel as
``(name, dtype, shape, raw bytes)`` and are rebuilt here.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator

import torch

_END = None  # marks the end of a sync on the queue
EncodedTensor = tuple[str, str, list[int], bytes]


def encode_bucket(bucket) -> list[EncodedTensor]:
    """``(name, tensor)`` pairs as plain values vLLM's RPC carries unchanged."""
    encoded = []
    for name, tensor in bucket:
        data = tensor.detach().to("cpu").contiguous()
        encoded.append((name, str(data.dtype).removeprefix("torch."), list(data.shape),
                        data.view(torch.uint8).numpy().tobytes()))
    return encoded


def decode_tensor(dtype: str, shape: list[int], data: bytes) -> torch.Tensor:
    flat = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    return flat.view(getattr(torch, dtype)).reshape(shape)


class WeightSyncExtension:
    """Mixed into vLLM's worker class (``worker_extension_cls``); ``self`` is the worker."""

    def begin_weight_sync(self) -> None:
        if getattr(self, "_sync_thread", None) is not None:
            raise RuntimeError("begin_weight_sync: a weight sync is already in progress")
        self._sync_queue: queue.Queue = queue.Queue(maxsize=1)
        self._sync_error: BaseException | None = None
        self._sync_names: list[str] = []

        def reload() -> None:
            try:
                self.model_runner.reload_weights(weights_iterator=self._queued_weights())
            except BaseException as error:  # reported by the next RPC
                self._sync_error = error
                while self._sync_queue.get() is not _END:  # let a blocked sender go on
                    pass

        self._sync_thread = threading.Thread(target=reload, name="opentinker-weight-sync", daemon=True)
        self._sync_thread.start()

    def _queued_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        while (bucket := self._sync_queue.get()) is not _END:
            for name, dtype, shape, data in bucket:
                self._sync_names.append(name)
                yield name, decode_tensor(dtype, shape, data).to(self.device)

    def receive_weight_bucket(self, bucket: list[EncodedTensor]) -> None:
        if getattr(self, "_sync_thread", None) is None:
            raise RuntimeError("receive_weight_bucket: call begin_weight_sync first")
        if self._sync_error is not None:
            raise RuntimeError(f"weight sync failed in the worker: {self._sync_error!r}")
        self._sync_queue.put(bucket)

    def finish_weight_sync(self) -> list[str]:
        """Ends the sync; returns the names the reload received, in order."""
        thread = getattr(self, "_sync_thread", None)
        if thread is None:
            raise RuntimeError("finish_weight_sync: no weight sync in progress")
        self._sync_queue.put(_END)
        thread.join()
        self._sync_thread = None
        if self._sync_error is not None:
            raise RuntimeError(f"weight sync failed in the worker: {self._sync_error!r}")
        return self._sync_names
