"""The model of an image definition: its frozen records, names and rules, and the small helpers
every part of reading one shares (a problem collector, safe relative paths, unknown-key checks).

Reading is split along the definition's parts, each in its own module:

    definition.py             load(): the folder -> a Definition (image.yaml's top level, files)
    definition_model.py       this: the records and shared helpers
    definition_pins.py        versions.env's git sources (NAME_REPO/_REF/_PRS) and image references
    definition_stages.py      image.yaml's stages (parent, Dockerfile, files, patches, sources, packages)
    definition_dockerfile.py  the rules a stage's Dockerfile must follow (FROM, ARG, COPY, compile of patches)
    source_options.py         image.yaml's ``sources:`` (how prefetch treats each git source)

Everyone else imports the names from ``imagebuild.definition``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from imagebuild.core import lazy, yamlread
from imagebuild.core.errors import DefinitionError, Problem, UsageError, excerpt
from imagebuild.definition import dockerfile as dockerfile_mod
from imagebuild.definition import envfile, pkgspec, textfile
from imagebuild.definition.source_options import SourceOptions

difflib = lazy.module("difflib")  # error hints only

IMAGES_DIR = "docker-images"
SHARED_PATCHES_DIR = "patches-eugr"
VERSIONS_FILE = "versions.env"
IMAGE_FILE = "image.yaml"
DEFAULT_GATE_FILE = "gate.yaml"

NAME_MAX = 100  # a folder name, a docker repository name with room for a registry prefix
NAME_RE = lazy.compile(r"(?=.{1,100}\Z)[a-z0-9]+(?:[._-][a-z0-9]+)*\Z")  # NAME_MAX characters
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
# ... exactly these (plan/source_mounts.CONTEXT, fetch/packages.WHEELS_CONTEXT and APT_CONTEXT,
# plan/planner.PARENT_CONTEXT; tests/unit/definition/test_dockerfile.py keeps them equal), and an
# earlier stage's imagebuild-stage-<name> (plan/planner.stage_context). A name that merely starts
# with imagebuild- is no context of ours: an image of that name would be pulled into the build.
NAMED_CONTEXTS = frozenset({"imagebuild-src", "imagebuild-wheels", "imagebuild-apt", "imagebuild-parent",
                            "imagebuild-ccache"})  # the compiler cache (buildstep/compilecache.py)
STAGE_CONTEXT_PREFIX = "imagebuild-stage-"
# Filled in by BuildKit itself from the platform (which is part of every key).
BUILDKIT_ARGS = frozenset(
    f"{p}{s}" for p in ("TARGET", "BUILD") for s in ("PLATFORM", "OS", "ARCH", "VARIANT")
)

STAGE_KEYS = ("name", "dockerfile", "from", "files", "patches", "sources", "network", "description",
              "requirements", "apt")
TOP_KEYS = ("description", "platform", "stages", "gate", "sources", "python", "apt_snapshot", "build_metadata",
            "verified_bases")


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
    # NAME_TREE: the git tree the composition (ref + PRs merged in order) must produce; prefetch refuses
    # another (a tree depends on the files alone, not on who merged them or when)
    tree: str | None = None

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
    build_metadata: str | None = None  # where the release writes eugr's build-metadata.yaml (absolute)
    verified_bases: tuple[str, ...] = ()  # versions.env keys of bases pinned only from the engine's image

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
    if not isinstance(name, str) or not NAME_RE.match(name):
        raise DefinitionError([Problem(
            "<command line>", f"invalid image name {excerpt(name)}: expected a plain identifier "
            f"(lower-case letters, digits, '.', '_', '-'; at most {NAME_MAX} characters; no slashes, no '..')",
            key="IMAGE",
            hint="image names are folder names under docker-images/, e.g. glm53-jovian-r12")])


def list_images(root: Path) -> list[str]:
    base = root / IMAGES_DIR
    return sorted(p.name for p in base.iterdir() if p.is_dir() and NAME_RE.match(p.name)
                  and (p / IMAGE_FILE).exists())


def misnamed_images(root: Path) -> list[str]:
    """Folders under docker-images/ that hold an image.yaml but whose name is no image name (upper
    case, unicode, a newline, too long): list and validate show them INVALID, never skip them."""
    base = root / IMAGES_DIR
    return sorted(p.name for p in base.iterdir() if p.is_dir() and not NAME_RE.match(p.name)
                  and (p / IMAGE_FILE).exists()) if base.is_dir() else []


class Collector:
    def __init__(self) -> None:
        self.problems: list[Problem] = []
        self.notices: list[Notice] = []
        self._resolved: dict[Path, Path] = {}

    def resolved(self, folder: Path) -> Path:
        """``folder.resolve()``, once per folder while one definition is read (every declared path
        is checked against its folder: each resolve is an lstat per path component)."""
        real = self._resolved.get(folder)
        if real is None:
            real = self._resolved[folder] = folder.resolve()
        return real

    def err(self, file: str, message: str, *, line: int | None = None, key: str | None = None,
            hint: str | None = None) -> None:
        self.problems.append(Problem(file, message, line=line, key=key, hint=hint))

    def note(self, file: str, message: str, *, line: int | None = None, key: str | None = None) -> None:
        self.notices.append(Notice(file, line, key, message))


def safe_rel_path(value, base: Path, file: str, line: int, key: str, c: Collector) -> Path | None:
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
    except RuntimeError:  # a symlink loop (Python before 3.13; 3.13 resolves it as far as it goes)
        c.err(file, f"path {value!r} is a symlink loop (its links never reach a file)", line=line, key=key)
        return None
    except OSError:
        real = full
    if c.resolved(base) not in (real, *real.parents):
        c.err(file, f"path {value!r} leads outside its folder (through a symlink)", line=line, key=key)
        return None
    return full


def unknown_keys(node: yamlread.Node, allowed: tuple[str, ...], file: str, where: str, c: Collector) -> None:
    for key, line in (node.key_lines or {}).items():
        if key not in allowed:
            close = difflib.get_close_matches(key, allowed, n=1)
            c.err(file, f"unknown key {excerpt(key)} in {where}", line=line, key=key,
                  hint=f"did you mean {close[0]!r}?" if close else f"allowed: {', '.join(allowed)}")


# no definition text is read past this (a YAML file has its own 1 MiB limit, yamlread.MAX_BYTES); it
# leaves room for versions.env's own limit on build args (1 MiB in all), which then names the keys
DEFINITION_MAX_BYTES = textfile.MAX_BYTES


def read_text(path: Path, display: str, c: Collector) -> str | None:
    """The file as UTF-8 text, or None with the problem (the line and column of a bad byte) collected."""
    if path.exists() and not path.is_file():  # a FIFO would hang the read; a folder is no file
        c.err(display, f"is {'a folder' if path.is_dir() else 'not a regular file'}, expected a file")
        return None
    try:
        size = path.stat().st_size
        if size > DEFINITION_MAX_BYTES:  # refused before it is read (a 200 MB versions.env took 429 MB)
            c.err(display, f"is {size} bytes: larger than {DEFINITION_MAX_BYTES} bytes (8 MiB), the limit for "
                  "a definition file")
            return None
        return textfile.decode(path.read_bytes())
    except textfile.TextError as exc:
        c.err(display, exc.message, line=exc.line)
    except OSError as exc:
        c.err(display, f"cannot read: {exc.strerror}", hint="check the file's permissions")
    return None
