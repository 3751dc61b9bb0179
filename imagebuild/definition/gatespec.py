"""Read and validate a gate spec (``docker-images/<image>/gate.yaml``) -> a frozen ``GateSpec``.

A gate spec lists the checks an image must pass before it may be promoted or synced. Every
problem is collected and raised at once as ``DefinitionError`` (exit 2), each naming the file,
the line and the key, what was expected and a hint. Nothing here touches Docker. The format is
documented in docs/gate.md.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from imagebuild.core import lazy, yamlread
from imagebuild.core.errors import DefinitionError, Problem, excerpt

difflib = lazy.module("difflib")  # error hints only


class SpecError(DefinitionError):
    """Problems in a gate spec (exit 2), titled by what it is: a ``--spec`` file is no image definition."""

    def __init__(self, problems: list[Problem]):
        super().__init__(problems, what="gate spec")

SPEC_VERSION = 1
TOP_KEYS = ("version", "description", "python", "timeout", "checks")
COMMON_KEYS = ("id", "kind", "description", "requires", "severity", "when")
WHEN_KEY_RE = lazy.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
SEVERITIES = ("error", "warn")
REQUIRES = ("gpu",)
ID_RE = lazy.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*\Z")
SHA256_RE = lazy.compile(r"[0-9a-f]{64}\Z")
GIT_ID_RE = lazy.compile(r"[0-9a-f]{40}\Z")
# what an installed package folder holds that no source tree does: the bytecode Python writes beside it
GIT_TREE_EXCLUDE = ("__pycache__", "*.pyc")
SASS_RE = lazy.compile(r"sm_[0-9]{2,3}[af]?\Z")
PTX_RE = lazy.compile(r"compute_[0-9]{2,3}[af]?\Z")
MODULE_RE = lazy.compile(r"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*\Z")
DEFAULT_PYTHON = "python3"
DEFAULT_TIMEOUT_S = 600

# PTX ISA version -> the first CUDA release whose driver JIT-compiles it: NVIDIA's PTX ISA
# documentation, "Release History" table (docs.nvidia.com/cuda/parallel-thread-execution, release
# notes); 9.2 <- 13.2 measured here (nvcc 13.2.78 writes `.version 9.2`, ../shared/FACTS.md). A driver
# of CUDA X.Y takes every PTX ISA whose first release is X.Y or older (docs/gate.md, "driver").
PTX_ISA_FIRST_CUDA = {
    "7.0": "11.0", "7.1": "11.1", "7.2": "11.2", "7.3": "11.3", "7.4": "11.4", "7.5": "11.5",
    "7.6": "11.6", "7.7": "11.7", "7.8": "11.8", "8.0": "12.0", "8.1": "12.1", "8.2": "12.2",
    "8.3": "12.3", "8.4": "12.4", "8.5": "12.5", "8.6": "12.7", "8.7": "12.8", "8.8": "12.9",
    "9.0": "13.0", "9.1": "13.1", "9.2": "13.2",
}
VERSION_RE = lazy.compile(r"[0-9]+\.[0-9]+\Z")


def _vkey(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in v.split("."))


def max_ptx_isa(cuda: str) -> str | None:
    """The newest PTX ISA a CUDA ``cuda`` (X.Y) driver JIT-compiles; None where the table cannot
    tell (older than 11.0, or newer than its newest release: state ``ptx_isa:`` then)."""
    newest = max(PTX_ISA_FIRST_CUDA.values(), key=_vkey)
    if _vkey(cuda) < (11, 0) or _vkey(cuda) > _vkey(newest):
        return None
    return max((isa for isa, first in PTX_ISA_FIRST_CUDA.items() if _vkey(first) <= _vkey(cuda)), key=_vkey)


# ELF e_machine values (System V ABI) by the names people write; docs/gate.md lists them.
ELF_MACHINES = {
    "aarch64": 183, "arm64": 183, "x86_64": 62, "x86-64": 62, "amd64": 62, "i386": 3, "386": 3,
    "arm": 40, "ppc64le": 21, "ppc64": 21, "s390x": 22, "riscv64": 243,
}

# kind -> (required keys, optional keys)
KINDS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "import": (("module",), ()),
    "version": (("distribution", "specifier"), ()),
    "command": (("run",), ("exit", "stdout", "stderr", "stdout_not", "stderr_not")),
    "file": (("path",), ("exists", "contains", "matches", "sha256")),
    "metadata": ((), ("architecture", "os", "labels", "env", "entrypoint", "cmd", "user", "workdir")),
    "expression": (("expr",), ("imports",)),
    "elf": (("path", "machine"), ("glob", "min_files")),
    "pip-check": ((), ("allow",)),
    # `path` or `module` (the folder of an installed package), checked in _p_cuda_targets
    "cuda-targets": (("sass",), ("path", "module", "ptx", "tolerate", "require", "kernels", "glob", "min_files",
                                 "cuobjdump", "libraries", "driver")),
    # `path` or `module`, checked in _p_git_tree
    "git-tree": (("tree",), ("path", "module", "exclude")),
}


@dataclass(frozen=True)
class Check:
    id: str
    kind: str
    params: dict  # the kind-specific keys, validated and normalised
    requires_gpu: bool = False
    severity: str = "error"
    description: str | None = None
    line: int = 0
    # runs only when the image definition's versions.env has these values (key, value); () = always
    when: tuple[tuple[str, str], ...] = ()

    def as_dict(self) -> dict:
        return {"id": self.id, "kind": self.kind, "severity": self.severity,
                "requires": ["gpu"] if self.requires_gpu else [], "description": self.description,
                "params": self.params, **({"when": dict(self.when)} if self.when else {})}

    def when_unmet(self, env: dict[str, str] | None) -> str | None:
        """Why ``when:`` keeps this check from running with the definition's versions.env ``env``
        (None: it runs). ``env`` None (a bare image reference, no definition) cannot satisfy it."""
        if not self.when:
            return None
        want = ", ".join(f"{k}={v}" for k, v in self.when)
        if env is None:
            return f"when {want}: no image definition (a bare image reference) to read versions.env from"
        diff = [f"{k}={env.get(k, '(not set)')}" for k, v in self.when if env.get(k) != v]
        return f"not applicable: when {want}; versions.env has {', '.join(diff)}" if diff else None


@dataclass(frozen=True)
class GateSpec:
    file: str  # as displayed in messages (relative to the project root where possible)
    path: Path
    python: str
    timeout_s: int
    description: str | None
    checks: tuple[Check, ...] = field(default=())

    def check(self, check_id: str) -> Check:
        for c in self.checks:
            if c.id == check_id:
                return c
        raise KeyError(check_id)


class _Problems:
    def __init__(self, file: str):
        self.file = file
        self.items: list[Problem] = []

    def err(self, line: int | None, key: str | None, message: str, hint: str | None = None) -> None:
        self.items.append(Problem(self.file, message, line=line, key=key, hint=hint))


def digest(path: Path) -> str:
    """The digest a receipt is keyed by: the spec file's exact bytes."""
    from imagebuild.core.fsutil import sha256_file

    return "sha256:" + sha256_file(Path(path))


def load(path: Path, *, display: str | None = None) -> GateSpec:
    """Parse and validate the spec at ``path``; raise ``DefinitionError`` listing every problem."""
    path = Path(path)
    shown = display or str(path)
    if path.exists() and not path.is_file():  # a FIFO would hang the read
        raise SpecError([Problem(shown, f"is {'a folder' if path.is_dir() else 'not a regular file'}, "
                                       "expected a gate spec file")])
    try:
        if path.stat().st_size > yamlread.MAX_BYTES:  # refused before it is read whole
            raise SpecError([Problem(shown, f"is {path.stat().st_size} bytes: larger than {yamlread.MAX_BYTES} "
                                           "bytes (1 MiB), the limit for a gate spec")])
        data = path.read_bytes()
    except FileNotFoundError:
        raise SpecError([Problem(shown, "gate spec not found",
                                       hint="create it (docs/gate.md) or point image.yaml's `gate:` at it")]
                              ) from None
    except OSError as exc:
        raise SpecError([Problem(shown, f"cannot read gate spec: {exc.strerror or exc}")]) from None
    from imagebuild.definition import textfile

    try:
        text = textfile.decode(data)
    except textfile.TextError as exc:  # by line and column, not "position 11"
        raise SpecError([Problem(shown, exc.message, line=exc.line)]) from None
    return parse(text, shown, path)


def parse(text: str, file: str, path: Path | None = None) -> GateSpec:
    """The spec in ``text`` (shown as ``file``); DefinitionError listing every problem."""
    return _parse(text, file, path)


def _parse(text: str, file: str, path: Path | None) -> GateSpec:
    p = _Problems(file)
    try:
        root = yamlread.load(text)
    except yamlread.YamlError as exc:
        raise SpecError([Problem(file, str(exc), line=exc.line,
                                       hint="check the indentation and quoting near that line")]) from None
    if root is None or not isinstance(root.value, dict):
        raise SpecError([Problem(file, "expected a mapping with a `checks:` list",
                                       line=root.line if root else 1, hint="see docs/gate.md")])
    m: dict[str, yamlread.Node] = root.value
    kl = root.key_lines or {}
    if not any(key in TOP_KEYS for key in m):  # some other file (a password file, a config): quote nothing of it
        raise SpecError([Problem(file, f"not a gate spec: none of its {len(m)} top-level key(s) is one of "
                                       f"{', '.join(TOP_KEYS)} (nothing of the file is quoted)",
                                 hint="see docs/gate.md; --spec names a gate spec (gate.yaml)")])
    for key in m:
        if key not in TOP_KEYS:
            _unknown(p, kl.get(key), key if len(key) <= 32 and key.isprintable() else excerpt(key), key, TOP_KEYS)

    if "version" in m and m["version"].value != SPEC_VERSION:
        p.err(m["version"].line, "version", f"unsupported gate spec version {m['version'].value!r}",
              hint=f"this imagebuild reads version {SPEC_VERSION}")
    python = DEFAULT_PYTHON
    if "python" in m:
        v = m["python"].value
        if not isinstance(v, str) or not v.strip() or any(ch.isspace() for ch in v):
            p.err(m["python"].line, "python", f"expected the interpreter's path or name, got {v!r}",
                  hint="e.g. python3 or /opt/venv/bin/python")
        else:
            python = v
    timeout = DEFAULT_TIMEOUT_S
    if "timeout" in m:
        v = m["timeout"].value
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            p.err(m["timeout"].line, "timeout", f"expected a positive number of seconds, got {v!r}")
        else:
            timeout = v
    description = _opt_str(p, m, "description", "description")

    checks: list[Check] = []
    if "checks" not in m:
        p.err(root.line, "checks", "missing `checks:` (the list of checks)", hint="see docs/gate.md")
    else:
        node = m["checks"]
        if node.value is None:
            node = yamlread.Node([], node.line)
        if not isinstance(node.value, list):
            p.err(node.line, "checks", "expected a list of checks")
        elif not node.value:  # a gate of no checks would pass nothing; at run time it fails (exit 4)
            p.err(node.line, "checks", "expected at least one check, got an empty list",
                  hint="a gate of no checks proves nothing; see docs/gate.md for the check kinds")
        else:
            seen: dict[str, int] = {}
            for i, cn in enumerate(node.value):
                c = _check(p, cn, i)
                if c is None:
                    continue
                if c.id in seen:
                    p.err(c.line, f"checks[{i}].id", f"duplicate check id {c.id!r} (first on line {seen[c.id]})",
                          hint="every check needs its own id")
                    continue
                seen[c.id] = c.line
                checks.append(c)
    if p.items:
        raise SpecError(p.items)
    return GateSpec(file, Path(path) if path else Path(file), python, timeout, description, tuple(checks))


# ---------------------------------------------------------------------------------------------


def _unknown(p: _Problems, line, where: str, key: str, allowed) -> None:
    close = difflib.get_close_matches(key, list(allowed), n=1)
    p.err(line, where, f"unknown key {excerpt(key)}",
          hint=f"did you mean {close[0]!r}?" if close else f"allowed here: {', '.join(allowed)}")


def _opt_str(p: _Problems, m: dict, key: str, where: str) -> str | None:
    if key not in m or m[key].value is None:
        return None
    v = m[key].value
    if not isinstance(v, str):
        p.err(m[key].line, where, f"expected a string, got {v!r}")
        return None
    return v


def _str_list(p: _Problems, node: yamlread.Node, where: str, *, allow_single=True) -> list[str] | None:
    v = node.value
    if isinstance(v, str) and allow_single:
        return [v]
    if isinstance(v, list) and all(isinstance(x.value, str) for x in v):
        return [x.value for x in v]
    p.err(node.line, where, f"expected a string{' or a list of strings' if allow_single else ' list'}, "
          f"got {node.plain()!r}")
    return None


def _regexes(p: _Problems, node: yamlread.Node, where: str) -> list[str] | None:
    pats = _str_list(p, node, where)
    if pats is None:
        return None
    ok = True
    for pat in pats:
        try:
            re.compile(pat)
        except re.error as exc:
            p.err(node.line, where, f"invalid regular expression {pat!r}: {exc}",
                  hint="Python `re` syntax; escape literal dots and brackets with a backslash")
            ok = False
    return pats if ok else None


def _check(p: _Problems, cn: yamlread.Node, i: int) -> Check | None:
    where = f"checks[{i}]"
    if not isinstance(cn.value, dict):
        p.err(cn.line, where, f"expected a mapping with `id:` and `kind:`, got {cn.plain()!r}")
        return None
    m: dict[str, yamlread.Node] = cn.value
    kl = cn.key_lines or {}
    before = len(p.items)

    cid = m["id"].value if "id" in m else None
    if cid is None:
        p.err(cn.line, f"{where}.id", "missing `id:`", hint="a short unique name, e.g. vllm-import")
    elif not isinstance(cid, str) or not ID_RE.match(cid):
        p.err(m["id"].line, f"{where}.id", f"invalid check id {cid!r}",
              hint="letters, digits, '.', '_', '-' (starting with a letter or digit)")
        cid = None
    label = f"checks[{cid}]" if cid else where

    kind = m["kind"].value if "kind" in m else None
    if kind is None:
        p.err(cn.line, f"{label}.kind", "missing `kind:`", hint=f"one of: {', '.join(KINDS)}")
    elif kind not in KINDS:
        close = difflib.get_close_matches(str(kind), list(KINDS), n=1)
        p.err(m["kind"].line, f"{label}.kind", f"unknown check kind {kind!r}",
              hint=f"did you mean {close[0]!r}?" if close else f"one of: {', '.join(KINDS)}")
        kind = None

    severity = "error"
    if "severity" in m:
        severity = m["severity"].value
        if severity not in SEVERITIES:
            p.err(m["severity"].line, f"{label}.severity", f"expected one of {', '.join(SEVERITIES)}, "
                  f"got {severity!r}", hint="`warn` reports a failure without failing the gate")
    requires_gpu = False
    if "requires" in m:
        req = _str_list(p, m["requires"], f"{label}.requires")
        for r in req or []:
            if r not in REQUIRES:
                p.err(m["requires"].line, f"{label}.requires", f"unknown requirement {r!r}",
                      hint=f"one of: {', '.join(REQUIRES)}")
            else:
                requires_gpu = True
    description = _opt_str(p, m, "description", f"{label}.description")
    when: list[tuple[str, str]] = []
    if "when" in m:
        wn = m["when"]
        if not isinstance(wn.value, dict) or not wn.value:
            p.err(wn.line, f"{label}.when", "expected a mapping of versions.env keys to values",
                  hint="e.g. when: {VLLM_REQUIRE_RUST_FRONTEND: \"1\"}")
        else:
            for k, vn in wn.value.items():
                if not WHEN_KEY_RE.match(str(k)):
                    p.err(vn.line, f"{label}.when", f"invalid versions.env key {k!r}")
                elif isinstance(vn.value, bool) or not isinstance(vn.value, (str, int)):
                    p.err(vn.line, f"{label}.when.{k}", f"expected a string or number, got {vn.plain()!r}",
                          hint="quote it: versions.env values are text")
                else:
                    when.append((str(k), str(vn.value)))

    params: dict = {}
    if kind is not None:
        required, optional = KINDS[kind]
        allowed = COMMON_KEYS + required + optional
        for key in m:
            if key not in allowed:
                _unknown(p, kl.get(key), f"{label}.{key}", key, allowed)
        for key in required:
            if key not in m:
                p.err(cn.line, f"{label}.{key}", f"a `{kind}` check needs `{key}:`", hint="see docs/gate.md")
        params = _PARAMS[kind](p, m, label)
    if len(p.items) != before or cid is None or kind is None:
        return None
    return Check(cid, kind, params, requires_gpu, severity, description, cn.line, tuple(when))


# ---------------------------------------------------------------------------------------------
# kind-specific keys


def _p_import(p, m, label):
    v = m.get("module")
    if v is not None and (not isinstance(v.value, str) or not MODULE_RE.match(v.value)):
        p.err(v.line, f"{label}.module", f"expected a dotted module name, got {v.plain()!r}",
              hint="e.g. vllm._C_stable_libtorch")
    return {"module": v.value if v else None}


def _p_version(p, m, label):
    out = {}
    d = m.get("distribution")
    if d is not None:
        if not isinstance(d.value, str) or not d.value.strip():
            p.err(d.line, f"{label}.distribution", f"expected a distribution name, got {d.plain()!r}",
                  hint="the name pip installs, e.g. flashinfer-python")
        out["distribution"] = d.value
    s = m.get("specifier")
    if s is not None:
        from packaging.specifiers import InvalidSpecifier, SpecifierSet  # only here: ~5 ms to import

        text = s.value
        if isinstance(text, int | float) and not isinstance(text, bool):
            text = None  # a bare number is almost surely a forgotten operator
        try:
            if not isinstance(text, str) or not text.strip():
                raise InvalidSpecifier(str(s.plain()))
            SpecifierSet(text)
        except InvalidSpecifier:
            p.err(s.line, f"{label}.specifier", f"invalid PEP 440 version specifier {s.plain()!r}",
                  hint="quote it and give an operator, e.g. \"==2.13.0\", \">=0.6.17,<0.7\" or "
                  "\"==0.1.dev20489+g06f922207\"")
        out["specifier"] = s.value
    return out


def _p_command(p, m, label):
    out: dict = {}
    r = m.get("run")
    if r is not None:
        if isinstance(r.value, str) and r.value.strip():
            out["run"] = r.value
        elif isinstance(r.value, list) and r.value and all(isinstance(x.value, str | int) for x in r.value):
            out["run"] = [str(x.value) for x in r.value]
        else:
            p.err(r.line, f"{label}.run", f"expected a shell command or an argv list, got {r.plain()!r}")
    out["exit"] = 0
    if "exit" in m:
        e = m["exit"].value
        if not isinstance(e, int) or isinstance(e, bool) or not 0 <= e <= 255:
            p.err(m["exit"].line, f"{label}.exit", f"expected an exit code 0-255, got {e!r}")
        else:
            out["exit"] = e
    for key in ("stdout", "stderr", "stdout_not", "stderr_not"):
        if key in m:
            out[key] = _regexes(p, m[key], f"{label}.{key}")
    return out


def _p_file(p, m, label):
    out: dict = {}
    path = m.get("path")
    if path is not None:
        out["path"] = _image_path(p, path, label)
    out["exists"] = True
    if "exists" in m:
        if not isinstance(m["exists"].value, bool):
            p.err(m["exists"].line, f"{label}.exists", f"expected true or false, got {m['exists'].value!r}")
        else:
            out["exists"] = m["exists"].value
    if "contains" in m:
        out["contains"] = _str_list(p, m["contains"], f"{label}.contains")
    if "matches" in m:
        out["matches"] = _regexes(p, m["matches"], f"{label}.matches")
    if "sha256" in m:
        v = m["sha256"].value
        v = v[7:] if isinstance(v, str) and v.startswith("sha256:") else v
        if not isinstance(v, str) or not SHA256_RE.match(v):
            p.err(m["sha256"].line, f"{label}.sha256", f"expected 64 lower-case hex digits, got {m['sha256'].value!r}")
        out["sha256"] = v
    if out["exists"] is False and any(k in out for k in ("contains", "matches", "sha256")):
        p.err(m["exists"].line, f"{label}.exists", "`exists: false` cannot be combined with contents checks")
    return out


def _p_metadata(p, m, label):
    out: dict = {}
    fields = KINDS["metadata"][1]
    if not any(k in m for k in fields):
        p.err(None if not m else min(n.line for n in m.values()), label,
              "a `metadata` check needs at least one of: " + ", ".join(fields))
    for key in ("architecture", "os", "user", "workdir"):
        if key in m:
            v = m[key].value
            if not isinstance(v, str):
                p.err(m[key].line, f"{label}.{key}", f"expected a string, got {v!r}")
            out[key] = v
    for key in ("labels", "env"):
        if key in m:
            v = m[key].value
            if not isinstance(v, dict) or not all(isinstance(x.value, str | int | float) or x.value is None
                                                  for x in v.values()):
                p.err(m[key].line, f"{label}.{key}", "expected a mapping of names to values (null = absent)")
                continue
            out[key] = {k: (None if x.value is None else str(x.value)) for k, x in v.items()}
    for key in ("entrypoint", "cmd"):
        if key in m:
            v = m[key]
            if v.value is None or v.value == []:
                out[key] = None
            elif isinstance(v.value, list) and all(isinstance(x.value, str) for x in v.value):
                out[key] = [x.value for x in v.value]
            else:
                p.err(v.line, f"{label}.{key}", f"expected a list of strings or null (empty), got {v.plain()!r}")
    return out


def _p_expression(p, m, label):
    out: dict = {"imports": []}
    e = m.get("expr")
    if e is not None:
        if not isinstance(e.value, str) or not e.value.strip():
            p.err(e.line, f"{label}.expr", f"expected a Python expression, got {e.plain()!r}")
        else:
            try:
                compile(e.value, "<expr>", "eval")
            except SyntaxError as exc:
                p.err(e.line, f"{label}.expr", f"not a Python expression: {exc.msg}",
                      hint="one expression, e.g. hasattr(mod.Enum, 'B12X'); quote the YAML value")
        out["expr"] = e.value
    if "imports" in m:
        mods = _str_list(p, m["imports"], f"{label}.imports")
        for mod in mods or []:
            if not MODULE_RE.match(mod):
                p.err(m["imports"].line, f"{label}.imports", f"not a module name: {mod!r}")
        out["imports"] = mods or []
    return out


def _image_path(p, node, label) -> object:
    """``path:``: an absolute path in the image (the value as given, the problem collected)."""
    if not isinstance(node.value, str) or not node.value.startswith("/"):
        p.err(node.line, f"{label}.path", f"expected an absolute path in the image, got {node.plain()!r}")
    return node.value


def _scan_keys(p, m, label, out: dict) -> None:
    """``glob:`` and ``min_files:`` of a check that scans the files under a path (elf, cuda-targets)."""
    if "glob" in m:
        out["glob"] = _str_list(p, m["glob"], f"{label}.glob")
    if "min_files" in m:
        v = m["min_files"].value
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            p.err(m["min_files"].line, f"{label}.min_files", f"expected a number >= 1, got {v!r}",
                  hint="a check that finds no file would pass on an empty folder")
        out["min_files"] = v


def _p_elf(p, m, label):
    out: dict = {"glob": ["*.so", "*.so.*"], "min_files": 1}
    path = m.get("path")
    if path is not None:
        out["path"] = _image_path(p, path, label)
    mach = m.get("machine")
    if mach is not None:
        v = mach.value
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            out["machine"] = v
        elif isinstance(v, str) and v.lower() in ELF_MACHINES:
            out["machine"] = ELF_MACHINES[v.lower()]
        else:
            p.err(mach.line, f"{label}.machine", f"unknown ELF machine {v!r}",
                  hint="aarch64 (183), x86_64 (62), or the e_machine number")
        out["machine_name"] = str(v)
    _scan_keys(p, m, label, out)
    return out


def _p_pip_check(p, m, label):
    out: dict = {"allow": []}
    if "allow" in m:
        out["allow"] = _regexes(p, m["allow"], f"{label}.allow") or []
    return out


def _targets(p, node, label, rx, example):
    vals = _str_list(p, node, label)
    for v in vals or []:
        if not rx.match(v):
            p.err(node.line, label, f"not a CUDA target: {excerpt(v)}", hint=f"e.g. {example}")
    return vals or []


def _path_or_module(p, m, label, out: dict, check: str, path_is: str, example: str) -> None:
    """What a check reads in the image: exactly one of ``path`` and ``module``, into ``out``."""
    path, mod = m.get("path"), m.get("module")
    if (path is None) == (mod is None):
        p.err(None if not m else min(n.line for n in m.values()), label,
              f"{check} needs exactly one of `path` ({path_is}) and `module` (an installed package, "
              f"e.g. {example})")
    if path is not None:
        out["path"] = _image_path(p, path, label)
    if mod is not None:
        if not isinstance(mod.value, str) or not MODULE_RE.match(mod.value):
            p.err(mod.line, f"{label}.module", f"expected a module name, got {mod.plain()!r}")
        out["module"] = mod.value


def _p_cuda_targets(p, m, label):
    out: dict = {"glob": ["*.so", "*.so.*"], "min_files": 1, "ptx": [], "tolerate": [], "kernels": []}
    _path_or_module(p, m, label, out, "a `cuda-targets` check", "a folder or file in the image", "vllm")
    if "sass" in m:
        out["sass"] = _targets(p, m["sass"], f"{label}.sass", SASS_RE, "[sm_121a] (sm_<major><minor>[a|f])")
        if not out["sass"]:
            p.err(m["sass"].line, f"{label}.sass", "expected at least one SASS target",
                  hint="the architectures the image's kernels must be compiled for, e.g. [sm_121a]")
    if "ptx" in m:
        out["ptx"] = _targets(p, m["ptx"], f"{label}.ptx", PTX_RE, "[compute_121a]")
    if "tolerate" in m:  # extra targets allowed beside the file's own, never instead of them
        vals = _str_list(p, m["tolerate"], f"{label}.tolerate") or []
        for v in vals:
            if not (SASS_RE.match(v) or PTX_RE.match(v)):
                p.err(m["tolerate"].line, f"{label}.tolerate", f"not a CUDA target: {excerpt(v)}",
                      hint="e.g. [sm_80, compute_80] (SASS sm_..., PTX compute_...)")
        out["tolerate"] = vals
    out["require"] = list(out.get("sass") or [])
    if "require" in m:
        req = _str_list(p, m["require"], f"{label}.require") or []
        allowed = set(out.get("sass") or []) | set(out["ptx"])
        for t in req:
            if t not in allowed:
                p.err(m["require"].line, f"{label}.require", f"{excerpt(t)} is not one of the allowed targets",
                      hint="a required target must also be listed under sass: or ptx:")
        out["require"] = req
    if "kernels" in m:
        out["kernels"] = _regexes(p, m["kernels"], f"{label}.kernels") or []
    _scan_keys(p, m, label, out)
    if "cuobjdump" in m:
        v = m["cuobjdump"].value
        if not isinstance(v, str) or not v.strip():
            p.err(m["cuobjdump"].line, f"{label}.cuobjdump", f"expected a command or a path, got {v!r}")
        out["cuobjdump"] = v
    if "libraries" in m:
        out["libraries"] = _libraries(p, m["libraries"], f"{label}.libraries")
    if "driver" in m:
        out["driver"] = _driver(p, m["driver"], f"{label}.driver")
    return out


LIBRARY_KEYS = ("files", "targets", "why", "min_files")
DRIVER_KEYS = ("cuda", "name", "ptx_isa")


def _libraries(p, node, label) -> list[dict]:
    """``libraries:``: files that their own build compiles for other targets, each with its list."""
    if not isinstance(node.value, list) or not node.value:
        p.err(node.line, label, "expected a list of libraries, each with `files`, `targets` and `why`",
              hint="e.g. - {files: vllm_flash_attn/_vllm_fa2_C*.so, targets: [sm_80, compute_80], why: ...}")
        return []
    out = []
    for i, ln in enumerate(node.value):
        where = f"{label}[{i}]"
        if not isinstance(ln.value, dict):
            p.err(ln.line, where, f"expected a mapping with `files`, `targets` and `why`, got {ln.plain()!r}")
            continue
        lm, kl = ln.value, ln.key_lines or {}
        for key in lm:
            if key not in LIBRARY_KEYS:
                _unknown(p, kl.get(key, ln.line), where, key, LIBRARY_KEYS)
        lib: dict = {"min_files": 0}
        for key in ("files", "targets", "why"):
            if key not in lm:
                p.err(ln.line, f"{where}.{key}", f"missing `{key}:`",
                      hint={"files": "a glob of the file's path under the checked folder, e.g. "
                                     "vllm_flash_attn/_vllm_fa2_C*.so",
                            "targets": "every target the library's own build compiles, e.g. [sm_80, compute_80]",
                            "why": "where its build asks for them, e.g. its CMakeLists.txt line"}[key])
        f = lm.get("files")
        if f is not None:
            if not isinstance(f.value, str) or not f.value.strip() or f.value.startswith("/"):
                p.err(f.line, f"{where}.files", f"expected a glob relative to the checked folder, got {f.plain()!r}")
            lib["files"] = f.value
        t = lm.get("targets")
        if t is not None:
            vals = _str_list(p, t, f"{where}.targets") or []
            for v in vals:
                if not (SASS_RE.match(v) or PTX_RE.match(v)):
                    p.err(t.line, f"{where}.targets", f"not a CUDA target: {excerpt(v)}",
                          hint="e.g. [sm_80, compute_80] (SASS sm_..., PTX compute_...)")
            if not vals:
                p.err(t.line, f"{where}.targets", "expected at least one target")
            lib["targets"] = vals
        w = lm.get("why")
        if w is not None:
            if not isinstance(w.value, str) or not w.value.strip():
                p.err(w.line, f"{where}.why", f"expected the source of the list (text), got {w.plain()!r}")
            lib["why"] = w.value
        if "min_files" in lm:
            v = lm["min_files"].value
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                p.err(lm["min_files"].line, f"{where}.min_files", f"expected a number >= 0, got {v!r}")
            lib["min_files"] = v
        out.append(lib)
    return out


def _driver(p, node, label) -> dict:
    """``driver:``: the (oldest) driver of the nodes the image runs on; its PTX ISA limit."""
    if not isinstance(node.value, dict):
        p.err(node.line, label, f"expected a mapping with `cuda:` (and `name:`, `ptx_isa:`), got {node.plain()!r}",
              hint='e.g. driver: {name: R580, cuda: "13.0"}')
        return {}
    dm, kl = node.value, node.key_lines or {}
    for key in dm:
        if key not in DRIVER_KEYS:
            _unknown(p, kl.get(key, node.line), label, key, DRIVER_KEYS)
    out: dict = {"name": None}
    for key in ("cuda", "ptx_isa"):
        if key in dm:
            v = dm[key].value
            if not isinstance(v, str) or not VERSION_RE.match(v):
                p.err(dm[key].line, f"{label}.{key}", f"expected a quoted version X.Y, got {dm[key].plain()!r}",
                      hint=f'quote it ({key}: "13.0"): a bare 13.10 would read as 13.1')
            else:
                out[key] = v
    if "cuda" not in dm:
        p.err(node.line, f"{label}.cuda", "missing `cuda:` (the CUDA version of the driver, as nvidia-smi shows it)",
              hint='e.g. cuda: "13.0" for R580')
    if "name" in dm:
        v = dm["name"].value
        if not isinstance(v, str) or not v.strip():
            p.err(dm["name"].line, f"{label}.name", f"expected a name, got {dm['name'].plain()!r}")
        out["name"] = v
    if "cuda" in out and "ptx_isa" not in out:
        isa = max_ptx_isa(out["cuda"])
        if isa is None:
            p.err(dm["cuda"].line, f"{label}.cuda", f"the PTX ISA limit of a CUDA {out['cuda']} driver is not "
                  f"in imagebuild's table (CUDA 11.0 to {max(PTX_ISA_FIRST_CUDA.values(), key=_vkey)})",
                  hint="state it: ptx_isa: \"X.Y\" (NVIDIA's PTX ISA release notes)")
        out["ptx_isa"] = isa
    return out


def _p_git_tree(p, m, label):
    out: dict = {"exclude": list(GIT_TREE_EXCLUDE)}
    _path_or_module(p, m, label, out, "a `git-tree` check", "a folder in the image", "b12x")
    t = m.get("tree")
    if t is not None:
        if not isinstance(t.value, str) or not GIT_ID_RE.match(t.value):
            p.err(t.line, f"{label}.tree", f"expected a git tree id (40 lower-case hex digits), got {t.plain()!r}",
                  hint="quote it ('...'); `git rev-parse <commit>:<folder>` gives the tree of a folder")
        out["tree"] = t.value
    if "exclude" in m:
        vals = _str_list(p, m["exclude"], f"{label}.exclude")
        for v in vals or []:
            if not v or "/" in v:
                p.err(m["exclude"].line, f"{label}.exclude", f"expected a file or folder name glob, got {excerpt(v)}",
                      hint="names, not paths: e.g. [__pycache__, '*.pyc'], matched at every level")
        out["exclude"] = vals or []
    return out


_PARAMS = {"import": _p_import, "version": _p_version, "command": _p_command, "file": _p_file,
           "metadata": _p_metadata, "expression": _p_expression, "elf": _p_elf, "pip-check": _p_pip_check,
           "cuda-targets": _p_cuda_targets, "git-tree": _p_git_tree}
