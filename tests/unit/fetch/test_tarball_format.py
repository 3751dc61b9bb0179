"""Tarball format 2: a plain tar (no gzip), whose bytes depend only on imagebuild's own writer.

Format 1 wrapped the same tar in gzip members, so its bytes (the lock's sha256, every stage key)
depended on the machine's deflate: a Python linked with zlib-ng could not prefetch at all. These
checks fail on format 1: its first bytes are gzip's magic, ``r:`` cannot read it, and a zlib-ng
``zlib`` stopped it (the removed known-answer test)."""

from __future__ import annotations

import hashlib
import importlib.util
import io
import os
import subprocess
import sys
import tarfile

import pytest
from zlib_ng import zlib_ng

from imagebuild.fetch import gitcache, tarball

EPOCH = 1_700_000_123


def _git(*args: str, cwd) -> str:
    env = dict(os.environ, GIT_AUTHOR_DATE="@1700000000 +0000", GIT_COMMITTER_DATE="@1700000000 +0000",
               GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@localhost", GIT_COMMITTER_NAME="t",
               GIT_COMMITTER_EMAIL="t@localhost", GIT_CONFIG_NOSYSTEM="1", HOME=str(cwd))
    return subprocess.run(["git", *args], cwd=cwd, env=env, check=True, capture_output=True, text=True).stdout.strip()


def _tree(root):
    (root / "src" / "deep").mkdir(parents=True)
    (root / "src" / "deep" / "k.cu").write_bytes(b"__global__ void k() {}\n" * 5000)  # ~115 KB
    (root / "src-b").mkdir()
    (root / "src-b" / "x.txt").write_text("x\n")
    (root / "run.sh").write_text("#!/bin/sh\necho run\n")
    (root / "run.sh").chmod(0o755)
    (root / "CMakeLists.txt").write_text("project(t)\n")
    (root / "link").symlink_to("run.sh")


@pytest.fixture
def entries(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    _tree(work)
    _git("init", "-q", "-b", "main", ".", cwd=work)
    _git("add", "-A", ".", cwd=work)
    _git("commit", "-q", "-m", "t", cwd=work)
    m = gitcache.Cache(tmp_path / "cache", offline=True).mirror(work.as_uri())
    _git("clone", "-q", "--bare", "--no-local", work.as_uri(), str(m.path), cwd=tmp_path)
    return [tarball.Entry(p, mode, sha, m) for mode, sha, p in tarball.list_tree(m, "HEAD")]


def _is_plain_tar(data: bytes) -> None:
    head = data[:512]
    assert head[257:265] == b"ustar  \0", head[:16]  # GNU magic where a tar header has it; not gzip's 1f 8b
    tarfile.TarInfo.frombuf(head, "utf-8", "surrogateescape")  # a valid header: its checksum verified
    assert len(data) % tarfile.RECORDSIZE == 0 and data.endswith(b"\0" * 1024)


def test_format_2_is_a_plain_tar():
    assert tarball.FORMAT == 2 and tarball.SUFFIX == ".tar"
    assert not hasattr(tarball, "check_deflate") and not hasattr(tarball, "zlib")


def test_pack_writes_a_plain_tar_and_the_same_bytes_twice(entries, tmp_path):
    d1 = tarball.pack(entries, tmp_path / "one.tar", EPOCH)
    d2 = tarball.pack(list(reversed(entries)), tmp_path / "two.tar", EPOCH)
    one, two = (tmp_path / "one.tar").read_bytes(), (tmp_path / "two.tar").read_bytes()
    assert one == two and d1 == d2 == hashlib.sha256(one).hexdigest()
    _is_plain_tar(one)
    with tarfile.open(tmp_path / "one.tar", mode="r:") as t:  # r: reads no compression at all
        assert t.getnames() == ["./CMakeLists.txt", "./link", "./run.sh", "./src", "./src/deep",
                                "./src/deep/k.cu", "./src-b", "./src-b/x.txt"]
        assert t.extractfile("./src/deep/k.cu").read() == b"__global__ void k() {}\n" * 5000
        assert t.getmember("./run.sh").mode == 0o755 and t.getmember("./CMakeLists.txt").mode == 0o644
        assert t.getmember("./link").issym() and t.getmember("./link").linkname == "run.sh"
        for m in t.getmembers():
            assert (m.uid, m.gid, m.uname, m.gname, m.mtime) == (0, 0, "", "", EPOCH)
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_pack_dir_writes_the_same_layout(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    for d in (a, b):
        d.mkdir()
        _tree(d)
    os.utime(b / "run.sh", (1, 1))  # times on disk do not count
    da, db = tarball.pack_dir(a, tmp_path / "a.tar", EPOCH), tarball.pack_dir(b, tmp_path / "b.tar", EPOCH)
    data = (tmp_path / "a.tar").read_bytes()
    assert da == db == hashlib.sha256(data).hexdigest() and data == (tmp_path / "b.tar").read_bytes()
    _is_plain_tar(data)
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as t:
        assert t.getmember("./run.sh").mode == 0o755 and t.getmember("./src/deep").isdir()


def test_the_bytes_do_not_depend_on_this_pythons_deflate(tmp_path, monkeypatch):
    """A copy of the module loaded where ``zlib`` is zlib-ng (as in a Python linked with it) packs the
    very same bytes; under format 1 it refused to pack at all."""
    monkeypatch.setitem(sys.modules, "zlib", zlib_ng)
    spec = importlib.util.spec_from_file_location("imagebuild_tarball_zlib_ng", tarball.__file__)
    ng = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, ng)  # (its dataclass looks itself up there)
    spec.loader.exec_module(ng)
    monkeypatch.undo()
    src = tmp_path / "t"
    src.mkdir()
    _tree(src)
    assert ng.pack_dir(src, tmp_path / "ng.tar", EPOCH) == tarball.pack_dir(src, tmp_path / "here.tar", EPOCH)
    assert (tmp_path / "ng.tar").read_bytes() == (tmp_path / "here.tar").read_bytes()
