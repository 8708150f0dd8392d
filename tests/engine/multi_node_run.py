"""Run by test_multi_node.py in a process of its own, since a Ray ``Cluster`` cannot share a
process with the test session's local Ray: ``python multi_node_run.py OUT``.

Builds a Ray cluster of two nodes on this machine (``node_a``, the head this process joins,
and ``node_b``, 2 CPUs each), then runs the same seeded 3-step GRPO job twice: with its two
FSDP ranks spread over both nodes (``trainer.nnodes=2 trainer.n_gpus_per_node=1``) and with
both on one node (``nnodes=1 n_gpus_per_node=2``). Writes ``OUT/result.json`` (each run's
metrics, the node of each rank and of this process, the rollout engine) and each run's final
weights (``OUT/<run>.pt``), and the error asking for a third node gives."""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import ray
import torch
from ray.cluster_utils import Cluster

from opentinker.config import make_config
from opentinker.engine.ppo.trainer import RLTrainer

COMMON = [
    "actor_rollout_ref.actor.strategy=fsdp",
    "trainer.device=cpu",
    "actor_rollout_ref.rollout.name=transformers",  # sampled in the trainer's process
    "data.train_batch_size=2",
    "actor_rollout_ref.actor.ppo_mini_batch_size=2",
    "actor_rollout_ref.rollout.n=4",
    "actor_rollout_ref.actor.use_kl_loss=true",  # the reference model is sharded over the nodes too
    "actor_rollout_ref.actor.optim.lr=1e-4",
    "trainer.total_training_steps=3",
    "trainer.test_freq=-1",
    "trainer.val_before_train=false",
    "trainer.seed=0",
    "trainer.progress_bar=false",
]
RUNS = {
    "two_nodes": ["trainer.nnodes=2", "trainer.n_gpus_per_node=1"],
    "one_node": ["trainer.nnodes=1", "trainer.n_gpus_per_node=2"],
}


def node_names() -> dict[str, str]:
    """Ray node id -> the custom resource that names the node (node_a, node_b)."""
    return {node["NodeID"]: next(key for key in node["Resources"] if key.startswith("node_"))
            for node in ray.nodes() if node["Alive"]}


def run(name: str, overrides: list[str], out: Path) -> dict:
    trainer = RLTrainer(make_config([*COMMON, *overrides]))
    try:
        history = trainer.fit()
        weights = {n: t.clone() for bucket in trainer.backend.weights() for n, t in bucket}
        torch.save(weights, out / f"{name}.pt")
        rollout_weights = trainer.rollout.model.state_dict()
        names = node_names()
        return {
            "history": [{k: v for k, v in m.items() if isinstance(v, (int, float)) and math.isfinite(v)}
                        for m in history],
            "rank_nodes": [names[node] for node in trainer.backend.rank_node_ids],
            "driver_node": names[ray.get_runtime_context().get_node_id()],
            "driver_pid": os.getpid(),
            "rollout_engine": type(trainer.rollout).__name__,
            # The engine's own model object in this process, holding the synced final weights.
            "rollout_model_in_driver": isinstance(trainer.rollout.model, torch.nn.Module),
            "rollout_weights_synced": all(torch.equal(rollout_weights[n], t) for n, t in weights.items()),
        }
    finally:
        trainer.close()


def too_many_nodes_error() -> str:
    from opentinker.engine.backend import BackendSpec
    from opentinker.engine.backend.fsdp import FSDPBackend
    from opentinker.engine.model_loading import load_tokenizer, resolve_model_path

    path = resolve_model_path(None)
    spec = BackendSpec(path, load_tokenizer(path).pad_token_id, strategy="fsdp", ranks=3, nodes=3, device="cpu")
    try:
        FSDPBackend(spec, placement_timeout_s=5).close()
    except RuntimeError as exc:
        return str(exc)
    return ""


def main(out: Path) -> None:
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 2, "resources": {"node_a": 1}, "include_dashboard": False})
    try:
        cluster.add_node(num_cpus=2, resources={"node_b": 1})
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False)
        result = {name: run(name, overrides, out) for name, overrides in RUNS.items()}
        result["too_many_nodes_error"] = too_many_nodes_error()
        (out / "result.json").write_text(json.dumps(result))
    finally:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
