"""Gate receipts: the record of one gate run, keyed by the image's store-independent identity.

``<state>/receipts/<identity-hex>.json`` holds the receipt of the LATEST gate run of that image
(a later run replaces it, so a failure after a pass withdraws the pass), and
``<state>/receipts/<identity-hex>.log`` the run's log (every command, its output, and the
container's own log). Receipts are written atomically. Promotion (``:candidate`` -> ``:local``)
and ``sync`` ask ``find_passing(root, identity.digest)`` for exactly the image they move.

Format (schema ``imagebuild.receipt``, version 1): docs/gate.md.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from . import state
from .fsutil import atomic_write_json

SCHEMA = "imagebuild.receipt"
VERSION = 1
OUTCOMES = ("passed", "failed", "skipped", "warned")


def receipts_dir(root: Path) -> Path:
    return state.state_dir(root) / "receipts"


def _hex(identity_digest: str) -> str:
    algo, _, hexpart = identity_digest.partition(":")
    if algo != "sha256" or len(hexpart) != 64 or any(c not in "0123456789abcdef" for c in hexpart):
        raise ValueError(f"not an identity digest: {identity_digest!r} (expected sha256:<64 hex>)")
    return hexpart


def receipt_path(root: Path, identity_digest: str) -> Path:
    return receipts_dir(root) / f"{_hex(identity_digest)}.json"


def log_path(root: Path, identity_digest: str) -> Path:
    return receipts_dir(root) / f"{_hex(identity_digest)}.log"


@dataclass(frozen=True)
class Receipt:
    data: dict
    path: Path

    @property
    def passed(self) -> bool:
        return self.data.get("result") == "passed"

    @property
    def identity_digest(self) -> str:
        return self.data["identity"]["digest"]

    @property
    def checks(self) -> list[dict]:
        return self.data["checks"]

    @property
    def gpu_checks_skipped(self) -> bool:
        return bool(self.data.get("gpu_checks_skipped"))


def write(root: Path, data: dict) -> Receipt:
    """Validate the shape and write ``data`` atomically to its identity's receipt file."""
    if data.get("schema") != SCHEMA or data.get("version") != VERSION:
        raise ValueError("not a receipt document")
    for c in data["checks"]:
        if c["outcome"] not in OUTCOMES:
            raise ValueError(f"bad outcome {c['outcome']!r} for check {c['id']!r}")
    path = receipt_path(root, data["identity"]["digest"])
    atomic_write_json(path, data)
    return Receipt(data, path)


def read(root: Path, identity_digest: str) -> dict | None:
    """The latest receipt for that identity, or None (also for an unreadable or foreign file)."""
    path = receipt_path(root, identity_digest)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (FileNotFoundError, json.JSONDecodeError, UnicodeDecodeError):
        return None
    if not isinstance(data, dict) or data.get("schema") != SCHEMA or data.get("version") != VERSION:
        return None
    if (data.get("identity") or {}).get("digest") != identity_digest:
        return None
    return data


def find_passing(root: Path, identity_digest: str, *, require_gpu: bool = False) -> dict | None:
    """The passing receipt for exactly this image identity, or None.

    Only the latest run counts: a failed run after a pass returns None. With ``require_gpu``, a
    pass whose GPU checks were skipped (no GPU on the gating host) does not count either.
    """
    data = read(root, identity_digest)
    if data is None or data.get("result") != "passed":
        return None
    if any(c.get("outcome") == "failed" and c.get("severity") != "warn" for c in data.get("checks", [])):
        return None  # a hand-edited or inconsistent file: never trust it
    if not data.get("checks"):
        return None
    if require_gpu and data.get("gpu_checks_skipped"):
        return None
    return data
