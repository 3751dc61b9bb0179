"""The Rust toolchain a tree names, pinned and offline (docs/prefetch.md, "The Rust toolchain the
tree names"): for a source with ``rust_toolchain: dist`` (image.yaml), prefetch fetches the release
archives of the version its ``rust-toolchain.toml`` names, for the definition's platform, and the
stage installs them without rustup and without network.

- **Where from**: ``RUSTUP_DIST_SERVER``, rustup's own setting for the server (or mirror) that
  holds ``dist/``. No server is built in: without it prefetch stops and says so.
- **What**: the channel manifest ``dist/channel-rust-<channel>.toml`` (checked against the
  ``.sha256`` published beside it), then, for ``rustc``, ``cargo`` and ``rust-std`` of the target,
  the ``.tar.gz`` archive the manifest lists, checked against the manifest's ``hash``. The archive
  is fetched from the path the manifest names, under the configured server; the lock records the
  URL as published (the same lock on every site), the version, the target and every digest.
- **Kept**: archives are cached by sha256 (``<cache>/rust-dist/<sha256>.tar.gz``) and copied into
  ``deps-src/<image>/src/`` under their published file names. A lock whose record still names the
  same channel and target, with the archives there and intact, is kept with no network; so is
  ``--offline`` (from the cache's manifest and archives otherwise).
- **In the stage**: plan/source_mounts.py mounts the archives like any tarball, and the generated
  script installs each archive's components into ``/imagebuild/work/rust`` and puts its ``bin`` first
  on ``PATH``.

The manifest's GPG signature (``.asc``) is not checked here: the pin is the manifest's sha256 in
the lock, and every archive's digest from it.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tomllib
import urllib.parse
from pathlib import Path, PurePosixPath

from imagebuild.core.errors import OperationFailed
from imagebuild.core.fsutil import atomic_write_bytes, sha256_file
from imagebuild.fetch import crates as crates_mod
from imagebuild.fetch import gitcache
from imagebuild.fetch.gitcache import OfflineMissing

log = logging.getLogger("imagebuild")

SERVER_ENV = "RUSTUP_DIST_SERVER"
COMPONENTS = ("rustc", "cargo", "rust-std")
TARGETS = {"linux/arm64": "aarch64-unknown-linux-gnu", "linux/arm64/v8": "aarch64-unknown-linux-gnu",
           "linux/amd64": "x86_64-unknown-linux-gnu"}
FORMAT = 1


def target_of(platform: str) -> str:
    t = TARGETS.get(platform)
    if t is None:
        raise OperationFailed(f"platform {platform}: no Rust target known for it",
                              hint=f"known: {', '.join(sorted(TARGETS))}")
    return t


def _server() -> str:
    s = os.environ.get(SERVER_ENV, "").strip()
    if not s:
        raise OperationFailed(
            f"{SERVER_ENV} is not set: prefetch takes Rust release archives from the server it names "
            "(rustup's own setting), never from a built-in host",
            hint=f"export {SERVER_ENV}=<the server or mirror that holds dist/channel-rust-<version>.toml>; "
            "docs/prefetch.md, \"The Rust toolchain the tree names\"")
    return s.rstrip("/")


def _at_server(server: str, published: str) -> str:
    """The published URL's path under the configured server."""
    path = urllib.parse.urlsplit(published).path
    return server + (path if path.startswith("/") else "/" + path)


def lock_files(rec: dict | None) -> list[tuple[str, str]]:
    """(tarball, sha256) of every archive a cargo record's ``toolchain_dist`` names."""
    td = (rec or {}).get("toolchain_dist") if isinstance(rec, dict) else None
    if not isinstance(td, dict):
        return []
    return [(a["tarball"], a["sha256"]) for a in td.get("archives") or ()
            if isinstance(a, dict) and isinstance(a.get("tarball"), str) and isinstance(a.get("sha256"), str)]


def intact(root: Path, rec: dict | None) -> str | None:
    """Why the archives of ``rec`` are not all there and intact, or None."""
    for tb, sha in lock_files(rec):
        p = root / tb
        if not p.is_file() or sha256_file(p) != sha:
            return f"{tb} is missing or does not match the lock's sha256"
    return None


def fetch(source: str, toolchain: dict | None, platform: str, srcdir: Path, root: Path, cache: gitcache.Cache,
          old: dict | None, display) -> dict:
    """The lock's ``toolchain_dist`` record of a source whose tree names ``toolchain`` ({file, channel})."""
    if not isinstance(toolchain, dict):
        raise OperationFailed(f"{source}: rust_toolchain: dist, but the tree has no rust-toolchain.toml (or "
                              "rust-toolchain) beside or above its Cargo.lock: no version to fetch",
                              hint="leave rust_toolchain out (the stage's own toolchain), or a tree that names one")
    channel, tfile = toolchain["channel"], toolchain["file"]
    from imagebuild.fetch.rust import VERSION_CHANNEL

    if not VERSION_CHANNEL.match(channel):
        raise OperationFailed(f"{source}: {tfile}: channel = {channel!r} is no version: a pinned toolchain needs "
                              "one (1.95 or 1.95.0)", hint="leave rust_toolchain out for this tree")
    target = target_of(platform)
    if isinstance(old, dict) and old.get("format") == FORMAT and old.get("channel") == channel \
            and old.get("target") == target and lock_files({"toolchain_dist": old}) \
            and intact(root, {"toolchain_dist": old}) is None:
        log.info("  %s: Rust %s (%s) for %s unchanged (kept)", source, old.get("version"), tfile, target)
        return old
    dist_dir = cache.root / "rust-dist"
    mname = f"channel-rust-{channel}.toml"
    cached_manifest = dist_dir / mname
    if cache.offline:
        if not cached_manifest.is_file():
            raise OfflineMissing(f"{source}: --offline: the Rust {channel} channel manifest ({tfile}) is not in the "
                                 f"cache ({dist_dir})", hint="run prefetch without --offline once to fill the cache")
        raw = cached_manifest.read_bytes()
        server = None
    else:
        server = _server()
        murl = f"{server}/dist/{mname}"
        raw = crates_mod.http_get(murl, f"{source}: {tfile}: Rust {channel} channel manifest")
        sums = crates_mod.http_get(murl + ".sha256", f"{source}: {tfile}: Rust {channel} channel manifest's sha256")
        want = sums.decode("ascii", "replace").split()[0] if sums.strip() else ""
        got = hashlib.sha256(raw).hexdigest()
        if got != want:
            raise OperationFailed(f"{source}: {gitcache.redact(murl)} has sha256 {got}, its .sha256 says {want!r}")
        dist_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(cached_manifest, raw)
    msha = hashlib.sha256(raw).hexdigest()
    try:
        man = tomllib.loads(raw.decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise OperationFailed(f"{source}: the Rust {channel} channel manifest is not TOML ({exc})") from None
    pkgs = man.get("pkg") if isinstance(man.get("pkg"), dict) else {}
    rustc_v = str((pkgs.get("rustc") or {}).get("version") or "")
    version = rustc_v.split()[0] if rustc_v else ""
    from imagebuild.fetch.cargo import version_tuple

    if not version_tuple(version) or version_tuple(version)[:len(channel.split("."))] != version_tuple(channel)[
            :len(channel.split("."))]:
        raise OperationFailed(f"{source}: the Rust {channel} channel manifest names rustc {rustc_v!r}, not {channel}")
    archives = []
    for comp in COMPONENTS:
        t = ((pkgs.get(comp) or {}).get("target") or {}).get(target)
        if not isinstance(t, dict) or not t.get("available") or not isinstance(t.get("url"), str) \
                or not isinstance(t.get("hash"), str):
            raise OperationFailed(f"{source}: {tfile}: Rust {version} has no {comp} for {target} in its channel manifest",
                                  hint="a platform the release does not ship; or leave rust_toolchain out")
        url, sha = t["url"], t["hash"]
        name = PurePosixPath(urllib.parse.urlsplit(url).path).name
        if not name.endswith(".tar.gz") or "/" in name or name.startswith("."):
            raise OperationFailed(f"{source}: Rust {version}: {comp} archive {url!r} is not a .tar.gz file")
        cached = dist_dir / f"{sha}.tar.gz"
        if not (cached.is_file() and sha256_file(cached) == sha):
            if server is None:
                raise OfflineMissing(f"{source}: --offline: the Rust {version} {comp} archive for {target} is not in "
                                     f"the cache ({dist_dir})", hint="run prefetch without --offline once")
            where = _at_server(server, url)
            log.info("  %s: fetching Rust %s %s for %s", source, version, comp, target)
            data = crates_mod.http_get(where, f"{source}: {tfile}: Rust {version} {comp}")
            got = hashlib.sha256(data).hexdigest()
            if got != sha:
                raise OperationFailed(f"{source}: {gitcache.redact(where)} has sha256 {got}, the channel manifest says {sha}")
            atomic_write_bytes(cached, data)
        dest = srcdir / name
        if not (dest.is_file() and sha256_file(dest) == sha):
            tmp = dest.with_name(f".{name}.tmp")
            shutil.copyfile(cached, tmp)
            os.replace(tmp, dest)
        archives.append({"component": comp, "url": gitcache.redact(url), "sha256": sha, "tarball": display(dest)})
    log.info("  %s: Rust %s (%s: channel %s) for %s: %s", source, version, tfile, channel, target,
             ", ".join(COMPONENTS))
    return {"format": FORMAT, "channel": channel, "file": tfile, "version": version, "rustc": rustc_v,
            "target": target, "manifest": {"name": mname, "sha256": msha}, "archives": archives}
