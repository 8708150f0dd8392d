"""Where the tiny model is: the folder shipped in the package (the SFT-warmed model), or a
build in the cache (the base model; a rebuild)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from opentinker.tiny.recipe import REPORT_FILE, TINY_MODEL_NAME, TINY_MODEL_VERSION

# The SFT-warmed model as built once by ``python -m opentinker.tiny --rebuild`` and committed:
# every machine trains from the same bytes. (A rebuild repeats itself byte for byte on one
# machine, but float32 kernels differ between CPUs and the SFT amplifies the difference: two
# machines' rebuilds scored 0.545 and 0.380 held-out.)
SHIPPED_DIR = Path(__file__).resolve().parent / "model"


def default_cache_dir() -> Path:
    """``$OPENTINKER_CACHE_DIR``, else ``$XDG_CACHE_HOME/opentinker``, else ``~/.cache/opentinker``."""
    explicit = os.environ.get("OPENTINKER_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg:
        return Path(xdg).expanduser() / "opentinker"
    return Path.home() / ".cache" / "opentinker"


def tiny_model_dir(cache_dir: str | os.PathLike | None = None, *, warm: bool = True) -> Path:
    """Where the tiny model is: the shipped folder (warm, no ``cache_dir``), else where a build
    goes in ``cache_dir`` (the default cache when None); a build may not be there yet."""
    if warm and cache_dir is None:
        return SHIPPED_DIR
    return cache_build_dir(cache_dir, warm=warm)


def cache_build_dir(cache_dir: str | os.PathLike | None = None, *, warm: bool = True) -> Path:
    """Where a build of the (warm or base) tiny model goes in ``cache_dir``."""
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    suffix = "" if warm else "-base"
    return root / f"{TINY_MODEL_NAME}-{TINY_MODEL_VERSION}{suffix}"


def _is_complete(folder: Path) -> bool:
    # The report is written last inside the temporary folder, and the folder only appears
    # under its final name by an atomic rename, so its presence means a finished build.
    return (folder / REPORT_FILE).is_file() and (folder / "model.safetensors").is_file()


@contextlib.contextmanager
def _build_lock(lock_path: Path) -> Iterator[None]:
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


def ensure_tiny_model(
    cache_dir: str | os.PathLike | None = None,
    *,
    warm: bool = True,
    progress: bool = True,
    force: bool = False,
) -> Path:
    """The folder of the tiny model: the shipped SFT-warmed one, or (``warm=False``, a
    ``cache_dir``, or ``force``) a build in the cache, built once.

    Concurrent builders (threads or processes) are serialized by a lock file; a build goes to a
    temporary folder beside the final one and is renamed into place, so a reader never sees a
    half-written model. ``force`` rebuilds even when a finished build is there.
    """
    if warm and cache_dir is None and not force:
        if not _is_complete(SHIPPED_DIR):
            raise FileNotFoundError(f"the shipped tiny model is missing from {SHIPPED_DIR} (a partial "
                                    "checkout?); `python -m opentinker.tiny --rebuild` builds one into the cache")
        return SHIPPED_DIR
    from opentinker.tiny.build import build_tiny_model

    target = cache_build_dir(cache_dir, warm=warm)
    if _is_complete(target) and not force:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _build_lock(target.parent / f".{target.name}.lock"):
        if _is_complete(target) and not force:
            return target  # another process built it while we waited for the lock
        # Builders hold the lock, so staging folders seen now were left by a killed build.
        for stale in target.parent.glob(f".{target.name}.tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        if progress:
            kind = "SFT-warmed" if warm else "base (random init)"
            print(f"[opentinker.tiny] building the {kind} tiny model into {target}", file=sys.stderr)
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        try:
            build_tiny_model(staging, sft_steps=None if warm else 0, progress=progress)
            os.chmod(staging, 0o755)  # mkdtemp makes it private; the cache is an ordinary folder
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


def read_tiny_report(folder: str | os.PathLike) -> dict[str, Any]:
    """The build report (recipe, parameter count, build seconds, accuracies) of a built folder."""
    return json.loads((Path(folder) / REPORT_FILE).read_text())
