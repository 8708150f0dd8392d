"""Multi-node, simulated: a Ray cluster of two nodes on this machine (multi_node_run.py, in a
process of its own with its own Ray temp folder, so it neither meets the session's Ray nor
becomes the cluster a bare ``ray.init()`` elsewhere finds). GRPO for 3 steps with the FSDP
ranks on two nodes (``trainer.nnodes=2``, one rank each) against the same job with both
ranks on one node; and what placement says when the cluster has too few nodes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from opentinker.engine.backend import BackendSpec

pytestmark = pytest.mark.heavy  # minutes: scheduled first (tests/conftest.py)

pytest.importorskip("ray")

SCRIPT = Path(__file__).with_name("multi_node_run.py")
VARYING = ("timing_s/", "perf/")  # wall-clock metrics


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_model_dir):
    """The script's result.json and its folder (the runs' final weights)."""
    out = tmp_path_factory.mktemp("multi_node")
    ray_tmp = tempfile.mkdtemp(prefix="ot-ray-")  # short: Ray's unix sockets live under it
    try:
        result = subprocess.run([sys.executable, str(SCRIPT), str(out)], env={**os.environ, "RAY_TMPDIR": ray_tmp},
                                capture_output=True, text=True, timeout=600)
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads((out / "result.json").read_text()), out


def test_the_ranks_run_on_two_nodes_and_the_rollout_in_the_trainer_process(runs):
    result, _ = runs
    two, one = result["two_nodes"], result["one_node"]
    # One rank on each node; which node gets rank 0 is Ray's choice (on node_b the ranks meet
    # away from the trainer's node: on one machine both nodes have the same address, though).
    assert sorted(two["rank_nodes"]) == ["node_a", "node_b"]
    # nnodes=1: packed on one node, as before (which one is Ray's choice: CI saw node_b).
    assert len(one["rank_nodes"]) == 2 and len(set(one["rank_nodes"])) == 1
    for run in (two, one):
        # rollout.name=transformers: the engine and its model live in the trainer's own process
        # (on the head node, where the driver joined), and got the ranks' weights after each step.
        assert run["driver_node"] == "node_a"
        assert run["rollout_engine"] == "TransformersRolloutEngine"
        assert run["rollout_model_in_driver"] and run["rollout_weights_synced"]


def test_three_grpo_steps_on_two_nodes_match_one_node(runs, tiny_model_dir):
    """Both runs have 2 gloo ranks with the same rows each, so the same sums in the same order:
    every metric and every final weight came out bit-identical, and that is what is asserted."""
    result, out = runs
    two, one = result["two_nodes"]["history"], result["one_node"]["history"]
    assert [m["step"] for m in two] == [m["step"] for m in one] == [1, 2, 3]
    for a, b in zip(two, one):
        keys = {k for k in a if not k.startswith(VARYING)}
        assert keys == {k for k in b if not k.startswith(VARYING)}
        assert {"reward/mean", "actor/pg_loss", "actor/grad_norm", "actor/kl"} <= keys
        assert {k: a[k] for k in keys} == {k: b[k] for k in keys}, a["step"]
        assert a["actor/optimizer_steps"] == 1
    assert any(m["actor/grad_norm"] > 0 for m in two)
    weights_two, weights_one = torch.load(out / "two_nodes.pt"), torch.load(out / "one_node.pt")
    assert weights_two.keys() == weights_one.keys()
    assert all(torch.equal(weights_two[name], weights_one[name]) for name in weights_two)
    from opentinker.engine.model_loading import load_causal_lm

    initial = load_causal_lm(str(tiny_model_dir)).state_dict()
    assert any(not torch.equal(weights_two[name], initial[name]) for name in weights_two)  # it trained


def test_more_nodes_than_the_cluster_has_fail_at_once_naming_trainer_nnodes(runs, ray_session, tiny_model_dir,
                                                                            tiny_tokenizer):
    result, _ = runs
    assert result["too_many_nodes_error"].startswith(
        "trainer.nnodes=3 spreads the FSDP ranks over 3 distinct Ray nodes, 1 on each (trainer.n_gpus_per_node), "
        "which needs 3 nodes with 1 CPU each; the Ray cluster has 2 (2 alive: ")
    from opentinker.engine.backend.fsdp import FSDPBackend

    # The session's Ray is one node with 4 CPUs: enough CPUs for 2 ranks, not 2 nodes.
    with pytest.raises(RuntimeError, match=r"trainer.nnodes=2 .* the Ray cluster has 1 \(1 alive: .*: 4 CPU\)"):
        FSDPBackend(BackendSpec(str(tiny_model_dir), tiny_tokenizer.pad_token_id, strategy="fsdp", ranks=2, nodes=2,
                                device="cpu"))


def test_nodes_must_divide_the_ranks():
    with pytest.raises(ValueError, match="nodes: 2 with 3 ranks"):
        BackendSpec("model", 0, strategy="fsdp", ranks=3, nodes=2)
    with pytest.raises(ValueError, match="nodes: 2 with 1 ranks and strategy 'local'"):
        BackendSpec("model", 0, nodes=2)
