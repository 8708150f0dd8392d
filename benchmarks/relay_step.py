"""Time per training step with the env direct and through the job's client relay, side by side.

    python benchmarks/relay_step.py [--steps 6] [--prompts 8] [--n 4] [--openenv-sessions 1 64]

One fresh ``opentinker-server serve`` (the real runner, the tiny model, its own Ray) and one thin
client in this process. For each env (the gym arithmetic server; an OpenEnv server allowing 1
session, and one allowing 64: ``tests/environments/openenv_server.py``'s env, in the OpenEnv venv
``make install-openenv`` makes) two jobs run one after the other with the same config and seed:
``direct`` (the server's runner calls the env) and ``relay`` (``"relay": "client"``: the calls go
through this process's relay). Each step has ``--prompts`` x ``--n`` episodes of up to 2 turns.

Printed per job: the median seconds per step and per rollout over the steps after the first,
the env errors and redone steps of the whole run (every one should be 0), and relay / direct.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._server import BenchServer  # noqa: E402
from opentinker import GenericEnvironment, InteractionSpec, OpenTinkerClient  # noqa: E402
from opentinker.environments.server import running_env_server  # noqa: E402
from opentinker.environments.games import ArithmeticEnv  # noqa: E402


def config(args: argparse.Namespace) -> dict:
    return {"trainer.test_freq": -1, "trainer.progress_bar": False, "trainer.seed": 1,
            "data.train_batch_size": args.prompts, "actor_rollout_ref.actor.ppo_mini_batch_size": args.prompts,
            "actor_rollout_ref.rollout.n": args.n, "data.max_response_length": 24,
            "actor_rollout_ref.rollout.multi_turn.max_assistant_turns": 2}


def run_job(client: OpenTinkerClient, args: argparse.Namespace, name: str, kind: str, url: str,
            relay: bool) -> dict:
    spec_config = {"env_endpoint": url, **({"relay": "client"} if relay else {})}
    if kind == "openenv":
        spec_config["max_steps"] = 2
    spec = InteractionSpec(name=name, class_path=kind, config=spec_config)
    rows = [{"extra_info": {"interaction_kwargs": {"name": name}}}] * (args.prompts * 4)
    env = GenericEnvironment(config(args), [spec], dataset=rows)
    handle = client.submit(env, steps=args.steps, name=f"{name}-{'relay' if relay else 'direct'}")
    info = handle.wait(progress=False)
    if info.status.value != "completed":
        raise SystemExit(f"job {info.job_id} ended {info.status.value}: {info.error}")
    metrics = [m["metrics"] for m in handle.metrics()][1:]  # the first step warms up
    return {
        "step_s": statistics.median(m["timing_s/step"] for m in metrics),
        "rollout_s": statistics.median(m["timing_s/rollout"] for m in metrics),
        "env_errors": int(sum(m.get(f"env/{name}/env_errors", 0) for m in metrics)),
        "redone": int(sum(m.get("train/env_outage_retries", 0) for m in metrics)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--openenv-sessions", type=int, nargs="*", default=[1, 64])
    args = parser.parse_args()

    sys.path.insert(0, str(ROOT / "tests"))
    from environments.openenv_server import OpenEnvServer  # the test suite's OpenEnv env and venv

    server = BenchServer(ROOT, "--allow-env-host", "127.0.0.1").start()
    rows = []
    try:
        key = server.new_key("bench")
        with OpenTinkerClient(server.url, key) as client, running_env_server(ArithmeticEnv) as (gym_url,):
            envs = [("gym", "gym", gym_url, None)]
            folder = Path(tempfile.mkdtemp(prefix="opentinker-relay-bench-"))
            for sessions in args.openenv_sessions:
                openenv = OpenEnvServer(folder, max_concurrent_envs=sessions).start()
                envs.append((f"openenv{sessions}", "openenv", openenv.url, openenv))
            try:
                for name, kind, url, _ in envs:
                    for relay in (False, True):
                        started = time.perf_counter()
                        result = run_job(client, args, name, kind, url, relay)
                        rows.append((name, "relay" if relay else "direct", result))
                        print(f"{name:>10} {'relay' if relay else 'direct':>6}: {result} "
                              f"({time.perf_counter() - started:.0f} s in all)", flush=True)
            finally:
                for *_, openenv in envs:
                    if openenv is not None:
                        openenv.kill()
    finally:
        server.stop()

    episodes = args.prompts * args.n
    print(f"\n{episodes} episodes per step (up to 2 turns each), median over steps 2-{args.steps}\n")
    print("| env | route | s / step | s / rollout | env errors | redone steps | relay / direct (step) |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    direct = {}
    for name, route, result in rows:
        if route == "direct":
            direct[name] = result["step_s"]
        ratio = f"x{result['step_s'] / direct[name]:.2f}" if route == "relay" else ""
        print(f"| {name} | {route} | {result['step_s']:.3f} | {result['rollout_s']:.3f} | {result['env_errors']} | "
              f"{result['redone']} | {ratio} |")


if __name__ == "__main__":
    main()
