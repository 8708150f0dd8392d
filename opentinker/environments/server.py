"""Serve a plain Python environment class over the OpenTinker env protocol (JSON over HTTP).

A user writes an ordinary class and hands it to :func:`serve_environment`::

    class MyEnv:
        def reset(self, **kwargs) -> str | dict: ...
        def step(self, action: str) -> tuple[str, float, bool, dict]: ...
        def close(self) -> None: ...          # optional

    serve_environment(MyEnv, port=8000)

Protocol (the field names are fixed; the trainer's agent loop speaks them):

``POST /reset``    ``{"instance_id", "job_id"?, "seed"?, ...extra}``
                   -> ``{"observation": str, "system_prompt": str | null, "info": {}}``
``POST /step``     ``{"instance_id", "action", "step"?, "job_id"?}``
                   -> ``{"observation": str, "reward": float, "done": bool, "info": {}}``
``POST /finalize`` ``{"instance_id", "job_id"?}`` -> ``{"ok": true}``
``GET  /health``   -> ``{"status": "ok", "instances": int, "env": str, "jobs": {job_id: {...}}}``

Decisions worth knowing:

* ``step`` is the index of the step a ``/step`` request means: the number of steps already
  applied to the instance (0 for the first). With ``step`` equal to that count the step is
  applied; with ``step`` one less, the stored answer of the last step is returned again
  *without* calling ``env.step`` (a retry whose answer was lost), so retries never apply a
  step twice; any other index is a 409 naming the expected and the given index. A request
  without ``step`` is applied as it comes.
* ``job_id`` is stored per instance (from ``/reset``); a ``/step`` whose ``job_id`` differs
  from its instance's is a 409. ``app.state.stats`` and ``/health`` count resets, steps,
  replayed steps, finalized and expired instances and user errors per job id; requests
  without one count under ``"default"``.

* ``/reset`` builds a *new* ``EnvClass(**env_kwargs)`` per instance id and calls
  ``reset(seed=..., **extra)``; ``seed`` is passed only when the request has one and
  ``job_id`` is kept for bookkeeping, never passed on. Resetting a live id replaces (and
  closes) the old object; if the new ``reset`` fails the old instance is left as it was.
* ``reset`` may return a string, a dict ``{"observation", "system_prompt"?, "info"?}`` or a
  gymnasium-style ``(observation, info)`` pair. ``step`` may return the 4-tuple
  ``(observation, reward, done, info)`` or gymnasium's 5-tuple
  ``(observation, reward, terminated, truncated, info)``; an episode that is truncated but
  not terminated answers ``done: true`` with ``info["truncated"] = true``.
* Every error body is ``{"error": "<message>"}`` plus ``"instance_id"`` when one is
  involved: 404 for an unknown instance on ``/step``, 409 for a ``/step`` after the episode
  reported ``done`` (reset or finalize it instead), 422 for a malformed request (the
  message names the missing/invalid fields; pydantic's ``"detail"`` list rides along) and
  500 when the user's code raises (the message is ``"<ExceptionType>: <text>"``); the
  server keeps serving after any of them.
* ``/finalize`` calls ``close()`` and forgets the instance; an unknown id is fine
  (idempotent). An exception from ``close()`` is logged, not returned.
* User methods are synchronous: they run in a worker thread, under a per-instance lock, so
  two requests on one instance never interleave while different instances run concurrently.
* Instances untouched for ``idle_timeout_s`` are closed and dropped by a background sweep
  every ``sweep_interval_s`` (default: a tenth of the timeout). An instance in the middle of
  a request is never swept.

Only fastapi/uvicorn (the ``env`` extra) are needed; no torch.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import socket
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool

logger = logging.getLogger(__name__)

DEFAULT_IDLE_TIMEOUT_S = 600.0
DEFAULT_JOB = "default"  # the statistics key of requests that carry no job_id
_MAX_JOB_ID_CHARS = 256

__all__ = [
    "DEFAULT_JOB",
    "EnvInstance",
    "EnvJobStats",
    "EnvServerError",
    "EnvServerStats",
    "create_env_app",
    "running_app_servers",
    "running_env_server",
    "serve_environment",
]


# --------------------------------------------------------------------------- requests


class ResetRequest(BaseModel):
    """Unknown fields are allowed: they are passed to ``reset`` as keyword arguments."""

    model_config = ConfigDict(extra="allow")

    instance_id: str
    job_id: str | None = Field(default=None, max_length=_MAX_JOB_ID_CHARS)
    seed: int | None = None


class StepRequest(BaseModel):
    instance_id: str
    action: str
    step: int | None = Field(default=None, ge=0, description="steps already applied to the instance")
    job_id: str | None = Field(default=None, max_length=_MAX_JOB_ID_CHARS)


class FinalizeRequest(BaseModel):
    instance_id: str
    job_id: str | None = Field(default=None, max_length=_MAX_JOB_ID_CHARS)


# --------------------------------------------------------------------------- state


class EnvServerError(Exception):
    """An error answered as ``{"error": message, "instance_id"?: ...}`` with ``status``."""

    def __init__(self, status: int, message: str, instance_id: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.instance_id = instance_id


@dataclass
class EnvInstance:
    """One live environment object and its bookkeeping."""

    instance_id: str
    env: Any
    job_id: str | None = None
    created_at: float = field(default_factory=time.monotonic)
    last_used: float = field(default_factory=time.monotonic)
    steps: int = 0
    done: bool = False
    last_reply: dict | None = None  # the answer of the last applied step, for a retried /step
    busy: int = 0  # requests currently holding or waiting for the lock
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    def touch(self) -> None:
        self.last_used = time.monotonic()


@dataclass
class EnvJobStats:
    """Request counters; ``replayed_steps`` are retried /step requests answered from memory."""

    resets: int = 0
    steps: int = 0
    replayed_steps: int = 0
    finalized: int = 0
    expired: int = 0
    user_errors: int = 0


MAX_TRACKED_JOBS = 256  # job ids with counters of their own in /health


@dataclass
class EnvServerStats(EnvJobStats):
    """Totals over all jobs, and ``by_job``: the same counters per job id (``DEFAULT_JOB``
    for requests without one), for the ``MAX_TRACKED_JOBS`` most recently active jobs (a
    client picks job ids: the table must not grow with them)."""

    by_job: OrderedDict[str, EnvJobStats] = field(default_factory=OrderedDict)

    def count(self, job_id: str | None, counter: str) -> None:
        key = job_id if job_id is not None else DEFAULT_JOB
        job = self.by_job.pop(key, None) or EnvJobStats()
        self.by_job[key] = job  # now the most recent
        if len(self.by_job) > MAX_TRACKED_JOBS:
            self.by_job.popitem(last=False)
        for counts in (self, job):
            setattr(counts, counter, getattr(counts, counter) + 1)


# --------------------------------------------------------------------------- helpers


def _describe(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _error_response(status: int, message: str, instance_id: str | None = None, **extra) -> JSONResponse:
    body: dict[str, Any] = {"error": message}
    if instance_id is not None:
        body["instance_id"] = instance_id
    body.update(extra)
    return JSONResponse(status_code=status, content=body)


def _json_info(info: Any, what: str) -> dict:
    if info is None:
        return {}
    if not isinstance(info, dict):
        raise TypeError(f"{what} info must be a dict, got {type(info).__name__}")
    return jsonable_encoder(info)


def _normalize_reset(result: Any) -> dict:
    """A reset return value as the protocol's ``{"observation", "system_prompt", "info"}``."""
    system_prompt = None
    info: Any = {}
    if isinstance(result, str):
        observation = result
    elif isinstance(result, dict):
        if "observation" not in result:
            raise TypeError("reset() returned a dict without an 'observation' key")
        observation = result["observation"]
        system_prompt = result.get("system_prompt")
        info = result.get("info")
    elif isinstance(result, tuple) and len(result) == 2:
        observation, info = result
    else:
        raise TypeError(
            "reset() must return a str, a dict with 'observation' or an (observation, info) "
            f"pair, got {type(result).__name__}"
        )
    if not isinstance(observation, str):
        raise TypeError(f"reset() observation must be a str, got {type(observation).__name__}")
    if system_prompt is not None and not isinstance(system_prompt, str):
        raise TypeError(f"reset() system_prompt must be a str or None, got {type(system_prompt).__name__}")
    return {"observation": observation, "system_prompt": system_prompt, "info": _json_info(info, "reset()")}


def _normalize_step(result: Any) -> dict:
    """A step return value (4- or gymnasium 5-tuple) as the protocol's step response."""
    cut_short = False
    if isinstance(result, (tuple, list)) and len(result) == 4:
        observation, reward, done, info = result
    elif isinstance(result, (tuple, list)) and len(result) == 5:
        observation, reward, terminated, truncated, info = result
        done = bool(terminated) or bool(truncated)
        cut_short = bool(truncated) and not bool(terminated)  # `done` alone would lose this
    else:
        raise TypeError(
            "step() must return (observation, reward, done, info) or "
            f"(observation, reward, terminated, truncated, info), got {result!r:.200}"
        )
    if not isinstance(observation, str):
        raise TypeError(f"step() observation must be a str, got {type(observation).__name__}")
    reward = float(reward)
    if not math.isfinite(reward):
        raise ValueError(f"step() reward must be finite, got {reward}")
    info = _json_info(info, "step()")
    if cut_short:
        info["truncated"] = True
    return {"observation": observation, "reward": reward, "done": bool(done), "info": info}


def _close_env(env: Any, instance_id: str) -> None:
    close = getattr(env, "close", None)
    if close is None:
        return
    try:
        close()
    except Exception:  # a failing close must not take the server (or a sweep) down
        logger.exception("close() of environment instance %r failed", instance_id)


# --------------------------------------------------------------------------- the app


def create_env_app(
    env_class: type,
    *,
    env_kwargs: dict | None = None,
    idle_timeout_s: float | None = DEFAULT_IDLE_TIMEOUT_S,
    sweep_interval_s: float | None = None,
) -> FastAPI:
    """A FastAPI app serving ``env_class`` over the env protocol.

    ``idle_timeout_s`` of None or <= 0 disables idle expiry. ``sweep_interval_s`` defaults to
    a tenth of the timeout (at most 30 s). State is inspectable: ``app.state.instances``
    (instance id -> :class:`EnvInstance`), ``app.state.stats`` (:class:`EnvServerStats`, with
    a per-job breakdown).
    """
    env_kwargs = dict(env_kwargs or {})
    expire = idle_timeout_s is not None and idle_timeout_s > 0
    if sweep_interval_s is None:
        sweep_interval_s = min(idle_timeout_s / 10.0, 30.0) if expire else 30.0
    sweep_interval_s = max(float(sweep_interval_s), 0.01)

    instances: dict[str, EnvInstance] = {}
    stats = EnvServerStats()

    async def close_instance(inst: EnvInstance) -> None:
        """Close an instance already removed from ``instances``, once nobody is using it."""
        async with inst.lock:
            await run_in_threadpool(_close_env, inst.env, inst.instance_id)

    async def sweep_once() -> int:
        now = time.monotonic()
        stale = [
            inst
            for inst in instances.values()
            if inst.busy == 0 and not inst.lock.locked() and now - inst.last_used > idle_timeout_s
        ]
        for inst in stale:
            if instances.get(inst.instance_id) is inst:
                del instances[inst.instance_id]
                stats.count(inst.job_id, "expired")
                logger.info("instance %r idle for %.1fs: closed", inst.instance_id, now - inst.last_used)
        for inst in stale:
            await close_instance(inst)
        return len(stale)

    async def sweeper() -> None:
        while True:
            await asyncio.sleep(sweep_interval_s)
            try:
                await sweep_once()
            except Exception:  # keep sweeping whatever happens
                logger.exception("idle sweep failed")

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        task = asyncio.create_task(sweeper()) if expire else None
        try:
            yield
        finally:
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            leftovers = list(instances.values())
            instances.clear()
            for inst in leftovers:
                await run_in_threadpool(_close_env, inst.env, inst.instance_id)

    app = FastAPI(title=f"OpenTinker environment: {env_class.__name__}", lifespan=lifespan)
    app.state.env_class = env_class
    app.state.env_kwargs = env_kwargs
    app.state.instances = instances
    app.state.stats = stats
    app.state.idle_timeout_s = idle_timeout_s if expire else None
    app.state.sweep_interval_s = sweep_interval_s
    app.state.sweep_once = sweep_once

    @app.exception_handler(EnvServerError)
    async def _env_error(request: Request, exc: EnvServerError) -> JSONResponse:
        return _error_response(exc.status, exc.message, exc.instance_id)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        parts = []
        for err in errors:
            loc = ".".join(str(p) for p in err.get("loc", ()) if p != "body") or "body"
            parts.append(f"{loc}: {err.get('msg', 'invalid')}")
        return _error_response(422, "invalid request: " + "; ".join(parts), detail=jsonable_encoder(errors))

    def make_and_reset(extra: dict) -> tuple[Any, dict]:
        env = env_class(**env_kwargs)
        try:
            return env, _normalize_reset(env.reset(**extra))
        except BaseException:
            _close_env(env, "<failed reset>")
            raise

    @app.post("/reset")
    async def reset(req: ResetRequest) -> dict:
        extra = dict(req.model_extra or {})
        if req.seed is not None:
            extra["seed"] = req.seed
        try:
            env, response = await run_in_threadpool(make_and_reset, extra)
        except Exception as exc:
            stats.count(req.job_id, "user_errors")
            logger.warning("reset of %r failed: %s", req.instance_id, _describe(exc))
            raise EnvServerError(500, _describe(exc), req.instance_id) from exc
        old = instances.get(req.instance_id)
        instances[req.instance_id] = EnvInstance(req.instance_id, env, job_id=req.job_id)
        stats.count(req.job_id, "resets")
        if old is not None:
            await close_instance(old)
        return response

    @app.post("/step")
    async def step(req: StepRequest) -> dict:
        inst = instances.get(req.instance_id)
        if inst is None:
            raise EnvServerError(404, f"unknown instance_id {req.instance_id!r}", req.instance_id)
        inst.busy += 1
        try:
            inst.touch()
            async with inst.lock:
                if instances.get(req.instance_id) is not inst:  # finalized/replaced while we waited
                    raise EnvServerError(404, f"unknown instance_id {req.instance_id!r}", req.instance_id)
                if req.job_id is not None and req.job_id != inst.job_id:
                    raise EnvServerError(
                        409, f"instance {req.instance_id!r} belongs to another job than {req.job_id!r}", req.instance_id
                    )
                if req.step is not None and req.step != inst.steps:
                    if req.step == inst.steps - 1 and inst.last_reply is not None:
                        stats.count(inst.job_id, "replayed_steps")  # a retry whose answer was lost
                        return inst.last_reply
                    raise EnvServerError(
                        409,
                        f"step index mismatch for instance {req.instance_id!r}: expected step {inst.steps}, "
                        f"got {req.step}",
                        req.instance_id,
                    )
                if inst.done:
                    raise EnvServerError(
                        409,
                        f"instance {req.instance_id!r} is done; call /reset or /finalize",
                        req.instance_id,
                    )
                try:
                    response = _normalize_step(await run_in_threadpool(lambda: inst.env.step(req.action)))
                except Exception as exc:
                    stats.count(inst.job_id, "user_errors")
                    logger.warning("step of %r failed: %s", req.instance_id, _describe(exc))
                    raise EnvServerError(500, _describe(exc), req.instance_id) from exc
                inst.steps += 1
                inst.done = response["done"]
                inst.last_reply = response
                stats.count(inst.job_id, "steps")
                return response
        finally:
            inst.touch()
            inst.busy -= 1

    @app.post("/finalize")
    async def finalize(req: FinalizeRequest) -> dict:
        inst = instances.pop(req.instance_id, None)
        if inst is not None:
            stats.count(inst.job_id, "finalized")
            await close_instance(inst)
        return {"ok": True}

    @app.get("/health")
    async def health() -> dict:
        live = Counter(inst.job_id if inst.job_id is not None else DEFAULT_JOB for inst in instances.values())
        jobs = {job: {"instances": live.get(job, 0), **asdict(counts)} for job, counts in stats.by_job.items()}
        return {"status": "ok", "instances": len(instances), "env": env_class.__name__, "jobs": jobs}

    return app


# --------------------------------------------------------------------------- running it


def bind_listening_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (0: a free port) for uvicorn's ``sockets=``."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto=IPPROTO_TCP matters: asyncio only sets TCP_NODELAY on accepted sockets whose proto
    # says TCP, and without it every response stalls ~40 ms (Nagle vs. delayed ACK).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.bind((host, port))
        sock.listen(2048)  # claim the port now; uvicorn's create_server(sock=...) listens again
    except BaseException:
        sock.close()
        raise
    return sock


def _bind_consecutive(host: str, port: int, count: int, attempts: int = 50) -> list[socket.socket]:
    """``count`` sockets bound to consecutive ports from ``port`` (0: any free run)."""
    if port:
        socks: list[socket.socket] = []
        try:
            for offset in range(count):
                socks.append(bind_listening_socket(host, port + offset))
        except BaseException:
            for s in socks:
                s.close()
            raise
        return socks
    last_error: OSError | None = None
    for _ in range(attempts):
        first = bind_listening_socket(host, 0)
        socks = [first]
        base = first.getsockname()[1]
        try:
            for offset in range(1, count):
                socks.append(bind_listening_socket(host, base + offset))
            return socks
        except OSError as exc:
            last_error = exc
            for s in socks:
                s.close()
    raise OSError(f"no run of {count} consecutive free ports on {host}") from last_error


def _url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


class _ServerThread:
    def __init__(self, app: FastAPI, sock: socket.socket, log_level: str, access_log: bool):
        host, port = sock.getsockname()[:2]
        self.url = _url(host, port)
        self.sock = sock
        config = uvicorn.Config(
            app, log_level=log_level, access_log=access_log, lifespan="on", timeout_graceful_shutdown=5,
            loop="asyncio",  # the same loop with or without uvloop installed (vLLM pulls it in)
        )
        self.server = uvicorn.Server(config)
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name=f"env-server-{port}", daemon=True)

    def _run(self) -> None:
        try:
            self.server.run(sockets=[self.sock])
        except BaseException as exc:  # SystemExit from a failed startup included
            self.error = exc

    def start(self) -> None:
        self.thread.start()

    def wait_started(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError(f"environment server {self.url} failed to start: {self.error!r}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"environment server {self.url} did not start in {timeout}s")
            time.sleep(0.01)

    def stop(self, timeout: float) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)
        if self.thread.is_alive():
            self.server.force_exit = True
            self.thread.join(timeout)
        with contextlib.suppress(OSError):
            self.sock.close()


def _wait_healthy(urls: Sequence[str], timeout: float) -> None:
    """Ask each ``{url}/health`` every 20 ms until it answers 200 (stdlib client: no proxies,
    no log noise); TimeoutError once ``timeout`` seconds have passed for all of them."""
    import http.client
    from urllib.parse import urlsplit

    from tenacity import RetryError, Retrying, retry_if_result, wait_fixed

    deadline = time.monotonic() + timeout

    def healthy(url: str) -> bool:
        parts = urlsplit(url)
        conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=1.0)
        try:
            conn.request("GET", "/health")
            return conn.getresponse().status == 200
        except (OSError, http.client.HTTPException):
            return False
        finally:
            conn.close()

    for url in urls:
        retrying = Retrying(
            retry=retry_if_result(lambda ok: not ok),
            stop=lambda _state: time.monotonic() > deadline,
            wait=wait_fixed(0.02),
        )
        try:
            retrying(healthy, url)
        except RetryError:
            raise TimeoutError(f"{url}/health did not answer within {timeout}s") from None


@contextlib.contextmanager
def running_app_servers(
    apps: Sequence[FastAPI],
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    log_level: str = "warning",
    access_log: bool = False,
    startup_timeout_s: float = 30.0,
) -> Iterator[list[str]]:
    """Serve each app on its own port (consecutive from ``port``; 0 picks a free run) in
    background threads; yields their base URLs once ``/health`` answers on every one and
    shuts them all down on exit."""
    socks = _bind_consecutive(host, port, len(apps))
    threads = [_ServerThread(app, sock, log_level, access_log) for app, sock in zip(apps, socks)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.wait_started(startup_timeout_s)
        urls = [t.url for t in threads]
        _wait_healthy(urls, startup_timeout_s)
        yield urls
    finally:
        for t in threads:
            t.server.should_exit = True
        for t in threads:
            t.stop(timeout=10.0)


@contextlib.contextmanager
def running_env_server(
    env_class: type,
    host: str = "127.0.0.1",
    port: int = 0,
    num_shards: int = 1,
    **kw: Any,
) -> Iterator[list[str]]:
    """Serve ``env_class`` in background threads; yields the shards' base URLs.

    ``kw`` goes to :func:`create_env_app` (``env_kwargs``, ``idle_timeout_s``,
    ``sweep_interval_s``), except ``log_level``, ``access_log`` and ``startup_timeout_s``
    which go to :func:`running_app_servers`. Each shard is its own app with its own state.
    """
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    run_kw = {k: kw.pop(k) for k in ("log_level", "access_log", "startup_timeout_s") if k in kw}
    apps = [create_env_app(env_class, **kw) for _ in range(num_shards)]
    with running_app_servers(apps, host, port, **run_kw) as urls:
        yield urls


def serve_environment(
    env_class: type,
    host: str = "127.0.0.1",
    port: int = 8000,
    *,
    num_shards: int = 1,
    idle_timeout_s: float | None = DEFAULT_IDLE_TIMEOUT_S,
    sweep_interval_s: float | None = None,
    env_kwargs: dict | None = None,
    log_level: str = "info",
    access_log: bool = False,
) -> None:
    """Serve ``env_class`` until interrupted (Ctrl+C / SIGTERM); blocks.

    ``num_shards > 1`` serves independent copies on ports ``port .. port + num_shards - 1``.
    """
    import signal

    stop = threading.Event()
    previous = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, lambda *_: stop.set())
    try:
        with running_env_server(
            env_class,
            host,
            port,
            num_shards,
            env_kwargs=env_kwargs,
            idle_timeout_s=idle_timeout_s,
            sweep_interval_s=sweep_interval_s,
            log_level=log_level,
            access_log=access_log,
        ) as urls:
            for url in urls:
                logger.info("serving %s at %s", env_class.__name__, url)
                print(f"{env_class.__name__} environment server listening on {url}", flush=True)
            while not stop.wait(0.2):
                pass
            print("shutting down", flush=True)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
