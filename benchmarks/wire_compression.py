"""What ``proto_compress_fwdbwd`` (the SDK zstd-compresses forward_backward bodies) buys: body
bytes and the client's compress / server's decompress time, for SDK-built chunks.

    python benchmarks/wire_compression.py [--datums 64,1024] [--tokens 512]

Each chunk is what the tinker SDK sends: a ``ForwardBackwardRequest`` protobuf of ``--datums``
next-token datums of ``--tokens`` tokens (ids drawn from a 150k vocabulary, as real text
tokenized by a large model), with ``weights`` (RL: also ``logprobs`` and ``advantages``).
Printed: raw and zstd bytes and their ratio, compress (SDK side, zstd level 3 as the SDK
uses) and decompress (server side) milliseconds, and what that saves at a few link speeds.
"""

from __future__ import annotations

import argparse
import time

import numpy as np


def chunk(datums: int, tokens: int, rl: bool, seed: int = 0) -> bytes:
    from tinker import types
    from tinker.proto.request_conv import forward_backward_request_to_proto

    rng = np.random.default_rng(seed)
    data = []
    for _ in range(datums):
        ids = rng.integers(0, 150_000, size=tokens + 1).tolist()
        inputs = {"target_tokens": ids[1:], "weights": [1.0] * tokens}
        if rl:
            inputs["logprobs"] = (-rng.exponential(1.0, size=tokens)).astype(np.float32).tolist()
            inputs["advantages"] = [float(rng.standard_normal())] * tokens
        data.append(types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]), loss_fn_inputs=inputs))
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=data, loss_fn="cross_entropy"), model_id="m", seq_id=1)
    return forward_backward_request_to_proto(request).SerializeToString()


def timed(fn, repeat: int = 5) -> tuple[float, object]:
    best, out = float("inf"), None
    for _ in range(repeat):
        start = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - start)
    return best, out


def main() -> None:
    import zstandard

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--datums", default="64,1024")
    parser.add_argument("--tokens", type=int, default=512)
    args = parser.parse_args()
    print(f"{'chunk':<26} {'raw':>9} {'zstd':>9} {'ratio':>6} {'compress':>9} {'decompress':>10}   saved at "
          "100 Mbit/s / 1 Gbit/s / 10 Gbit/s")
    for datums in [int(d) for d in args.datums.split(",")]:
        for rl in (False, True):
            body = chunk(datums, args.tokens, rl)
            compress_s, packed = timed(lambda: zstandard.ZstdCompressor().compress(body))
            decompress_s, _ = timed(lambda: zstandard.ZstdDecompressor().stream_reader(packed).read(len(body) + 1))
            saved = [(len(body) - len(packed)) * 8 / bps - compress_s - decompress_s for bps in (1e8, 1e9, 1e10)]
            label = f"{datums} x {args.tokens} {'RL' if rl else 'SFT'}"
            print(f"{label:<26} {len(body) / 2**20:7.2f}MB {len(packed) / 2**20:7.2f}MB {len(body) / len(packed):5.1f}x "
                  f"{compress_s * 1e3:7.1f}ms {decompress_s * 1e3:8.1f}ms   "
                  + " / ".join(f"{s * 1e3:+.0f} ms" for s in saved))


if __name__ == "__main__":
    main()
