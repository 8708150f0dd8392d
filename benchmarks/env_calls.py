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
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import time

import httpx

from opentinker.environments.gym_interaction import GymEnvironmentInteraction
from opentinker.environments.server import bind_listening_socket


def start_env_server() -> tuple[subprocess.Popen, str]:
    with bind_listening_socket("127.0.0.1", 0) as sock:
        port = sock.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "opentinker.environments.games", "arithmetic", "--port", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=1, trust_env=False).status_code == 200:
                return server, url
        except httpx.TransportError:
            time.sleep(0.1)
    server.kill()
    raise RuntimeError("the env server did not start")


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--episodes", type=int, default=128, help="episodes per round (a step's trajectories)")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    server, url = start_env_server()
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
