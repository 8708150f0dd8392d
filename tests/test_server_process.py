"""`opentinker-server serve` as a real process with its own local Ray: Ray listens on
loopback only (audit item 8), and when the server is killed (-9) nothing it started
survives, a running job included (13); the restarted server resumes that job from its last
checkpoint, and its events and step numbers go on without gaps or repeats."""

from __future__ import annotations

import ipaddress
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from opentinker.client.local_server import wait_for_health
from opentinker.server.reaper import descendants

pytestmark = [pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc"),
              pytest.mark.heavy]  # minutes: scheduled first (tests/conftest.py)

SMALL = {"data.train_batch_size": 2, "actor_rollout_ref.actor.ppo_mini_batch_size": 2,
         "actor_rollout_ref.rollout.n": 2, "trainer.test_freq": -1, "trainer.save_freq": 5,
         "trainer.total_training_steps": 5000}


def _cli(*args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "opentinker.server.cli", *args],
                          capture_output=True, text=True, timeout=60, check=True)
    return done.stdout


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _serve(data: Path, port: int) -> subprocess.Popen:
    log = open(data / f"server-{port}.log", "a")  # noqa: SIM115 - closed with the process
    process = subprocess.Popen(
        [sys.executable, "-m", "opentinker.server.cli", "serve", "--port", str(port), "--data-dir", str(data),
         "--ray-num-cpus", "2"],
        stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    wait_for_health(f"http://127.0.0.1:{port}", process, data / f"server-{port}.log")
    return process


def _listening(pids: set[int]) -> list[tuple[ipaddress._BaseAddress, int, int]]:
    """(address, port, pid) of every TCP socket the processes listen on, from /proc."""
    owner: dict[str, int] = {}
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:["):
                    owner[target[8:-1]] = pid
        except OSError:
            continue
    found = []
    for table, width in (("/proc/net/tcp", 4), ("/proc/net/tcp6", 16)):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state != "0A" or inode not in owner:  # 0A: LISTEN
                continue
            hex_address, hex_port = local.split(":")
            raw = bytes.fromhex(hex_address)
            # /proc prints each 32-bit word in host (little-endian) order.
            raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
            address = ipaddress.ip_address(raw if width == 4 else raw)
            if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped:
                address = address.ipv4_mapped
            found.append((address, int(hex_port, 16), owner[inode]))
    return found


def _alive(processes: dict[int, str]) -> list[int]:
    from opentinker.server.reaper import _start_time

    return [pid for pid, started in processes.items() if _start_time(pid) == started]


def test_ray_listens_on_loopback_and_nothing_outlives_a_killed_server(tiny_model_dir, tmp_path):
    data = tmp_path / "server"
    data.mkdir()
    _cli("admin", "create-user", "nina", "--data-dir", str(data))
    key = _cli("admin", "create-key", "nina", "--data-dir", str(data)).strip().splitlines()[-1]
    headers = {"Authorization": f"Bearer {key}"}
    port = _free_port()
    server = _serve(data, port)
    url = f"http://127.0.0.1:{port}"
    try:
        job_id = httpx.post(f"{url}/v1/jobs", json={"config": SMALL}, headers=headers, trust_env=False).json()["job_id"]
        deadline = time.monotonic() + 180
        while not httpx.get(f"{url}/v1/jobs/{job_id}/checkpoints", headers=headers,
                            trust_env=False).json()["checkpoints"]:
            assert time.monotonic() < deadline, "the job never saved a checkpoint"
            time.sleep(0.5)
        tree = descendants(server.pid)
        names = {pid: Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
                 for pid in tree}
        assert any("JobRunner" in name for name in names.values()), names  # the job's actor is in the tree
        sockets = _listening(set(tree) | {server.pid})
        assert len(sockets) >= 3, sockets  # gcs_server, raylet, workers, the API itself
        public = [(str(a), p, names.get(pid, "server")) for a, p, pid in sockets if not a.is_loopback]
        assert public == []  # item 8: nothing reachable from another machine

        os.kill(server.pid, signal.SIGKILL)
        server.wait(10)
        deadline = time.monotonic() + 60
        while _alive(tree):
            assert time.monotonic() < deadline, {pid: names[pid] for pid in _alive(tree)}
            time.sleep(0.5)
        saved = sorted(p.name for p in (data / "jobs" / job_id / "checkpoints").iterdir())
        time.sleep(3)
        assert sorted(p.name for p in (data / "jobs" / job_id / "checkpoints").iterdir()) == saved  # nothing trains
    finally:
        if server.poll() is None:
            server.kill()
    restarted = _serve(data, port)
    try:
        job = httpx.get(f"{url}/v1/jobs/{job_id}", headers=headers, trust_env=False).json()
        assert job["status"] in ("queued", "running")  # it had checkpoints: it resumes
        events = httpx.get(f"{url}/v1/jobs/{job_id}/events", params={"stream": "false"}, headers=headers,
                           trust_env=False).json()["events"]
        statuses = [e["data"]["status"] for e in events if e["type"] == "status"]
        assert statuses[:4] == ["queued", "running", "interrupted", "queued"]
        httpx.post(f"{url}/v1/jobs/{job_id}/cancel", headers=headers, trust_env=False)
        tree = descendants(restarted.pid)
    finally:
        restarted.terminate()
        restarted.wait(60)
    deadline = time.monotonic() + 30
    while _alive(tree):  # a clean stop leaves nothing behind either
        assert time.monotonic() < deadline, _alive(tree)
        time.sleep(0.5)


def test_a_job_killed_with_its_server_resumes_and_finishes_without_gaps_or_repeats(tiny_model_dir, tmp_path):
    data = tmp_path / "server"
    data.mkdir()
    _cli("admin", "create-user", "olga", "--data-dir", str(data))
    key = _cli("admin", "create-key", "olga", "--data-dir", str(data)).strip().splitlines()[-1]
    headers = {"Authorization": f"Bearer {key}"}
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    steps = 40
    config = {**SMALL, "trainer.total_training_steps": steps, "trainer.save_freq": 1}
    server = _serve(data, port)
    try:
        job_id = httpx.post(f"{url}/v1/jobs", json={"config": config}, headers=headers, trust_env=False).json()["job_id"]
        deadline = time.monotonic() + 180
        while httpx.get(f"{url}/v1/jobs/{job_id}", headers=headers, trust_env=False).json()["step"] < 5:
            assert time.monotonic() < deadline, "the job did not reach step 5"
            time.sleep(0.2)
        os.kill(server.pid, signal.SIGKILL)
        server.wait(10)
    finally:
        if server.poll() is None:
            server.kill()
    restarted = _serve(data, port)
    try:
        deadline = time.monotonic() + 300
        while (job := httpx.get(f"{url}/v1/jobs/{job_id}", headers=headers, trust_env=False).json())["status"] != \
                "completed":
            assert job["status"] in ("queued", "running", "interrupted"), job
            assert time.monotonic() < deadline, "the resumed job did not finish"
            time.sleep(0.5)
        events = httpx.get(f"{url}/v1/jobs/{job_id}/events", params={"stream": "false"}, headers=headers,
                           trust_env=False).json()["events"]
    finally:
        restarted.terminate()
        restarted.wait(60)
    assert [e["id"] for e in events] == list(range(1, len(events) + 1))
    assert [e["data"]["step"] for e in events if e["type"] == "progress"] == list(range(1, steps + 1))
    assert [e["data"]["step"] for e in events if e["type"] == "metrics"] == list(range(1, steps + 1))
    statuses = [e["data"]["status"] for e in events if e["type"] == "status"]
    assert statuses == ["queued", "running", "interrupted", "queued", "running", "completed"]
    assert events[-1]["type"] == "status"
