"""One update of a ragged GRPO batch in each input layout, side by side in one run (CPU or GPU).

    python benchmarks/packed_update.py [--model PATH] [--repeats 5] [--micro 16] [--threads N]

Layouts (``engine/backend/forward.py``), on the same model, batch and micro-batches:

* ``padded``: every micro-batch's rows padded to its longest;
* ``shared prefix`` (the default): each prompt once, its KV cache expanded to its samples;
* ``packed``: ``use_remove_padding``, the micro-batch's rows in one row without padding, each
  sequence's attention its own (``packed_attention``: sdpa per sequence on CPU, one varlen
  flash kernel on a GPU);
* ``packed, row mask``: the same packed row with the block-diagonal mask transformers builds
  over the whole row (what packing was before ``packed_attention``).

The batch: 8 prompts x 8 samples, prompts of 24-64 tokens, responses of 8 to ``--longest``
tokens (uniform), random token ids. One update = ``forward_backward`` of every micro-batch,
then ``optim_step``. Each layout's backend is built once; the layouts take turns, one update
each per turn (after a warm-up turn), and the median is printed with its ratio to padded.
"""

from __future__ import annotations

import argparse
import statistics
import time
from contextlib import contextmanager, nullcontext
from dataclasses import replace

import torch

from opentinker.engine.backend import AdamParams, BackendSpec, make_backend
from opentinker.engine.batch import TokenBatch

PROMPTS, SAMPLES = 8, 8


def ragged_batch(vocab: int, longest: int, seed: int = 0) -> TokenBatch:
    generator = torch.Generator().manual_seed(seed)
    prompts, responses = [], []
    for _ in range(PROMPTS):
        prompt = torch.randint(3, vocab, (int(torch.randint(24, 65, (1,), generator=generator)),),
                               generator=generator).tolist()
        for _ in range(SAMPLES):
            length = int(torch.randint(8, longest + 1, (1,), generator=generator))
            prompts.append(prompt)
            responses.append(torch.randint(3, vocab, (length,), generator=generator).tolist())
    return TokenBatch.from_responses(prompts, responses)


@contextmanager
def row_mask_packing():
    """Packed rows through transformers' own mask over the whole row."""
    from opentinker.engine.backend import forward

    kept = forward.packed_call_kwargs
    forward.packed_call_kwargs = lambda model, position_ids, device: None
    try:
        yield
    finally:
        forward.packed_call_kwargs = kept


LAYOUTS = {
    "padded": {"share_prompt_prefix": False},
    "shared prefix": {"share_prompt_prefix": True},
    "packed": {"use_remove_padding": True},
    "packed, row mask": {"use_remove_padding": True},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a model folder (default: the embedded tiny model)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--micro", type=int, default=16, help="rows per micro-batch")
    parser.add_argument("--longest", type=int, default=192, help="longest response, tokens")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from opentinker.engine.model_loading import resolved_spec

    base = resolved_spec(BackendSpec(args.model, device=args.device))
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(base.model_path).vocab_size
    batch = ragged_batch(vocab, args.longest)
    real = sum(len(p) + len(r) for p, r in zip(batch.prompt_ids, batch.response_ids))
    padded = sum(len(part) * max(len(p) + len(r) for p, r in zip(part.prompt_ids, part.response_ids))
                 for part in batch.split(args.micro))
    print(f"batch: {len(batch)} rows, {real} real tokens, {padded} padded ({padded / real:.2f}x), "
          f"micro-batches of {args.micro}, torch threads {torch.get_num_threads()}, device {args.device}")
    backends = {name: make_backend(replace(base, **options)) for name, options in LAYOUTS.items()}
    params = AdamParams(lr=1e-6, grad_clip=1.0)

    def update(name: str) -> float:
        backend = backends[name]
        start = time.perf_counter()
        with row_mask_packing() if name == "packed, row mask" else nullcontext():
            for part in batch.split(args.micro):
                backend.forward_backward(part, "cross_entropy")
        backend.optim_step(params)
        if args.device != "cpu":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    times: dict[str, list[float]] = {name: [] for name in LAYOUTS}
    for turn in range(args.repeats + 1):
        for name in LAYOUTS:
            seconds = update(name)
            if turn:  # the first turn warms up
                times[name].append(seconds)
    reference = statistics.median(times["padded"])
    print(f"{'layout':<18} {'s/update':>9} {'real tok/s':>11} {'padded / this':>14}")
    for name, runs in times.items():
        median = statistics.median(runs)
        print(f"{name:<18} {median:>9.3f} {real / median:>11,.0f} {reference / median:>13.2f}x")


if __name__ == "__main__":
    main()
