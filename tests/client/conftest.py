"""A small but faithful v1 protocol server for the client tests (FastAPI + uvicorn on 127.0.0.1).

It implements the route table of ``docs/design.md`` with simulated jobs (no training):
a job walks through its steps emitting status/progress/metrics events; client-mode jobs
consume the batches pushed to them from a bounded queue (429 + Retry-After when full).
Knobs on :class:`ProtocolState` make it misbehave on purpose — answer a route with 5xx
first, lose the answer to a job creation, cut SSE connections after k events — and every
request is recorded (method, path, headers) so the tests can count what the client sent.
"""

from __future__ import annotations

import asyncio
import collections
import io
import json
import socket
import tarfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
import uvicorn
from fastapi import Depends, FastAPI, Header, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from opentinker.client import OpenTinkerClient
from opentinker.environments.env_routing import shard_urls
from opentinker.environments.registry import default_registry
from opentinker.environments.server import bind_listening_socket
from opentinker.protocol import (
    CheckpointInfo,
    CheckpointList,
    EnvCheck,
    EnvCheckResult,
    Event,
    Health,
    JobCreate,
    JobCreated,
    JobInfo,
    JobList,
    JobStatus,
    StepAccepted,
    StepBatch,
)

API_KEY = "test-key"
FAIL_JOB_NAME = "will-fail"  # a job with this name fails at step 2
FAIL_MESSAGE = "CUDA out of memory while computing old logprobs"


@dataclass
class Recorded:
    method: str
    path: str
    headers: dict[str, str]


@dataclass
class SimJob:
    info: JobInfo
    events: list[Event] = field(default_factory=list)
    queue: collections.deque = field(default_factory=collections.deque)
    accepted: dict[int, StepAccepted] = field(default_factory=dict)
    next_push: int = 1
    rows_consumed: list[list[dict]] = field(default_factory=list)
    checkpoints: list[CheckpointInfo] = field(default_factory=list)
    save_requested: bool = False
    request: JobCreate | None = None


def checkpoint_archive(files: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for name, content in files.items():
            member = tarfile.TarInfo(name)
            member.size = len(content)
            member.mtime = int(time.time())
            tar.addfile(member, io.BytesIO(content))
    return buffer.getvalue()


class ProtocolState:
    def __init__(self) -> None:
        self.requests: list[Recorded] = []
        self.jobs: dict[str, SimJob] = {}
        self.job_keys: dict[str, str] = {}  # Idempotency-Key of POST /v1/jobs -> job id
        self.step_keys: dict[tuple[str, str], StepAccepted] = {}
        # (method, path) -> statuses to answer with before the route runs
        self.inject: dict[tuple[str, str], list[int]] = {}
        self.lose_create_answers = 0  # create the job, then answer 504 (as if the answer was lost)
        self.sse_drop_after: int | None = None  # each SSE connection ends after this many events
        self.sse_abort = False  # ... by breaking the connection mid-event instead of ending cleanly
        self.sse_connections: list[str | None] = []  # Last-Event-ID of each SSE connection
        self.queue_limit = 2
        self.retry_after = "0.05"
        self.rate_limited = 0
        self.step_time = 0.02
        self.hold = threading.Event()  # while clear, server-mode jobs do not start
        self.hold.set()
        self.default_steps = 3
        self.archives: dict[tuple[str, str], bytes] = {}
        self.allowed = default_registry().allowed_paths()
        self.tasks: set[asyncio.Task] = set()

    def posts(self, path: str) -> list[Recorded]:
        return [r for r in self.requests if r.method == "POST" and r.path == path]

    def emit(self, job: SimJob, type_: str, data: dict[str, Any]) -> None:
        job.events.append(
            Event(id=len(job.events) + 1, job_id=job.info.job_id, type=type_, data=data, created_at=time.time())
        )

    def set_status(self, job: SimJob, status: JobStatus, reason: str | None = None) -> None:
        job.info.status = status
        job.info.updated_at = time.time()
        data: dict[str, Any] = {"status": status.value}
        if reason:
            data["reason"] = reason
        self.emit(job, "status", data)
        job.info.final_event_id = job.events[-1].id if status.finished else None  # where its events end


def _total_steps(config: dict[str, Any]) -> int | None:
    if "trainer.total_training_steps" in config:
        return int(config["trainer.total_training_steps"])
    trainer = config.get("trainer")
    if isinstance(trainer, dict) and "total_training_steps" in trainer:
        return int(trainer["total_training_steps"])
    return None


async def _run_job(state: ProtocolState, job: SimJob) -> None:
    while not state.hold.is_set():
        await asyncio.sleep(0.01)
    if job.info.status.finished:
        return
    state.set_status(job, JobStatus.RUNNING)
    total = job.info.total_steps
    state.emit(job, "log", {"message": "loading model sim"})  # as the server's runner does
    state.emit(job, "log", {"message": f"model sim loaded; training {total} steps"})
    for step in range(1, total + 1):
        if job.info.mode == "client":
            while not job.queue and not job.info.status.finished:
                await asyncio.sleep(0.005)
            if job.info.status.finished:
                return
            job.rows_consumed.append(job.queue.popleft())
        await asyncio.sleep(state.step_time)
        if job.info.status.finished:  # cancelled meanwhile
            return
        if job.info.name == FAIL_JOB_NAME and step == 2:
            job.info.error = FAIL_MESSAGE
            state.emit(job, "error", {"message": FAIL_MESSAGE})
            state.set_status(job, JobStatus.FAILED, reason="error")
            return
        job.info.step = step
        state.emit(job, "progress", {"step": step, "total_steps": total})
        state.emit(job, "metrics", {"step": step, "metrics": {"reward/mean": step / total, "actor/kl": 0.001 * step}})
        if job.save_requested:
            job.save_requested = False
            name = f"global_step_{step}"
            job.checkpoints.append(CheckpointInfo(name=name, step=step, created_at=time.time()))
            state.emit(job, "checkpoint", {"step": step, "name": name})
    state.set_status(job, JobStatus.COMPLETED)


class _Recorder:
    """Pure ASGI middleware: records every request and answers injected statuses."""

    def __init__(self, app: Any, server: ProtocolServer):
        self.app = app
        self.server = server

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            state = self.server.state
            headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
            state.requests.append(Recorded(scope["method"], scope["path"], headers))
            pending = state.inject.get((scope["method"], scope["path"]))
            if pending:
                status = pending.pop(0)
                await JSONResponse({"error": f"injected {status}"}, status_code=status)(scope, receive, send)
                return
        await self.app(scope, receive, send)


class ProtocolServer:
    api_key = API_KEY
    fail_job_name = FAIL_JOB_NAME
    fail_message = FAIL_MESSAGE
    archive = staticmethod(checkpoint_archive)

    def __init__(self) -> None:
        self.state = ProtocolState()
        self.app = self._build_app()
        self.url = ""

    def reset(self) -> None:
        self.state = ProtocolState()

    def _job(self, job_id: str) -> SimJob:
        job = self.state.jobs.get(job_id)
        if job is None:
            raise HTTPException(404, f"no job {job_id!r}")
        return job

    def _build_app(self) -> FastAPI:
        app = FastAPI()
        server = self

        @app.exception_handler(HTTPException)
        async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
            return JSONResponse({"error": str(exc.detail), "detail": None}, status_code=exc.status_code,
                                headers=exc.headers)

        @app.exception_handler(RequestValidationError)
        async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"][1:])
            return JSONResponse({"error": f"invalid request: {where}: {first['msg']}", "detail": exc.errors()},
                                status_code=422)

        def auth(authorization: str | None = Header(None)) -> None:
            if authorization != f"Bearer {API_KEY}":
                raise HTTPException(401, "invalid or missing API key")

        @app.get("/health")  # lets the test server double as an env endpoint
        async def env_health() -> dict:
            return {"status": "ok"}

        @app.get("/v1/health")
        async def health() -> Health:
            return Health(version="test")

        @app.get("/v1/version", dependencies=[Depends(auth)])
        async def version() -> dict:
            return {"version": "test", "protocol": 1}

        @app.post("/v1/jobs", status_code=201, dependencies=[Depends(auth)])
        async def create_job(job: JobCreate, idempotency_key: str | None = Header(None)) -> Any:
            state = server.state
            if idempotency_key and idempotency_key in state.job_keys:
                return JobCreated(job_id=state.job_keys[idempotency_key])
            now = time.time()
            job_id = uuid.uuid4().hex[:12]
            info = JobInfo(job_id=job_id, name=job.name, mode=job.mode, status=JobStatus.QUEUED, created_at=now,
                           updated_at=now, total_steps=_total_steps(job.config) or state.default_steps,
                           config={"trainer.total_training_steps": _total_steps(job.config) or state.default_steps})
            sim = SimJob(info=info, request=job)
            state.jobs[job_id] = sim
            if idempotency_key:
                state.job_keys[idempotency_key] = job_id
            state.set_status(sim, JobStatus.QUEUED)
            task = asyncio.create_task(_run_job(state, sim))
            state.tasks.add(task)
            if state.lose_create_answers > 0:
                state.lose_create_answers -= 1
                return JSONResponse({"error": "gateway timeout"}, status_code=504)
            return JobCreated(job_id=job_id)

        @app.get("/v1/jobs", dependencies=[Depends(auth)])
        async def list_jobs() -> JobList:
            return JobList(jobs=[j.info for j in server.state.jobs.values()])

        @app.get("/v1/jobs/{job_id}", dependencies=[Depends(auth)])
        async def get_job(job_id: str) -> JobInfo:
            return server._job(job_id).info

        @app.post("/v1/jobs/{job_id}/cancel", dependencies=[Depends(auth)])
        async def cancel(job_id: str) -> JobInfo:
            job = server._job(job_id)
            if job.info.status == JobStatus.COMPLETED:
                raise HTTPException(409, f"job {job_id} already completed")
            if not job.info.status.finished:
                server.state.set_status(job, JobStatus.CANCELLED, reason="cancelled by user")
            return job.info

        @app.post("/v1/jobs/{job_id}/steps", status_code=202, dependencies=[Depends(auth)])
        async def push_step(job_id: str, batch: StepBatch, idempotency_key: str | None = Header(None)) -> Any:
            state = server.state
            job = server._job(job_id)
            if job.info.mode != "client":
                raise HTTPException(409, f"job {job_id} runs in server mode; it takes no step batches")
            if idempotency_key and (job_id, idempotency_key) in state.step_keys:
                return state.step_keys[(job_id, idempotency_key)].model_copy(update={"duplicate": True})
            if batch.step in job.accepted:
                return job.accepted[batch.step].model_copy(update={"duplicate": True})
            if job.info.status.finished:
                raise HTTPException(409, f"job {job_id} is {job.info.status.value}")
            if batch.step != job.next_push:
                raise HTTPException(409, f"expected step {job.next_push}, got step {batch.step}")
            if len(job.queue) >= state.queue_limit:
                state.rate_limited += 1
                raise HTTPException(429, "the step queue is full", headers={"Retry-After": state.retry_after})
            job.queue.append(batch.rows)
            job.next_push += 1
            accepted = StepAccepted(step=batch.step, queued=len(job.queue))
            job.accepted[batch.step] = accepted
            if idempotency_key:
                state.step_keys[(job_id, idempotency_key)] = accepted
            return accepted

        @app.get("/v1/jobs/{job_id}/events", dependencies=[Depends(auth)])
        async def events(job_id: str, stream: bool = True, last_event_id: str | None = Header(None)) -> Any:
            state = server.state
            job = server._job(job_id)
            if not stream:
                return {"events": [e.model_dump(mode="json") for e in job.events]}
            state.sse_connections.append(last_event_id)
            start = int(last_event_id or 0)

            async def generate():
                yield ": connected\n\n"
                cursor, sent = start, 0
                while True:
                    for event in [e for e in job.events if e.id > cursor]:
                        if state.sse_drop_after is not None and sent >= state.sse_drop_after:
                            if state.sse_abort:
                                # half an event, then the connection breaks
                                yield f"id: {event.id}\nevent: {event.type}\ndata: {{\"id\": {event.id}, "
                                raise ConnectionAbortedError("simulated dropped connection")
                            return
                        yield f"id: {event.id}\nevent: {event.type}\ndata: {event.model_dump_json()}\n\n"
                        cursor, sent = event.id, sent + 1
                        if event.type == "status" and JobStatus(event.data["status"]).finished:
                            return
                    if job.info.status.finished and cursor >= len(job.events):
                        return  # resumed past the final event: nothing more will come
                    await asyncio.sleep(0.01)

            return StreamingResponse(generate(), media_type="text/event-stream")

        @app.get("/v1/jobs/{job_id}/checkpoints", dependencies=[Depends(auth)])
        async def checkpoints(job_id: str) -> CheckpointList:
            return CheckpointList(checkpoints=server._job(job_id).checkpoints)

        @app.post("/v1/jobs/{job_id}/checkpoints", status_code=202, dependencies=[Depends(auth)])
        async def save_checkpoint(job_id: str) -> dict:
            job = server._job(job_id)
            if job.info.status.finished:
                raise HTTPException(409, f"job {job_id} is {job.info.status.value}")
            job.save_requested = True
            return {"status": "scheduled"}

        @app.get("/v1/jobs/{job_id}/checkpoints/{name}/download", dependencies=[Depends(auth)])
        async def download(job_id: str, name: str) -> Response:
            job = server._job(job_id)
            if name not in {c.name for c in job.checkpoints}:
                raise HTTPException(404, f"job {job_id} has no checkpoint {name!r}")
            archive = server.state.archives.get((job_id, name)) or checkpoint_archive(
                {"config.json": json.dumps({"model_type": "qwen2", "step": name}).encode(),
                 "model.safetensors": b"\0" * 64, "tokenizer/tokenizer.json": b"{}"}
            )
            return Response(archive, media_type="application/gzip")

        @app.post("/v1/env/check", dependencies=[Depends(auth)])
        async def env_check(body: EnvCheck) -> EnvCheckResult:
            allowed = server.state.allowed
            problems = []
            async with httpx.AsyncClient(timeout=2.0) as http:
                for spec in body.interactions:
                    if spec.class_path not in allowed:
                        problems.append(f"interaction {spec.name!r}: class {spec.class_path!r} is not allowed")
                        continue
                    if "env_endpoint" in spec.config or "env_shards" in spec.config:
                        for url in shard_urls(spec.config.get("env_endpoint"), spec.config.get("env_shards")):
                            try:
                                (await http.get(url + "/health")).raise_for_status()
                            except httpx.HTTPError as exc:
                                problems.append(f"interaction {spec.name!r}: env endpoint {url} did not answer "
                                                f"GET /health ({type(exc).__name__})")
            return EnvCheckResult(ok=not problems, allowed_class_paths=allowed, problems=problems)

        return _Recorder(app, server)


class _ServerThread:
    def __init__(self, app: Any):
        self.sock = bind_listening_socket("127.0.0.1", 0)  # with TCP_NODELAY: no ~40 ms Nagle stalls
        self.port = self.sock.getsockname()[1]
        config = uvicorn.Config(app, log_level="critical", access_log=False, lifespan="off", loop="asyncio",
                                timeout_graceful_shutdown=1)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the protocol test server did not start")
            time.sleep(0.01)
        return f"http://127.0.0.1:{self.port}"

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()


@pytest.fixture(scope="session")
def _protocol_server():
    server = ProtocolServer()
    with _ServerThread(server.app) as url:
        server.url = url
        yield server


@pytest.fixture
def proto(_protocol_server: ProtocolServer) -> ProtocolServer:
    """The protocol server with fresh state."""
    _protocol_server.reset()
    return _protocol_server


@pytest.fixture
def client(proto: ProtocolServer):
    with OpenTinkerClient(proto.url, API_KEY, timeout=10, retries=3, backoff=0.01, max_backoff=0.05) as c:
        yield c


def closed_port_url() -> str:
    """A loopback URL nobody listens on (the port was just free)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


@pytest.fixture
def closed_url() -> str:
    return closed_port_url()

