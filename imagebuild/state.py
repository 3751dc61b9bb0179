"""Where imagebuild keeps its own state for a project: build records, logs, receipts, locks.

``<root>/.imagebuild/`` (ignored by git), or ``$IMAGEBUILD_STATE_DIR``. Layout:

    builds/<image>/<build-id>/...   build records and per-stage logs (build)
    receipts/<identity-hex>.json    gate receipts keyed by image identity (gate)
    locks/<image>.lock              one build of an image at a time (build)
"""

from __future__ import annotations

import os
from pathlib import Path

STATE_DIRNAME = ".imagebuild"


def state_dir(root: Path) -> Path:
    explicit = os.environ.get("IMAGEBUILD_STATE_DIR")
    return Path(explicit) if explicit else Path(root) / STATE_DIRNAME


def deps_dir(root: Path, image: str) -> Path:
    """Prefetch output for one image: ``deps-src/<image>/`` (contents ignored by git)."""
    return Path(root) / "deps-src" / image
