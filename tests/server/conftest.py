"""Fixtures of the server tests: one Ray per session, real uvicorn servers on 127.0.0.1,
users and keys made through the admin functions, and a small stand-in runner.

``StandInRunner`` follows the JobRunner interface (see opentinker/server/jobs.py) and runs
as a real Ray actor; instead of training, each step sleeps. What it does is chosen by
words in the job's name:

- ``slow`` / ``medium``: steps take 0.5 s / 0.1 s (default 0.02 s);
- ``hold`` (client mode): accepts batches but never trains one;
- ``raise``: ``run`` raises at step 2; ``crash``: the actor process exits at step 2;
- ``bad-init``: the constructor raises;
- ``needs-gpu``: asks Ray for a GPU (through ``ray_actor_options``), so it is never placed.
Rows containing ``"reject"`` are refused by ``push_batch`` (ValueError).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

ray = pytest.importorskip("ray")

import uvicorn  # noqa: E402

from opentinker.environments.server import bind_listening_socket  # noqa: E402
from opentinker.environments.relay import RelayDoor, RelayHub  # noqa: E402
from opentinker.server import auth  # noqa: E402
from opentinker.server.app import create_app  # noqa: E402
from opentinker.server.settings import ServerSettings  # noqa: E402
from opentinker.server.store import Store  # noqa: E402


class StandInRunner(RelayDoor):
    """A JobRunner look-alike whose steps are sleeps (see the module docstring)."""

    def __init__(self, job_id: str, spec: dict, job_dir: str, policy: Any, resume_from_step: int | None = None):
        name = spec.get("name") or ""
        self.start_step = resume_from_step or 0
        if "bad-init" in name:
            raise ValueError("the stand-in runner refused to start")
        self.job_id = job_id
        self.mode = spec.get("mode", "server")
        self.dataset_rows = len(spec.get("dataset") or [])
        self.job_dir = Path(job_dir)
        self.total_steps = int((spec.get("config") or {}).get("trainer.total_training_steps", 3))
        self.step_s = 0.5 if "slow" in name else 0.1 if "medium" in name else 0.02
        self.hold = "hold" in name
        self.raise_at = 2 if "raise" in name else None
        self.crash_at = 2 if "crash" in name else None
        self._lock = threading.Lock()
        self._events: list[dict] = []
        self._batches: collections.deque = collections.deque()
        self._cancel = threading.Event()
        self._checkpoint_requested = threading.Event()
        self._checkpoint_refusal: str | None = None  # the server's (refuse_checkpoints)
        self.relay = RelayHub()  # the client relay's door, as the real runner has it (no calls come)

    @staticmethod
    def ray_actor_options(spec: dict) -> dict:
        # "needs-gpu": a resource this test cluster lacks, so Ray never places the actor.
        return {"num_gpus": 1} if "needs-gpu" in (spec.get("name") or "") else {}

    def _emit(self, type_: str, data: dict) -> None:
        with self._lock:
            self._events.append({"type": type_, "data": data})

    def _save(self, step: int) -> None:
        name = f"global_step_{step}"
        if self._checkpoint_refusal is not None:  # as JobRunner: not written, a warning instead
            self._emit("log", {"level": "warning", "message": f"checkpoint {name} was not saved: "
                               f"{self._checkpoint_refusal}"})
            return
        folder = self.job_dir / "checkpoints" / name
        (folder / "tokenizer").mkdir(parents=True, exist_ok=True)
        (folder / "config.json").write_text('{"model_type": "stand-in", "step": %d}' % step)
        (folder / "model.safetensors").write_bytes(os.urandom(3000))
        (folder / "tokenizer" / "tokenizer.json").write_text("{}")
        self._emit("checkpoint", {"step": step, "name": name, "path": str(folder)})

    def _next_batch(self) -> bool:
        """Wait for a pushed batch (client mode); False when cancelled meanwhile."""
        while not self._cancel.is_set():
            with self._lock:
                if self._batches and not self.hold:
                    self._batches.popleft()
                    return True
            time.sleep(0.01)
        return False

    def run(self) -> dict:
        step = self.start_step
        self._emit("log", {"message": f"stand-in runner of {self.job_id} starts", "dataset_rows": self.dataset_rows})
        while step < self.total_steps:
            if self._cancel.is_set():
                return {"status": "cancelled", "error": None, "step": step}
            if self.mode == "client" and not self._next_batch():
                continue
            time.sleep(self.step_s)
            step += 1
            if step == self.raise_at:
                raise RuntimeError("the stand-in runner failed at step 2")
            if step == self.crash_at:
                os._exit(3)
            self._emit("progress", {"step": step, "total_steps": self.total_steps})
            self._emit("metrics", {"step": step, "metrics": {"reward": step / self.total_steps, "kl": float("nan")}})
            if self._checkpoint_requested.is_set() or step == self.total_steps:
                self._checkpoint_requested.clear()
                self._save(step)
        return {"status": "completed", "error": None, "step": step}

    def drain_events(self) -> list[dict]:
        with self._lock:
            events, self._events = self._events, []
        return events

    def push_batch(self, step: int, rows: list[dict]) -> None:
        if any("reject" in row for row in rows):
            raise ValueError(f"the stand-in runner rejects step {step}")
        with self._lock:
            self._batches.append((step, rows))
        self._emit("log", {"message": f"received step {step}"})

    def queued(self) -> int:
        with self._lock:
            return len(self._batches)

    def cancel(self) -> None:
        self._cancel.set()

    def request_checkpoint(self) -> None:
        self._checkpoint_requested.set()

    def refuse_checkpoints(self, reason: str | None) -> None:
        self._checkpoint_refusal = reason



class LiveServer:
    """``create_app`` served by uvicorn in a thread on a free 127.0.0.1 port."""

    def __init__(self, settings: ServerSettings, runner_cls: type | None = StandInRunner):
        self.sock = bind_listening_socket("127.0.0.1", 0)  # with TCP_NODELAY: no ~40 ms Nagle stalls
        port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        self.settings = dataclasses.replace(settings, port=port)  # the port it really serves on
        self.app = create_app(self.settings, runner_cls=runner_cls)
        config = uvicorn.Config(self.app, log_level="warning", lifespan="on", timeout_graceful_shutdown=2,
                                loop="asyncio", **self.settings.uvicorn_options())  # as `opentinker-server serve`
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=lambda: self.server.run(sockets=[self.sock]), daemon=True)

    def start(self) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError("the test server failed to start")
            if time.monotonic() > deadline:
                raise TimeoutError("the test server did not start in 60 s")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        with contextlib.suppress(OSError):
            self.sock.close()

    @property
    def manager(self):
        return self.app.state.manager

    def client(self, key: str | None = None) -> httpx.Client:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=30.0, trust_env=False)


def test_settings(data_dir: Path, **overrides: Any) -> ServerSettings:
    values: dict[str, Any] = dict(
        data_dir=data_dir,
        max_queued_steps=2,
        event_poll_s=0.05,
        cancel_grace_s=5.0,
        endpoint_check_timeout_s=2.0,
        # The product's default: an actor still starting on a loaded 2-core machine (CI, with
        # the other xdist worker busy) took over 3 s to answer its first call.
        runner_call_timeout_s=10.0,
        env_hosts=["127.0.0.1"],  # the tests' env servers run on loopback
        max_running_jobs_per_user=100,  # the quota tests set their own
        max_queued_jobs_per_user=100,
        # The suite sends ~100 wrong keys from 127.0.0.1 on purpose (every route, both APIs);
        # test_operator_tooling.py checks the default limit.
        auth_failures_per_minute=1000,
    )
    values.update(overrides)
    return ServerSettings(**values)


test_settings.__test__ = False  # not a test, despite its name


def make_user(data_dir: Path, name: str) -> str:
    """A user and an API key, made through the admin functions; returns the key."""
    store = Store(data_dir / "opentinker.db")
    try:
        user = auth.create_user(store, name)
        return auth.create_api_key(store, user)
    finally:
        store.close()


class _RecordingHandler(BaseHTTPRequestHandler):
    """Some other service: records each request's path and Authorization header and
    answers 404 with a body that must never be shown to a client."""

    seen: list[dict] = []
    BODY = b"SECRET-internal-dashboard-token"

    def do_GET(self):  # noqa: N802
        type(self).seen.append({"path": self.path, "authorization": self.headers.get("Authorization")})
        self.send_response(404)
        self.send_header("Content-Length", str(len(self.BODY)))
        self.end_headers()
        self.wfile.write(self.BODY)

    do_POST = do_GET

    def log_message(self, *args):
        pass


@pytest.fixture
def recording_service() -> Iterator[tuple[str, list[dict]]]:
    """``(base_url, seen)`` of a service on 127.0.0.1 that records every request it gets."""
    _RecordingHandler.seen = []
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _RecordingHandler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}", _RecordingHandler.seen
    httpd.shutdown()


@pytest.fixture(scope="session")
def ray_cluster(ray_session) -> str:
    """The session's Ray (tests/conftest.py); the test servers use it instead of their own."""
    # The stand-in lives in this conftest, which Ray's workers cannot import by name:
    # ship its code by value.
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    return ray_session


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("server-data")


@pytest.fixture(scope="session")
def keys(data_dir) -> dict[str, str]:
    """API keys of alice and bob, plus a revoked one of alice's."""
    result = {"alice": make_user(data_dir, "alice"), "bob": make_user(data_dir, "bob")}
    store = Store(data_dir / "opentinker.db")
    try:
        revoked = auth.create_api_key(store, "alice")
        assert auth.revoke_api_key(store, revoked)
    finally:
        store.close()
    result["revoked"] = revoked
    return result


@pytest.fixture(scope="session")
def server(ray_cluster, data_dir, keys) -> Iterator[LiveServer]:
    live = LiveServer(test_settings(data_dir)).start()
    try:
        yield live
    finally:
        live.stop()


@pytest.fixture
def alice(server, keys) -> Iterator[httpx.Client]:
    with server.client(keys["alice"]) as client:
        yield client


@pytest.fixture
def bob(server, keys) -> Iterator[httpx.Client]:
    with server.client(keys["bob"]) as client:
        yield client


@pytest.fixture
def start_server(ray_cluster) -> Iterator[Callable[..., LiveServer]]:
    """``start_server(data_dir, **settings)``: another live server; stopped at teardown."""
    started: list[LiveServer] = []

    def start(data_dir: Path, **overrides: Any) -> LiveServer:
        live = LiveServer(test_settings(data_dir, **overrides)).start()
        started.append(live)
        return live

    yield start
    for live in started:
        live.stop()


# helpers for the test modules: with --import-mode=importlib a test module cannot import
# conftest, so they are handed out by the `helpers` fixture -------------------------------


def wait_for(predicate: Callable[[], Any], timeout: float = 30.0, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.05)


def iter_sse(response: httpx.Response) -> Iterator[dict[str, str]]:
    """One dict (id, event, data) per Server-Sent Event of ``response`` (httpx-sse reads them;
    comments such as ``: keep-alive`` are skipped)."""
    from httpx_sse import EventSource

    for sse in EventSource(response).iter_sse():
        if sse.data:
            yield {"id": sse.id, "event": sse.event, "data": sse.data}


def create_job(client: httpx.Client, name: str, *, mode: str = "server", steps: int = 3, **body: Any) -> str:
    payload = {"name": name, "mode": mode, "config": {"trainer.total_training_steps": steps}, **body}
    response = client.post("/v1/jobs", json=payload)
    assert response.status_code == 201, response.text
    return response.json()["job_id"]


def job_status(client: httpx.Client, job_id: str) -> str:
    response = client.get(f"/v1/jobs/{job_id}")
    assert response.status_code == 200, response.text
    return response.json()["status"]


def wait_status(client: httpx.Client, job_id: str, *statuses: str, timeout: float = 120.0) -> dict:
    # Generous: a job's actor is a new Ray worker process that imports torch and builds its
    # trainer, which took over 30 s on CI's 2 cores with the other xdist worker busy.
    def check():
        info = client.get(f"/v1/jobs/{job_id}").json()
        return info if info["status"] in statuses else None

    return wait_for(check, timeout, f"job {job_id} to be {'/'.join(statuses)}")


def all_events(client: httpx.Client, job_id: str, after: int = 0) -> list[dict]:
    response = client.get(f"/v1/jobs/{job_id}/events", params={"stream": "false", "after": after})
    assert response.status_code == 200, response.text
    return response.json()["events"]


@pytest.fixture(scope="session")
def helpers():
    import types

    return types.SimpleNamespace(
        wait_for=wait_for,
        iter_sse=iter_sse,
        create_job=create_job,
        job_status=job_status,
        wait_status=wait_status,
        all_events=all_events,
        make_user=make_user,
        StandInRunner=StandInRunner,
        LiveServer=LiveServer,  # LiveServer(test_settings(...), runner_cls=None): the real JobRunner
        test_settings=test_settings,
        run_schemathesis=run_schemathesis,
    )


def run_schemathesis(workdir: Path, document_url: str, header: str, expected_statuses: list[str],
                     max_examples: int, base_url: str | None = None,
                     hooks: Path | None = None, timeout_s: float = 900,
                     request_timeout_s: float = 10.0) -> tuple[subprocess.CompletedProcess, dict[str, Any]]:
    """schemathesis (its CLI, all checks, seed 1) over the document at ``document_url``,
    ``positive_data_acceptance`` accepting ``expected_statuses``; the finished process and
    its JSON report. ``hooks``: a module of schemathesis hooks (``SCHEMATHESIS_HOOKS``);
    ``request_timeout_s``: how long one request may take before the fuzzer calls it an error."""
    config = workdir / "schemathesis.toml"
    config.write_text(f"[checks.positive_data_acceptance]\nexpected-statuses = {json.dumps(expected_statuses)}\n")
    report = workdir / "report.json"
    command = [
        sys.executable, "-c", "from schemathesis.cli import schemathesis; schemathesis()",
        "--config-file", str(config), "run", document_url, *(["--url", base_url] if base_url else []),
        "--header", header, "--checks", "all", "--max-examples", str(max_examples), "--seed", "1",
        "--request-timeout", str(request_timeout_s),
        "--report", "json", "--report-json-path", str(report),
    ]  # fmt: skip
    env = {**os.environ, **({"SCHEMATHESIS_HOOKS": str(hooks)} if hooks else {})}
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, cwd=workdir, env=env)
    return done, json.loads(report.read_text())
