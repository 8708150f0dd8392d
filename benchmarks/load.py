"""Load on the control plane: concurrent event streams plus control requests, and Tinker
clients beside a hostile sampler user, on loopback.

    python benchmarks/load.py [--streams 50] [--seconds 60] [--jobs 2] [--dataset-mib 19]
                              [--tinker-clients 4] [--no-hostile]

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

The Tinker part (``--tinker-clients`` N, 0 to leave it out): before the jobs start, a probe
user samples 2 tokens from the tiny model again and again, alone (its unloaded latency, from
``asample`` to the result, through ``retrieve_future``). In the loaded phase, in another
process, N users each drive the official ``tinker`` SDK in a loop (LoRA ``forward_backward``,
``optim_step``, ``save_weights_and_get_sampling_client``, a 4 x 16-token ``sample``); halfway
through it, one hostile user starts sending the audit's request, ``asample`` of 512 samples x
1,000 tokens (``stop=[]``), twice, resending after each 429 as the SDK does; the probe samples
all along. So the other users' sampling latency is measured three ways in one run: alone,
under the load without the hostile user, and under the load with it. It prints them and the
ratios. The run fails if a stream had a gap, the control p99 under load is 100 ms or more, or
the hostile user makes the probe's p99 5x what it is under the same load without them (the
ratio to "alone" is printed too: on a machine with few cores it is mostly the other
processes' share of the CPU, which the load without the hostile user shows).
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
TINY = "opentinker-tiny-arith"
PROBE_PROMPT = [1, 5, 9, 12, 40, 41, 42, 43]
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


def _sample_body(num_samples: int, max_tokens: int, **params) -> dict:
    return {"base_model": TINY, "num_samples": num_samples,
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": PROBE_PROMPT}]},
            "sampling_params": {"max_tokens": max_tokens, "temperature": 1.0, **params}}


def _await_future(client: httpx.Client, request_id: str) -> bool:
    """Polls ``retrieve_future`` until the result is in; False if it failed."""
    while True:
        response = client.post("/retrieve_future", json={"request_id": request_id})
        if response.status_code != 200:
            raise SystemExit(f"retrieve_future answered {response.status_code}: {response.text[:200]}")
        if not response.headers["content-type"].startswith("application/json"):
            return True
        body = response.json()
        if body.get("type") != "try_again":
            return "error" not in body


def probe_sampling(url: str, key: str, seconds: float) -> list[tuple[float, float]]:
    """2-token sampling requests, one after another: (wall-clock start, latency in s from
    ``asample`` to the result) of each."""
    latencies: list[tuple[float, float]] = []
    deadline = time.monotonic() + seconds
    with httpx.Client(base_url=url + "/api/v1", headers={"X-API-Key": "tml-" + key}, timeout=60,
                      trust_env=False) as client:
        while time.monotonic() < deadline:
            started, start = time.time(), time.perf_counter()
            response = client.post("/asample", json=_sample_body(1, 2))
            if response.status_code != 200:
                raise SystemExit(f"the probe's asample answered {response.status_code}: {response.text[:200]}")
            if not _await_future(client, response.json()["request_id"]):
                raise SystemExit("the probe's sampling request failed")
            latencies.append((started, time.perf_counter() - start))
            time.sleep(0.1)
    return latencies


def tinker_worker(url: str, keys: list[str], hostile_key: str | None, seconds: float) -> dict:
    """N SDK users training and sampling in a loop for ``seconds``, and a hostile sampler user
    from halfway on (its wall-clock start is returned as ``hostile["from"]``). The models are
    made first; "ready" on stdout says the loop starts."""
    import tinker
    from tinker import types

    stop_at = float("inf")
    made = threading.Barrier(len(keys) + 1)
    results: list[dict] = [{} for _ in keys]
    hostile: dict = {"accepted": 0, "refused_429": 0, "other": 0, "from": None}

    def sdk_user(index: int) -> None:
        tokens = [1, 5, 9, 12, 40, 41, 42, 43, 17, 99, 310, 7]
        datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                            loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)})
        service = tinker.ServiceClient(base_url=url, api_key="tml-" + keys[index])
        training = service.create_lora_training_client(base_model=TINY, rank=8, seed=index).result()
        made.wait(600)
        steps, sample_s = 0, []
        while time.monotonic() < stop_at:
            training.forward_backward([datum], "cross_entropy").result()
            training.optim_step(types.AdamParams(learning_rate=1e-4)).result()
            sampler = training.save_weights_and_get_sampling_client().result()
            started, start = time.time(), time.perf_counter()
            sampler.sample(prompt=types.ModelInput.from_ints(tokens[:4]), num_samples=4,
                           sampling_params=types.SamplingParams(max_tokens=16, temperature=1.0)).result()
            sample_s.append((started, time.perf_counter() - start))
            steps += 1
        service.close("success").result()
        results[index] = {"steps": steps, "sample_s": sample_s}

    def hostile_user() -> None:
        time.sleep(seconds / 2)
        hostile["from"] = time.time()
        with httpx.Client(base_url=url + "/api/v1", headers={"X-API-Key": "tml-" + hostile_key}, timeout=60,
                          trust_env=False) as client:
            while time.monotonic() < stop_at:
                response = client.post("/asample", json=_sample_body(512, 1000, stop=[]))
                if response.status_code == 200:
                    hostile["accepted"] += 1
                elif response.status_code == 429:
                    hostile["refused_429"] += 1
                    time.sleep(1.0)  # what the SDK does on a sampling 429
                else:
                    hostile["other"] += 1
                    time.sleep(1.0)

    threads = [threading.Thread(target=sdk_user, args=(i,), daemon=True) for i in range(len(keys))]
    for thread in threads:
        thread.start()
    made.wait(600)
    stop_at = time.monotonic() + seconds
    print("ready", flush=True)
    if hostile_key:
        threads.append(threading.Thread(target=hostile_user, daemon=True))
        threads[-1].start()
    for thread in threads:
        thread.join(seconds + 300)
    return {"sdk": results, "hostile": hostile}


def show(label: str, stats: dict[str, float]) -> None:
    print(f"  {label:<9} n={stats['n']:<6} p50={stats['p50']:7.1f} ms  p99={stats['p99']:7.1f} ms  "
          f"max={stats['max']:7.1f} ms", flush=True)


def _ms(latencies: list[float]) -> str:
    if not latencies:
        return "(none)"
    stats = percentiles(latencies)
    return f"{stats['p50']:.0f} / {stats['p99']:.0f} ms (n={stats['n']})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=50)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--dataset-mib", type=float, default=19.0, help="dataset of the first job; 0: none")
    parser.add_argument("--tinker-clients", type=int, default=4, help="tinker SDK users in the loaded phase; 0: none")
    parser.add_argument("--no-hostile", action="store_true", help="leave out the hostile sampler user")
    parser.add_argument("--stream-worker", nargs=3, metavar=("URL", "KEY", "JOB_IDS"), help=argparse.SUPPRESS)
    parser.add_argument("--tinker-worker", nargs=3, metavar=("URL", "KEYS", "HOSTILE_KEY"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.stream_worker:  # the child process
        url, key, job_ids = args.stream_worker
        print(json.dumps(stream_worker(url, key, job_ids.split(","), args.streams, args.seconds)))
        return 0
    if args.tinker_worker:  # the other child process
        url, keys, hostile_key = args.tinker_worker
        print(json.dumps(tinker_worker(url, [k for k in keys.split(",") if k], hostile_key if hostile_key != "-"
                                       else None, args.seconds)))
        return 0

    data = Path(tempfile.mkdtemp(prefix="opentinker-load-"))

    def new_key(name: str) -> str:
        _cli(data, "admin", "create-user", name)
        return _cli(data, "admin", "create-key", name).strip().splitlines()[-1]

    key = new_key("load")
    probe_key = new_key("probe") if args.tinker_clients else None
    tinker_keys = [new_key(f"tinker-{i}") for i in range(args.tinker_clients)]
    hostile_key = new_key("hostile") if args.tinker_clients and not args.no_hostile else None
    with __import__("socket").socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    print(f"[load] server {url} (data {data}); {args.jobs} training jobs (dataset {args.dataset_mib:g} MiB); "
          f"{args.streams} streams; {args.seconds:g} s", flush=True)
    server = start_server(data, port, args.jobs)
    headers = {"Authorization": f"Bearer {key}"}
    sampling_alone: list[tuple[float, float]] = []
    try:
        if probe_key:
            probe_sampling(url, probe_key, 1.0)  # starts the sampler
            sampling_s = min(15.0, args.seconds / 4)
            print(f"[load] sampling alone: the probe's 2-token requests, {sampling_s:g} s (before the jobs)", flush=True)
            sampling_alone = probe_sampling(url, probe_key, sampling_s)
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
        extra = f" + {args.tinker_clients} tinker SDK users" if args.tinker_clients else ""
        extra += " + a hostile sampler user + the probe" if hostile_key else " + the probe" if probe_key else ""
        child_env = {**os.environ, "PYTHONUNBUFFERED": "1", "TINKER_TELEMETRY": "0"}
        tinker_child = None
        if args.tinker_clients:  # its models are made first: the loaded phase starts when they train
            tinker_child = subprocess.Popen(
                [sys.executable, __file__, "--seconds", str(loaded_s), "--tinker-worker", url, ",".join(tinker_keys),
                 hostile_key or "-"], stdout=subprocess.PIPE, text=True, env=child_env)
            print(f"[load] making {args.tinker_clients} tinker SDK users' LoRA models", flush=True)
            if tinker_child.stdout.readline().strip() != "ready":
                raise SystemExit("the tinker SDK users could not make their models")
        print(f"[load] loaded: control requests + {args.streams} event streams{extra}, {loaded_s:g} s"
              + (" (the hostile user from halfway on)" if hostile_key else ""), flush=True)
        worker = subprocess.Popen(
            [sys.executable, __file__, "--streams", str(args.streams), "--seconds", str(loaded_s),
             "--stream-worker", url, key, ",".join(job_ids)],
            stdout=subprocess.PIPE, text=True, env=child_env,
        )
        time.sleep(2)  # let the streams connect and catch up
        probe_loaded: list[tuple[float, float]] = []
        if probe_key:
            probe_thread = threading.Thread(
                target=lambda: probe_loaded.extend(probe_sampling(url, probe_key, loaded_s - 2)), daemon=True)
            probe_thread.start()
        loaded = percentiles(control_load(url, key, job_ids, loaded_s - 2))
        if probe_key:
            probe_thread.join(120)
        out, _ = worker.communicate(timeout=loaded_s + 120)
        streams = json.loads(out.strip().splitlines()[-1])["streams"]
        tinker_out = {}
        if tinker_child is not None:
            out, _ = tinker_child.communicate(timeout=loaded_s + 400)
            tinker_out = json.loads(out.strip().splitlines()[-1])
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
    gap_free = gaps == 0 and finished == len(streams) and min(events) > 0
    print("gap-free: yes" if gap_free else "gap-free: NO", flush=True)
    checks = {"event streams gap-free": gap_free, "control p99 under load < 100 ms": loaded["p99"] < 100}
    hostile = tinker_out.get("hostile", {})
    hostile_from = hostile.get("from") or float("inf")

    def split(timed: list[list[float]]) -> tuple[list[float], list[float]]:
        """Latencies of the requests started before the hostile user did, and of those after."""
        return [s for t, s in timed if t < hostile_from], [s for t, s in timed if t >= hostile_from]

    if sampling_alone:
        print("the probe's 2-token sampling latency (asample to result):")
        alone = percentiles([s for _, s in sampling_alone])
        show("alone", alone)
        phases = {"loaded": percentiles(split(probe_loaded)[0])}
        if hostile_key:
            phases["+hostile"] = percentiles(split(probe_loaded)[1])
        for label, stats in phases.items():
            show(label, stats)
            print(f"    / alone: p50 x{stats['p50'] / alone['p50']:.2f}, p99 x{stats['p99'] / alone['p99']:.2f}")
        if hostile_key:
            ratio = phases["+hostile"]["p99"] / phases["loaded"]["p99"]
            print(f"  with the hostile user / the same load without: p50 "
                  f"x{phases['+hostile']['p50'] / phases['loaded']['p50']:.2f}, p99 x{ratio:.2f}")
            checks["the hostile user leaves the probe's p99 < 5x the same load's without it"] = ratio < 5
    if tinker_out:
        for index, result in enumerate(tinker_out["sdk"]):
            if not result:
                print(f"tinker SDK user {index}: did not finish")
                checks["every tinker SDK user finished"] = False
                continue
            before, after = split(result["sample_s"])
            line = f"tinker SDK user {index}: {result['steps']} steps (forward_backward, optim_step, snapshot, " \
                   f"sample 4 x 16); sample p50 / p99 without the hostile user {_ms(before)}"
            print(line + (f", with it {_ms(after)}" if hostile_key else ""))
        if hostile_key:
            print(f"hostile user: 512 x 1,000-token calls accepted {hostile['accepted']}, refused with 429 "
                  f"{hostile['refused_429']}, other answers {hostile['other']}")
            checks["the hostile user's extra calls were refused with 429"] = hostile["refused_429"] > 0 \
                and hostile["other"] == 0
    for name, passed in checks.items():
        print(f"check: {name}: {'yes' if passed else 'NO'}")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
