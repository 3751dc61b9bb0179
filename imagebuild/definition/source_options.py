"""The ``sources:`` part of an image definition: how prefetch treats each git source.

Pure parsing and validation of image.yaml's top-level ``sources:`` mapping (no network, no
subprocess); ``definition.load`` calls ``source_options`` and keeps the result on
``Definition.source_options``. The format is documented in docs/image-definition.md ("Git
sources and FetchContent dependencies"); what prefetch does with it in docs/prefetch.md.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import PurePosixPath

from imagebuild.core import lazy, yamlread
from imagebuild.core.errors import excerpt
from imagebuild.definition import envfile

difflib = lazy.module("difflib")  # error hints only

SOURCE_KEYS = ("scan_fetchcontent", "dependency_of", "declares", "env", "subdir", "submodules", "exclude",
               "cargo_switch", "rust_toolchain")
RUST_TOOLCHAINS = ("dist",)  # sources.NAME.rust_toolchain: the release archives the tree's toolchain file names
ENV_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
# an override may also be a CMake cache variable, which may hold '-', '.', '+'
# (FetchContent's own FETCHCONTENT_SOURCE_DIR_VLLM-FLASH-ATTN); only ENV_NAME_RE names can be env vars
OVERRIDE_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_.+-]*\Z")
FETCHCONTENT_NAME_RE = re.compile(r"[A-Za-z0-9_.+-]+\Z")
SUBMODULES_DECLARED = "declared"  # the lock's word for "as the FetchContent declaration asks"


@dataclass(frozen=True)
class SourceOptions:
    """How prefetch treats one git source (image.yaml ``sources:``; docs/image-definition.md)."""

    name: str
    scan_fetchcontent: bool  # read FetchContent_Declare calls in the composed tree
    dependency_of: str | None  # the source whose FetchContent declaration this one satisfies
    declares: str  # the FetchContent name it satisfies (default: NAME lower-case)
    env: str | None  # the override variable, as written; None: the one the tree reads (prefetch finds it)
    subdir: str | None  # only this folder of the tree is packed
    # which submodules to pack: None = as the declaration's GIT_SUBMODULES asks (a dependency) or none
    # (a top-level source); True = all, recursively; False = none; a tuple = those paths
    submodules: bool | tuple[str, ...] | None = None
    line: int | None = None  # where image.yaml declares it (None: defaults)
    # FetchContent declarations of this source's tree that no source pins, on purpose: (name, reason)
    exclude: tuple[tuple[str, str], ...] = ()
    # a versions.env key prefetch sets to 1 when the composed tree has Rust crates (a Cargo.lock it
    # vendored), else 0 (VLLM_REQUIRE_RUST_FRONTEND); None: none
    cargo_switch: str | None = None
    # "dist": prefetch fetches the Rust release archives the tree's toolchain file names (rustc,
    # cargo, rust-std for the platform) and the stage installs them; None: the stage's own (apt, base)
    rust_toolchain: str | None = None

    def setting(self) -> dict:
        """The settings as the lock records them (compared by prefetch's no-change check)."""
        sub = self.submodules
        return {"scan_fetchcontent": self.scan_fetchcontent, "dependency_of": self.dependency_of,
                "declares": self.declares, "env": self.env, "subdir": self.subdir,
                "submodules": SUBMODULES_DECLARED if sub is None else (list(sub) if isinstance(sub, tuple) else sub),
                "exclude": {n: r for n, r in self.exclude},
                # only when set: the settings of locks written before it stay the same
                **({"cargo_switch": self.cargo_switch} if self.cargo_switch else {}),
                **({"rust_toolchain": self.rust_toolchain} if self.rust_toolchain else {})}

    def excluded(self, declared_name: str) -> str | None:
        """The reason ``declared_name`` is excluded, or None."""
        for n, r in self.exclude:
            if n.lower() == declared_name.lower():
                return r
        return None


def default_source_options(name: str) -> SourceOptions:
    return SourceOptions(name, True, None, name.lower(), None, None, None)


def source_options(spec: yamlread.Node, yfile: str, env: envfile.EnvFile, sources: Mapping[str, object],
                   err: Callable[..., None]) -> dict[str, SourceOptions]:
    """image.yaml ``sources:``: per git source, how prefetch finds, fetches and packs it."""
    out = {name: default_source_options(name) for name in sources}
    lines: dict[str, dict[str, int]] = {}  # name -> key -> line
    node = spec.value.get("sources")
    if node is None:
        return out
    if not isinstance(node.value, dict):
        err(yfile, "expected a mapping of git source names (versions.env NAME_REPO) to options",
              line=node.line, key="sources")
        return out
    for name, opts in node.value.items():
        where = f"sources.{name}"
        line = (node.key_lines or {}).get(name, opts.line)
        if name not in sources:
            if env.get(f"{name}_REPO") is None:
                close = difflib.get_close_matches(name, list(sources), n=1)
                err(yfile, f"unknown git source {name!r}: versions.env has no {name}_REPO", line=line,
                    key=where, hint=f"did you mean {close[0]!r}?" if close else
                    f"known sources: {', '.join(sorted(sources)) or 'none'}")
            continue
        if opts.value is None:
            continue
        if not isinstance(opts.value, dict):
            err(yfile, "expected a mapping of options", line=opts.line, key=where,
                hint=f"allowed: {', '.join(SOURCE_KEYS)}")
            continue
        _unknown_keys(opts, SOURCE_KEYS, yfile, where, err)
        m = opts.value
        vals: dict = {}
        if "scan_fetchcontent" in m:
            if not isinstance(m["scan_fetchcontent"].value, bool):
                err(yfile, "expected true or false", line=m["scan_fetchcontent"].line,
                    key=f"{where}.scan_fetchcontent")
            else:
                vals["scan_fetchcontent"] = m["scan_fetchcontent"].value
        if "submodules" in m:
            sub = _submodules(m["submodules"], yfile, f"{where}.submodules", err)
            if sub is not _BAD:
                vals["submodules"] = sub
        if "exclude" in m:
            ex = _exclude(m["exclude"], yfile, f"{where}.exclude", err)
            if ex is not _BAD:
                vals["exclude"] = ex
        for key in ("dependency_of", "declares", "env", "subdir", "cargo_switch", "rust_toolchain"):
            if key in m:
                v = m[key].value
                if not isinstance(v, str) or not v.strip():
                    err(yfile, "expected a non-empty string", line=m[key].line, key=f"{where}.{key}")
                    continue
                vals[key] = v
        kl = lambda k, m=m: m[k].line  # noqa: E731
        dep = vals.get("dependency_of")
        if dep is not None and dep not in sources:
            err(yfile, f"dependency_of {dep!r} is not a git source (versions.env has no {dep}_REPO)",
                line=kl("dependency_of"), key=f"{where}.dependency_of")
            vals.pop("dependency_of")
        elif dep == name:
            err(yfile, "a source cannot be a dependency of itself", line=kl("dependency_of"),
                key=f"{where}.dependency_of")
            vals.pop("dependency_of")
        if "env" in vals and not OVERRIDE_NAME_RE.match(vals["env"]):
            err(yfile, f"invalid variable name {vals['env']!r}", line=kl("env"), key=f"{where}.env",
                hint="e.g. VLLM_CUTLASS_SRC_DIR or FETCHCONTENT_SOURCE_DIR_CUTLASS")
            vals.pop("env")
        if "cargo_switch" in vals and not ENV_NAME_RE.match(vals["cargo_switch"]):
            err(yfile, f"invalid versions.env key {vals['cargo_switch']!r}", line=kl("cargo_switch"),
                key=f"{where}.cargo_switch", hint="e.g. VLLM_REQUIRE_RUST_FRONTEND")
            vals.pop("cargo_switch")
        if "rust_toolchain" in vals and vals["rust_toolchain"] not in RUST_TOOLCHAINS:
            err(yfile, f"unknown rust_toolchain {vals['rust_toolchain']!r}", line=kl("rust_toolchain"),
                key=f"{where}.rust_toolchain", hint=f"allowed: {', '.join(RUST_TOOLCHAINS)} (or leave it out: the "
                "stage's own toolchain, from apt or the base)")
            vals.pop("rust_toolchain")
        if "subdir" in vals:
            sp = PurePosixPath(vals["subdir"])
            if sp.is_absolute() or ".." in sp.parts or "\\" in vals["subdir"] or str(sp) == ".":
                err(yfile, f"subdir {vals['subdir']!r} must be a relative path inside the repository "
                    "(no absolute path, no '..')", line=kl("subdir"), key=f"{where}.subdir")
                vals.pop("subdir")
            else:
                vals["subdir"] = sp.as_posix()
        declares = vals.get("declares", name.lower())
        out[name] = SourceOptions(
            name=name,
            scan_fetchcontent=vals.get("scan_fetchcontent", not vals.get("dependency_of")),
            dependency_of=vals.get("dependency_of"), declares=declares, env=vals.get("env"),
            subdir=vals.get("subdir"), submodules=vals.get("submodules"), line=line,
            exclude=vals.get("exclude", ()), cargo_switch=vals.get("cargo_switch"),
            rust_toolchain=vals.get("rust_toolchain"))
        lines[name] = {k: m[k].line for k in m}
    # no cycles through dependency_of
    in_cycle: set[str] = set()
    for name in out:
        seen, cur = [name], out[name].dependency_of
        while cur is not None and cur in out:
            if cur in seen:
                if cur not in in_cycle:
                    in_cycle.update(seen)
                    err(yfile, f"dependency_of forms a cycle: {' -> '.join(seen + [cur])}",
                        line=out[name].line, key=f"sources.{name}.dependency_of")
                break
            seen.append(cur)
            cur = out[cur].dependency_of
    # a declaration is either pinned by a source or excluded by its parent, not both
    for name, o in out.items():
        parent = out.get(o.dependency_of) if o.dependency_of else None
        reason = parent.excluded(o.declares) if parent else None
        if reason is not None:
            err(yfile, f"{name} pins {o.declares!r} for {o.dependency_of}, which also excludes it "
                f"({reason!r})", line=lines.get(o.dependency_of, {}).get("exclude", o.line),
                key=f"sources.{o.dependency_of}.exclude",
                hint=f"remove {o.declares!r} from sources.{o.dependency_of}.exclude, or remove {name}")
    return out


_BAD = object()


def _submodules(node: yamlread.Node, yfile: str, key: str, err: Callable[..., None]):
    """true / false / a list of submodule paths (relative, no '..')."""
    v = node.value
    if isinstance(v, bool):
        return v
    if isinstance(v, list):
        paths: list[str] = []
        ok = True
        for item in v:
            p = item.value
            sp = PurePosixPath(p) if isinstance(p, str) and p.strip() else None
            if sp is None or sp.is_absolute() or ".." in sp.parts or "\\" in p or str(sp) == ".":
                err(yfile, f"submodule path {p!r} must be a relative path inside the repository",
                    line=item.line, key=key)
                ok = False
                continue
            if sp.as_posix() in paths:
                err(yfile, f"submodule path {p!r} is listed twice", line=item.line, key=key)
                ok = False
                continue
            paths.append(sp.as_posix())
        return tuple(paths) if ok else _BAD
    err(yfile, "expected true (all, recursively), false (none) or a list of submodule paths", line=node.line,
        key=key, hint="leave it out to take what the FetchContent declaration's GIT_SUBMODULES asks for")
    return _BAD


def _exclude(node: yamlread.Node, yfile: str, key: str, err: Callable[..., None]):
    """{FetchContent name: reason}: declarations the image leaves out on purpose."""
    if not isinstance(node.value, dict):
        err(yfile, "expected a mapping of FetchContent names to the reason each is left out", line=node.line,
            key=key, hint='e.g. exclude: {oneDNN: "CPU-only; this image builds for CUDA"}')
        return _BAD
    out: list[tuple[str, str]] = []
    ok = True
    for name, reason in node.value.items():
        line = (node.key_lines or {}).get(name, reason.line)
        if not FETCHCONTENT_NAME_RE.match(str(name)):
            err(yfile, f"{name!r} is not a FetchContent name", line=line, key=f"{key}.{name}")
            ok = False
        elif not isinstance(reason.value, str) or not reason.value.strip():
            err(yfile, f"exclusion of {name!r} needs a reason (a non-empty string)", line=line,
                key=f"{key}.{name}", hint='say why this image does not need it, e.g. "CPU-only; this image '
                'builds for CUDA"')
            ok = False
        elif any(n.lower() == str(name).lower() for n, _ in out):
            err(yfile, f"{name!r} is excluded twice", line=line, key=f"{key}.{name}")
            ok = False
        else:
            out.append((str(name), reason.value.strip()))
    return tuple(sorted(out, key=lambda t: t[0].lower())) if ok else _BAD


def _unknown_keys(node: yamlread.Node, allowed: tuple[str, ...], file: str, where: str,
                  err: Callable[..., None]) -> None:
    for key, line in (node.key_lines or {}).items():
        if key not in allowed:
            close = difflib.get_close_matches(key, allowed, n=1)
            err(file, f"unknown key {excerpt(key)} in {where}", line=line, key=key,
                hint=f"did you mean {close[0]!r}?" if close else f"allowed: {', '.join(allowed)}")
