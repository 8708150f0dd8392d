"""Build a folder into the cache once, safely under concurrency and kills.

Used for whatever is made on first use and then read by every process on the machine: the
tiny model's builds (:mod:`opentinker.tiny.folder`) and pretrained checkpoints converted into
Hugging Face folders (:mod:`opentinker.pretrained.convert`).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path


def default_cache_dir() -> Path:
    """``$OPENTINKER_CACHE_DIR``, else ``$XDG_CACHE_HOME/opentinker``, else ``~/.cache/opentinker``."""
    explicit = os.environ.get("OPENTINKER_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg:
        return Path(xdg).expanduser() / "opentinker"
    return Path.home() / ".cache" / "opentinker"


@contextlib.contextmanager
def build_lock(lock_path: Path) -> Iterator[None]:
    """An exclusive advisory lock (fcntl.flock); a no-op where fcntl does not exist."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows
        yield
        return
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a+") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def build_once(
    target: Path,
    build: Callable[[Path], None],
    is_complete: Callable[[Path], bool],
    *,
    force: bool = False,
    announce: Callable[[], None] | None = None,
) -> Path:
    """``target``, built by ``build(staging_folder)`` unless ``is_complete(target)`` already.

    Concurrent builders (threads or processes) are serialized by a lock file; a build goes to a
    temporary folder beside the target and is renamed into place, so a reader never sees a
    half-written folder, and a killed build leaves only a staging folder the next one removes.
    ``force`` rebuilds even a complete target. ``announce`` runs just before a build starts.
    """
    if is_complete(target) and not force:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with build_lock(target.parent / f".{target.name}.lock"):
        if is_complete(target) and not force:
            return target  # another process built it while we waited for the lock
        # Builders hold the lock, so staging folders seen now were left by a killed build.
        for stale in target.parent.glob(f".{target.name}.tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        if announce is not None:
            announce()
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        try:
            build(staging)
            # mkdtemp (and some writers) make things private; the cache is an ordinary folder that
            # a server running as another user may read.
            os.chmod(staging, 0o755)
            for path in staging.rglob("*"):
                os.chmod(path, 0o755 if path.is_dir() else 0o644)
            if target.exists():  # stale, incomplete or forced: move it aside, then swap in
                trash = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
                os.replace(target, trash / "old")
                os.replace(staging, target)
                shutil.rmtree(trash, ignore_errors=True)
            else:
                os.replace(staging, target)
        finally:
            if staging.exists():
                shutil.rmtree(staging, ignore_errors=True)
    return target
