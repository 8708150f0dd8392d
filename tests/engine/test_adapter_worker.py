"""The multi-tenant LoRA worker on the tiny model (no Ray: the actor's class in this process):
one model there trains exactly as a model of its own; several models in one batched pass train
exactly as each alone; a bad request fails alone; eviction to disk and back is bit-identical."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from opentinker.engine.backend.spec import BackendSpec, LoraSettings
from opentinker.engine.tinker.adapter_worker import AdapterWorker, ForwardBackwardCall
from opentinker.engine.tinker.model_worker import TinkerModelWorker

ADAM = {"learning_rate": 5e-3, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.01, "grad_clip_norm": 1.0}
TINY_BASE = BackendSpec(None, device="cpu", multi_adapter=True)  # the embedded tiny model as a shared base
ALL = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj,lm_head"  # Tinker's defaults: every switch on


def datums(seed: int, count: int = 3) -> list:
    """Next-token datums of different lengths (row weights 1)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(count):
        tokens = rng.integers(3, 1000, size=6 + 3 * i)
        out.append((tokens[:-1], {"target_tokens": tokens[1:], "weights": np.ones(len(tokens) - 1, np.float32)}))
    return out


def train(worker: AdapterWorker, model_ids: list[str], steps: int, together: bool,
          data_of: dict[str, str] | None = None) -> dict[str, list[float]]:
    """``steps`` of forward_backward + optim_step for each model, in one cycle per step
    (``together``) or one model per cycle; returns each model's losses. Each model's datums
    depend on its name (or the name ``data_of`` maps it to) and the step."""
    losses: dict[str, list[float]] = {m: [] for m in model_ids}
    for step in range(steps):
        groups = [model_ids] if together else [[m] for m in model_ids]
        for group in groups:
            calls = [ForwardBackwardCall(m, datums(ord((data_of or {}).get(m, m)) + step), "cross_entropy") for m in group]
            fb, done = worker.cycle(calls, [("optim_step", m, (ADAM,)) for m in group])
            for m, out in zip(group, fb):
                losses[m].append(out["result"]["metrics"]["loss:sum"])
            assert all("result" in d for d in done), done
    return losses


def adapter_weights(worker: AdapterWorker, model_id: str) -> dict[str, torch.Tensor]:
    adapter = worker.adapters[model_id]
    return {name.replace(f".{adapter.name}.", "."): p.detach().clone() for name, p in adapter.named}


SETTINGS = {"a": LoraSettings(8, 32.0, ALL, seed=1), "b": LoraSettings(4, 16.0, "q_proj,v_proj", seed=2),
            "c": LoraSettings(8, 32.0, ALL, seed=3)}


def test_one_adapter_trains_as_a_model_of_its_own():
    own = TinkerModelWorker(BackendSpec(None, lora=SETTINGS["a"], device="cpu", seed=1))  # a backend of its own
    shared = AdapterWorker(TINY_BASE)
    shared.add_model("a", SETTINGS["a"])
    for step in range(3):
        data = datums(step)
        mine = own.forward_backward(data, "cross_entropy", {}, False)
        fb, _ = shared.cycle([ForwardBackwardCall("a", data, "cross_entropy")], [("optim_step", "a", (ADAM,))])
        ours = fb[0]["result"]
        # A sum of ~300 in float32 (its spacing there is 3e-5): equal within a few units in the last place.
        assert ours["metrics"]["loss:sum"] == pytest.approx(mine["metrics"]["loss:sum"], rel=1e-6, abs=1e-5)
        for a, b in zip(ours["outputs"], mine["outputs"]):
            np.testing.assert_allclose(a["logprobs"], b["logprobs"], atol=1e-5)
        own.optim_step(ADAM)
    theirs = {n.replace(".default.", "."): p for n, p in own.backend.model.named_parameters() if p.requires_grad}
    ours = adapter_weights(shared, "a")
    assert set(theirs) == set(ours)
    # Float noise in a gradient near zero moves Adam's normalized update by a fraction of the learning
    # rate (measured 1.5e-5 after 3 steps with transformers 5.19); a step missing or made twice would
    # differ by the learning rate itself, 5e-3.
    assert max(float((theirs[n] - ours[n]).abs().max()) for n in ours) < 1e-4


def test_models_batched_together_train_as_each_alone_and_a_bad_request_fails_alone():
    together = AdapterWorker(TINY_BASE)
    for m, settings in SETTINGS.items():
        together.add_model(m, settings)
    passes = together.passes
    batched = train(together, list(SETTINGS), steps=3, together=True)
    assert together.passes - passes == 3  # one pass per step for all three models

    for m, settings in SETTINGS.items():
        alone = AdapterWorker(TINY_BASE)
        alone.add_model(m, settings)
        np.testing.assert_allclose(train(alone, [m], steps=3, together=False)[m], batched[m], atol=1e-5)
        mine, ours = adapter_weights(alone, m), adapter_weights(together, m)
        assert max(float((mine[n] - ours[n]).abs().max()) for n in ours) < 1e-5

    # A request with a token past the vocabulary, and one with an unknown loss, beside a good one.
    bad_tokens = [(np.array([1, 2, 5000]), {"target_tokens": np.array([2, 5000, 3])})]
    fb, _ = together.cycle([ForwardBackwardCall("a", bad_tokens, "cross_entropy"),
                            ForwardBackwardCall("b", datums(0), "no_such_loss"),
                            ForwardBackwardCall("c", datums(0), "cross_entropy", forward_only=True)], [])
    assert fb[0]["category"] == "user" and "vocabulary" in fb[0]["error"]
    assert fb[1]["category"] == "user" and "no_such_loss" in fb[1]["error"]
    assert fb[2]["result"]["metrics"]["loss:sum"] > 0
    # forward_only and the failures left every gradient alone.
    assert all(p.grad is None for p in together.model.parameters())
    # Also beside a training request in the same pass (whose backward reaches c's adapter too).
    together.cycle([ForwardBackwardCall("a", datums(1), "cross_entropy"),
                    ForwardBackwardCall("c", datums(1), "cross_entropy", forward_only=True)], [])
    assert all(p.grad is not None for p in together.adapters["a"].parameters())
    assert all(p.grad is None for p in together.adapters["c"].parameters())


def test_eviction_to_disk_and_back_is_bit_identical(tmp_path):
    resident = AdapterWorker(TINY_BASE)
    evicting = AdapterWorker(TINY_BASE, max_resident=1, offload_dir=str(tmp_path))
    for worker in (resident, evicting):
        for m, settings in SETTINGS.items():
            worker.add_model(m, settings)
    assert len(evicting._resident) == 1 and len(list(tmp_path.iterdir())) == 2
    # Accumulated gradients survive an eviction too: a's forward_backward, then b's and c's
    # turns, then a's optim_step.
    for worker in (resident, evicting):
        worker.cycle([ForwardBackwardCall("a", datums(5), "cross_entropy")], [])
    expected = train(resident, list(SETTINGS), steps=3, together=False)
    got = train(evicting, list(SETTINGS), steps=3, together=False)
    assert got == expected  # exactly: the same numbers, bit for bit
    for worker in (resident, evicting):
        worker.cycle([], [("optim_step", "a", (ADAM,))])
    for m in SETTINGS:
        mine, ours = adapter_weights(resident, m), adapter_weights(evicting, m)
        assert all(torch.equal(mine[n], ours[n]) for n in ours), m
    # A cycle of all three runs its batched pass in groups of one resident model.
    passes = evicting.passes
    evicting.cycle([ForwardBackwardCall(m, datums(1), "cross_entropy", forward_only=True) for m in SETTINGS], [])
    assert evicting.passes - passes == 3


def test_checkpoints_load_into_a_model_of_the_same_lora_and_nothing_else(tmp_path):
    shared = AdapterWorker(TINY_BASE)
    shared.add_model("b", SETTINGS["b"])
    train(shared, ["b"], steps=2, together=False)
    shared.save_state("b", str(tmp_path / "ckpt"))

    own = TinkerModelWorker(BackendSpec(None, lora=LoraSettings(4, 16.0, "q_proj,k_proj,v_proj,o_proj,lm_head"),
                                        device="cpu"))
    with pytest.raises(ValueError):  # q,k,v,o against b's q,v: refused, not loaded wrongly
        own.load_state(str(tmp_path / "ckpt"), True)

    again = AdapterWorker(TINY_BASE)
    again.add_model("x", SETTINGS["b"])
    again.load_state("x", str(tmp_path / "ckpt"), True)
    assert again.adapters["x"].step == 2
    np.testing.assert_allclose(train(again, ["x"], steps=1, together=False, data_of={"x": "b"})["x"],
                               train(shared, ["b"], steps=1, together=False)["b"], atol=0)


def test_workers_started_by_ray_as_the_server_starts_them_compute_on_every_core(ray_session):
    """Ray starts an actor that reserves no CPU with OMP_NUM_THREADS=1; the Tinker workers and
    the job runner raise torch's threads to the node's cores (the server's actors reserve none)."""
    import ray

    from opentinker.engine.cpu_threads import node_cores
    from opentinker.engine.tinker.sampler_worker import TinkerSampler
    from opentinker.server.runner import JobRunner

    if node_cores() < 2:
        pytest.skip("one core: nothing to raise")

    def threads(actor) -> int:
        return ray.get(actor.__ray_call__.remote(lambda _self: torch.get_num_threads()))

    @ray.remote(num_cpus=0)
    def bare() -> int:
        return torch.get_num_threads()

    assert ray.get(bare.remote()) == 1  # what the workers below would get on their own
    workers = [ray.remote(AdapterWorker).options(num_cpus=0).remote(TINY_BASE),
               ray.remote(TinkerSampler).options(num_cpus=0).remote(None, device="cpu"),
               ray.remote(JobRunner).options(num_cpus=0).remote("job", {"config": {}}, "/tmp/unused-job-dir")]
    try:
        assert [threads(worker) for worker in workers] == [node_cores()] * len(workers)
    finally:
        for worker in workers:
            ray.kill(worker)
