"""Every GPU path of the engine in one go, with one table at the end (never part of CI).

    python benchmarks/gpu_check.py [--out results.json] [--only update,rollout,...]
    make gpu-check

Meant for a GPU node that has torch, transformers and peft but maybe none of this project's
other dependencies (no Ray, vLLM or FastAPI): what needs a missing package is skipped and the
table says so. Models are built from a config in code (nothing is downloaded): a randomly
initialised Qwen2.5-0.5B-shaped model, and the embedded tiny model for whole GRPO/GAE runs
(``OPENTINKER_CACHE_DIR`` may point at a copy of it; otherwise it is built, ~3 min).

Checks (``--only`` picks some):

* ``hardware``: the GPU's bf16 matmul rate (8192^3) and its memory bandwidth (a 2 GiB copy):
  the peaks the rows below are measured against.
* ``update``: one full fine-tuning update on the 0.5B shape with ``LocalBackend`` (fp32 master
  weights, bf16 autocast on bf16 weight copies cast once per step, ``weight_casts.py``): 64 rows
  of 128 prompt + 512 response tokens, micro-batches of 16, then fused AdamW; then the same
  with autocast casting the weights in every micro-batch (the code before), and the peer:
  transformers' own ``model(labels=)`` loss on the same tokens and micro-batches. MFU = ``6 * parameters * tokens / seconds`` over the dense bf16 peak (attention
  FLOPs left out: an underestimate).
* ``packed``: padded against packed micro-batches (``use_remove_padding``: each sequence's
  attention its own, one varlen flash kernel) on ragged rows (responses of 64 to 512 tokens),
  same tokens, each after a warm-up; MFU over real tokens, and the two losses' difference.
* ``fsdp``: the same update on one FSDP2 rank (nccl, bf16 mixed precision), no Ray needed.
* ``lora``: the same update with LoRA rank 32 on every linear layer.
* ``rollout``: the transformers rollout engine, bf16, 64 and 256 prompts of 128 tokens + 256
  generated (``ignore_eos``), tokens/s against the decode's memory bound (every step reads all
  weights and each row's KV cache at the measured bandwidth): the eager loop, the slot decode
  (``slot_decode=True``: CUDA graphs per row bucket) and the peer, transformers'
  ``generate(cache_implementation="static")`` (which compiles), on the same prompts; the slot
  decode's greedy tokens against the eager loop's; then the compiled decode
  (``compile_decode=True``) against the eager loop on 64 rows (``benchmarks/compiled_decode.py``).
* ``adapters``: the Tinker multi-tenant worker, 4 LoRA models on one 0.5B base, one batched
  forward_backward + optim_step of all four; then each model's request of mixed row lengths
  (one row of 1,000 tokens and 31 of 16: padded to one pass that would be 32 x 1,000), the
  passes cut by padded tokens (``pass_plan``): peak GPU memory over the idle worker per real
  token.
* ``trl``: one GRPO step of ours (slot decode) against TRL's ``GRPOTrainer`` on the 0.5B shape,
  same prompts, tokens and batch (``benchmarks/grpo_vs_trl.py --device cuda``); needs trl,
  accelerate and datasets (``WHEELS=``), else the row says it was skipped.
* ``grpo`` / ``gae``: a few steps of the quickstart's GRPO (and of PPO with a critic) on the
  tiny model with ``trainer.device=cuda``: the recipe end to end on the GPU.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fsdp_scaling import PEAK_BF16_FLOPS  # noqa: E402
from model_shapes import qwen25_05b_folder  # noqa: E402

ROWS, PROMPT, RESPONSE, MICRO = 64, 128, 512, 16
TOKEN_HIGH = 150000  # random token ids below this (the 0.5B shape has 151936)
RECIPE_DEVICE = "cuda"  # of the grpo and gae checks
ROWS_OUT: list[dict] = []  # the table, one dict per row


def row(check: str, what: str, value: str, goal: str = "") -> None:
    ROWS_OUT.append({"check": check, "what": what, "value": value, "goal": goal})
    print(f"[gpu_check] {check:<9} {what:<44} {value:<28} {goal}", flush=True)


def synced_seconds(fn, repeats: int = 1, warmup: int = 0) -> float:
    """Seconds per call of ``fn`` on the GPU, after ``warmup`` untimed calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats


def free_memory() -> None:
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()


def spec_peak() -> float | None:
    name = torch.cuda.get_device_name()
    return next((flops for key, flops in PEAK_BF16_FLOPS.items() if key in name), None)


# -- checks -------------------------------------------------------------------------------
def check_hardware(state: dict) -> None:
    from rollout_throughput import measured_bandwidth

    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    matmul = 2 * 8192 ** 3 / synced_seconds(lambda: a @ b, 10, warmup=3)
    bandwidth = measured_bandwidth()  # a 2 GiB device-to-device copy
    state.update(matmul=matmul, bandwidth=bandwidth)
    row("hardware", torch.cuda.get_device_name(), f"torch {torch.__version__}")
    row("hardware", "bf16 matmul 8192^3", f"{matmul / 1e12:.0f} TFLOP/s",
        f"spec dense peak {spec_peak() / 1e12:.0f}" if spec_peak() else "")
    row("hardware", "copy bandwidth (read + write)", f"{bandwidth / 1e12:.2f} TB/s")


def training_batch():
    from opentinker.engine.batch import TokenBatch

    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, TOKEN_HIGH, (ROWS, PROMPT), generator=generator).tolist()
    responses = torch.randint(3, TOKEN_HIGH, (ROWS, RESPONSE), generator=generator).tolist()
    return TokenBatch.from_responses(prompts, responses)


def timed_updates(forward_backward, optim_step, batch, repeats: int = 2) -> float:
    """Seconds per update of the whole batch in micro-batches (after one warm-up update)."""
    def update():
        for start in range(0, len(batch), MICRO):
            forward_backward(batch.select(range(start, start + MICRO)))
        optim_step()

    return synced_seconds(update, repeats, warmup=1)


def report_update(check: str, label: str, seconds: float, parameters: int, state: dict, goal: str = "") -> None:
    tokens = ROWS * (PROMPT + RESPONSE)
    flops = 6 * parameters * tokens / seconds
    peak = spec_peak() or state.get("matmul")
    row(check, f"{label}: {tokens} tokens/update", f"{seconds:.2f} s, {tokens / seconds:,.0f} tok/s")
    row(check, f"{label}: MFU (6N/token, dense bf16 peak)", f"{flops / 1e12:.0f} TFLOP/s = {flops / peak:.1%}",
        goal or "goal >= 40%")
    row(check, f"{label}: peak GPU memory", f"{torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")


def check_update(state: dict, lora=None, check: str = "update") -> None:
    from opentinker.engine.backend import BackendSpec, make_backend
    from opentinker.engine.backend.base import AdamParams

    free_memory()
    backend = make_backend(BackendSpec(model_path=state["folder"], pad_token_id=0, device="cuda", lora=lora,
                                       share_prompt_prefix=False))
    parameters = sum(p.numel() for n, p in backend.model.named_parameters() if "lora_" not in n)
    seconds = timed_updates(lambda b: backend.forward_backward(b, "cross_entropy"),
                            lambda: backend.optim_step(AdamParams(lr=1e-6, grad_clip=1.0)), state["batch"])
    label = "LocalBackend full" if lora is None else f"LocalBackend LoRA r{lora.rank}"
    report_update(check, label, seconds, parameters, state,
                  "" if lora is None else "(frozen base: 6N overcounts ~1/3)")
    if lora is None:
        state["update_s"] = seconds
        casts, backend.weight_casts = backend.weight_casts, None  # autocast casting every micro-batch
        before = timed_updates(lambda b: backend.forward_backward(b, "cross_entropy"),
                               lambda: backend.optim_step(AdamParams(lr=1e-6, grad_clip=1.0)), state["batch"])
        backend.weight_casts = casts
        row(check, "without cached weight casts (autocast's per micro-batch)", f"{before:.2f} s",
            f"cached casts x{before / seconds:.2f} faster")
        peer = peer_update_seconds(state)
        free_memory()
        row(check, "peer: model(labels=), fp32 weights + bf16 autocast", f"{peer:.2f} s",
            f"ours x{peer / seconds:.2f} its speed (its LM head also runs on the prompts)")
    elif "update_s" in state:
        row(check, "LoRA / full update time", f"x{seconds / state['update_s']:.2f}")
    backend.close()


def peer_update_seconds(state: dict) -> float:
    """The same update through transformers' own loss: ``model(input_ids, labels=input_ids)``
    under bf16 autocast on fp32 weights, the same micro-batches, then fused AdamW."""
    from opentinker.engine.model_loading import load_causal_lm

    model = load_causal_lm(state["folder"], device=torch.device("cuda")).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=True)

    def forward_backward(batch) -> None:
        ids = torch.tensor([p + r for p, r in zip(batch.prompt_ids, batch.response_ids)], device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()

    def optim_step() -> None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return timed_updates(forward_backward, optim_step, state["batch"])  # its model goes with this frame


def ragged_batch(rows: int = ROWS):
    """GRPO-like rows whose responses stop at different lengths (64 to RESPONSE tokens)."""
    from opentinker.engine.batch import TokenBatch

    generator = torch.Generator().manual_seed(1)
    prompts = torch.randint(3, TOKEN_HIGH, (rows, PROMPT), generator=generator).tolist()
    lengths = torch.randint(64, RESPONSE + 1, (rows,), generator=generator).tolist()
    return TokenBatch.from_responses(prompts, [torch.randint(3, TOKEN_HIGH, (n,), generator=generator).tolist()
                                               for n in lengths])


def check_packed(state: dict) -> None:
    """Padded against packed micro-batches (use_remove_padding: varlen flash attention per
    sequence) on ragged rows, same model and tokens, interleaved; MFU counts real tokens only."""
    from opentinker.engine.backend import BackendSpec, make_backend
    from opentinker.engine.backend.base import AdamParams

    batch = ragged_batch()
    tokens = sum(len(p) + len(r) for p, r in zip(batch.prompt_ids, batch.response_ids))
    row("packed", "ragged batch: real / padded tokens", f"{tokens} / {len(batch) * (PROMPT + RESPONSE)}")
    seconds, losses = {}, {}
    for packed in (False, True):
        free_memory()
        backend = make_backend(BackendSpec(model_path=state["folder"], pad_token_id=0, device="cuda",
                                           share_prompt_prefix=False, use_remove_padding=packed))
        parameters = sum(p.numel() for p in backend.model.parameters())
        first = batch.select(range(MICRO))
        losses[packed] = backend.forward_loss(first, "cross_entropy").metrics["loss:sum"]
        seconds[packed] = timed_updates(lambda b: backend.forward_backward(b, "cross_entropy"),
                                        lambda: backend.optim_step(AdamParams(lr=1e-6, grad_clip=1.0)), batch)
        label = "packed (varlen)" if packed else "padded"
        flops = 6 * parameters * tokens / seconds[packed]
        row("packed", f"{label}: update", f"{seconds[packed]:.2f} s, {tokens / seconds[packed]:,.0f} real tok/s")
        row("packed", f"{label}: MFU on real tokens", f"{flops / (spec_peak() or state.get('matmul')):.1%}",
            "goal >= 40%")
        row("packed", f"{label}: peak GPU memory", f"{torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")
        backend.close()
    row("packed", "padded / packed update time", f"x{seconds[False] / seconds[True]:.2f}")
    row("packed", "first micro-batch loss: |packed - padded| / padded",
        f"{abs(losses[True] - losses[False]) / abs(losses[False]):.1e}", "bf16 rounding (~1e-3)")


def check_lora(state: dict) -> None:
    from opentinker.engine.backend.spec import LoraSettings

    check_update(state, LoraSettings(32, 64.0, "all-linear"), check="lora")


def check_fsdp(state: dict) -> None:
    import socket

    import torch.distributed as dist

    from opentinker.engine.backend import BackendSpec
    from opentinker.engine.backend.base import AdamParams
    from opentinker.engine.backend.fsdp_rank import FSDPRank

    free_memory()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    spec = BackendSpec(model_path=state["folder"], pad_token_id=0, strategy="fsdp", device="cuda",
                       share_prompt_prefix=False)
    rank = FSDPRank(0, 1, "127.0.0.1", port, spec)
    try:
        parameters = sum(p.numel() for p in rank.model.parameters())
        seconds = timed_updates(lambda b: rank.forward_backward(b, "cross_entropy", None, 1.0, False),
                                lambda: rank.optim_step(AdamParams(lr=1e-6, grad_clip=1.0)), state["batch"])
        report_update("fsdp", f"FSDP2 x1 ({dist.get_backend()})", seconds, parameters, state)
        if "update_s" in state:
            row("fsdp", "FSDP2 x1 / LocalBackend update time", f"x{seconds / state['update_s']:.2f}")
    finally:
        rank.shutdown()


def check_rollout(state: dict) -> None:
    from compiled_decode import compare, prompts_of
    from rollout_throughput import decode_bound, static_generate, tokens_per_second, transformers_engine

    from opentinker.engine.rollout.sampling import choose_tokens, counter_uniform
    from opentinker.tiny import ensure_tiny_model

    free_memory()
    cuda, bf16 = torch.device("cuda"), torch.bfloat16
    eager = transformers_engine(state["folder"], cuda, bf16)
    slots = transformers_engine(state["folder"], cuda, bf16, slot_decode=True)
    decoder = slots.slot_decoder
    generator = torch.Generator().manual_seed(1)
    tokens = 256
    for batch in (64, 256):
        prompts = torch.randint(3, TOKEN_HIGH, (batch, PROMPT), generator=generator).tolist()
        shape = f"{batch} x ({PROMPT} + {tokens})"
        bound = decode_bound(state["folder"], batch, PROMPT, tokens, state["bandwidth"])
        rate = tokens_per_second(eager, prompts, tokens, rounds=1)
        row("rollout", f"eager decode, {shape}", f"{rate:,.0f} tok/s = {rate / bound:.1%} of bound",
            f"bound {bound:,.0f}")
        start = time.perf_counter()
        ours = tokens_per_second(slots, prompts, tokens, rounds=1)
        total = time.perf_counter() - start
        how = ("CUDA graphs" if decoder.graphs_enabled else f"no graphs: {decoder.graph_error}") + (
            ", varlen flash" if decoder.varlen else ", sdpa")
        peer_first, peer = static_generate(state["folder"], prompts, tokens)
        row("rollout", f"slot decode ({how}), {shape}",
            f"{ours:,.0f} tok/s = {ours / bound:.1%} of bound = x{ours / peer:.2f} generate(static)",
            f"goal >= 25% and >= x2; x{ours / rate:.2f} eager; 2 calls {total:.0f} s with the captures")
        row("rollout", f"peer: generate(cache_implementation=static), {shape}", f"{peer:,.0f} tok/s",
            f"first call {peer_first:.0f} s (transformers compiles)")
        free_memory()
    # What sampling costs in a 256-row step: the inverse CDF runs in float64 over the vocabulary.
    rows = 256
    logits = torch.randn(rows, decoder.model.config.vocab_size, device=cuda)
    ones, seeds = torch.ones(rows, device=cuda), torch.arange(rows, device=cuda)

    def sample():
        return choose_tokens(logits, ones, seeds < 0, seeds * 0 - 1, ones, counter_uniform(seeds, seeds), filtered=False)

    sampling_ms = 1e3 * synced_seconds(sample, repeats=10, warmup=2)
    row("rollout", f"sampling alone, {rows} rows x {logits.shape[1]:,} vocab", f"{sampling_ms:.2f} ms a step",
        f"of {1e3 * rows / ours:.2f} ms a slot-decode step at {rows} rows")
    prompts = torch.randint(3, TOKEN_HIGH, (64, PROMPT), generator=generator).tolist()
    result = compare(eager, slots, prompts, 64, rounds=1)
    row("rollout", f"slot decode vs eager, greedy, 64 x ({PROMPT} + 64)",
        f"same tokens {result['same_rows']}/64", f"logprob gap {result['logprob_gap']:.0e} before any difference (bf16)")
    del slots, decoder
    free_memory()
    # Random weights give near-flat logits over 152k tokens, where any reordering of a bf16 sum
    # flips an argmax; the tiny model's trained, peaked distributions are the fair test.
    tiny, tiny_prompts = str(ensure_tiny_model()), prompts_of(64)
    for dtype in (torch.float32, bf16):
        result = compare(transformers_engine(tiny, cuda, dtype), transformers_engine(tiny, cuda, dtype, slot_decode=True),
                         tiny_prompts, 64, rounds=1)
        row("rollout", f"slot decode vs eager, greedy, tiny model, {str(dtype)[6:]}",
            f"same tokens {result['same_rows']}/64", f"logprob gap {result['logprob_gap']:.0e} before any difference")
    free_memory()
    compiled = transformers_engine(state["folder"], cuda, bf16, compile_decode=True)
    result = compare(eager, compiled, prompts, tokens, rounds=1)
    row("rollout", f"compiled decode, 64 x ({PROMPT} + {tokens})",
        f"{result['compiled_tok_s']:,.0f} tok/s = x{result['compiled_tok_s'] / result['eager_tok_s']:.2f} of eager",
        f"first call {result['first_call_s']:.0f} s; greedy same {result['same_rows']}/64, "
        f"logprob gap {result['logprob_gap']:.0e}")


def check_adapters(state: dict) -> None:
    import numpy as np

    from opentinker.engine.backend.spec import BackendSpec, LoraSettings
    from opentinker.engine.tinker.adapter_worker import AdapterWorker, ForwardBackwardCall
    from opentinker.engine.tinker.pass_plan import PassLimits

    free_memory()
    # A GPU server's --tinker-pass-tokens: 16,384 padded tokens a pass (the first cycle below is
    # one pass of 16 x 513).
    worker = AdapterWorker(BackendSpec(state["folder"], device="cuda", multi_adapter=True), limits=PassLimits.for_tokens(16_384))
    models = [f"user{i}" for i in range(4)]
    for i, model in enumerate(models):
        worker.add_model(model, LoraSettings(32, 64.0, "all-linear", seed=i))
    rng = np.random.default_rng(0)
    adam = {"learning_rate": 1e-4, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.0,
            "grad_clip_norm": 1.0}

    def datums(count: int = 4, length: int = 512):
        out = []
        for _ in range(count):
            tokens = rng.integers(3, TOKEN_HIGH, size=length + 1)
            out.append((tokens[:-1], {"target_tokens": tokens[1:], "weights": np.ones(length, np.float32)}))
        return out

    def cycle():
        calls = [ForwardBackwardCall(m, datums(), "cross_entropy") for m in models]
        results, done = worker.cycle(calls, [("optim_step", m, (adam,)) for m in models])
        failed = [r for r in [*results, *done] if "result" not in r]
        if failed:
            raise RuntimeError(f"adapter cycle failed: {failed[0]}")

    seconds = synced_seconds(cycle, 2, warmup=1)
    tokens = len(models) * 4 * 512
    row("adapters", "4 LoRA models x 4 rows x 512 on one base", f"{seconds:.2f} s/cycle, {tokens / seconds:,.0f} tok/s")
    row("adapters", "peak GPU memory", f"{torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")

    def mixed():  # per model: one row of 1,000 tokens and 31 of 16
        return [*datums(1, 1000), *datums(31, 16)]

    gc.collect()
    torch.cuda.synchronize()
    idle = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    passes, worker.largest_pass = worker.passes, (0, 0)
    start = time.perf_counter()
    results, done = worker.cycle([ForwardBackwardCall(m, mixed(), "cross_entropy") for m in models],
                                 [("optim_step", m, (adam,)) for m in models])
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    if any("result" not in r for r in [*results, *done]):
        raise RuntimeError(f"mixed-length adapter cycle failed: {[*results, *done]}")
    real = len(models) * (1000 + 31 * 16)
    peak = torch.cuda.max_memory_allocated() - idle
    row("adapters", f"mixed lengths: 4 x (1 x 1000 + 31 x 16), {worker.passes - passes} passes "
        f"(largest {worker.largest_pass[0]:,} padded tokens)",
        f"{seconds:.2f} s/cycle, peak +{peak / 2**30:.2f} GiB = {peak / real / 2**10:,.0f} KiB per real token")


def run_recipe(check: str, overrides: list[str]) -> None:
    from opentinker.engine.ppo.trainer import train

    free_memory()
    steps = 4
    start = time.perf_counter()
    history = train([f"trainer.device={RECIPE_DEVICE}", f"trainer.total_training_steps={steps}", "trainer.test_freq=-1",
                     "trainer.progress_bar=false", "trainer.seed=0", *overrides])
    seconds = time.perf_counter() - start
    rewards = [round(m["reward/mean"], 3) for m in history]
    finite = all(math.isfinite(v) for m in history for v in m.values() if isinstance(v, float))
    row(check, f"tiny model, {steps} steps on {RECIPE_DEVICE}: reward/mean", str(rewards),
        "every metric finite" if finite else "NaN or inf seen")
    if "critic/vf_loss" in history[-1]:  # the critic trained: its loss, step by step
        row(check, "critic vf_loss", str([round(m["critic/vf_loss"], 4) for m in history]))
    row(check, "median s/step (after the first)", f"{statistics.median(m['timing_s/step'] for m in history[1:]):.2f} s",
        f"{seconds:.0f} s in all")


def check_grpo(state: dict) -> None:
    run_recipe("grpo", [])


def check_gae(state: dict) -> None:  # the default actor lr (1e-6) barely moves it: same rewards as grpo
    run_recipe("gae", ["algorithm.adv_estimator=gae", "critic.optim.lr=1e-4"])


def check_trl(state: dict) -> None:
    """One GRPO step of ours (slot decode) vs TRL's GRPOTrainer on the 0.5B shape, same prompts,
    tokens and batch (``benchmarks/grpo_vs_trl.py --device cuda``)."""
    import importlib.util

    if importlib.util.find_spec("trl") is None:
        row("trl", "skipped: trl is not installed", "", "WHEELS= with trl, accelerate, datasets and theirs")
        return
    import grpo_vs_trl

    free_memory()
    results: dict = {}
    grpo_vs_trl.main(["--device", "cuda", "--model", state["folder"], "--steps", "3",
                      "--ours-override", "actor_rollout_ref.rollout.slot_decode=true"], results)
    ours, theirs = (statistics.median(results[name]["seconds"]) for name in ("ours", "trl"))
    row("trl", f"GRPO step, {grpo_vs_trl.PROMPTS_PER_STEP} x {grpo_vs_trl.SAMPLES_PER_PROMPT} x "
        f"{grpo_vs_trl.MAX_NEW_TOKENS} tokens, 0.5B shape", f"ours {ours:.2f} s, TRL {theirs:.2f} s = x{theirs / ours:.2f}",
        "goal >= x2")


CHECKS = {"hardware": check_hardware, "update": check_update, "packed": check_packed, "rollout": check_rollout,
          "grpo": check_grpo, "fsdp": check_fsdp, "lora": check_lora, "adapters": check_adapters, "gae": check_gae,
          "trl": check_trl}
NEEDS_MODEL = {"update", "packed", "rollout", "fsdp", "lora", "adapters", "trl"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default=",".join(CHECKS), help=f"comma-separated, of {', '.join(CHECKS)}")
    parser.add_argument("--out", type=Path, help="also write the table here as JSON")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device here", file=sys.stderr)
        return 2
    wanted = [name.strip() for name in args.only.split(",") if name.strip()]
    unknown = sorted(set(wanted) - set(CHECKS))
    if unknown:
        parser.error(f"--only: unknown check(s) {', '.join(unknown)} (known: {', '.join(CHECKS)})")
    state: dict = {}
    start = time.perf_counter()
    failures = 0
    for name in ["hardware", *[w for w in wanted if w != "hardware"]]:
        try:
            if name in NEEDS_MODEL and "folder" not in state:
                state["folder"], state["batch"] = qwen25_05b_folder(), training_batch()
            CHECKS[name](state)
        except Exception as error:  # one failing path must not hide the others
            failures += 1
            row(name, "FAILED", f"{type(error).__name__}: {str(error)[:200]}")
            traceback.print_exc()
        if args.out:
            args.out.write_text(json.dumps(ROWS_OUT, indent=1))
    print("\n| check | what | value | goal / note |\n|---|---|---|---|")
    for r in ROWS_OUT:
        print(f"| {r['check']} | {r['what']} | {r['value']} | {r['goal']} |")
    print(f"\n[gpu_check] {time.perf_counter() - start:.0f} s in all, {failures} check(s) failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
