"""Small file-system helpers: atomic writes, bounded reads of regular files only, content digests."""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

from imagebuild.core import lazy

# imported on first use: `list` and `validate` need none of them (docs/cli.md, "Start-up time")
hashlib = lazy.module("hashlib")
json = lazy.module("json")
tempfile = lazy.module("tempfile")

_CHUNK = 1 << 20


def atomic_write_bytes(path: Path, data: bytes, mode: int = 0o644) -> None:
    """Write ``data`` to ``path`` via a temp file in the same folder and a rename.

    A reader sees the old file or the new one, never a half-written one; a crash leaves at most
    a ``.tmp`` file that nothing accepts.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def atomic_write_text(path: Path, text: str, mode: int = 0o644) -> None:
    atomic_write_bytes(path, text.encode("utf-8"), mode)


def atomic_write_json(path: Path, obj: object) -> None:
    """Write ``obj`` as stable, sorted, indented JSON (no timestamps added)."""
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


# ------------------------------------------------------------------------------------------ reading

# the bound of a state file read whole when its reader names none (a receipt, a lock, a record, a report)
READ_MAX = 16 << 20


class UnfitFile(OSError):
    """A file imagebuild does not read: not a regular file (a FIFO, whose read waits for a writer; a
    device such as /dev/zero, whose read never ends; a socket; a folder), or bigger than its bound.
    An ``OSError``, so that a reader that takes an unreadable file as absent or bad does so here too;
    ``strerror`` says why, for a message (docs/security.md, "hang or exhaust memory on an input")."""


@contextlib.contextmanager
def held(path: Path) -> Iterator[None]:
    """An exclusive flock on ``path`` (created when missing) for the ``with`` block: who else takes it
    waits until the block ends."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def special_kind(mode: int) -> str | None:
    """What a file of ``mode`` is when it is not a regular file (``'a FIFO'``...), else None."""
    import stat

    if stat.S_ISREG(mode):
        return None
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISBLK(mode) or stat.S_ISCHR(mode):
        return "a device"
    if stat.S_ISDIR(mode):
        return "a folder"
    return "not a regular file"


def read_bytes(path: str | os.PathLike, limit: int = READ_MAX) -> bytes:
    """The bytes of ``path`` (links followed), only if it is a regular file of at most ``limit`` bytes;
    else ``UnfitFile``. Opened without blocking (a FIFO's open waits for a writer otherwise) and checked
    on the open file, so a file swapped in between cannot get past; read no further than the bound
    (a file that grows while it is read)."""
    import errno

    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        kind = special_kind(st.st_mode)
        if kind is not None:
            raise UnfitFile(errno.EINVAL, f"{kind}, not a regular file: not read", str(path))
        if st.st_size > limit:
            raise UnfitFile(errno.EFBIG, f"{st.st_size} bytes, over the {limit}-byte bound: not read", str(path))
        chunks, n = [], 0
        while n <= limit and (chunk := os.read(fd, min(_CHUNK, limit + 1 - n))):
            chunks.append(chunk)
            n += len(chunk)
        if n > limit:
            raise UnfitFile(errno.EFBIG, f"over the {limit}-byte bound: not read", str(path))
        return b"".join(chunks)
    finally:
        os.close(fd)


def read_text(path: str | os.PathLike, limit: int = READ_MAX, *, errors: str = "strict") -> str:
    """``read_bytes`` as UTF-8 text (``errors`` as for ``bytes.decode``)."""
    return read_bytes(path, limit).decode("utf-8", errors)


def sha256_bytes(data: bytes) -> str:
    h = hashlib.sha256()
    h.update(data)
    return h.hexdigest()


def sha256_file(path: Path) -> str:
    with open(path, "rb") as f:
        h = hashlib.sha256()
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def sha256_tree(path: Path) -> str:
    """Digest of a file, or of a folder's files: relative names, modes (x bit) and contents.

    Independent of mtimes, owners and the folder's location, so the same content gives the
    same digest on every machine.
    """
    path = Path(path)
    if path.is_file():
        return sha256_bytes(f"F . {_xbit(path)} {sha256_file(path)}\n".encode())
    h = hashlib.sha256()  # a line per file
    for root, dirs, files in os.walk(path):
        dirs.sort()
        for name in sorted(files):
            full = Path(root) / name
            rel = full.relative_to(path).as_posix()
            # a name that is not UTF-8 is hashed as its bytes (os.fsencode), never an internal error
            if full.is_symlink():
                h.update(os.fsencode(f"L {rel} {os.readlink(full)}\n"))
                continue
            h.update(os.fsencode(f"F {rel} {_xbit(full)} {sha256_file(full)}\n"))
    return h.hexdigest()


def _xbit(path: Path) -> str:
    return "x" if os.stat(path).st_mode & 0o111 else "-"


def is_loop(path: Path) -> bool:
    """Whether ``path`` is a symbolic link that never ends in a file (a loop, or too many links)."""
    try:
        Path(path).resolve(strict=True)
    except RuntimeError:  # Python before 3.13
        return True
    except OSError as exc:
        import errno

        return exc.errno == errno.ELOOP
    return False


def inside(path: Path, folder: Path) -> bool:
    """Whether ``path``, symlinks followed, is in ``folder`` (also resolved): a link may point
    within the folder, never out of it."""
    try:
        real, top = Path(path).resolve(), Path(folder).resolve()
    except (OSError, RuntimeError):  # RuntimeError: a symlink loop (Python before 3.13)
        return False
    return top in real.parents


def canonical_json(obj: object) -> bytes:
    """The one serialisation that keys are hashed over."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def usable_dir(path: Path, what: str, *, hint: str | None = None, create: bool = True) -> Path:
    """``path`` as a folder this process can write in, made if missing; else a UsageError (exit 2)
    naming ``what`` (the setting it came from, e.g. ``IMAGEBUILD_STATE_DIR``) and why. ``create``
    False (a dry run): nothing is made; a missing folder is checked as its nearest existing parent,
    which must be a folder this process can write in."""
    from imagebuild.core.errors import UsageError

    path = orig = Path(path)
    if not create:
        top = path
        while not os.path.lexists(top) and top != top.parent:
            top = top.parent
        if top != path:
            if not top.is_dir():
                raise UsageError(f"{what}: cannot make the folder {path}: {top} is not a folder", hint=hint)
            path = top
    try:
        if create:
            path.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise UsageError(f"{what}: {path} is not a folder", hint=hint) from None
    except OSError as exc:
        raise UsageError(f"{what}: cannot make the folder {path}: {exc.strerror or exc}", hint=hint) from None
    if not path.is_dir():
        raise UsageError(f"{what}: {path} is not a folder", hint=hint)
    try:  # a real probe: root passes os.access() where nothing can be created (/proc, a read-only mount)
        fd, probe = tempfile.mkstemp(prefix=".imagebuild-probe.", dir=path)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        made = "" if path == orig else f"cannot make the folder {orig}: "
        raise UsageError(f"{what}: {made}cannot write in {path}: {exc.strerror or exc}", hint=hint) from None
    return orig


def check_output_file(path: str | Path, flag: str) -> Path:
    """The file a flag names for writing (``bundle -o``, ``gate --junit``), checked before any work:
    not empty, not an existing folder or device (a rename would replace it), in a folder that can
    be made and written. A UsageError (exit 2) names the flag otherwise."""
    from imagebuild.core.errors import UsageError

    if not str(path).strip():
        raise UsageError(f"{flag}: expected a file name, got an empty one")
    p = Path(os.path.abspath(path))
    if p.is_dir():
        raise UsageError(f"{flag} {path}: is a folder: expected a file name")
    if p.exists() and not p.is_file():
        raise UsageError(f"{flag} {path}: exists and is not a regular file (a device, socket or pipe): "
                         "refusing to replace it")
    usable_dir(p.parent, f"{flag} {path}")
    return p
