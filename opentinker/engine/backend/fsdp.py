"""``FSDPBackend``: the training primitives on N ranks, each a Ray actor holding an FSDP2 shard.

The ranks sit in a placement group (``BackendSpec.ranks`` of them, for a PPO job
``trainer.nnodes`` x ``trainer.n_gpus_per_node``: one GPU each, or one CPU each on CPU; with
``trainer.nnodes`` > 1 ``n_gpus_per_node`` on each of that many distinct Ray nodes) and form a
process group (nccl on GPU, gloo on CPU) at rank 0's node. Each rank builds its own model:
rank 0 loads the checkpoint, the others build on the meta device (both read the model folder
on their own node); every decoder layer and then the root are wrapped with ``fully_shard``;
the weights reach the other ranks from rank 0 (``set_model_state_dict`` with
``broadcast_from_rank0``), so every rank ends up holding only its shard. The frozen
reference model is sharded the same way on the same ranks.

The driver (this object) splits each batch into contiguous row shards, one per rank, and
never holds the model: ``weights()`` all-gathers one bucket of full tensors at a time onto
rank 0 and hands it over. Losses are sums over tokens, so each rank back-propagates the sum
over its rows; FSDP averages gradients over ranks, hence the factor ``world_size``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from opentinker.engine.backend.base import (
    DEFAULT_BUCKET_BYTES,
    AdamParams,
    ForwardBackwardOutput,
    ForwardOutput,
    WeightBucket,
    loss_without_gradients,
)
from opentinker.engine.backend.forward import ResponseScorer, pad_to
from opentinker.engine.backend.fsdp_rank import FSDPRank, rendezvous_address
from opentinker.engine.backend.losses import check_inputs, resolve_loss
from opentinker.engine.backend.spec import BackendSpec
from opentinker.engine.batch import TokenBatch
from opentinker.engine.placement import PLACEMENT_TIMEOUT_S, wait_until_placed


def shard_rows(batch: TokenBatch, world_size: int) -> list[tuple[TokenBatch, int]]:
    """Contiguous row shards, one per rank, as ``(shard, real_rows)``. FSDP's collectives need
    every rank to run, so a rank without rows gets one row of zero weight to compute."""
    bounds = [round(i * len(batch) / world_size) for i in range(world_size + 1)]
    shards = []
    for start, end in zip(bounds, bounds[1:]):
        if end > start:
            shards.append((batch.select(range(start, end)), end - start))
            continue
        filler = batch.select([0])
        filler.tensors = {**filler.tensors, "weights": torch.zeros_like(filler.response_mask)}
        shards.append((filler, 0))
    return shards


def place_ranks(rank_class: type, options: BackendSpec, placement_timeout_s: float = PLACEMENT_TIMEOUT_S,
                *extra: Any) -> tuple[Any, list[Any]]:
    """``options.ranks`` actors of ``rank_class`` in a placement group (one GPU, or one CPU on
    CPU, each), made as ``rank_class(rank, world_size, master_addr, master_port, options,
    *extra)`` with ``options.device`` resolved to cpu or cuda. With ``options.nodes`` > 1
    (``trainer.nnodes``) they sit ``ranks / nodes`` on each of that many distinct Ray nodes
    (ranks 0 to ``ranks / nodes - 1`` on one of them, and so on). Returns the group and the actors."""
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    if not ray.is_initialized():
        ray.init(include_dashboard=False, log_to_driver=False)
    world_size, nodes = options.ranks, options.nodes
    per_node = world_size // nodes
    cuda = options.device == "cuda" or (options.device == "auto" and ray.cluster_resources().get("GPU", 0) > 0)
    options = dataclasses.replace(options, device="cuda" if cuda else "cpu")
    resource = "GPU" if cuda else "CPU"
    bundle = {"GPU": 1, "CPU": 1} if cuda else {"CPU": 1}
    if nodes == 1:
        group = placement_group([bundle] * world_size, strategy="PACK")
        bundle_of = list(range(world_size))
    else:
        # One bundle per node holding that node's ranks, STRICT_SPREAD: exactly `nodes` distinct
        # nodes, `per_node` ranks on each, numbered node by node as torchrun does. (A bundle per
        # rank with STRICT_SPREAD would need a node per rank; SPREAD only tries to spread.)
        node_bundle = {key: value * per_node for key, value in bundle.items()}
        _check_enough_nodes(nodes, node_bundle, resource)
        group = placement_group([node_bundle] * nodes, strategy="STRICT_SPREAD")
        bundle_of = [rank // per_node for rank in range(world_size)]
    where = f" on {nodes} nodes ({per_node} on each, trainer.nnodes)" if nodes > 1 else ""
    wait_until_placed(group, placement_timeout_s, lambda available: (
        f"the Ray cluster cannot place {world_size} FSDP ranks of 1 {resource} each{where} (trainer.nnodes x "
        f"trainer.n_gpus_per_node); {resource} available: {available.get(resource, 0):g}"))
    remote = ray.remote(rank_class)
    # Rank 0's node, which may not be this one (trainer.nnodes > 1). On one machine running
    # several Ray nodes they all share its address: the free port makes the rendezvous unique.
    master_addr, master_port = ray.get(ray.remote(rendezvous_address).options(
        num_cpus=0, scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=0),
    ).remote())
    ranks = [
        remote.options(
            num_cpus=1, num_gpus=1 if cuda else 0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=bundle_of[rank]),
        ).remote(rank, world_size, master_addr, master_port, options, *extra)
        for rank in range(world_size)
    ]
    return group, ranks


def _check_enough_nodes(nodes: int, node_bundle: dict[str, float], resource: str) -> None:
    """Fail at once, naming ``trainer.nnodes`` and the cluster's nodes, when fewer than
    ``nodes`` alive Ray nodes could each hold ``node_bundle`` (a STRICT_SPREAD group would
    otherwise wait for its timeout). Counts the nodes' totals: busy nodes are waited for."""
    import ray

    alive = [node for node in ray.nodes() if node.get("Alive")]
    fit = [node for node in alive
           if all(node.get("Resources", {}).get(key, 0) >= value for key, value in node_bundle.items())]
    if len(fit) >= nodes:
        return
    per_node = int(node_bundle[resource])
    have = ", ".join(f"{node.get('NodeManagerAddress', '?')}: {node.get('Resources', {}).get(resource, 0):g} {resource}"
                     for node in alive)
    raise RuntimeError(
        f"trainer.nnodes={nodes} spreads the FSDP ranks over {nodes} distinct Ray nodes, {per_node} on each "
        f"(trainer.n_gpus_per_node), which needs {nodes} nodes with {per_node} {resource} each; the Ray cluster "
        f"has {len(fit)} ({len(alive)} alive: {have})")


class FSDPBackend:
    """The driver side: a placement group of ``options.ranks`` FSDPRank actors."""

    def __init__(self, options: BackendSpec, *, placement_timeout_s: float = PLACEMENT_TIMEOUT_S):
        self.world_size = options.ranks  # at least 1: BackendSpec checks it
        self._pg, self._ranks = place_ranks(FSDPRank, options, placement_timeout_s)
        # Every rank must run the same number of model calls (FSDP gathers each layer's shards
        # in each): the driver picks one layout for all shards of a batch.
        self._layout = ResponseScorer(options.pad_token_id, torch.device("cpu"), options.use_remove_padding,
                                      options.share_prompt_prefix and not options.gradient_checkpointing)
        self._call("ready")  # raises the first rank's construction error, if any
        self.rank_node_ids: list[str] = self._call("node_id")  # the Ray node of each rank, in rank order
        self.step = 0

    def _call(self, method: str, *args: Any, per_rank: list[tuple] | None = None) -> list[Any]:
        import ray

        calls = [getattr(rank, method).remote(*(per_rank[i] if per_rank else args))
                 for i, rank in enumerate(self._ranks)]
        return ray.get(calls)

    def _shares_prefix(self, shards: list[tuple[TokenBatch, int]]) -> bool:
        """The prompt-once layout for every rank, or for none (then all run padded rows)."""
        return all(self._layout.shares_prefix(shard) for shard, _ in shards)

    # -- primitives ----------------------------------------------------------------
    def forward(self, batch: TokenBatch, *, temperature: float = 1.0, reference: bool = False,
                with_entropy: bool = False) -> ForwardOutput:
        shards = shard_rows(batch, self.world_size)
        share = self._shares_prefix(shards)
        results = self._call("forward", per_rank=[(shard, temperature, reference, with_entropy, share)
                                                  for shard, _ in shards])
        logprobs = _join([r[0] for r in results], shards, batch.response_width)
        entropy = _join([r[1] for r in results], shards, batch.response_width) if with_entropy else None
        return ForwardOutput(logprobs, entropy)

    def forward_backward(self, batch: TokenBatch, loss_fn: str, loss_config: Mapping[str, Any] | None = None, *,
                         temperature: float = 1.0, with_entropy: bool = False) -> ForwardBackwardOutput:
        spec, _ = resolve_loss(loss_fn, loss_config)  # refuse bad input here, not on every rank
        check_inputs(spec, batch.tensors, tuple(batch.response_mask.shape))
        shards = shard_rows(batch, self.world_size)
        share = self._shares_prefix(shards)
        results = self._call("forward_backward", per_rank=[
            (shard, loss_fn, loss_config, temperature, with_entropy, share) for shard, _ in shards])
        metrics: dict[str, float] = {}
        for _, _, rank_metrics, _ in results:
            for key, value in rank_metrics.items():
                metrics[key] = metrics.get(key, 0.0) + value
        width = batch.response_width
        return ForwardBackwardOutput(
            _join([r[0] for r in results], shards, width), _join([r[1] for r in results], shards, width), metrics,
            _join([r[3] for r in results], shards, width) if results[0][3] is not None else None,
        )

    def forward_loss(self, batch: TokenBatch, loss_fn: str, loss_config: Mapping[str, Any] | None = None, *,
                     temperature: float = 1.0) -> ForwardBackwardOutput:
        """``forward_backward``'s outputs, the gradients left as they are."""
        return loss_without_gradients(self, batch, loss_fn, loss_config, temperature)

    def optim_step(self, params: AdamParams) -> dict[str, float]:
        metrics = self._call("optim_step", params)[0]
        self.step += int(not metrics["skipped_nonfinite"])
        return metrics

    # -- weights and state ----------------------------------------------------------
    def weights(self, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> Iterator[WeightBucket]:
        import ray

        plan: list[list[str]] = []
        size = 0
        for name, nbytes in ray.get(self._ranks[0].tensor_sizes.remote()):
            if not plan or (size + nbytes > bucket_bytes and plan[-1]):
                plan.append([])
                size = 0
            plan[-1].append(name)
            size += nbytes
        for names in plan:
            yield self._call("gather", names)[0]

    def save_state(self, path: str | Path) -> Path:
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self._call("save_state", str(path))
        return path

    def load_state(self, path: str | Path, *, with_optimizer: bool = True) -> None:
        self.step = int(self._call("load_state", str(path), with_optimizer)[0])

    def export_hf(self, path: str | Path, tokenizer: Any = None) -> Path:
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self._call("export_hf", str(path))
        if tokenizer is not None:
            tokenizer.save_pretrained(path)
        return path

    def close(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        if not getattr(self, "_ranks", None):
            return
        try:
            self._call("shutdown")
        except Exception:  # a dead rank: kill the rest anyway
            pass
        for rank in self._ranks:
            ray.kill(rank, no_restart=True)
        self._ranks = []
        remove_placement_group(self._pg)


def _join(parts: list[torch.Tensor], shards: list[tuple[TokenBatch, int]], width: int) -> torch.Tensor:
    return torch.cat([pad_to(part[:rows], width) for part, (_, rows) in zip(parts, shards)])
