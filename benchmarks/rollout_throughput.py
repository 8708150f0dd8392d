"""Generated tokens per second: the transformers rollout engine vs the vLLM one, same prompts,
same run.

    python benchmarks/rollout_throughput.py [--prompts 64] [--tokens 64] [--rounds 3]   # CPU, tiny model
    python benchmarks/rollout_throughput.py --gpu [--prompts 256] [--tokens 512]        # a GPU node

Both engines get the same prompt token ids (arithmetic questions of the built-in task on the
tiny model; random ids on the GPU model), temperature 1, and generate exactly ``--tokens``
tokens each (``ignore_eos``), so the work is equal. Each engine does one untimed warm-up
round, then ``--rounds`` timed ones; the median round is reported as tokens/s, with the ratio.

GPU (``--gpu``): a randomly initialised Qwen2.5-0.5B-shaped model (config in code, no
download) in bf16. The decode bound printed beside it: every decode step reads all weights
once plus each sequence's KV cache, so at the GPU's memory bandwidth (measured here with a
large device-to-device copy) ``tokens/s <= prompts / (weight bytes + mean KV bytes per step)
* bandwidth``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from opentinker.engine.rollout import SamplingParams


def arithmetic_prompts(count: int) -> tuple[str, list[list[int]]]:
    from opentinker.engine.data import chat_prompt_ids
    from opentinker.engine.model_loading import load_tokenizer
    from opentinker.tiny import ensure_tiny_model
    from opentinker.environments.arithmetic import make_problems

    folder = str(ensure_tiny_model())
    tokenizer = load_tokenizer(folder)
    return folder, [chat_prompt_ids(tokenizer, p.messages()) for p in make_problems(count, seed=3)]


def transformers_engine(folder: str, device: torch.device, dtype: torch.dtype, compile_decode: bool = False,
                        slot_decode: bool = False):
    from opentinker.engine.model_loading import eos_token_ids, load_causal_lm, load_tokenizer
    from opentinker.engine.rollout.transformers_engine import TransformersRolloutEngine

    tokenizer = load_tokenizer(folder)
    model = load_causal_lm(folder, dtype=dtype, device=device)
    return TransformersRolloutEngine(model, eos_token_ids(tokenizer, folder), tokenizer.pad_token_id, seed=0,
                                     compile_decode=compile_decode, slot_decode=slot_decode)


def vllm_engine(folder: str, max_model_len: int, **kwargs):
    from opentinker.engine.rollout.vllm_engine import VLLMRolloutEngine

    return VLLMRolloutEngine(folder, max_model_len=max_model_len, **kwargs)


def tokens_per_second(engine, prompts: list[list[int]], tokens: int, rounds: int) -> float:
    params = SamplingParams(temperature=1.0, max_tokens=tokens, ignore_eos=True)
    engine.generate(prompts, params)  # warm-up: allocations, kernels, caches
    seconds = []
    for _ in range(rounds):
        start = time.perf_counter()
        completions = engine.generate(prompts, params)
        seconds.append(time.perf_counter() - start)
        assert all(len(c.token_ids) == tokens for c in completions)
    return len(prompts) * tokens / statistics.median(seconds)


def static_generate(folder: str, prompts: list[list[int]], tokens: int) -> tuple[float, float]:
    """The peer on a GPU: transformers' ``generate(cache_implementation="static")`` (sampled,
    exactly ``tokens`` new tokens per row) on a bf16 copy of the model: its first call's
    seconds (transformers compiles the decode step) and tokens/s of the second."""
    import signal

    from opentinker.engine.model_loading import load_causal_lm

    model = load_causal_lm(folder, dtype=torch.bfloat16, device="cuda").eval()
    ids = torch.tensor(prompts, device="cuda")
    options = dict(max_new_tokens=tokens, min_new_tokens=tokens, do_sample=True, pad_token_id=0,
                   attention_mask=torch.ones_like(ids), cache_implementation="static")
    seconds = []

    def give_up(*_):
        raise TimeoutError("generate(static) took over 300 s")

    signal.signal(signal.SIGALRM, give_up)
    signal.alarm(300)  # a compile that hangs must not hold the machine
    try:
        for _ in range(2):
            torch.cuda.synchronize()
            start = time.perf_counter()
            model.generate(ids, **options)
            torch.cuda.synchronize()
            seconds.append(time.perf_counter() - start)
    finally:
        signal.alarm(0)
    del model
    return seconds[0], len(prompts) * tokens / seconds[1]


def measured_bandwidth() -> float:
    """Bytes/s of a 2 GiB device-to-device copy (read + write)."""
    source = torch.empty(1 << 30, dtype=torch.bfloat16, device="cuda")
    target = torch.empty_like(source)
    target.copy_(source)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(10):
        target.copy_(source)
    torch.cuda.synchronize()
    return 10 * 2 * source.numel() * source.element_size() / (time.perf_counter() - start)


def decode_bound(folder: str, prompts: int, prompt_length: int, tokens: int, bandwidth: float) -> float:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(folder)
    head_dim = config.hidden_size // config.num_attention_heads
    layers = config.num_hidden_layers
    embed = config.vocab_size * config.hidden_size
    attention = config.hidden_size * head_dim * (2 * config.num_attention_heads + 2 * config.num_key_value_heads)
    mlp = 3 * config.hidden_size * config.intermediate_size
    weight_bytes = 2 * (embed + layers * (attention + mlp))  # bf16; tied embeddings read once as the LM head
    kv_per_token = 2 * layers * 2 * config.num_key_value_heads * head_dim  # K and V, bf16
    mean_context = prompt_length + tokens / 2
    step_bytes = weight_bytes + prompts * mean_context * kv_per_token
    return prompts * bandwidth / step_bytes


def report(results: dict[str, float]) -> None:
    for name, rate in results.items():
        print(f"{name:<13} {rate:>10.0f} tokens/s", flush=True)
    if len(results) == 2:
        print(f"vllm / transformers: x{results['vllm'] / results['transformers']:.2f}")


def cpu(args) -> None:
    folder, prompts = arithmetic_prompts(args.prompts)
    max_len = max(len(p) for p in prompts) + args.tokens
    print(f"CPU, tiny model, {len(prompts)} prompts x {args.tokens} tokens, {torch.get_num_threads()} torch threads, "
          f"load average {os.getloadavg()[0]:.2f}", flush=True)
    results = {}
    if args.only in (None, "transformers"):
        results["transformers"] = tokens_per_second(transformers_engine(folder, torch.device("cpu"), torch.float32),
                                                    prompts, args.tokens, args.rounds)
    if args.only in (None, "vllm"):
        engine = vllm_engine(folder, max_len)
        try:
            results["vllm"] = tokens_per_second(engine, prompts, args.tokens, args.rounds)
        finally:
            engine.close()
    report(results)


def gpu(args) -> None:
    from model_shapes import qwen25_05b_folder

    folder = qwen25_05b_folder()
    generator = torch.Generator().manual_seed(0)
    prompt_length = 128
    prompts = torch.randint(3, 1536, (args.prompts, prompt_length), generator=generator).tolist()
    name = torch.cuda.get_device_name()
    bandwidth = measured_bandwidth()
    print(f"{name}, random Qwen2.5-0.5B shape, bf16, {args.prompts} prompts x {prompt_length} + {args.tokens} tokens",
          flush=True)
    results = {}
    if args.only in (None, "transformers"):
        engine = transformers_engine(folder, torch.device("cuda"), torch.bfloat16)
        results["transformers"] = tokens_per_second(engine, prompts, args.tokens, args.rounds)
        del engine
        torch.cuda.empty_cache()
    if args.only in (None, "vllm"):
        engine = vllm_engine(folder, prompt_length + args.tokens, dtype="bfloat16", gpu_memory_utilization=0.8)
        try:
            results["vllm"] = tokens_per_second(engine, prompts, args.tokens, args.rounds)
        finally:
            engine.close()
    report(results)
    bound = decode_bound(folder, args.prompts, prompt_length, args.tokens, bandwidth)
    print(f"decode bound at the measured {bandwidth / 1e12:.2f} TB/s: {bound:.0f} tokens/s "
          + ", ".join(f"({name} at {rate / bound:.0%} of it)" for name, rate in results.items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpu", action="store_true", help="the Qwen2.5-0.5B-shaped run on a CUDA GPU")
    parser.add_argument("--prompts", type=int, default=None, help="default 64 on CPU, 256 on a GPU")
    parser.add_argument("--tokens", type=int, default=None, help="default 64 on CPU, 512 on a GPU")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--only", choices=["transformers", "vllm"])
    args = parser.parse_args()
    args.prompts = args.prompts or (256 if args.gpu else 64)
    args.tokens = args.tokens or (512 if args.gpu else 64)
    start = time.perf_counter()
    gpu(args) if args.gpu else cpu(args)
    print(f"[rollout_throughput] {time.perf_counter() - start:.0f} s in all")


if __name__ == "__main__":
    main()
