"""What Rust a composed tree asks for, read from the tree itself (docs/prefetch.md, "The Rust the
tree needs"): no cargo, no rustc, no network.

Every requirement is a ``Need``: the version, the file that asks for it and what in it asks:

- the **toolchain file** rustup would use for a ``cargo build`` in the Cargo.lock's folder: the
  nearest ``rust-toolchain.toml`` (``[toolchain] channel``) or ``rust-toolchain`` (a bare channel,
  or the same TOML) in that folder or a folder above it inside the packed tree. A channel that is a
  version (``1.95``, ``1.95.0``) asks for that version; ``stable``/``beta``/``nightly[-date]`` ask
  for no version (the lock records the channel; nothing is invented);
- the **edition** of every manifest under the Cargo.lock's folder (``[package] edition`` or
  ``[workspace.package] edition``): 2018 needs Rust 1.31, 2021 1.56, 2024 1.85 (the releases that
  stabilised them);
- the **Cargo.lock version** (``version = N`` at its top): 3 needs cargo 1.53, 4 needs cargo 1.78
  (the first cargo that reads it; cargo and rustc ship together, one version);
- the **rust-version** (cargo's minimum supported Rust) a manifest of the tree declares
  (fetch/cargo.manifest_rust_version); the vendored crates' own are added by the caller.

The highest is what the stage's toolchain must reach (fetch/prefetch.check_rust_toolchain).
"""

from __future__ import annotations

import re
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import PurePosixPath

from imagebuild.fetch import cargo as cargo_mod

TOOLCHAIN_FILES = ("rust-toolchain.toml", "rust-toolchain")  # rustup's order: the .toml wins
# the Rust release that stabilised each edition (the Rust edition guide)
EDITION_RUST = {"2018": "1.31", "2021": "1.56", "2024": "1.85"}
# the first cargo that reads each Cargo.lock version (cargo's changelog: v3 1.53, v4 1.78)
LOCKFILE_CARGO = {3: "1.53", 4: "1.78"}
VERSION_CHANNEL = re.compile(r"^\d+\.\d+(?:\.\d+)?$")


@dataclass(frozen=True)
class Need:
    version: str  # the lowest Rust that satisfies it
    file: str  # the file of the tree that asks, relative to the packed tree
    asks: str  # what in it asks: 'channel = "1.95"', 'edition = "2024"', 'version = 4', 'rust-version = "1.80"'

    def as_list(self) -> list[str]:
        return [self.version, self.file, self.asks]

    @property
    def who(self) -> str:
        return f"{self.file} ({self.asks})"


@dataclass(frozen=True)
class Toolchain:
    file: str  # the toolchain file, relative to the packed tree
    channel: str  # as written: "1.95", "stable", "nightly-2026-05-01"

    @property
    def version(self) -> str | None:
        return self.channel if VERSION_CHANNEL.match(self.channel) else None


def toolchain_channel(text: str) -> str | None:
    """The channel of a ``rust-toolchain.toml`` / ``rust-toolchain`` file's text, or None."""
    try:
        doc = tomllib.loads(text)
    except (tomllib.TOMLDecodeError, UnicodeDecodeError):
        doc = None
    if isinstance(doc, dict):
        tc = doc.get("toolchain")
        ch = tc.get("channel") if isinstance(tc, dict) else None
        return ch.strip() if isinstance(ch, str) and ch.strip() else None
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.strip().startswith("#")]
    return lines[0] if len(lines) == 1 and re.fullmatch(r"[A-Za-z0-9._-]+", lines[0]) else None


def lockfile_version(text: str) -> int | None:
    """The ``version = N`` of a Cargo.lock (None: a v1/v2 lockfile says none)."""
    m = re.search(r"^version\s*=\s*(\d+)\s*$", text.split("[[package]]", 1)[0], re.M)
    return int(m.group(1)) if m else None


def manifest_edition(text: str) -> str | None:
    try:
        doc = tomllib.loads(text)
    except (tomllib.TOMLDecodeError, UnicodeDecodeError):
        return None
    for table in (doc.get("package"), (doc.get("workspace") or {}).get("package")):
        e = table.get("edition") if isinstance(table, dict) else None
        if isinstance(e, str):
            return e
    return None


def find_toolchain(paths: set[str], lock_path: str) -> str | None:
    """The toolchain file rustup would read for a build in ``lock_path``'s folder: the nearest one
    in that folder or above it (``paths``: the files of the packed tree)."""
    d = PurePosixPath(lock_path).parent
    while True:
        for name in TOOLCHAIN_FILES:
            cand = (d / name).as_posix() if str(d) != "." else name
            if cand in paths:
                return cand
        if str(d) in (".", ""):
            return None
        d = d.parent


def tree_needs(files: dict[str, str], lock_paths: list[str], read: Callable[[str], str]) -> tuple[list[Need], list[Toolchain]]:
    """(the needs, the toolchain files) of the Cargo.lock files ``lock_paths`` of a packed tree whose
    blobs are ``files`` (path -> blob id, relative to the packed tree); ``read(blob)`` gives a blob's
    text. Sorted, each file read once."""
    needs: dict[tuple[str, str], Need] = {}
    chains: dict[str, Toolchain] = {}
    paths = set(files)

    def add(n: Need) -> None:
        needs.setdefault((n.file, n.asks), n)

    for lp in lock_paths:
        tf = find_toolchain(paths, lp)
        if tf and tf not in chains:
            ch = toolchain_channel(read(files[tf]))
            if ch:
                chains[tf] = Toolchain(tf, ch)
                if chains[tf].version:
                    add(Need(ch, tf, f'channel = "{ch}"'))
        if lp in files:
            v = lockfile_version(read(files[lp]))
            if v in LOCKFILE_CARGO:
                add(Need(LOCKFILE_CARGO[v], lp, f"version = {v}"))
        folder = PurePosixPath(lp).parent.as_posix()
        prefix = "" if folder == "." else folder + "/"
        for path in sorted(paths):
            parts = path.split("/")
            if parts[-1] != "Cargo.toml" or not path.startswith(prefix):
                continue
            if any(p in cargo_mod.SKIP_DIRS or p.startswith(".") for p in parts[:-1]):
                continue
            text = read(files[path])
            ed = manifest_edition(text)
            if ed in EDITION_RUST:
                add(Need(EDITION_RUST[ed], path, f'edition = "{ed}"'))
            rv = cargo_mod.manifest_rust_version(text)
            if rv:
                add(Need(rv, path, f'rust-version = "{rv}"'))
    out = sorted(needs.values(), key=lambda n: (cargo_mod.version_tuple(n.version) or (0,), n.file, n.asks), reverse=True)
    return out, sorted(chains.values(), key=lambda t: t.file)


def highest(needs: list[Need]) -> Need | None:
    best = None
    for n in needs:
        t = cargo_mod.version_tuple(n.version)
        if t and (best is None or t > cargo_mod.version_tuple(best.version)):
            best = n
    return best


# ------------------------------------------------------------------------------------------------ protoc
# build scripts that run a protobuf compiler: prost-build and tonic's builders call `protoc` (PROTOC or
# PATH) unless they are handed a descriptor set made by a pure-Rust compiler
PROTOC_USERS = re.compile(r"\b(tonic_prost_build|tonic_build|prost_build)\s*::")
# crates that make a system protoc unnecessary: protox (the pure-Rust compiler vLLM moved to, vllm#52892),
# or a protoc built or shipped by a crate
PROTOC_FREE = ("protox", "protobuf-src", "protoc-bin-vendored")


def protoc_need(files: dict[str, str], lock_paths: list[str], read: Callable[[str], str]) -> dict | None:
    """Whether building the Cargo.lock files' packages runs a system ``protoc``: None when no build
    script of the tree uses a protobuf builder; else {"needed", "build_scripts": [path: builder],
    "compiler": the crate that replaces protoc, or None}."""
    users: list[str] = []
    for lp in lock_paths:
        folder = PurePosixPath(lp).parent.as_posix()
        prefix = "" if folder == "." else folder + "/"
        for path in sorted(files):
            parts = path.split("/")
            if parts[-1] != "build.rs" or not path.startswith(prefix) \
                    or any(p in cargo_mod.SKIP_DIRS or p.startswith(".") for p in parts[:-1]):
                continue
            m = PROTOC_USERS.search(read(files[path]))
            if m and f"{path}: {m.group(1)}" not in users:
                users.append(f"{path}: {m.group(1)}")
    if not users:
        return None
    free = None
    for lp in lock_paths:
        if lp in files:
            text = read(files[lp])
            free = next((c for c in PROTOC_FREE if re.search(r'^name = "' + re.escape(c) + r'"$', text, re.M)), None)
            if free:
                break
    return {"needed": free is None, "build_scripts": users, "compiler": free}
