"""What ``sample_use_retrieve_futures`` changes: N concurrent SDK samples waited for with one
``retrieve_futures`` long poll per session, against one ``retrieve_future`` long poll per
request.

    python benchmarks/sampling_poll.py [--requests 64] [--tokens 16] [--rounds 3]

Starts ``opentinker-server serve`` (its own Ray, the tiny model), one user, one sampling client
on the base model. Each round fires ``--requests`` ``sample`` calls at once (1 sample of
``--tokens`` tokens each) and waits for all; the same rounds run with the server's setting (the
poller on) and with the SDK told otherwise (its client config's
``sample_use_retrieve_futures`` set to false in this process), alternating. Printed per mode:
wall time per round (median), and the SDK's HTTP calls per round to ``retrieve_future`` and
``retrieve_futures`` (counted by wrapping the SDK's two resource methods).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _server import BenchServer  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TINY = "opentinker-tiny-arith"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    import tinker
    from tinker import types
    from tinker.resources.futures import AsyncFuturesResource

    calls: Counter = Counter()
    for name in ("retrieve", "retrieve_multi"):
        original = getattr(AsyncFuturesResource, name)

        def counted(self, *a, _original=original, _name=name, **k):
            calls[_name] += 1
            return _original(self, *a, **k)

        setattr(AsyncFuturesResource, name, counted)

    server = BenchServer(ROOT)
    key = server.new_key("sampler")
    server.start()
    try:
        results: dict[str, list[tuple[float, int, int]]] = {"poller on": [], "poller off": []}
        clients = {}
        for mode in results:
            service = tinker.ServiceClient(base_url=server.url, api_key="tml-" + key)
            config = service.holder._client_config
            service.holder._client_config = config.model_copy(
                update={"sample_use_retrieve_futures": mode == "poller on"})
            clients[mode] = (service, service.create_sampling_client(base_model=TINY).result())
        prompt = types.ModelInput.from_ints([1, 5, 9, 12, 40, 41, 42, 43])
        params = types.SamplingParams(max_tokens=args.tokens, temperature=1.0)
        for _ in range(args.rounds + 1):  # the first round of each mode is a warm-up
            for mode, (_, sampler) in clients.items():
                calls.clear()
                start = time.perf_counter()
                futures = [sampler.sample(prompt=prompt, num_samples=1, sampling_params=params)
                           for _ in range(args.requests)]
                for future in futures:
                    future.result()
                results[mode].append((time.perf_counter() - start, calls["retrieve"], calls["retrieve_multi"]))
        print(f"{args.requests} concurrent samples x {args.tokens} tokens, {args.rounds} rounds each "
              f"(after a warm-up round)")
        for mode, rounds in results.items():
            rounds = rounds[1:]
            print(f"  {mode:<11} {statistics.median(r[0] for r in rounds):6.2f} s per round; HTTP calls per round: "
                  f"retrieve_future {statistics.median(r[1] for r in rounds):.0f}, retrieve_futures "
                  f"{statistics.median(r[2] for r in rounds):.0f}", flush=True)
        for service, _ in clients.values():
            service.close("success").result()
    finally:
        server.stop()


if __name__ == "__main__":
    main()
