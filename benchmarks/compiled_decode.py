"""The compiled decode step and the slot decode against the eager loop, side by side in one process.

    python benchmarks/compiled_decode.py [--rows 64] [--tokens 64] [--rounds 5] [--decode compiled,slots]
                                         [--device cuda --shape qwen05b]

Engines on the same weights: the eager one, one with ``compile_decode=True``
(``opentinker/engine/rollout/compiled_decode.py``) and one with ``slot_decode=True``
(``opentinker/engine/rollout/slot_decode.py``: CUDA graphs on a GPU). For each of the latter,
prints what its first call costs (the compile, or the graph captures), whether greedy decoding
gives the eager tokens, the largest gap between the logprobs of those tokens, and tokens/s
(median of ``--rounds`` rounds, the engines taking turns so that all see the same machine
load), sampled at temperature 1 with exactly ``--tokens`` tokens per row.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from opentinker.engine.rollout import SamplingParams  # noqa: E402


def prompts_of(rows: int, groups: int = 8) -> list[list[int]]:
    """GRPO's shape: ``groups`` arithmetic questions, each repeated ``rows / groups`` times."""
    from opentinker.engine.data import chat_prompt_ids
    from opentinker.engine.model_loading import load_tokenizer
    from opentinker.tiny import ensure_tiny_model
    from opentinker.environments.arithmetic import make_problems

    tokenizer = load_tokenizer(str(ensure_tiny_model()))
    distinct = [chat_prompt_ids(tokenizer, p.messages()) for p in make_problems(groups, seed=5)]
    return [distinct[i % groups] for i in range(rows)]


def _shared_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def compare(eager, compiled, prompts: list[list[int]], tokens: int, rounds: int) -> dict:
    """The other engine's (``compiled``: compiled or slot decode) first call's seconds, its
    greedy agreement with the eager engine and both engines' tokens/s."""
    greedy = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    sampled = SamplingParams(temperature=1.0, max_tokens=tokens, ignore_eos=True)
    start = time.perf_counter()
    compiled_greedy = compiled.generate(prompts, greedy)
    first_s = time.perf_counter() - start
    eager_greedy = eager.generate(prompts, greedy)
    same = sum(a.token_ids == b.token_ids for a, b in zip(eager_greedy, compiled_greedy))
    # Compared up to each row's first different token: after it the two rows are different texts.
    gap = max((abs(a.logprobs[i] - b.logprobs[i]) for a, b in zip(eager_greedy, compiled_greedy)
               for i in range(_shared_prefix(a.token_ids, b.token_ids))), default=0.0)
    seconds: dict[str, list[float]] = {"eager": [], "compiled": []}
    for _ in range(rounds):
        for name, engine in (("eager", eager), ("compiled", compiled)):
            start = time.perf_counter()
            engine.generate(prompts, sampled)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            seconds[name].append(time.perf_counter() - start)
    rate = {name: len(prompts) * tokens / statistics.median(s) for name, s in seconds.items()}
    return {"first_call_s": first_s, "same_rows": same, "rows": len(prompts), "logprob_gap": gap,
            "eager_tok_s": rate["eager"], "compiled_tok_s": rate["compiled"]}


def main() -> None:
    from rollout_throughput import transformers_engine

    from opentinker.tiny import ensure_tiny_model

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--decode", default="compiled,slots", help="comma-separated, of compiled, slots")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--shape", choices=["tiny", "qwen05b"], default="tiny",
                        help="qwen05b: Qwen2.5-0.5B's shape, random weights (bf16 on cuda)")
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if args.shape == "tiny":
        folder = str(ensure_tiny_model())
    else:
        from model_shapes import qwen25_05b_folder

        folder = qwen25_05b_folder()
    eager = transformers_engine(folder, device, dtype)
    print(f"torch {torch.__version__}, {args.device}, {torch.get_num_threads()} threads; {args.shape} model, "
          f"{args.rows} rows x {args.tokens} tokens")
    for decode in [name.strip() for name in args.decode.split(",") if name.strip()]:
        other = transformers_engine(folder, device, dtype, **{"compiled": {"compile_decode": True},
                                                               "slots": {"slot_decode": True}}[decode])
        result = compare(eager, other, prompts_of(args.rows), args.tokens, args.rounds)
        first = "compile" if decode == "compiled" else "graph captures" if device.type == "cuda" else "pool"
        print(f"[{decode}] first call ({first} + decode): {result['first_call_s']:.1f} s")
        print(f"[{decode}] greedy: {result['same_rows']}/{result['rows']} rows give the eager tokens; largest "
              f"logprob gap {result['logprob_gap']:.1e}")
        print(f"[{decode}] tokens/s, median of {args.rounds}: eager {result['eager_tok_s']:,.0f}, {decode} "
              f"{result['compiled_tok_s']:,.0f}: x{result['compiled_tok_s'] / result['eager_tok_s']:.2f}")
        del other

if __name__ == "__main__":
    main()
