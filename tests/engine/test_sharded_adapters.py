"""The multi-tenant LoRA worker on FSDP ranks (the ``fsdp`` strategy), on the tiny model with 2
gloo ranks as real Ray actors: the same cycles give the same results as the single-process
worker (losses, per-datum logprobs, errors, checkpoints with weights and AdamW state), also
with rows split unevenly, a rank left without rows, forward-only requests beside training
ones, and with adapters evicted to disk; a dead rank takes the worker down with a clear error."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

from opentinker.engine.backend.base import STATE_FILE
from opentinker.engine.tinker.adapter_worker import AdapterWorker, ForwardBackwardCall as Call
from opentinker.engine.tinker.pass_plan import PassLimits

from .test_adapter_worker import ADAM as BASE_ADAM
from .test_adapter_worker import SETTINGS, TINY_BASE, datums

pytestmark = pytest.mark.heavy  # minutes: scheduled first (tests/conftest.py)

ray = pytest.importorskip("ray")

# Two ranks sum gradients in another order than one process. AdamW divides each gradient by
# its own scale, so with a tiny eps that rounding noise in near-zero gradients would become a
# whole step of either sign; an eps above the noise keeps the comparison about the arithmetic.
ADAM = {**BASE_ADAM, "eps": 1e-4}
BAD_TOKENS = [(np.array([1, 2, 5000]), {"target_tokens": np.array([2, 5000, 3])})]


def cycles(folder: Path) -> list[tuple[list[Call], list[tuple]]]:
    """Cycles that split rows unevenly over 2 ranks and leave one without rows."""
    return [
        # 3 + 1 + 1 rows; b only looks.
        ([Call("a", datums(1), "cross_entropy"), Call("b", datums(2, 1), "cross_entropy", forward_only=True),
          Call("c", datums(3, 1), "cross_entropy")], []),
        # One row: rank 1 has none and runs a filler row.
        ([Call("b", datums(4, 1), "cross_entropy")], [("optim_step", "a", (ADAM,)), ("optim_step", "c", (ADAM,))]),
        # A bad request; c only looks, then steps with no gradient (AdamW must leave it alone).
        ([Call("a", BAD_TOKENS, "cross_entropy"), Call("c", datums(5), "cross_entropy", forward_only=True),
          Call("b", datums(6), "cross_entropy")], [("optim_step", "b", (ADAM,)), ("optim_step", "c", (ADAM,))]),
        ([Call(m, datums(7 + i), "cross_entropy") for i, m in enumerate("abc")],
         [("optim_step", m, (ADAM,)) for m in "abc"]),
        ([], [("save_state", m, (str(folder / m),)) for m in "abc"]),
        # The worker's first adapter leaves (peft then froze the others, which failed or trained nothing).
        ([], [("remove_model", "a", ())]),
        ([Call("b", datums(10, 2), "cross_entropy"), Call("c", datums(11), "cross_entropy")],
         [("optim_step", m, (ADAM,)) for m in "bc"]),
    ]


def checkpoint(folder: Path) -> dict:
    return torch.load(folder / STATE_FILE, map_location="cpu", weights_only=False)


def assert_close(a, b, tol: float) -> None:
    """Equal structure and values within ``tol`` relative to the larger of 1 and the value's
    scale (AdamW's second moments reach 1e6 here): two ranks sum gradients in another order."""
    if isinstance(a, dict):
        assert set(a) == set(b)
        for key in a:
            assert_close(a[key], b[key], tol)
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_close(x, y, tol)
    elif torch.is_tensor(a):
        assert a.shape == b.shape
        if a.numel():
            assert float((a.float() - b.float()).abs().max()) <= tol * max(1.0, float(b.float().abs().max()))
    elif isinstance(a, float):
        assert a == pytest.approx(b, abs=tol * max(1.0, abs(b)))
    else:
        assert a == b


@pytest.fixture
def sharded_worker(ray_session, tmp_path):
    from opentinker.engine.tinker.sharded_adapters import ShardedAdapterWorker

    made = []

    def make(**options):
        actor = ray.remote(ShardedAdapterWorker).options(num_cpus=0).remote(
            dataclasses.replace(TINY_BASE, strategy="fsdp", ranks=2), offload_dir=str(tmp_path / f"offload{len(made)}"), **options)
        made.append(actor)
        ray.get(actor.ready.remote())
        return actor

    yield make
    for actor in made:
        try:
            ray.get(actor.close.remote(), timeout=60)
        except Exception:  # noqa: BLE001 - already dead (the failure test)
            pass
        ray.kill(actor, no_restart=True)


@pytest.mark.parametrize("max_resident,limits", [(None, None), (1, PassLimits(tokens=24))])
def test_two_ranks_give_what_one_process_gives(sharded_worker, tmp_path, max_resident, limits):
    """Also with small passes (``limits``: a request's rows sorted by length over several
    passes, each pass's rows split over the ranks) against one pass in one process."""
    local = AdapterWorker(TINY_BASE)
    sharded = sharded_worker(max_resident=max_resident, limits=limits)
    for m, settings in SETTINGS.items():
        local.add_model(m, settings)
        ray.get(sharded.cycle.remote([], [("add_model", m, (settings,))]))
    for calls, ops in cycles(tmp_path / "local"):
        expected_fb, expected_done = local.cycle(calls, ops)
        got_fb, got_done = ray.get(sharded.cycle.remote(
            calls, [(method, m, (str(tmp_path / "sharded" / m),)) if method == "save_state" else (method, m, args)
                    for method, m, args in ops]))
        for expected, got in zip(expected_fb, got_fb):
            if "error" in expected:
                assert got["category"] == expected["category"] and got["error"] == expected["error"]
                continue
            assert_close(got["result"]["metrics"], expected["result"]["metrics"], 1e-5)
            assert len(got["result"]["outputs"]) == len(expected["result"]["outputs"])
            for mine, ours in zip(got["result"]["outputs"], expected["result"]["outputs"]):
                for name in ("logprobs", "elementwise_loss"):
                    np.testing.assert_allclose(mine[name], ours[name], rtol=1e-5, atol=1e-5)
        # optim_step's metrics (the grad norm: the ranks' summed gradients) and the others' None.
        assert_close(got_done, expected_done, 1e-5)
    for m in SETTINGS:  # rank 0 wrote each model's checkpoint: weights, AdamW state and step as the local ones
        mine, ours = checkpoint(tmp_path / "sharded" / m), checkpoint(tmp_path / "local" / m)
        assert mine["step"] == ours["step"] and mine["step"] >= 2
        assert_close(mine["model"], ours["model"], 1e-5)
        assert_close(mine["optimizer"]["state"], ours["optimizer"]["state"], 1e-5)
    stats = ray.get(sharded.stats.remote())
    assert stats["ranks"] == 2 and stats["models"] == 2
    assert len(stats["resident"]) == (2 if max_resident is None else 1)
    if limits is not None:
        assert stats["largest_pass"][0] <= 24 and stats["passes"] > len(cycles(tmp_path)) + 4


def test_a_dead_rank_stops_the_worker_with_an_actor_error(sharded_worker):
    import os
    import signal

    sharded = sharded_worker()
    ray.get(sharded.cycle.remote([], [("add_model", "a", (SETTINGS["a"],))]))
    pids = ray.get(sharded.stats.remote())["pids"]
    assert len(pids) == 2
    os.kill(pids[1], signal.SIGKILL)
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(sharded.cycle.remote([Call("a", datums(1), "cross_entropy")], []), timeout=120)
