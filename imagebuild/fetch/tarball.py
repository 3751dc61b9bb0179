"""Deterministic tar of a git tree (plus its submodules), straight from the object store.

The archive holds the tree's files with names relative to the source root (``./CMakeLists.txt``,
no top folder), directories included, entries sorted by name within each folder (the order of
``tar --sort=name``), every entry with the same mtime
(the composed commit's time), uid/gid 0, empty user and group names, modes 0644/0755 (files by
their git executable bit, folders 0755) and symlinks as symlinks. GNU tar format, ended by two zero
blocks and padded with zeros to a full 10240-byte record.

Not compressed (FORMAT 2; FORMAT 1 was the same tar in gzip members): the bytes, hence the lock's
sha256 and every stage key, depend only on this writer, not on the machine's deflate (a Python
linked with zlib-ng, as on Fedora 40+ or in some standalone builds, wrote other gzip bytes and
could not prefetch at all), and deflate was about 45 % of a cold prefetch's CPU. The tarballs are
about 2.7x larger on disk (the vLLM tree: 76.7 MB, 28.9 MB gzipped); the build reads them through a
local bind mount (docs/prefetch.md, "Tarballs").

Blobs stream from ``git cat-file --batch`` (one process per repository) straight into the file.
"""

from __future__ import annotations

import hashlib
import os
import tarfile
import threading
from dataclasses import dataclass
from pathlib import Path

from imagebuild.core import run as run_mod
from imagebuild.core.errors import OperationFailed
from imagebuild.fetch.gitcache import Mirror

FORMAT = 2  # raise when the archive layout changes: the lock records it, a tarball of another format is repacked
SUFFIX = ".tar"  # of the files pack and pack_dir write (FORMAT 1's were .tar.gz)
_BUF = 1 << 20  # bytes gathered before each write to the file


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


class _HashingFile:
    """Bytes in, hashed and written to ``f`` in pieces of about ``_BUF`` (few system calls)."""

    def __init__(self, f):
        self.f = f
        self.h = hashlib.sha256()
        self._buf = bytearray()

    def write(self, data) -> int:
        if len(data) >= _BUF:  # a large blob: as it is, without a copy into the buffer
            self.flush()
            self.h.update(data)
            self.f.write(data)
            return len(data)
        self._buf += data
        if len(self._buf) >= _BUF:
            self.flush()
        return len(data)

    def flush(self) -> None:
        if self._buf:
            self.h.update(self._buf)
            self.f.write(self._buf)
            self._buf.clear()
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
    zeros up to a full record; return the archive's SHA-256."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        with open(tmp, "wb") as raw:
            sink = _HashingFile(raw)
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
            sink.flush()
            os.fsync(raw.fileno())
        if before_commit is not None:
            before_commit()
        os.chmod(tmp, 0o644)
        os.replace(tmp, dest)
        return sink.h.hexdigest()
    except BaseException:
        try:
            tmp.unlink()
        except FileNotFoundError:
            pass
        raise


def pack_dir(root: Path, dest: Path, mtime: int) -> str:
    """Write a folder's files (not ``root`` itself) to ``dest`` atomically, in the same layout as
    ``pack`` (sorted names, ``mtime``, owner 0, modes 0644/0755 by the owner's execute bit, symlinks
    as symlinks); return its SHA-256. For files that are not in git (the crates vendored from a
    Cargo.lock): their bytes and names decide the archive, nothing else."""
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
