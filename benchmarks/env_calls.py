"""The agent loop's calls to an environment server: this project's client against httpx.

    python benchmarks/env_calls.py [--episodes 128] [--rounds 5]

Starts ``python -m opentinker.environments.games arithmetic`` (a process of its own, as in a
deployment). A round is what one multi-turn training step sends: ``--episodes`` episodes at
once, each ``/reset``, one ``/step`` and ``/finalize``. The same rounds go through
:class:`~opentinker.environments.gym_interaction.GymEnvironmentInteraction` (its HTTP calls on
aiohttp, ``opentinker/environments/env_http.py``) and through an ``httpx.AsyncClient`` with the
same connection limit posting the same bodies (what the interaction used before), in turns.
Printed per client: wall seconds per round and this process's CPU seconds per round (medians
after a first round of each), and their ratios.

    python benchmarks/env_calls.py --relay [--episodes 128] [--rounds 5]

The same rounds direct and through a job's client relay (``relay: client``), side by side in
one job: a real ``opentinker-server`` app (uvicorn on loopback, Ray) runs a job whose runner
(:class:`RelayRounds`, in its Ray actor like a real job's agent loops) sends each round once
straight to the env server and once through its RelayHub -> the server's relay route -> the
WebSocket -> this process's :class:`~opentinker.client.relay.EnvRelay` -> the env server.
Printed: the median wall seconds per round of each and their ratio.

    python benchmarks/env_calls.py --openenv [--env-python .venv-openenv/bin/python]

The same rounds against an OpenEnv server (``examples/openenv_env.py --serve``, openenv's own
app, 128 sessions allowed) through :class:`~opentinker.environments.openenv_interaction.OpenEnvInteraction`
(one WebSocket session per episode: open + reset, step, close) and against the gym server
through the gym interaction, in turns. Printed: wall and client CPU per round, and the ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

from opentinker.environments.gym_interaction import GymEnvironmentInteraction
from opentinker.environments.relay import RelayDoor, RelayHub
from opentinker.environments.server import bind_listening_socket


def start_server(command: list[str], what: str) -> tuple[subprocess.Popen, str]:
    """``command`` + ``PORT`` on a free loopback port, once its /health answers: (process, URL)."""
    with bind_listening_socket("127.0.0.1", 0) as sock:
        port = sock.getsockname()[1]
    server = subprocess.Popen([*command, str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=1, trust_env=False).status_code == 200:
                return server, url
        except httpx.TransportError:
            time.sleep(0.1)
    server.kill()
    raise RuntimeError(f"{what} did not start")


def start_env_server() -> tuple[subprocess.Popen, str]:
    return start_server([sys.executable, "-m", "opentinker.environments.games", "arithmetic", "--port"],
                        "the env server")


async def through_the_interaction(interaction: GymEnvironmentInteraction, episodes: int, tag: str) -> None:
    async def episode(i: int) -> None:
        instance = await interaction.start_interaction(f"{tag}-{i}")
        await interaction.generate_response(instance, [{"role": "assistant", "content": "12"}])
        await interaction.finalize_interaction(instance)

    await asyncio.gather(*(episode(i) for i in range(episodes)))


async def through_httpx(client: httpx.AsyncClient, url: str, episodes: int, tag: str) -> None:
    async def post(path: str, body: dict) -> dict:
        response = await client.post(f"{url}/{path}", json=body)
        response.raise_for_status()
        return response.json()

    async def episode(i: int) -> None:
        instance = f"{tag}-{i}"
        await post("reset", {"instance_id": instance})
        await post("step", {"instance_id": instance, "action": "12", "step": 0})
        await post("finalize", {"instance_id": instance})

    await asyncio.gather(*(episode(i) for i in range(episodes)))


async def compare(url: str, episodes: int, rounds: int) -> dict[str, tuple[float, float]]:
    interaction = GymEnvironmentInteraction({"env_endpoint": url})
    limits = httpx.Limits(max_connections=interaction.max_connections,
                          max_keepalive_connections=min(64, interaction.max_connections))
    samples: dict[str, list[tuple[float, float]]] = {"opentinker (aiohttp)": [], "httpx": []}
    async with interaction, httpx.AsyncClient(limits=limits, trust_env=False) as client:
        runs = {"opentinker (aiohttp)": lambda tag: through_the_interaction(interaction, episodes, tag),
                "httpx": lambda tag: through_httpx(client, url, episodes, tag)}
        for index in range(rounds + 1):  # the first round of each warms its connections up
            for name, run in runs.items():
                wall, cpu = time.perf_counter(), time.process_time()
                await run(f"{name[:5]}-{index}")
                samples[name].append((time.perf_counter() - wall, time.process_time() - cpu))
    return {name: (statistics.median(w for w, _ in s[1:]), statistics.median(c for _, c in s[1:]))
            for name, s in samples.items()}


async def relay_rounds(config: dict, context, hub, episodes: int, rounds: int) -> dict[str, float]:
    """Median wall seconds of a round direct and through the relay, in turns (in the job's actor).
    A function, not a method: an async method would make Ray run the runner as an async actor."""
    direct = GymEnvironmentInteraction({"env_endpoint": config["env_endpoint"], "name": "arith"})
    relayed = GymEnvironmentInteraction.create({**config, "name": "arith"}, context)
    while not hub.status()["connected"]:
        await asyncio.sleep(0.05)
    walls: dict[str, list[float]] = {"direct": [], "relay": []}
    for index in range(rounds + 1):  # the first round of each warms its connections up
        for name, interaction in (("direct", direct), ("relay", relayed)):
            wall = time.perf_counter()
            await through_the_interaction(interaction, episodes, f"{name}-{index}")
            walls[name].append(time.perf_counter() - wall)
    await direct.aclose()
    return {f"{name}_s": statistics.median(values[1:]) for name, values in walls.items()}


class RelayRounds(RelayDoor):
    """A job runner (the JobManager's contract) whose run is the benchmark: rounds of episodes
    through a direct interaction and a relayed one, in turns, reported as a metrics event."""

    def __init__(self, job_id, spec, job_dir, policy, resume_from_step=None):
        self.job_id = job_id
        self.config = spec["interactions"][0]["config"]
        self.episodes, self.rounds = int(spec["name"].split("x")[0]), int(spec["name"].split("x")[1])
        self.relay = RelayHub(max_in_flight=policy.env_relay_in_flight)
        self.context = policy.interaction_context(job_id, self.relay)
        self._events: list[dict] = []

    def run(self) -> dict:
        walls = asyncio.run(relay_rounds(self.config, self.context, self.relay, self.episodes, self.rounds))
        self._events.append({"type": "metrics", "data": {"step": 1, "metrics": walls}})
        return {"status": "completed", "error": None, "step": 1}

    def drain_events(self) -> list[dict]:
        events, self._events = self._events, []
        return events

    def cancel(self) -> None:
        pass


def relay_compare(url: str, episodes: int, rounds: int) -> dict[str, float]:
    """The rounds of :class:`RelayRounds` in a job of a real server app on loopback."""
    import tempfile
    import threading

    import ray
    import uvicorn

    from opentinker import OpenTinkerClient
    from opentinker.environments.registry import InteractionSpec
    from opentinker.server import auth
    from opentinker.server.app import create_app
    from opentinker.server.settings import ServerSettings
    from opentinker.server.store import Store

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # ship RelayRounds to the actor by value
    with tempfile.TemporaryDirectory() as data, bind_listening_socket("127.0.0.1", 0) as sock:
        port = sock.getsockname()[1]
        settings = ServerSettings(data_dir=Path(data), port=port, ray_address="auto")
        store = Store(settings.db_path)
        key = auth.create_api_key(store, auth.create_user(store, "bench"))
        store.close()
        app = create_app(settings, runner_cls=RelayRounds)
        server = uvicorn.Server(uvicorn.Config(app, log_level="warning", **settings.uvicorn_options()))
        thread = threading.Thread(target=lambda: server.run(sockets=[sock]), daemon=True)
        thread.start()
        while not server.started:
            time.sleep(0.05)
        try:
            spec = InteractionSpec(name="arith", class_path="gym", config={"env_endpoint": url, "relay": "client"})
            with OpenTinkerClient(f"http://127.0.0.1:{port}", key) as client:
                job = client.create_job({"name": f"{episodes}x{rounds}", "config": {},
                                         "interactions": [spec.model_dump()]})
                # The client relay in a process of its own, as on the user's machine.
                carrier = subprocess.Popen([sys.executable, __file__, "--carry", job.job_id, client.base_url, url],
                                           env={**os.environ, "OPENTINKER_API_KEY": key})
                try:
                    info = job.wait(progress=False)
                finally:
                    carrier.wait(30)
                assert info.status.value == "completed", info
                return job.metrics()[-1]["metrics"]
        finally:
            server.should_exit = True
            thread.join(30)
            ray.shutdown()


def start_openenv_server(python: str) -> tuple[subprocess.Popen, str]:
    """``examples/openenv_env.py --serve`` on a free port, in the python that has openenv."""
    example = Path(__file__).resolve().parents[1] / "examples" / "openenv_env.py"
    return start_server([python, str(example), "--max-sessions", "128", "--serve"],
                        f"the OpenEnv server (is openenv installed in {python}? make install-openenv)")


async def openenv_compare(gym_url: str, openenv_url: str, episodes: int, rounds: int) -> dict[str, tuple[float, float]]:
    from opentinker.environments.openenv_interaction import OpenEnvInteraction

    gym = GymEnvironmentInteraction({"env_endpoint": gym_url, "name": "gym"})
    openenv = OpenEnvInteraction({"env_endpoint": openenv_url, "name": "openenv"})
    samples: dict[str, list[tuple[float, float]]] = {"gym (HTTP)": [], "OpenEnv (WebSocket)": []}
    async with gym:
        for index in range(rounds + 1):  # the first round of each warms up (and reads /schema)
            for name, interaction in (("gym (HTTP)", gym), ("OpenEnv (WebSocket)", openenv)):
                wall, cpu = time.perf_counter(), time.process_time()
                await through_the_interaction(interaction, episodes, f"{name[:3]}-{index}")
                samples[name].append((time.perf_counter() - wall, time.process_time() - cpu))
        await openenv.aclose()
    return {name: (statistics.median(w for w, _ in s[1:]), statistics.median(c for _, c in s[1:]))
            for name, s in samples.items()}


def carry(job_id: str, server_url: str, env_url: str) -> None:
    """The client side of ``--relay``: carry the job's env calls until the server ends the relay."""
    from opentinker import OpenTinkerClient
    from opentinker.client.relay import EnvRelay
    from opentinker.environments.registry import InteractionSpec

    spec = InteractionSpec(name="arith", class_path="gym", config={"env_endpoint": env_url, "relay": "client"})
    with OpenTinkerClient(server_url) as client:
        relay = EnvRelay(client, job_id, [spec]).start()
        while relay.running:
            time.sleep(0.2)


def main() -> None:
    if sys.argv[1:2] == ["--carry"]:
        carry(*sys.argv[2:5])
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--episodes", type=int, default=128, help="episodes per round (a step's trajectories)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--relay", action="store_true", help="direct vs through a job's client relay")
    parser.add_argument("--openenv", action="store_true", help="OpenEnv over WebSocket sessions vs the gym HTTP path")
    parser.add_argument("--env-python", default=str(Path(__file__).resolve().parents[1] / ".venv-openenv/bin/python"),
                        help="with --openenv: a python with openenv==0.10.0 (make install-openenv)")
    args = parser.parse_args()
    server, url = start_env_server()
    if args.openenv:
        try:
            openenv_server, openenv_url = start_openenv_server(args.env_python)
            try:
                results = asyncio.run(openenv_compare(url, openenv_url, args.episodes, args.rounds))
            finally:
                openenv_server.kill()
                openenv_server.wait()
        finally:
            server.kill()
            server.wait()
        print(f"{args.episodes} episodes at once (each: start, one step, finalize), median of {args.rounds} rounds "
              f"after a first one:")
        for name, (wall, cpu) in results.items():
            print(f"  {name:22} wall {wall:6.3f} s   client CPU {cpu:6.3f} s")
        (gym_wall, gym_cpu), (env_wall, env_cpu) = results.values()
        print(f"  OpenEnv / gym: wall x{env_wall / gym_wall:.2f}, client CPU x{env_cpu / gym_cpu:.2f}")
        return
    if args.relay:
        try:
            walls = relay_compare(url, args.episodes, args.rounds)
        finally:
            server.kill()
            server.wait()
        print(f"{args.episodes} episodes at once ({3 * args.episodes} calls), in a job's runner, median of "
              f"{args.rounds} rounds after a first one:")
        print(f"  direct (aiohttp from the runner)   wall {walls['direct_s']:6.3f} s")
        print(f"  relay (server -> client -> env)    wall {walls['relay_s']:6.3f} s")
        print(f"  relay / direct: wall x{walls['relay_s'] / walls['direct_s']:.2f}")
        return
    try:
        results = asyncio.run(compare(url, args.episodes, args.rounds))
    finally:
        server.kill()
        server.wait()
    calls = 3 * args.episodes
    print(f"{args.episodes} episodes at once (reset + step + finalize: {calls} calls) against a local env server, "
          f"median of {args.rounds} rounds after a first one:")
    for name, (wall, cpu) in results.items():
        print(f"  {name:22} wall {wall:6.3f} s   client CPU {cpu:6.3f} s ({cpu / calls * 1e3:.2f} ms a call)")
    (ours_wall, ours_cpu), (peer_wall, peer_cpu) = results.values()
    print(f"  httpx / opentinker: wall x{peer_wall / ours_wall:.2f}, client CPU x{peer_cpu / ours_cpu:.2f}")


if __name__ == "__main__":
    main()
