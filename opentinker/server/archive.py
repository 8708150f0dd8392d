"""Stream a folder as ``.tar.gz`` without building the archive in memory or on disk.

A checkpoint can be gigabytes, so each file is read in chunks and pushed through one
gzip stream; the tar headers come from :class:`tarfile.TarInfo`. Symbolic links and other
special files are skipped: only regular files and folders under the root are sent, so a
link can never expose a file outside the checkpoint.
"""

from __future__ import annotations

import os
import stat
import tarfile
import zlib
from collections.abc import Iterator
from pathlib import Path

CHUNK_BYTES = 1 << 20
_BLOCK = tarfile.BLOCKSIZE  # 512


def _entries(root: Path) -> Iterator[tuple[Path, os.stat_result]]:
    """Folders and regular files under ``root`` (root first), sorted, links not followed."""
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        dirnames.sort()
        here = Path(dirpath)
        yield here, here.lstat()
        for name in sorted(filenames):
            path = here / name
            info = path.lstat()
            if stat.S_ISREG(info.st_mode):
                yield path, info


def _header(arcname: str, info: os.stat_result, is_dir: bool) -> bytes:
    member = tarfile.TarInfo(arcname)
    member.type = tarfile.DIRTYPE if is_dir else tarfile.REGTYPE
    member.size = 0 if is_dir else info.st_size
    member.mtime = int(info.st_mtime)
    member.mode = 0o755 if is_dir else 0o644
    return member.tobuf(format=tarfile.PAX_FORMAT)


def iter_tar_gz(root: str | Path, arcname: str) -> Iterator[bytes]:
    """Chunks of a gzip-compressed tar of ``root``, whose entries are under ``arcname/``."""
    root = Path(root)
    gzip = zlib.compressobj(6, zlib.DEFLATED, 31)  # wbits 31: gzip header and trailer

    def out(data: bytes) -> Iterator[bytes]:
        compressed = gzip.compress(data)
        if compressed:
            yield compressed

    for path, info in _entries(root):
        relative = path.relative_to(root).as_posix()
        name = arcname if relative == "." else f"{arcname}/{relative}"
        is_dir = stat.S_ISDIR(info.st_mode)
        yield from out(_header(name, info, is_dir))
        if is_dir:
            continue
        remaining = info.st_size
        with open(path, "rb") as handle:
            while remaining > 0:
                chunk = handle.read(min(CHUNK_BYTES, remaining))
                if not chunk:  # the file shrank since stat: keep the promised size
                    chunk = b"\0" * remaining
                remaining -= len(chunk)
                yield from out(chunk)
        padding = -info.st_size % _BLOCK
        if padding:
            yield from out(b"\0" * padding)
    yield gzip.compress(b"\0" * (2 * _BLOCK)) + gzip.flush()
