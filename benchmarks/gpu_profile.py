"""Where a GPU update's time goes, beside transformers' own paths (a CUDA machine; never in CI).

    python benchmarks/gpu_profile.py

On the Qwen2.5-0.5B shape (random weights, config in code), one micro-batch of 16 rows x
(128 + 512) tokens:

* ``LocalBackend.forward_backward`` with the logprob chunks of the CPU (4 MiB) and of the GPU
  (256 MiB), side by side: each chunk costs a few kernel launches;
* the torch profiler's top kernels of the GPU-sized run;
* the peer: the same tokens through ``model(labels=...)`` (transformers' own loss), with fp32
  weights under bf16 autocast as ours, and with the model cast to bf16;
* decoding 64 rows x 256 tokens with ``model.generate``: its dynamic KV cache vs
  ``cache_implementation="static"`` (which transformers compiles), first call and then.
"""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_check import synced_seconds  # noqa: E402
from model_shapes import qwen25_05b_folder  # noqa: E402

from opentinker.engine.backend import BackendSpec, make_backend, token_logprobs  # noqa: E402
from opentinker.engine.batch import TokenBatch  # noqa: E402

PROMPT, RESPONSE, ROWS = 128, 512, 16


def main() -> None:
    from torch.profiler import ProfilerActivity, profile

    folder = qwen25_05b_folder()
    generator = torch.Generator().manual_seed(0)
    batch = TokenBatch.from_responses(torch.randint(3, 150000, (ROWS, PROMPT), generator=generator).tolist(),
                                      torch.randint(3, 150000, (ROWS, RESPONSE), generator=generator).tolist())
    backend = make_backend(BackendSpec(model_path=folder, pad_token_id=0, device="cuda", share_prompt_prefix=False))
    model = backend.model
    parameters = sum(p.numel() for p in model.parameters())
    tokens = ROWS * (PROMPT + RESPONSE)

    def report(label: str, seconds: float) -> None:
        print(f"[gpu_profile] {label}: {seconds * 1e3:.0f} ms = {6 * parameters * tokens / seconds / 1e12:.0f} TFLOP/s",
              flush=True)

    def ours():
        backend.forward_backward(batch, "cross_entropy")
        model.zero_grad(set_to_none=True)

    gpu_chunk = token_logprobs.GPU_CHUNK_ELEMENTS
    for chunk in (token_logprobs.CHUNK_ELEMENTS, gpu_chunk):
        token_logprobs.GPU_CHUNK_ELEMENTS = chunk
        report(f"LocalBackend fwd+bwd, {tokens} tokens, logprob chunks of {chunk * 4 >> 20} MiB",
               synced_seconds(ours, 3, warmup=1))
    token_logprobs.GPU_CHUNK_ELEMENTS = gpu_chunk
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        ours()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15), flush=True)

    ids = torch.tensor([p + r for p, r in zip(batch.prompt_ids, batch.response_ids)], device="cuda")

    def peer():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        model.zero_grad(set_to_none=True)

    report("peer: model(labels=) fp32 weights + bf16 autocast", synced_seconds(peer, 3, warmup=1))
    model.to(torch.bfloat16)
    report("peer: model(labels=) bf16 weights", synced_seconds(peer, 3, warmup=1))

    model.eval()
    prompt = torch.randint(3, 150000, (64, PROMPT), device="cuda")
    new = 256
    for cache in ("dynamic", "static"):
        options = dict(max_new_tokens=new, min_new_tokens=new, do_sample=True, pad_token_id=0)
        if cache == "static":
            options["cache_implementation"] = "static"
        signal.alarm(300)  # a compile that hangs must not hold the machine
        start = time.perf_counter()
        model.generate(prompt, **options)
        first = time.perf_counter() - start
        rate = 64 * new / synced_seconds(lambda: model.generate(prompt, **options), 1, warmup=1)
        signal.alarm(0)
        print(f"[gpu_profile] generate, {cache} cache, 64 x {new}: first call {first:.1f} s, then {rate:,.0f} tokens/s",
              flush=True)


if __name__ == "__main__":
    main()
