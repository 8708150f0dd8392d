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
- Optional: ``refuse_checkpoints(reason: str | None)``: while ``reason`` is set, a checkpoint
  would not be kept (the server's checkpoint bounds, :mod:`opentinker.server.checkpoint_caps`;
  the reason names the operator's flag): the runner writes none and emits a warning ``log``
  event with the reason instead, and goes on training. Told before ``run`` when the job starts
  refused, then whenever the answer changes. Without it, the checkpoints a runner writes are
  still measured and those past a bound deleted (a warning event says so).

No call to a runner blocks the event loop: ObjectRefs are awaited (ray.init runs once, at
startup, before anything is served).

Scheduling: a user has at most ``max_running_jobs_per_user`` jobs in Ray at once; later ones
stay ``queued`` in the store and start, oldest first, as slots free up (also after a
restart). A client-mode job with nothing to train for ``client_idle_timeout_s`` is stopped.
A cancelled job's final status event is published only after its runner's last events.
Each checkpoint a runner reports is measured on disk and kept only within the server's
checkpoint bounds (:class:`~opentinker.server.checkpoint_caps.JobCheckpointCaps`).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.exceptions import RayActorError, RayTaskError

from opentinker.protocol import JobStatus, step_checkpoint_name
from opentinker.server.accounting import UsageMeter
from opentinker.server.audit_hooks import kept_checkpoints
from opentinker.server.checkpoint_caps import JobCheckpointCaps
from opentinker.server.job_metering import JobMetering
from opentinker.server.ray_cluster import RayCluster
from opentinker.server.redaction import Redaction
from opentinker.server.runner_reports import final_status, normalize_events, ray_failure_reason
from opentinker.server.settings import ServerSettings
from opentinker.server.store import JobRecord, Store

log = logging.getLogger("opentinker.server.jobs")

RAY_NAMESPACE = "opentinker"
ACTOR_MAX_CONCURRENCY = 8
DEFAULT_RUNNER = "opentinker.server.runner.JobRunner"


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


def _ref_future(ref: Any) -> asyncio.Future:
    """An asyncio future for an ObjectRef, bound to the running loop."""
    return asyncio.wrap_future(ref.future())


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
    # Checkpoints: why the runner was last told its next one would not be kept (None: it would),
    # and the size of the newest it wrote (the estimate of the next; None: none measured yet).
    checkpoint_refusal: str | None = None
    checkpoint_bytes: int | None = None


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
        self._started = False
        self._scheduling = asyncio.Lock()
        self._background: set[asyncio.Task] = set()  # scheduling passes (held: the loop keeps only weak refs)
        # Job actors live in this server's own namespace, so that servers sharing a Ray
        # cluster never see (or sweep) each other's actors.
        self.namespace = f"{RAY_NAMESPACE}-{store.server_id()[:12]}"
        self.cluster = RayCluster(settings, self.namespace, leftover_prefix=actor_name(""))
        self.redaction = Redaction(settings)  # server folders out of what users read
        self.checkpoints = JobCheckpointCaps(store, settings)
        self.audit: Any = None  # the app's AuditLog (audit_hooks.install): kept checkpoints are audited
        # Each step's tokens, compute seconds and checkpoints, as its events arrive (the same
        # usage_buckets table as app.state.usage's meter: the meter keeps nothing in memory).
        self.metering = JobMetering(UsageMeter(store, settings.usage_retention_days), store, settings.job_policy)

    # lifecycle -----------------------------------------------------------------------

    def start(self) -> None:
        """Connect to Ray (:meth:`RayCluster.connect`); jobs may start from then on."""
        self.checkpoints.measure_on_disk()
        self.cluster.connect()
        self._started = True

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
            _kill(job)
        self._active.clear()
        self.cluster.disconnect()

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
            _kill(active)
            del self._active[job.job_id]
            return
        active.task = asyncio.get_running_loop().create_task(self._supervise(active), name=f"job-{job.job_id}")

    def _announce_resume(self, job: JobRecord, step: int, active: _ActiveJob) -> None:
        """Say where a resumed job continues; client mode: feed it the batches pushed after
        its checkpoint again (in step order: a threaded actor takes them by index anyway)."""
        again = f"; steps {step + 1} to {job.step} run again (no checkpoint after step {step})" if job.step > step else ""
        self.store.append_event(job.job_id, "log", {"message": f"resuming from checkpoint {step_checkpoint_name(step)}{again}"})
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
        kept = 0  # bytes of this drain's checkpoints kept, not yet indexed
        for i, event in enumerate(events):
            if event["type"] == "error":
                event["data"] = self.redaction.published_error(active.job_id, event["data"])
            elif event["type"] == "checkpoint":
                events[i], size = self.checkpoints.landed(active.user_id, active.job_id, event, kept)
                active.checkpoint_bytes = size or active.checkpoint_bytes
                kept += events[i]["data"].get("size_bytes") or 0
        self.store.append_runner_events(active.job_id, events)
        kept_checkpoints(self.audit, self.store, active.user_id, active.job_id, events)
        self.metering.record(active.job_id, active.user_id, events)
        for event in events:
            step = event["data"].get("step")
            if event["type"] == "progress" and isinstance(step, int):
                active.trained_step = max(active.trained_step, step)
                active.last_activity = time.monotonic()

    async def _tell_checkpoint_room(self, active: _ActiveJob) -> None:
        """Tell a runner with ``refuse_checkpoints`` whether its next checkpoint would be kept,
        when that changes. Awaited, so the runner hears the answers in order."""
        if not hasattr(self.runner_class(), "refuse_checkpoints"):
            return
        refusal = self.checkpoints.refusal(active.user_id, active.job_id, active.checkpoint_bytes)
        if refusal != active.checkpoint_refusal:
            await _ref_future(active.actor.refuse_checkpoints.remote(refusal))
            active.checkpoint_refusal = refusal

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
            await self._tell_checkpoint_room(active)  # a job that starts refused writes no checkpoint
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
                await self._tell_checkpoint_room(active)
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
            _kill(active)
            self.store.publish_status(job_id)  # a cancel's final event, after the runner's last events
            if self._active.get(job_id) is active:
                del self._active[job_id]
            if self._started:  # a slot is free: start the next queued job
                self._schedule_soon()

    def redact(self, text: str) -> str:
        return self.redaction.redact(text)

    def _finish(self, job_id: str, result: Any) -> None:
        status, error, step = final_status(result)
        self.store.set_status(job_id, status, error=self.redact(error) if error else None, step=step)

    async def _kill_after_grace(self, active: _ActiveJob) -> None:
        task = active.task
        if task is None:
            return
        done, _ = await asyncio.wait({task}, timeout=self.settings.cancel_grace_s)
        if not done:
            grace = self.settings.cancel_grace_s
            log.warning("job %s: the runner did not stop within %ss of the cancel; killing it", active.job_id, grace)
            task.cancel()



def _kill(active: _ActiveJob) -> None:
    if active.actor is not None:
        with contextlib.suppress(Exception):
            ray.kill(active.actor, no_restart=True)
