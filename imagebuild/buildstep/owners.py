"""Which project made which builds of the shared stage store.

The stage store (``state.stages_dir()``) and the engine are shared by every clone on a node, but
each clone keeps its own run records. So that ``imagebuild gc`` in one clone never removes the
builds another clone keeps, every project claims the builds it made:

    <stages>/<image>/owners/<project id>.json
        {"schema": "imagebuild.store-owner", "version": 1, "root": "/path/of/the/checkout",
         "builds": {"<build id>": ["<stage key>", ...]}}

``<project id>`` is the SHA-256 of the checkout's resolved path (its first 16 hex digits). A
build adds its build id and stage keys to its project's file; gc rewrites its own file with only
the builds it kept. A file whose checkout no longer exists claims nothing. Each file is written
atomically, under the image's build lock (the build's, or gc's).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

from imagebuild.core import fsutil
from imagebuild.core.fsutil import atomic_write_json

SCHEMA = "imagebuild.store-owner"
VERSION = 1
OWNERS_MAX = 1 << 20  # an owners file lists a checkout's builds: a few KiB
DIRNAME = "owners"


def project_id(root: Path) -> str:
    return hashlib.sha256(str(Path(root).resolve()).encode()).hexdigest()[:16]


def owner_path(store_dir: Path, root: Path) -> Path:
    return Path(store_dir) / DIRNAME / f"{project_id(root)}.json"


@dataclass
class Claim:
    root: str
    builds: dict[str, list[str]] = field(default_factory=dict)

    @property
    def keys(self) -> set[str]:
        return {k for ks in self.builds.values() for k in ks}

    def live(self) -> bool:
        """Whether the checkout that claims these builds is still there."""
        return Path(self.root).is_dir()


def read(path: Path) -> Claim | None:
    try:
        data = json.loads(fsutil.read_text(path, OWNERS_MAX))
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("schema") != SCHEMA or not isinstance(data.get("root"), str):
        return None
    builds = data.get("builds") if isinstance(data.get("builds"), dict) else {}
    return Claim(data["root"], {str(b): [str(k) for k in ks] for b, ks in builds.items() if isinstance(ks, list)})


def claims(store_dir: Path) -> list[Claim]:
    """Every project's claim on this image's builds (unreadable files claim nothing)."""
    d = Path(store_dir) / DIRNAME
    out = []
    for p in sorted(d.glob("*.json")) if d.is_dir() else ():
        c = read(p)
        if c is not None:
            out.append(c)
    return out


def others(store_dir: Path, root: Path) -> list[Claim]:
    """The live claims of every project but ``root``."""
    mine = str(Path(root).resolve())
    return [c for c in claims(store_dir) if c.root != mine and c.live()]


def write(store_dir: Path, root: Path, builds: dict[str, list[str]]) -> None:
    path = owner_path(store_dir, root)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(path, {"schema": SCHEMA, "version": VERSION, "root": str(Path(root).resolve()),
                             "builds": {b: sorted(set(ks)) for b, ks in sorted(builds.items())}})


def claim(store_dir: Path, root: Path, build_id: str, keys: list[str]) -> None:
    """Add one build (its id and stage keys) to ``root``'s claim."""
    c = read(owner_path(store_dir, root))
    builds = dict(c.builds) if c else {}
    builds[build_id] = sorted(set(builds.get(build_id, [])) | {k for k in keys if k})
    write(store_dir, root, builds)
