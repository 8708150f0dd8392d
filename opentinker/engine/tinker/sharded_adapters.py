"""Many users' LoRA models on one base model sharded over FSDP ranks (the ``fsdp`` strategy).

:class:`ShardedAdapterWorker` is :class:`~opentinker.engine.tinker.adapter_worker.AdapterWorker`
spread over ``ranks`` Ray actors (:class:`AdapterRank`): the frozen base is sharded with
FSDP2 (each rank holds 1/N of it and gathers one layer at a time), while every adapter and its
AdamW state are small and live whole on every rank. The driver sends each cycle to every rank;
each rank runs the same passes on its own contiguous share of each pass's rows, so it computes
the gradient of its rows only; at a model's ``optim_step`` the ranks sum that model's
gradients (one all-reduce) and take the same AdamW step, so the adapters stay equal everywhere.
Results come back per request as the rows of every rank, in order, and the sums of their
metrics. Checkpoints and sampler snapshots are rank 0's (the same format and files as the
single-process worker's); a checkpoint is read by every rank.

Every decision that makes ranks run collectives (which passes, which adapters are resident)
follows from the cycle alone, so the ranks agree without talking. A failure inside a pass on
one rank would leave the others waiting in a collective: the driver then kills every rank and
itself, and the host reports the worker dead (its models are lost; the next LoRA model of that
base starts a new worker).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from opentinker.engine.backend.fsdp import place_ranks
from opentinker.engine.backend.fsdp_rank import build_sharded_model, join_process_group
from opentinker.engine.backend.spec import BackendSpec
from opentinker.engine.batch import TokenBatch
from opentinker.engine.placement import PLACEMENT_TIMEOUT_S
from opentinker.engine.tinker.adapter_state import Adapter
from opentinker.engine.tinker.adapter_worker import AdapterWorker, ForwardBackwardCall, _Prepared
from opentinker.engine.tinker.pass_plan import PassLimits, join_pieces

log = logging.getLogger("opentinker.engine.tinker")


class AdapterRank(AdapterWorker):
    """One rank: a shard of the base, every adapter whole, its rows of each pass."""

    def __init__(self, rank: int, world_size: int, master_addr: str, master_port: int, options: BackendSpec,
                 max_resident: int | None, offload_dir: str, limits: PassLimits | None = None):
        self.rank, self.world_size = rank, world_size
        device, self.mesh = join_process_group(rank, world_size, master_addr, master_port, options.device)
        super().__init__(dataclasses.replace(options, device=str(device)), max_resident,
                         str(Path(offload_dir) / f"rank{rank}"), limits)

    def _load_base(self, spec: BackendSpec) -> torch.nn.Module:
        return build_sharded_model(spec, self.rank, self.mesh, self.device, trainable=False)

    def _bounds(self, rows: int) -> tuple[int, int]:
        """This rank's contiguous share of ``rows`` rows (as ``fsdp.shard_rows`` splits a batch)."""
        return round(self.rank * rows / self.world_size), round((self.rank + 1) * rows / self.world_size)

    def _own_rows(self, group: list[_Prepared]) -> list[tuple[_Prepared, TokenBatch, list[int]]]:
        start, end = self._bounds(sum(len(item.batch) for item in group))
        parts = []
        offset = 0
        for item in group:
            low, high = max(start, offset) - offset, min(end, offset + len(item.batch)) - offset
            if high > low:
                whole = (low, high) == (0, len(item.batch))
                parts.append((item, item.batch if whole else item.batch.select(range(low, high)),
                              item.rows[low:high]))
            offset += len(item.batch)
        return parts

    def _filler(self, group: list[_Prepared], train: bool) -> list[tuple[_Prepared, TokenBatch, list[int]]]:
        """A rank without rows in a pass (or without training rows in a training pass) still
        runs it (FSDP's collectives need every rank): one row, of a training request if the
        pass trains, whose result is dropped (no rows of its own) and whose loss is not counted."""
        item = next((item for item in group if not item.call.forward_only), group[0]) if train else group[0]
        return [(item, item.batch.select([0]), [])]

    def _reduce_gradients(self, adapter: Adapter) -> None:
        """Each rank holds the gradient of its own rows: the sum over ranks is the model's. A
        tensor no rank has a gradient for stays without one (AdamW then leaves it alone)."""
        import torch.distributed as dist

        parameters = adapter.parameters()
        present = torch.tensor([float(p.grad is not None) for p in parameters], device=self.device)
        dist.all_reduce(present)
        reduced = [p for p, count in zip(parameters, present.tolist()) if count > 0]
        if not reduced:
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in reduced]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat)
        offset = 0
        for parameter in reduced:
            size = parameter.numel()
            parameter.grad = flat[offset:offset + size].view_as(parameter).clone()
            offset += size

    def stats(self) -> dict[str, Any]:
        import os

        return {**super().stats(), "rank": self.rank, "pid": os.getpid()}

    def shutdown(self) -> None:
        import torch.distributed as dist

        self.close()
        if dist.is_initialized():
            dist.destroy_process_group()


class ShardedAdapterWorker:
    """The driver: ``AdapterWorker``'s interface (``ready``, ``cycle``, ``stats``, ``close``) on
    ``ranks`` :class:`AdapterRank` actors in a placement group."""

    def __init__(self, base: BackendSpec, max_resident: int | None = None, offload_dir: str | None = None,
                 limits: PassLimits | None = None, placement_timeout_s: float = PLACEMENT_TIMEOUT_S):
        import tempfile

        from opentinker.engine.model_loading import resolved_spec

        if base.strategy != "fsdp":
            raise ValueError(f"base: a ShardedAdapterWorker shards a base with strategy 'fsdp', not {base.strategy!r}")
        # shared_base() refuses a spec that is not multi_adapter; the model path and pad id once, for every rank
        options = resolved_spec(base.shared_base())
        folder = offload_dir or tempfile.mkdtemp(prefix="opentinker-adapters-")
        self._group, self._ranks = place_ranks(AdapterRank, options, placement_timeout_s, max_resident, folder,
                                                  limits)
        self._limits = self._gather([rank.ready.remote() for rank in self._ranks])[0]

    def ready(self) -> dict[str, Any]:
        return self._limits

    def cycle(self, calls: Sequence[ForwardBackwardCall],
              ops: Sequence[tuple[str, str, tuple]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        per_rank = self._gather([rank.cycle.remote(calls, ops) for rank in self._ranks])
        fb = [_join_rows([outcomes[index] for outcomes, _ in per_rank]) for index in range(len(calls))]
        return fb, per_rank[0][1]  # every rank did the same operations; rank 0 wrote the files

    def stats(self) -> dict[str, Any]:
        import psutil

        per_rank = self._gather([rank.stats.remote() for rank in self._ranks])
        return {**per_rank[0], "ranks": len(per_rank), "pids": [s["pid"] for s in per_rank],
                "rss_bytes": sum(s["rss_bytes"] for s in per_rank) + psutil.Process().memory_info().rss}

    def _gather(self, refs: list[Any]) -> list[Any]:
        """Every rank's answer; when one rank fails the others may wait for it in a collective
        forever, so the first failure stops every rank and this driver (the host sees the
        worker die)."""
        import ray

        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            try:
                ray.get(done[0])
            except Exception as error:  # noqa: BLE001
                log.error("a rank of the sharded adapter worker failed (%s); stopping the worker", error)
                self.close(graceful=False)
                ray.actor.exit_actor()
        return ray.get(refs)

    def close(self, graceful: bool = True) -> None:
        """Stops the ranks (``graceful``: each first leaves the process group and deletes its
        offloaded adapters; not after a failure, when a rank may be stuck in a collective)."""
        import ray
        from ray.util.placement_group import remove_placement_group

        if not getattr(self, "_ranks", None):
            return
        if graceful:
            with contextlib.suppress(Exception):  # a dead rank is killed below anyway
                ray.get([rank.shutdown.remote() for rank in self._ranks], timeout=30)
        for rank in self._ranks:
            ray.kill(rank, no_restart=True)
        self._ranks = []
        remove_placement_group(self._group)


def _join_rows(outcomes: list[dict[str, Any]]) -> dict[str, Any]:
    """One request's result from each rank's share: its rows in the request's order, summed
    metrics (every Tinker metric is a sum). The same error on every rank (bad input is refused
    before any pass, identically) is reported once."""
    if any("error" in outcome for outcome in outcomes):
        return next(outcome for outcome in outcomes if "error" in outcome)
    return {"result": join_pieces([(outcome["result"]["rows"], outcome["result"]) for outcome in outcomes])}
