"""Many LoRA models sampled in one decode batch on the unchanged base model (no Ray: the
sampler actor's class in this process): each row gets its own adapter, and a sampled token's
logprob is the training model's logprob of it for that adapter."""

from __future__ import annotations

import asyncio

import numpy as np

from opentinker.engine.backend.lora import LoraSettings
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
    trainer = AdapterWorker(None, device="cpu")
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
