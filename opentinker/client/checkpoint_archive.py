"""Checkpoint archives from the server, extracted safely: every member is checked before
anything is written (plain files and folders inside the destination, no links or devices,
bounded member count and bytes), and a failed extraction leaves nothing behind. Used by
``JobHandle.download_checkpoint`` (``opentinker jobs download``)."""

from __future__ import annotations

import gzip
import os
import re
import stat
import tarfile
import uuid
import zlib
from pathlib import Path
from typing import Any

from opentinker.client.errors import OpenTinkerError, UnsafeArchiveError
from opentinker.protocol import CHECKPOINT_NAME_PATTERN

__all__ = ["MAX_ARCHIVE_BYTES", "MAX_ARCHIVE_MEMBERS", "check_checkpoint_name", "download_limit",
           "extract_tar_safely"]


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


def check_checkpoint_name(name: object, what: str) -> str:
    """``name`` when it is a plain checkpoint folder name (the server's rule), else
    :class:`UnsafeArchiveError`: it becomes a folder name on this machine."""
    if not isinstance(name, str) or not _CHECKPOINT_NAME.fullmatch(name) or ".." in name:
        raise UnsafeArchiveError(
            f"refusing checkpoint name {name!r} ({what}): a checkpoint name is a plain folder name "
            "(a letter or digit, then letters, digits, '_', '.' or '-', at most 128 characters, no '..')"
        )
    return name


def download_limit(max_members: int, max_bytes: int) -> int:
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
