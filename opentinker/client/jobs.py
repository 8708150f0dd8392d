"""``JobHandle``: one training job on the server — its info, event stream, checkpoints and,
in client mode, the step batches the client pushes."""

from __future__ import annotations

import os
import tarfile
import tempfile
import threading
import time
import uuid
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

import httpx
import pydantic

from opentinker.client.errors import (
    ConflictError,
    JobFailedError,
    JobTimeoutError,
    NotFoundError,
    OpenTinkerError,
    RateLimitError,
    UnsafeArchiveError,
    error_from_response,
)
from opentinker.client.sse import iter_sse
from opentinker.protocol import (
    CheckpointInfo,
    CheckpointList,
    Event,
    JobInfo,
    JobStatus,
    StepAccepted,
    StepBatch,
)

if TYPE_CHECKING:
    from opentinker.client.client import OpenTinkerClient

__all__ = ["JobHandle", "extract_tar_safely"]

_RETRY_STATUSES = frozenset({502, 503, 504})
_DEFAULT_RETRY_AFTER_S = 1.0
_MAX_RETRY_AFTER_S = 60.0
#: metric names shown in the progress bar's postfix, first one present wins
_POSTFIX_METRICS: dict[str, tuple[str, ...]] = {"reward": ("reward/mean",), "kl": ("actor/kl", "actor/kl_loss")}


class _RetryableStatus(Exception):
    def __init__(self, status_code: int):
        super().__init__(f"HTTP {status_code}")
        self.status_code = status_code


def _final_status(event: Event) -> JobStatus | None:
    """The finished status an event announces, or None."""
    if event.type != "status":
        return None
    try:
        status = JobStatus(event.data.get("status"))
    except ValueError:
        return None
    return status if status.finished else None


def _sleep(seconds: float, deadline: float | None, stop: threading.Event | None = None) -> bool:
    """Sleep (never past ``deadline``); False when ``stop`` was set meanwhile."""
    if deadline is not None:
        seconds = min(seconds, max(0.0, deadline - time.monotonic()))
    if stop is not None:
        return not stop.wait(seconds)
    time.sleep(seconds)
    return True


class JobHandle:
    """A job on the server, by id. Cheap to create; every method asks the server."""

    def __init__(self, client: OpenTinkerClient, job_id: str):
        self.client = client
        self.job_id = job_id
        self._pusher: _StepPusher | None = None

    def __repr__(self) -> str:
        return f"JobHandle({self.job_id!r}, server={self.client.base_url!r})"

    @property
    def _path(self) -> str:
        return f"/jobs/{quote(self.job_id, safe='')}"

    # ------------------------------------------------------------------ state

    def info(self) -> JobInfo:
        """``GET /v1/jobs/{id}``."""
        return JobInfo.model_validate(self.client.request_json("GET", self._path))

    def cancel(self) -> JobInfo:
        """``POST /v1/jobs/{id}/cancel``. Cancelling a job that already finished is not an
        error: its (final) info comes back."""
        self.stop_pushing()
        try:
            return JobInfo.model_validate(self.client.request_json("POST", f"{self._path}/cancel"))
        except ConflictError:
            info = self.info()
            if info.status.finished:
                return info
            raise

    def events(self, after: int | None = None) -> list[Event]:
        """Every event so far (``GET /v1/jobs/{id}/events?stream=false``), those with id > ``after``."""
        body = self.client.request_json("GET", f"{self._path}/events", params={"stream": "false"})
        events = [Event.model_validate(e) for e in body.get("events", [])]
        return [e for e in events if after is None or e.id > after]

    def metrics(self) -> list[dict[str, Any]]:
        """The data of every metrics event so far: ``[{"step": k, "metrics": {name: value}}, ...]``."""
        return [e.data for e in self.events() if e.type == "metrics"]

    # ------------------------------------------------------------------ event stream

    def stream(self, after: int | None = None) -> Iterator[Event]:
        """The job's events as they happen (Server-Sent Events), from the one after ``after``
        (None: from the first). A dropped connection is resumed with ``Last-Event-ID`` set to
        the last id seen, so no event is lost or repeated. Stops after the final status event
        (or, resuming past it, as soon as the job is known to be finished)."""
        return self._stream(after, deadline=None)

    def _stream(self, after: int | None, deadline: float | None) -> Iterator[Event]:
        client = self.client
        last = int(after or 0)
        failures = 0  # consecutive failed connections
        idle = 0  # consecutive clean ends that brought nothing new
        while True:
            read_timeout = client.stream_read_timeout
            if deadline is not None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise JobTimeoutError(f"timed out waiting for job {self.job_id} (it keeps running)")
                read_timeout = min(read_timeout, remaining)
            received = False
            try:
                for event in self._connect(last, read_timeout):
                    if event.id <= last:
                        continue  # the server repeated something we have: skip, never yield twice
                    last = event.id
                    received, failures, idle = True, 0, 0
                    yield event
                    if _final_status(event) is not None:
                        return
                    if deadline is not None and time.monotonic() >= deadline:
                        raise JobTimeoutError(f"timed out waiting for job {self.job_id} (it keeps running)")
            except httpx.ReadTimeout:
                continue  # a quiet stream (no heartbeat): reconnect; the deadline check is above
            except (httpx.TransportError, _RetryableStatus) as exc:
                if failures >= client.retries:
                    raise client.connection_error(exc, failures + 1) from exc
                _sleep(client.backoff_delay(failures), deadline)
                failures += 1
                continue
            if received:
                continue  # the stream ended early: resume at once from the last id
            if self.info().status.finished:
                return  # nothing after `last` will ever come
            _sleep(client.backoff_delay(min(idle, 4)), deadline)
            idle += 1

    def _connect(self, last: int, read_timeout: float) -> Iterator[Event]:
        headers = {"Accept": "text/event-stream", "Cache-Control": "no-cache"}
        if last:
            headers["Last-Event-ID"] = str(last)
        with self.client.open_stream(f"{self._path}/events", headers=headers, read_timeout=read_timeout) as response:
            if response.status_code in _RETRY_STATUSES:
                raise _RetryableStatus(response.status_code)
            if response.is_error:
                response.read()
                raise error_from_response(response)
            for sse in iter_sse(response.iter_lines()):
                try:
                    yield Event.model_validate_json(sse.data)
                except pydantic.ValidationError as exc:
                    raise OpenTinkerError(f"malformed event on the stream of job {self.job_id}: {sse.data[:200]!r}") from exc

    def wait(
        self,
        timeout: float | None = None,
        progress: bool = True,
        *,
        wandb_project: str | None = None,
        on_event: Callable[[Event], None] | None = None,
    ) -> JobInfo:
        """Follow the job until it finishes and return its final :class:`JobInfo`.

        Shows a tqdm bar over ``total_steps`` with the latest ``reward`` (``reward/mean``) and
        ``kl`` (``actor/kl``) unless ``progress=False``; logs every metrics event to
        Weights & Biases when ``wandb_project`` is given and wandb is installed. Raises
        :class:`JobFailedError` (the server's error message) when the job failed or was
        interrupted, :class:`JobTimeoutError` after ``timeout`` seconds (the job keeps
        running). A cancelled job is returned, not raised.
        """
        deadline = time.monotonic() + timeout if timeout is not None else None
        info = self.info()
        bar = _ProgressBar(info) if progress else None
        wandb_run = _WandbRun.start(wandb_project, info) if wandb_project else None
        last_error: str | None = None
        try:
            for event in self._stream(None, deadline):
                if event.type == "error":
                    last_error = str(event.data.get("message") or last_error)
                if bar is not None:
                    bar.on_event(event)
                if wandb_run is not None:
                    wandb_run.on_event(event)
                if on_event is not None:
                    on_event(event)
        finally:
            if bar is not None:
                bar.close()
            if wandb_run is not None:
                wandb_run.finish()
        info = self.info()
        pusher = self._pusher
        if pusher is not None:
            pusher.stop.set()
            pusher.join(timeout=10)
            if pusher.error is not None:
                raise OpenTinkerError(
                    f"pushing step batches to job {self.job_id} failed at step {pusher.pushed + 1}: {pusher.error}"
                ) from pusher.error
        if info.status in (JobStatus.FAILED, JobStatus.INTERRUPTED):
            reason = info.error or last_error or "the server gave no error message"
            what = "failed" if info.status == JobStatus.FAILED else "was interrupted (the server stopped)"
            raise JobFailedError(f"job {self.job_id} {what} at step {info.step}: {reason}", info=info)
        return info

    # ------------------------------------------------------------------ checkpoints

    def checkpoints(self) -> list[CheckpointInfo]:
        """``GET /v1/jobs/{id}/checkpoints``, oldest first."""
        listed = CheckpointList.model_validate(self.client.request_json("GET", f"{self._path}/checkpoints"))
        return sorted(listed.checkpoints, key=lambda c: (c.step, c.created_at))

    def save_checkpoint(self) -> dict[str, Any]:
        """``POST /v1/jobs/{id}/checkpoints``: ask for a checkpoint at the end of the current
        step (answered 202 at once; a checkpoint event follows on the stream)."""
        return self.client.request_json("POST", f"{self._path}/checkpoints")

    def download_checkpoint(self, name: str | None = None, dest: str | os.PathLike[str] | None = None) -> Path:
        """Download checkpoint ``name`` (None: the latest) and extract it into ``dest``
        (default ``./<name>``). Returns the Hugging Face folder: ``dest`` itself, or
        ``dest/<top>`` when every member of the archive sits under one top-level folder.

        Every archive member is checked before anything is written: absolute paths, ``..``
        escapes, links pointing outside ``dest`` and device files raise
        :class:`UnsafeArchiveError`.
        """
        if name is None:
            checkpoints = self.checkpoints()
            if not checkpoints:
                raise NotFoundError(f"job {self.job_id} has no checkpoints yet")
            name = checkpoints[-1].name
        dest_path = Path(dest) if dest is not None else Path.cwd() / name
        with tempfile.TemporaryDirectory(prefix="opentinker-download-") as tmp:
            archive = Path(tmp) / "checkpoint.tar.gz"
            self._download(f"{self._path}/checkpoints/{quote(name, safe='')}/download", archive)
            top_level = extract_tar_safely(archive, dest_path)
        if len(top_level) == 1 and (dest_path / top_level[0]).is_dir():
            return dest_path / top_level[0]
        return dest_path

    def _download(self, path: str, target: Path) -> None:
        client = self.client
        attempt = 0
        while True:
            try:
                with client.open_stream(path, read_timeout=client.stream_read_timeout) as response:
                    if response.status_code in _RETRY_STATUSES and attempt < client.retries:
                        raise _RetryableStatus(response.status_code)
                    if response.is_error:
                        response.read()
                        raise error_from_response(response)
                    with open(target, "wb") as out:
                        for chunk in response.iter_bytes(1 << 20):
                            out.write(chunk)
                return
            except (httpx.TransportError, _RetryableStatus) as exc:
                if attempt >= client.retries:
                    raise client.connection_error(exc, attempt + 1) from exc
                time.sleep(client.backoff_delay(attempt))
                attempt += 1

    # ------------------------------------------------------------------ client mode

    def push_step(
        self,
        step: int,
        rows: Iterable[Mapping[str, Any]],
        idempotency_key: str | None = None,
        *,
        timeout: float | None = None,
    ) -> StepAccepted:
        """``POST /v1/jobs/{id}/steps``: the rows of training step ``step`` (client mode).

        When the server's queue is full (429) waits ``Retry-After`` seconds and tries again
        with the same ``Idempotency-Key`` (``idempotency_key`` or a new uuid4), for at most
        ``timeout`` seconds (None: as long as it takes). 409: wrong step order or mode.
        """
        accepted = self._push_step(step, rows, idempotency_key, timeout, stop=None)
        assert accepted is not None
        return accepted

    def _push_step(
        self,
        step: int,
        rows: Iterable[Mapping[str, Any]],
        idempotency_key: str | None,
        timeout: float | None,
        stop: threading.Event | None,
    ) -> StepAccepted | None:
        body = StepBatch(step=step, rows=[dict(r) for r in rows]).model_dump(mode="json")
        key = idempotency_key or uuid.uuid4().hex
        deadline = time.monotonic() + timeout if timeout is not None else None
        while True:
            try:
                answer = self.client.request_json("POST", f"{self._path}/steps", json=body, idempotency_key=key)
                return StepAccepted.model_validate(answer)
            except RateLimitError as exc:
                delay = exc.retry_after if exc.retry_after is not None else _DEFAULT_RETRY_AFTER_S
                delay = min(max(delay, 0.01), _MAX_RETRY_AFTER_S)
                if deadline is not None and time.monotonic() + delay > deadline:
                    raise
                if not _sleep(delay, None, stop):
                    return None

    def start_pushing(self, batches: Iterable[list[dict[str, Any]]]) -> None:
        """Push one batch per step from ``batches`` in a background thread, steps
        1..total_steps, as far ahead as the server's queue allows. Used by
        ``client.submit(env, mode="client")``; :meth:`wait` reports its failure."""
        if self._pusher is not None and self._pusher.is_alive():
            raise RuntimeError(f"job {self.job_id} already has a step pusher running")
        self._pusher = _StepPusher(self, batches)
        self._pusher.start()

    @property
    def is_pushing(self) -> bool:
        """Whether this handle feeds the job step batches from a background thread."""
        return self._pusher is not None and self._pusher.is_alive()

    def stop_pushing(self) -> None:
        if self._pusher is not None:
            self._pusher.stop.set()


class _StepPusher(threading.Thread):
    def __init__(self, handle: JobHandle, batches: Iterable[list[dict[str, Any]]]):
        super().__init__(name=f"opentinker-steps-{handle.job_id}", daemon=True)
        self.handle = handle
        self.batches = batches
        self.stop = threading.Event()
        self.error: BaseException | None = None
        self.pushed = 0

    def run(self) -> None:
        try:
            total = self.handle.info().total_steps
            batches = iter(self.batches)
            for step in range(1, total + 1):
                if self.stop.is_set():
                    return
                try:
                    rows = next(batches)
                except StopIteration:
                    raise OpenTinkerError(f"the dataloader ran out after {self.pushed} batches of {total}") from None
                if self.handle._push_step(step, rows, None, None, self.stop) is None:
                    return
                self.pushed = step
        except ConflictError as exc:
            if self._job_finished():
                return  # cancelled or failed meanwhile: wait() reports the job's own status
            self._fail(exc)
        except BaseException as exc:  # noqa: BLE001 - reported by wait()
            self._fail(exc)

    def _job_finished(self) -> bool:
        try:
            return self.handle.info().status.finished
        except OpenTinkerError:
            return False

    def _fail(self, exc: BaseException) -> None:
        self.error = exc
        # Nobody will feed the job any more: cancel it so wait() ends instead of hanging.
        try:
            self.handle.client.request_json("POST", f"{self.handle._path}/cancel")
        except OpenTinkerError:
            pass


class _ProgressBar:
    def __init__(self, info: JobInfo):
        from tqdm.auto import tqdm

        self.label = info.name or info.job_id
        self.bar = tqdm(total=info.total_steps or None, desc=self.label, unit="step", dynamic_ncols=True)
        self.postfix: dict[str, float] = {}

    def _advance(self, step: Any) -> None:
        if isinstance(step, int) and step > self.bar.n:
            self.bar.update(step - self.bar.n)

    def on_event(self, event: Event) -> None:
        data = event.data
        if event.type == "progress":
            total = data.get("total_steps")
            if isinstance(total, int) and total > 0 and total != self.bar.total:
                self.bar.total = total
            self._advance(data.get("step"))
        elif event.type == "metrics":
            metrics = data.get("metrics") or {}
            for label, names in _POSTFIX_METRICS.items():
                value = next((metrics[n] for n in names if isinstance(metrics.get(n), (int, float))), None)
                if value is not None:
                    self.postfix[label] = float(value)
            if self.postfix:
                self.bar.set_postfix(self.postfix, refresh=False)
            self._advance(data.get("step"))
        elif event.type == "status":
            status = data.get("status")
            label = self.label if status in (None, JobStatus.RUNNING.value) else f"{self.label} [{status}]"
            self.bar.set_description_str(label, refresh=False)

    def close(self) -> None:
        self.bar.close()


class _WandbRun:
    """Logs metrics events to Weights & Biases; wandb is imported only when asked for."""

    def __init__(self, run: Any):
        self.run = run

    @classmethod
    def start(cls, project: str, info: JobInfo) -> _WandbRun | None:
        try:
            import wandb
        except ImportError:
            warnings.warn(
                f"wandb_project={project!r} was given but wandb is not installed (pip install wandb); "
                "metrics are not logged to Weights & Biases",
                stacklevel=3,
            )
            return None
        run = wandb.init(project=project, name=info.name or info.job_id, config={"job_id": info.job_id, **info.config})
        return cls(run)

    def on_event(self, event: Event) -> None:
        if event.type != "metrics":
            return
        metrics = event.data.get("metrics") or {}
        step = event.data.get("step")
        self.run.log(dict(metrics), step=step if isinstance(step, int) else None)

    def finish(self) -> None:
        self.run.finish()


def extract_tar_safely(archive: str | os.PathLike[str], dest: str | os.PathLike[str]) -> list[str]:
    """Extract a (gzipped) tar archive into ``dest``, after checking every member: no
    absolute paths, no ``..`` escapes, no links leading outside ``dest``, no device or fifo
    files. Nothing is written when any member is rejected. Returns the archive's top-level
    names, sorted."""
    dest_path = Path(dest)
    dest_path.mkdir(parents=True, exist_ok=True)
    root = dest_path.resolve()
    try:
        tar = tarfile.open(archive, "r:*")
    except tarfile.TarError as exc:
        raise OpenTinkerError(f"the downloaded checkpoint is not a valid tar archive: {exc}") from exc
    with tar:
        members = tar.getmembers()
        for member in members:
            _check_member(member, root)
        kwargs: dict[str, Any] = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
        try:
            tar.extractall(root, members=members, **kwargs)
        except tarfile.TarError as exc:  # the stdlib's own filter said no
            raise UnsafeArchiveError(f"refusing to extract the checkpoint archive: {exc}") from exc
    parts = (PurePosixPath(m.name.replace("\\", "/")).parts for m in members)
    return sorted({p[0] for p in parts if p and p[0] not in (".", "")})


def _inside(root: Path, path: Path) -> bool:
    return path == root or root in path.parents


def _check_member(member: tarfile.TarInfo, root: Path) -> None:
    name = member.name
    posix = PurePosixPath(name.replace("\\", "/"))
    if posix.is_absolute() or (len(name) > 1 and name[1] == ":"):
        raise UnsafeArchiveError(f"checkpoint archive member {name!r} has an absolute path")
    target = (root / posix).resolve()
    if not _inside(root, target):
        raise UnsafeArchiveError(f"checkpoint archive member {name!r} would be written outside {root}")
    if member.ischr() or member.isblk() or member.isfifo():
        raise UnsafeArchiveError(f"checkpoint archive member {name!r} is a device or fifo")
    if member.issym() or member.islnk():
        link = PurePosixPath(member.linkname.replace("\\", "/"))
        if link.is_absolute():
            raise UnsafeArchiveError(f"checkpoint archive link {name!r} points to the absolute path {member.linkname!r}")
        base = target.parent if member.issym() else root
        if not _inside(root, (base / link).resolve()):
            raise UnsafeArchiveError(f"checkpoint archive link {name!r} points outside {root}: {member.linkname!r}")

