"""Resolve a stage's requirement set as a whole, for the definition's platform and Python, before
anything is downloaded (docs/packages.md, "Resolution").

The resolver is uv's ``pip compile`` (``--python-platform``, ``--python-version``): it evaluates
environment markers (``platform_machine``, ``python_version``, ...) for the target, not for the
host, and reads no pip configuration (no host find-links, no host constraints). pip's
``--platform`` / ``--python-version`` only change which wheel tags and Requires-Python are
accepted; its markers stay those of the interpreter that runs it, so a cross-target ``pip download``
or ``pip install --dry-run --report`` can pick the host's dependency set.

A stage whose parent chain has stages with wheels is resolved with the parents' locked pins as
constraints: it may install more, never another version of what a parent installed. A set that
does not resolve is bad input (``DefinitionError``, exit 2) naming the file and the conflicting
requirements; an index that does not answer, or a missing uv, is an operation failure (exit 1).
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from imagebuild.core import lazy, state
from imagebuild.core.errors import DefinitionError, OperationFailed, Problem
from imagebuild.definition import pkgspec
from imagebuild.definition import reader as d

log = lazy.logger()
run_mod = lazy.module("imagebuild.core.run")
shutil = lazy.module("shutil")
tempfile = lazy.module("tempfile")

RESOLVE_TIMEOUT_S = 1800
_UV_ARCH = {"linux/amd64": "x86_64", "linux/arm64": "aarch64"}
# the manylinux levels uv's --python-platform knows (uv 0.13: 2014 = 2_17, 2_28, 2_31 ... 2_40)
_UV_LEVELS = (40, 39, 38, 37, 36, 35, 34, 33, 32, 31, 28, 17)
_PIN_RE = lazy.compile(r"(?P<name>[A-Za-z0-9][A-Za-z0-9._-]*)==(?P<version>[^\s;\\]+)")
_SPEC_RE = lazy.compile(r"(?P<name>[A-Za-z0-9][A-Za-z0-9._-]*)(?:\[[^\]]*\])?(?P<spec>(?:[<>=!~]=?|===)[^\s,]+"
                        r"(?:,(?:[<>=!~]=?|===)[^\s,]+)*)?")


class Unavailable(OperationFailed):
    """The set does not resolve because the index has no version, or no wheel for the target, of
    ``specs``: what the index serves, not a conflict of the file (exit 1)."""

    def __init__(self, message: str, specs: list[str], *, hint: str | None = None):
        super().__init__(message, hint=hint)
        self.specs = specs


@dataclass(frozen=True)
class ParentPin:
    stage: str  # the parent stage that installs it
    name: str  # normalised
    version: str


def python_platform(platform: str, glibc: str) -> str:
    """uv's ``--python-platform`` for a glibc-``glibc`` system on ``platform``: the newest manylinux
    level uv knows that is not newer than the base's glibc."""
    arch = _UV_ARCH.get(platform)
    if arch is None:
        raise OperationFailed(f"the resolver has no target for {platform}",
                              hint="supported: " + ", ".join(sorted(_UV_ARCH)))
    minor = int(glibc.split(".")[1])
    level = next((m for m in _UV_LEVELS if m <= minor), None)
    if level is None:
        raise OperationFailed(f"glibc {glibc} is older than manylinux_2_17, the oldest level the resolver targets",
                              hint="set python.glibc to the base image's glibc (2.17 or newer)")
    return f"{arch}-manylinux_2_{level}"


def parent_pins(defn: d.Definition, stage: d.Stage, done: dict[str, list[tuple[str, str]]]) -> list[ParentPin]:
    """The wheels the stages above ``stage`` install: ``done`` maps a stage to its (name, version) set."""
    pins: list[ParentPin] = []
    st = stage
    while st.parent.kind == "stage":
        st = defn.stage(st.parent.name)
        pins += [ParentPin(st.name, name, version) for name, version in done.get(st.name, ())]
    return pins


def uv_argv() -> list[str]:
    return [sys.executable, "-m", "uv"]


def uv_version() -> str:
    proc = run_mod.run([*uv_argv(), "--version"], check=False, timeout=60)
    text = proc.stdout.decode("utf-8", "replace").strip()
    if proc.returncode != 0:
        raise OperationFailed(f"the resolver (uv) does not run in imagebuild's environment: {text[-200:]}",
                              hint=f"install it: {sys.executable} -m pip install uv (a dependency in "
                              "pyproject.toml)")
    return text.split("(")[0].strip()


def _env() -> dict[str, str | None]:
    # no UV_* setting of the host: the definition's indexes and this target only
    env: dict[str, str | None] = {k: None for k in os.environ if k.startswith("UV_")}
    env.update({"NO_COLOR": "1", "UV_NO_PROGRESS": "1"})
    return env


def resolve(defn: d.Definition, stage: d.Stage, index_args: list[str],
            parents: list[ParentPin]) -> list[tuple[str, str]]:
    """The whole set of (normalised name, version) that ``stage``'s requirements need on the target,
    with ``parents`` as constraints. Raises DefinitionError when it does not resolve."""
    req = stage.requirements
    py = defn.python
    by_parent = {p.name: p for p in parents}
    clashes = [(r, by_parent[r.key]) for r in req.items if r.key in by_parent
               and by_parent[r.key].version != r.version]
    if clashes:
        raise _refused(defn, stage, [
            (r.line, f"{r.spec()}, but stage {p.stage!r} installs {p.name}=={p.version} (its lock)")
            for r, p in clashes], hint="pin the parent's version here, or move the pin into the parent's "
            "requirements: a stage may add packages, never change what its parent installed")
    uv_version()  # a clear error when uv is missing
    work = Path(tempfile.mkdtemp(prefix=f".resolve-{stage.name}-", dir=_mkdir(state.state_dir(defn.root))))
    try:
        infile, cfile, outfile = work / "requirements.in", work / "constraints.txt", work / "resolved.txt"
        infile.write_text("".join(r.spec() + "\n" for r in req.items), encoding="utf-8")
        cfile.write_text("".join(f"{p.name}=={p.version}\n" for p in parents), encoding="utf-8")
        argv = [*uv_argv(), "pip", "compile", "--no-config", "--no-python-downloads", "--python", sys.executable,
                "--python-platform", python_platform(defn.platform, py.glibc), "--python-version", py.version,
                "--no-build", "--index-strategy", "unsafe-best-match", "--no-header", "--no-annotate",
                "--cache-dir", str(state.state_dir(defn.root) / "uv-cache"), *index_args,
                "-c", str(cfile), str(infile), "-o", str(outfile)]
        log.info("stage %s: resolving %s as one set for %s, CPython %s (uv pip compile)", stage.name, req.display,
                 defn.platform, py.version)
        proc = run_mod.run(argv, check=False, env=_env(), timeout=RESOLVE_TIMEOUT_S)
        out = proc.stdout.decode("utf-8", "replace")
        if proc.returncode != 0:
            raise resolution_error(defn, stage, out, parents)
        resolved = read_pins(outfile.read_text(encoding="utf-8"))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    moved = [(n, v, by_parent[n]) for n, v in resolved if n in by_parent and by_parent[n].version != v]
    if moved:  # a constraint ==X admits X+local: the exact version string must stay the parent's
        raise _refused(defn, stage, [f"the set resolves {n}=={v}, but stage {p.stage!r} installs {n}=={p.version}"
                                     for n, v, p in moved],
                       hint="pin the parent's exact version in this file")
    return resolved


def read_pins(text: str) -> list[tuple[str, str]]:
    """(normalised name, version) of each ``name==version`` line of a compiled requirements file."""
    out = []
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        m = _PIN_RE.match(line)
        if m:
            out.append((pkgspec.normalise(m.group("name")), m.group("version")))
    return sorted(set(out))


def explanation(out: str) -> list[str]:
    """The resolver's explanation of a failure, one sentence per line (uv's ``cause:`` lines)."""
    m = re.search(r"No solution found when resolving dependencies[^\n]*\n(?P<body>.*)", out, re.S)
    if not m:
        return []
    body = m.group("body").split("\nhint:", 1)[0]
    text = " ".join(re.sub(r"^\s*(?:cause:|[×╰─▶│]+)\s*", "", ln).strip() for ln in body.splitlines())
    return [s.strip() for s in re.split(r"(?<=\.)\s+(?=And because|Because)", " ".join(text.split())) if s.strip()]


def _requirement_spec(text: str) -> tuple[str, str] | None:
    m = _SPEC_RE.match(text.strip())
    if not m:
        return None
    return pkgspec.normalise(m.group("name")), (m.group("spec") or "")


def conflicts(defn: d.Definition, stage: d.Stage, sentences: list[str], parents: list[ParentPin]) -> list[str]:
    """The conflicting requirements the resolver names, each said with where it comes from: a line of
    the file, a parent stage's lock, or a dependency of a package (``X requires Y``)."""
    req = stage.requirements
    lines = {r.key: r for r in req.items}
    by_parent = {p.name: p for p in parents}
    out: list[str] = []
    for s in sentences:
        for m in re.finditer(r"(?:all versions of (?P<all>\S+) depend|(?P<who>\S+) depends) on "
                             r"(?P<what>[^\s,]+(?:,[<>=!~][^\s,]+)*)", s):
            who = _as_pinned(m.group("who"), lines) if m.group("who") else None
            if m.group("all"):  # uv's words when the index has one version of it: say the pinned one
                r = lines.get(pkgspec.normalise(m.group("all")))
                who = r.spec() if r is not None else m.group("all")
            out.append(f"{who} requires {m.group('what').rstrip('.')}")
        for m in re.finditer(r"(?<!that )you require (?P<list>.+?)(?:, we can conclude|\.?$)", s):
            for part in re.split(r",\s*|\s+and\s+", m.group("list")):
                parsed = _requirement_spec(part.rstrip("."))
                if parsed is None:
                    continue
                name, spec = parsed
                r = lines.get(name)
                if r is not None and spec == f"=={r.version}":
                    out.append(f"{req.display}:{r.line} pins {r.spec()}")
                elif name in by_parent and spec == f"=={by_parent[name].version}":
                    p = by_parent[name]
                    out.append(f"stage {p.stage!r} installs {name}=={p.version} (its lock; this stage's "
                               "set may not change it)")
        for p in parents:  # uv names a constraint only by its pin: which parent installs it
            if re.search(rf"(?<![\w.-]){re.escape(p.name)}=={re.escape(p.version)}(?![\w.+])", s):
                out.append(f"stage {p.stage!r} installs {p.name}=={p.version} (its lock; this stage's "
                           "set may not change it)")
        for m in re.finditer(r"there is no version of (?P<what>\S+)", s):
            out.append(f"no version of {m.group('what')} on the index for the target")
        for m in re.finditer(r"(?P<what>\S+) has no usable wheels", s):
            out.append(f"{m.group('what')} has no wheel for the target")
    return list(dict.fromkeys(out))


def _as_pinned(text: str, lines: dict) -> str:
    """uv's ``name<=1.0`` (a range of versions that behave alike) as the file's pin it covers."""
    from packaging.specifiers import InvalidSpecifier, SpecifierSet

    parsed = _requirement_spec(text)
    if parsed is None or parsed[0] not in lines:
        return text
    r = lines[parsed[0]]
    try:
        return r.spec() if not parsed[1] or r.version in SpecifierSet(parsed[1]) else text
    except InvalidSpecifier:
        return text


def unavailable(sentences: list[str]) -> list[str]:
    """The requirements the resolver found no wheel or no version of (``name==version`` as written)."""
    found = []
    for s in sentences:
        found += re.findall(r"there is no version of (\S+)", s) + re.findall(r"(\S+) has no usable wheels", s)
    return list(dict.fromkeys(found))


def target_text(defn: d.Definition) -> str:
    return f"{defn.platform}, CPython {defn.python.version}, manylinux glibc <= {defn.python.glibc}"


def resolution_error(defn: d.Definition, stage: d.Stage, out: str, parents: list[ParentPin]):
    req = stage.requirements
    sentences = explanation(out)
    if not sentences:
        tail = "\n".join("  | " + ln for ln in out.strip().splitlines()[-15:])
        return OperationFailed(f"stage {stage.name!r}: resolving {req.display} failed:\n{tail}",
                               hint="is the index reachable? (the index URLs come from versions.env via image.yaml)")
    found = conflicts(defn, stage, sentences, parents)
    missing = unavailable(sentences)
    if missing:
        return Unavailable(f"stage {stage.name!r}: {req.display} does not resolve for the target "
                           f"({target_text(defn)}): " + "; ".join(found), missing,
                           hint="pin a version the index has a wheel of for this platform and Python")
    lines = [f"conflicting requirements ({target_text(defn)}):"] + [f"  - {c}" for c in found]
    lines += ["resolver (uv pip compile):"] + [f"  {s}" for s in sentences]
    parent_hit = any(c.startswith("stage ") for c in found)
    hint = ("move the pins named above to versions that resolve together (`python -m uv pip compile --no-config "
            f"--python-platform {python_platform(defn.platform, defn.python.glibc)} --python-version "
            f"{defn.python.version} --no-build {req.display}` shows a resolution); the pins must resolve as one "
            "set, not one at a time")
    if parent_hit:
        hint = ("the set would change a version a parent stage installs: pin that version here, or change the "
                "parent's requirements; " + hint)
    return _refused(defn, stage, ["the pins do not resolve as one set:\n      " + "\n      ".join(lines)],
                    hint=hint)


def _refused(defn: d.Definition, stage: d.Stage, messages: list, *, hint: str) -> DefinitionError:
    """``messages``: strings, or (line, string) for a line of the requirements file."""
    return DefinitionError([Problem(file=stage.requirements.display, message=m[1] if isinstance(m, tuple) else m,
                                    line=m[0] if isinstance(m, tuple) else None, hint=hint) for m in messages],
                           image=defn.name)


def _mkdir(p: Path) -> Path:
    p.mkdir(parents=True, exist_ok=True)
    return p
