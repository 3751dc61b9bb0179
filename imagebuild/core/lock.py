"""The lock file: every resolved input of an image, committed beside its definition.

``docker-images/<image>/lock.json``, written by prefetch, read by plan and build. Its SHA-256
is the build id (``plan.build_id_of``), so it is serialised deterministically (sorted keys,
fixed indentation, no timestamps, no host paths) and written atomically.

    {
      "schema": "imagebuild.lock", "version": 1, "image": "<name>",
      "sources": {NAME: {...}},   # git sources and FetchContent deps (prefetch)
      "images":  {KEY: {...}},    # base images by digest (package prefetch)
      "wheels":  {...}, "apt": {...}
    }

Each section is owned by one step; ``update_sections`` replaces whole sections so steps do not
overwrite each other's data. Within ``batch(image_dir, image)`` (one prefetch run of an image)
the sections are collected in memory and the lock is written **once**, atomically, when the
batch ends without an error; ``read`` sees the pending sections meanwhile, and ``after_write``
callbacks (files that must follow the lock, such as SHA256SUMS) run right after that write. A
run that fails or is interrupted writes no lock at all: the previous one stays as it was.
"""

from __future__ import annotations

import _thread  # threading's RLock itself, without importing threading (start-up time)
import json
from collections.abc import Callable, Iterator
from pathlib import Path

from imagebuild.core import fsutil, lazy
from imagebuild.core.errors import DefinitionError, Problem
from imagebuild.core.fsutil import atomic_write_text

# only prefetch batches and copies locks: `plan` reads one and needs neither (~2 ms of imports)
copy = lazy.module("copy")

LOCK_SCHEMA = "imagebuild.lock"
LOCK_VERSION = 1
LOCK_FILE = "lock.json"


def lock_path(image_dir: Path) -> Path:
    return Path(image_dir) / LOCK_FILE


def serialise(data: dict) -> str:
    return json.dumps(data, indent=2, sort_keys=True, ensure_ascii=True) + "\n"


_batches: dict[Path, dict] = {}
_batch_lock = _thread.RLock()


def _key(image_dir: Path) -> Path:
    return Path(image_dir).resolve()


def batch(image_dir: Path, image: str):
    """Collect every ``update_sections`` of ``image_dir`` and write the lock once at the end (a
    context manager)."""
    from contextlib import contextmanager

    return contextmanager(_batch)(image_dir, image)


def _batch(image_dir: Path, image: str) -> Iterator[None]:
    k = _key(image_dir)
    with _batch_lock:
        if k in _batches:  # nested: the outer batch writes
            yield
            return
        _batches[k] = {"data": None, "image": image, "after": [], "dirty": False, "abort": []}
    try:
        try:
            yield
            with _batch_lock:
                b = _batches[k]
            if b["dirty"]:
                atomic_write_text(lock_path(image_dir), serialise(b["data"]))
        except BaseException:  # the lock was not written: what was made for it goes
            with _batch_lock:
                undo = list(_batches[k]["abort"])
            for fn in undo:
                try:
                    fn()
                except Exception:  # noqa: BLE001 - the first error is the one to report
                    pass
            raise
        for fn in b["after"]:
            fn()
    finally:
        with _batch_lock:
            _batches.pop(k, None)


def after_write(image_dir: Path, fn: Callable[[], None]) -> None:
    """Run ``fn`` once the lock is on disk: at once outside a batch, else after the batch's write."""
    with _batch_lock:
        b = _batches.get(_key(image_dir))
        if b is not None:
            b["after"].append(fn)
            return
    fn()


def on_abort(image_dir: Path, fn: Callable[[], None]) -> None:
    """Run ``fn`` when the batch of ``image_dir`` ends without writing the lock (an error, an interrupt);
    outside a batch the lock is written at once, and ``fn`` is never run."""
    with _batch_lock:
        b = _batches.get(_key(image_dir))
        if b is not None:
            b["abort"].append(fn)


def read(image_dir: Path, display: str | None = None) -> dict | None:
    """The lock as a dict, or None when there is none yet. A malformed lock is a DefinitionError."""
    with _batch_lock:
        b = _batches.get(_key(image_dir))
        if b is not None and b["data"] is not None:
            return copy.deepcopy(b["data"])
    p = lock_path(image_dir)
    shown = display or str(p)
    if not p.exists():
        return None
    try:
        data = json.loads(fsutil.read_text(p))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        line = getattr(exc, "lineno", None)
        raise DefinitionError([Problem(shown, f"unreadable lock file: {exc}", line=line,
                                       hint="re-create it with `imagebuild prefetch`")]) from None
    if not isinstance(data, dict) or data.get("schema") != LOCK_SCHEMA:
        raise DefinitionError([Problem(shown, f"not an imagebuild lock (expected schema {LOCK_SCHEMA!r})",
                                       key="schema")])
    if data.get("version") != LOCK_VERSION:
        raise DefinitionError([Problem(shown, f"lock version {data.get('version')!r} is not supported "
                                       f"(expected {LOCK_VERSION})", key="version",
                                       hint="re-create it with this imagebuild's `prefetch`")])
    return data


def update_sections(image_dir: Path, image: str, sections: dict[str, dict]) -> dict:
    """Replace whole sections of the lock (creating it if needed), atomically. Returns the lock.
    Inside a ``batch`` nothing is written until the batch ends."""
    data = read(image_dir) or {"schema": LOCK_SCHEMA, "version": LOCK_VERSION, "image": image}
    before = serialise(data)
    data.update(sections)
    with _batch_lock:
        b = _batches.get(_key(image_dir))
        if b is not None:
            b["data"] = data
            b["dirty"] = b["dirty"] or serialise(data) != before or not lock_path(image_dir).is_file()
            return copy.deepcopy(data)
    atomic_write_text(lock_path(image_dir), serialise(data))
    return data
