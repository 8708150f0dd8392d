"""``JobHandle``: one training job on the server — its info, event stream, checkpoints and,
in client mode, the step batches the client pushes."""

from __future__ import annotations

import gzip
import os
import re
import stat
import tarfile
import tempfile
import threading
import time
import uuid
import zlib
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
    CHECKPOINT_NAME_PATTERN,
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

__all__ = ["MAX_ARCHIVE_BYTES", "MAX_ARCHIVE_MEMBERS", "JobHandle", "extract_tar_safely"]

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
            _check_checkpoint_name(name, "the checkpoint name given")
        else:
            checkpoints = self.checkpoints()
            if not checkpoints:
                raise NotFoundError(f"job {self.job_id} has no checkpoints yet")
            name = _check_checkpoint_name(checkpoints[-1].name, f"the server's latest checkpoint of job {self.job_id}")
        dest_path = Path(dest) if dest is not None else Path.cwd() / name
        max_members, max_bytes = MAX_ARCHIVE_MEMBERS, MAX_ARCHIVE_BYTES
        with tempfile.TemporaryDirectory(prefix="opentinker-download-") as tmp:
            archive = Path(tmp) / "checkpoint.tar.gz"
            self._download(
                f"{self.path}/checkpoints/{quote(name, safe='')}/download",
                archive,
                max_bytes=_download_limit(max_members, max_bytes),
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


# ---------------------------------------------------------------------- checkpoint archives

#: the most members :func:`extract_tar_safely` accepts in one archive (folders included)
MAX_ARCHIVE_MEMBERS = 100_000
#: the most uncompressed bytes (the sum of the file sizes) :func:`extract_tar_safely` writes
MAX_ARCHIVE_BYTES = 1 << 40  # 1 TiB

_CHUNK_BYTES = 1 << 20
_FILE_MODE = 0o644  # extracted files and folders get ordinary permissions (less the umask),
_DIR_MODE = 0o755  # never the archive's modes or owners
# The server's rule for checkpoint names: plain folder names such as "global_step_20".
_CHECKPOINT_NAME = re.compile(CHECKPOINT_NAME_PATTERN)
_DRIVE = re.compile(r"[A-Za-z]:")
# What a broken or truncated (gzipped) tar stream raises while it is read.
_CORRUPT = (tarfile.TarError, EOFError, zlib.error, gzip.BadGzipFile)


def _check_checkpoint_name(name: object, what: str) -> str:
    """``name`` when it is a plain checkpoint folder name (the server's rule), else
    :class:`UnsafeArchiveError`: it becomes a folder name on this machine."""
    if not isinstance(name, str) or not _CHECKPOINT_NAME.fullmatch(name) or ".." in name:
        raise UnsafeArchiveError(
            f"refusing checkpoint name {name!r} ({what}): a checkpoint name is a plain folder name "
            "(a letter or digit, then letters, digits, '_', '.' or '-', at most 128 characters, no '..')"
        )
    return name


def _download_limit(max_members: int, max_bytes: int) -> int:
    """The most bytes a download may bring for an archive within the given limits: the file
    data, generous room for the tar headers and padding, and gzip's worst-case growth."""
    tar_bytes = max_bytes + max_members * 16 * tarfile.BLOCKSIZE + (1 << 20)
    return tar_bytes + tar_bytes // 100


def _refuse(member: tarfile.TarInfo, why: str) -> UnsafeArchiveError:
    return UnsafeArchiveError(f"refusing to extract the checkpoint archive: member {member.name!r} {why}")


def _member_parts(member: tarfile.TarInfo) -> tuple[str, ...]:
    """The member's path below the destination as components (``()``: the destination
    itself); raises :class:`UnsafeArchiveError` for any name that could land elsewhere."""
    name = member.name
    if not name:
        raise _refuse(member, "has an empty name")
    if "\x00" in name:
        raise _refuse(member, "has a NUL character in its name")
    if "\\" in name:
        raise _refuse(member, "has a backslash in its name (a Windows path separator)")
    if _DRIVE.match(name):
        raise _refuse(member, "starts with a Windows drive letter")
    if name.startswith("/"):
        raise _refuse(member, "has an absolute path")
    parts = tuple(p for p in name.split("/") if p not in ("", "."))
    if ".." in parts:
        raise _refuse(member, "has a '..' component")
    return parts


def _check_member(member: tarfile.TarInfo) -> tuple[str, ...]:
    """Check one member on its own (name and type); returns its path components."""
    parts = _member_parts(member)
    if member.issym():
        raise _refuse(member, f"is a symbolic link (to {member.linkname!r}); a checkpoint holds only files and folders")
    if member.islnk():
        raise _refuse(member, f"is a hard link (to {member.linkname!r}); a checkpoint holds only files and folders")
    if member.ischr() or member.isblk():
        raise _refuse(member, "is a device file")
    if member.isfifo():
        raise _refuse(member, "is a fifo")
    if not (member.isreg() or member.isdir()):
        raise _refuse(member, f"has the unsupported type {member.type!r}; a checkpoint holds only files and folders")
    if member.isreg():
        if not parts:
            raise _refuse(member, "is a file that names the destination folder itself")
        if member.size < 0:
            raise _refuse(member, f"declares a negative size ({member.size})")
    return parts


class _Plan:
    """What an archive will write, all of it checked before anything is: the folders to
    make (parents first) and the files, each with the member that asked for it."""

    def __init__(self) -> None:
        self.dirs: dict[tuple[str, ...], tarfile.TarInfo] = {}
        self.files: list[tuple[tuple[str, ...], tarfile.TarInfo]] = []
        self.top_level: set[str] = set()


def _plan(tar: tarfile.TarFile, max_members: int, max_bytes: int) -> _Plan:
    plan = _Plan()
    seen: dict[str, tarfile.TarInfo] = {}  # case-folded path -> member (names that differ only
    # in case overwrite each other on macOS and Windows)
    file_keys: dict[str, tarfile.TarInfo] = {}
    count = total = 0
    try:
        for member in tar:  # headers only, one at a time: stop at the first refusal or limit
            count += 1
            if count > max_members:
                raise _refuse(member, f"is past the limit of {max_members} members per archive")
            parts = _check_member(member)
            if member.isreg():
                total += member.size
                if total > max_bytes:
                    raise _refuse(member, f"brings the archive past the limit of {max_bytes} uncompressed bytes")
            if not parts:
                continue  # "." or "./": the destination folder itself
            key = "/".join(parts).casefold()
            if key in seen:
                raise _refuse(member, f"would overwrite member {seen[key].name!r} (the same path)")
            seen[key] = member
            plan.top_level.add(parts[0])
            if member.isreg():
                file_keys[key] = member
                plan.files.append((parts, member))
            for depth in range(1, len(parts) if member.isreg() else len(parts) + 1):
                plan.dirs.setdefault(parts[:depth], member)
    except _CORRUPT as exc:
        raise OpenTinkerError(f"the checkpoint archive is corrupt or truncated: {exc}") from exc
    for folder, member in plan.dirs.items():
        clash = file_keys.get("/".join(folder).casefold())
        if clash is not None:
            where = "/".join(folder)
            raise _refuse(member, f"needs {where!r} to be a folder, but the archive has it as the file {clash.name!r}")
    plan.dirs = dict(sorted(plan.dirs.items(), key=lambda item: (len(item[0]), item[0])))
    return plan


def _check_destination(root: Path, plan: _Plan) -> None:
    """Refuse to write through what already sits in ``root``: a folder the archive needs that
    exists as a link or a file, or a file whose place is taken by a folder."""
    if os.path.lexists(root) and not root.is_dir():
        raise OpenTinkerError(f"cannot extract the checkpoint into {root}: it exists and is not a folder")
    for folder, member in plan.dirs.items():  # parents first, so lstat never passes through a link
        path = root.joinpath(*folder)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            continue
        if not stat.S_ISDIR(st.st_mode):
            raise _refuse(member, f"needs the folder {path}, which exists and is not a folder (a file or a link)")
    for parts, member in plan.files:
        path = root.joinpath(*parts)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            continue
        if stat.S_ISDIR(st.st_mode):
            raise _refuse(member, f"would replace the folder {path}")


def _copy_member(tar: tarfile.TarFile, member: tarfile.TarInfo, out: Any, total: int, max_bytes: int) -> int:
    """Copy a regular member's data to ``out``, never more than its header declared."""
    source = tar.extractfile(member)
    if source is None:
        raise _refuse(member, "has no data to read")
    written = 0
    with source:
        for chunk in iter(lambda: source.read(_CHUNK_BYTES), b""):
            written += len(chunk)
            if written > member.size:
                raise _refuse(member, f"holds more data than the {member.size} bytes its header declares")
            total += len(chunk)
            if total > max_bytes:
                raise _refuse(member, f"brings the archive past the limit of {max_bytes} uncompressed bytes")
            out.write(chunk)
    if written != member.size:
        raise OpenTinkerError(
            f"the checkpoint archive is truncated: member {member.name!r} holds {written} of its {member.size} bytes"
        )
    return total


def extract_tar_safely(
    archive: str | os.PathLike[str],
    dest: str | os.PathLike[str],
    *,
    max_members: int | None = None,
    max_bytes: int | None = None,
) -> list[str]:
    """Extract a (gzipped) tar checkpoint archive into ``dest``; returns its top-level names,
    sorted.

    Every member is checked before anything is written, and one refusal raises
    :class:`UnsafeArchiveError` with nothing written (``dest`` is not even created):
    symbolic and hard links, device files and fifos, absolute paths, Windows drive letters
    and backslashes, ``..`` components, empty names, two members with the same path (case
    ignored), more than ``max_members`` members or more than ``max_bytes`` bytes of file data
    (defaults :data:`MAX_ARCHIVE_MEMBERS`, :data:`MAX_ARCHIVE_BYTES`). Folders and files are
    then made one by one (``tarfile.extractall`` is not used, so Python 3.10 behaves like the
    newer ones) with modes 0o755 / 0o644, never the archive's modes or owners; a member that
    yields more data than its header declares is refused. Each file is written to a
    temporary name first and renamed into place once every file is written, so when the
    extraction fails midway (a full disk, a broken stream) everything this call made is
    removed again and what ``dest`` held before is left as it was.
    """
    max_members = MAX_ARCHIVE_MEMBERS if max_members is None else max_members
    max_bytes = MAX_ARCHIVE_BYTES if max_bytes is None else max_bytes
    root = Path(dest).resolve()
    try:
        tar = tarfile.open(archive, "r:*")
    except _CORRUPT as exc:
        raise OpenTinkerError(f"the downloaded checkpoint is not a valid tar archive: {exc}") from exc
    with tar:
        plan = _plan(tar, max_members, max_bytes)
        _check_destination(root, plan)
        _extract(tar, plan, root, max_bytes)
    return sorted(plan.top_level)


def _extract(tar: tarfile.TarFile, plan: _Plan, root: Path, max_bytes: int) -> None:
    made_dirs: list[Path] = []  # folders this call created, parents first
    staged: list[tuple[Path, Path]] = []  # (temporary file, final path)
    renamed = 0  # staged[:renamed] are in place
    made_files: list[Path] = []  # final paths this call created (none existed before)
    try:
        missing = [p for p in (root, *root.parents) if not os.path.lexists(p)]
        for path in (*reversed(missing), *(root.joinpath(*folder) for folder in plan.dirs)):
            try:
                os.mkdir(path, _DIR_MODE)
            except FileExistsError:
                if not stat.S_ISDIR(os.lstat(path).st_mode):
                    raise
            else:
                made_dirs.append(path)
        total = 0
        for parts, member in plan.files:
            final = root.joinpath(*parts)
            temporary = final.with_name(f".opentinker-{uuid.uuid4().hex}.part")
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0) | getattr(os, "O_NOFOLLOW", 0)
            fd = os.open(temporary, flags, _FILE_MODE)
            staged.append((temporary, final))
            with open(fd, "wb") as out:
                total = _copy_member(tar, member, out, total, max_bytes)
        for temporary, final in staged:
            existed = os.path.lexists(final)
            os.replace(temporary, final)  # replaces a file or a link in its place, never follows one
            renamed += 1
            if not existed:
                made_files.append(final)
    except BaseException as exc:
        _undo([t for t, _ in staged[renamed:]] + made_files, made_dirs)
        if isinstance(exc, _CORRUPT):
            raise OpenTinkerError(f"the checkpoint archive is corrupt or truncated: {exc}") from exc
        raise


def _undo(made_files: list[Path], made_dirs: list[Path]) -> None:
    """Remove what a failed extraction made; what was there before stays."""
    for path in made_files:
        try:
            os.unlink(path)
        except OSError:
            pass
    for path in reversed(made_dirs):
        try:
            os.rmdir(path)
        except OSError:
            pass
