"""Where imagebuild keeps its own state for a project: build records, logs, receipts, locks.

``<root>/.imagebuild/`` (ignored by git), or ``$IMAGEBUILD_STATE_DIR``. Layout:

    builds/<image>/<build-id>/...   build records and per-stage logs (build)
    receipts/<identity-hex>.json    gate receipts keyed by image identity (gate)
    tmp/                            temporary folders of running builds (removed when they end)

Stage images live in the shared stage store (``stages_dir()``), not here.
"""

from __future__ import annotations

import os
from pathlib import Path

STATE_DIRNAME = ".imagebuild"


def state_dir(root: Path) -> Path:
    explicit = os.environ.get("IMAGEBUILD_STATE_DIR")
    return Path(explicit) if explicit else Path(root) / STATE_DIRNAME


STAGES_ENV = "IMAGEBUILD_STAGES"


def cache_home() -> Path:
    """The user's cache folder: ``$XDG_CACHE_HOME``, else ``~/.cache``. imagebuild's caches live in
    ``<cache_home>/imagebuild/``: stages, git, sync, peer (and parse, left by earlier versions)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache"))


def stages_dir() -> Path:
    """The stage store (stagestore.py): ``$IMAGEBUILD_STAGES``, else
    ``$XDG_CACHE_HOME/imagebuild/stages`` (``~/.cache/imagebuild/stages``). It is a cache of
    content-addressed stage images, shared by every clone on this host: a stage's key names
    everything that made it, so a key built in one clone is the same stage in another."""
    explicit = os.environ.get(STAGES_ENV)
    if explicit:
        return Path(explicit)
    return cache_home() / "imagebuild" / "stages"


def deps_dir(root: Path, image: str) -> Path:
    """Prefetch output for one image: ``deps-src/<image>/`` (contents ignored by git)."""
    return Path(root) / "deps-src" / image


# A gate's temporary folder ($TMPDIR/imagebuild-gate-*) holds this flock while the gate runs: gc removes
# one whose lock is free (a gate killed with kill -9 leaves its folder)
GATE_TMP_PREFIX = "imagebuild-gate-"
GATE_TMP_LOCK = ".imagebuild-gate.lock"
