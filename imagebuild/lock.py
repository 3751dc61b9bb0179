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
overwrite each other's data.
"""

from __future__ import annotations

import json
from pathlib import Path

from .errors import DefinitionError, Problem
from .fsutil import atomic_write_text

LOCK_SCHEMA = "imagebuild.lock"
LOCK_VERSION = 1
LOCK_FILE = "lock.json"


def lock_path(image_dir: Path) -> Path:
    return Path(image_dir) / LOCK_FILE


def serialise(data: dict) -> str:
    return json.dumps(data, indent=2, sort_keys=True, ensure_ascii=True) + "\n"


def read(image_dir: Path, display: str | None = None) -> dict | None:
    """The lock as a dict, or None when there is none yet. A malformed lock is a DefinitionError."""
    p = lock_path(image_dir)
    shown = display or str(p)
    if not p.exists():
        return None
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
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
    """Replace whole sections of the lock (creating it if needed), atomically. Returns the lock."""
    data = read(image_dir) or {"schema": LOCK_SCHEMA, "version": LOCK_VERSION, "image": image}
    data.update(sections)
    atomic_write_text(lock_path(image_dir), serialise(data))
    return data
