"""Read and validate an image definition: ``docker-images/<name>/`` -> a frozen ``Definition``.

A definition folder holds:

- ``versions.env``: every pin (git sources, base images, versions fed to build args);
- ``image.yaml``: target platform, the stages in build order (Dockerfile, parent, context
  files, patches, sources), and where the gate spec lives;
- one Dockerfile per stage, and the files and patches the stages consume.

Every problem found is collected and raised at once as ``DefinitionError`` (exit 2), each naming
its file, line or key, what was expected, and a hint. Nothing here writes anything.
The format is documented in docs/image-definition.md.
"""

from __future__ import annotations

import fnmatch
import os
import re
from pathlib import Path, PurePosixPath

from . import dockerfile as dockerfile_mod
from . import envfile, lazy, pkgspec, textfile, yamlread
from . import source_options as source_options_mod
from .errors import DefinitionError, Problem, UsageError
from .records import dataclass, field
from .source_options import (  # noqa: F401  (re-exported: prefetch and tests import them from here)
    ENV_NAME_RE,
    SOURCE_KEYS,
    SourceOptions,
    default_source_options,
)

difflib = lazy.module("difflib")  # error hints only

IMAGES_DIR = "docker-images"
SHARED_PATCHES_DIR = "patches-eugr"
VERSIONS_FILE = "versions.env"
IMAGE_FILE = "image.yaml"
DEFAULT_GATE_FILE = "gate.yaml"

NAME_RE = lazy.compile(r"[a-z0-9]+(?:[._-][a-z0-9]+)*\Z")
STAGE_RE = lazy.compile(r"[a-z][a-z0-9]*(?:[_-][a-z0-9]+)*\Z")
SHA_RE = lazy.compile(r"[0-9a-f]{40}\Z")
HEXISH_RE = lazy.compile(r"[0-9a-fA-F]{4,64}\Z")
REF_NAME_RE = lazy.compile(r"[A-Za-z0-9][A-Za-z0-9._/+-]*\Z")
PR_RE = lazy.compile(r"(?P<num>[1-9][0-9]*)(?:@(?P<sha>[^\s,]*))?\Z")
# registry/name[:tag][@sha256:digest]; name components are lower case
IMAGE_REF_RE = lazy.compile(
    r"(?P<name>(?:[a-zA-Z0-9.-]+(?::[0-9]+)?/)?[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
    r"(?:/[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*)*)"
    r"(?::(?P<tag>[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}))?"
    r"(?:@(?P<digest>[A-Za-z0-9]+:[^\s]*))?\Z"
)
DIGEST_RE = lazy.compile(r"sha256:[0-9a-f]{64}\Z")
REPO_URL_RE = lazy.compile(r"(?:(?:https?|git|ssh|file)://\S+|[A-Za-z0-9._-]+@[A-Za-z0-9.-]+:\S+)\Z")
PLATFORM_RE = lazy.compile(r"linux/(amd64|arm64|arm/v7|arm/v6|ppc64le|s390x|riscv64|386)\Z")

# Build args the plan provides (not from versions.env).
ARG_PARENT = "PARENT"
ARG_BUILD_ID = "IMAGEBUILD_BUILD_ID"  # refused: the build id derives from the stage keys
ARG_IMAGE = "IMAGEBUILD_IMAGE"
ARG_STAGE = "IMAGEBUILD_STAGE"
STAGE_ARG_PREFIX = "STAGE_"
# Named build contexts the build provides (imagebuild-src, imagebuild-wheels, imagebuild-apt, ...).
BUILD_CONTEXT_PREFIX = "imagebuild-"
# Filled in by BuildKit itself from the platform (which is part of every key).
BUILDKIT_ARGS = frozenset(
    f"{p}{s}" for p in ("TARGET", "BUILD") for s in ("PLATFORM", "OS", "ARCH", "VARIANT")
)

STAGE_KEYS = ("name", "dockerfile", "from", "files", "patches", "sources", "network", "description",
              "requirements", "apt")
TOP_KEYS = ("description", "platform", "stages", "gate", "sources", "python", "apt_snapshot")


def stage_arg(stage_name: str) -> str:
    """The build arg through which a later stage receives an earlier stage's image."""
    return STAGE_ARG_PREFIX + stage_name.upper().replace("-", "_")


@dataclass(frozen=True)
class ImageRef:
    key: str  # versions.env key holding it
    value: str
    name: str
    tag: str | None
    digest: str | None

    @property
    def pinned(self) -> bool:
        return self.digest is not None


@dataclass(frozen=True)
class PullRequest:
    number: int
    sha: str | None  # None: not pinned yet (prefetch resolves it)


@dataclass(frozen=True)
class GitSource:
    name: str  # e.g. VLLM (the versions.env prefix)
    repo: str
    ref: str  # the commit (40 hex) once pinned, else the branch or tag name to resolve
    prs: tuple[PullRequest, ...]
    follows: str | None = None  # NAME_REF=<branch or tag>@<sha>: the name the pin follows (--refresh moves it)

    @property
    def ref_pinned(self) -> bool:
        return bool(SHA_RE.match(self.ref))

    @property
    def pinned(self) -> bool:
        return self.ref_pinned and all(pr.sha for pr in self.prs)

    def pins(self) -> dict:
        return {"repo": self.repo, "ref": self.ref,
                "prs": [f"{p.number}@{p.sha}" if p.sha else str(p.number) for p in self.prs]}


@dataclass(frozen=True)
class InputFile:
    declared: str  # as written in image.yaml
    path: Path  # absolute path on disk
    context_path: str  # where the stage's build context holds it
    kind: str  # "file" or "patch"


@dataclass(frozen=True)
class Parent:
    kind: str  # "image" (a versions.env key) or "stage"
    name: str  # the key or the stage name


@dataclass(frozen=True)
class ArgSource:
    name: str
    origin: str  # "versions.env", "plan", "buildkit", "default"
    default: str | None = None


@dataclass(frozen=True)
class Stage:
    name: str
    dockerfile: Path
    dockerfile_display: str
    dockerfile_bytes: bytes
    parsed: dockerfile_mod.Dockerfile
    parent: Parent
    inputs: tuple[InputFile, ...]
    sources: tuple[str, ...]
    network: bool
    description: str | None
    args: tuple[ArgSource, ...]
    requirements: pkgspec.Requirements | None = None  # wheels it installs (pkgspec.py)
    apt: pkgspec.AptList | None = None  # apt packages it installs

    @property
    def stage_deps(self) -> tuple[str, ...]:
        """Earlier stages whose image this stage uses through a ``STAGE_*`` build arg."""
        return tuple(a.name for a in self.args if a.origin == "plan" and a.name.startswith(STAGE_ARG_PREFIX))


@dataclass(frozen=True)
class Notice:
    """Something that is not an error but must be said (for example an unpinned source)."""

    file: str
    line: int | None
    key: str | None
    message: str

    def render(self) -> str:
        loc = self.file + (f":{self.line}" if self.line else "") + (f": {self.key}" if self.key else "")
        return f"{loc}: {self.message}"


@dataclass(frozen=True)
class Definition:
    name: str
    root: Path
    dir: Path
    platform: str
    description: str | None
    env: envfile.EnvFile
    stages: tuple[Stage, ...]
    sources: dict[str, GitSource]
    images: dict[str, ImageRef]
    gate: Path | None
    notices: tuple[Notice, ...] = field(default=())
    python: pkgspec.PythonTarget | None = None  # target of the wheel downloads
    apt_snapshot: str | None = None  # snapshot archive date (versions.env value)
    source_options: dict[str, SourceOptions] = field(default_factory=dict)

    def rel(self, path: Path) -> str:
        return display_path(self.root, path)

    def stage(self, name: str) -> Stage:
        for s in self.stages:
            if s.name == name:
                return s
        raise KeyError(name)


def display_path(root: Path, path: Path) -> str:
    try:
        return Path(os.path.relpath(path, root)).as_posix()
    except ValueError:
        return str(path)


# ---------------------------------------------------------------------------------------------
# project root and image names


def find_root(start: Path | None = None, explicit: str | None = None) -> Path:
    """The project root: ``explicit`` (``--root``/``IMAGEBUILD_ROOT``) or the nearest folder
    at or above ``start`` that holds ``docker-images/``."""
    if explicit:
        root = Path(explicit).resolve()
        if not (root / IMAGES_DIR).is_dir():
            raise UsageError(f"{root}: no {IMAGES_DIR}/ folder here",
                             hint="--root (or IMAGEBUILD_ROOT) must name a folder that holds docker-images/")
        return root
    here = (start or Path.cwd()).resolve()
    for cand in (here, *here.parents):
        if (cand / IMAGES_DIR).is_dir():
            return cand
    raise UsageError(f"no {IMAGES_DIR}/ folder in {here} or any folder above it",
                     hint="run imagebuild inside a project, or pass --root DIR")


def check_image_name(name: str) -> None:
    if not NAME_RE.match(name):
        raise DefinitionError([Problem(
            "<command line>", f"invalid image name {name!r}: expected a plain identifier "
            "(lower-case letters, digits, '.', '_', '-'; no slashes, no '..')", key="IMAGE",
            hint="image names are folder names under docker-images/, e.g. glm53-jovian-r12")])


def list_images(root: Path) -> list[str]:
    base = root / IMAGES_DIR
    return sorted(p.name for p in base.iterdir() if p.is_dir() and NAME_RE.match(p.name)
                  and (p / IMAGE_FILE).exists())


# ---------------------------------------------------------------------------------------------
# loading


class _Collector:
    def __init__(self) -> None:
        self.problems: list[Problem] = []
        self.notices: list[Notice] = []

    def err(self, file: str, message: str, *, line: int | None = None, key: str | None = None,
            hint: str | None = None) -> None:
        self.problems.append(Problem(file, message, line=line, key=key, hint=hint))

    def note(self, file: str, message: str, *, line: int | None = None, key: str | None = None) -> None:
        self.notices.append(Notice(file, line, key, message))


def load(root: Path, name: str) -> Definition:
    """Read, validate and return the definition ``name``; raise DefinitionError on any problem."""
    check_image_name(name)
    root = root.resolve()
    d = root / IMAGES_DIR / name
    c = _Collector()
    disp = lambda p: display_path(root, p)  # noqa: E731
    if not d.is_dir():
        known = list_images(root) if (root / IMAGES_DIR).is_dir() else []
        close = difflib.get_close_matches(name, known, n=1)
        raise DefinitionError([Problem(
            disp(d), "no such image definition (folder not found)", key="IMAGE",
            hint=f"did you mean {close[0]!r}?" if close else
            f"known images: {', '.join(known) or 'none'} (imagebuild list)")], image=name)

    env = _load_env(d / VERSIONS_FILE, disp(d / VERSIONS_FILE), c)
    spec = _load_yaml(d / IMAGE_FILE, disp(d / IMAGE_FILE), c)
    if env is None or spec is None:
        raise DefinitionError(c.problems, image=name)

    yfile = disp(d / IMAGE_FILE)
    sources = _git_sources(env, c)
    platform, description, gate, stage_nodes = _top_level(spec, yfile, d, c)
    python, apt_snapshot, _ = pkgspec.top_level(spec.value, yfile, env, c.err)
    source_options = source_options_mod.source_options(spec, yfile, env, sources, c.err)

    stages: list[Stage] = []
    images: dict[str, ImageRef] = {}
    seen_names: dict[str, int] = {}
    broken: set = set()  # stages with problems: later stages that use them report nothing more
    all_names = [n.value["name"].value for n in stage_nodes
                 if isinstance(n.value, dict) and "name" in n.value]
    for node in stage_nodes:
        st = _stage(node, yfile, root, d, env, sources, seen_names, stages, images, all_names, broken, c)
        if st is not None:
            stages.append(st)
        elif isinstance(node.value, dict) and "name" in node.value:
            broken.add(node.value["name"].value)

    if python is None and "python" not in spec.value:
        for st in stages:
            if st.requirements is not None:
                c.err(yfile, f"stage {st.name!r} installs wheels but image.yaml has no 'python:'",
                      key=f"stages[{st.name}].requirements", line=1,
                      hint='add e.g. python: "3.12" (the base image\'s CPython) at the top level')
                break
    if c.problems:
        raise DefinitionError(c.problems, image=name)
    return Definition(
        name=name, root=root, dir=d, platform=platform, description=description, env=env,
        stages=tuple(stages), sources=sources, images=images, gate=gate, notices=tuple(c.notices),
        source_options=source_options, python=python, apt_snapshot=apt_snapshot)


def _load_env(path: Path, display: str, c: _Collector) -> envfile.EnvFile | None:
    if not path.is_file():
        c.err(display, "missing", hint="every image folder holds a versions.env with its pins")
        return None
    text = _read_text(path, display, c)
    if text is None:
        return None
    # problems are collected into c.problems; keep going so every file is checked in one run
    return envfile.parse_text(text, path, display, c.problems)


def _read_text(path: Path, display: str, c: _Collector) -> str | None:
    """The file as UTF-8 text, or None with the problem (the line and column of a bad byte) collected."""
    try:
        return textfile.decode(path.read_bytes())
    except textfile.TextError as exc:
        c.err(display, exc.message, line=exc.line)
    except OSError as exc:
        c.err(display, f"cannot read: {exc.strerror}", hint="check the file's permissions")
    return None


def _load_yaml(path: Path, display: str, c: _Collector) -> yamlread.Node | None:
    if not path.is_file():
        c.err(display, "missing", hint="every image folder holds an image.yaml listing its stages "
              "(see docs/image-definition.md)")
        return None
    text = _read_text(path, display, c)
    if text is None:
        return None
    try:
        node = yamlread.load(text)
    except yamlread.YamlError as exc:
        c.err(display, str(exc), line=exc.line)
        return None
    if node is None or not isinstance(node.value, dict):
        c.err(display, "expected a mapping with 'platform' and 'stages'", line=node.line if node else 1)
        return None
    return node


def _unknown_keys(node: yamlread.Node, allowed: tuple[str, ...], file: str, where: str, c: _Collector) -> None:
    for key, line in (node.key_lines or {}).items():
        if key not in allowed:
            close = difflib.get_close_matches(key, allowed, n=1)
            c.err(file, f"unknown key {key!r} in {where}", line=line, key=key,
                  hint=f"did you mean {close[0]!r}?" if close else f"allowed: {', '.join(allowed)}")


def _top_level(spec: yamlread.Node, yfile: str, d: Path, c: _Collector):
    _unknown_keys(spec, TOP_KEYS, yfile, "image.yaml", c)
    m = spec.value
    platform = ""
    if "platform" not in m:
        c.err(yfile, "missing required key", key="platform", line=1,
              hint="the target platform, e.g. 'platform: linux/arm64' for DGX Spark")
    else:
        platform = m["platform"].value
        if not isinstance(platform, str) or not PLATFORM_RE.match(platform):
            c.err(yfile, f"invalid platform {platform!r}: expected linux/<arch>, e.g. linux/arm64",
                  line=m["platform"].line, key="platform")
            platform = ""
    description = m["description"].value if "description" in m else None
    if description is not None and not isinstance(description, str):
        c.err(yfile, "expected a string", line=m["description"].line, key="description")
        description = None

    gate = None
    if "gate" in m:
        g = m["gate"].value
        gp = _safe_rel_path(g, d, yfile, m["gate"].line, "gate", c)
        if gp is not None:
            if not gp.is_file():
                c.err(yfile, f"gate spec {g!r} not found", line=m["gate"].line, key="gate")
            else:
                gate = gp
    elif (d / DEFAULT_GATE_FILE).is_file():
        gate = d / DEFAULT_GATE_FILE
    if gate is not None:  # the gate spec is part of the definition: validate it too (docs/gate.md)
        from . import gatespec

        try:
            shown = (PurePosixPath(yfile).parent / gate.relative_to(d).as_posix()).as_posix()
        except ValueError:
            shown = str(gate)
        try:
            gatespec.load(gate, display=shown)
        except DefinitionError as exc:
            c.problems.extend(exc.problems)

    stage_nodes: list[yamlread.Node] = []
    if "stages" not in m:
        c.err(yfile, "missing required key", key="stages", line=1,
              hint="list the stages in build order, each with name and from")
    elif not isinstance(m["stages"].value, list) or not m["stages"].value:
        c.err(yfile, "expected a non-empty list of stages", line=m["stages"].line, key="stages")
    else:
        stage_nodes = m["stages"].value
    return platform, description, gate, stage_nodes


def _safe_rel_path(value, base: Path, file: str, line: int, key: str, c: _Collector) -> Path | None:
    """``value`` as a path inside ``base``; refuse absolute paths, '..' and escaping symlinks."""
    if not isinstance(value, str) or not value.strip():
        c.err(file, "expected a relative path", line=line, key=key)
        return None
    p = PurePosixPath(value)
    if p.is_absolute() or ".." in p.parts or "\\" in value:
        c.err(file, f"path {value!r} must stay inside {display_path(base.parent.parent, base)}/ "
              "(no absolute paths, no '..')", line=line, key=key)
        return None
    full = base / p
    try:
        real = full.resolve()
    except OSError:
        real = full
    if base.resolve() not in (real, *real.parents):
        c.err(file, f"path {value!r} leads outside its folder (through a symlink)", line=line, key=key)
        return None
    return full


def _git_sources(env: envfile.EnvFile, c: _Collector) -> dict[str, GitSource]:
    f = env.display
    sources: dict[str, GitSource] = {}
    names = {k[: -len("_REPO")] for k in env.entries if k.endswith("_REPO")}
    broken_names = {k[: -len("_REPO")] for k in env.broken if k.endswith("_REPO")}
    # _REF / _PRS without a _REPO
    for key in env.entries:
        for suffix in ("_REF", "_PRS"):
            if key.endswith(suffix) and key[: -len(suffix)] not in names | broken_names and suffix == "_PRS":
                c.err(f, f"{key} has no matching {key[: -len(suffix)]}_REPO", line=env.line_of(key), key=key,
                      hint=f"add {key[: -len(suffix)]}_REPO=<git URL> or remove the line")
    for name in sorted(names):
        rk, fk, pk = f"{name}_REPO", f"{name}_REF", f"{name}_PRS"
        repo = env.get(rk) or ""
        ok = True
        if not REPO_URL_RE.match(repo):
            c.err(f, f"invalid repository URL {repo!r}: expected https://, git://, ssh://, file:// or "
                  "user@host:path", line=env.line_of(rk), key=rk)
            ok = False
        ref = env.get(fk)
        follows, ref_ok = None, True
        if ref and "@" in ref:  # <branch or tag>@<sha>: a pin that remembers what it follows
            follows, _, ref = ref.rpartition("@")
            if not REF_NAME_RE.match(follows) or ".." in follows:
                c.err(f, f"invalid ref name {follows!r} before '@' (expected a branch or tag name)",
                      line=env.line_of(fk), key=fk, hint=f"write {fk}=<branch or tag>@<40-hex sha>, or only one")
                ok = ref_ok = False
            elif not SHA_RE.match(ref):
                c.err(f, f"{follows}@{ref}: {ref!r} is not a full 40-hex commit sha", line=env.line_of(fk), key=fk,
                      hint=f"write {fk}={follows} and let prefetch pin it as {follows}@<sha>")
                ok = ref_ok = False
        if not ref_ok:
            pass
        elif ref is None:
            c.err(f, f"git source {name} has {rk} but no {fk}", line=env.line_of(rk), key=fk,
                  hint=f"add {fk}=<full 40-hex commit sha>")
            ok = False
        elif not ref:
            c.err(f, "empty ref", line=env.line_of(fk), key=fk, hint="give the full 40-hex commit sha")
            ok = False
        elif not SHA_RE.match(ref):
            if HEXISH_RE.match(ref):
                if len(ref) == 40:
                    c.err(f, "commit sha must be lower-case hex", line=env.line_of(fk), key=fk)
                else:
                    c.err(f, f"short or malformed commit sha {ref!r} ({len(ref)} hex digits): expected "
                          "the full 40-hex commit", line=env.line_of(fk), key=fk,
                          hint="abbreviated shas are ambiguous; `git rev-parse <sha>` in a clone gives the "
                          "full one")
                ok = False
            elif REF_NAME_RE.match(ref):
                c.note(f, f"ref {ref!r} is a name, not a commit: unpinned (imagebuild prefetch resolves it)",
                       line=env.line_of(fk), key=fk)
            else:
                c.err(f, f"invalid ref {ref!r}: expected a full 40-hex commit sha", line=env.line_of(fk), key=fk)
                ok = False
        prs: list[PullRequest] = []
        raw_prs = env.get(pk)
        if raw_prs is not None:
            seen: set[int] = set()
            for item in raw_prs.replace(",", " ").split():
                m = PR_RE.match(item)
                if not m:
                    c.err(f, f"invalid pull request {item!r}: expected N or N@<40-hex sha>",
                          line=env.line_of(pk), key=pk, hint='e.g. VLLM_PRS="550@<sha> 552"')
                    ok = False
                    continue
                num, sha = int(m.group("num")), m.group("sha")
                if sha is not None and not SHA_RE.match(sha):
                    c.err(f, f"pull request {num}: {sha!r} is not a full 40-hex commit sha",
                          line=env.line_of(pk), key=pk,
                          hint=f"write {num}@<40-hex sha>, or a bare {num} to let prefetch pin it")
                    ok = False
                    continue
                if num in seen:
                    c.err(f, f"pull request {num} is listed twice", line=env.line_of(pk), key=pk)
                    ok = False
                    continue
                seen.add(num)
                if sha is None:
                    c.note(f, f"pull request {num} is not pinned (imagebuild prefetch pins its head)",
                           line=env.line_of(pk), key=pk)
                prs.append(PullRequest(num, sha))
        if ok and ref is not None:
            sources[name] = GitSource(name, repo, ref, tuple(prs), follows)
    return sources


def parse_image_ref(key: str, value: str) -> tuple[ImageRef | None, str | None]:
    """(ref, error message)."""
    m = IMAGE_REF_RE.match(value or "")
    if not m:
        return None, (f"invalid image reference {value!r}: expected name:tag@sha256:<64 hex>")
    digest = m.group("digest")
    if digest is not None and not DIGEST_RE.match(digest):
        return None, (f"invalid digest {digest!r}: expected sha256: followed by 64 lower-case hex digits")
    return ImageRef(key, value, m.group("name"), m.group("tag"), digest), None


def _stage(node, yfile, root, d, env, sources, seen_names, done, images, all_names, broken, c) -> Stage | None:
    if not isinstance(node.value, dict):
        c.err(yfile, "each stage must be a mapping with at least 'name' and 'from'", line=node.line)
        return None
    _unknown_keys(node, STAGE_KEYS, yfile, "a stage", c)
    m = node.value
    if "name" not in m:
        c.err(yfile, "stage without a name", line=node.line, key="name")
        return None
    name = m["name"].value
    where = f"stages[{name}]"
    if not isinstance(name, str) or not STAGE_RE.match(name):
        c.err(yfile, f"invalid stage name {name!r}: expected lower-case letters, digits, '-' or '_', "
              "starting with a letter", line=m["name"].line, key="name")
        return None
    if name in seen_names:
        c.err(yfile, f"duplicate stage name {name!r} (first on line {seen_names[name]})", line=m["name"].line,
              key=f"{where}.name")
        return None
    seen_names[name] = m["name"].line
    earlier = [s.name for s in done]
    ok = True

    # parent
    parent = None
    if "from" not in m:
        c.err(yfile, f"stage {name!r} has no 'from'", line=node.line, key=f"{where}.from",
              hint="'from' names an earlier stage or a versions.env key holding a base image")
        ok = False
    else:
        fv, fl = m["from"].value, m["from"].line
        if isinstance(fv, str) and fv in earlier:
            parent = Parent("stage", fv)
        elif isinstance(fv, str) and (fv in broken or fv in env.broken):
            ok = False
        elif isinstance(fv, str) and env.get(fv) is not None:
            ref, msg = parse_image_ref(fv, env.get(fv))
            if msg:
                c.err(env.display, msg, line=env.line_of(fv), key=fv)
                ok = False
            else:
                images[fv] = ref
                parent = Parent("image", fv)
                if not ref.pinned:
                    c.note(env.display, f"base image {ref.value!r} has no digest: unpinned "
                           "(imagebuild prefetch resolves and pins it)", line=env.line_of(fv), key=fv)
        else:
            later = isinstance(fv, str) and fv in all_names
            cands = earlier + [k for k in env.entries]
            close = difflib.get_close_matches(str(fv), cands, n=1)
            c.err(yfile, f"stage {name!r}: from {fv!r} is " +
                  ("a later stage (stages build in the order listed)" if later else
                   "neither an earlier stage nor a versions.env key"),
                  line=fl, key=f"{where}.from",
                  hint=f"did you mean {close[0]!r}?" if close else
                  f"earlier stages: {', '.join(earlier) or 'none'}")
            ok = False

    # Dockerfile
    df_decl = m["dockerfile"].value if "dockerfile" in m else f"Dockerfile.{name}"
    df_line = m["dockerfile"].line if "dockerfile" in m else m["name"].line
    df_path = _safe_rel_path(df_decl, d, yfile, df_line, f"{where}.dockerfile", c)
    df_bytes = b""
    parsed = None
    if df_path is not None:
        df_disp = display_path(root, df_path)
        try:
            df_bytes = df_path.read_bytes()
            parsed = dockerfile_mod.parse(textfile.decode(df_bytes))
        except textfile.TextError as exc:
            c.err(df_disp, exc.message, line=exc.line)
        except FileNotFoundError:
            c.err(yfile, f"stage {name!r}: Dockerfile {df_decl!r} not found", line=df_line,
                  key=f"{where}.dockerfile",
                  hint=f"create {df_disp} or set 'dockerfile:' for the stage")
        except IsADirectoryError:
            c.err(yfile, f"stage {name!r}: {df_disp} is a folder, not a Dockerfile", line=df_line,
                  key=f"{where}.dockerfile")
        except OSError as exc:
            c.err(df_disp, f"cannot read: {exc.strerror}", hint="check the file's permissions")
    else:
        df_disp = str(df_decl)

    # files and patches
    inputs: list[InputFile] = []
    inputs_ok = True
    for key, kind in (("files", "file"), ("patches", "patch")):
        if key not in m:
            continue
        items = m[key].value
        if not isinstance(items, list):
            c.err(yfile, "expected a list of paths", line=m[key].line, key=f"{where}.{key}")
            ok = False
            continue
        for item in items:
            inp = _input(item, kind, root, d, yfile, f"{where}.{key}", c)
            if inp is None:
                ok = inputs_ok = False
            elif any(i.context_path == inp.context_path for i in inputs):
                c.err(yfile, f"{inp.context_path!r} is declared twice", line=item.line, key=f"{where}.{key}")
                ok = False
            else:
                inputs.append(inp)

    # git sources mounted into the stage
    stage_sources: list[str] = []
    if "sources" in m:
        items = m["sources"].value
        if not isinstance(items, list):
            c.err(yfile, "expected a list of git source names", line=m["sources"].line, key=f"{where}.sources")
            ok = False
        else:
            for item in items:
                sname = item.value
                if sname in sources:
                    stage_sources.append(sname)
                elif isinstance(sname, str) and env.get(f"{sname}_REPO") is not None:
                    ok = False  # already reported against versions.env
                else:
                    close = difflib.get_close_matches(str(sname), list(sources), n=1)
                    c.err(yfile, f"unknown git source {sname!r}: versions.env has no {sname}_REPO",
                          line=item.line, key=f"{where}.sources",
                          hint=f"did you mean {close[0]!r}?" if close else
                          f"known sources: {', '.join(sorted(sources)) or 'none'}")
                    ok = False

    network = False
    if "network" in m:
        network = m["network"].value
        if not isinstance(network, bool):
            c.err(yfile, "expected true or false", line=m["network"].line, key=f"{where}.network")
            ok = False
            network = False
    desc = m["description"].value if "description" in m else None

    # packages the stage installs (prefetched as wheels / debs; pkgspec.py)
    reqs = apt = None
    pkg_path = lambda v, line, key: _safe_rel_path(v, d, yfile, line, key, c)  # noqa: E731
    disp = lambda p: display_path(root, p)  # noqa: E731
    if "requirements" in m:
        reqs = pkgspec.stage_requirements(m["requirements"], yfile, where, pkg_path, disp, env, c.err)
        ok &= reqs is not None
    if "apt" in m:
        apt = pkgspec.stage_apt(m["apt"], yfile, where, pkg_path, disp, c.err)
        ok &= apt is not None

    args: list[ArgSource] = []
    if parsed is not None:
        ok &= _check_dockerfile(name, parsed, df_disp, env, earlier + sorted(broken), inputs, args, c,
                                check_copies=inputs_ok)
        ok &= _args_fit_command_line(name, parsed, df_disp, env, args, c)
    if not ok or parsed is None or parent is None:
        return None
    return Stage(name=name, dockerfile=df_path, dockerfile_display=df_disp, dockerfile_bytes=df_bytes,
                 parsed=parsed, parent=parent, inputs=tuple(inputs), sources=tuple(stage_sources),
                 network=network, description=desc, args=tuple(args), requirements=reqs, apt=apt)


def _input(item, kind, root: Path, d: Path, yfile: str, key: str, c: _Collector) -> InputFile | None:
    value = item.value
    if isinstance(value, str) and value.startswith(SHARED_PATCHES_DIR + "/"):
        base = root / SHARED_PATCHES_DIR
        rel = value[len(SHARED_PATCHES_DIR) + 1:]
    else:
        base, rel = d, value
    full = _safe_rel_path(rel, base, yfile, item.line, key, c)
    if full is None:
        return None
    if not full.exists():
        c.err(yfile, f"{value!r} not found ({display_path(root, full)})", line=item.line, key=key)
        return None
    if not os.access(full, os.R_OK) or (full.is_dir() and not os.access(full, os.X_OK)):
        c.err(yfile, f"{value!r} is not readable", line=item.line, key=key, hint="check its permissions")
        return None
    if full.is_file():
        try:
            with open(full, "rb"):
                pass
        except OSError as exc:
            c.err(yfile, f"{value!r}: cannot read: {exc.strerror}", line=item.line, key=key)
            return None
    if kind == "patch":
        if not (full.is_file() and full.name.startswith("patch_") and full.name.endswith(".py")):
            c.err(yfile, f"patch {value!r} must be a file named patch_*.py", line=item.line, key=key)
            return None
        if not _compiles(full, display_path(root, full), c):
            return None
        ctx = f"patches/{full.name}"
    else:
        ctx = PurePosixPath(rel).as_posix().rstrip("/")
    return InputFile(declared=str(value), path=full, context_path=ctx, kind=kind)


# The build args of one stage all go on one docker command line. Linux allows ARG_MAX (usually
# 2 MiB) for the arguments and the environment together; half of it is left to the environment.
BUILD_ARGS_MAX = 1 << 20


def _args_fit_command_line(name, parsed, df_disp, env, args, c) -> bool:
    total = 0
    for a in args:
        if a.origin == "versions.env":
            total += len("--build-arg") + len(f"{a.name}={env.get(a.name)}".encode()) + 2
            if total > BUILD_ARGS_MAX:
                line = next(x.line for x in parsed.args if x.name == a.name)
                c.err(df_disp, f"stage {name!r}: its build args from versions.env reach {total} bytes at ARG "
                      f"{a.name}: more than {BUILD_ARGS_MAX} bytes (half of Linux's usual 2 MiB ARG_MAX) on "
                      "one docker command line", line=line, key=a.name,
                      hint="pins are short: put long content in a file the stage lists under 'files:'")
                return False
    return True


def _check_from_refs(parsed, df_disp, env, plan_args, aliases, earlier, c) -> bool:
    """``COPY --from=X`` and ``RUN --mount=...,from=X``: X is a stage of this Dockerfile (its name or
    index), a build context imagebuild provides, or exactly ${NAME} with NAME PARENT, an earlier
    stage's STAGE_* arg or a versions.env key holding an image. Never a literal image: every image
    pin lives in versions.env."""
    ok = True
    declared = set(parsed.arg_names())
    refs = [(f"{cp.keyword} --from={cp.from_stage!r}", cp.from_stage, cp.line) for cp in parsed.copies
            if cp.from_stage is not None]
    refs += [(f"RUN --mount from={value!r}", value, line) for value, line in parsed.mount_froms]
    for what, value, line in refs:
        var = dockerfile_mod.variable(value)
        if value in aliases or value.startswith(BUILD_CONTEXT_PREFIX) or \
                (value.isdigit() and int(value) < len(parsed.froms)):
            continue
        if var is not None:
            if var not in plan_args and env.get(var) is None:
                c.err(df_disp, f"{what}: {var} is neither PARENT, an earlier stage's STAGE_* arg, nor a "
                      "versions.env key", line=line, key=var)
                ok = False
            elif var not in declared:
                c.err(df_disp, f"{what}: no 'ARG {var}' declares it", line=line, key=var,
                      hint=f"add 'ARG {var}' before the first FROM")
                ok = False
            elif var not in plan_args:
                _, msg = parse_image_ref(var, env.get(var))
                if msg:
                    c.err(env.display, msg, line=env.line_of(var), key=var)
                    ok = False
            continue
        if value in earlier:
            hint = (f"{value!r} is an imagebuild stage, not a stage of this Dockerfile: declare "
                    f"'ARG {stage_arg(value)}' before the first FROM and write ${{{stage_arg(value)}}}")
        else:
            hint = ("every image pin lives in versions.env: add KEY=<image>@sha256:<digest> there, declare "
                    "'ARG KEY' before the first FROM and write ${KEY}; or name a stage of this Dockerfile "
                    "(FROM ... AS NAME)")
        c.err(df_disp, f"{what} names an image outside versions.env", line=line, hint=hint)
        ok = False
    return ok


def _compiles(path: Path, display: str, c: _Collector) -> bool:
    """Compile a patch script without running it: a syntax error is reported with its line."""
    text = _read_text(path, display, c)
    if text is None:
        return False
    try:
        compile(text, display, "exec", dont_inherit=True)
    except SyntaxError as exc:
        c.err(display, f"does not compile: {exc.msg}", line=exc.lineno,
              hint="fix the patch script (imagebuild compiles every patch when it reads the definition, "
              "and runs none)")
        return False
    except ValueError as exc:  # e.g. "source code string cannot contain null bytes"
        c.err(display, f"does not compile: {exc}")
        return False
    return True


def _check_dockerfile(name, parsed, df_disp, env, earlier, inputs, args_out, c, check_copies=True) -> bool:
    ok = True
    if parsed.syntax_directive:
        c.err(df_disp, "a '# syntax=' directive makes BuildKit pull a frontend image from a registry",
              line=parsed.syntax_directive, hint="remove the line; the built-in frontend is used")
        ok = False
    if not parsed.froms:
        c.err(df_disp, "no FROM instruction", hint="start the stage with: ARG PARENT / FROM ${PARENT}")
        return False
    plan_args = {ARG_PARENT, ARG_IMAGE, ARG_STAGE} | {stage_arg(s) for s in earlier}
    declared = parsed.defaults()
    global_args = {a.name for a in parsed.args if a.global_scope}
    aliases: set[str] = set()
    uses_parent = False
    for fr in parsed.froms:
        var = fr.variable
        if fr.image.lower() == "scratch" or fr.image in aliases:
            pass
        elif var is not None:
            if var not in global_args:
                c.err(df_disp, f"FROM uses ${{{var}}} but no 'ARG {var}' comes before the first FROM",
                      line=fr.line, key=var, hint=f"add 'ARG {var}' at the top of the Dockerfile")
                ok = False
            elif var == ARG_PARENT:
                uses_parent = True
            elif var.startswith(STAGE_ARG_PREFIX) and var in plan_args:
                pass
            elif env.get(var) is not None:
                ref, msg = parse_image_ref(var, env.get(var))
                if msg:
                    c.err(env.display, msg, line=env.line_of(var), key=var)
                    ok = False
            elif var not in plan_args:
                c.err(df_disp, f"FROM ${{{var}}}: {var} is neither PARENT, an earlier stage's STAGE_* "
                      "arg, nor a versions.env key", line=fr.line, key=var)
                ok = False
        elif "$" in fr.image:
            c.err(df_disp, f"FROM {fr.image!r}: use exactly ${{NAME}} for a variable image",
                  line=fr.line)
            ok = False
        else:
            c.err(df_disp, f"FROM {fr.image!r} names an image outside versions.env", line=fr.line,
                  hint="every pin lives in versions.env: build FROM ${PARENT} (the stage's 'from') or an "
                  "earlier stage's ${STAGE_<NAME>}")
            ok = False
        if fr.alias:
            aliases.add(fr.alias)
    ok &= _check_from_refs(parsed, df_disp, env, plan_args, aliases, earlier, c)
    if not uses_parent:
        c.err(df_disp, f"stage {name!r} never builds FROM ${{PARENT}}",
              line=parsed.froms[0].line, key=ARG_PARENT,
              hint="declare 'ARG PARENT' before the first FROM and write 'FROM ${PARENT}'; the plan feeds "
              "it the stage's 'from'")
        ok = False

    for argname in parsed.arg_names():
        line = next(a.line for a in parsed.args if a.name == argname)
        if argname == ARG_BUILD_ID:
            c.err(df_disp, f"ARG {argname}: a stage cannot receive the build id", line=line, key=argname,
                  hint="the build id is derived from every stage's key, so no stage can depend on it; the "
                  "release image carries it (label io.imagebuild.build-id, /opt/imagebuild/build.json)")
            ok = False
        elif env.get(argname) is not None:
            if argname in plan_args:
                c.err(env.display, f"{argname} is provided by imagebuild and cannot be set in versions.env",
                      line=env.line_of(argname), key=argname)
                ok = False
            else:
                args_out.append(ArgSource(argname, "versions.env", declared[argname]))
        elif argname in plan_args:
            args_out.append(ArgSource(argname, "plan"))
        elif argname.startswith(STAGE_ARG_PREFIX) and argname[len(STAGE_ARG_PREFIX):]:
            c.err(df_disp, f"ARG {argname}: no earlier stage is called "
                  f"{argname[len(STAGE_ARG_PREFIX):].lower().replace('_', '-')!r}", line=line, key=argname,
                  hint=f"earlier stages: {', '.join(earlier) or 'none'}")
            ok = False
        elif argname in BUILDKIT_ARGS:
            args_out.append(ArgSource(argname, "buildkit"))
        elif declared[argname] is not None:
            args_out.append(ArgSource(argname, "default", declared[argname]))
        else:
            close = difflib.get_close_matches(argname, list(env.entries), n=1)
            c.err(df_disp, f"ARG {argname} has no value: not in versions.env and no default", line=line,
                  key=argname,
                  hint=(f"did you mean {close[0]!r} in versions.env?" if close else
                        f"add {argname}=<value> to versions.env, or give a default: ARG {argname}=<value>"))
            ok = False

    for cp in parsed.copies if check_copies else ():
        if cp.from_stage:
            continue
        for src in cp.sources:
            if re.match(r"[a-z]+://", src):
                c.err(df_disp, f"{cp.keyword} from a URL ({src}) needs the network during the build",
                      line=cp.line, hint="download it with prefetch and declare it under 'files'")
                ok = False
                continue
            if not _covered(src, inputs):
                c.err(df_disp, f"{cp.keyword} {src!r}: not declared in the stage's files or patches",
                      line=cp.line, key=src,
                      hint="the build context holds only declared inputs (they are part of the cache key); "
                      "add it to 'files:' in image.yaml")
                ok = False
    return ok


def _covered(src: str, inputs: list[InputFile]) -> bool:
    s = src.lstrip("./").rstrip("/")
    if s in ("", "."):
        return bool(inputs)
    for i in inputs:
        cp = i.context_path
        if s == cp or s.startswith(cp + "/") or fnmatch.fnmatch(cp, s) or cp.startswith(s + "/"):
            return True
    return False
