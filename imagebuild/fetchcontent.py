"""Find CMake ``FetchContent_Declare`` calls in a source tree (read from a git commit).

Reads ``CMakeLists.txt`` at the top and every ``cmake/**/*.cmake``. For each declaration it
records the name, ``GIT_REPOSITORY``, ``GIT_TAG``, ``GIT_SUBMODULES``, ``SOURCE_SUBDIR``,
``URL`` and ``SOURCE_DIR``, with the file and line. A name declared several times (vLLM
declares ``cutlass`` once with ``SOURCE_DIR`` for the override and once with the repository)
is merged: the repository declaration wins, the first line is kept.
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass, field

from .gitcache import Mirror

PATTERNS = ("CMakeLists.txt", "cmake/*.cmake", "cmake/**/*.cmake")
KEYWORDS = frozenset({
    "GIT_REPOSITORY", "GIT_TAG", "GIT_SUBMODULES", "GIT_SUBMODULES_RECURSE", "GIT_SHALLOW", "GIT_PROGRESS",
    "GIT_REMOTE_NAME", "GIT_CONFIG", "GIT_REMOTE_UPDATE_STRATEGY", "URL", "URL_HASH", "URL_MD5",
    "SOURCE_DIR", "SOURCE_SUBDIR", "BINARY_DIR", "DOWNLOAD_DIR", "PREFIX", "TMP_DIR", "STAMP_DIR",
    "EXCLUDE_FROM_ALL", "SYSTEM", "OVERRIDE_FIND_PACKAGE", "FIND_PACKAGE_ARGS", "UPDATE_DISCONNECTED",
    "DOWNLOAD_EXTRACT_TIMESTAMP", "DOWNLOAD_NO_EXTRACT", "PATCH_COMMAND", "UPDATE_COMMAND",
    "CONFIGURE_COMMAND", "BUILD_COMMAND", "INSTALL_COMMAND", "TEST_COMMAND", "LOG_DOWNLOAD",
    "SVN_REPOSITORY", "HG_REPOSITORY", "CVS_REPOSITORY", "DOWNLOAD_COMMAND", "TLS_VERIFY",
})


@dataclass
class Declaration:
    name: str
    file: str
    line: int
    repository: str | None = None
    tag: str | None = None
    submodules: list[str] | None = None  # None: not given (FetchContent then takes all)
    source_subdir: str | None = None
    url: str | None = None
    source_dir: str | None = None
    lines: list[int] = field(default_factory=list)

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line}"

    def as_dict(self) -> dict:
        return {"name": self.name, "file": self.file, "line": self.line, "repository": self.repository,
                "tag": self.tag, "submodules": self.submodules}


_TOKEN = re.compile(r'"((?:[^"\\]|\\.)*)"|\[(=*)\[(.*?)\]\2\]|([^\s()"#]+)|(\()|(\))|(#)', re.S)


def _strip_comments(text: str) -> str:
    """Blank out comments (keeping newlines, so line numbers stay right)."""
    out = []
    i, n = 0, len(text)
    while i < n:
        ch = text[i]
        if ch == '"':
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            out.append(text[i:j + 1])
            i = j + 1
        elif ch == "#":
            m = re.match(r"#\[(=*)\[", text[i:])
            if m:
                end = text.find("]" + m.group(1) + "]", i + m.end())
                end = n if end < 0 else end + len(m.group(1)) + 2
            else:
                end = text.find("\n", i)
                end = n if end < 0 else end
            out.append(re.sub(r"[^\n]", " ", text[i:end]))
            i = end
        else:
            out.append(ch)
            i += 1
    return "".join(out)


def parse(text: str, file: str) -> list[Declaration]:
    """Every FetchContent_Declare call in one CMake file, in order."""
    text = _strip_comments(text)
    # find calls where quoted strings are blanked out (same length, so positions agree)
    masked = re.sub(r'"(?:[^"\\]|\\.)*"', lambda q: '"' + re.sub(r"[^\n]", " ", q.group(0)[1:-1]) + '"', text)
    decls: list[Declaration] = []
    for m in re.finditer(r"(?i)\bFetchContent_Declare\s*\(", masked):
        line = text.count("\n", 0, m.start()) + 1
        depth, i, args = 1, m.end(), []
        while depth and i < len(text):
            t = _TOKEN.match(text, i)
            if not t:
                i += 1
                continue
            i = t.end()
            if t.group(5):
                depth += 1
            elif t.group(6):
                depth -= 1
            elif t.group(1) is not None:
                args.append(t.group(1))
            elif t.group(3) is not None:
                args.append(t.group(3))
            elif t.group(4):
                args.append(t.group(4))
        if not args:
            continue
        d = Declaration(name=args[0], file=file, line=line, lines=[line])
        key, values = None, {}
        for a in args[1:]:
            if a in KEYWORDS:
                key = a
                values.setdefault(key, [])
            elif key:
                values[key].append(a)
        first = lambda k, v=values: v[k][0] if v.get(k) else None  # noqa: E731
        d.repository = first("GIT_REPOSITORY")
        d.tag = first("GIT_TAG")
        d.url = first("URL")
        d.source_dir = first("SOURCE_DIR")
        d.source_subdir = first("SOURCE_SUBDIR")
        if "GIT_SUBMODULES" in values:
            d.submodules = [p for v in values["GIT_SUBMODULES"] for p in v.split(";") if p]
        decls.append(d)
    return decls


def merge(decls: list[Declaration]) -> dict[str, Declaration]:
    """By lower-case name; a declaration with a repository or URL wins over a SOURCE_DIR-only one."""
    out: dict[str, Declaration] = {}
    for d in decls:
        key = d.name.lower()
        prev = out.get(key)
        if prev is None:
            out[key] = d
            continue
        if not (prev.repository or prev.url) and (d.repository or d.url):
            d.lines = prev.lines + d.lines
            out[key] = d
        else:
            prev.lines.append(d.line)
    return out


def wanted(path: str) -> bool:
    if path == "CMakeLists.txt":
        return True
    return path.startswith("cmake/") and path.endswith(".cmake") and fnmatch.fnmatch(path, "cmake/*")


def scan(m: Mirror, commit: str) -> dict[str, Declaration]:
    """The FetchContent declarations of ``commit`` in mirror ``m``."""
    files = [p for p in m.out("ls-tree", "-r", "--name-only", "-z", commit).split("\0") if p and wanted(p)]
    files.sort()
    if not files:
        return {}
    data = "".join(f"{commit}:{p}\n" for p in files).encode()
    raw = m.git("cat-file", "--batch", input=data).stdout
    decls: list[Declaration] = []
    pos = 0
    for p in files:
        nl = raw.index(b"\n", pos)
        header = raw[pos:nl].decode().split()
        pos = nl + 1
        if len(header) < 3 or header[1] != "blob":
            continue
        size = int(header[2])
        body = raw[pos:pos + size].decode("utf-8", "replace")
        pos += size + 1
        decls.extend(parse(body, p))
    return merge(decls)
