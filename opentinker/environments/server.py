"""Serve a plain Python environment class over the OpenTinker env protocol (JSON over HTTP).

A user writes an ordinary class and hands it to :func:`serve_environment`::

    class MyEnv:
        def reset(self, **kwargs) -> str | dict: ...
        def step(self, action: str) -> tuple[str, float, bool, dict]: ...
        def close(self) -> None: ...          # optional

    serve_environment(MyEnv, port=8000)

Protocol (the field names are fixed; the trainer's agent loop speaks them):

``POST /reset``    ``{"instance_id", "job_id"?, "seed"?, ...extra}``
                   -> ``{"observation": str, "images"?: [data URL], "system_prompt": str | null, "info": {}}``
``POST /step``     ``{"instance_id", "action", "step"?, "job_id"?}``
                   -> ``{"observation": str, "images"?: [data URL], "reward": float, "done": bool, "info": {}}``
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
  gymnasium-style ``(observation, info)`` pair. An observation (at reset or step) is a string,
  or ``{"text": str, "images": [...]}`` for a vision-language model: each picture (PNG, JPEG or
  WebP bytes, a path, a Pillow image, or a data URL) goes out as a data URL in the answer's
  ``"images"`` list, and the trainer shows them before the text in the next user turn. ``step`` may return the 4-tuple
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
import socket
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from opentinker.environments.env_table import (
    DEFAULT_JOB, EnvInstance, EnvJobStats, EnvServerError, EnvServerStats, EnvTable, FinalizeRequest, ResetRequest,
    StepRequest,
)

logger = logging.getLogger(__name__)

DEFAULT_IDLE_TIMEOUT_S = 600.0

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


# --------------------------------------------------------------------------- the app


def _error_response(status: int, message: str, instance_id: str | None = None, **extra) -> JSONResponse:
    body: dict[str, Any] = {"error": message}
    if instance_id is not None:
        body["instance_id"] = instance_id
    body.update(extra)
    return JSONResponse(status_code=status, content=body)


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
    expire = idle_timeout_s is not None and idle_timeout_s > 0
    if sweep_interval_s is None:
        sweep_interval_s = min(idle_timeout_s / 10.0, 30.0) if expire else 30.0
    sweep_interval_s = max(float(sweep_interval_s), 0.01)
    table = EnvTable(env_class, dict(env_kwargs or {}), idle_timeout_s if expire else None)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        task = asyncio.create_task(table.sweep_forever(sweep_interval_s)) if expire else None
        try:
            yield
        finally:
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            await table.close_all()

    app = FastAPI(title=f"OpenTinker environment: {env_class.__name__}", lifespan=lifespan)
    app.state.env_class = env_class
    app.state.env_kwargs = table.env_kwargs
    app.state.instances = table.instances
    app.state.stats = table.stats
    app.state.idle_timeout_s = table.idle_timeout_s
    app.state.sweep_interval_s = sweep_interval_s
    app.state.sweep_once = table.sweep_once

    @app.exception_handler(EnvServerError)
    async def _env_error(request: Request, exc: EnvServerError) -> JSONResponse:
        return _error_response(exc.status, exc.message, exc.instance_id)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        parts = [f"{'.'.join(str(p) for p in err.get('loc', ()) if p != 'body') or 'body'}: {err.get('msg', 'invalid')}"
                 for err in errors]
        return _error_response(422, "invalid request: " + "; ".join(parts), detail=jsonable_encoder(errors))

    @app.post("/reset")
    async def reset(req: ResetRequest) -> dict:
        return await table.reset(req)

    @app.post("/step")
    async def step(req: StepRequest) -> dict:
        return await table.step(req)

    @app.post("/finalize")
    async def finalize(req: FinalizeRequest) -> dict:
        return await table.finalize(req)

    @app.get("/health")
    async def health() -> dict:
        return table.health()

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
