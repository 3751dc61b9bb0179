"""What a stage that builds git sources gets from prefetch: every source extracted, every override set.

A stage lists the git sources it builds (image.yaml ``sources:`` of the stage). It receives
those and, recursively, the FetchContent dependencies the lock records for them (``dependency_of``)
in the named build context ``imagebuild-src``, plus two generated files:

- ``imagebuild-src.sh``: sourced in a ``RUN`` that binds the context, it checks each tarball
  against the lock's sha256, extracts it to ``/imagebuild/work/<name>`` and sets every override
  the way the tree reads it: an environment variable (``VLLM_CUTLASS_SRC_DIR``,
  ``TRITON_KERNELS_SRC_DIR``) or a ``-D`` setting added to ``CMAKE_ARGS`` (which vLLM's setup.py
  passes to CMake) and ``IMAGEBUILD_CMAKE_ARGS`` (for a Dockerfile that calls cmake itself). It
  exports ``IMAGEBUILD_SRC_<NAME>`` for each source and prints what it did, and which declared
  dependencies are excluded on purpose, into the build log;
- ``imagebuild-src.json``: the same as data (``source_mounts`` below, ``Mounts.as_dict``).

One line in a Dockerfile gets all of it::

    RUN --mount=type=bind,from=imagebuild-src,target=/imagebuild/src \\
        . /imagebuild/src/imagebuild-src.sh && cd "$IMAGEBUILD_SRC_VLLM" && pip wheel ...

Everything here is a pure function of the definition's stage and the lock: the same lock gives
the same bytes (no timestamps, no host paths), so the stage key can cover it exactly
(``Mounts.key_inputs``). ``imagebuild plan`` shows it per stage. docs/prefetch.md, "In the build".
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass, field

from imagebuild.core.fsutil import sha256_bytes

CONTEXT = "imagebuild-src"  # the named build context
MOUNT = "/imagebuild/src"  # where a Dockerfile binds it (read-only)
WORK = "/imagebuild/work"  # where the sources are extracted
SCRIPT = "imagebuild-src.sh"
MANIFEST = "imagebuild-src.json"
SCHEMA = "imagebuild.source-mounts"
VERSION = 1
CARGO_VENDOR = f"{WORK}/cargo-vendor"  # every vendored crate of the stage's sources (fetch/cargo.py)
CARGO_HOME = f"{WORK}/cargo-home"  # a fresh CARGO_HOME whose config.toml replaces crates-io with it
CARGO_SUFFIX = ".cargo-vendor"  # the mount of NAME's crates is NAME.cargo-vendor
CARGO_DIR_PLACEHOLDER = "@IMAGEBUILD_CARGO_VENDOR_DIR@"  # fetch/cargo.py writes it in the lock's config
RUST_SUFFIX = ".rust-"  # the mount of NAME's pinned Rust toolchain archives: NAME.rust-rustc, ... (fetch/rust_dist.py)
RUST_DIST = f"{WORK}/rust-dist"  # where they are extracted
RUST_PREFIX = f"{WORK}/rust"  # where their components are installed (bin/ first on PATH)


def context_file(name: str, tarball: str) -> str:
    """The name of mount ``name``'s tarball in the named context: ``<name>`` with the suffix of the
    lock's file (``.tar`` for the sources prefetch packs, FORMAT 2; ``.tar.gz`` for a lock packed
    with FORMAT 1 and for the Rust toolchain's release archives), so a Dockerfile that reads a file
    itself sees what it is, and the generated script extracts it by that suffix (``tar -xf`` or
    ``tar -xzf``: BusyBox's tar, as Debian builds it, does not detect gzip by itself)."""
    return f"{name}{'.tar.gz' if str(tarball).endswith('.tar.gz') else '.tar'}"


@dataclass(frozen=True)
class Override:
    name: str  # VLLM_CUTLASS_SRC_DIR, FETCHCONTENT_SOURCE_DIR_ONEDNN, ...
    via: str  # "env" (an environment variable) or "cmake" (a -D setting)
    value: str  # the folder it points at

    def as_dict(self) -> dict:
        return {"name": self.name, "via": self.via, "value": self.value}


@dataclass(frozen=True)
class Mount:
    name: str  # the git source (versions.env NAME)
    tarball: str  # path in the project (the lock's)
    file: str  # its name in the named context
    sha256: str  # the lock's
    dir: str  # where it is extracted in the build
    dependency_of: str | None
    overrides: tuple[Override, ...] = ()
    commit: str | None = None  # the (composed) commit the tarball is
    version: str | None = None  # its setuptools-scm version (fetch/compose.scm_version)

    def as_dict(self) -> dict:
        return {"name": self.name, "tarball": self.tarball, "file": self.file, "sha256": self.sha256,
                "dir": self.dir, "dependency_of": self.dependency_of, "commit": self.commit,
                "version": self.version, "overrides": [o.as_dict() for o in self.overrides]}


@dataclass(frozen=True)
class Excluded:
    name: str  # the FetchContent name
    declared_by: str  # the source whose tree declares it
    reason: str
    where: str  # file:line

    def as_dict(self) -> dict:
        return {"name": self.name, "declared_by": self.declared_by, "reason": self.reason, "where": self.where}


@dataclass(frozen=True)
class Mounts:
    stage: str
    sources: tuple[str, ...]  # as the stage lists them
    mounts: tuple[Mount, ...] = ()
    excluded: tuple[Excluded, ...] = ()
    missing: tuple[str, ...] = field(default=())  # sources the lock has no usable entry for
    cargo: tuple[tuple[str, str, tuple[str, ...]], ...] = ()  # (source, cargo's config, Cargo.lock paths)
    rust: tuple[tuple[str, str, str, str], ...] = ()  # (source, version, target, toolchain file): pinned toolchains

    def cargo_config(self, vendor_dir: str = CARGO_VENDOR) -> str | None:
        """The config.toml of the stage's CARGO_HOME: each source's replacement of crates-io (and of
        its git sources) by ``vendor_dir``, every table once, and ``net.offline = true``; None when
        no source has crates."""
        if not self.cargo:
            return None
        seen: set[str] = set()
        out: list[str] = []
        for _name, text, _locks in self.cargo:
            for header, body in _toml_tables(text.replace(CARGO_DIR_PLACEHOLDER, vendor_dir)):
                if header in seen or header == "[net]":
                    continue
                seen.add(header)
                out += [header, *body, ""]
        return "\n".join(out + ["[net]", "offline = true"]) + "\n"

    @property
    def complete(self) -> bool:
        return not self.missing

    def as_dict(self) -> dict:
        return {"schema": SCHEMA, "version": VERSION, "stage": self.stage, "sources": list(self.sources),
                "context": CONTEXT, "mount": MOUNT, "work": WORK, "script": SCRIPT,
                "mounts": [m.as_dict() for m in self.mounts], "excluded": [x.as_dict() for x in self.excluded],
                "missing": list(self.missing),
                "cargo": {"home": CARGO_HOME, "vendor": CARGO_VENDOR,
                          "lockfiles": {n: list(locks) for n, _t, locks in self.cargo}} if self.cargo else None,
                # only when there is one: the manifests of stages without stay the same bytes
                **({"rust": {"prefix": RUST_PREFIX, "toolchains": [
                    {"source": n, "version": v, "target": t, "file": f} for n, v, t, f in self.rust]}} if self.rust else {})}

    def script(self) -> str:
        return _script(self)

    def manifest(self) -> str:
        return json.dumps(self.as_dict(), indent=2, sort_keys=True) + "\n"

    def files(self) -> dict[str, bytes]:
        """The generated files the named context holds beside the tarballs."""
        if not self.sources:
            return {}
        return {SCRIPT: self.script().encode(), MANIFEST: self.manifest().encode()}

    def key_inputs(self) -> dict:
        """Everything the stage receives through ``imagebuild-src``, for its cache key: each
        tarball by its locked sha256 and the generated files by theirs."""
        return {"tarballs": {m.file: m.sha256 for m in self.mounts},
                "generated": {n: sha256_bytes(b) for n, b in sorted(self.files().items())}}


def closure(lock: dict | None, names: Iterable[str]) -> list[str]:
    """The sources a stage lists plus, recursively, the FetchContent dependencies the lock records
    for them (``dependency_of``), in a fixed order: the stage's own first, then breadth first."""
    srcs = (lock or {}).get("sources") or {}
    out: list[str] = []
    todo = list(names)
    while todo:
        n = todo.pop(0)
        if n in out:
            continue
        out.append(n)
        todo += sorted(k for k, v in srcs.items() if isinstance(v, dict) and v.get("dependency_of") == n)
    return out


def folder(name: str) -> str:
    return f"{WORK}/{re.sub(r'[^a-z0-9._-]', '_', name.lower())}"


def source_mounts(lock: dict | None, stage: str, sources: Iterable[str]) -> Mounts:
    """What stage ``stage`` (listing ``sources``) receives, from the lock alone."""
    sources = tuple(sources)
    srcs = (lock or {}).get("sources") or {}
    mounts: list[Mount] = []
    excluded: list[Excluded] = []
    missing: list[str] = []
    cargo: list[tuple[str, str, tuple[str, ...]]] = []
    rust: list[tuple[str, str, str, str]] = []
    for name in closure(lock, sources):
        e = srcs.get(name)
        if not isinstance(e, dict) or not e.get("tarball") or not e.get("sha256"):
            missing.append(name)
            continue
        where = folder(name)
        ovs: list[Override] = []
        ov = e.get("override")
        if isinstance(ov, dict) and ov.get("name"):
            ovs.append(Override(ov["name"], "env" if ov.get("via") == "env" else "cmake", where))
        elif e.get("env"):  # a lock written before overrides were checked: as the environment
            ovs.append(Override(e["env"], "env", where))
        mounts.append(Mount(name, e["tarball"], context_file(name, e["tarball"]), e["sha256"], where,
                            e.get("dependency_of"), tuple(ovs), _str(e.get("commit")), _str(e.get("version"))))
        cg = e.get("cargo")
        if isinstance(cg, dict):  # its Rust crates (every Cargo.lock of the tree), vendored
            if not cg.get("tarball") or not cg.get("sha256") or not isinstance(cg.get("config"), str):
                missing.append(name + CARGO_SUFFIX)
            else:
                mounts.append(Mount(name + CARGO_SUFFIX, cg["tarball"], context_file(name + CARGO_SUFFIX, cg["tarball"]),
                                    cg["sha256"], CARGO_VENDOR, name))
                locks = tuple(str(x.get("path")) for x in cg.get("lockfiles") or [] if isinstance(x, dict))
                cargo.append((name, cg["config"], locks))
            td = cg.get("toolchain_dist")
            if isinstance(td, dict):  # the Rust toolchain its tree names, as release archives
                arcs = [a for a in td.get("archives") or () if isinstance(a, dict)]
                if not arcs or any(not (a.get("tarball") and a.get("sha256") and a.get("component")) for a in arcs):
                    missing.append(name + RUST_SUFFIX + "toolchain")
                else:
                    for a in arcs:
                        mname = name + RUST_SUFFIX + str(a["component"])
                        mounts.append(Mount(mname, a["tarball"], context_file(mname, a["tarball"]), a["sha256"],
                                            f"{RUST_DIST}/{name.lower()}-{a['component']}", name))
                    rust.append((name, str(td.get("version")), str(td.get("target")), str(td.get("file"))))
        for x in e.get("excluded") or []:
            if isinstance(x, dict) and x.get("name"):
                excluded.append(Excluded(x["name"], name, str(x.get("reason", "")),
                                         f"{x.get('file')}:{x.get('line')}"))
    if len({(v, t) for _n, v, t, _f in rust}) > 1:
        missing.append("one Rust toolchain (the sources name " + ", ".join(f"{n}: {v}" for n, v, _t, _f in rust) + ")")
    return Mounts(stage, sources, tuple(mounts), tuple(excluded), tuple(missing), tuple(cargo), tuple(rust[:1]))


def _toml_tables(text: str) -> list[tuple[str, list[str]]]:
    """(header, lines) of each table of the config ``cargo vendor`` printed (comments dropped)."""
    out: list[tuple[str, list[str]]] = []
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("["):
            out.append((line, []))
        elif out:
            out[-1][1].append(line)
    return out


def _q(text: str) -> str:
    import shlex  # only for a stage that mounts sources

    return shlex.quote(text)


def _script(ms: Mounts) -> str:
    env = [(o.name, o.value) for m in ms.mounts for o in m.overrides if o.via == "env"]
    cmake = [f"-D{o.name}={o.value}" for m in ms.mounts for o in m.overrides if o.via == "cmake"]
    lines = [
        "# generated by imagebuild from the image's lock.json: do not edit (docs/prefetch.md, \"In the build\")",
        f"# stage {ms.stage or '-'}: sources {' '.join(ms.sources)}",
        "# Use it in one RUN that binds the named context, then build:",
        f"#   RUN --mount=type=bind,from={CONTEXT},target={MOUNT} \\",
        f"#       . {MOUNT}/{SCRIPT} && cd \"$IMAGEBUILD_SRC_{_var(ms.sources[0]) if ms.sources else 'NAME'}\" && ...",
        "# It checks each tarball against the lock's sha256, extracts it, and sets every override the way",
        "# the tree reads it (environment, or -D in CMAKE_ARGS and IMAGEBUILD_CMAKE_ARGS).",
        "_imagebuild_src() {",
        "    # $1 name  $2 file in the context  $3 sha256  $4 folder",
        "    if command -v sha256sum >/dev/null 2>&1; then",
        f"        echo \"$3  {MOUNT}/$2\" | sha256sum -c >/dev/null 2>&1 || {{",
        f"            echo \"imagebuild-src: {MOUNT}/$2 ($1) does not match the lock's sha256 $3\" >&2; return 1; }}",
        "    fi",
        "    mkdir -p \"$4\" || return 1",
        # by the name's suffix, not by tar's own detection: BusyBox's tar (Debian's) -xf reads no gzip
        "    case \"$2\" in",
        f"        *.gz) tar -xzf \"{MOUNT}/$2\" -C \"$4\" ;;  # a lock packed by tarball format 1; Rust's archives",
        f"        *) tar -xf \"{MOUNT}/$2\" -C \"$4\" ;;  # a plain tar (tarball format 2)",
        "    esac || { echo \"imagebuild-src: cannot extract $2 ($1)\" >&2; return 1; }",
        "    echo \"imagebuild-src: $1 -> $4\" >&2",
        "}",
    ]
    if ms.missing:
        lines.append(f"echo {_q('imagebuild-src: not prefetched: ' + ', '.join(ms.missing))} >&2; return 1 2>/dev/null"
                     " || exit 1")
    for m in ms.mounts:
        lines.append(f"_imagebuild_src {_q(m.name)} {_q(m.file)} {m.sha256} {_q(m.dir)} || return 1 2>/dev/null"
                     " || exit 1")
        lines.append(f"export IMAGEBUILD_SRC_{_var(m.name)}={_q(m.dir)}")
        if m.commit:
            lines.append(f"export IMAGEBUILD_COMMIT_{_var(m.name)}={_q(m.commit)}")
        if m.version:
            lines.append(f"export IMAGEBUILD_VERSION_{_var(m.name)}={_q(m.version)}")
    for name, value in env:
        lines.append(f"export {name}={_q(value)}")
        lines.append(f"echo {_q(f'imagebuild-src: {name}={value} (environment)')} >&2")
    if cmake:
        args = " ".join(cmake)
        lines.append(f"export IMAGEBUILD_CMAKE_ARGS={_q(args)}")
        lines.append('export CMAKE_ARGS="${CMAKE_ARGS:+$CMAKE_ARGS }$IMAGEBUILD_CMAKE_ARGS"')
        for a in cmake:
            lines.append(f"echo {_q(f'imagebuild-src: {a} (CMAKE_ARGS)')} >&2")
    else:
        lines.append("export IMAGEBUILD_CMAKE_ARGS=")
    cfg = ms.cargo_config()
    if cfg is not None:  # Rust crates: a fresh CARGO_HOME whose config points cargo at the vendored ones
        locks = "; ".join(f"{n}: {', '.join(ls)}" for n, _t, ls in ms.cargo)
        lines.append(f"mkdir -p {CARGO_HOME} || return 1 2>/dev/null || exit 1")
        lines.append(f"cat > {CARGO_HOME}/config.toml <<'IMAGEBUILD_CARGO_CONFIG'")
        lines += cfg.rstrip("\n").split("\n")
        lines.append("IMAGEBUILD_CARGO_CONFIG")
        lines.append(f"export CARGO_HOME={CARGO_HOME} CARGO_NET_OFFLINE=true")
        lines.append(f"echo {_q(f'imagebuild-src: CARGO_HOME={CARGO_HOME}: crates-io replaced by {CARGO_VENDOR}, offline ({locks})')} >&2")
    for name, version, target, tfile in ms.rust:  # the pinned toolchain: each archive's components, no rustup
        lines.append(f"mkdir -p {RUST_PREFIX} || return 1 2>/dev/null || exit 1")
        lines.append(f"for _d in {RUST_DIST}/*/*/; do for _c in $(cat \"$_d/components\"); do "
                     f"cp -a \"$_d/$_c/.\" {RUST_PREFIX}/ || exit 1; done; done || return 1 2>/dev/null || exit 1")
        lines.append(f"rm -f {RUST_PREFIX}/manifest.in")
        lines.append(f'export PATH="{RUST_PREFIX}/bin:$PATH"')
        lines.append(f"echo {_q(f'imagebuild-src: Rust {version} for {target} ({name}: {tfile}) installed in {RUST_PREFIX}, first on PATH')} >&2")
    for x in ms.excluded:
        text = (f"imagebuild-src: {x.name} is excluded on purpose ({x.reason}; declared by {x.declared_by} at "
                f"{x.where}): it is not in this build, so a step that needs it fails offline")
        lines.append(f"echo {_q(text)} >&2")
    lines.append("unset -f _imagebuild_src")
    return "\n".join(lines) + "\n"


def _str(value) -> str | None:
    return value if isinstance(value, str) and value else None


def _var(name: str) -> str:
    return re.sub(r"[^A-Z0-9_]", "_", name.upper())
