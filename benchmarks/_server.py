"""A fresh ``opentinker-server serve`` for a benchmark: its own data folder, local Ray and port,
users made with the admin CLI. ``code`` is the source tree the server runs from (this one, or
another commit's worktree)."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def env(code: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(code), "TINKER_TELEMETRY": "0"}


class BenchServer:
    def __init__(self, code: Path, *flags: str):
        self.code = code
        self.data = Path(tempfile.mkdtemp(prefix="opentinker-bench-"))
        self.flags = flags
        self.process: subprocess.Popen | None = None
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"

    def new_key(self, name: str) -> str:
        self._cli("admin", "create-user", name)
        return self._cli("admin", "create-key", name).strip().splitlines()[-1]

    def _cli(self, *args: str) -> str:
        return subprocess.run([sys.executable, "-m", "opentinker.server.cli", *args, "--data-dir", str(self.data)],
                              capture_output=True, text=True, timeout=120, check=True, env=env(self.code)).stdout

    def start(self) -> BenchServer:
        import httpx

        log = open(self.data / "server.log", "w")  # noqa: SIM115 - lives as long as the server
        self.process = subprocess.Popen(
            [sys.executable, "-m", "opentinker.server.cli", "serve", "--port", str(self.port), "--data-dir",
             str(self.data), "--log-level", "warning", *self.flags],
            stdout=log, stderr=subprocess.STDOUT, env=env(self.code), cwd=self.code)
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise SystemExit(f"the server exited: {(self.data / 'server.log').read_text()[-2000:]}")
            try:
                if httpx.get(self.url + "/v1/health", timeout=2, trust_env=False).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise SystemExit("the server did not answer /v1/health within 180 s")

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.process.kill()
        shutil.rmtree(self.data, ignore_errors=True)


@contextlib.contextmanager
def checkout(rev: str) -> Iterator[Path]:
    """Another commit of this repository in a temporary git worktree (to run side by side)."""
    folder = Path(tempfile.mkdtemp(prefix="opentinker-rev-"))
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(folder / "tree"), rev], check=True,
                   capture_output=True)
    try:
        yield folder / "tree"
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(folder / "tree")],
                       capture_output=True)
        shutil.rmtree(folder, ignore_errors=True)
