"""Many LoRA models on one server: memory per model, throughput and fairness as K grows.

    python benchmarks/multi_tenant.py [--ks 1,2,4,8] [--seconds 20] [--rank 8]
                                      [--compare-with 13349a7 | none] [--fsdp-ranks N]
    python benchmarks/multi_tenant.py --hostile [--ks 4] [--seconds 30]
    python benchmarks/multi_tenant.py --chunking

For each K, a fresh ``opentinker-server serve`` (its own local Ray, the embedded tiny model,
a fresh data folder) and K users, each with one official ``tinker`` SDK client in a thread of
a child process, each training its own LoRA model (rank ``--rank``, seed = its index): a
warm-up step, then ``forward_backward`` + ``optim_step`` back to back for ``--seconds``
(each step waits for both results). Printed per K:

- the server's total RSS (the server process and every process under it: Ray and the model
  workers) before any model, with the K models made (each after one warm-up step) and with
  them trained; the RSS each model added (the difference over K; from K=2 on also the
  marginal cost against the K=1 run, made and trained);
- aggregate steps/s, each client's p50 / p99 step latency (worst client shown), and the
  fairness ratio most / least steps per client.

``--hostile``: K users training as above, with and without one more, hostile user who, in a
loop, creates a LoRA model, sends the largest legal mixed-length ``forward_backward`` (1,024
datums: half of one token, half of 1,023 tokens, the context's limit) and unloads the model a
few seconds later, mid-request. Printed side by side: every normal user's steps (all must
succeed and their loss move), their p99 step latency and the server's peak RSS (sampled every
0.2 s), and the ratios (goals on 2 cores: p99 within 5x, peak RSS within +1 GiB).

``--chunking``: what cutting a big request into cycle shares costs a user alone: one client's
``forward_backward`` of 64 rows x 255 tokens (16 shares of 1,024 padded tokens) + ``optim_step``
on a default server and on one with ``--tinker-cycle-tokens 100000`` (one cycle), the two
servers in turn, twice; median seconds per step.

``--worker-only``: the shared worker alone in this process, to tell a model's own state from
the batched pass's activations in the RSS it adds.

``--compare-with REF`` runs the same on another commit of this repository (a temporary git
worktree; by default the last commit with one worker actor per model), side by side.
``--fsdp-ranks N`` adds a side: this tree with ``--tinker-strategy fsdp --tinker-ranks N`` (the
shared base sharded over N FSDP ranks). Only relative numbers of one run mean anything: the
machine is shared.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _server import BenchServer, checkout, env  # noqa: E402

TINY = "opentinker-tiny-arith"
BEFORE_MULTI_TENANT = "13349a7"  # the last commit where every Tinker model had a worker of its own


def tree_rss(pid: int) -> int:
    """RSS of ``pid`` and every process under it (Ray's too), bytes."""
    import psutil

    root = psutil.Process(pid)
    total = 0
    for process in [root, *root.children(recursive=True)]:
        try:
            total += process.memory_info().rss
        except psutil.Error:
            pass
    return total


def hostile_user(url: str, key: str, stop: threading.Event, counts: dict) -> None:
    """Creates a LoRA model, sends the largest legal mixed-length forward_backward, unloads the
    model a few seconds later (mid-request), again, until ``stop``."""
    import httpx
    import tinker
    from tinker import types

    def datum(length: int, salt: int) -> types.Datum:
        tokens = [1 + (salt * 31 + j * 17) % 900 for j in range(length + 1)]
        return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                           loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * length})

    big = [datum(1 if i % 2 else 1023, i) for i in range(1024)]  # the SDK's chunk: 1,024 datums
    service = tinker.ServiceClient(base_url=url, api_key="tml-" + key)
    with httpx.Client(base_url=url + "/api/v1", headers={"X-API-Key": "tml-" + key}, timeout=60,
                      trust_env=False) as raw:
        while not stop.is_set():
            training = service.create_lora_training_client(base_model=TINY, rank=64, seed=counts["models"]).result()
            counts["models"] += 1
            training.forward_backward(big, "cross_entropy")  # not waited for: it is unloaded mid-way
            counts["requests"] += 1
            stop.wait(5.0)
            raw.post("/unload_model", json={"model_id": training.model_id}).raise_for_status()
    service.close("success").result()


def client_worker(url: str, keys: list[str], rank: int, seconds: float, hostile_key: str | None = None) -> dict:
    """The child process: one SDK client per key in its own thread (and, with ``hostile_key``,
    a hostile user in another)."""
    import tinker
    from tinker import types

    made = threading.Barrier(len(keys) + 1)
    go = threading.Event()
    results: list[dict] = [{} for _ in keys]
    stop_at = [float("inf")]

    def user(index: int) -> None:
        tokens = [1 + (index * 7 + j * 13) % 900 for j in range(48)]
        data = [types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                            loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)})
                for _ in range(4)]
        service = tinker.ServiceClient(base_url=url, api_key="tml-" + keys[index])
        training = service.create_lora_training_client(base_model=TINY, rank=rank, seed=index).result()
        adam = types.AdamParams(learning_rate=1e-4)
        training.forward_backward(data, "cross_entropy").result()  # warm-up
        training.optim_step(adam).result()
        made.wait(600)
        go.wait()
        latencies, losses = [], []
        while time.monotonic() < stop_at[0]:
            start = time.perf_counter()
            fb = training.forward_backward(data, "cross_entropy")
            step = training.optim_step(adam)
            losses.append(fb.result().metrics["loss:sum"])
            step.result()
            latencies.append(time.perf_counter() - start)
        made.wait(600)  # everyone stops before anyone leaves (their models count in the RSS)
        results[index] = {"latencies": latencies, "losses": losses}
        made.wait(600)
        service.close("success").result()

    threads = [threading.Thread(target=user, args=(i,), daemon=True) for i in range(len(keys))]
    for thread in threads:
        thread.start()
    made.wait(600)
    print("ready", flush=True)
    sys.stdin.readline()  # the parent measured the RSS with the models made
    stop_at[0] = time.monotonic() + seconds
    stop_hostile, hostile_counts = threading.Event(), {"models": 0, "requests": 0}
    if hostile_key:
        attacker = threading.Thread(target=hostile_user, args=(url, hostile_key, stop_hostile, hostile_counts),
                                    daemon=True)
        attacker.start()
    go.set()
    made.wait(seconds + 600)
    stop_hostile.set()
    if hostile_key:
        attacker.join(300)
    print("stopped", flush=True)
    sys.stdin.readline()  # the parent measured the RSS after training
    made.wait(600)
    for thread in threads:
        thread.join(120)
    return {"clients": results, "hostile": hostile_counts}


class PeakRSS:
    """The most the server's process tree held, sampled every 0.2 s while in the block."""

    def __init__(self, pid: int):
        self.pid, self.peak, self._stop = pid, 0, threading.Event()

    def __enter__(self) -> PeakRSS:
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()
        return self

    def _watch(self) -> None:
        while not self._stop.wait(0.2):
            self.peak = max(self.peak, tree_rss(self.pid))

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def run_k(code: Path, k: int, rank: int, seconds: float, flags: tuple[str, ...] = (), hostile: bool = False) -> dict:
    server = BenchServer(code, "--tinker-max-models", str(max(8, k + 1)), *flags)
    keys = [server.new_key(f"user{i}") for i in range(k)]
    hostile_key = [server.new_key("hostile")] if hostile else []
    child = None
    try:
        server.start()
        time.sleep(3)  # Ray's own processes settle
        idle = tree_rss(server.process.pid)
        child = subprocess.Popen([sys.executable, __file__, "--client-worker", server.url, ",".join(keys), str(rank),
                                  str(seconds), *hostile_key], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 text=True, env=env(ROOT))
        _expect(child, "ready")
        made = tree_rss(server.process.pid)
        child.stdin.write("go\n")
        child.stdin.flush()
        with PeakRSS(server.process.pid) as peak:
            _expect(child, "stopped")
        trained = tree_rss(server.process.pid)
        child.stdin.write("done\n")
        child.stdin.flush()
        out, _ = child.communicate(timeout=300)
        result = json.loads(out.strip().splitlines()[-1])
    finally:
        if child is not None and child.poll() is None:
            child.kill()
        server.stop()
    latencies = [c["latencies"] for c in result["clients"]]
    steps = [len(lat) for lat in latencies]
    return {"k": k, "idle_rss": idle, "made_rss": made, "trained_rss": trained, "steps": steps,
            "peak_rss": max(peak.peak, trained), "hostile": result["hostile"],
            "loss_moved": [len(c["losses"]) > 1 and c["losses"][0] != c["losses"][-1] for c in result["clients"]],
            "steps_per_s": sum(steps) / seconds,
            "p50": [statistics.median(lat) for lat in latencies],
            "p99": [sorted(lat)[min(len(lat) - 1, int(0.99 * len(lat)))] for lat in latencies],
            "fairness": max(steps) / max(1, min(steps))}


def worker_memory(k: int, rank: int) -> None:
    """In this process, the shared worker alone: the RSS each of K LoRA models adds when
    trained one at a time (its state: adapter, gradients, AdamW), then after batched cycles
    of all K (the allocator keeps the larger pass's activations)."""
    import gc

    import numpy as np
    import psutil
    import torch

    from opentinker.engine.backend.spec import BackendSpec, LoraSettings
    from opentinker.engine.tinker.adapter_worker import AdapterWorker, ForwardBackwardCall

    torch.set_num_threads(1)
    targets = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"
    adam = {"learning_rate": 1e-4, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.0,
            "grad_clip_norm": 0.0}
    tokens = np.asarray([1 + (j * 13) % 900 for j in range(48)])
    data = [(tokens[:-1], {"target_tokens": tokens[1:], "weights": np.ones(47, np.float32)})] * 4
    worker = AdapterWorker(BackendSpec(None, device="cpu", multi_adapter=True))
    process = psutil.Process()

    def cycles(groups: list[list[str]]) -> int:
        for _ in range(3):
            for group in groups:
                worker.cycle([ForwardBackwardCall(m, data, "cross_entropy") for m in group],
                             [("optim_step", m, (adam,)) for m in group])
        gc.collect()
        return process.memory_info().rss

    models = [f"m{i}" for i in range(k)]
    worker.add_model(models[0], LoraSettings(rank, 32.0, targets, seed=0))
    one = cycles([models[:1]])
    for i, model in enumerate(models[1:], 1):
        worker.add_model(model, LoraSettings(rank, 32.0, targets, seed=i))
    alone = cycles([[m] for m in models])
    batched = cycles([models])
    state = sum(p.numel() * p.element_size() for m in models for p in worker.adapters[m].parameters()) / k
    print(f"[worker alone] K={k}, rank {rank}: adapter weights {state / 2**20:.2f} MB per model (x3 with AdamW); "
          f"RSS added per model, trained one at a time: {(alone - one) / (k - 1) / 2**20:.2f} MB; "
          f"after batched cycles of all {k}: {(batched - one) / (k - 1) / 2**20:.2f} MB", flush=True)


def _expect(child: subprocess.Popen, word: str) -> None:
    while True:
        line = child.stdout.readline()
        if not line:
            raise SystemExit(f"the client process ended before saying {word!r}")
        if line.strip() == word:
            return


def show(label: str, rows: list[dict]) -> None:
    mib = 2**20
    one = next((r for r in rows if r["k"] == 1), None)
    print(f"\n{label}")
    print("   K  idle RSS  made RSS  marginal  trained RSS  per model  marginal  steps/s  p50 (worst)  p99 (worst)  "
          "fairness")
    for r in rows:
        per_model = (r["trained_rss"] - r["idle_rss"]) / r["k"] / mib

        def marginal(field: str) -> str:
            return "" if one is None or r["k"] == 1 else f"{(r[field] - one[field]) / (r['k'] - 1) / mib:7.1f}M"

        print(f"  {r['k']:>2}  {r['idle_rss'] / mib:7.0f}M  {r['made_rss'] / mib:7.0f}M  {marginal('made_rss'):>8}  "
              f"{r['trained_rss'] / mib:10.0f}M  {per_model:8.1f}M  {marginal('trained_rss'):>8}  "
              f"{r['steps_per_s']:7.2f}  {max(r['p50']) * 1000:8.0f} ms  {max(r['p99']) * 1000:8.0f} ms  "
              f"{r['fairness']:8.2f}", flush=True)


def hostile_run(k: int, rank: int, seconds: float) -> None:
    """K normal users with and without a hostile one, side by side (the two runs alternate,
    twice)."""
    runs: dict[bool, list[dict]] = {False: [], True: []}
    for _ in range(2):
        for hostile in (False, True):
            print(f"[multi_tenant] K={k}, {'with' if hostile else 'without'} the hostile user", flush=True)
            runs[hostile].append(run_k(ROOT, k, rank, seconds, hostile=hostile))
    gib = 2**30
    print(f"\n{k} normal users, {seconds:g} s a run; p99 = the worst normal user's")
    print("  run              steps  all trained  p50 (worst)  p99 (worst)  peak RSS   hostile models / requests")
    for hostile in (False, True):
        for r in runs[hostile]:
            print(f"  {'with hostile' if hostile else 'alone':<15} {sum(r['steps']):6d}  {str(all(r['loss_moved'])):>11}  "
                  f"{max(r['p50']) * 1000:8.0f} ms  {max(r['p99']) * 1000:8.0f} ms  {r['peak_rss'] / gib:6.2f} GiB  "
                  f"{r['hostile']['models']} / {r['hostile']['requests']}", flush=True)
    for alone, attacked in zip(runs[False], runs[True]):
        print(f"  ratio: p99 x{max(attacked['p99']) / max(alone['p99']):.2f} (goal <= 5), peak RSS "
              f"{(attacked['peak_rss'] - alone['peak_rss']) / gib:+.2f} GiB (goal <= +1), steps "
              f"x{sum(attacked['steps']) / max(1, sum(alone['steps'])):.2f}")


def chunking_run(steps: int = 4) -> None:
    """A user alone with a big request: chunked over cycles (the default) against one cycle."""
    import tinker
    from tinker import types

    def datum(row: int, length: int = 255) -> types.Datum:
        tokens = [1 + (row * 7 + j * 13) % 900 for j in range(length + 1)]
        return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                           loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * length})

    data = [datum(row) for row in range(64)]
    sides = {"chunked (--tinker-cycle-tokens 1024)": (), "one cycle (--tinker-cycle-tokens 100000)":
             ("--tinker-cycle-tokens", "100000")}
    times: dict[str, list[float]] = {label: [] for label in sides}
    for _ in range(2):
        for label, flags in sides.items():
            server = BenchServer(ROOT, *flags)
            key = server.new_key("user")
            try:
                server.start()
                service = tinker.ServiceClient(base_url=server.url, api_key="tml-" + key)
                training = service.create_lora_training_client(base_model=TINY, rank=8, seed=1).result()
                training.forward_backward(data[:4], "cross_entropy").result()  # warm-up
                for _ in range(steps):
                    start = time.perf_counter()
                    training.forward_backward(data, "cross_entropy").result()
                    training.optim_step(types.AdamParams(learning_rate=1e-4)).result()
                    times[label].append(time.perf_counter() - start)
                service.close("success").result()
            finally:
                server.stop()
    chunked, whole = (statistics.median(t) for t in times.values())
    for label, values in times.items():
        print(f"  {label}: median {statistics.median(values):.2f} s a step of 64 x 255 tokens")
    print(f"  chunked / one cycle: x{chunked / whole:.3f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ks", default="1,2,4,8")
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--compare-with", default=BEFORE_MULTI_TENANT, help="a git ref, or none")
    parser.add_argument("--fsdp-ranks", type=int, default=0,
                        help="also run this tree with the shared base on N FSDP ranks (0: not)")
    parser.add_argument("--worker-only", action="store_true",
                        help="only the shared worker's memory per model, in this process (the largest K)")
    parser.add_argument("--hostile", action="store_true",
                        help="K normal users (the largest of --ks) with and without a hostile one, side by side")
    parser.add_argument("--chunking", action="store_true",
                        help="a user alone: a big forward_backward chunked over cycles against one cycle")
    parser.add_argument("--client-worker", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker_only:
        worker_memory(max(int(k) for k in args.ks.split(",")), args.rank)
        return 0
    if args.client_worker:
        url, keys, rank, seconds, *hostile_key = args.client_worker
        print(json.dumps(client_worker(url, keys.split(","), int(rank), float(seconds), *hostile_key)), flush=True)
        return 0
    if args.chunking:
        chunking_run()
        return 0
    if args.hostile:
        hostile_run(max(int(k) for k in args.ks.split(",")), args.rank, args.seconds)
        return 0
    ks = [int(k) for k in args.ks.split(",")]
    print(f"[multi_tenant] K = {ks}, {args.seconds:g} s each, LoRA rank {args.rank}, tiny model on "
          f"{os.cpu_count()} CPUs; load average {os.getloadavg()[0]:.2f}", flush=True)
    sides: list[tuple[str, Path, tuple[str, ...]]] = [("this tree (shared base worker)", ROOT, ())]
    if args.fsdp_ranks:
        sides.append((f"this tree (shared base on {args.fsdp_ranks} FSDP ranks)", ROOT,
                      ("--tinker-strategy", "fsdp", "--tinker-ranks", str(args.fsdp_ranks))))
    with contextlib.ExitStack() as stack:
        if args.compare_with != "none":
            sides.append((f"{args.compare_with} (one worker per model)", stack.enter_context(checkout(args.compare_with)),
                          ()))
        results: dict[str, list[dict]] = {label: [] for label, _, _ in sides}
        for k in ks:  # the two sides alternate, K by K, so both see the same machine
            for label, code, flags in sides:
                print(f"[multi_tenant] K={k}: {label}", flush=True)
                results[label].append(run_k(code, k, args.rank, args.seconds, flags))
    for label, rows in results.items():
        show(label, rows)
    for label, _, _ in sides[1:]:
        ours, theirs = results[sides[0][0]], results[label]
        print(f"\nratios (this tree, local / {label}), by K: steps/s, RSS added per model")
        for a, b in zip(ours, theirs):
            added = (a["trained_rss"] - a["idle_rss"]) / max(1, b["trained_rss"] - b["idle_rss"])
            print(f"  K={a['k']}: x{a['steps_per_s'] / b['steps_per_s']:.2f} steps/s, x{added:.3f} memory")
    return 0


if __name__ == "__main__":
    sys.exit(main())
