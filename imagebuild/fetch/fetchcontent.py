"""Read a source tree's CMake files the way prefetch needs them: its FetchContent dependencies,
the variables their arguments use, the override variables the tree reads, and the conditions
each declaration sits under.

The walk follows CMake's order: ``CMakeLists.txt`` at the top, each ``include()`` of a file in
the tree where it is included (``${CMAKE_CURRENT_LIST_DIR}/...``, paths relative to the top,
module names found as ``cmake/<Name>.cmake``), then every other ``cmake/**/*.cmake`` file (they
may be included in ways the walk cannot follow). Nothing is evaluated: the scan records, it
does not run CMake.

- **Declarations**: every ``FetchContent_Declare`` and every ``FetchContent_Populate`` that
  gives its own download arguments (``GIT_REPOSITORY``/``URL``; the one-argument form only
  populates an earlier declaration). A name declared several times (vLLM declares ``cutlass``
  once with ``SOURCE_DIR`` in an override branch and once with the repository) is merged: the
  first declaration with a repository or URL is the primary one, a ``SOURCE_DIR``-only one
  names the override variable, and a later one with other values is kept as an alternative
  (oneDNN ``9c5be1cc`` at one line, ``v3.10`` at another) instead of being dropped.
- **Variables**: ``set(VAR value...)`` (plain, ``CACHE`` defaults, ``PARENT_SCOPE``) in any
  scanned file. ``GIT_TAG ${CUTLASS_REVISION}`` is resolved to the literal the tree sets, with
  the file and line it came from; a value that cannot be resolved (not set in the tree, set to
  several values, read from the environment) is said so, never guessed.
- **Reads**: where the tree reads a name from the environment (``$ENV{X}``, ``DEFINED ENV{X}``)
  or as a CMake variable (``${X}``, ``if(X)``, ``if(DEFINED X)``), so an override can be checked
  against the tree and delivered the way the tree reads it.
- **Conditions**: the ``if``/``elseif``/``else`` branches (and ``function``/``macro`` bodies)
  around each declaration and around the ``include()`` that brought its file in, so a
  dependency only a CPU build uses shows ``if (VLLM_TARGET_DEVICE STREQUAL "cpu")``.
"""

from __future__ import annotations

import fnmatch
import posixpath
import re
from dataclasses import dataclass, field
from itertools import product

from imagebuild.fetch.gitcache import Mirror

PATTERNS = ("CMakeLists.txt", "cmake/*.cmake", "cmake/**/*.cmake")
KEYWORDS = frozenset({
    "GIT_REPOSITORY", "GIT_TAG", "GIT_SUBMODULES", "GIT_SUBMODULES_RECURSE", "GIT_SHALLOW", "GIT_PROGRESS",
    "GIT_REMOTE_NAME", "GIT_CONFIG", "GIT_REMOTE_UPDATE_STRATEGY", "URL", "URL_HASH", "URL_MD5",
    "SOURCE_DIR", "SOURCE_SUBDIR", "BINARY_DIR", "DOWNLOAD_DIR", "PREFIX", "TMP_DIR", "STAMP_DIR",
    "SUBBUILD_DIR", "QUIET",
    "EXCLUDE_FROM_ALL", "SYSTEM", "OVERRIDE_FIND_PACKAGE", "FIND_PACKAGE_ARGS", "UPDATE_DISCONNECTED",
    "DOWNLOAD_EXTRACT_TIMESTAMP", "DOWNLOAD_NO_EXTRACT", "PATCH_COMMAND", "UPDATE_COMMAND",
    "CONFIGURE_COMMAND", "BUILD_COMMAND", "INSTALL_COMMAND", "TEST_COMMAND", "LOG_DOWNLOAD",
    "SVN_REPOSITORY", "HG_REPOSITORY", "CVS_REPOSITORY", "DOWNLOAD_COMMAND", "TLS_VERIFY",
})
# words of an if() expression that are not variable names
_IF_WORDS = frozenset({
    "NOT", "AND", "OR", "DEFINED", "COMMAND", "POLICY", "TARGET", "TEST", "EXISTS", "IS_NEWER_THAN",
    "IS_DIRECTORY", "IS_SYMLINK", "IS_ABSOLUTE", "IS_READABLE", "IS_WRITABLE", "IS_EXECUTABLE", "MATCHES",
    "LESS", "GREATER", "EQUAL", "LESS_EQUAL", "GREATER_EQUAL", "STRLESS", "STRGREATER", "STREQUAL",
    "STRLESS_EQUAL", "STRGREATER_EQUAL", "VERSION_LESS", "VERSION_GREATER", "VERSION_EQUAL",
    "VERSION_LESS_EQUAL", "VERSION_GREATER_EQUAL", "PATH_EQUAL", "IN_LIST", "ON", "OFF", "YES", "NO", "TRUE",
    "FALSE", "Y", "N", "IGNORE", "NOTFOUND",
})
_MAX_CANDIDATES = 16
_VAR_REF = re.compile(r"\$\{([A-Za-z0-9_.+-]+)\}")
_ENV_REF = re.compile(r"\$ENV\{([A-Za-z0-9_.+-]+)\}")
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.+-]*\Z")


# ------------------------------------------------------------------------------------------------ commands


@dataclass(frozen=True)
class Arg:
    text: str
    quoted: bool  # "quoted" or [[bracket]]: never split on ';', never an if() keyword


@dataclass(frozen=True)
class Command:
    name: str  # lower case
    args: tuple[Arg, ...]
    line: int


def _skip_comment(text: str, i: int, line: int) -> tuple[int, int]:
    m = re.match(r"#\[(=*)\[", text[i:i + 64])
    if m:
        end = text.find("]" + m.group(1) + "]", i + m.end())
        end = len(text) if end < 0 else end + len(m.group(1)) + 2
    else:
        end = text.find("\n", i)
        end = len(text) if end < 0 else end
    return end, line + text.count("\n", i, end)


_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", '"': '"', "\\": "\\", "$": "$", "(": "(", ")": ")", "#": "#",
            " ": " ", "@": "@", "^": "^", "[": "[", "]": "]"}


def _args(text: str, i: int, line: int) -> tuple[list[Arg], int, int]:
    """The arguments of a command whose '(' ends just before ``i``; returns (args, end, line)."""
    n = len(text)
    args: list[Arg] = []
    depth = 1
    while i < n:
        ch = text[i]
        if ch == "\n":
            line += 1
            i += 1
        elif ch in " \t\r":
            i += 1
        elif ch == "#":
            i, line = _skip_comment(text, i, line)
        elif ch == "(":
            depth += 1
            args.append(Arg("(", False))
            i += 1
        elif ch == ")":
            depth -= 1
            i += 1
            if depth == 0:
                return args, i, line
            args.append(Arg(")", False))
        elif ch == '"':
            j, buf = i + 1, []
            while j < n and text[j] != '"':
                if text[j] == "\\" and j + 1 < n:
                    nxt = text[j + 1]
                    if nxt == "\n":  # line continuation
                        line += 1
                    elif nxt == ";":
                        buf.append("\\;")
                    else:
                        buf.append(_ESCAPES.get(nxt, nxt))
                    j += 2
                    continue
                if text[j] == "\n":
                    line += 1
                buf.append(text[j])
                j += 1
            args.append(Arg("".join(buf), True))
            i = j + 1
        elif ch == "[" and re.match(r"\[=*\[", text[i:i + 64]):
            m = re.match(r"\[(=*)\[", text[i:i + 64])
            start = i + m.end()
            if text.startswith("\n", start):  # a newline right after the opening is dropped
                start += 1
                line += 1
            end = text.find("]" + m.group(1) + "]", start)
            end = n if end < 0 else end
            args.append(Arg(text[start:end], True))
            line += text.count("\n", start, end)
            i = end + len(m.group(1)) + 2
        else:
            j, buf = i, []
            while j < n and text[j] not in ' \t\r\n()#"':
                if text[j] == "\\" and j + 1 < n:
                    buf.append(text[j:j + 2])
                    j += 2
                    continue
                buf.append(text[j])
                j += 1
            if j < n and text[j] == '"' and buf:  # legacy -DX="a b" inside an unquoted argument
                k = text.find('"', j + 1)
                k = n if k < 0 else k
                buf.append(text[j:k + 1])
                line += text.count("\n", j, k)
                j = k + 1
                while j < n and text[j] not in ' \t\r\n()#':
                    buf.append(text[j])
                    j += 1
            if j == i:  # a stray character: step over it
                j += 1
            args.append(Arg("".join(buf), False))
            i = j
    return args, i, line


def commands(text: str) -> list[Command]:
    """Every command invocation in a CMake file, in order, with its line and arguments."""
    out: list[Command] = []
    i, n, line = 0, len(text), 1
    while i < n:
        ch = text[i]
        if ch == "\n":
            line += 1
            i += 1
            continue
        if ch in " \t\r":
            i += 1
            continue
        if ch == "#":
            i, line = _skip_comment(text, i, line)
            continue
        m = _IDENT.match(text, i)
        if not m:
            j = text.find("\n", i)
            i = n if j < 0 else j
            continue
        j = m.end()
        while j < n and text[j] in " \t":
            j += 1
        if j >= n or text[j] != "(":
            i = j
            continue
        start = line
        args, i, line = _args(text, j + 1, line)
        out.append(Command(m.group(0).lower(), tuple(args), start))
    return out


def _words(args: tuple[Arg, ...]) -> list[str]:
    """Unquoted arguments split on ';' (as CMake does), quoted ones as they are."""
    out: list[str] = []
    for a in args:
        if a.quoted:
            out.append(a.text)
        else:
            out += [p for p in re.split(r"(?<!\\);", a.text)]
    return out


def _show(args: tuple[Arg, ...]) -> str:
    return " ".join(f'"{a.text}"' if a.quoted else a.text for a in args)


# ------------------------------------------------------------------------------------------------ model


@dataclass
class Resolved:
    """A value as the tree gives it: the literal(s) it resolves to, where they were set, or why not."""

    values: list[str]  # distinct candidates, in the order found (one: resolved)
    origin: list[str]  # file:line of every set() used
    problems: list[str]  # why it cannot be resolved (empty when it can)

    @property
    def value(self) -> str | None:
        return self.values[0] if len(self.values) == 1 and not self.problems else None

    @property
    def note(self) -> str | None:
        if self.problems:
            return "; ".join(self.problems)
        if len(self.values) > 1:
            return "set to several values in the tree: " + ", ".join(repr(v) for v in self.values)
        return None


@dataclass
class Declaration:
    name: str
    file: str
    line: int
    kind: str = "declare"  # "declare" (FetchContent_Declare) or "populate" (FetchContent_Populate with its own args)
    repository: str | None = None
    tag: str | None = None  # as written (``${CUTLASS_REVISION}`` stays that)
    submodules: list[str] | None = None  # GIT_SUBMODULES as written; None: not given (FetchContent takes all)
    submodules_recurse: bool | None = None  # GIT_SUBMODULES_RECURSE (None: not given, CMake's default is on)
    source_subdir: str | None = None
    url: str | None = None
    source_dir: str | None = None
    lines: list[int] = field(default_factory=list)
    when: tuple[str, ...] = ()  # the branches it sits under, outermost first ("file:line: if (...)")
    # filled in by the scan
    tag_resolved: Resolved | None = None  # None when the tag is a literal
    repository_resolved: Resolved | None = None
    submodule_paths: list[str] | None = None  # what the declaration asks for, resolved; None: all
    submodules_note: str | None = None
    override: str | None = None  # the variable a SOURCE_DIR-only declaration of this name reads
    override_where: str | None = None
    alternatives: list[Declaration] = field(default_factory=list)

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line}"

    @property
    def has_download(self) -> bool:
        return bool(self.repository or self.url)

    @property
    def tag_value(self) -> str | None:
        """The tag or commit the tree asks for: the literal, or the variable's resolved value."""
        if self.tag is None:
            return None
        if self.tag_resolved is None:
            return self.tag
        return self.tag_resolved.value

    @property
    def repository_value(self) -> str | None:
        if self.repository_resolved is None:
            return self.repository
        return self.repository_resolved.value

    def same_download(self, other: Declaration) -> bool:
        return (self.repository_value, self.url, self.tag_value, self.submodule_paths) == \
            (other.repository_value, other.url, other.tag_value, other.submodule_paths)

    def as_dict(self) -> dict:
        """The lock's record of a declaration (docs/prefetch.md, "The lock's sources section")."""
        d = {"name": self.name, "file": self.file, "line": self.line, "kind": self.kind,
             "repository": self.repository, "tag": self.tag, "submodules": self.submodules,
             "lines": list(self.lines), "when": list(self.when),
             "tag_resolved": _resolved_dict(self.tag_resolved),
             "submodule_paths": self.submodule_paths,
             "override": self.override,
             "alternatives": [{"file": a.file, "line": a.line, "repository": a.repository_value, "tag": a.tag,
                               "tag_value": a.tag_value, "when": list(a.when)} for a in self.alternatives]}
        if self.repository_resolved is not None:
            d["repository_resolved"] = _resolved_dict(self.repository_resolved)
        if self.url:
            d["url"] = self.url
        if self.submodules_note:
            d["submodules_note"] = self.submodules_note
        return d


def _resolved_dict(r: Resolved | None) -> dict | None:
    if r is None:
        return None
    return {"value": r.value, "from": list(r.origin), "unresolved": r.note}


@dataclass(frozen=True)
class Assignment:
    name: str
    value: str  # arguments joined with ';' as CMake stores a list
    file: str
    line: int
    cache: bool

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line}"


@dataclass
class Scan:
    """What the CMake files of one commit say."""

    files: list[str] = field(default_factory=list)  # every file read, in walk order
    declarations: dict[str, Declaration] = field(default_factory=dict)  # lower-case name -> merged
    assignments: dict[str, list[Assignment]] = field(default_factory=dict)
    env_reads: dict[str, list[str]] = field(default_factory=dict)  # name -> ["file:line", ...]
    var_reads: dict[str, list[str]] = field(default_factory=dict)

    # -- variables ------------------------------------------------------------------------------

    def resolve(self, text: str, _depth: int = 0) -> Resolved:
        """Every ``${VAR}`` in ``text`` replaced by what the tree sets it to."""
        problems = [f"reads the environment variable {m.group(1)}" for m in _ENV_REF.finditer(text)]
        refs = list(dict.fromkeys(m.group(1) for m in _VAR_REF.finditer(text)))
        if not refs or problems:
            return Resolved([text] if not problems else [], [], problems)
        if _depth > 8:
            return Resolved([], [], [f"variables nested too deep in {text!r}"])
        choices: list[list[tuple[str, str]]] = []  # per variable: (value, where)
        origin: list[str] = []
        for var in refs:
            sets = self.assignments.get(var, [])
            if not sets:
                problems.append(f"{var} is not set in the scanned CMake files (it may come from the command "
                                "line or the environment)")
                continue
            opts: dict[str, str] = {}
            for a in sets:
                sub = self.resolve(a.value, _depth + 1)
                if sub.problems:
                    problems.append(f"{var} ({a.where}): {'; '.join(sub.problems)}")
                    continue
                origin.append(a.where)
                origin += sub.origin
                for v in sub.values:
                    opts.setdefault(v, a.where)
            choices.append(list(opts.items()))
        if problems:
            return Resolved([], list(dict.fromkeys(origin)), problems)
        values: list[str] = []
        for combo in product(*choices):
            out = text
            for var, (val, _w) in zip(refs, combo, strict=True):
                out = out.replace("${" + var + "}", val)
            if out not in values:
                values.append(out)
            if len(values) >= _MAX_CANDIDATES:
                break
        return Resolved(values, list(dict.fromkeys(origin)), [])

    # -- reads ------------------------------------------------------------------------------------

    def how_read(self, name: str) -> tuple[list[str], list[str]]:
        """(where the tree reads ``name`` from the environment, where as a CMake variable)."""
        return (list(dict.fromkeys(self.env_reads.get(name, []))),
                list(dict.fromkeys(self.var_reads.get(name, []))))

    def read_names(self) -> list[str]:
        return sorted(set(self.env_reads) | set(self.var_reads))


def fetchcontent_dir_var(name: str) -> str:
    """The cache variable FetchContent itself reads for ``name``: ``FETCHCONTENT_SOURCE_DIR_<NAME>``
    with the name upper-cased as CMake does (``vllm-flash-attn`` keeps its dashes)."""
    return "FETCHCONTENT_SOURCE_DIR_" + name.upper()


# ------------------------------------------------------------------------------------------------ walk


class _Walker:
    def __init__(self, read: callable, paths: set[str]):
        self.read = read  # path -> text or None
        self.paths = paths
        self.scan = Scan()
        self.visited: set[str] = set()
        self.decls: list[Declaration] = []
        self.included: list[str] = []  # every include() target found in the tree

    def walk(self, path: str, outer: tuple[str, ...]) -> None:
        if path in self.visited:
            return
        text = self.read(path)
        if text is None:
            return
        self.visited.add(path)
        self.scan.files.append(path)
        stack: list[str] = []
        for cmd in commands(text):
            name, args = cmd.name, cmd.args
            at = f"{path}:{cmd.line}"
            self._reads(cmd, at)
            if name == "if":
                stack.append(f"{at}: if ({_show(args)})")
            elif name == "elseif" and stack:
                stack[-1] = f"{at}: elseif ({_show(args)})"
            elif name == "else" and stack:
                head = stack[-1].split(": ", 1)[1]
                stack[-1] = f"{at}: else of {head}"
            elif name in ("endif", "endfunction", "endmacro") and stack:
                stack.pop()
            elif name in ("function", "macro"):
                stack.append(f"{at}: {name}({args[0].text if args else ''}) body")
            elif name == "include" and args:
                target = self._include_target(args[0].text, path)
                if target is not None:
                    self.included.append(target)
                    self.walk(target, outer + tuple(stack) + (f"{at}: include({args[0].text})",))
            elif name == "set" and args:
                self._set(args, path, cmd.line)
            elif name in ("fetchcontent_declare", "fetchcontent_populate") and args:
                d = _declaration(cmd, path, outer + tuple(stack))
                if d is not None:
                    self.decls.append(d)

    def _reads(self, cmd: Command, at: str) -> None:
        for a in cmd.args:
            for m in _ENV_REF.finditer(a.text):
                self.scan.env_reads.setdefault(m.group(1), []).append(at)
            for m in _VAR_REF.finditer(a.text):
                self.scan.var_reads.setdefault(m.group(1), []).append(at)
        if cmd.name not in ("if", "elseif", "while"):
            return
        words = cmd.args
        for i, a in enumerate(words):
            if a.quoted:
                continue
            m = re.fullmatch(r"ENV\{([A-Za-z0-9_.+-]+)\}", a.text)
            if m:
                self.scan.env_reads.setdefault(m.group(1), []).append(at)
                continue
            if _NAME.match(a.text) and a.text.upper() not in _IF_WORDS:
                prev = words[i - 1].text.upper() if i else ""
                if prev in ("COMMAND", "POLICY", "TARGET", "TEST"):  # names of other things
                    continue
                self.scan.var_reads.setdefault(a.text, []).append(at)

    def _set(self, args: tuple[Arg, ...], path: str, line: int) -> None:
        var = args[0].text
        if not _NAME.match(var):  # set(ENV{X} ...), set(${dynamic} ...)
            return
        rest = list(args[1:])
        cache = False
        for i, a in enumerate(rest):
            if not a.quoted and a.text == "CACHE":
                rest, cache = rest[:i], True
                break
            if not a.quoted and a.text == "PARENT_SCOPE" and i == len(rest) - 1:
                rest = rest[:i]
                break
        value = ";".join(a.text for a in rest)
        self.scan.assignments.setdefault(var, []).append(Assignment(var, value, path, line, cache))

    def _include_target(self, arg: str, cur: str) -> str | None:
        here = posixpath.dirname(cur)
        v = arg.replace("${CMAKE_CURRENT_LIST_DIR}", "/" + here if here else "")
        for root_var in ("${CMAKE_SOURCE_DIR}", "${PROJECT_SOURCE_DIR}", "${CMAKE_CURRENT_SOURCE_DIR}"):
            v = v.replace(root_var, "")
        if "${" in v or "$ENV{" in v:
            return None
        if "/" not in v and not v.endswith(".cmake"):  # a module name: look for cmake/<Name>.cmake
            cand = f"cmake/{v}.cmake"
            return cand if cand in self.paths else None
        p = posixpath.normpath(v.lstrip("/"))
        return p if p in self.paths else None


def _declaration(cmd: Command, path: str, when: tuple[str, ...]) -> Declaration | None:
    words = _words(cmd.args)
    if not words or not words[0]:
        return None
    d = Declaration(name=words[0], file=path, line=cmd.line, lines=[cmd.line], when=when,
                    kind="declare" if cmd.name == "fetchcontent_declare" else "populate")
    key, values = None, {}
    for w in words[1:]:
        if w in KEYWORDS:
            key = w
            values.setdefault(key, [])
        elif key:
            values[key].append(w)
    if d.kind == "populate" and not any(k in values for k in ("GIT_REPOSITORY", "URL", "SOURCE_DIR")):
        return None  # FetchContent_Populate(name): populates an earlier declaration
    first = lambda k: values[k][0] if values.get(k) else None  # noqa: E731
    d.repository = first("GIT_REPOSITORY")
    d.tag = first("GIT_TAG")
    d.url = first("URL")
    d.source_dir = first("SOURCE_DIR")
    d.source_subdir = first("SOURCE_SUBDIR")
    if "GIT_SUBMODULES" in values:
        # a list either way: "a;b" quoted is one argument but two paths to FetchContent
        d.submodules = [p for v in values["GIT_SUBMODULES"] for p in (v.split(";") if "$" not in v else [v]) if p]
    if values.get("GIT_SUBMODULES_RECURSE"):
        d.submodules_recurse = values["GIT_SUBMODULES_RECURSE"][0].upper() not in ("OFF", "FALSE", "0", "NO", "N")
    return d


def _resolve_declaration(scan: Scan, d: Declaration) -> None:
    if d.tag and "$" in d.tag:
        d.tag_resolved = scan.resolve(d.tag)
    if d.repository and "$" in d.repository:
        d.repository_resolved = scan.resolve(d.repository)
    if d.submodules is None:
        d.submodule_paths = None
        return
    paths: list[str] = []
    notes: list[str] = []
    for raw in d.submodules:
        if "$" not in raw:
            paths += [p for p in raw.split(";") if p]
            continue
        r = scan.resolve(raw)
        if r.problems:
            notes.append(f"GIT_SUBMODULES {raw}: {'; '.join(r.problems)}")
            continue
        if len(r.values) > 1:
            notes.append(f"GIT_SUBMODULES {raw} depends on the branch taken ("
                         + ", ".join(repr(v) for v in r.values) + f"; set at {', '.join(r.origin)}): "
                         "taking every path any branch asks for")
        for v in r.values:
            paths += [p for p in v.split(";") if p]
    d.submodule_paths = list(dict.fromkeys(paths))
    d.submodules_note = "; ".join(notes) or None


def _override_of(d: Declaration) -> str | None:
    """The variable a SOURCE_DIR-only declaration reads (``${X}`` or ``$ENV{X}``), if it is one."""
    if not d.source_dir or d.has_download:
        return None
    m = re.fullmatch(r"\$(?:ENV)?\{([A-Za-z0-9_.+-]+)\}", d.source_dir.strip())
    return m.group(1) if m else None


def merge(decls: list[Declaration]) -> dict[str, Declaration]:
    """By lower-case name. The first declaration with a repository or URL is the primary one; a
    SOURCE_DIR-only one contributes the override variable; a later one with other values is kept
    as an alternative; one with the same values only adds its line."""
    out: dict[str, Declaration] = {}
    overrides: dict[str, tuple[str, str]] = {}
    for d in decls:
        key = d.name.lower()
        ov = _override_of(d)
        if ov and key not in overrides:
            overrides[key] = (ov, d.where)
        prev = out.get(key)
        if prev is None:
            out[key] = d
            continue
        if not prev.has_download and d.has_download:
            d.lines = sorted(set(prev.lines + d.lines))
            out[key] = d
        elif d.has_download and not prev.same_download(d):
            prev.alternatives.append(d)
        else:
            prev.lines = sorted(set(prev.lines + [d.line]))
    for key, d in out.items():
        if key in overrides:
            d.override, d.override_where = overrides[key]
    return out


def parse(text: str, file: str) -> list[Declaration]:
    """Every declaration in one CMake file, in order (no includes followed; tests and tools)."""
    w = _Walker(lambda p: text if p == file else None, {file})
    w.walk(file, ())
    for d in w.decls:
        _resolve_declaration(w.scan, d)
    return w.decls


def wanted(path: str) -> bool:
    if path == "CMakeLists.txt":
        return True
    return path.startswith("cmake/") and path.endswith(".cmake") and fnmatch.fnmatch(path, "cmake/*")


def scan_files(files: dict[str, str], paths: set[str] | None = None) -> Scan:
    """Scan a tree given as {path: text} (``paths``: every path of the tree, for includes)."""
    paths = set(files) if paths is None else paths
    w = _Walker(files.get, paths)
    if "CMakeLists.txt" in files:
        w.walk("CMakeLists.txt", ())
    for p in sorted(files):
        if wanted(p) and p not in w.visited:
            w.walk(p, ("(not included from CMakeLists.txt as far as the scan follows)",))
    for d in w.decls:
        _resolve_declaration(w.scan, d)
    w.scan.declarations = merge(w.decls)
    return w.scan


def scan(m: Mirror, commit: str) -> Scan:
    """Scan the CMake files of ``commit`` in mirror ``m``: CMakeLists.txt, what it includes, and
    every ``cmake/**/*.cmake``."""
    listing = [p for p in m.out("ls-tree", "-r", "--name-only", "-z", commit).split("\0") if p]
    paths = set(listing)
    texts: dict[str, str] = {}

    def load(want: list[str]) -> None:
        want = [p for p in want if p in paths and p not in texts]
        if not want:
            return
        data = "".join(f"{commit}:{p}\n" for p in want).encode()
        raw = m.git("cat-file", "--batch", input=data).stdout
        pos = 0
        for p in want:
            nl = raw.index(b"\n", pos)
            header = raw[pos:nl].decode().split()
            pos = nl + 1
            if len(header) < 3 or header[1] != "blob":
                continue
            size = int(header[2])
            texts[p] = raw[pos:pos + size].decode("utf-8", "replace")
            pos += size + 1

    # CMakeLists.txt and cmake/**; then whatever they include elsewhere in the tree (in rounds)
    load(sorted(p for p in listing if wanted(p)))
    for _ in range(16):
        w = _Walker(texts.get, paths)
        for p in sorted(texts):
            w.walk(p, ())
        missing = [t for t in dict.fromkeys(w.included) if t not in texts]
        before = len(texts)
        load(missing)
        if len(texts) == before:
            break
    return scan_files(texts, paths)
