"""The Rust crates of a composed source: every ``Cargo.lock`` found, vendored with ``cargo vendor``
into one deterministic tarball per source, so that ``cargo build --offline`` (setuptools-rust
included) works in a stage under ``--network none`` (docs/prefetch.md, "Rust crates").

- **Find**: every ``Cargo.lock`` of the tree as packed (the source's ``subdir`` when it has one),
  except under folders that hold other projects' code (``third_party``, ``vendor``, ...,
  ``SKIP_DIRS``) and hidden folders. Submodules are not searched (they are packed as their own
  trees; their crates are theirs). Each needs its ``Cargo.toml`` beside it.
- **Vendor**: from the Cargo.lock files themselves (fetch/crates.py): every registry crate a
  ``.crate`` file checked against the lock's sha256 (from the registry the machine's cargo config
  names, cached by checksum), every git crate a commit fetched through the git cache (git's
  ``insteadOf`` mirror map applies). No cargo on the host, and only the Cargo.lock blobs are read
  from the mirror: nothing is extracted.
- **Pack**: the vendor folder as a deterministic tarball (``tarball.pack_dir``: sorted, fixed
  mtime ``VENDOR_MTIME``, owner 0, modes 0644/0755), named by ``vendor_id`` (the digests of the
  Cargo.lock files): a second prefetch with the same Cargo.lock files keeps the tarball and runs
  no cargo at all.
- **Config**: the source replacement (crates-io, other registries and every git source of the
  locks to the vendored folder), with the folder as ``DIR_PLACEHOLDER``; the stage's
  ``imagebuild-src.sh`` writes it, with the folder it extracted to and ``net.offline = true``,
  into a fresh ``CARGO_HOME`` (plan/source_mounts.py).
"""

from __future__ import annotations

import logging
import re
import tempfile
import tomllib
from dataclasses import dataclass
from pathlib import Path

from imagebuild.core.errors import CommandFailed, OperationFailed
from imagebuild.core.fsutil import canonical_json, sha256_bytes
from imagebuild.fetch import crates as crates_mod
from imagebuild.fetch import tarball
from imagebuild.fetch.gitcache import Cache, Mirror

log = logging.getLogger("imagebuild")

FORMAT = 3  # raise when the vendor tarball's layout or the record changes (2: crates_rust_version, 3: from the lock)
VENDOR_MTIME = 315532800  # 1980-01-01: the crates' bytes do not depend on the composed commit
DIR_PLACEHOLDER = crates_mod.DIR_PLACEHOLDER
CONFIG_ENV = crates_mod.CONFIG_ENV
# folders whose Cargo.lock files belong to other projects' code kept in the tree
SKIP_DIRS = frozenset({"third_party", "third-party", "thirdparty", "3rdparty", "vendor", "vendored", "external",
                       "extern", "deps", "node_modules", "target"})


@dataclass(frozen=True)
class LockFile:
    path: str  # relative to the packed tree (the source's subdir when it has one)
    blob: str  # git blob id: what decides the crates


def find_lockfiles(listing: list[tuple[str, str, str]], subdir: str | None = None) -> list[LockFile]:
    """Every ``Cargo.lock`` of a tree listing ((mode, sha, path), tarball.list_tree), relative to
    ``subdir``, outside ``SKIP_DIRS`` and hidden folders, sorted by path."""
    prefix = (subdir.rstrip("/") + "/") if subdir else ""
    out = []
    for mode, sha, path in listing:
        if not path.startswith(prefix) or mode not in ("100644", "100755"):
            continue
        rel = path[len(prefix):]
        parts = rel.split("/")
        if parts[-1] != "Cargo.lock":
            continue
        if any(p in SKIP_DIRS or p.startswith(".") for p in parts[:-1]):
            continue
        out.append(LockFile(rel, sha))
    return sorted(out, key=lambda x: x.path)


def vendor_id(lockfiles: list[LockFile]) -> str:
    """The digest of everything that decides the vendor tarball's bytes: the format, the mtime and
    every Cargo.lock (path and blob). It names the tarball; the same Cargo.lock files give the
    same tarball without running cargo again."""
    doc = {"format": FORMAT, "tarball_format": tarball.FORMAT, "mtime": VENDOR_MTIME,
           "lockfiles": [[x.path, x.blob] for x in lockfiles]}
    return sha256_bytes(canonical_json(doc))


@dataclass
class Vendored:
    tarball_sha256: str
    crates: int
    config: str  # cargo's source-replacement config, the folder as DIR_PLACEHOLDER
    registry: int  # crates from a registry (.crate files checked against the lock)
    git: int  # crates from git commits
    rust_version: list | None = None  # [version, crate]: the highest rust-version a vendored crate declares


def vendor(source: str, m: Mirror, commit: str, subdir: str | None, lockfiles: list[LockFile],
           dest: Path, *, cache: Cache, tmp_parent: Path | None = None) -> Vendored:
    """Vendor the crates of ``lockfiles`` (of ``commit`` under ``subdir``) from the Cargo.lock files
    alone (fetch/crates.py: no cargo, nothing extracted but the lock files' blobs) and pack them into
    ``dest`` (atomically). Raises OperationFailed naming the Cargo.lock and the crate."""
    texts = []
    for x in lockfiles:
        try:
            texts.append((x.path, m.git("cat-file", "blob", x.blob).stdout.decode("utf-8", "replace")))
        except CommandFailed as exc:
            raise OperationFailed(exc.message) from None
    with tempfile.TemporaryDirectory(prefix=".cargo-vendor-", dir=tmp_parent) as tmp:
        out = Path(tmp) / "vendor"
        res = crates_mod.vendor(source, texts, out, cache)
        crates = sorted(p.name for p in out.iterdir() if p.is_dir())
        needed = highest((manifest_rust_version((out / c / "Cargo.toml").read_text(encoding="utf-8", errors="replace")),
                           c) for c in crates if (out / c / "Cargo.toml").is_file())
        digest = tarball.pack_dir(out, dest, VENDOR_MTIME)
        return Vendored(digest, len(crates), res.config, res.registry, res.git, list(needed) if needed else None)


# ---------------------------------------------------------------------------------------------
# the Rust toolchain the crates need (``rust-version``, cargo's minimum supported Rust version)


def manifest_rust_version(text: str) -> str | None:
    """The ``rust-version`` a Cargo.toml declares (``[package]``, else ``[workspace.package]``), or
    None (none declared, inherited from a workspace, or not TOML)."""
    try:
        doc = tomllib.loads(text)
    except (tomllib.TOMLDecodeError, UnicodeDecodeError):
        return None
    for table in (doc.get("package"), (doc.get("workspace") or {}).get("package")):
        v = table.get("rust-version") if isinstance(table, dict) else None
        if isinstance(v, str) and version_tuple(v):
            return v
    return None


def version_tuple(v: str) -> tuple[int, ...] | None:
    """``1.70`` / ``1.70.0`` / ``1.75.0+dfsg0ubuntu1-0ubuntu1`` (a Debian version of rustc: the upstream
    part) as (1, 70, 0); None when it is no such version."""
    m = re.match(r"^(?:\d+:)?(\d+)\.(\d+)(?:\.(\d+))?", v.strip())
    return (int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)) if m else None


def highest(pairs) -> tuple[str, str] | None:
    """The (version, who) pair with the highest version among ``pairs`` (None versions skipped)."""
    best = None
    for v, who in pairs:
        t = version_tuple(v) if v else None
        if t and (best is None or t > best[0]):
            best = (t, v, who)
    return (best[1], best[2]) if best else None
