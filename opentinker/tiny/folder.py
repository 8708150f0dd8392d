"""Where the tiny model is: the folder shipped in the package (the SFT-warmed model), or a
build in the cache (the base model; a rebuild)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from opentinker.cached_build import build_once, default_cache_dir
from opentinker.tiny.recipe import REPORT_FILE, TINY_MODEL_NAME, TINY_MODEL_VERSION

# The SFT-warmed model as built once by ``python -m opentinker.tiny --rebuild`` and committed:
# every machine trains from the same bytes. (A rebuild repeats itself byte for byte on one
# machine, but float32 kernels differ between CPUs and the SFT amplifies the difference: two
# machines' rebuilds scored 0.545 and 0.380 held-out.)
SHIPPED_DIR = Path(__file__).resolve().parent / "model"


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


def ensure_tiny_model(
    cache_dir: str | os.PathLike | None = None,
    *,
    warm: bool = True,
    progress: bool = True,
    force: bool = False,
) -> Path:
    """The folder of the tiny model: the shipped SFT-warmed one, or (``warm=False``, a
    ``cache_dir``, or ``force``) a build in the cache, built once.

    Built by :func:`opentinker.cached_build.build_once` (locked, renamed into place when
    finished); ``force`` rebuilds even when a finished build is there.
    """
    if warm and cache_dir is None and not force:
        if not _is_complete(SHIPPED_DIR):
            raise FileNotFoundError(f"the shipped tiny model is missing from {SHIPPED_DIR} (a partial "
                                    "checkout?); `python -m opentinker.tiny --rebuild` builds one into the cache")
        return SHIPPED_DIR
    from opentinker.tiny.build import build_tiny_model

    def announce() -> None:
        if progress:
            kind = "SFT-warmed" if warm else "base (random init)"
            print(f"[opentinker.tiny] building the {kind} tiny model into {target}", file=sys.stderr)

    target = cache_build_dir(cache_dir, warm=warm)
    return build_once(target, lambda staging: build_tiny_model(staging, sft_steps=None if warm else 0, progress=progress),
                      _is_complete, force=force, announce=announce)


def read_tiny_report(folder: str | os.PathLike) -> dict[str, Any]:
    """The build report (recipe, parameter count, build seconds, accuracies) of a built folder."""
    return json.loads((Path(folder) / REPORT_FILE).read_text())
