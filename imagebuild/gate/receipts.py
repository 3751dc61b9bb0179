"""Gate receipts: the record of one gate run, keyed by (image identity, gate spec digest).

``<state>/receipts/<identity-hex>/<spec-hex>.json`` holds the receipt of the LATEST run of that
spec against that image (a later run replaces it, so a failure after a pass withdraws the pass),
and ``<spec-hex>.log`` that run's log (every command, its output, the container's own log).
Receipts are written atomically.

A receipt says which gate it proved: ``spec.sha256`` is the digest of the spec file that ran
and ``authority`` says where that spec came from:

- ``definition``: the definition's own gate spec (``gate:`` in image.yaml);
- ``ad-hoc``: any other spec (``imagebuild gate IMAGE --spec FILE``, or an image reference).

Promotion and sync ask ``find_passing(ctx, identity, spec_digest)`` (``ctx``: a ``context.Context``
or a project root) with the digest of the
definition's CURRENT spec: only a passing ``definition`` receipt for exactly that image and
exactly that spec counts. An ad-hoc run never authorizes a promotion, and adding a check to
gate.yaml makes every earlier receipt irrelevant.

Format (schema ``imagebuild.receipt``, version 2): docs/gate.md.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from imagebuild.core import state
from imagebuild.core.fsutil import atomic_write_json

SCHEMA = "imagebuild.receipt"
VERSION = 2
OUTCOMES = ("passed", "failed", "skipped", "warned")
AUTHORITY_DEFINITION = "definition"
AUTHORITY_AD_HOC = "ad-hoc"


def receipts_dir(ctx) -> Path:
    """``<state>/receipts`` of a ``context.Context`` (or of a project root)."""
    from imagebuild.core.context import of

    return of(ctx).state / "receipts"


def _hex(digest: str, what: str = "identity") -> str:
    algo, _, hexpart = str(digest).partition(":")
    if algo != "sha256" or len(hexpart) != 64 or any(c not in "0123456789abcdef" for c in hexpart):
        raise ValueError(f"not a {what} digest: {digest!r} (expected sha256:<64 hex>)")
    return hexpart


def receipt_path(ctx, identity_digest: str, spec_digest: str) -> Path:
    return receipts_dir(ctx) / _hex(identity_digest) / f"{_hex(spec_digest, 'spec')}.json"


def log_path(ctx, identity_digest: str, spec_digest: str) -> Path:
    return receipt_path(ctx, identity_digest, spec_digest).with_suffix(".log")


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
    def spec_digest(self) -> str:
        return self.data["spec"]["sha256"]

    @property
    def authority(self) -> str:
        return self.data.get("authority", AUTHORITY_AD_HOC)

    @property
    def checks(self) -> list[dict]:
        return self.data["checks"]

    @property
    def gpu_checks_skipped(self) -> bool:
        return bool(self.data.get("gpu_checks_skipped"))


def write(ctx, data: dict) -> Receipt:
    """Validate the shape and write ``data`` atomically to its (identity, spec) receipt file."""
    if data.get("schema") != SCHEMA or data.get("version") != VERSION:
        raise ValueError("not a receipt document")
    if data.get("authority") not in (AUTHORITY_DEFINITION, AUTHORITY_AD_HOC):
        raise ValueError(f"bad authority {data.get('authority')!r}")
    for c in data["checks"]:
        if c["outcome"] not in OUTCOMES:
            raise ValueError(f"bad outcome {c['outcome']!r} for check {c['id']!r}")
    path = receipt_path(ctx, data["identity"]["digest"], data["spec"]["sha256"])
    atomic_write_json(path, data)
    return Receipt(data, path)


def read(ctx, identity_digest: str, spec_digest: str) -> dict | None:
    """The latest receipt for that identity and spec, or None (also for an unreadable or foreign file)."""
    try:
        path = receipt_path(ctx, identity_digest, spec_digest)
        data = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, OSError):
        return None
    if not isinstance(data, dict) or data.get("schema") != SCHEMA or data.get("version") != VERSION:
        return None
    if (data.get("identity") or {}).get("digest") != identity_digest or \
            (data.get("spec") or {}).get("sha256") != spec_digest:
        return None
    return data


def for_identity(ctx, identity_digest: str) -> list[dict]:
    """Every receipt of that image (any spec), newest run first."""
    try:
        d = receipts_dir(ctx) / _hex(identity_digest)
    except ValueError:
        return []
    out = []
    for p in d.glob("*.json") if d.is_dir() else ():
        try:
            data = json.loads(p.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if isinstance(data, dict) and data.get("schema") == SCHEMA and data.get("version") == VERSION:
            out.append(data)
    return sorted(out, key=lambda x: (x.get("run") or {}).get("finished") or "", reverse=True)


def find_passing(ctx, identity_digest: str, spec_digest: str, *, require_gpu: bool = False) -> dict | None:
    """The passing receipt of the definition's spec ``spec_digest`` for exactly this image, or None.

    Only the latest run counts: a failed run after a pass returns None. An ad-hoc receipt never
    counts. With ``require_gpu``, a pass whose GPU checks were skipped does not count either.
    """
    data = read(ctx, identity_digest, spec_digest)
    if data is None or data.get("result") != "passed" or data.get("authority") != AUTHORITY_DEFINITION:
        return None
    if any(c.get("outcome") == "failed" and c.get("severity") != "warn" for c in data.get("checks", [])):
        return None  # a hand-edited or inconsistent file: never trust it
    if not data.get("checks"):
        return None
    if require_gpu and data.get("gpu_checks_skipped"):
        return None
    return data


# ------------------------------------------------------------------------------------------ synced receipts


def synced_dir() -> Path:
    """Where ``imagebuild sync`` carries receipts on a peer: the peer's sync cache
    (``$IMAGEBUILD_PEER_CACHE``, default ``$XDG_CACHE_HOME/imagebuild/peer``) ``/receipts/``, laid out
    like ``<state>/receipts/``. ``imagebuild gate IMAGE --check-receipt`` reads it."""
    explicit = os.environ.get("IMAGEBUILD_PEER_CACHE")
    base = Path(explicit) if explicit else state.cache_home() / "imagebuild" / "peer"
    return base / "receipts"


def _passing(data: dict | None) -> bool:
    if data is None or data.get("result") != "passed" or data.get("authority") != AUTHORITY_DEFINITION:
        return False
    if any(c.get("outcome") == "failed" and c.get("severity") != "warn" for c in data.get("checks", [])):
        return False
    return bool(data.get("checks"))


def find_passing_synced(identity_digest: str, spec_digest: str | None) -> tuple[dict, Path] | None:
    """A passing ``definition`` receipt for the identity among the receipts sync carried here: of
    exactly ``spec_digest``, or (None) of any spec, newest first."""
    try:
        d = synced_dir() / _hex(identity_digest)
    except ValueError:
        return None
    paths = [d / f"{_hex(spec_digest, 'spec')}.json"] if spec_digest else sorted(d.glob("*.json"))
    found = []
    for path in paths:
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if not isinstance(data, dict) or data.get("schema") != SCHEMA or data.get("version") != VERSION:
            continue
        if (data.get("identity") or {}).get("digest") != identity_digest:
            continue
        if spec_digest and (data.get("spec") or {}).get("sha256") != spec_digest:
            continue
        if _passing(data):
            found.append((data, path))
    found.sort(key=lambda x: (x[0].get("run") or {}).get("finished") or "", reverse=True)
    return found[0] if found else None
