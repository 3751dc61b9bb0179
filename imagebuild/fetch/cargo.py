"""The Rust crates of a composed source: every ``Cargo.lock`` found, vendored with ``cargo vendor``
into one deterministic tarball per source, so that ``cargo build --offline`` (setuptools-rust
included) works in a stage under ``--network none`` (docs/prefetch.md, "Rust crates").

- **Find**: every ``Cargo.lock`` of the tree as packed (the source's ``subdir`` when it has one),
  except under folders that hold other projects' code (``third_party``, ``vendor``, ...,
  ``SKIP_DIRS``) and hidden folders. Submodules are not searched (they are packed as their own
  trees; their crates are theirs). Each needs its ``Cargo.toml`` beside it.
- **Vendor**: the composed tree is extracted to a temporary folder (``git archive``; path
  dependencies outside the Cargo.lock's folder resolve), then one
  ``cargo vendor --locked --versioned-dirs --respect-source-config`` for all of the tree's
  manifests (the first with ``--manifest-path``, the others with ``--sync``) writes one vendor
  folder. It runs with a private, fresh ``CARGO_HOME``: the host's cargo config and registry
  cache never leak in. ``IMAGEBUILD_CARGO_CONFIG`` names a cargo config file copied into it (a
  registry mirror, or a directory source of crates); ``IMAGEBUILD_CARGO`` the cargo to run
  (default: ``cargo`` on PATH, then ``~/.cargo/bin/cargo``).
- **Pack**: the vendor folder as a deterministic tarball (``tarball.pack_dir``: sorted, fixed
  mtime ``VENDOR_MTIME``, owner 0, modes 0644/0755), named by ``vendor_id`` (the digests of the
  Cargo.lock files): a second prefetch with the same Cargo.lock files keeps the tarball and runs
  no cargo at all.
- **Config**: what ``cargo vendor`` prints (the source replacement: crates-io and any git source
  to the vendored folder), with the folder as ``DIR_PLACEHOLDER``; the stage's
  ``imagebuild-src.sh`` writes it, with the folder it extracted to and ``net.offline = true``,
  into a fresh ``CARGO_HOME`` (plan/source_mounts.py).
"""

from __future__ import annotations

import logging
import os
import re
import tarfile
import tempfile
import tomllib
from dataclasses import dataclass
from pathlib import Path

from imagebuild.core import run as run_mod
from imagebuild.core.errors import CommandFailed, OperationFailed
from imagebuild.core.fsutil import canonical_json, sha256_bytes
from imagebuild.fetch import tarball
from imagebuild.fetch.gitcache import Mirror

log = logging.getLogger("imagebuild")

FORMAT = 2  # raise when the vendor tarball's layout or the record changes (2: crates_rust_version)
VENDOR_MTIME = 315532800  # 1980-01-01: the crates' bytes do not depend on the composed commit
DIR_PLACEHOLDER = "@IMAGEBUILD_CARGO_VENDOR_DIR@"
CONFIG_ENV = "IMAGEBUILD_CARGO_CONFIG"
CARGO_ENV = "IMAGEBUILD_CARGO"
# folders whose Cargo.lock files belong to other projects' code kept in the tree
SKIP_DIRS = frozenset({"third_party", "third-party", "thirdparty", "3rdparty", "vendor", "vendored", "external",
                       "extern", "deps", "node_modules", "target"})
TIMEOUT_S = 1800


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


def cargo_binary() -> str:
    explicit = os.environ.get(CARGO_ENV)
    if explicit:
        return explicit
    found = run_mod.which("cargo")
    if found:
        return found
    home = Path.home() / ".cargo" / "bin" / "cargo"
    return str(home) if home.is_file() else "cargo"


@dataclass
class Vendored:
    tarball_sha256: str
    crates: int
    config: str  # cargo's source-replacement config, the folder as DIR_PLACEHOLDER
    cargo: str  # `cargo --version`
    rust_version: list | None = None  # [version, crate]: the highest rust-version a vendored crate declares


def _crate_of(output: str) -> str | None:
    """The crate cargo's error names (``itoa v1.0.1``, ``cfg-if``), or None."""
    pats = (r"failed to download `([^`]+)`", r"no matching package named `([^`]+)` found",
            r"failed to get `([^`]+)` as a dependency", r"failed to select a version for(?: the requirement)? `([^`=\s]+)",
            r"checksum for `([^`]+)` (?:was not previously calculated|changed)", r"failed to load source for dependency `([^`]+)`",
            r"unable to get packages from source.*?`([^`]+)`")
    for p in pats:
        m = re.search(p, output, re.S)
        if m:
            return m.group(1).strip()
    m = re.search(r"download(?:ing)? ([A-Za-z0-9_-]+) v([0-9][^\s)]*)", output)
    return f"{m.group(1)} v{m.group(2)}" if m else None


def _locks_naming(root: Path, lockfiles: list[LockFile], crate: str) -> list[str]:
    name = crate.split(" ", 1)[0]
    out = []
    for x in lockfiles:
        try:
            text = (root / x.path).read_text("utf-8", "replace")
        except OSError:
            continue
        if re.search(r'^name = "' + re.escape(name) + r'"$', text, re.M):
            out.append(x.path)
    return out


def _extract(m: Mirror, commit: str, subdir: str | None, dest: Path) -> None:
    treeish = f"{commit}:{subdir}" if subdir else commit
    proc = run_mod.popen(["git", "--git-dir", str(m.path), "archive", "--format=tar", treeish], stdin=False)
    try:
        with tarfile.open(fileobj=proc.stdout, mode="r|") as tf:
            tf.extractall(dest, filter="tar")
    except (tarfile.TarError, OSError) as exc:
        proc.kill()
        proc.wait()
        raise OperationFailed(f"cannot extract {treeish[:12]} from {m.path.name} for cargo vendor: {exc}") from None
    try:
        run_mod.check_popen(proc)
    except CommandFailed as exc:
        raise OperationFailed(exc.message) from None


def vendor(source: str, m: Mirror, commit: str, subdir: str | None, lockfiles: list[LockFile],
           dest: Path, *, tmp_parent: Path | None = None) -> Vendored:
    """Vendor the crates of ``lockfiles`` (of ``commit`` under ``subdir``) and pack them into ``dest``
    (atomically). Raises OperationFailed naming the Cargo.lock and the crate when cargo cannot get one."""
    cargo = cargo_binary()
    with tempfile.TemporaryDirectory(prefix=".cargo-vendor-", dir=tmp_parent) as tmp:
        t = Path(tmp)
        tree, home, out = t / "tree", t / "cargo-home", t / "vendor"
        tree.mkdir()
        home.mkdir()
        _extract(m, commit, subdir, tree)
        for x in lockfiles:
            if not (tree / x.path).with_name("Cargo.toml").is_file():
                raise OperationFailed(f"{source}: {x.path} has no Cargo.toml beside it (commit {commit[:12]}): "
                                      "cargo cannot vendor a Cargo.lock without its manifest")
        cfg = os.environ.get(CONFIG_ENV)
        if cfg:
            try:
                (home / "config.toml").write_bytes(Path(cfg).read_bytes())
            except OSError as exc:
                raise OperationFailed(f"{CONFIG_ENV}={cfg}: cannot read it ({exc.strerror})",
                                      hint="point it at a cargo config file (config.toml)") from None
        manifests = [str(tree / Path(x.path).with_name("Cargo.toml")) for x in lockfiles]
        argv = [cargo, "vendor", "--locked", "--versioned-dirs", "--respect-source-config",
                "--manifest-path", manifests[0]]
        for extra in manifests[1:]:
            argv += ["--sync", extra]
        argv.append(str(out))
        env = {"CARGO_HOME": str(home), "CARGO_TERM_COLOR": "never", "CARGO_TERM_PROGRESS_WHEN": "never",
               "CARGO_HTTP_TIMEOUT": os.environ.get("CARGO_HTTP_TIMEOUT", "30"),
               "CARGO_NET_RETRY": os.environ.get("CARGO_NET_RETRY", "2"), "CARGO_TARGET_DIR": str(t / "target"),
               "RUSTUP_TOOLCHAIN": os.environ.get("RUSTUP_TOOLCHAIN", "")}
        env = {k: v for k, v in env.items() if v}
        version = _cargo_version(cargo, env, tree, source, lockfiles)
        # cargo vendor prints the config on stdout, progress and errors on stderr: keep them apart
        proc = run_mod.popen(argv, env=env, cwd=tree, stdin=False,
                             hint="cargo vendor needs the crates registry (or IMAGEBUILD_CARGO_CONFIG)")
        try:
            stdout, stderr = proc.communicate(timeout=TIMEOUT_S)
        except BaseException:
            proc.kill()
            proc.wait()
            raise
        if proc.returncode != 0:
            text = stderr.decode("utf-8", "replace")
            crate = _crate_of(text)
            where = ", ".join(x.path for x in lockfiles)
            if crate:
                naming = _locks_naming(tree, lockfiles, crate)
                where = ", ".join(naming) or where
            tail = "\n".join("  | " + ln for ln in text.strip().splitlines()[-12:])
            raise OperationFailed(
                f"{source}: {where}: cannot vendor {'crate ' + crate if crate else 'its crates'} "
                f"(cargo vendor exit {proc.returncode}, commit {commit[:12]})\n{tail}",
                hint="prefetch needs the crates registry (crates.io) for a new or changed Cargo.lock; "
                f"or set {CONFIG_ENV} to a cargo config with a mirror or a directory source")
        crates = sorted(p.name for p in out.iterdir() if p.is_dir()) if out.is_dir() else []
        if not crates:
            out.mkdir(exist_ok=True)
        config = stdout.decode("utf-8", "replace").replace(str(out), DIR_PLACEHOLDER).strip() + "\n"
        if crates and DIR_PLACEHOLDER not in config:
            raise OperationFailed(f"{source}: cargo vendor printed no source replacement for {out}: {config[:200]!r}")
        needed = highest((manifest_rust_version((out / c / "Cargo.toml").read_text(encoding="utf-8", errors="replace")),
                           c) for c in crates if (out / c / "Cargo.toml").is_file())
        digest = tarball.pack_dir(out, dest, VENDOR_MTIME)
        return Vendored(digest, len(crates), config, version, list(needed) if needed else None)


def _cargo_version(cargo: str, env: dict, cwd: Path, source: str, lockfiles: list[LockFile]) -> str:
    try:
        return run_mod.output([cargo, "--version"], env=env, cwd=cwd, timeout=60)
    except OperationFailed as exc:
        raise OperationFailed(
            f"{source}: {', '.join(x.path for x in lockfiles)}: the tree has Rust crates to vendor, but cargo "
            f"cannot run ({exc.message.splitlines()[0]})",
            hint=f"install Rust's cargo (rustup), or point {CARGO_ENV} at it") from None


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
