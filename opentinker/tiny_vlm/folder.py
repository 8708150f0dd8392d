"""Where the tiny VLM is: the folder shipped in the package, or a build in the cache."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from opentinker.cached_build import build_once, default_cache_dir
from opentinker.tiny_vlm.recipe import REPORT_FILE, TINY_VLM_NAME, TINY_VLM_VERSION

# Built once by ``python -m opentinker.tiny_vlm --rebuild`` and committed, as the text model is:
# every machine trains from the same bytes.
SHIPPED_DIR = Path(__file__).resolve().parent / "model"


def _is_complete(folder: Path) -> bool:
    # The report is written last, and a build appears under its name only by an atomic rename.
    return (folder / REPORT_FILE).is_file() and (folder / "model.safetensors").is_file()


def ensure_tiny_vlm(cache_dir: str | os.PathLike | None = None, *, progress: bool = True, force: bool = False) -> Path:
    """The tiny VLM's folder: the shipped one, or (a ``cache_dir``, or ``force``) a build in the
    cache, built once (:func:`opentinker.cached_build.build_once`)."""
    if cache_dir is None and not force:
        if not _is_complete(SHIPPED_DIR):
            raise FileNotFoundError(f"the shipped tiny VLM is missing from {SHIPPED_DIR} (a partial checkout?); "
                                    "`python -m opentinker.tiny_vlm --rebuild` builds one into the cache")
        return SHIPPED_DIR
    from opentinker.tiny_vlm.build import build_tiny_vlm

    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = root / f"{TINY_VLM_NAME}-{TINY_VLM_VERSION}"

    def announce() -> None:
        if progress:
            print(f"[opentinker.tiny_vlm] building the tiny VLM into {target}", file=sys.stderr)

    return build_once(target, lambda staging: build_tiny_vlm(staging, progress=progress), _is_complete,
                      force=force, announce=announce)


def read_tiny_vlm_report(folder: str | os.PathLike) -> dict[str, Any]:
    return json.loads((Path(folder) / REPORT_FILE).read_text())
