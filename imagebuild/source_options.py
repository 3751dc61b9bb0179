"""The ``sources:`` part of an image definition: how prefetch treats each git source.

Pure parsing and validation of image.yaml's top-level ``sources:`` mapping (no network, no
subprocess); ``definition.load`` calls ``source_options`` and keeps the result on
``Definition.source_options``. The format is documented in docs/image-definition.md ("Git
sources and FetchContent dependencies"); what prefetch does with it in docs/prefetch.md.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import PurePosixPath

from . import envfile, yamlread

SOURCE_KEYS = ("scan_fetchcontent", "dependency_of", "declares", "env", "subdir", "submodules")
ENV_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


@dataclass(frozen=True)
class SourceOptions:
    """How prefetch treats one git source (image.yaml ``sources:``; docs/image-definition.md)."""

    name: str
    scan_fetchcontent: bool  # read FetchContent_Declare calls in the composed tree
    dependency_of: str | None  # the source whose FetchContent declaration this one satisfies
    declares: str  # the FetchContent name it satisfies (default: NAME lower-case)
    env: str | None  # the override variable the build points at it
    subdir: str | None  # only this folder of the tree is packed
    submodules: bool  # pack the submodules (recursively) too
    line: int | None = None  # where image.yaml declares it (None: defaults)


def default_source_options(name: str) -> SourceOptions:
    return SourceOptions(name, True, None, name.lower(), None, None, False)



def source_options(spec: yamlread.Node, yfile: str, env: envfile.EnvFile, sources: Mapping[str, object],
                   err: Callable[..., None]) -> dict[str, SourceOptions]:
    """image.yaml ``sources:``: per git source, how prefetch finds, fetches and packs it."""
    out = {name: default_source_options(name) for name in sources}
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
        for key in ("scan_fetchcontent", "submodules"):
            if key in m:
                if not isinstance(m[key].value, bool):
                    err(yfile, "expected true or false", line=m[key].line, key=f"{where}.{key}")
                else:
                    vals[key] = m[key].value
        for key in ("dependency_of", "declares", "env", "subdir"):
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
        if "env" in vals and not ENV_NAME_RE.match(vals["env"]):
            err(yfile, f"invalid variable name {vals['env']!r}", line=kl("env"), key=f"{where}.env",
                  hint="e.g. VLLM_CUTLASS_SRC_DIR or FETCHCONTENT_SOURCE_DIR_CUTLASS")
            vals.pop("env")
        if "subdir" in vals:
            sp = PurePosixPath(vals["subdir"])
            if sp.is_absolute() or ".." in sp.parts or "\\" in vals["subdir"] or str(sp) == ".":
                err(yfile, f"subdir {vals['subdir']!r} must be a relative path inside the repository "
                      "(no absolute path, no '..')", line=kl("subdir"), key=f"{where}.subdir")
                vals.pop("subdir")
            else:
                vals["subdir"] = sp.as_posix()
        declares = vals.get("declares", name.lower())
        env_var = vals.get("env")
        if env_var is None and vals.get("dependency_of"):
            env_var = "FETCHCONTENT_SOURCE_DIR_" + re.sub(r"[^A-Z0-9_]", "_", declares.upper())
        out[name] = SourceOptions(
            name=name,
            scan_fetchcontent=vals.get("scan_fetchcontent", not vals.get("dependency_of")),
            dependency_of=vals.get("dependency_of"), declares=declares, env=env_var,
            subdir=vals.get("subdir"), submodules=vals.get("submodules", False), line=line)
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
    return out


def _unknown_keys(node: yamlread.Node, allowed: tuple[str, ...], file: str, where: str,
                  err: Callable[..., None]) -> None:
    for key, line in (node.key_lines or {}).items():
        if key not in allowed:
            close = difflib.get_close_matches(key, allowed, n=1)
            err(file, f"unknown key {key!r} in {where}", line=line, key=key,
                hint=f"did you mean {close[0]!r}?" if close else f"allowed: {', '.join(allowed)}")
