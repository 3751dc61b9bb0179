"""A stage's build context as one deterministic stream: the key hashes exactly what BuildKit gets.

The context of a stage is its declared inputs (``files:``, ``patches:``, the patch primitive) at
their context paths. Instead of hashing the inputs beside what is copied (which once left file
modes, empty folders and folder links out of the key while they reached the image), the plan
writes the context as a normalized tar and hashes those bytes; the build writes the same stream,
checks its digest against the plan's, and extracts it as the context folder BuildKit reads. What is
sent is what is hashed.

The stream holds, in a fixed order (by path, parents first):

- folders (also empty ones), mode 0755;
- regular files, mode 0755 when any x bit is set, else 0644 (a clone made under ``umask 077``
  gives the same stream and the same image);
- symbolic links inside a folder input, with their target as written (to a file or a folder);
- every entry owned by 0:0 with no user or group name, mtime ``SOURCE_DATE_EPOCH``.

Any other file type (a FIFO, a socket, a device) is a definition error naming it: a context holds
files, folders and links only (and a FIFO would hang the read). A top-level input that is a link
is read as the file it names (its containment was checked when the definition was read).
"""

from __future__ import annotations

import hashlib
import os
import stat
import tarfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from imagebuild.core.errors import DefinitionError, Problem, excerpt

FORMAT = "imagebuild-context-1"  # what decides the stream's bytes; part of every stage key
DIR_MODE, FILE_MODE, EXEC_MODE, LINK_MODE = 0o755, 0o644, 0o755, 0o777


@dataclass(frozen=True)
class Entry:
    name: str  # path in the context
    kind: str  # "dir", "file", "link"
    mode: int
    source: Path | None = None  # the file whose bytes it holds
    target: str = ""  # a link's target


def _mode(st: os.stat_result) -> int:
    return EXEC_MODE if st.st_mode & 0o111 else FILE_MODE


def _refuse(path: Path, display: str) -> DefinitionError:
    st = os.lstat(path)
    what = ("a FIFO" if stat.S_ISFIFO(st.st_mode) else "a socket" if stat.S_ISSOCK(st.st_mode)
            else "a device" if stat.S_ISBLK(st.st_mode) or stat.S_ISCHR(st.st_mode) else "not a regular file")
    return DefinitionError([Problem(display, f"is {what}: a build context holds files, folders and symbolic "
                                             "links only", hint="remove it from the declared files")])


def entries(inputs: Iterable[tuple[Path, str, str]]) -> list[Entry]:
    """Every entry of the context of ``inputs`` ((path on disk, context path, how errors name it)), in
    stream order."""
    out: dict[str, Entry] = {}

    def add_parents(name: str) -> None:
        for parent in reversed(PurePosixPath(name).parents):
            p = str(parent)
            if p != "." and p not in out:
                out[p] = Entry(p, "dir", DIR_MODE)

    for path, cpath, display in inputs:
        cpath = str(PurePosixPath(cpath))
        add_parents(cpath)
        if path.is_dir():
            out[cpath] = Entry(cpath, "dir", DIR_MODE)
            for dirpath, dirnames, filenames in os.walk(path):
                dirnames.sort()
                base = Path(dirpath)
                rel_base = PurePosixPath(cpath) / base.relative_to(path).as_posix()
                for n in sorted(dirnames + filenames):
                    full = base / n
                    name = str(rel_base / n)
                    try:
                        name.encode("utf-8")
                    except UnicodeEncodeError:
                        raise DefinitionError([Problem(f"{display}/{excerpt(full.relative_to(path).as_posix())}",
                                                       "has a name that is not UTF-8: a build context holds "
                                                       "UTF-8 names only", hint="rename it")]) from None
                    st = os.lstat(full)
                    if stat.S_ISLNK(st.st_mode):
                        out[name] = Entry(name, "link", LINK_MODE, target=os.readlink(full))
                        if n in dirnames:
                            dirnames.remove(n)  # a folder link is an entry, not walked into
                    elif stat.S_ISDIR(st.st_mode):
                        out[name] = Entry(name, "dir", DIR_MODE)
                    elif stat.S_ISREG(st.st_mode):
                        out[name] = Entry(name, "file", _mode(st), source=full)
                    else:
                        raise _refuse(full, f"{display}/{full.relative_to(path).as_posix()}")
        else:
            try:
                st = os.stat(path)
            except FileNotFoundError:
                raise DefinitionError([Problem(display, "declared as a stage input, but not there")]) from None
            if not stat.S_ISREG(st.st_mode):
                raise _refuse(path, display)
            out[cpath] = Entry(cpath, "file", _mode(st), source=path)
    return [out[k] for k in sorted(out, key=lambda n: n.split("/"))]


def _tarinfo(e: Entry, epoch: int) -> tarfile.TarInfo:
    ti = tarfile.TarInfo(e.name)
    ti.mode, ti.mtime, ti.uid, ti.gid, ti.uname, ti.gname = e.mode, epoch, 0, 0, "", ""
    if e.kind == "dir":
        ti.type = tarfile.DIRTYPE
    elif e.kind == "link":
        ti.type, ti.linkname = tarfile.SYMTYPE, e.target
    else:
        ti.type, ti.size = tarfile.REGTYPE, os.stat(e.source).st_size
    return ti


class _Hashing:
    """A write-only stream that hashes what passes (and passes it on, when given a file)."""

    def __init__(self, out=None):
        self.h, self.out, self.size = hashlib.sha256(), out, 0

    def write(self, data) -> int:
        self.h.update(data)
        self.size += len(data)
        if self.out is not None:
            self.out.write(data)
        return len(data)

    def tell(self) -> int:
        return self.size


def write(ents: list[Entry], epoch: int, out=None) -> str:
    """Write the stream of ``ents`` (to ``out``, or only hash it); returns ``sha256:<hex>``."""
    sink = _Hashing(out)
    with tarfile.open(fileobj=sink, mode="w|", format=tarfile.PAX_FORMAT) as tf:
        for e in ents:
            ti = _tarinfo(e, epoch)
            if e.kind == "file":
                with open(e.source, "rb") as f:
                    tf.addfile(ti, f)
            else:
                tf.addfile(ti)
    return "sha256:" + sink.h.hexdigest()


def digest(inputs: Iterable[tuple[Path, str, str]], epoch: int) -> str:
    return write(entries(inputs), epoch)


def names(ents: Iterable[Entry]) -> Iterator[str]:
    return (e.name for e in ents)
