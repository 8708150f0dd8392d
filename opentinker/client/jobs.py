"""``JobHandle``: one training job on the server — its info, event stream, checkpoints and,
in client mode, the step batches the client pushes."""

from __future__ import annotations

import os
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import quote


from opentinker.client.errors import (
    ConflictError,
    JobFailedError,
    NotFoundError,
    OpenTinkerError,
    UnsafeArchiveError,
    error_from_response,
)
from opentinker.client.checkpoint_archive import (
    MAX_ARCHIVE_BYTES,
    MAX_ARCHIVE_MEMBERS,
    check_checkpoint_name,
    download_limit,
    extract_tar_safely,
)
from opentinker.client.event_stream import stream_events
from opentinker.client.progress import ProgressBar, WandbRun
from opentinker.client.retries import (
    RETRY_STATUSES,
    RetryableStatus,
    Stopped,
    retry_rate_limited,
    retry_transient,
)
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
    from opentinker.client.relay import EnvRelay
    from opentinker.environments.registry import InteractionSpec

__all__ = ["JobHandle"]

class JobHandle:
    """A job on the server, by id. Cheap to create; every method asks the server."""

    def __init__(self, client: OpenTinkerClient, job_id: str):
        self.client = client
        self.job_id = job_id
        self._pusher: _StepPusher | None = None
        self.relay: EnvRelay | None = None  # carrying this job's env calls from this machine

    def __repr__(self) -> str:
        return f"JobHandle({self.job_id!r}, server={self.client.base_url!r})"

    @property
    def path(self) -> str:
        """The job's resource on the API (``/jobs/<id>``)."""
        return f"/jobs/{quote(self.job_id, safe='')}"

    # ------------------------------------------------------------------ state

    def info(self) -> JobInfo:
        """``GET /v1/jobs/{id}``."""
        return JobInfo.model_validate(self.client.request_json("GET", self.path))

    def resume(self) -> JobInfo:
        """``POST /v1/jobs/{id}/resume``: continue a stopped (interrupted, failed or cancelled)
        job from its last checkpoint; :class:`ConflictError` when it has none or is not stopped."""
        return JobInfo.model_validate(self.client.request_json("POST", f"{self.path}/resume"))

    def cancel(self) -> JobInfo:
        """``POST /v1/jobs/{id}/cancel``. Cancelling a job that already finished is not an
        error: its (final) info comes back."""
        self.stop_pushing()
        try:
            return JobInfo.model_validate(self.client.request_json("POST", f"{self.path}/cancel"))
        except ConflictError:
            info = self.info()
            if info.status.finished:
                return info
            raise

    def events(self, after: int | None = None) -> list[Event]:
        """Every event so far (``GET /v1/jobs/{id}/events?stream=false``), those with id > ``after``."""
        body = self.client.request_json("GET", f"{self.path}/events", params={"stream": "false"})
        events = [Event.model_validate(e) for e in body.get("events", [])]
        return [e for e in events if after is None or e.id > after]

    def metrics(self) -> list[dict[str, Any]]:
        """The data of every metrics event so far: ``[{"step": k, "metrics": {name: value}}, ...]``."""
        return [e.data for e in self.events() if e.type == "metrics"]

    # ------------------------------------------------------------------ event stream

    def stream(self, after: int | None = None) -> Iterator[Event]:
        """The job's events as they happen (Server-Sent Events), from the one after ``after``
        (None: from the first). A dropped connection is resumed with ``Last-Event-ID`` set to
        the last id seen, so no event is lost or repeated; a server restart is waited for. Stops
        after the job's final status event: a stop that was followed by a resume (``interrupted``
        then ``queued``) is not the end, and the stream goes on with the resumed job."""
        return stream_events(self, after, deadline=None)

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
        ``kl`` (``actor/kl``), and once they happen the run's env errors, redone steps and time
        spent waiting for envs, unless ``progress=False``; logs every metrics event to
        Weights & Biases when ``wandb_project`` is given and wandb is installed. Follows the job
        through stops that are resumed (a server restart, ``jobs resume``): raises
        :class:`JobFailedError` (the server's error message) only when the job ended failed or
        interrupted, :class:`JobTimeoutError` after ``timeout`` seconds (the job keeps
        running). A cancelled job is returned, not raised.
        """
        deadline = time.monotonic() + timeout if timeout is not None else None
        info = self.info()
        bar = ProgressBar(info) if progress else None
        wandb_run = WandbRun.start(wandb_project, info) if wandb_project else None
        last_error: str | None = None
        try:
            for event in stream_events(self, None, deadline):
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
        if info.status.finished:
            self.stop_relay(info)
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

    # ------------------------------------------------------------------ client relay

    def start_relay(self, specs: Iterable[InteractionSpec] | None = None) -> EnvRelay | None:
        """Carry the job's env calls from this machine (interactions with ``relay: client``): to
        the endpoints of ``specs``, else of the specs this machine kept when it started the job
        (:func:`opentinker.client.relay.remember`; never the server's copy: a server must not
        choose where this machine connects). None when there is nothing to relay. See
        :mod:`opentinker.client.relay`."""
        from opentinker.client.relay import EnvRelay, recall, relayed_specs, remember

        if self.relay is not None and self.relay.running:
            return self.relay
        chosen = relayed_specs(list(specs)) if specs is not None else recall(self.client, self.job_id)
        if not chosen:
            return None
        if specs is not None:
            remember(self.client, self.job_id, chosen)
        self.relay = EnvRelay(self.client, self.job_id, chosen).start()
        return self.relay

    def stop_relay(self, info: JobInfo | None = None) -> None:
        """Stop carrying the job's env calls (they wait, as for an env outage, until a client
        attaches); once the job has completed, the specs kept on this machine are dropped too (a
        failed, cancelled or interrupted job may be resumed: ``attach()`` then needs them)."""
        from opentinker.client.relay import forget

        if self.relay is None:
            return
        self.relay.stop()
        try:
            completed = (info or self.info()).status is JobStatus.COMPLETED
        except OpenTinkerError:
            return
        if completed:
            forget(self.client, self.job_id)

    def attach(
        self,
        env: Any = None,
        *,
        timeout: float | None = None,
        progress: bool = True,
        wandb_project: str | None = None,
        on_event: Callable[[Event], None] | None = None,
    ) -> JobInfo:
        """Follow a running job from this process, carrying its env calls when it has relayed
        interactions (``env``: a GenericEnvironment or its interaction specs; None: the specs this
        machine kept when it started the job). What a restarted client calls to let a job that
        waits for its env go on; returns like :meth:`wait`."""
        specs = getattr(env, "interaction_specs", env)
        self.start_relay(specs)
        return self.wait(timeout=timeout, progress=progress, wandb_project=wandb_project, on_event=on_event)

    # ------------------------------------------------------------------ checkpoints

    def checkpoints(self) -> list[CheckpointInfo]:
        """``GET /v1/jobs/{id}/checkpoints``, oldest first."""
        listed = CheckpointList.model_validate(self.client.request_json("GET", f"{self.path}/checkpoints"))
        return sorted(listed.checkpoints, key=lambda c: (c.step, c.created_at))

    def save_checkpoint(self) -> dict[str, Any]:
        """``POST /v1/jobs/{id}/checkpoints``: ask for a checkpoint at the end of the current
        step (answered 202 at once; a checkpoint event follows on the stream)."""
        return self.client.request_json("POST", f"{self.path}/checkpoints")

    def download_checkpoint(self, name: str | None = None, dest: str | os.PathLike[str] | None = None) -> Path:
        """Download checkpoint ``name`` (None: the latest) and extract it into ``dest``
        (default ``./<name>``). Returns the Hugging Face folder: ``dest`` itself, or
        ``dest/<top>`` when every member of the archive sits under one top-level folder.

        The checkpoint name, whether given or taken from the server's list, must be a plain
        folder name (the server's own rule: ``[A-Za-z0-9][A-Za-z0-9_.-]{0,127}``, no ``..``);
        any other raises :class:`UnsafeArchiveError` before the download starts. The archive
        is then checked as a whole before anything is written (see :func:`extract_tar_safely`):
        links, device files, absolute paths, ``..`` escapes, duplicate names and archives over
        :data:`MAX_ARCHIVE_MEMBERS` / :data:`MAX_ARCHIVE_BYTES` raise :class:`UnsafeArchiveError`
        and leave ``dest`` as it was (not even created).
        """
        if name is not None:
            check_checkpoint_name(name, "the checkpoint name given")
        else:
            checkpoints = self.checkpoints()
            if not checkpoints:
                raise NotFoundError(f"job {self.job_id} has no checkpoints yet")
            name = check_checkpoint_name(checkpoints[-1].name, f"the server's latest checkpoint of job {self.job_id}")
        dest_path = Path(dest) if dest is not None else Path.cwd() / name
        max_members, max_bytes = MAX_ARCHIVE_MEMBERS, MAX_ARCHIVE_BYTES
        with tempfile.TemporaryDirectory(prefix="opentinker-download-") as tmp:
            archive = Path(tmp) / "checkpoint.tar.gz"
            self._download(
                f"{self.path}/checkpoints/{quote(name, safe='')}/download",
                archive,
                max_bytes=download_limit(max_members, max_bytes),
            )
            top_level = extract_tar_safely(archive, dest_path, max_members=max_members, max_bytes=max_bytes)
        if len(top_level) == 1 and (dest_path / top_level[0]).is_dir():
            return dest_path / top_level[0]
        return dest_path

    def _download(self, path: str, target: Path, max_bytes: int | None = None) -> None:
        client = self.client

        def download() -> None:
            with client.open_stream(path, read_timeout=client.stream_read_timeout) as response:
                if response.status_code in RETRY_STATUSES:
                    response.read()
                    raise RetryableStatus(response)
                if response.is_error:
                    response.read()
                    raise error_from_response(response)
                received = 0
                with open(target, "wb") as out:
                    for chunk in response.iter_bytes(1 << 20):
                        received += len(chunk)
                        if max_bytes is not None and received > max_bytes:
                            raise UnsafeArchiveError(
                                f"refusing the checkpoint download {path}: the server sent more than {max_bytes} "
                                "bytes (the limit follows MAX_ARCHIVE_BYTES and MAX_ARCHIVE_MEMBERS)"
                            )
                        out.write(chunk)

        retry_transient(client, download)

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
        key = idempotency_key or uuid.uuid4().hex  # the same on every re-send of this step
        try:
            answer = retry_rate_limited(
                lambda: self.client.request_json("POST", f"{self.path}/steps", json=body, idempotency_key=key),
                timeout=timeout,
                stop=stop,
            )
        except Stopped:
            return None
        return StepAccepted.model_validate(answer)

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
            self.handle.client.request_json("POST", f"{self.handle.path}/cancel")
        except OpenTinkerError:
            pass
