"""Many LoRA models sampled in one decode batch on the unchanged base model (no Ray: the
sampler actor's class in this process): each row gets its own adapter, and a sampled token's
logprob is the training model's logprob of it for that adapter."""

from __future__ import annotations

import asyncio

import numpy as np

from opentinker.engine.backend.spec import BackendSpec, LoraSettings
from opentinker.engine.tinker.adapter_worker import AdapterWorker, ForwardBackwardCall
from opentinker.engine.tinker.sampler_worker import BASE, TinkerSampler

ADAM = {"learning_rate": 2e-2, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.0, "grad_clip_norm": 0.0}
MODELS = {"a": LoraSettings(8, 32.0, "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj", seed=1),
          "b": LoraSettings(4, 16.0, "q_proj,v_proj", seed=2),
          "c": LoraSettings(8, 32.0, "gate_proj,up_proj,down_proj", seed=3)}
PROMPT = [5, 9, 12, 40, 41]
MAX_TOKENS = 6


def datum(tokens: list[int]):
    tokens = np.asarray(tokens)
    return tokens[:-1], {"target_tokens": tokens[1:], "weights": np.ones(len(tokens) - 1, np.float32)}


def test_rows_of_different_adapters_decode_together_with_each_models_own_logprobs(tmp_path):
    trainer = AdapterWorker(BackendSpec(None, device="cpu", multi_adapter=True))
    folders = {}
    for name, settings in MODELS.items():
        trainer.add_model(name, settings)
        for step in range(3):  # moved well away from the base (B starts at zero)
            target = [7 + 3 * ord(name) % 50 + step] * 10
            trainer.cycle([ForwardBackwardCall(name, [datum(PROMPT + target)], "cross_entropy")],
                          [("optim_step", name, (ADAM,))])
        folders[name] = str(tmp_path / name)
        trainer.save_sampler_weights(name, folders[name])

    sampler = TinkerSampler(None, device="cpu")
    requests = {name: {"snapshot": folder, "prompt": PROMPT, "num_samples": 2, "user": name,
                       "params": {"max_tokens": MAX_TOKENS, "temperature": 1.0, "seed": 11}}
                for name, folder in folders.items()}
    requests["base"] = {**requests["a"], "snapshot": BASE, "user": "base"}

    async def sample_all():
        return await asyncio.gather(*(sampler.sample(request) for request in requests.values()))

    results = dict(zip(requests, asyncio.run(sample_all())))
    # One lane on the base weights for everyone: never a weight swap, and far fewer decode
    # steps than the 4 calls one after another would take.
    assert sampler.loaded == BASE
    assert sampler.scheduler.steps < 2 * MAX_TOKENS

    trainer.add_model("base", LoraSettings(4, 16.0, "q_proj", seed=0))  # B = 0: the base model itself
    for name, result in results.items():
        for tokens, logprobs, _ in result["sequences"]:
            full = PROMPT + list(tokens)
            fb, _ = trainer.cycle([ForwardBackwardCall(name, [datum(full)], "cross_entropy", forward_only=True)], [])
            expected = fb[0]["result"]["outputs"][0]["logprobs"][len(PROMPT) - 1:]
            np.testing.assert_allclose(logprobs, expected, atol=2e-4, err_msg=name)
    # The models really differ: the same seeded sample differs between them.
    assert len({tuple(results[name]["sequences"][0][0]) for name in requests}) > 1


def test_the_samplers_adapter_cache_is_bounded_in_bytes_and_deleted_snapshots_leave_it(tmp_path):
    """The audit's pattern (many large snapshots sampled one after another, and at once) on a
    cache with room for two adapters: it never holds more bytes than its budget, every call
    is still served, a deleted snapshot's adapter leaves it, and an adapter larger than the
    whole budget is refused naming the flag."""
    import pytest
    import torch

    from opentinker.engine.tinker.row_adapters import adapter_bytes

    trainer = AdapterWorker(BackendSpec(None, device="cpu", multi_adapter=True))
    trainer.add_model("a", LoraSettings(32, 64.0, "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj", seed=1))
    folders = []
    for index in range(6):  # a snapshot per step: each one different
        trainer.cycle([ForwardBackwardCall("a", [datum(PROMPT + [7 + index] * 6)], "cross_entropy")],
                      [("optim_step", "a", (ADAM,))])
        folders.append(str(tmp_path / f"step-{index}"))
        trainer.save_sampler_weights("a", folders[-1])
    one = adapter_bytes(folders[0], torch.float32)
    assert one > 100_000
    budget = 2 * one + one // 2
    sampler = TinkerSampler(None, device="cpu", limits={"adapter_cache_bytes": budget})

    def request(folder):
        return {"snapshot": folder, "prompt": PROMPT, "num_samples": 2, "user": folder,
                "params": {"max_tokens": 3, "temperature": 1.0, "seed": 5}}

    async def one_by_one_then_all_at_once():
        alone = [await sampler.sample(request(folder)) for folder in folders]
        stats = sampler.stats()["adapter_cache"]
        assert stats["adapters"] == 2 and stats["bytes"] == 2 * one  # the tensors' bytes, as the header said
        together = await asyncio.gather(*(sampler.sample(request(folder)) for folder in folders))
        await sampler.sample(request(folders[0]))  # cached now, whatever the others did
        await sampler.evict(folders[0])
        return alone, together

    alone, together = asyncio.run(one_by_one_then_all_at_once())
    stats = sampler.stats()["adapter_cache"]
    assert stats["peak_bytes"] <= budget, stats
    assert stats["adapters"] == 1 and stats["bytes"] == one and stats["held"] == 0
    # Every call was served with its own adapter, waiting for room or not (seeded: the same
    # tokens; logprobs to float rounding of the batched forward).
    for mine, batched in zip(alone, together):
        assert [tokens for tokens, _, _ in mine["sequences"]] == [tokens for tokens, _, _ in batched["sequences"]]
        for (_, logprobs, _), (_, batched_logprobs, _) in zip(mine["sequences"], batched["sequences"]):
            np.testing.assert_allclose(logprobs, batched_logprobs, atol=1e-5)
    assert len({tuple(r["sequences"][0][0]) for r in alone}) > 1

    small = TinkerSampler(None, device="cpu", limits={"adapter_cache_bytes": one - 1})
    with pytest.raises(ValueError, match=r"more than the sampler's whole adapter cache .*--tinker-sampler-adapter-cache-mb"):
        asyncio.run(small.sample(request(folders[0])))
    assert small.stats()["adapter_cache"]["bytes"] == 0
