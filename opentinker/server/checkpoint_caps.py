"""Bounds on checkpoint bytes on disk, so that no user, and not all of them together, fill the
disk the store and every job share.

A bound (:class:`ByteCap`) is checked twice: before a checkpoint is written, by an estimate
of its size against what is kept, and once written, by its measured size; every refusal
names the operator's flag. The bounds:

- the server's cap on every checkpoint it keeps, all users', RL jobs' and the Tinker API's
  (``--max-checkpoint-gb``: :func:`server_cap`);
- each user's quota for their RL jobs' checkpoints (``--max-job-checkpoint-gb``), checked with
  the cap by :class:`JobCheckpointCaps`;
- each user's Tinker checkpoints, in count and bytes (:mod:`opentinker.server.tinker.checkpoint_quota`).

An RL job's checkpoint is written by its runner, which may live on another node and never
reaches the store: the server tells it whether its next checkpoint would fit (``refuse_checkpoints``
of the runner contract, estimated by the job's newest checkpoint), and measures each one the
runner reports; one that does not fit is deleted and never listed. Either way the job goes on
and its events say which checkpoint was not kept and why.
"""

from __future__ import annotations

import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from opentinker.protocol import CHECKPOINT_NAME_PATTERN

if TYPE_CHECKING:
    from opentinker.server.settings import ServerSettings
    from opentinker.server.store import Store

GiB = 2**30
JOB_REMEDY = "the job goes on without it"


class QuotaExceeded(Exception):
    """``retry``: full now (429: what frees room may come); else this one checkpoint is larger
    than the whole bound (400)."""

    def __init__(self, message: str, retry: bool):
        super().__init__(message)
        self.retry = retry


def size_text(nbytes: int) -> str:
    for unit, scale in (("GiB", GiB), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes} B"


def folder_bytes(folder: Path) -> int:
    """A checkpoint's bytes on disk (0 once gone)."""
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()) if folder.is_dir() else 0


@dataclass
class ByteCap:
    """At most ``max_bytes`` of checkpoints; ``flag``: the operator's flag that sets it; ``name``:
    what it is ("checkpoint quota per user"); ``whose``/``others``: the checkpoints it counts,
    in a refusal before and after the write."""

    max_bytes: int
    flag: str
    name: str
    whose: str
    others: str

    def _limit(self, whole: str = "") -> str:
        return f"this server's {whole}{self.name} of {size_text(self.max_bytes)} ({self.flag} {self.max_bytes / GiB:g})"

    def check(self, used: int, estimate: int, what: str, remedy: str) -> None:
        """Before a write: QuotaExceeded unless ``estimate`` (0: unknown) fits beside ``used``
        (a checkpoint takes at least a byte: a full bound refuses any)."""
        if estimate > self.max_bytes:
            raise QuotaExceeded(f"{what} takes about {size_text(estimate)}, more than {self._limit('whole ')}",
                                retry=False)
        if used + max(estimate, 1) > self.max_bytes:
            more = f" and this one about {size_text(estimate)} more" if estimate else ""
            raise QuotaExceeded(f"{self.whose} take {size_text(used)} on disk{more}: over {self._limit()}; {remedy}",
                                retry=True)

    def check_landed(self, used: int, size: int) -> None:
        """Once written (``size``: measured on disk): QuotaExceeded unless it fits beside ``used``."""
        if used + size > self.max_bytes:
            raise QuotaExceeded(f"this checkpoint took {size_text(size)} on disk, and with {self.others} "
                                f"({size_text(used)}) that is over {self._limit()}; it was not kept", retry=False)


def server_cap(max_bytes: int) -> ByteCap:
    """The cap on every checkpoint of the server (``--max-checkpoint-gb``)."""
    return ByteCap(max_bytes, "--max-checkpoint-gb", "cap on all users' checkpoints (RL jobs' and the Tinker API's)",
                   "the checkpoints on this server (all users')", "the others on this server")


class JobCheckpointCaps:
    """RL jobs' checkpoints (``<job dir>/checkpoints/<name>``, indexed in the store with their
    sizes) against the server's cap and each user's quota for their jobs' checkpoints."""

    def __init__(self, store: Store, settings: ServerSettings):
        self.store = store
        self.settings = settings
        self.server = server_cap(int(settings.max_checkpoint_gb * GiB))
        self.per_user = ByteCap(int(settings.max_job_checkpoint_gb * GiB), "--max-job-checkpoint-gb",
                                "quota per user for jobs' checkpoints", "your jobs' checkpoints", "your jobs' others")

    def measure_on_disk(self) -> None:
        """At start-up, every job checkpoint measured again: those indexed before sizes were
        count, and those whose folders the operator removed count no more."""
        for record in self.store.every_checkpoint():
            size = folder_bytes(self.settings.job_checkpoint_dir(record.job_id, record.name))
            if size != record.size_bytes:
                self.store.set_checkpoint_size(record.job_id, record.name, size)

    def refusal(self, user_id: int, job_id: str, estimate: int | None = None) -> str | None:
        """Why the job's next checkpoint would not be kept now (None: it would), by ``estimate``
        (None: the size of the job's newest kept; before its first, whether the bounds are full)."""
        if estimate is None:
            estimate = self.store.newest_checkpoint_bytes(job_id) or 0
        try:
            self.per_user.check(self.store.checkpoint_bytes(user_id), estimate, "a checkpoint of this job", JOB_REMEDY)
            self.server.check(self.store.all_checkpoint_bytes(), estimate, "a checkpoint of this job", JOB_REMEDY)
        except QuotaExceeded as refused:
            return str(refused)
        return None

    def land(self, user_id: int, job_id: str, name: str, pending: int = 0) -> tuple[int, str | None]:
        """A checkpoint the job's runner wrote: its size on disk, and None when it fits both
        bounds beside the checkpoints kept and ``pending`` bytes kept but not yet indexed; else
        why not, and its folder is deleted. One of the same name (a resumed job saving a step
        again wrote over it) counts as replaced."""
        if not re.match(CHECKPOINT_NAME_PATTERN, name):  # one folder's name, never a path
            return 0, f"its runner named it {name!r}, not a checkpoint folder's name"
        folder = self.settings.job_checkpoint_dir(job_id, name)
        size = folder_bytes(folder)
        replaced = self.store.get_checkpoint(job_id, name)
        freed = (replaced.size_bytes or 0) if replaced is not None else 0
        try:
            self.per_user.check_landed(self.store.checkpoint_bytes(user_id) + pending - freed, size)
            self.server.check_landed(self.store.all_checkpoint_bytes() + pending - freed, size)
        except QuotaExceeded as refused:
            shutil.rmtree(folder, ignore_errors=True)
            if replaced is not None:  # its files were written over, then deleted
                self.store.forget_checkpoint(job_id, name)
            return size, str(refused)
        return size, None

    def landed(self, user_id: int, job_id: str, event: dict[str, Any], pending: int = 0
               ) -> tuple[dict[str, Any], int | None]:
        """A runner's ``checkpoint`` event, and the checkpoint's measured size (None: it names no
        folder to measure): with that size (to be indexed) when it fits the bounds (:meth:`land`),
        else, its folder deleted, a warning ``log`` event saying why."""
        data = event["data"]
        name, step = data.get("name"), data.get("step")
        if not isinstance(name, str) or not data.get("path"):
            return event, None  # not indexed (the store's rule): nothing on disk to count
        size, refusal = self.land(user_id, job_id, name, pending)
        if refusal is None:
            return {**event, "data": {**data, "size_bytes": size}}, size
        return {"type": "log", "data": {"level": "warning", "step": step,
                                        "message": f"checkpoint {name} (step {step}) was not kept: {refusal}"}}, size
