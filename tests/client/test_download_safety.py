"""Checkpoint download safety (audit item 11): a hostile server must not make the client
write outside the destination, through links, or without bound; a refusal writes nothing.

Real tar archives are built here with ``tarfile`` and served by the protocol test server
(tests/client/conftest.py) over real HTTP; extraction writes real files under ``tmp_path``.
"""

from __future__ import annotations

import errno
import io
import os
import re
import tarfile
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from opentinker.client import OpenTinkerError, UnsafeArchiveError
from opentinker.client import jobs as jobs_module
from opentinker.client.checkpoint_archive import MAX_ARCHIVE_BYTES, MAX_ARCHIVE_MEMBERS, extract_tar_safely
from opentinker.protocol import CheckpointInfo, JobCreate

# ---------------------------------------------------------------------- helpers


def _tar(build: Callable[[tarfile.TarFile], object], mode: str = "w:gz", fmt: int = tarfile.PAX_FORMAT) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode=mode, format=fmt) as tar:
        build(tar)
    return buffer.getvalue()


def _file(tar: tarfile.TarFile, name: str, content: bytes = b"x", mode: int = 0o644, **fields) -> None:
    member = tarfile.TarInfo(name)
    member.size = len(content)
    member.mode = mode
    for key, value in fields.items():
        setattr(member, key, value)
    tar.addfile(member, io.BytesIO(content))


def _dir(tar: tarfile.TarFile, name: str, mode: int = 0o755) -> None:
    member = tarfile.TarInfo(name)
    member.type = tarfile.DIRTYPE
    member.mode = mode
    tar.addfile(member)


def _special(tar: tarfile.TarFile, name: str, kind: bytes, linkname: str = "") -> None:
    member = tarfile.TarInfo(name)
    member.type = kind
    member.linkname = linkname
    tar.addfile(member)


def _tree(root: Path) -> set[str]:
    """Every path under ``root`` (links not followed), relative."""
    found = set()
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            found.add(os.path.relpath(os.path.join(dirpath, name), root))
    return found


def _serve(client, proto, archive: bytes, name: str = "global_step_1"):
    """A job on the test server whose (only, so latest) checkpoint ``name`` downloads as ``archive``."""
    job = client.create_job(JobCreate(config={"trainer.total_training_steps": 1}))
    proto.state.jobs[job.job_id].checkpoints.append(CheckpointInfo(name=name, step=1, created_at=time.time()))
    proto.state.archives[(job.job_id, name)] = archive
    return job


def _downloads(proto) -> list[str]:
    return [r.path for r in proto.state.requests if r.path.endswith("/download")]


def _umasked(mode: int) -> int:
    umask = os.umask(0)
    os.umask(umask)
    return mode & ~umask


# ---------------------------------------------------------------------- checkpoint names

BAD_NAMES = [
    "../../x",
    "/tmp/abs",
    "a/b",
    "..",
    ".",
    "",
    "a..b",
    ".hidden",
    "-rf",
    "x\x00y",
    "a\\b",
    "..\\x",
    "C:x",
    "C:\\x",
    "ok\n",
    "x" * 129,
]


@pytest.mark.parametrize("bad", BAD_NAMES, ids=repr)
def test_a_checkpoint_name_from_the_server_is_checked_before_anything_happens(client, proto, tmp_path, monkeypatch, bad):
    cwd = tmp_path / "a" / "b"
    cwd.mkdir(parents=True)
    monkeypatch.chdir(cwd)
    job = _serve(client, proto, proto.archive({"config.json": b"{}"}), name=bad)
    before, abs_existed = _tree(tmp_path), os.path.lexists("/tmp/abs")
    with pytest.raises(UnsafeArchiveError, match=re.escape(f"refusing checkpoint name {bad!r}")) as info:
        job.download_checkpoint()  # dest: ./<name>
    assert "server's latest checkpoint" in str(info.value)
    assert _downloads(proto) == []  # refused before the download request
    assert _tree(tmp_path) == before  # nothing written: no ../../x, no ./a/b, ...
    assert os.path.lexists("/tmp/abs") == abs_existed


def test_an_absolute_checkpoint_name_from_the_server_writes_nothing_there(client, proto, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    target = tmp_path / "elsewhere" / "abs"  # what Path.cwd() / name would have become
    job = _serve(client, proto, proto.archive({"config.json": b"{}"}), name=str(target))
    with pytest.raises(UnsafeArchiveError, match=re.escape(repr(str(target)))):
        job.download_checkpoint()
    assert not (tmp_path / "elsewhere").exists() and _downloads(proto) == []


@pytest.mark.parametrize("bad", ["../../x", "/tmp/abs", "a/b", "..", "", "C:x", "x\x00y"], ids=repr)
def test_a_checkpoint_name_given_by_the_caller_is_checked_too(client, proto, tmp_path, bad):
    job = client.create_job(JobCreate(config={"trainer.total_training_steps": 1}))
    sent = len(proto.state.requests)
    with pytest.raises(UnsafeArchiveError, match=re.escape(f"refusing checkpoint name {bad!r} (the checkpoint name given)")):
        job.download_checkpoint(bad, tmp_path / "dest")
    assert len(proto.state.requests) == sent  # not a single request
    assert not (tmp_path / "dest").exists()


def test_a_good_name_downloads_into_the_current_folder_by_default(client, proto, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    job = _serve(client, proto, proto.archive({"config.json": b'{"a": 1}', "tok/t.json": b"{}"}), name="global_step_7.v2")
    folder = job.download_checkpoint()
    assert folder == tmp_path / "global_step_7.v2"
    assert (folder / "config.json").read_bytes() == b'{"a": 1}' and (folder / "tok" / "t.json").read_bytes() == b"{}"


# ---------------------------------------------------------------------- archive members


def _symlink_chain(tar):  # a -> ".", a/b -> "..", a/b/escape.txt: one level above the destination
    _file(tar, "config.json", b"{}")
    _special(tar, "a", tarfile.SYMTYPE, ".")
    _special(tar, "a/b", tarfile.SYMTYPE, "..")
    _file(tar, "a/b/escape.txt", b"pwned")


def _chain_file_first(tar):  # the same chain with the payload listed before the links
    _file(tar, "a/b/escape.txt", b"pwned")
    _special(tar, "a", tarfile.SYMTYPE, ".")
    _special(tar, "a/b", tarfile.SYMTYPE, "..")


def _nul_name(tar):
    member = tarfile.TarInfo("placeholder")
    member.pax_headers = {"path": "a\x00b.txt"}
    member.size = 1
    tar.addfile(member, io.BytesIO(b"x"))


# kind -> (archive builder, refused member, what the refusal says)
EVIL: dict[str, tuple[Callable, str, str]] = {
    "symlink-chain": (_symlink_chain, "a", "is a symbolic link (to '.')"),
    "symlink-chain-file-first": (_chain_file_first, "a", "is a symbolic link (to '.')"),
    "symlink-inside": (
        lambda t: (_file(t, "model.bin", b"w"), _special(t, "alias.bin", tarfile.SYMTYPE, "model.bin")),
        "alias.bin",
        "is a symbolic link (to 'model.bin')",
    ),
    "symlink-out": (lambda t: _special(t, "weights", tarfile.SYMTYPE, "../../etc"), "weights", "is a symbolic link"),
    "symlink-absolute": (lambda t: _special(t, "w", tarfile.SYMTYPE, "/etc/passwd"), "w", "is a symbolic link"),
    "hardlink-inside": (
        lambda t: (_file(t, "model.bin", b"w"), _special(t, "copy.bin", tarfile.LNKTYPE, "model.bin")),
        "copy.bin",
        "is a hard link (to 'model.bin')",
    ),
    "hardlink-out": (lambda t: _special(t, "w", tarfile.LNKTYPE, "../escape.txt"), "w", "is a hard link"),
    "dotdot": (lambda t: (_file(t, "config.json"), _file(t, "../escape.txt")), "../escape.txt", "has a '..' component"),
    "nested-dotdot": (lambda t: _file(t, "a/../../escape.txt"), "a/../../escape.txt", "has a '..' component"),
    "harmless-dotdot": (lambda t: _file(t, "a/../b.txt"), "a/../b.txt", "has a '..' component"),
    "dotdot-dir": (lambda t: _dir(t, "sub/.."), "sub/..", "has a '..' component"),
    "backslash": (lambda t: _file(t, "..\\escape.txt"), "..\\escape.txt", "has a backslash"),
    "backslash-inside": (lambda t: _file(t, "sub\\x.txt"), "sub\\x.txt", "has a backslash"),
    "drive": (lambda t: _file(t, "C:/escape.txt"), "C:/escape.txt", "starts with a Windows drive letter"),
    "drive-relative": (lambda t: _file(t, "c:escape.txt"), "c:escape.txt", "starts with a Windows drive letter"),
    "char-device": (lambda t: _special(t, "null", tarfile.CHRTYPE), "null", "is a device file"),
    "block-device": (lambda t: _special(t, "sda", tarfile.BLKTYPE), "sda", "is a device file"),
    "fifo": (lambda t: (_file(t, "config.json"), _special(t, "pipe", tarfile.FIFOTYPE)), "pipe", "is a fifo"),
    "empty-name": (lambda t: (_file(t, "config.json"), _file(t, "")), "", "has an empty name"),
    "nul-name": (_nul_name, "a\x00b.txt", "has a NUL character"),
    "root-as-file": (lambda t: _file(t, "./"), "./", "is a file that names the destination folder itself"),
    "duplicate": (lambda t: (_file(t, "config.json", b"1"), _file(t, "config.json", b"2")), "config.json",
                  "would overwrite member 'config.json'"),
    "duplicate-dot-slash": (lambda t: (_file(t, "config.json"), _file(t, "./config.json")), "./config.json",
                            "would overwrite member 'config.json'"),
    "duplicate-case": (lambda t: (_file(t, "Config.json"), _file(t, "config.json")), "config.json",
                       "would overwrite member 'Config.json'"),
    "duplicate-dir": (lambda t: (_dir(t, "sub"), _dir(t, "sub/")), "sub", "would overwrite member 'sub'"),
    "file-then-dir": (lambda t: (_file(t, "sub"), _dir(t, "sub")), "sub", "would overwrite member 'sub'"),
    "file-as-parent": (lambda t: (_file(t, "sub"), _file(t, "sub/x.txt")), "sub/x.txt",
                       "needs 'sub' to be a folder, but the archive has it as the file 'sub'"),
}


def _assert_refused(info: pytest.ExceptionInfo, member: str, says: str) -> None:
    assert info.type is UnsafeArchiveError
    assert f"member {member!r} {says}" in str(info.value)


@pytest.mark.parametrize("kind", sorted(EVIL))
def test_download_refuses_the_member_and_writes_nothing(client, proto, tmp_path, kind):
    build, member, says = EVIL[kind]
    job = _serve(client, proto, _tar(build))
    dest = tmp_path / "out" / "ckpt"
    before = _tree(tmp_path)
    with pytest.raises(UnsafeArchiveError) as info:
        job.download_checkpoint(dest=dest)
    _assert_refused(info, member, says)
    assert not (tmp_path / "out").exists()  # not even the destination folder
    assert _tree(tmp_path) == before  # nothing next to it either
    assert not (tmp_path / "escape.txt").exists()


@pytest.mark.parametrize("kind", sorted(EVIL))
def test_extract_refuses_the_member_on_an_uncompressed_archive(tmp_path, kind):
    build, member, says = EVIL[kind]
    archive = tmp_path / "c.tar"
    archive.write_bytes(_tar(build, mode="w"))
    with pytest.raises(UnsafeArchiveError) as info:
        extract_tar_safely(archive, tmp_path / "dest")
    _assert_refused(info, member, says)
    assert _tree(tmp_path) == {"c.tar"}


def test_an_absolute_member_is_refused_and_nothing_lands_there(client, proto, tmp_path):
    target = tmp_path / "abs-escape.txt"
    job = _serve(client, proto, _tar(lambda t: (_file(t, "config.json"), _file(t, str(target), b"pwned"))))
    with pytest.raises(UnsafeArchiveError) as info:
        job.download_checkpoint(dest=tmp_path / "ckpt")
    _assert_refused(info, str(target), "has an absolute path")
    assert not target.exists() and not (tmp_path / "ckpt").exists()


def test_a_member_with_a_negative_size_is_refused(tmp_path):
    archive = tmp_path / "c.tar"
    member = tarfile.TarInfo("neg.bin")
    member.size = -1  # GNU base-256 numbers can be negative
    archive.write_bytes(_tar(lambda t: t.addfile(member), mode="w", fmt=tarfile.GNU_FORMAT))
    with pytest.raises(UnsafeArchiveError) as info:
        extract_tar_safely(archive, tmp_path / "dest")
    _assert_refused(info, "neg.bin", "declares a negative size (-1)")
    assert not (tmp_path / "dest").exists()


def test_the_symlink_chain_is_refused_on_every_python_the_project_allows(tmp_path, monkeypatch):
    """Python 3.10 (and early 3.11) have no tar ``data`` filter: the check must not rely on it."""
    monkeypatch.delattr(tarfile, "data_filter", raising=False)
    monkeypatch.setattr(tarfile.TarFile, "extractall", None)  # never used
    monkeypatch.setattr(tarfile.TarFile, "extract", None)
    archive = tmp_path / "chain.tar.gz"
    archive.write_bytes(_tar(_symlink_chain))
    with pytest.raises(UnsafeArchiveError) as info:
        extract_tar_safely(archive, tmp_path / "x" / "y")
    _assert_refused(info, "a", "is a symbolic link")
    assert _tree(tmp_path) == {"chain.tar.gz"}
    # and a good archive extracts the same way without them
    archive.write_bytes(_tar(lambda t: (_dir(t, "m"), _file(t, "m/config.json", b"{}"))))
    assert extract_tar_safely(archive, tmp_path / "x" / "y") == ["m"]
    assert (tmp_path / "x" / "y" / "m" / "config.json").read_bytes() == b"{}"


# ---------------------------------------------------------------------- good checkpoints


def test_a_checkpoint_like_the_servers_extracts_with_its_content_and_ordinary_modes(client, proto, tmp_path):
    def build(tar):  # the server's layout: the folder itself, then its folders and files
        _dir(tar, "global_step_3", mode=0o700)
        _file(tar, "global_step_3/config.json", b'{"model_type": "qwen2"}', mode=0o4777, uid=0, gid=0,
              uname="root", gname="root")
        _file(tar, "global_step_3/model.safetensors", bytes(range(256)) * 4)
        _dir(tar, "global_step_3/tokenizer", mode=0o777)
        _file(tar, "global_step_3/tokenizer/tokenizer.json", b"{}")
        _file(tar, "global_step_3/empty.txt", b"")

    job = _serve(client, proto, _tar(build), name="global_step_3")
    folder = job.download_checkpoint(dest=tmp_path / "dl")
    assert folder == tmp_path / "dl" / "global_step_3"
    assert (folder / "config.json").read_bytes() == b'{"model_type": "qwen2"}'
    assert (folder / "model.safetensors").read_bytes() == bytes(range(256)) * 4
    assert (folder / "tokenizer" / "tokenizer.json").read_bytes() == b"{}"
    assert (folder / "empty.txt").read_bytes() == b""
    assert _tree(tmp_path / "dl") == {"global_step_3", "global_step_3/config.json", "global_step_3/model.safetensors",
                                      "global_step_3/tokenizer", "global_step_3/tokenizer/tokenizer.json",
                                      "global_step_3/empty.txt"}
    for path in (folder / "config.json", folder / "model.safetensors", folder / "empty.txt"):
        assert path.stat().st_mode & 0o7777 == _umasked(0o644)  # not the archive's 0o4777
    for path in (tmp_path / "dl", folder, folder / "tokenizer"):
        assert path.stat().st_mode & 0o7777 == _umasked(0o755)


def test_the_servers_own_archive_round_trips(client, proto, tmp_path):
    from opentinker.server.archive import iter_tar_gz  # stdlib only: what the real server streams

    source = tmp_path / "src"
    (source / "tokenizer").mkdir(parents=True)
    (source / "config.json").write_text('{"step": 5}')
    (source / "tokenizer" / "vocab.txt").write_text("a\nb\n")
    job = _serve(client, proto, b"".join(iter_tar_gz(source, "global_step_5")), name="global_step_5")
    folder = job.download_checkpoint(dest=tmp_path / "dl")
    assert folder == tmp_path / "dl" / "global_step_5"
    assert (folder / "config.json").read_text() == '{"step": 5}'
    assert (folder / "tokenizer" / "vocab.txt").read_text() == "a\nb\n"


def test_dot_slash_names_and_the_root_entry_extract_into_the_destination(tmp_path):
    archive = tmp_path / "c.tar.gz"
    archive.write_bytes(_tar(lambda t: (_dir(t, "."), _file(t, "./config.json", b"1"), _dir(t, "./sub"),
                                        _file(t, "./sub//x.bin", b"2"))))
    assert extract_tar_safely(archive, tmp_path / "dest") == ["config.json", "sub"]
    assert (tmp_path / "dest" / "config.json").read_bytes() == b"1"
    assert (tmp_path / "dest" / "sub" / "x.bin").read_bytes() == b"2"


def test_extracting_again_replaces_files_and_keeps_what_else_was_there(tmp_path):
    dest = tmp_path / "dest"
    (dest / "sub").mkdir(parents=True)
    (dest / "config.json").write_bytes(b"old")
    (dest / "notes.txt").write_bytes(b"mine")
    outside = tmp_path / "outside.txt"
    outside.write_bytes(b"untouched")
    (dest / "sub" / "x.bin").symlink_to(outside)  # a link where the archive puts a file: replaced, not followed
    archive = tmp_path / "c.tar.gz"
    archive.write_bytes(_tar(lambda t: (_file(t, "config.json", b"new"), _file(t, "sub/x.bin", b"data"))))
    assert extract_tar_safely(archive, dest) == ["config.json", "sub"]
    assert (dest / "config.json").read_bytes() == b"new" and (dest / "notes.txt").read_bytes() == b"mine"
    assert not (dest / "sub" / "x.bin").is_symlink() and (dest / "sub" / "x.bin").read_bytes() == b"data"
    assert outside.read_bytes() == b"untouched"
    assert not [p for p in _tree(dest) if ".part" in p]


def test_a_link_already_in_the_destination_is_not_written_through(tmp_path):
    dest = tmp_path / "dest"
    dest.mkdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (dest / "sub").symlink_to(elsewhere, target_is_directory=True)
    archive = tmp_path / "c.tar.gz"
    archive.write_bytes(_tar(lambda t: (_file(t, "config.json", b"1"), _file(t, "sub/x.bin", b"2"))))
    with pytest.raises(UnsafeArchiveError) as info:
        extract_tar_safely(archive, dest)
    _assert_refused(info, "sub/x.bin", "needs the folder")
    assert list(elsewhere.iterdir()) == [] and _tree(dest) == {"sub"}


def test_a_folder_where_the_archive_has_a_file_is_refused(tmp_path):
    dest = tmp_path / "dest"
    (dest / "config.json").mkdir(parents=True)
    archive = tmp_path / "c.tar.gz"
    archive.write_bytes(_tar(lambda t: (_file(t, "a.bin"), _file(t, "config.json"))))
    with pytest.raises(UnsafeArchiveError) as info:
        extract_tar_safely(archive, dest)
    _assert_refused(info, "config.json", "would replace the folder")
    assert _tree(dest) == {"config.json"}


# ---------------------------------------------------------------------- limits


def test_the_default_limits_are_generous():
    assert MAX_ARCHIVE_MEMBERS == 100_000 and MAX_ARCHIVE_BYTES == 1 << 40


def _three_files(tar):
    _file(tar, "a.bin", b"123456")
    _file(tar, "b.bin", b"123456")
    _file(tar, "c.bin", b"")


def test_an_archive_over_the_size_cap_is_refused_from_its_headers(tmp_path):
    archive = tmp_path / "c.tar.gz"
    archive.write_bytes(_tar(_three_files))
    with pytest.raises(UnsafeArchiveError) as info:
        extract_tar_safely(archive, tmp_path / "dest", max_bytes=11)
    _assert_refused(info, "b.bin", "brings the archive past the limit of 11 uncompressed bytes")
    assert not (tmp_path / "dest").exists()
    assert extract_tar_safely(archive, tmp_path / "dest", max_bytes=12) == ["a.bin", "b.bin", "c.bin"]


def test_an_archive_over_the_member_cap_is_refused(tmp_path):
    archive = tmp_path / "c.tar.gz"
    archive.write_bytes(_tar(_three_files))
    with pytest.raises(UnsafeArchiveError) as info:
        extract_tar_safely(archive, tmp_path / "dest", max_members=2)
    _assert_refused(info, "c.bin", "is past the limit of 2 members per archive")
    assert not (tmp_path / "dest").exists()
    assert extract_tar_safely(archive, tmp_path / "dest", max_members=3) == ["a.bin", "b.bin", "c.bin"]


def test_download_applies_the_module_limits(client, proto, tmp_path, monkeypatch):
    monkeypatch.setattr(jobs_module, "MAX_ARCHIVE_BYTES", 11)
    job = _serve(client, proto, _tar(_three_files))
    with pytest.raises(UnsafeArchiveError) as info:
        job.download_checkpoint(dest=tmp_path / "dest")
    _assert_refused(info, "b.bin", "brings the archive past the limit of 11 uncompressed bytes")
    assert not (tmp_path / "dest").exists()


def test_download_stops_reading_an_endless_answer(client, proto, tmp_path, monkeypatch):
    monkeypatch.setattr(jobs_module, "MAX_ARCHIVE_BYTES", 0)
    monkeypatch.setattr(jobs_module, "MAX_ARCHIVE_MEMBERS", 0)  # the download may bring ~1 MiB at most
    job = _serve(client, proto, os.urandom(3 << 20))
    with pytest.raises(UnsafeArchiveError, match="the server sent more than"):
        job.download_checkpoint(dest=tmp_path / "dest")
    assert not (tmp_path / "dest").exists()


def _lying_extractfile(monkeypatch, name: str, data: bytes) -> None:
    """Make ``name``'s stream yield ``data`` whatever its header declares (tarfile itself never
    yields more than the header's size; this stands for a reader that would)."""
    original = tarfile.TarFile.extractfile

    def extractfile(self, member):
        if getattr(member, "name", member) == name:
            return io.BytesIO(data)
        return original(self, member)

    monkeypatch.setattr(tarfile.TarFile, "extractfile", extractfile)


def test_a_member_yielding_more_than_its_header_declares_is_refused_and_undone(tmp_path, monkeypatch):
    archive = tmp_path / "c.tar.gz"
    archive.write_bytes(_tar(lambda t: (_file(t, "m/a.bin", b"12345"), _file(t, "m/sub/b.bin", b"12345"))))
    _lying_extractfile(monkeypatch, "m/sub/b.bin", b"12345" * 1000)
    with pytest.raises(UnsafeArchiveError) as info:
        extract_tar_safely(archive, tmp_path / "out" / "dest")
    _assert_refused(info, "m/sub/b.bin", "holds more data than the 5 bytes its header declares")
    assert _tree(tmp_path) == {"c.tar.gz"}  # m/a.bin, the folders and out/ were removed again


def test_the_size_cap_is_enforced_while_writing(tmp_path, monkeypatch):
    archive = tmp_path / "c.tar.gz"
    archive.write_bytes(_tar(lambda t: (_file(t, "a.bin", b"12345"), _file(t, "b.bin", b"12345"))))
    original = tarfile.TarFile.extractfile
    monkeypatch.setattr(tarfile.TarFile, "extractfile", lambda self, m: _grown(original(self, m)))
    with pytest.raises(UnsafeArchiveError) as info:
        extract_tar_safely(archive, tmp_path / "dest", max_bytes=10)
    _assert_refused(info, "a.bin", "holds more data than the 5 bytes")
    assert not (tmp_path / "dest").exists()


def _grown(stream):
    data = stream.read()
    return io.BytesIO(data + data)


# ---------------------------------------------------------------------- failures midway


def _failing_extractfile(monkeypatch, name: str, exc: BaseException) -> None:
    original = tarfile.TarFile.extractfile

    class Broken(io.RawIOBase):
        def readable(self):
            return True

        def readinto(self, buffer):
            raise exc

    def extractfile(self, member):
        if getattr(member, "name", member) == name:
            return io.BufferedReader(Broken())
        return original(self, member)

    monkeypatch.setattr(tarfile.TarFile, "extractfile", extractfile)


def test_a_full_disk_midway_removes_what_was_written_and_keeps_what_was_there(tmp_path, monkeypatch):
    dest = tmp_path / "dest"
    (dest / "old").mkdir(parents=True)
    (dest / "config.json").write_bytes(b"old config")
    (dest / "old" / "keep.bin").write_bytes(b"keep")
    before = _tree(dest)
    archive = tmp_path / "c.tar.gz"
    archive.write_bytes(_tar(lambda t: (_file(t, "config.json", b"new config"), _file(t, "new/a/x.bin", b"x"),
                                        _file(t, "old/y.bin", b"y"), _file(t, "z.bin", b"z"))))
    _failing_extractfile(monkeypatch, "z.bin", OSError(errno.ENOSPC, "No space left on device"))
    with pytest.raises(OSError) as info:
        extract_tar_safely(archive, dest)
    assert info.value.errno == errno.ENOSPC
    assert _tree(dest) == before  # no new/, no old/y.bin, no temporary files
    assert (dest / "config.json").read_bytes() == b"old config"  # replaced only once every file is written
    assert (dest / "old" / "keep.bin").read_bytes() == b"keep"


def test_a_truncated_archive_leaves_nothing(tmp_path):
    first, second = os.urandom(4096), os.urandom(8192)
    data = _tar(lambda t: (_dir(t, "m"), _file(t, "m/a.bin", first), _file(t, "m/b.bin", second)), mode="w")
    archive = tmp_path / "c.tar"
    archive.write_bytes(data[: 3 * 512 + len(first) + 4096])  # b.bin's header and half its data
    with pytest.raises(OpenTinkerError, match="corrupt or truncated") as info:
        extract_tar_safely(archive, tmp_path / "out" / "dest")
    assert not isinstance(info.value, UnsafeArchiveError)
    assert _tree(tmp_path) == {"c.tar"}


def test_a_truncated_gzip_download_leaves_nothing(client, proto, tmp_path):
    data = _tar(lambda t: (_file(t, "a.bin", os.urandom(50_000)), _file(t, "b.bin", os.urandom(50_000))))
    job = _serve(client, proto, data[: len(data) // 2])
    with pytest.raises(OpenTinkerError, match="corrupt or truncated") as info:
        job.download_checkpoint(dest=tmp_path / "dest")
    assert not isinstance(info.value, UnsafeArchiveError)
    assert not (tmp_path / "dest").exists()


def test_not_a_tar_archive(tmp_path):
    archive = tmp_path / "c.tar.gz"
    archive.write_bytes(b"<html>502 Bad Gateway</html>")
    with pytest.raises(OpenTinkerError, match="not a valid tar archive"):
        extract_tar_safely(archive, tmp_path / "dest")
    assert not (tmp_path / "dest").exists()


def test_a_broken_stream_midway_is_reported_as_a_corrupt_archive_and_undone(tmp_path, monkeypatch):
    dest = tmp_path / "dest"
    dest.mkdir()
    (dest / "keep.txt").write_bytes(b"keep")
    archive = tmp_path / "c.tar.gz"
    archive.write_bytes(_tar(lambda t: (_file(t, "m/a.bin", b"a"), _file(t, "m/b.bin", b"b"))))
    _failing_extractfile(monkeypatch, "m/b.bin", tarfile.ReadError("unexpected end of data"))
    with pytest.raises(OpenTinkerError, match="corrupt or truncated: unexpected end of data") as info:
        extract_tar_safely(archive, dest)
    assert isinstance(info.value.__cause__, tarfile.ReadError)
    assert _tree(dest) == {"keep.txt"}
