"""Each phase of a GRPO step against this machine's own limits: a roofline per phase.

    python benchmarks/roofline.py [--steps 5] [--tokens 64] [--no-tinker | --only-tinker] [--eager-decode]
                                  [--compare-with REV]

1. This machine's peaks, with the torch threads the trainer uses: an fp32 matmul of 2048^3
   (the compute peak), the same at the model's own shapes (a decode step's 64 rows, an update's
   4096 tokens), and the memory bandwidth of a 256 MiB copy (read + write).
2. A seeded GRPO run on the embedded tiny model with grpo_vs_trl.py's work: 8 prompts x 8
   samples, exactly ``--tokens`` sampled tokens each, a KL loss (so a reference pass), one
   update per step, the rollout's decode compiled (``--eager-decode``: not). Each phase's median
   time over the steps after the first (the trainer's ``timing_s/*``); the first step's time
   is printed apart (it includes the compile).
3. The arithmetic of each phase, counted from the model's config: every matmul (2 FLOPs per
   weight per token; the LM head only where logits are taken) and attention (4 x layers x
   heads x head_dim x context per token); prompts once per group (the rollout's prefill and
   the scorer share them); the update is 3x a forward pass (backward twice). Bytes: a decode
   step reads every weight and each row's KV cache.
4. Per phase: time, compute bound (FLOPs / matmul peak), memory bound (bytes / bandwidth),
   which one applies, and the fraction of it reached; then the whole step's.
5. Per phase, "matmuls alone": the phase's matmuls at its own shapes, run back to back with
   nothing else, as a share of the 2048^3 rate. No implementation on this BLAS gets a phase
   closer to its compute bound than that share; the gap between it and "of bound" is everything
   else (attention, norms, sampling, Python).

With the Tinker path (default; ``--no-tinker`` skips it): one LoRA ``forward_backward`` +
``optim_step`` of 8 rows x 64 tokens through a real server and the real ``tinker`` SDK, against
the same calls on the same worker class in this process: the service's overhead as a ratio,
and per call (forward_backward alone, optim_step alone, and a bare HTTP round trip) where the
extra milliseconds go. ``--compare-with REV`` adds REV's server (a temporary git worktree) to the
turns: the same step through both servers, this tree's and REV's, as a ratio.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

PROMPTS, SAMPLES = 8, 8


# -- the machine ----------------------------------------------------------------------------
def matmul_rate(m: int, k: int, n: int, seconds: float = 0.5) -> float:
    """FLOP/s of ``[m, k] @ [k, n]`` in fp32, repeated for about ``seconds``."""
    a, b = torch.randn(m, k), torch.randn(k, n)
    a @ b
    repeats, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        a @ b
        repeats += 1
    return 2 * m * k * n * repeats / (time.perf_counter() - start)


def copy_bandwidth() -> float:
    source = torch.empty(1 << 26)  # 256 MiB of fp32
    target = torch.empty_like(source)
    target.copy_(source)
    start = time.perf_counter()
    for _ in range(5):
        target.copy_(source)
    return 5 * 2 * source.numel() * 4 / (time.perf_counter() - start)


# -- the model's arithmetic -----------------------------------------------------------------
class Shape:
    def __init__(self, config):
        self.layers = config.num_hidden_layers
        self.hidden = config.hidden_size
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        # Each layer's linear weights as (out, in): q, k, v, o, gate, up, down.
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        inter = config.intermediate_size
        self.layer_linears = [(q, self.hidden), (kv, self.hidden), (kv, self.hidden), (self.hidden, q),
                              (inter, self.hidden), (inter, self.hidden), (self.hidden, inter)]
        self.body = self.layers * sum(out * inner for out, inner in self.layer_linears)  # weights below the LM head
        self.head = self.hidden * config.vocab_size
        self.vocab = config.vocab_size
        self.weight_bytes = 4 * (self.body + self.head + self.layers * 2 * self.hidden)

    def attention(self, first: int, last: int) -> float:
        """FLOPs of attention for one row's tokens at positions first..last-1 (causal)."""
        contexts = (first + last + 1) * (last - first) / 2  # sum of context lengths
        return 4 * self.layers * self.heads * self.head_dim * contexts

    def forward(self, prompt: float, response: float, rows: int, groups: int) -> float:
        """A scoring pass: prompts once per group, each row's response on it, logits at responses."""
        prompt_pass = groups * (2 * self.body * prompt + self.attention(0, int(prompt)))
        responses = rows * (2 * (self.body + self.head) * response + self.attention(int(prompt), int(prompt + response)))
        return prompt_pass + responses

    def decode_bytes(self, prompt: float, response: float, rows: int) -> float:
        kv_per_token = 2 * self.layers * self.kv_heads * self.head_dim * 4
        mean_context = prompt + response / 2
        return response * (self.weight_bytes + rows * mean_context * kv_per_token)


def phase_costs(shape: Shape, prompt: float, response: float) -> dict[str, tuple[float, float]]:
    """(FLOPs, bytes) of each timed phase of one step; bytes only where memory can bind."""
    rows = PROMPTS * SAMPLES
    prefill = PROMPTS * (2 * shape.body * prompt + 2 * shape.head + shape.attention(0, int(prompt)))
    decode = rows * (2 * (shape.body + shape.head) * response + shape.attention(int(prompt), int(prompt + response)))
    scoring = shape.forward(prompt, response, rows, PROMPTS)
    return {"rollout": (prefill + decode, shape.decode_bytes(prompt, response, rows)),
            "ref_logprob": (scoring, 0.0), "update": (3 * scoring, 0.0)}


# -- what the matmuls alone take ---------------------------------------------------------------
def matmul_shares(shape: Shape, prompt: float, response: float, turns: int = 5) -> dict[str, float]:
    """Per phase: the rate of its matmuls alone, as a share of the 2048^3 rate.

    The phase's products at its own shapes (a weight per layer, as in the model, so they do not
    all sit in cache; for the update also each product's two gradients), called back to back
    with nothing in between, in turns with a 2048^3 product (this machine's speed moves from
    minute to minute), median over ``turns``. No implementation built on this BLAS does the
    phase's arithmetic faster: the share is the most of its compute bound the phase can reach."""
    weights = [torch.randn(out, inner) for _ in range(shape.layers) for out, inner in shape.layer_linears]
    weights.append(torch.randn(shape.vocab, shape.hidden))  # the LM head, last
    rows, prompt_rows, response_rows = PROMPTS * SAMPLES, PROMPTS * round(prompt), PROMPTS * SAMPLES * round(response)
    sizes = {size for weight in weights for size in weight.shape}
    activations = {n: torch.randn(max(response_rows, prompt_rows), n) for n in sizes}

    def forward(tokens: int, head_tokens: int) -> list:
        return [(activations[w.shape[1]][:tokens], w.t()) for w in weights[:-1]] + \
               [(activations[shape.hidden][:head_tokens], weights[-1].t())]

    def backward(tokens: int, head_tokens: int) -> list:  # the input's and the weight's gradient
        pairs = []
        for w in weights:
            count = head_tokens if w is weights[-1] else tokens
            out = activations[w.shape[0]][:count]
            pairs += [(out, w), (out.t(), activations[w.shape[1]][:count])]
        return pairs

    scoring = forward(prompt_rows, 0) + forward(response_rows, response_rows)
    products = {"rollout": forward(prompt_rows, PROMPTS) + forward(rows, rows) * round(response),
                "ref_logprob": scoring,
                "update": scoring + backward(prompt_rows, 0) + backward(response_rows, response_rows)}
    big = torch.randn(2048, 2048)

    def seconds(pairs) -> float:
        start = time.perf_counter()
        for a, b in pairs:
            a @ b
        return time.perf_counter() - start

    shares = {}
    for phase, pairs in products.items():
        pairs = [(a, b) for a, b in pairs if a.shape[0] and b.shape[1]]
        flops = sum(2 * a.shape[0] * a.shape[1] * b.shape[1] for a, b in pairs)
        seconds(pairs)
        ratios = [(flops / seconds(pairs)) / (2 * 2048 ** 3 / seconds([(big, big)])) for _ in range(turns)]
        shares[phase] = statistics.median(ratios)
    return shares


# -- the run ------------------------------------------------------------------------------------
def timed_run(steps: int, tokens: int, compile_decode: bool, model: str | None = None) -> list[dict]:
    from opentinker.config import make_config
    from opentinker.engine.ppo.trainer import RLTrainer

    overrides = [
        *([f"actor_rollout_ref.model.path={model}"] if model else []),
        f"data.train_batch_size={PROMPTS}", "data.shuffle=false", f"data.max_response_length={tokens}",
        f"actor_rollout_ref.rollout.n={SAMPLES}", "actor_rollout_ref.rollout.ignore_eos=true",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={PROMPTS}",
        f"actor_rollout_ref.actor.ppo_micro_batch_size={PROMPTS * SAMPLES}",
        f"actor_rollout_ref.ref.log_prob_micro_batch_size={PROMPTS * SAMPLES}",
        "actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.actor.optim.lr=1e-5", "trainer.device=cpu",
        "trainer.seed=0", f"trainer.total_training_steps={steps + 1}", "trainer.progress_bar=false",
        "trainer.test_freq=-1", "trainer.val_before_train=false",
        f"actor_rollout_ref.rollout.compile_decode={str(compile_decode).lower()}",
    ]
    trainer = RLTrainer(make_config(overrides))
    try:
        return [trainer.train_step() for _ in range(steps + 1)]  # the first one warms up (and compiles)
    finally:
        trainer.close()


def tinker_overhead(rows: int = 8, tokens: int = 64, repeats: int = 10, compare_with: str | None = None) -> None:
    """A LoRA training step through the server and the SDK vs the same worker in this process
    (and, with ``compare_with``, vs the server of that revision)."""
    import tinker
    from _server import ROOT, BenchServer, checkout
    from tinker import types

    from opentinker.engine.backend.spec import BackendSpec, LoraSettings
    from opentinker.tiny import ensure_tiny_model
    from opentinker.engine.tinker.adapter_worker import AdapterWorker, ForwardBackwardCall

    token_rows = [[1 + (r * 7 + j * 13) % 900 for j in range(tokens + 1)] for r in range(rows)]
    adam = {"learning_rate": 1e-4, "beta1": 0.9, "beta2": 0.95, "eps": 1e-12, "weight_decay": 0.0,
            "grad_clip_norm": 0.0}
    worker = AdapterWorker(BackendSpec(str(ensure_tiny_model()), device="cpu", multi_adapter=True))
    worker.add_model("m", LoraSettings(32, 32.0, "all-linear"))
    data = [(row[:-1], {"target_tokens": row[1:], "weights": [1.0] * tokens}) for row in token_rows]

    def local(calls, ops):
        return lambda: worker.cycle(calls, ops)

    fb_call = [ForwardBackwardCall("m", data, "cross_entropy")]
    optim_op = [("optim_step", "m", (adam,))]
    datums = [types.Datum(model_input=types.ModelInput.from_ints(row[:-1]),
                          loss_fn_inputs={"target_tokens": row[1:], "weights": [1.0] * tokens}) for row in token_rows]
    params = types.AdamParams(learning_rate=1e-4)
    with contextlib.ExitStack() as stack:
        server = BenchServer(ROOT).start()
        stack.callback(server.stop)
        key = server.new_key("roofline")
        service = tinker.ServiceClient(base_url=server.url, api_key="tml-" + key)
        rest = tinker.RestClient(base_url=server.url, api_key="tml-" + key)
        training = service.create_lora_training_client(base_model="opentinker-tiny-arith", rank=32).result()

        def remote_step(training=training):
            forward_backward = training.forward_backward(datums, "cross_entropy")  # both sent before waiting
            step = training.optim_step(params)
            forward_backward.result()
            step.result()

        # Each pair runs in turns (in-process, then remote) so that both see the same machine load.
        pairs = {"step": (local(fb_call, optim_op), remote_step),
                 "forward_backward": (local(fb_call, []), lambda: training.forward_backward(datums, "cross_entropy").result()),
                 "optim_step": (local(fb_call, optim_op), lambda: training.optim_step(params).result())}
        if compare_with:
            other = BenchServer(stack.enter_context(checkout(compare_with))).start()
            stack.callback(other.stop)
            other_client = tinker.ServiceClient(base_url=other.url, api_key="tml-" + other.new_key("roofline"))
            other_training = other_client.create_lora_training_client(base_model="opentinker-tiny-arith",
                                                                      rank=32).result()
            pairs[f"step on {compare_with}"] = (lambda: remote_step(other_training), remote_step)
        seconds = {name: interleaved(*pair, repeats) for name, pair in pairs.items()}
        round_trip = timed(lambda: rest.get_server_capabilities().result(), repeats)
    # In-process optim_step: the cycle's second part (a cycle with no gradients skips the update).
    seconds["optim_step"] = (seconds["optim_step"][0] - seconds["forward_backward"][0], seconds["optim_step"][1])
    print(f"\nTinker LoRA step ({rows} rows x {tokens} tokens, rank 32), median of {repeats} after a warm-up, ms:")
    print(f"  {'':18} {'in-process':>10} {'server+SDK':>10} {'extra':>7}")
    for name in ("forward_backward", "optim_step", "step"):
        here, there = seconds[name]
        print(f"  {name:18} {here * 1e3:10.1f} {there * 1e3:10.1f} {(there - here) * 1e3:+7.1f}")
    print(f"  {'HTTP round trip':18} {'':10} {round_trip * 1e3:10.1f}  (get_server_capabilities: the floor of a call)")
    here, there = seconds["step"]
    print(f"  service overhead: x{there / here:.2f} (each call: an HTTP submit, a Ray call to the worker, a "
          "long-polled retrieve_future; a model's next call is queued at the worker while its previous one runs)")
    if compare_with:
        theirs, ours = seconds[f"step on {compare_with}"]
        print(f"  the same step through {compare_with}'s server: {theirs * 1e3:.1f} ms, this tree's {ours * 1e3:.1f} ms "
              f"(x{ours / theirs:.3f}, {(ours - theirs) * 1e3:+.1f} ms)")


def timed(fn, repeats: int) -> float:
    """Median seconds of ``fn()`` over ``repeats`` calls after one warm-up call."""
    seconds = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        fn()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds[1:])


def interleaved(first, second, repeats: int) -> tuple[float, float]:
    """Median seconds of ``first()`` and of ``second()``, called in turns, after a warm-up of each."""
    seconds: tuple[list[float], list[float]] = ([], [])
    for _ in range(repeats + 1):
        for fn, out in zip((first, second), seconds):
            start = time.perf_counter()
            fn()
            out.append(time.perf_counter() - start)
    return statistics.median(seconds[0][1:]), statistics.median(seconds[1][1:])


def main() -> None:
    from transformers import AutoConfig

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=64, help="sampled tokens per response (forced)")
    parser.add_argument("--no-tinker", action="store_true", help="skip the Tinker service-overhead part")
    parser.add_argument("--only-tinker", action="store_true", help="only the Tinker service-overhead part")
    parser.add_argument("--eager-decode", action="store_true", help="rollout.compile_decode=false")
    parser.add_argument("--compare-with", metavar="REV", help="also time the Tinker step through REV's server")
    parser.add_argument("--repeats", type=int, default=10, help="Tinker calls timed per kind (the median is shown)")
    parser.add_argument("--model", default=None,
                        help="a model folder, .gguf file or preset, e.g. smollm2-135m-instruct (default: the tiny model)")
    args = parser.parse_args()
    if args.only_tinker:
        tinker_overhead(repeats=args.repeats, compare_with=args.compare_with)
        return
    torch.manual_seed(0)
    from opentinker.engine.model_loading import resolve_model_path

    shape = Shape(AutoConfig.from_pretrained(resolve_model_path(args.model)))
    threads = torch.get_num_threads()
    peak = matmul_rate(2048, 2048, 2048)
    decode_shape = matmul_rate(PROMPTS * SAMPLES, shape.hidden, 4 * shape.hidden)
    update_shape = matmul_rate(4096, shape.hidden, 4 * shape.hidden)
    bandwidth = copy_bandwidth()
    print(f"torch {torch.__version__}, {threads} threads: fp32 matmul 2048^3 {peak / 1e9:.0f} GFLOP/s; at the model's "
          f"shapes {decode_shape / 1e9:.0f} (64 x {shape.hidden} x {4 * shape.hidden}, a decode step) and "
          f"{update_shape / 1e9:.0f} (4096 rows, an update); copy {bandwidth / 1e9:.1f} GB/s", flush=True)

    first, *history = timed_run(args.steps, args.tokens, not args.eager_decode, args.model)
    prompt = statistics.mean(h["prompt_length/mean"] for h in history)
    response = statistics.mean(h["response_length/mean"] for h in history)
    costs = phase_costs(shape, prompt, response)
    seconds = {key.removeprefix("timing_s/"): statistics.median(h[key] for h in history)
               for key in history[0] if key.startswith("timing_s/")}
    decode = "eager decode" if args.eager_decode else "compiled decode"
    print(f"\n{PROMPTS} prompts x {SAMPLES} samples, prompt {prompt:.1f} + response {response:.1f} tokens, "
          f"{decode}, median of {args.steps} steps after a first one of {first['timing_s/step']:.1f} s "
          f"(its rollout {first['timing_s/rollout']:.1f} s)\n")
    shares = matmul_shares(shape, prompt, response)
    print(f"{'phase':<12} {'time s':>7} {'GFLOP':>7} {'compute s':>9} {'memory s':>8} {'bound':>7} {'of bound':>8} "
          f"{'matmuls alone':>13}")
    total_compute = total_floor = 0.0
    for phase, (flops, nbytes) in costs.items():
        compute_s, memory_s = flops / peak, nbytes / bandwidth
        bound = max(compute_s, memory_s)
        total_compute += compute_s
        total_floor += compute_s / shares[phase]
        print(f"{phase:<12} {seconds[phase]:7.3f} {flops / 1e9:7.2f} {compute_s:9.3f} {memory_s:8.3f} "
              f"{'compute' if compute_s >= memory_s else 'memory':>7} {bound / seconds[phase]:8.0%} "
              f"{shares[phase]:13.0%}")
    rest = seconds["step"] - sum(seconds[p] for p in costs)
    print(f"{'the rest':<12} {rest:7.3f}  (advantages, weight sync, batching: no arithmetic counted)")
    print("matmuls alone: the phase's matmuls at its own shapes, back to back with nothing else, as a share of the "
          "2048^3 rate (in turns with it): the most of its bound a phase can reach with this BLAS")
    print(f"\nwhole step: {total_compute / seconds['step']:.0%} of its compute bound "
          f"({seconds['step']:.3f} s for {total_compute:.3f} s of arithmetic at the 2048^3 matmul rate; "
          f"its matmuls alone would reach {total_compute / total_floor:.0%})")
    if not args.no_tinker:
        tinker_overhead(repeats=args.repeats, compare_with=args.compare_with)


if __name__ == "__main__":
    main()
