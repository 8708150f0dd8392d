"""JobManager: one Ray actor per job, and an asyncio task per job that mirrors it into the store.

The runner class (default :class:`opentinker.server.runner.JobRunner`) is wrapped as a
threaded Ray actor, so ``run`` can block in one thread while the control plane calls its
other methods from the event loop. The contract, all methods called through Ray:

- ``Runner(job_id, spec, job_dir, policy, resume_from_step)`` where ``spec`` is
  ``JobCreate.model_dump()`` (datasets included), ``job_dir`` is ``<data_dir>/jobs/<job_id>``
  (created), ``policy`` the server's :class:`~opentinker.server.policy.JobPolicy` (served
  models, allowlists, limits) and ``resume_from_step`` None, or the step of the job's
  checkpoint to continue from (a resumed job; client mode: its later pushed batches follow).
- ``run() -> {"status": "completed"|"failed"|"cancelled", "error": str|None, "step": int}``
  blocks until the job ends.
- ``drain_events() -> [{"type": EventType, "data": dict}, ...]`` since the last drain;
  ``checkpoint`` data is ``{"step", "name", "path"}`` (the path is indexed, not published).
- ``push_batch(step, rows)`` (client mode; raising ValueError rejects the batch),
  ``queued() -> int``, ``cancel()``, ``request_checkpoint()``.
- Optional: a static ``ray_actor_options(spec) -> dict`` merged into the actor's
  ``.options()`` (e.g. ``{"num_gpus": 1}``: Ray hides GPUs from actors that ask for none).

No call to a runner blocks the event loop: ObjectRefs are awaited (ray.init runs once, at
startup, before anything is served).

Scheduling: a user has at most ``max_running_jobs_per_user`` jobs in Ray at once; later ones
stay ``queued`` in the store and start, oldest first, as slots free up (also after a
restart). A client-mode job with nothing to train for ``client_idle_timeout_s`` is stopped.
A cancelled job's final status event is published only after its runner's last events.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.exceptions import RayActorError, RayTaskError

from opentinker.protocol import JobStatus
from opentinker.server.settings import ServerSettings
from opentinker.server.store import JobRecord, Store

log = logging.getLogger("opentinker.server.jobs")

RAY_NAMESPACE = "opentinker"
ACTOR_MAX_CONCURRENCY = 8
DEFAULT_RUNNER = "opentinker.server.runner.JobRunner"
_RUNNER_EVENT_TYPES = ("progress", "metrics", "checkpoint", "error", "log")


class JobNotActiveError(RuntimeError):
    """The job has no live runner (finished, interrupted by a restart, or never started)."""


class RunnerBusyError(RuntimeError):
    """The runner did not answer a control call in time (still being placed by Ray, or
    too busy); the caller may retry."""


def actor_name(job_id: str) -> str:
    return f"opentinker-job-{job_id}"


def _load_default_runner() -> type:
    module_name, _, attribute = DEFAULT_RUNNER.rpartition(".")
    return getattr(importlib.import_module(module_name), attribute)


@contextlib.contextmanager
def _keep_signal_handlers() -> Iterator[None]:
    """Undo the SIGTERM/SIGINT handlers ray.init installs: they exit the process at once,
    skipping uvicorn's graceful shutdown (and with it our lifespan, which kills the
    job actors and closes the store)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            if handler is not None:
                signal.signal(sig, handler)


def _ref_future(ref: Any) -> asyncio.Future:
    """An asyncio future for an ObjectRef, bound to the running loop."""
    return asyncio.wrap_future(ref.future())


_ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*m")


def ray_failure_reason(exc: BaseException) -> str:
    """A short account of a Ray failure: the runner's own exception when there is one."""
    if isinstance(exc, RayTaskError):
        cause = getattr(exc, "cause", None)
        if cause is not None:
            return f"{type(cause).__name__}: {cause}"
        return _last_line(str(exc))
    if isinstance(exc, RayActorError):
        text = _ANSI_ESCAPE.sub("", str(exc))
        if exc.actor_init_failed:  # the message ends with the constructor's exception
            return f"the job's runner failed to start: {_last_line(text)}"
        # Skip Ray's fixed first line and its tab-indented ids; keep the exit detail.
        lines = [line.strip() for line in text.splitlines()[1:] if line.strip() and not line.startswith("\t")]
        detail = " ".join(lines)
        if len(detail) > 300:
            detail = detail[:300] + "..."
        return "the job's runner process died" + (f": {detail}" if detail else "")
    return f"{type(exc).__name__}: {exc}"


def _last_line(text: str) -> str:
    lines = [line.strip() for line in _ANSI_ESCAPE.sub("", text).splitlines() if line.strip()]
    return lines[-1] if lines else text


def _jsonable(value: Any) -> Any:
    """Runner data as plain JSON: numpy/torch scalars unwrapped, NaN/inf as null (strict
    JSON has neither), anything else unknown as its string."""
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, bool) or value is None or isinstance(value, (int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    item = getattr(value, "item", None)
    if callable(item):
        with contextlib.suppress(Exception):
            return _jsonable(item())
    return str(value)


def normalize_events(raw: Any) -> list[dict[str, Any]]:
    """Runner events as ``{"type", "data"}`` with a known type. A runner cannot emit
    ``status`` (the manager owns the job's status) or invent types: those become ``log``."""
    events: list[dict[str, Any]] = []
    for event in raw or []:
        if not isinstance(event, dict):
            events.append({"type": "log", "data": {"message": str(event)}})
            continue
        type_ = event.get("type")
        data = event.get("data")
        data = _jsonable(data) if isinstance(data, dict) else {"value": _jsonable(data)}
        if type_ not in _RUNNER_EVENT_TYPES:
            data = {"message": f"runner event of type {type_!r}", "type": str(type_), "data": data}
            type_ = "log"
        events.append({"type": type_, "data": data})
    return events


@contextlib.contextmanager
def _ray_on_loopback(enabled: bool) -> Iterator[None]:
    """Make a local Ray started now listen on 127.0.0.1 only.

    Ray binds its gRPC servers to every interface unless its node IP is 127.0.0.1, and it
    turns an explicit 127.0.0.1 into the machine's reachable address; only its
    single-machine mode (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``, read through
    ``ray_constants.ENABLE_RAY_CLUSTER``) keeps the loopback address. Seen with Ray 2.60:
    gcs_server, raylet and workers then listen on [::ffff:127.0.0.1] only.
    """
    if not enabled:
        yield
        return
    from ray._private import ray_constants

    saved_env = os.environ.get(ray_constants.ENABLE_RAY_CLUSTERS_ENV_VAR)
    saved = ray_constants.ENABLE_RAY_CLUSTER
    os.environ[ray_constants.ENABLE_RAY_CLUSTERS_ENV_VAR] = "0"  # for the processes Ray starts
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved
        if saved_env is None:
            os.environ.pop(ray_constants.ENABLE_RAY_CLUSTERS_ENV_VAR, None)
        else:
            os.environ[ray_constants.ENABLE_RAY_CLUSTERS_ENV_VAR] = saved_env


@dataclass
class _ActiveJob:
    job_id: str
    user_id: int
    mode: str
    actor: Any = None
    task: asyncio.Task | None = None
    started: bool = False  # the runner's constructor has returned
    cancel_requested: bool = False
    kill_task: asyncio.Task | None = None
    # Client mode, for the idle timeout: the last pushed and trained step, and when either moved.
    pushed_step: int = 0
    trained_step: int = 0
    last_activity: float = field(default_factory=time.monotonic)


class JobManager:
    """Starts, watches, cancels and cleans up the Ray actor of every running job.

    ``runner_cls`` is the class to run as each job's actor (tests pass a small stand-in);
    None imports :data:`DEFAULT_RUNNER` on first use.
    """

    def __init__(self, store: Store, settings: ServerSettings, runner_cls: type | None = None):
        self.store = store
        self.settings = settings
        self._runner_cls = runner_cls
        self._remote_cls: Any = None
        self._active: dict[str, _ActiveJob] = {}
        self._owns_ray = False
        self._started = False
        self._reaper: subprocess.Popen | None = None
        self._scheduling = asyncio.Lock()
        self._background: set[asyncio.Task] = set()  # scheduling passes (held: the loop keeps only weak refs)
        # Job actors live in this server's own namespace, so that servers sharing a Ray
        # cluster never see (or sweep) each other's actors.
        self.namespace = f"{RAY_NAMESPACE}-{store.server_id()[:12]}"
        # What redact() replaces, longest first (a model folder may sit in the data folder).
        paths = {str(settings.data_dir.resolve()): "<data dir>", str(settings.data_dir): "<data dir>"}
        for model in settings.job_policy.models:
            if model.path and os.path.isabs(os.path.expanduser(model.path)):
                paths[os.path.expanduser(model.path).rstrip("/")] = f"<model {model.name}>"
        self._private_paths = sorted(paths.items(), key=lambda item: -len(item[0]))

    # lifecycle -----------------------------------------------------------------------

    def start(self) -> None:
        """Connect to Ray (or start a local one). If this process already has Ray up (an
        embedding application, the tests), it is used as is and left running at shutdown.

        A local Ray listens on loopback only (unless ``ray_all_interfaces``) and a watchdog
        process stops it if this server dies without shutting down. On an existing cluster
        (``ray_address``), job actors a previous server process left behind are killed."""
        if ray.is_initialized():
            self._owns_ray = False
        else:
            local = not self.settings.ray_address
            kwargs: dict[str, Any] = dict(
                address=self.settings.ray_address or None,
                include_dashboard=False,
                ignore_reinit_error=True,
                log_to_driver=False,
            )
            if local and self.settings.ray_num_cpus is not None:
                kwargs["num_cpus"] = self.settings.ray_num_cpus
            with _keep_signal_handlers(), _ray_on_loopback(local and not self.settings.ray_all_interfaces):
                ray.init(**kwargs)
            self._owns_ray = True
            if local:
                self._reaper = start_reaper()
            else:
                self._kill_leftover_actors()
        self._started = True
        log.info("ray: %s", ray.get_runtime_context().gcs_address)

    def _kill_leftover_actors(self) -> None:
        """Job actors of a previous process of this server (same store) on a shared cluster:
        their jobs are marked interrupted at startup, so nothing would ever watch them."""
        try:
            names = ray.util.list_named_actors(all_namespaces=True)
        except Exception:  # an old cluster without the API: nothing to sweep
            log.exception("could not list the cluster's named actors")
            return
        for entry in names:
            name, namespace = entry.get("name", ""), entry.get("namespace")
            if namespace == self.namespace and name.startswith(actor_name("")):
                with contextlib.suppress(Exception):
                    ray.kill(ray.get_actor(name, namespace=namespace), no_restart=True)
                    log.warning("killed %s, left running by a previous server process", name)

    async def shutdown(self) -> None:
        """Stop watching and kill every job's actor. Their store status is left as is: the
        next start marks running jobs interrupted (the same as after a crash)."""
        self._started = False  # no new job starts from here on
        active = list(self._active.values())
        for job in active:
            for task in (job.task, job.kill_task):
                if task is not None and not task.done():
                    task.cancel()
        for job in active:
            if job.task is not None:
                with contextlib.suppress(BaseException):
                    await job.task
            self._kill(job)
        self._active.clear()
        if self._owns_ray and ray.is_initialized():
            ray.shutdown()
        if self._reaper is not None:
            stop_reaper(self._reaper)
            self._reaper = None

    # jobs ----------------------------------------------------------------------------

    def runner_class(self) -> type:
        if self._runner_cls is None:
            self._runner_cls = _load_default_runner()
        return self._runner_cls

    def _remote_runner(self) -> Any:
        if self._remote_cls is None:  # wrapped once: Ray exports the class on first use
            self._remote_cls = ray.remote(self.runner_class())
        return self._remote_cls

    def active_job_ids(self) -> list[str]:
        return sorted(self._active)

    def is_active(self, job_id: str) -> bool:
        return job_id in self._active

    def placement_problem(self, cfg: Any) -> str | None:
        """Why the Ray cluster could never place the job's FSDP ranks (one GPU each, or one
        CPU each on CPU; with trainer.nnodes > 1, n_gpus_per_node on each of that many nodes),
        or None. Checked against the cluster's total, not what is free now: a job that must
        wait for other jobs to end is fine, one that can never start is not."""
        if cfg.actor_rollout_ref.actor.strategy != "fsdp":
            return None
        ranks = int(cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node)
        total = ray.cluster_resources()
        gpu = cfg.trainer.device == "cuda" or (cfg.trainer.device == "auto" and total.get("GPU", 0) > 0)
        resource = "GPU" if gpu else "CPU"
        have = total.get(resource, 0)
        if have < ranks:
            return (f"actor_rollout_ref.actor.strategy=fsdp with trainer.nnodes x trainer.n_gpus_per_node = {ranks} "
                    f"ranks needs {ranks} {resource} in this server's Ray cluster, which has {have:g}")
        nodes, per_node = int(cfg.trainer.nnodes), int(cfg.trainer.n_gpus_per_node)
        if nodes > 1:  # the ranks go n_gpus_per_node on each of nnodes distinct nodes (backend/fsdp.py)
            fit = sum(1 for node in ray.nodes() if node.get("Alive") and all(
                node.get("Resources", {}).get(key, 0) >= per_node for key in {resource, "CPU"}))
            if fit < nodes:
                return (f"trainer.nnodes={nodes} spreads the FSDP ranks over {nodes} distinct nodes, {per_node} on "
                        f"each, which needs {nodes} nodes with {per_node} {resource} each in this server's Ray "
                        f"cluster; it has {fit}")
        return None

    def has_gpus(self) -> bool:
        """Whether this server's Ray cluster has GPUs (what ``trainer.device=auto`` picks)."""
        return ray.cluster_resources().get("GPU", 0) > 0

    def running_count(self, user_id: int) -> int:
        return sum(1 for job in self._active.values() if job.user_id == user_id)

    def submit(self, job: JobRecord) -> None:
        """Start the job when its user has a free slot, else leave it queued (it starts when
        one frees up); returns at once."""
        if not self._started:
            raise RuntimeError("JobManager.start() has not been called")
        self._schedule_soon()

    def _schedule_soon(self) -> None:
        task = asyncio.get_running_loop().create_task(self.schedule(), name="schedule")
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def schedule(self) -> None:
        """Start queued jobs, oldest first, while their users have free slots."""
        async with self._scheduling:
            limit = self.settings.max_running_jobs_per_user
            for job in self.store.unfinished_jobs(JobStatus.QUEUED):
                if job.job_id not in self._active and self.running_count(job.user_id) < limit:
                    await self._launch(job)

    async def _launch(self, job: JobRecord) -> None:
        """Create the job's actor and the task that watches it."""
        active = _ActiveJob(job.job_id, job.user_id, job.mode)
        self._active[job.job_id] = active
        job_dir = self.settings.job_dir(job.job_id)
        resume_from = self.store.resume_step(job.job_id) if job.step > 0 else None
        try:
            job_dir.mkdir(parents=True, exist_ok=True)
            data = await asyncio.to_thread(self.store.job_data, job.job_id)  # datasets can be large
            spec = {**job.spec, **data}
            runner_cls = self.runner_class()
            options: dict[str, Any] = {
                "max_concurrency": ACTOR_MAX_CONCURRENCY,
                "name": actor_name(job.job_id),
                "namespace": self.namespace,
            }
            extra_options = getattr(runner_cls, "ray_actor_options", None)
            if callable(extra_options):
                options.update(extra_options(spec) or {})
            active.actor = (
                self._remote_runner()
                .options(**options)
                .remote(job.job_id, spec, str(job_dir), self.settings.job_policy, resume_from)
            )
            if resume_from is not None:
                self._announce_resume(job, resume_from, active)
        except Exception as exc:  # the runner class failed to import, bad options, ...
            log.exception("job %s: could not start its runner", job.job_id)
            del self._active[job.job_id]
            self.store.set_status(job.job_id, JobStatus.FAILED,
                                  error=self.redact(f"could not start the job's runner: {exc}"))
            return
        if self.store.get_job(job.job_id).status is not JobStatus.QUEUED:  # cancelled meanwhile
            self._kill(active)
            del self._active[job.job_id]
            return
        active.task = asyncio.get_running_loop().create_task(self._supervise(active), name=f"job-{job.job_id}")

    def _announce_resume(self, job: JobRecord, step: int, active: _ActiveJob) -> None:
        """Say where a resumed job continues; client mode: feed it the batches pushed after
        its checkpoint again (in step order: a threaded actor takes them by index anyway)."""
        again = f"; steps {step + 1} to {job.step} run again (no checkpoint after step {step})" if job.step > step else ""
        self.store.append_event(job.job_id, "log", {"message": f"resuming from checkpoint global_step_{step}{again}"})
        active.trained_step = step
        for pushed, rows in self.store.pushed_rows_after(job.job_id, step):
            active.actor.push_batch.remote(pushed, rows)
            active.pushed_step = pushed

    async def resume(self, job_id: str, reason: str) -> bool:
        """Queue a stopped job again from its newest usable checkpoint; False when it has none."""
        if self.store.resume_step(job_id) is None or not self.store.reopen(job_id, reason):
            return False
        self._schedule_soon()
        return True

    async def _call(self, job_id: str, method: str, *args: Any, timeout: float | None) -> Any:
        """``actor.method(*args)``, awaited. Raises JobNotActiveError, RunnerBusyError
        (no answer within ``timeout``), RayActorError (the actor died) or RayTaskError
        (the runner raised; ``.cause`` is its exception)."""
        ref = getattr(self._actor(job_id), method).remote(*args)
        try:
            return await asyncio.wait_for(_ref_future(ref), timeout)
        except asyncio.TimeoutError:
            raise RunnerBusyError(f"job {job_id}'s runner did not answer {method}() within {timeout}s") from None

    async def queued(self, job_id: str) -> int:
        """Batches pushed but not yet trained."""
        return int(await self._call(job_id, "queued", timeout=self.settings.runner_call_timeout_s))

    async def push_batch(self, job_id: str, step: int, rows: list[dict[str, Any]]) -> None:
        """Forward one client-mode batch. No timeout: once sent, a call is delivered in order
        to the live actor, so giving up early would leave the step's fate unknown (and a
        retry could deliver it twice). Callers ask ``queued`` first, which has one."""
        await self._call(job_id, "push_batch", step, rows, timeout=None)
        active = self._active.get(job_id)
        if active is not None:
            active.pushed_step = max(active.pushed_step, step)
            active.last_activity = time.monotonic()

    async def request_checkpoint(self, job_id: str) -> None:
        await self._call(job_id, "request_checkpoint", timeout=self.settings.runner_call_timeout_s)

    async def cancel(self, job_id: str, reason: str = "cancelled by the user") -> bool:
        """Mark the job cancelled now; ask its runner to stop after the current step and
        kill the actor once ``run`` returns or ``cancel_grace_s`` has passed. The final
        status event follows the runner's last events. Returns False when the job had
        already finished (nothing changes)."""
        active = self._active.get(job_id)
        draining = active is not None and active.started and not active.cancel_requested
        changed = self.store.set_status(job_id, JobStatus.CANCELLED, reason=reason, publish=not draining)
        if not changed or active is None or active.cancel_requested:
            return changed
        active.cancel_requested = True
        if not active.started:
            # Still being placed or constructed: there is no step to finish.
            if active.task is not None:
                active.task.cancel()
            return True
        # Not awaited: the answer does not matter, and the kill below is the backstop.
        active.actor.cancel.remote()
        active.kill_task = asyncio.get_running_loop().create_task(self._kill_after_grace(active))
        return True

    def started_actor(self, job_id: str) -> Any | None:
        """The runner actor of a job whose runner is up and not being cancelled, else None."""
        active = self._active.get(job_id)
        if active is None or not active.started or active.cancel_requested:
            return None
        return active.actor

    def _actor(self, job_id: str) -> Any:
        active = self._active.get(job_id)
        if active is None:
            raise JobNotActiveError(f"job {job_id} has no running runner")
        return active.actor

    # watching one job ------------------------------------------------------------------

    def _store_events(self, active: _ActiveJob, raw: Any) -> None:
        events = normalize_events(raw)
        if not events:
            return
        for event in events:
            if event["type"] == "error":
                event["data"] = self._published_error(active.job_id, event["data"])
        self.store.append_runner_events(active.job_id, events)
        for event in events:
            step = event["data"].get("step")
            if event["type"] == "progress" and isinstance(step, int):
                active.trained_step = max(active.trained_step, step)
                active.last_activity = time.monotonic()

    async def _drain(self, active: _ActiveJob) -> None:
        self._store_events(active, await _ref_future(active.actor.drain_events.remote()))

    def _idle_for(self, active: _ActiveJob) -> float | None:
        """Seconds a client-mode job has had nothing to train (None: it has work, or is not client mode)."""
        if active.mode != "client" or active.cancel_requested or active.trained_step < active.pushed_step:
            return None
        return time.monotonic() - active.last_activity

    async def _supervise(self, active: _ActiveJob) -> None:
        job_id, poll = active.job_id, self.settings.event_poll_s
        run: asyncio.Future | None = None
        try:
            run = _ref_future(active.actor.run.remote())
            # The first drain is answered once the runner's constructor has returned: from
            # then on the job is running (before, Ray may still be placing the actor).
            await self._drain(active)
            active.started = True
            active.last_activity = time.monotonic()
            self.store.set_status(job_id, JobStatus.RUNNING)
            idle_limit = self.settings.client_idle_timeout_s
            while not run.done():
                await asyncio.wait({run}, timeout=poll)
                await self._drain(active)
                idle = self._idle_for(active)
                if idle is not None and idle > idle_limit:
                    await self.cancel(
                        job_id,
                        f"stopped after {idle:.0f} s with no step to train (client-mode jobs end after "
                        f"{idle_limit:g} s without a pushed batch; the server's --client-idle-timeout)",
                    )
            result = run.result()
            await self._drain(active)
            self._finish(job_id, result)
        except asyncio.CancelledError:
            raise
        except (RayActorError, RayTaskError) as exc:
            # A RayActorError from a drain may come before run's own; prefer run's account.
            if run is not None and run.done() and run.exception() is not None:
                exc = run.exception()  # type: ignore[assignment]
            log.warning("job %s failed: %s", job_id, ray_failure_reason(exc))
            self.store.set_status(job_id, JobStatus.FAILED, error=self.redact(ray_failure_reason(exc)))
        except Exception as exc:
            log.exception("job %s: watching the runner failed", job_id)
            self.store.set_status(job_id, JobStatus.FAILED, error=self.redact(ray_failure_reason(exc)))
        finally:
            if run is not None:
                if run.done():
                    with contextlib.suppress(BaseException):
                        run.exception()
                else:
                    run.cancel()
            if active.kill_task is not None and active.kill_task is not asyncio.current_task():
                active.kill_task.cancel()
            self._kill(active)
            self.store.publish_status(job_id)  # a cancel's final event, after the runner's last events
            if self._active.get(job_id) is active:
                del self._active[job_id]
            if self._started:  # a slot is free: start the next queued job
                self._schedule_soon()

    def _published_error(self, job_id: str, data: dict[str, Any]) -> dict[str, Any]:
        """An error event as users see it: its message (server paths replaced) and an id to
        quote. Its trace goes to this server's log under that id, never to the store."""
        trace = data.pop("traceback", None)
        error_id = str(data.get("error_id") or uuid.uuid4().hex[:12])
        message = self.redact(str(data.get("message") or "the job's runner reported an error"))
        log.error("job %s: error %s: %s%s", job_id, error_id, message, f"\n{trace}" if trace else "")
        return {**data, "message": message, "error_id": error_id}

    def redact(self, text: str) -> str:
        """``text`` without this server's folders: the data folder and served models' paths
        (exception messages name them; where things live on the server is the operator's business)."""
        for path, label in self._private_paths:
            text = text.replace(path, label)
        return text

    def _finish(self, job_id: str, result: Any) -> None:
        if not isinstance(result, dict):
            self.store.set_status(job_id, JobStatus.FAILED, error=f"the runner's run() returned {result!r}, not a dict")
            return
        try:
            status = JobStatus(result.get("status"))
        except ValueError:
            status = JobStatus.FAILED
            result = {**result, "error": f"the runner's run() returned unknown status {result.get('status')!r}"}
        if not status.finished or status is JobStatus.INTERRUPTED:
            status = JobStatus.FAILED
            result = {**result, "error": f"the runner's run() returned non-final status {result.get('status')!r}"}
        step = result.get("step")
        error = result.get("error")
        self.store.set_status(
            job_id,
            status,
            error=self.redact(str(error)) if error else None,
            step=step if isinstance(step, int) else None,
        )

    async def _kill_after_grace(self, active: _ActiveJob) -> None:
        task = active.task
        if task is None:
            return
        done, _ = await asyncio.wait({task}, timeout=self.settings.cancel_grace_s)
        if not done:
            grace = self.settings.cancel_grace_s
            log.warning("job %s: the runner did not stop within %ss of the cancel; killing it", active.job_id, grace)
            task.cancel()

    def _kill(self, active: _ActiveJob) -> None:
        if active.actor is not None:
            with contextlib.suppress(Exception):
                ray.kill(active.actor, no_restart=True)


def start_reaper() -> subprocess.Popen | None:
    """Start the watchdog that stops this process's Ray if the process dies (Linux only)."""
    if not sys.platform.startswith("linux"):
        return None
    return subprocess.Popen(
        [sys.executable, "-m", "opentinker.server.reaper", str(os.getpid())],
        stdin=subprocess.PIPE,
        start_new_session=True,  # a signal to the server's process group spares the watchdog
    )


def stop_reaper(reaper: subprocess.Popen) -> None:
    """Close the watchdog's pipe (it then stops whatever of Ray is left) and wait for it."""
    with contextlib.suppress(Exception):
        assert reaper.stdin is not None
        reaper.stdin.close()
    try:
        reaper.wait(timeout=15)
    except subprocess.TimeoutExpired:
        reaper.kill()
