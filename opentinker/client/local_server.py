"""Start ``opentinker-server`` on this machine for a script, and connect to it.

For the quickstart and the examples: they use ``OPENTINKER_BASE_URL`` / ``OPENTINKER_API_KEY``
when set (a real server), and otherwise start a local one on a free loopback port with the
embedded tiny model (needs the server extra), create a user and a key, and stop it at the end.
The local server lets jobs reach env servers on this machine (``--allow-env-host 127.0.0.1``).
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import httpx
from tenacity import (
    RetryError,
    Retrying,
    retry_if_exception_type,
    retry_if_result,
    stop_after_delay,
    wait_fixed,
)

from opentinker.client.client import OpenTinkerClient

_API_KEY = re.compile(r"\bot-[A-Za-z0-9_\-]+")
USER = "local"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _server_cli(*args: str) -> str:
    result = subprocess.run([sys.executable, "-m", "opentinker.server.cli", *args],
                            capture_output=True, text=True, timeout=120)
    if result.returncode != 0:
        raise RuntimeError(f"opentinker-server {' '.join(args)} failed: {result.stderr.strip() or result.stdout}")
    return result.stdout


def wait_for_health(url: str, process: subprocess.Popen, log_path: Path, timeout_s: float = 120.0) -> None:
    """Ask ``/v1/health`` every 0.3 s until it answers 200; RuntimeError when the server
    process exits first or ``timeout_s`` passes."""

    def healthy() -> bool:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with code {process.returncode}; its log: {log_path}")
        return httpx.get(f"{url}/v1/health", timeout=1.0, trust_env=False).status_code == 200

    retrying = Retrying(
        retry=retry_if_exception_type(httpx.HTTPError) | retry_if_result(lambda ok: not ok),
        stop=stop_after_delay(timeout_s),
        wait=wait_fixed(0.3),
    )
    try:
        retrying(healthy)
    except RetryError:
        raise RuntimeError(
            f"the server at {url} did not answer /v1/health within {timeout_s:.0f} s; log: {log_path}"
        ) from None


@contextlib.contextmanager
def local_server(data_dir: str | Path | None = None, port: int | None = None,
                 models: list[str] | None = None) -> Iterator[tuple[str, str]]:
    """Yields ``(base_url, api_key)`` of a freshly started local server serving ``models``
    (``--model`` values; the first is the default) beside the tiny model; stops it on exit."""
    data = Path(data_dir) if data_dir is not None else Path(tempfile.mkdtemp(prefix="opentinker-server-"))
    data.mkdir(parents=True, exist_ok=True)
    if USER not in _server_cli("admin", "list-users", "--data-dir", str(data)).split():
        _server_cli("admin", "create-user", USER, "--data-dir", str(data))
    # The key is the last line (the line before it names the data folder, which may hold anything).
    match = _API_KEY.fullmatch(_server_cli("admin", "create-key", USER, "--data-dir", str(data)).strip().splitlines()[-1])
    if match is None:
        raise RuntimeError("could not read the API key printed by 'opentinker-server admin create-key'")
    url = f"http://127.0.0.1:{port or _free_port()}"
    log_path = data / "server.log"
    print(f"[opentinker] starting opentinker-server at {url} (log: {log_path})", flush=True)
    with open(log_path, "a") as log:
        server = subprocess.Popen(
            [sys.executable, "-m", "opentinker.server.cli", "serve", "--host", "127.0.0.1",
             "--port", url.rsplit(":", 1)[1], "--data-dir", str(data),
             # A personal server: its jobs may use env servers on this machine (the examples start some).
             "--allow-env-host", "127.0.0.1", "--allow-env-host", "localhost",
             *(arg for model in models or () for arg in ("--model", model))],
            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        try:
            wait_for_health(url, server, log_path)
            yield url, match.group(0)
        finally:
            server.terminate()
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                server.kill()
            print("[opentinker] server stopped", flush=True)


@contextlib.contextmanager
def connect_or_start_local(models: list[str] | None = None) -> Iterator[OpenTinkerClient]:
    """A client for ``OPENTINKER_BASE_URL`` when set, else for a local server started here
    (serving ``models`` beside the tiny model)."""
    if os.environ.get("OPENTINKER_BASE_URL"):
        with OpenTinkerClient() as client:
            yield client
        return
    with local_server(models=models) as (url, api_key), OpenTinkerClient(url, api_key) as client:
        yield client
