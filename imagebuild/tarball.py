"""Deterministic tar.gz of a git tree (plus its submodules), straight from the object store.

The archive holds the tree's files with names relative to the source root (``./CMakeLists.txt``,
no top folder), directories included, entries sorted by name, every entry with the same mtime
(the composed commit's time), uid/gid 0, empty user and group names, modes 0644/0755 (files by
their git executable bit, folders 0755) and symlinks as symlinks. GNU tar format; gzip with no
file name and mtime 0 at level 6. The same tree gives the same bytes on every machine.

Blobs stream from ``git cat-file --batch`` (one process per repository), and compression runs in
a second thread (zlib releases the GIL), so packing keeps pace with ``tar | gzip -n``.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import queue
import tarfile
import threading
from dataclasses import dataclass
from pathlib import Path

from . import run as run_mod
from .errors import OperationFailed
from .gitcache import Mirror

LEVEL = 6
_CHUNK = 1 << 20


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


class _GzipSink:
    """A file-like object: bytes in, gzip (mtime 0, no name) out to ``raw`` from a worker thread."""

    def __init__(self, raw):
        self._raw = raw
        self._buf = bytearray()
        self._q: queue.Queue = queue.Queue(maxsize=8)
        self._err: BaseException | None = None
        self._gz = gzip.GzipFile(filename="", mode="wb", compresslevel=LEVEL, fileobj=raw, mtime=0)
        self._t = threading.Thread(target=self._work, daemon=True)
        self._t.start()

    def _work(self) -> None:
        try:
            while True:
                chunk = self._q.get()
                if chunk is None:
                    break
                self._gz.write(chunk)
            self._gz.close()
        except BaseException as exc:  # noqa: BLE001 - handed to the writer thread
            self._err = exc
            while self._q.get() is not None:
                pass

    def write(self, data) -> int:
        self._buf += data
        if len(self._buf) >= _CHUNK:
            self._q.put(bytes(self._buf))
            self._buf.clear()
        return len(data)

    def close(self) -> None:
        if self._buf:
            self._q.put(bytes(self._buf))
            self._buf.clear()
        self._q.put(None)
        self._t.join()
        if self._err:
            raise self._err


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
    entries = sorted(entries, key=lambda e: e.path.encode("utf-8", "surrogateescape"))
    # folders: every parent of every entry
    dirs = sorted({str(Path(e.path).parent.as_posix()) for e in entries} - {"."})
    alldirs: set[str] = set()
    for d in dirs:
        parts = d.split("/")
        for i in range(1, len(parts) + 1):
            alldirs.add("/".join(parts[:i]))
    items: list[tuple[bytes, str, Entry | None]] = [(d.encode("utf-8", "surrogateescape") + b"/", d, None)
                                                    for d in alldirs]
    items += [(e.path.encode("utf-8", "surrogateescape"), e.path, e) for e in entries]
    # sort by name, a folder before what it holds ("a/" sorts right before "a/x")
    items.sort(key=lambda t: t[0])

    readers: dict[int, _BlobReader] = {}
    by_repo: dict[int, list[str]] = {}
    for e in entries:
        by_repo.setdefault(id(e.repo), []).append(e.sha)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        for e in entries:
            if id(e.repo) not in readers:
                readers[id(e.repo)] = _BlobReader(e.repo, by_repo[id(e.repo)])
        with open(tmp, "wb") as raw:
            hf = _HashingFile(raw)
            sink = _GzipSink(hf)
            with tarfile.open(fileobj=sink, mode="w|", format=tarfile.GNU_FORMAT) as tar:
                for _key, name, e in items:
                    ti = tarfile.TarInfo("./" + name)
                    ti.mtime = mtime
                    ti.uid = ti.gid = 0
                    ti.uname = ti.gname = ""
                    if e is None:
                        ti.type = tarfile.DIRTYPE
                        ti.mode = 0o755
                        tar.addfile(ti)
                        continue
                    rd = readers[id(e.repo)]
                    size = rd.header(e.sha)
                    if e.mode == "120000":
                        ti.type = tarfile.SYMTYPE
                        ti.mode = 0o777
                        ti.linkname = rd.proc.stdout.read(size).decode("utf-8", "surrogateescape")
                        rd.finish_blob()
                        tar.addfile(ti)
                        continue
                    ti.mode = 0o755 if e.mode == "100755" else 0o644
                    ti.size = size
                    tar.addfile(ti, _Exact(rd.proc.stdout, size))
                    rd.finish_blob()
            sink.close()
            raw.flush()
            os.fsync(raw.fileno())
        for rd in readers.values():
            rd.close()
        os.chmod(tmp, 0o644)
        os.replace(tmp, dest)
        return hf.h.hexdigest()
    except BaseException:
        for rd in readers.values():
            if rd.proc.poll() is None:
                rd.proc.kill()
                rd.proc.wait()
        try:
            tmp.unlink()
        except FileNotFoundError:
            pass
        raise


class _Exact(io.RawIOBase):
    """Read at most ``size`` bytes from ``f`` (tarfile copies exactly ti.size bytes)."""

    def __init__(self, f, size: int):
        self.f, self.left = f, size

    def read(self, n: int = -1) -> bytes:
        if self.left <= 0:
            return b""
        n = self.left if n is None or n < 0 else min(n, self.left)
        data = self.f.read(n)
        self.left -= len(data)
        return data

    def readable(self) -> bool:
        return True
