"""Deterministic tar.gz of a git tree (plus its submodules), straight from the object store.

The archive holds the tree's files with names relative to the source root (``./CMakeLists.txt``,
no top folder), directories included, entries sorted by name within each folder (the order of
``tar --sort=name``), every entry with the same mtime
(the composed commit's time), uid/gid 0, empty user and group names, modes 0644/0755 (files by
their git executable bit, folders 0755) and symlinks as symlinks. GNU tar format; gzip with no
file name and mtime 0 at level 6, written as a series of gzip members of 4 MiB of input each
(compressed in parallel). The same tree gives the same bytes wherever deflate is mainline
zlib's (1.2.13 and 1.3.1 agree); ``check_deflate`` refuses any other (zlib-ng) before packing.

Blobs stream from ``git cat-file --batch`` (one process per repository) straight into the tar
stream, so packing keeps pace with ``tar --sort=name | gzip -n`` and beats it on several cores.
"""

from __future__ import annotations

import hashlib
import os
import struct
import tarfile
import threading
import zlib
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from imagebuild.core import run as run_mod
from imagebuild.core.errors import OperationFailed
from imagebuild.fetch.gitcache import Mirror

LEVEL = 6
FORMAT = 1  # raise when the archive layout changes: the lock records it, a tarball of another format is repacked
_CHUNK = 4 << 20


@dataclass(frozen=True)
class Entry:
    path: str  # relative to the archive root, no leading ./
    mode: str  # git mode: 100644, 100755, 120000
    sha: str  # blob
    repo: Mirror


def list_tree(m: Mirror, treeish: str) -> list[tuple[str, str, str]]:
    """(mode, sha, path) for every blob and gitlink under ``treeish`` (recursive)."""
    raw = m.git("ls-tree", "-r", "-z", "--full-tree", treeish).stdout.decode("utf-8", "surrogateescape")
    out = []
    for rec in raw.split("\0"):
        if not rec:
            continue
        meta, path = rec.split("\t", 1)
        mode, _type, sha = meta.split()
        out.append((mode, sha, path))
    return out


# gzip member header: magic, deflate, no flags, mtime 0, no extra flags, OS "unknown" (255) --
# written by hand so that it does not depend on the platform zlib was built for.
_GZ_HEADER = b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\xff"


def _known_answer_input() -> bytes:
    """~0.5 MiB of text-like data with matches at many distances, from a fixed LCG (no stdlib
    random, whose algorithms may change between Python versions)."""
    words = (b"the build never depends on a flaky network cmake fetchcontent cutlass vllm b12x kernel "
             b"sm_121a arm64 gate receipt layer digest tarball deterministic").split()
    x, out = 20261129, []
    for _ in range(60000):
        x = (x * 6364136223846793005 + 1442695040888963407) % (1 << 64)
        out.append(words[(x >> 33) % len(words)] + str((x >> 17) % 1000).encode())
    return b" ".join(out)


# sha256 of gzip_member(_known_answer_input()) as mainline zlib (1.2.x, 1.3.x) writes it at LEVEL
_KNOWN_ANSWER_SHA256 = "c36a8ae81667bf711b55605d2cf9de95cf20dd8248ad8ca20e53e5c13af0064e"
_deflate_checked = False


def check_deflate() -> None:
    """Refuse to pack when this Python's deflate writes other bytes than mainline zlib.

    Tarballs are byte-identical across machines only if every machine compresses alike. A zlib
    that is not mainline (zlib-ng, some vendor-optimised builds, as in some standalone Python
    builds) produces valid but different bytes, which the lock then rejects everywhere else.
    A known-answer test catches that before anything is written.
    """
    global _deflate_checked
    if _deflate_checked:
        return
    got = hashlib.sha256(gzip_member(_known_answer_input())).hexdigest()
    if got != _KNOWN_ANSWER_SHA256:
        raise OperationFailed(
            f"this Python's zlib ({zlib.ZLIB_RUNTIME_VERSION}) does not compress like mainline zlib "
            "(known-answer test failed): its tarballs would not match the lock on other machines",
            hint="run imagebuild with a Python linked against the system's zlib (Debian/Ubuntu python3, "
            "pyenv builds); standalone builds linked with zlib-ng differ")
    _deflate_checked = True


def gzip_member(data: bytes, level: int = LEVEL) -> bytes:
    """One complete gzip member of ``data`` (deterministic: no name, mtime 0, fixed OS byte)."""
    c = zlib.compressobj(level, zlib.DEFLATED, -15, 9)
    body = c.compress(data) + c.flush()
    return _GZ_HEADER + body + struct.pack("<II", zlib.crc32(data) & 0xFFFFFFFF, len(data) & 0xFFFFFFFF)


class _GzipSink:
    """A file-like object: bytes in, gzip out to ``raw``.

    The input is cut into fixed 4 MiB pieces, each compressed as its own gzip member by a pool
    of threads (zlib releases the GIL), and the members are written in order: a multi-member
    gzip file, which gzip, tar and Python read as one stream. The cut points depend only on the
    input, so the output bytes do too.
    """

    def __init__(self, raw, workers: int | None = None):
        self._raw = raw
        self._buf = bytearray()
        self._pool = ThreadPoolExecutor(max_workers=workers or min(8, os.cpu_count() or 1))
        self._pending: deque = deque()
        self._limit = 2 * (workers or min(8, os.cpu_count() or 1)) + 1
        self._empty = True

    def write(self, data) -> int:
        self._buf += data
        while len(self._buf) >= _CHUNK:
            self._submit(bytes(self._buf[:_CHUNK]))
            del self._buf[:_CHUNK]
        return len(data)

    def _submit(self, chunk: bytes) -> None:
        self._empty = False
        self._pending.append(self._pool.submit(gzip_member, chunk))
        while len(self._pending) > self._limit:
            self._raw.write(self._pending.popleft().result())

    def close(self) -> None:
        try:
            if self._buf or self._empty:
                self._submit(bytes(self._buf))
                self._buf.clear()
            while self._pending:
                self._raw.write(self._pending.popleft().result())
        finally:
            self._pool.shutdown(wait=True, cancel_futures=True)


class _HashingFile:
    def __init__(self, f):
        self.f = f
        self.h = hashlib.sha256()

    def write(self, data) -> int:
        self.h.update(data)
        return self.f.write(data)

    def flush(self) -> None:
        self.f.flush()


class _BlobReader:
    """``git cat-file --batch`` for one mirror, fed in advance with the blobs in read order."""

    def __init__(self, m: Mirror, shas: list[str]):
        self.proc = run_mod.popen(["git", "--git-dir", str(m.path), "cat-file", "--batch"])
        self.mirror = m
        self._t = threading.Thread(target=self._feed, args=(shas,), daemon=True)
        self._t.start()

    def _feed(self, shas: list[str]) -> None:
        try:
            for i in range(0, len(shas), 512):
                self.proc.stdin.write("".join(s + "\n" for s in shas[i:i + 512]).encode())
            self.proc.stdin.close()
        except (BrokenPipeError, OSError):
            pass

    def header(self, sha: str) -> int:
        line = self.proc.stdout.readline().decode().split()
        if len(line) != 3 or line[0] != sha:
            raise OperationFailed(f"object {sha} is missing from {self.mirror.path.name}: {' '.join(line)}",
                                  hint="run prefetch again (without --offline) to fetch it")
        return int(line[2])

    def finish_blob(self) -> None:
        self.proc.stdout.read(1)  # the newline after the content

    def close(self) -> None:
        self._t.join()
        run_mod.check_popen(self.proc)


def pack(entries: list[Entry], dest: Path, mtime: int) -> str:
    """Write the archive of ``entries`` to ``dest`` atomically; return its SHA-256."""
    check_deflate()
    # folders: every parent of every entry
    dirs = sorted({str(Path(e.path).parent.as_posix()) for e in entries} - {"."})
    alldirs: set[str] = set()
    for d in dirs:
        parts = d.split("/")
        for i in range(1, len(parts) + 1):
            alldirs.add("/".join(parts[:i]))
    def key(path: str) -> tuple[bytes, ...]:
        return tuple(path.encode("utf-8", "surrogateescape").split(b"/"))

    # sorted like `tar --sort=name`: by name within each folder, a folder right before what it holds
    items: list[tuple[tuple, str, Entry | None]] = [(key(d), d, None) for d in alldirs]
    items += [(key(e.path), e.path, e) for e in entries]
    items.sort(key=lambda t: t[0])

    readers: dict[int, _BlobReader] = {}
    by_repo: dict[int, list[str]] = {}
    for _k, _n, e in items:  # each reader is fed its blobs in the order the archive takes them
        if e is not None:
            by_repo.setdefault(id(e.repo), []).append(e.sha)
    for e in entries:
        if id(e.repo) not in readers:
            readers[id(e.repo)] = _BlobReader(e.repo, by_repo[id(e.repo)])

    def members():
        for _key, name, e in items:
            if e is None:
                yield name, tarfile.DIRTYPE, 0o755, "", b""
                continue
            rd = readers[id(e.repo)]
            size = rd.header(e.sha)
            data = rd.proc.stdout.read(size)
            rd.finish_blob()
            if len(data) != size:
                raise OperationFailed(f"short read of object {e.sha} from {rd.mirror.path.name}")
            if e.mode == "120000":
                yield name, tarfile.SYMTYPE, 0o777, data.decode("utf-8", "surrogateescape"), b""
            else:
                yield name, tarfile.REGTYPE, 0o755 if e.mode == "100755" else 0o644, "", data

    def close_readers():  # before the archive is committed: a reader's failure fails the pack
        for rd in readers.values():
            rd.close()

    try:
        return _write_archive(dest, mtime, members(), before_commit=close_readers)
    except BaseException:
        for rd in readers.values():
            if rd.proc.poll() is None:
                rd.proc.kill()
                rd.proc.wait()
        raise


def _write_archive(dest: Path, mtime: int, members, *, before_commit=None) -> str:
    """Write ``members`` ((name, tar type, mode, link target, bytes), in archive order) to ``dest``
    atomically, in the one layout both packers share: GNU headers, owner 0 without names, ``mtime``,
    the deterministic gzip members, zeros up to a full record; return the archive's SHA-256."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        with open(tmp, "wb") as raw:
            hf = _HashingFile(raw)
            sink = _GzipSink(hf)
            written = 0
            for name, kind, mode, linkname, data in members:
                ti = tarfile.TarInfo("./" + name)
                ti.mtime = mtime
                ti.uid = ti.gid = 0
                ti.uname = ti.gname = ""
                ti.type, ti.mode, ti.linkname = kind, mode, linkname
                if kind == tarfile.REGTYPE:
                    ti.size = len(data)
                header = ti.tobuf(tarfile.GNU_FORMAT, "utf-8", "surrogateescape")
                sink.write(header)
                written += len(header)
                if data:
                    pad = -len(data) % tarfile.BLOCKSIZE
                    sink.write(data)
                    sink.write(b"\0" * pad)
                    written += len(data) + pad
            # end of archive: two zero blocks, then zeros up to a full record (as tar does)
            end = 2 * tarfile.BLOCKSIZE
            end += -(written + end) % tarfile.RECORDSIZE
            sink.write(b"\0" * end)
            sink.close()
            raw.flush()
            os.fsync(raw.fileno())
        if before_commit is not None:
            before_commit()
        os.chmod(tmp, 0o644)
        os.replace(tmp, dest)
        return hf.h.hexdigest()
    except BaseException:
        try:
            tmp.unlink()
        except FileNotFoundError:
            pass
        raise


def pack_dir(root: Path, dest: Path, mtime: int) -> str:
    """Write a folder's files (not ``root`` itself) to ``dest`` atomically, in the same layout as
    ``pack`` (sorted names, ``mtime``, owner 0, modes 0644/0755 by the owner's execute bit, symlinks
    as symlinks, the same gzip members); return its SHA-256. For files that are not in git (the
    crates ``cargo vendor`` writes): their bytes and names decide the archive, nothing else."""
    check_deflate()
    items: list[tuple[tuple[bytes, ...], str, Path]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        base = Path(dirpath)
        for n in dirnames + filenames:
            p = base / n
            rel = p.relative_to(root).as_posix()
            if not (p.is_symlink() or p.is_dir() or p.is_file()):
                raise OperationFailed(f"{p}: not a file, folder or symlink; cannot pack it")
            items.append((tuple(rel.encode("utf-8", "surrogateescape").split(b"/")), rel, p))
    items.sort(key=lambda t: t[0])

    def members():
        for _key, name, p in items:
            if p.is_symlink():
                yield name, tarfile.SYMTYPE, 0o777, os.readlink(p), b""
            elif p.is_dir():
                yield name, tarfile.DIRTYPE, 0o755, "", b""
            else:
                yield name, tarfile.REGTYPE, 0o755 if os.stat(p).st_mode & 0o100 else 0o644, "", p.read_bytes()

    return _write_archive(dest, mtime, members())
