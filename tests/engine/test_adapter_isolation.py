"""The shared LoRA worker keeps every model's training its own (issue 32, items 2 and 3):
unloading, adding or evicting one model never changes whether another trains or what it
learns (the audit: deleting the worker's first adapter froze the others through peft's
"active adapter"), and a request of mixed row lengths runs in passes bounded by what they cost
(padded tokens, attention cells), with the results and gradients of one pass."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from opentinker.engine.tinker.adapter_worker import AdapterWorker, ForwardBackwardCall
from opentinker.engine.tinker.pass_plan import PassLimits, cut_rows

from .test_adapter_worker import ADAM, SETTINGS, TINY_BASE, adapter_weights, datums, train


def step(worker: AdapterWorker, model_ids: list[str], number: int) -> dict[str, float]:
    """Step ``number`` of ``train``'s data for each model, in one cycle; each model's loss."""
    calls = [ForwardBackwardCall(m, datums(ord(m) + number), "cross_entropy") for m in model_ids]
    fb, done = worker.cycle(calls, [("optim_step", m, (ADAM,)) for m in model_ids])
    assert all("result" in d for d in done), done
    return {m: out["result"]["metrics"]["loss:sum"] for m, out in zip(model_ids, fb)}


def test_unloading_the_first_adapter_leaves_every_other_model_training_as_alone(tmp_path):
    # The audit's order: user 1 creates A (the worker's first adapter), user 2 creates B, user 1
    # creates C, then A is unloaded; later models come and go, and one is evicted to disk.
    shared = AdapterWorker(TINY_BASE, max_resident=2, offload_dir=str(tmp_path))
    for m in "abc":
        shared.add_model(m, SETTINGS[m])
    shared.remove_model("a")
    assert all(not p.requires_grad for adapter in shared.adapters.values() for p in adapter.parameters())
    got = [step(shared, ["b", "c"], 0)["b"]]
    c_after_one_step = adapter_weights(shared, "c")
    shared.add_model("d", SETTINGS["a"])  # b goes to disk (two resident)
    shared.remove_model("c")
    got.append(step(shared, ["b"], 1)["b"])
    shared.remove_model("d")
    got.append(step(shared, ["b"], 2)["b"])

    alone = AdapterWorker(TINY_BASE)
    alone.add_model("b", SETTINGS["b"])
    expected = train(alone, ["b"], steps=3, together=False)["b"]
    assert got[0] != got[-1]  # it trains: its loss moves
    np.testing.assert_allclose(got, expected, rtol=1e-6)
    mine, ours = adapter_weights(alone, "b"), adapter_weights(shared, "b")
    assert max(float((mine[n] - ours[n]).abs().max()) for n in ours) < 1e-6
    assert shared.adapters["b"].step == 3
    c_alone = AdapterWorker(TINY_BASE)
    c_alone.add_model("c", SETTINGS["c"])
    step(c_alone, ["c"], 0)
    mine = adapter_weights(c_alone, "c")  # c (peft froze part of it in the audit) trained in full
    assert max(float((mine[n] - c_after_one_step[n]).abs().max()) for n in mine) < 1e-6


def test_a_forward_beside_a_training_request_leaves_its_gradients_alone():
    shared = AdapterWorker(TINY_BASE)
    for m in "ab":
        shared.add_model(m, SETTINGS[m])
    shared.cycle([ForwardBackwardCall("a", datums(1), "cross_entropy"),
                  ForwardBackwardCall("b", datums(1), "cross_entropy", forward_only=True)], [])
    assert all(p.grad is not None for p in shared.adapters["a"].parameters())
    assert all(p.grad is None for p in shared.adapters["b"].parameters())


def mixed_lengths(short: int, long: int, seed: int = 0) -> list:
    """``short`` datums of 2 tokens and one of ``long`` tokens (the audit's mix, smaller)."""
    rng = np.random.default_rng(seed)
    out = []
    for length in [2] * (short // 2) + [long] + [2] * (short - short // 2):
        tokens = rng.integers(3, 1000, size=length + 1)
        out.append((tokens[:-1], {"target_tokens": tokens[1:], "weights": np.ones(length, np.float32)}))
    return out


def test_rows_are_cut_into_groups_of_similar_length_within_the_limits():
    limits = PassLimits(tokens=64, attention=64 * 64)
    lengths = [3] * 40 + [60] + [10] * 5
    groups = cut_rows(lengths, limits)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    assert groups[0] == [40]  # the long row alone: 2 x 60 would pass 64 padded tokens
    for group in groups:
        longest, shortest = max(lengths[i] for i in group), min(lengths[i] for i in group)
        assert len(group) == 1 or (len(group) * longest <= 64 and len(group) * longest ** 2 <= 64 * 64)
        assert 2 * shortest >= longest  # padding at most doubles a group's tokens
    assert [lengths[g[0]] for g in groups] == sorted((lengths[g[0]] for g in groups), reverse=True)


def test_a_mixed_length_request_runs_in_bounded_passes_with_the_gradients_of_one_pass():
    data = mixed_lengths(short=24, long=120)
    # Padded as one pass: 25 rows x 121 positions. Bounded: the long row alone, the rest together.
    limits = PassLimits(tokens=128, attention=128 * 128)
    results, grads = [], []
    for worker in (AdapterWorker(TINY_BASE), AdapterWorker(TINY_BASE, limits=limits)):
        worker.add_model("a", SETTINGS["a"])
        fb, _ = worker.cycle([ForwardBackwardCall("a", data, "cross_entropy")], [])
        results.append(fb[0]["result"])
        grads.append({n: p.grad.clone() for n, p in worker.adapters["a"].named})
        passes, largest = worker.passes, worker.largest_pass
    one, bounded = results
    assert passes == 2 and largest[0] <= 128 and largest[1] <= 128 * 128
    assert bounded["metrics"]["loss:sum"] == pytest.approx(one["metrics"]["loss:sum"], rel=1e-6)
    assert [len(o["logprobs"]) for o in bounded["outputs"]] == [len(tokens) for tokens, _ in data]
    for mine, ours in zip(bounded["outputs"], one["outputs"]):
        np.testing.assert_allclose(mine["logprobs"], ours["logprobs"], atol=1e-5)
    for name, grad in grads[0].items():  # to float rounding: other kernels (no padding mask), other sums
        assert float((grads[1][name] - grad).abs().max()) <= 1e-5 * float(grad.abs().max()), name


def test_a_pass_that_fails_for_one_model_fails_that_request_only():
    """Model c's adapter is broken (a weight of the wrong shape: its rows fail inside the
    batched pass); b, in the same pass, trains as it does alone and the worker goes on."""
    shared, alone = AdapterWorker(TINY_BASE), AdapterWorker(TINY_BASE)
    for m in "bc":
        shared.add_model(m, SETTINGS[m])
    alone.add_model("b", SETTINGS["b"])
    name, broken = shared.adapters["c"].named[0]
    broken.data = torch.zeros(3, 3)
    fb, done = shared.cycle([ForwardBackwardCall("c", datums(1), "cross_entropy"),
                             ForwardBackwardCall("b", datums(ord("b")), "cross_entropy")],
                            [("optim_step", "b", (ADAM,))])
    assert fb[0]["category"] == "server" and "result" not in fb[0]
    expected = train(alone, ["b"], steps=1, together=False)["b"]
    assert fb[1]["result"]["metrics"]["loss:sum"] == pytest.approx(expected[0], rel=1e-6)
    assert "result" in done[0]
    mine, ours = adapter_weights(alone, "b"), adapter_weights(shared, "b")
    assert max(float((mine[n] - ours[n]).abs().max()) for n in ours) < 1e-6
