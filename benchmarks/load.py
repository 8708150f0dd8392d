"""Load on the control plane: concurrent event streams plus control requests, on loopback.

    python benchmarks/load.py [--streams 50] [--seconds 60] [--jobs 2] [--dataset-mib 19]

Starts ``opentinker-server serve`` (its own local Ray, the embedded tiny model) on a free
loopback port with a fresh data folder, and ``--jobs`` real GRPO jobs that keep training
(and emitting events) for the whole run; the first one carries a dataset of about
``--dataset-mib`` MiB (the audit's setting: a server that re-read stored datasets on every
job read slowed down with it). Then, in one run, side by side:

- baseline (a quarter of ``--seconds``): control requests only;
- loaded (the rest): the same control requests while ``--streams`` clients, in a separate
  process, follow the jobs' event streams with the thin client (``JobHandle.stream``, which
  resumes with ``Last-Event-ID`` after a dropped connection).

Control requests are ``GET /v1/health``, ``GET /v1/jobs``, ``GET /v1/jobs/{id}`` and
``GET /v1/jobs/{id}/events?stream=false`` (the last few), sent back to back by a few
threads. It prints p50 / p99 / max latency per phase and the loaded / baseline ratio, then
the events each stream received and whether every stream saw the ids 1, 2, 3, ... with no
gap and no repeat (the run fails if one did not). Every phase is bounded in time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from opentinker.client.local_server import wait_for_health

CONTROL_THREADS = 4
JOB_CONFIG = {"data.train_batch_size": 2, "actor_rollout_ref.actor.ppo_mini_batch_size": 2,
              "actor_rollout_ref.rollout.n": 2, "trainer.test_freq": -1, "trainer.total_training_steps": 100000}


def _cli(data: Path, *args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "opentinker.server.cli", *args, "--data-dir", str(data)],
                          capture_output=True, text=True, timeout=120, check=True)
    return done.stdout


def start_server(data: Path, port: int, jobs: int) -> subprocess.Popen:
    log = open(data / "server.log", "w")  # noqa: SIM115 - lives as long as the server
    command = [sys.executable, "-m", "opentinker.server.cli", "serve", "--port", str(port), "--data-dir", str(data),
               "--log-level", "warning"]
    if jobs > 2:  # the default quota runs 2 jobs per user at once
        command += ["--max-running-jobs", str(jobs)]
    server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    wait_for_health(f"http://127.0.0.1:{port}", server, data / "server.log", timeout_s=180)
    return server


def dataset(mib: float) -> list[dict]:
    """Arithmetic rows, padded (in extra_info, which training ignores) to about ``mib`` MiB."""
    from opentinker.environments.arithmetic import make_problems

    pad = "x" * 5000
    count = max(8, int(mib * 2**20 / (len(pad) + 150)))
    return [{**p.as_row(), "extra_info": {"pad": pad}} for p in make_problems(count, seed=3)]


def percentiles(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    if not ordered:
        return {"n": 0, "p50": float("nan"), "p99": float("nan"), "max": float("nan")}
    q = statistics.quantiles(ordered, n=100, method="inclusive") if len(ordered) > 1 else ordered * 99
    return {"n": len(ordered), "p50": q[49] * 1000, "p99": q[98] * 1000, "max": ordered[-1] * 1000}


def control_load(url: str, key: str, job_ids: list[str], seconds: float) -> list[float]:
    """Latencies (s) of control requests sent back to back by CONTROL_THREADS threads."""
    latencies: list[float] = []
    lock = threading.Lock()
    stop = time.monotonic() + seconds

    def worker(index: int) -> None:
        paths = ["/v1/health", "/v1/jobs"]
        for job_id in job_ids:
            paths += [f"/v1/jobs/{job_id}", f"/v1/jobs/{job_id}/events?stream=false&after=0&limit=20"]
        headers = {"Authorization": f"Bearer {key}"}
        with httpx.Client(base_url=url, headers=headers, timeout=30, trust_env=False) as client:
            turn = index
            while time.monotonic() < stop:
                path = paths[turn % len(paths)]
                turn += 1
                start = time.perf_counter()
                response = client.get(path)
                elapsed = time.perf_counter() - start
                if response.status_code != 200:
                    raise SystemExit(f"GET {path} answered {response.status_code}: {response.text[:200]}")
                with lock:
                    latencies.append(elapsed)
                time.sleep(0.02)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(CONTROL_THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return latencies


def stream_worker(url: str, key: str, job_ids: list[str], streams: int, seconds: float) -> dict:
    """Follow the jobs' event streams from ``streams`` threads for ``seconds``; report what each saw."""
    from opentinker.client import OpenTinkerClient

    stop = time.monotonic() + seconds
    results: list[dict] = [{} for _ in range(streams)]

    def follow(index: int) -> None:
        job_id = job_ids[index % len(job_ids)]
        seen, gaps, last = 0, 0, 0
        with OpenTinkerClient(url, key) as client:
            for event in client.job(job_id).stream():
                if event.id != last + 1:
                    gaps += 1
                last = event.id
                seen += 1
                if time.monotonic() >= stop:
                    break
        results[index] = {"job": job_id, "events": seen, "gaps": gaps, "last_id": last}

    threads = [threading.Thread(target=follow, args=(i,), daemon=True) for i in range(streams)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(seconds + 60)
    return {"streams": results}


def show(label: str, stats: dict[str, float]) -> None:
    print(f"  {label:<9} n={stats['n']:<6} p50={stats['p50']:7.1f} ms  p99={stats['p99']:7.1f} ms  "
          f"max={stats['max']:7.1f} ms", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=50)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--dataset-mib", type=float, default=19.0, help="dataset of the first job; 0: none")
    parser.add_argument("--stream-worker", nargs=3, metavar=("URL", "KEY", "JOB_IDS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.stream_worker:  # the child process
        url, key, job_ids = args.stream_worker
        print(json.dumps(stream_worker(url, key, job_ids.split(","), args.streams, args.seconds)))
        return 0

    data = Path(tempfile.mkdtemp(prefix="opentinker-load-"))
    _cli(data, "admin", "create-user", "load")
    key = _cli(data, "admin", "create-key", "load").strip().splitlines()[-1]
    with __import__("socket").socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    print(f"[load] server {url} (data {data}); {args.jobs} training jobs (dataset {args.dataset_mib:g} MiB); "
          f"{args.streams} streams; {args.seconds:g} s", flush=True)
    server = start_server(data, port, args.jobs)
    headers = {"Authorization": f"Bearer {key}"}
    try:
        with httpx.Client(base_url=url, headers=headers, timeout=60, trust_env=False) as client:
            job_ids = []
            for i in range(args.jobs):
                body = {"name": f"load-{i}", "config": JOB_CONFIG}
                if i == 0 and args.dataset_mib > 0:
                    body["dataset"] = dataset(args.dataset_mib)
                response = client.post("/v1/jobs", json=body, timeout=600)
                if response.status_code != 201:
                    raise SystemExit(f"creating job {i} answered {response.status_code}: {response.text[:300]}")
                job_ids.append(response.json()["job_id"])
            deadline = time.monotonic() + 180
            while any(client.get(f"/v1/jobs/{j}").json()["step"] < 1 for j in job_ids):
                if time.monotonic() > deadline:
                    raise SystemExit("the jobs did not start training within 180 s")
                time.sleep(0.5)
        baseline_s = args.seconds / 4
        print(f"[load] baseline: control requests only, {baseline_s:g} s", flush=True)
        baseline = percentiles(control_load(url, key, job_ids, baseline_s))
        loaded_s = args.seconds - baseline_s
        print(f"[load] loaded: control requests + {args.streams} event streams, {loaded_s:g} s", flush=True)
        worker = subprocess.Popen(
            [sys.executable, __file__, "--streams", str(args.streams), "--seconds", str(loaded_s),
             "--stream-worker", url, key, ",".join(job_ids)],
            stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        time.sleep(2)  # let the streams connect and catch up
        loaded = percentiles(control_load(url, key, job_ids, loaded_s - 2))
        out, _ = worker.communicate(timeout=loaded_s + 120)
        streams = json.loads(out.strip().splitlines()[-1])["streams"]
        with httpx.Client(base_url=url, headers=headers, timeout=60, trust_env=False) as client:
            for job_id in job_ids:
                client.post(f"/v1/jobs/{job_id}/cancel")
    finally:
        server.terminate()
        server.wait(60)

    print("control request latency:")
    show("baseline", baseline)
    show("loaded", loaded)
    print(f"  loaded / baseline: p50 x{loaded['p50'] / baseline['p50']:.2f}, p99 x{loaded['p99'] / baseline['p99']:.2f}")
    events = [s.get("events", 0) for s in streams]
    gaps = sum(s.get("gaps", 0) for s in streams)
    finished = sum(1 for s in streams if s)
    print(f"event streams: {finished}/{len(streams)} finished, events per stream min {min(events)} "
          f"median {statistics.median(events):.0f} max {max(events)}, {sum(events)} in all; "
          f"streams with a gap or repeat: {sum(1 for s in streams if s.get('gaps'))} ({gaps} gaps)")
    ok = gaps == 0 and finished == len(streams) and min(events) > 0
    print("gap-free: yes" if ok else "gap-free: NO", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
