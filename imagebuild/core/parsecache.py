"""The pure parsers' results, kept between runs, found by the digest of exactly what they read.

Reading a definition parses YAML (PyYAML), validates the gate spec (packaging, for version
specifiers, and ``re``, for every pattern it holds), parses each Dockerfile and compiles each patch
script. Each of these is a pure function of one text, and together, with the imports they need,
they were more than half of what ``list``, ``validate`` and ``plan`` cost (docs/cli.md, "Start-up
time"). ``cached(kind, parts, compute)`` returns ``compute()``'s result for the same text from an
earlier run; everything that looks at the file system or relates one file to another (paths,
permissions, pins, stage order) runs every time, so a cached entry can never hide a change.

What a result is found by (the entry's name is the BLAKE2b digest of all of it):
- the parser's kind and every argument it takes, the text included, byte for byte;
- the code that produced it: the Python version, and the size and mtime of every module of this
  package and of the libraries the parsers use (PyYAML, packaging), so an upgrade or an edit of
  a parser misses every entry made before it (size and mtime are what Python's own bytecode
  cache trusts for the same question).

Only results are kept: a text that fails to parse raises its error, and nothing is stored, so an
error is always reported from a fresh parse. Within ``batch()`` (``definition.load``), nothing is
stored unless the whole definition reads without a problem. An entry is the digest of its payload plus the
payload (marshal data; records are rebuilt only as this package's classes); one whose digest does
not match is ignored and replaced. Entries are written with a temp file and a rename, and never
read from a folder that another user could write to.

Where: ``$IMAGEBUILD_PARSE_CACHE``, else ``$XDG_CACHE_HOME/imagebuild/parse`` (``~/.cache/...``);
``IMAGEBUILD_PARSE_CACHE=off`` turns it off. It lives outside the project, so read-only commands
still write nothing under it. ``imagebuild gc`` removes entries not written for 30 days.
"""

from __future__ import annotations

import _thread
import marshal
import os
import sys
from collections.abc import Callable
from pathlib import Path, PurePosixPath

try:  # the interpreter's own BLAKE2: hashlib would first load OpenSSL (~3-8 ms at every start)
    from _blake2 import blake2b
except ImportError:  # pragma: no cover (a Python built without it)
    from hashlib import blake2b

FORMAT = b"imagebuild-parsecache-2"
OFF_VALUES = ("off", "0", "no", "false")
MAX_AGE_S = 30 * 86400  # gc removes entries older than this (docs/cli.md, "gc")
_DIGEST_SIZE = 32
# the libraries whose code decides a parser's result, by a file that changes with each release
_LIBRARY_FILES = (("yaml", "__init__.py"), ("packaging", "specifiers.py"), ("packaging", "version.py"))

_state: dict[str, object] = {}  # per process: the folder (or None), the code tag


def folder() -> Path | None:
    """The cache folder, or None when turned off."""
    value = os.environ.get("IMAGEBUILD_PARSE_CACHE")
    if value is not None and value.strip().lower() in OFF_VALUES:
        return None
    if value:
        return Path(value).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(xdg) / "imagebuild" / "parse"


def _usable_folder() -> Path | None:
    """The folder, when it is ours and nobody else can write to it."""
    if "dir" in _state:
        return _state["dir"]  # type: ignore[return-value]
    d = folder()
    if d is not None:
        try:
            st = os.stat(d)
        except FileNotFoundError:
            st = None
        except OSError:
            d = None
        else:
            if st.st_uid != os.getuid() or st.st_mode & 0o022:
                d = None
    _state["dir"] = d
    return d


def code_tag() -> bytes:
    """What the parsers' results depend on besides their input: this package's code, the
    libraries' code and the Python version (size and mtime of each file; a few stat calls)."""
    tag = _state.get("tag")
    if tag is None:
        h = blake2b(FORMAT + b"\0" + sys.version.encode(), digest_size=_DIGEST_SIZE)
        package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        for folder, dirs, names in sorted(os.walk(package)):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__")
            for name in sorted(names):
                if name.endswith(".py"):
                    _stat_into(h, os.path.join(folder, name))
        for package, name in _LIBRARY_FILES:
            _stat_into(h, _library_file(package, name))
        tag = _state["tag"] = h.digest()
    return tag  # type: ignore[return-value]


def _library_file(package: str, name: str) -> str | None:
    """Where ``import package`` would find ``name``, without importing it (sys.path order)."""
    for entry in sys.path:
        path = os.path.join(entry or ".", package, name)
        if os.path.isfile(path):
            return path
    return None


def _stat_into(h, path: str | None) -> None:
    if path is None:
        h.update(b"-\0")
        return
    st = os.stat(path)
    h.update(f"{path}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())


def key(kind: str, parts: tuple[str | bytes, ...]) -> str:
    """The entry's name for the parser ``kind`` given ``parts`` (each argument, the text included)."""
    h = blake2b(code_tag(), digest_size=_DIGEST_SIZE)
    h.update(kind.encode() + b"\0")
    for p in parts:
        b = p.encode("utf-8", "surrogatepass") if isinstance(p, str) else p
        h.update(len(b).to_bytes(8, "big"))
        h.update(b)
    return h.hexdigest()


def cached(kind: str, parts: tuple[str | bytes, ...], compute: Callable[[], object]):
    """``compute()``, or the result it gave an earlier run for the same ``kind`` and ``parts``.

    ``compute`` must be a pure function of ``parts``; an exception from it propagates and stores
    nothing."""
    d = _usable_folder()
    if d is None:
        return compute()
    path = d / key(kind, parts)
    found = _read(path)
    if found is not None:
        return found[0]
    value = compute()
    pending = getattr(_local, "batches", None)
    if pending:
        pending[-1].append((d, path, value))
    else:
        _write(d, path, value)
    return value


class batch:
    """``with parsecache.batch():`` entries computed inside are written when the block ends without
    an exception, and dropped when it raises: reading a definition with a problem leaves the cache
    as it was (definition.load). Nested batches write with the outermost one; per thread."""

    def __enter__(self):
        if not hasattr(_local, "batches"):
            _local.batches = []
        _local.batches.append([])
        return self

    def __exit__(self, exc_type, exc, tb):
        pending = _local.batches.pop()
        if exc_type is None:
            if _local.batches:
                _local.batches[-1].extend(pending)
            else:
                for d, path, value in pending:
                    _write(d, path, value)
        return False


_local = _thread._local()  # threading.local, without importing threading (~2 ms)


def _read(path: Path) -> tuple[object] | None:
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError:
        return None
    digest, payload = data[:_DIGEST_SIZE], data[_DIGEST_SIZE:]
    if len(digest) != _DIGEST_SIZE or blake2b(payload, digest_size=_DIGEST_SIZE).digest() != digest:
        return None  # torn or tampered: parse afresh and replace it
    try:
        return (_decode(marshal.loads(payload)),)
    except Exception:  # noqa: BLE001 (a record that changed shape, an old format: a miss, never an error)
        return None


def _write(d: Path, path: Path, value: object) -> None:
    try:
        payload = marshal.dumps(_encode(value))
    except (TypeError, ValueError):  # something the encoding does not hold: keep computing it
        return
    data = blake2b(payload, digest_size=_DIGEST_SIZE).digest() + payload
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        if not d.is_dir():
            os.makedirs(d, mode=0o700, exist_ok=True)
            _state.pop("dir", None)
            if _usable_folder() is None:
                return
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, data)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError:  # a full disk or a read-only home: the parse still worked
        try:
            os.unlink(tmp)
        except OSError:
            pass


def stale_entries(now: float | None = None) -> list[tuple[Path, int]]:
    """Entries (path, size) not written for MAX_AGE_S, and temp files of killed writers: what gc
    removes."""
    import time

    d = folder()
    if d is None or not d.is_dir():
        return []
    now = time.time() if now is None else now
    out = []
    for p in sorted(d.iterdir()):
        try:
            st = p.lstat()
        except OSError:
            continue
        if now - st.st_mtime > (3600 if p.name.endswith(".tmp") else MAX_AGE_S):
            out.append((p, st.st_size))
    return out


# --------------------------------------------------------------------------------------------- encoding
# An entry is marshal data (the interpreter's own format: nothing to import, ~4 ms less than pickle
# at each start, and it cannot run code). marshal holds None, bool, int, float, str, bytes, list
# and dict; a tuple is the tag of anything else. A record is rebuilt only as a class of this
# package (imagebuild.records.dataclass), never any other.

_TUPLE, _RECORD, _PATH, _PURE = "t", "r", "p", "q"


def _encode(v):
    if v is None or isinstance(v, (bool, int, float, str, bytes)):
        return v
    if isinstance(v, list):
        return [_encode(x) for x in v]
    if isinstance(v, tuple):
        return (_TUPLE, [_encode(x) for x in v])
    if isinstance(v, dict):
        if not all(isinstance(k, str) for k in v):
            raise TypeError("dict keys must be strings")
        return {k: _encode(x) for k, x in v.items()}
    if isinstance(v, Path):
        return (_PATH, str(v))
    if isinstance(v, PurePosixPath):
        return (_PURE, str(v))
    cls = type(v)
    names = getattr(cls, "__record_fields__", None)
    if names is None or not cls.__module__.startswith("imagebuild."):
        raise TypeError(f"cannot keep a {cls.__qualname__}")
    return (_RECORD, f"{cls.__module__}:{cls.__qualname__}", {n: _encode(v.__dict__[n]) for n in names})


def _decode(v):
    if isinstance(v, list):
        return [_decode(x) for x in v]
    if isinstance(v, dict):
        return {k: _decode(x) for k, x in v.items()}
    if not isinstance(v, tuple):
        return v
    tag = v[0]
    if tag == _TUPLE:
        return tuple(_decode(x) for x in v[1])
    if tag == _PATH:
        return Path(v[1])
    if tag == _PURE:
        return PurePosixPath(v[1])
    if tag == _RECORD:
        module, _, qualname = v[1].partition(":")
        if not module.startswith("imagebuild."):
            raise ValueError(f"not a record of this package: {v[1]}")
        import importlib

        cls = importlib.import_module(module)
        for part in qualname.split("."):
            cls = getattr(cls, part)
        names = cls.__record_fields__
        if set(names) != set(v[2]):
            raise ValueError(f"{v[1]} changed shape")
        obj = cls.__new__(cls)
        obj.__dict__.update({n: _decode(x) for n, x in v[2].items()})
        return obj
    raise ValueError(f"unknown tag {tag!r}")

