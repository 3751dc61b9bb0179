"""The package parts of an image definition: what wheels and apt packages a stage installs.

Pure parsing and validation (no network, no subprocess); ``definition.load`` calls in here and
keeps the results on ``Definition.python``, ``Definition.apt_snapshot`` and ``Stage.requirements``
/ ``Stage.apt``. The format (docs/image-definition.md, "Python wheels, apt packages and base
images"):

image.yaml, top level::

    python:                          # the target interpreter of stages that install wheels
      version: "3.12"                # CPython X.Y (a bare `python: "3.12"` also works)
      glibc: "2.39"                  # newest manylinux glibc the base has (default 2.17)
      index_url: PIP_INDEX_URL       # versions.env key holding the index URL (default, or an empty
                                     # value: pip's configured index)
      extra_index_urls: [TORCH_INDEX_URL]
    apt_snapshot: APT_SNAPSHOT       # optional versions.env key: snapshot date 20250101T000000Z

image.yaml, per stage::

    requirements: requirements-torch.txt    # or {file: ..., index_url: KEY, extra_index_urls: [KEY]}
    apt: apt-packages.txt

A requirements file holds exact pins only (``name==version``, optional ``[extras]`` and
``--hash=sha256:<hex>``); an apt file holds ``name=version`` lines. Comments start with ``#``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from imagebuild.core import lazy
from imagebuild.core.fsutil import sha256_bytes

# No index host is written here: without index_url (or with an empty versions.env value) wheels come
# from pip's configured index (`pip config`, PIP_INDEX_URL, else pip's own default), read at prefetch.
DEFAULT_GLIBC = "2.17"

PY_VERSION_RE = lazy.compile(r"3\.(?:[0-9]|[1-9][0-9])\Z")
GLIBC_RE = lazy.compile(r"2\.(?:[0-9]|[1-9][0-9])\Z")
SNAPSHOT_RE = lazy.compile(r"[0-9]{8}T[0-9]{6}Z\Z")
URL_RE = lazy.compile(r"(?:https?|file)://\S+\Z")
# PEP 508 name, optional extras, ==version (PEP 440 public + optional local label)
REQ_RE = lazy.compile(
    r"(?P<name>[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?)"
    r"(?:\[(?P<extras>[A-Za-z0-9._,\s-]*)\])?"
    r"\s*==\s*(?P<version>[A-Za-z0-9][A-Za-z0-9.!+_-]*)\Z")
HASH_RE = lazy.compile(r"--hash[=\s]sha256:(?P<hex>[0-9a-f]{64})\Z")
APT_RE = lazy.compile(r"(?P<name>[a-z0-9][a-z0-9+.-]+)(?::(?P<arch>[a-z0-9-]+))?="
                    r"(?P<version>(?:[0-9]+:)?[A-Za-z0-9][A-Za-z0-9.+~-]*)\Z")
# a name without a version: visibly unpinned; prefetch resolves it in the pinned base and writes it back
APT_UNPINNED_RE = lazy.compile(r"(?P<name>[a-z0-9][a-z0-9+.-]+)(?::(?P<arch>[a-z0-9-]+))?\Z")

PYTHON_KEYS = ("version", "glibc", "index_url", "extra_index_urls")
REQ_KEYS = ("file", "index_url", "extra_index_urls", "satisfies", "exceptions")


def normalise(name: str) -> str:
    """PEP 503 normalised project name."""
    return re.sub(r"[-_.]+", "-", name).lower()


@dataclass(frozen=True)
class Index:
    key: str | None  # versions.env key, None for the default
    url: str | None  # None: pip's configured index (resolved by prefetch, packages.pip_index_args)

    @property
    def shown(self) -> str | None:
        """The URL without credentials, None for pip's configured index (what keys and locks hold)."""
        return redact_url(self.url) if self.url is not None else None


PIP_CONFIGURED = Index(None, None)


@dataclass(frozen=True)
class PythonTarget:
    version: str  # "3.12"
    glibc: str  # "2.39"
    index: Index
    extra_indexes: tuple[Index, ...]

    @property
    def abi(self) -> str:
        return "cp" + self.version.replace(".", "")


@dataclass(frozen=True)
class Requirement:
    name: str  # as written
    extras: tuple[str, ...]
    version: str
    hashes: tuple[str, ...]  # hex sha256 digests the author gave (may be empty)
    line: int

    @property
    def key(self) -> str:
        return normalise(self.name)

    def spec(self) -> str:
        ex = f"[{','.join(self.extras)}]" if self.extras else ""
        return f"{self.name}{ex}=={self.version}"


@dataclass(frozen=True)
class Requirements:
    path: Path
    display: str
    sha256: str  # of the file's bytes
    items: tuple[Requirement, ...]
    index: Index | None  # stage override, else the python target's
    extra_indexes: tuple[Index, ...] | None
    # the composed trees' own requirement files the installed set must meet: ((SOURCE, (file, ...)), ...)
    satisfies: tuple[tuple[str, tuple[str, ...]], ...] = ()
    exceptions: tuple[tuple[str, str], ...] = ()  # (normalised name, why the set differs from the tree)


@dataclass(frozen=True)
class AptPackage:
    name: str
    arch: str | None
    version: str | None  # None: unpinned (prefetch resolves and writes back name=version)
    line: int

    def spec(self) -> str:
        return f"{self.name}{':' + self.arch if self.arch else ''}" + (f"={self.version}" if self.version else "")


@dataclass(frozen=True)
class AptList:
    path: Path
    display: str
    sha256: str
    items: tuple[AptPackage, ...]


# ---------------------------------------------------------------------------------------------
# image.yaml top level


def top_level(m: dict, yfile: str, env, err) -> tuple[PythonTarget | None, str | None, str | None]:
    """(python target, apt snapshot value, its versions.env key) from image.yaml's mapping ``m``.

    ``err(file, message, line=, key=, hint=)`` collects problems; ``env`` is the EnvFile.
    """
    python = None
    if "python" in m:
        node = m["python"]
        v = node.value
        fields: dict = {}
        if isinstance(v, (str, float)):
            fields = {"version": (str(v), node.line)}
        elif isinstance(v, dict):
            for k, line in (node.key_lines or {}).items():
                if k not in PYTHON_KEYS:
                    err(yfile, f"unknown key {k!r} in python", line=line, key=f"python.{k}",
                        hint=f"allowed: {', '.join(PYTHON_KEYS)}")
            fields = {k: (n.value, n.line) for k, n in v.items()}
        else:
            err(yfile, "expected a version like \"3.12\" or a mapping with version, glibc, index_url, "
                "extra_index_urls", line=node.line, key="python")
        ok = True
        version, vline = fields.get("version", (None, node.line))
        version = str(version) if isinstance(version, (str, float)) else version
        if not isinstance(version, str) or not PY_VERSION_RE.match(version):
            if fields or not isinstance(v, dict):
                err(yfile, f"invalid python version {version!r}: expected CPython X.Y, e.g. \"3.12\" (quoted)",
                    line=vline, key="python.version")
            ok = False
        glibc, gline = fields.get("glibc", (DEFAULT_GLIBC, node.line))
        glibc = str(glibc) if isinstance(glibc, (str, float)) else glibc
        if not isinstance(glibc, str) or not GLIBC_RE.match(glibc):
            err(yfile, f"invalid glibc {glibc!r}: expected 2.N, the newest manylinux level the base image "
                "supports (e.g. \"2.39\" for Ubuntu 24.04)", line=gline, key="python.glibc")
            ok = False
        index = PIP_CONFIGURED
        if "index_url" in fields:
            index = _index(fields["index_url"], yfile, "python.index_url", env, err)
            ok &= index is not None
        extras: tuple[Index, ...] = ()
        if "extra_index_urls" in fields:
            extras = _indexes(fields["extra_index_urls"], yfile, "python.extra_index_urls", env, err)
            ok &= extras is not None
        if ok:
            python = PythonTarget(version, glibc, index, extras)

    snapshot = snapshot_key = None
    if "apt_snapshot" in m:
        node = m["apt_snapshot"]
        key = node.value
        if not isinstance(key, str) or env.get(key) is None:
            err(yfile, f"apt_snapshot: {key!r} is not a versions.env key", line=node.line, key="apt_snapshot",
                hint="name a versions.env key, e.g. apt_snapshot: APT_SNAPSHOT with APT_SNAPSHOT=20250101T000000Z")
        elif not SNAPSHOT_RE.match(env.get(key)):
            err(env.display, f"invalid snapshot date {env.get(key)!r}: expected YYYYMMDDTHHMMSSZ",
                line=env.line_of(key), key=key, hint="e.g. 20250101T000000Z (UTC)")
        else:
            snapshot, snapshot_key = env.get(key), key
    return python, snapshot, snapshot_key


def _index(value_line, yfile, key, env, err) -> Index | None:
    value, line = value_line
    if not isinstance(value, str) or env.get(value) is None:
        err(yfile, f"{value!r} is not a versions.env key", line=line, key=key,
            hint="index URLs live in versions.env (e.g. TORCH_INDEX_URL=https://<index host>/whl/cu130, or "
            "PYPI_INDEX_URL= empty for pip's configured index); name the key here")
        return None
    url = env.get(value)
    if url == "":
        return Index(value, None)  # an empty value: pip's configured index
    if not URL_RE.match(url):
        err(env.display, f"invalid index URL {redact_url(url)!r}: expected https://, http:// or file://",
            line=env.line_of(value), key=value)
        return None
    return Index(value, url)


def _indexes(value_line, yfile, key, env, err) -> tuple[Index, ...] | None:
    value, line = value_line
    if not isinstance(value, list):
        err(yfile, "expected a list of versions.env keys", line=line, key=key)
        return None
    out = []
    for item in value:
        ix = _index((item.value, item.line), yfile, key, env, err)
        if ix is None:
            return None
        out.append(ix)
    return tuple(out)


def redact_url(url: str) -> str:
    """The URL without credentials (user:token@ becomes ***@): safe for logs, locks and reports."""
    return re.sub(r"(?<=://)[^/@\s]+@", "***@", url)


# ---------------------------------------------------------------------------------------------
# per stage


def stage_requirements(node, yfile: str, where: str, safe_path, display, env, err) -> Requirements | None:
    """Parse a stage's ``requirements:`` value; ``safe_path(value, line, key)`` resolves a path."""
    v = node.value
    index = extras = None
    if isinstance(v, dict):
        for k, line in (node.key_lines or {}).items():
            if k not in REQ_KEYS:
                err(yfile, f"unknown key {k!r} in {where}.requirements", line=line, key=f"{where}.requirements.{k}",
                    hint=f"allowed: {', '.join(REQ_KEYS)}")
                return None
        if "file" not in v:
            err(yfile, "requirements mapping without 'file'", line=node.line, key=f"{where}.requirements")
            return None
        if "index_url" in v:
            index = _index((v["index_url"].value, v["index_url"].line), yfile, f"{where}.requirements.index_url",
                           env, err)
            if index is None:
                return None
        if "extra_index_urls" in v:
            n = v["extra_index_urls"]
            extras = _indexes((n.value, n.line), yfile, f"{where}.requirements.extra_index_urls", env, err)
            if extras is None:
                return None
        fnode = v["file"]
        satisfies = _satisfies(v.get("satisfies"), yfile, f"{where}.requirements.satisfies", env, err)
        exceptions = _exceptions(v.get("exceptions"), yfile, f"{where}.requirements.exceptions", err)
        if satisfies is None or exceptions is None:
            return None
    else:
        fnode = node
        satisfies, exceptions = (), ()
    path = safe_path(fnode.value, fnode.line, f"{where}.requirements")
    if path is None:
        return None
    data = _read(path, fnode, yfile, f"{where}.requirements", display, err)
    if data is None:
        return None
    items = parse_requirements(data.decode("utf-8", "replace"), display(path), err)
    if items is None:
        return None
    if not items:
        err(display(path), "no requirements listed", hint="list exact pins, one per line: name==version")
        return None
    return Requirements(path, display(path), sha256_bytes(data), tuple(items), index, extras, satisfies, exceptions)


def _satisfies(node, yfile: str, key: str, env, err):
    """``satisfies: {VLLM: [requirements/cuda.txt]}``: files of git sources (versions.env NAME_REPO)."""
    if node is None:
        return ()
    if not isinstance(node.value, dict) or not node.value:
        err(yfile, "expected a mapping of git sources to lists of their requirement files", line=node.line, key=key,
            hint="e.g. satisfies: {VLLM: [requirements/cuda.txt]}")
        return None
    out = []
    for name, files in node.value.items():
        if env.get(f"{name}_REPO") is None:
            err(yfile, f"{name!r} is no git source (versions.env has no {name}_REPO)", line=files.line or node.line,
                key=f"{key}.{name}")
            return None
        vals = files.value if isinstance(files.value, list) else None
        if not vals or not all(isinstance(x.value, str) and x.value and not x.value.startswith("/")
                               and ".." not in x.value.split("/") for x in vals):
            err(yfile, "expected a list of paths inside the source tree", line=files.line or node.line,
                key=f"{key}.{name}", hint="e.g. [requirements/cuda.txt]")
            return None
        out.append((name, tuple(x.value for x in vals)))
    return tuple(out)


def _exceptions(node, yfile: str, key: str, err):
    """``exceptions: {torch: "why"}``: packages whose installed version may differ from the tree's."""
    if node is None:
        return ()
    if not isinstance(node.value, dict):
        err(yfile, "expected a mapping of package names to the reason each may differ", line=node.line, key=key)
        return None
    out = []
    for name, why in node.value.items():
        if not isinstance(why.value, str) or len(why.value.strip()) < 10:
            err(yfile, f"{name}: say why the set may differ from the tree here (a sentence)", line=why.line or node.line,
                key=f"{key}.{name}")
            return None
        out.append((normalise(name), why.value.strip()))
    return tuple(out)


def stage_apt(node, yfile: str, where: str, safe_path, display, err, note=None) -> AptList | None:
    path = safe_path(node.value, node.line, f"{where}.apt")
    if path is None:
        return None
    data = _read(path, node, yfile, f"{where}.apt", display, err)
    if data is None:
        return None
    items = parse_apt(data.decode("utf-8", "replace"), display(path), err)
    if items is None:
        return None
    if not items:
        err(display(path), "no packages listed", hint="list exact versions, one per line: name=version")
        return None
    for a in items:
        if a.version is None and note is not None:
            note(display(path), "unpinned apt package: imagebuild prefetch resolves it in the pinned base and "
                 "writes name=version here", line=a.line, key=a.name)
    return AptList(path, display(path), sha256_bytes(data), tuple(items))


def _read(path: Path, node, yfile, key, display, err) -> bytes | None:
    from imagebuild.definition import textfile

    kind = textfile.unreadable_kind(path)
    if kind:  # never read: a FIFO would hang validate
        err(yfile, f"{node.value!r} is {kind}, expected a file ({display(path)})", line=node.line, key=key)
        return None
    try:
        if path.is_dir():
            err(yfile, f"{node.value!r} is a folder, expected a file ({display(path)})", line=node.line, key=key)
            return None
        if path.is_file() and path.stat().st_size > textfile.MAX_BYTES:
            err(yfile, f"{node.value!r} is {path.stat().st_size} bytes: larger than {textfile.MAX_BYTES} bytes "
                "(8 MiB), the limit for a definition file", line=node.line, key=key)
            return None
        data = path.read_bytes()
    except FileNotFoundError:
        err(yfile, f"{node.value!r} not found ({display(path)})", line=node.line, key=key)
        return None
    except OSError as exc:
        err(yfile, f"{node.value!r}: cannot read: {exc.strerror}", line=node.line, key=key)
        return None
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        err(display(path), "not valid UTF-8 text")
        return None
    return data


def _logical_lines(text: str):
    """(first line number, text) with backslash continuations joined and comments removed."""
    buf, start = "", None
    for n, raw in enumerate(text.splitlines(), start=1):
        line = re.sub(r"(^|\s)#.*$", "", raw).rstrip()
        if start is None:
            start = n
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        buf += line
        if buf.strip():
            yield start, buf.strip()
        buf, start = "", None
    if buf.strip():
        yield start, buf.strip()


def parse_requirements(text: str, file: str, err) -> list[Requirement] | None:
    out: list[Requirement] = []
    seen: dict[str, int] = {}
    ok = True
    for line, body in _logical_lines(text):
        if body.startswith("-"):
            err(file, f"option {body.split()[0]!r}: options belong in image.yaml, not here", line=line,
                hint="index URLs and options belong in image.yaml (python.index_url), not in the file")
            ok = False
            continue
        parts = body.split()
        req_text, opts = [], []
        for p in parts:
            (opts if p.startswith("--") else req_text).append(p)
        spec = " ".join(req_text)
        if not req_text:
            err(file, f"option {opts[0]!r} without a requirement", line=line,
                hint="index URLs and options belong in image.yaml (python.index_url), not in the file")
            ok = False
            continue
        if ";" in spec or "@" in spec:
            err(file, f"{spec!r}: environment markers and direct URLs are not supported", line=line,
                hint="pin an exact version from an index: name==version")
            ok = False
            continue
        m = REQ_RE.match(spec.replace(" ", ""))
        if not m:
            err(file, f"{spec!r} is not an exact pin", line=line,
                hint="write name==version (ranges, '*' and '~=' would resolve differently over time)")
            ok = False
            continue
        hashes = []
        for o in opts:
            hm = HASH_RE.match(o.replace("--hash ", "--hash="))
            if not hm:
                err(file, f"unsupported option {o!r}", line=line,
                    hint="only --hash=sha256:<64 hex> may follow a requirement; indexes go in image.yaml")
                ok = False
                continue
            hashes.append(hm.group("hex"))
        name = m.group("name")
        if normalise(name) in seen:
            err(file, f"{name} is listed twice (first on line {seen[normalise(name)]})", line=line)
            ok = False
            continue
        seen[normalise(name)] = line
        extras = tuple(sorted(e.strip() for e in (m.group("extras") or "").split(",") if e.strip()))
        out.append(Requirement(name, extras, m.group("version"), tuple(hashes), line))
    return out if ok else None


def parse_apt(text: str, file: str, err) -> list[AptPackage] | None:
    out: list[AptPackage] = []
    seen: dict[str, int] = {}
    ok = True
    for line, body in _logical_lines(text):
        for word in body.split():
            m = APT_RE.match(word) or APT_UNPINNED_RE.match(word)
            if not m:
                err(file, f"{word!r}: expected name=version with an exact Debian version (or a bare name, "
                    "which prefetch pins)", line=line,
                    hint="e.g. jq=1.6-2.1; `apt-cache policy NAME` in the base image shows the candidates")
                ok = False
                continue
            key = m.group("name") + (":" + m.group("arch") if m.group("arch") else "")
            if key in seen:
                err(file, f"{key} is listed twice (first on line {seen[key]})", line=line)
                ok = False
                continue
            seen[key] = line
            out.append(AptPackage(m.group("name"), m.group("arch"), m.groupdict().get("version"), line))
    return out if ok else None
