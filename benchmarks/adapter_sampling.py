"""K users sampling from K LoRA models at once: rows of every adapter in one decode batch,
against the same models saved as full weights (the sampler swaps weights between users).

    python benchmarks/adapter_sampling.py [--ks 1,4,8] [--samples 4] [--tokens 32] [--rank 8]

In this process (no Ray, no server): K LoRA models are trained a few steps on the tiny model
(one ``AdapterWorker``), each saved twice: as its adapter (what ``save_weights_for_sampler``
writes for a LoRA model) and as full merged weights (what it writes for a fully fine-tuned
model). One ``TinkerSampler`` then serves K concurrent calls (one per user, ``--samples`` x
``--tokens`` tokens, ``ignore_eos``) first from the adapters, then from the full snapshots.
Printed per K: wall time, decode steps, weight loads and the speed-up.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path
import tempfile

import numpy as np
import torch

from opentinker.engine.backend.spec import BackendSpec, LoraSettings
from opentinker.engine.tinker.adapter_worker import AdapterWorker, ForwardBackwardCall
from opentinker.engine.tinker.model_worker import SAMPLER_WEIGHTS_FILE
from opentinker.engine.tinker.row_adapters import LoadedAdapter
from opentinker.engine.tinker.sampler_worker import TinkerSampler

ALL = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"
ADAM = {"learning_rate": 1e-2, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.0, "grad_clip_norm": 0.0}
PROMPT = [5, 9, 12, 40, 41, 42, 43, 17]


def snapshots(k: int, rank: int, folder: Path) -> tuple[list[str], list[str]]:
    """K trained models' adapter folders and full-weight folders."""
    trainer = AdapterWorker(BackendSpec(None, device="cpu", multi_adapter=True))
    base = {name: t.detach().clone() for name, t in trainer.base.state_dict().items()}
    adapters, fulls = [], []
    for i in range(k):
        name = f"m{i}"
        trainer.add_model(name, LoraSettings(rank, 32.0, ALL, seed=i))
        tokens = np.asarray(PROMPT + [100 + i] * 8)
        data = [(tokens[:-1], {"target_tokens": tokens[1:], "weights": np.ones(len(tokens) - 1, np.float32)})]
        for _ in range(2):
            trainer.cycle([ForwardBackwardCall(name, data, "cross_entropy")], [("optim_step", name, (ADAM,))])
        adapters.append(str(folder / f"{name}-adapter"))
        trainer.save_sampler_weights(name, adapters[-1])
        loaded = LoadedAdapter(adapters[-1], torch.device("cpu"), torch.float32)
        merged = dict(base)
        for path, (lora_a, lora_b, scaling) in loaded.layers.items():
            merged[f"{path}.weight"] = base[f"{path}.weight"] + (lora_b @ lora_a) * scaling
        fulls.append(str(folder / f"{name}-full"))
        Path(fulls[-1]).mkdir(parents=True)
        torch.save(merged, Path(fulls[-1]) / SAMPLER_WEIGHTS_FILE)
    trainer.close()
    return adapters, fulls


def serve(sampler: TinkerSampler, folders: list[str], samples: int, tokens: int) -> tuple[float, int, int]:
    """All users' calls at once; (seconds, decode steps, weight loads)."""
    loads = [0]
    load = sampler.scheduler.load

    def counted(snapshot: str) -> None:
        loads[0] += 1
        load(snapshot)

    sampler.scheduler.load = counted
    steps = sampler.scheduler.steps
    requests = [{"snapshot": f, "prompt": PROMPT, "num_samples": samples, "user": f"user{i}",
                 "params": {"max_tokens": tokens, "temperature": 1.0, "seed": i, "ignore_eos": True}}
                for i, f in enumerate(folders)]

    async def run() -> None:
        await asyncio.gather(*(sampler.sample(r) for r in requests))

    start = time.perf_counter()
    asyncio.run(run())
    seconds = time.perf_counter() - start
    sampler.scheduler.load = load
    return seconds, sampler.scheduler.steps - steps, loads[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ks", default="1,4,8")
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--rank", type=int, default=8)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"K users x {args.samples} samples x {args.tokens} tokens, LoRA rank {args.rank}, tiny model, 1 thread")
    print(f"{'K':>3} {'adapters: s':>12} {'steps':>6} {'loads':>6} {'full weights: s':>16} {'steps':>6} "
          f"{'loads':>6} {'speed-up':>9}")
    for k in [int(x) for x in args.ks.split(",")]:
        with tempfile.TemporaryDirectory() as tmp:
            adapters, fulls = snapshots(k, args.rank, Path(tmp))
            sampler = TinkerSampler(None, device="cpu")
            serve(sampler, adapters[:1], 1, 2)  # warm-up
            a = serve(sampler, adapters, args.samples, args.tokens)
            f = serve(sampler, fulls, args.samples, args.tokens)
            print(f"{k:>3} {a[0]:>12.2f} {a[1]:>6} {a[2]:>6} {f[0]:>16.2f} {f[1]:>6} {f[2]:>6} {f[0] / a[0]:>8.2f}x",
                  flush=True)


if __name__ == "__main__":
    main()
