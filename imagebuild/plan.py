"""Definition -> ordered stages with build args, inputs and content-addressed cache keys.

No side effects: planning reads files and never writes, builds or pulls anything. Whether a
stage image already exists is asked through an injected callable (the CLI passes the engine's
read-only lookup), so the plan works without a Docker engine.

A stage's key is the SHA-256 of a canonical JSON document holding everything that can change
the stage's output: the parent's key (or the base image reference), the target platform, the
Dockerfile's bytes, the values of the build args the Dockerfile declares, the digests of the
context files and patches it consumes, and the pins of the git sources mounted into it.
Changing any of them changes the key of that stage and of every stage built on it.
"""

from __future__ import annotations

from collections.abc import Callable

from . import definition as d
from . import packages as packages_mod
from .fsutil import canonical_json, sha256_bytes, sha256_tree
from .lock import LOCK_FILE  # the lock's hash is the build id
from .records import dataclass, field

PLAN_SCHEMA = "imagebuild.plan"
PLAN_VERSION = 1
KEY_VERSION = 1

STAGE_TAG_KEY_LEN = 16


@dataclass(frozen=True)
class PlannedArg:
    name: str
    value: str
    origin: str  # versions.env | plan | buildkit | default


@dataclass(frozen=True)
class PlannedInput:
    path: str  # relative to the project root
    context_path: str
    sha256: str
    kind: str


@dataclass(frozen=True)
class PlannedStage:
    name: str
    dockerfile: str
    dockerfile_sha256: str
    parent_kind: str
    parent: str
    parent_ref: str
    args: tuple[PlannedArg, ...]
    inputs: tuple[PlannedInput, ...]
    sources: tuple[str, ...]
    uses_stages: tuple[str, ...]
    network: bool
    key: str
    image: str
    exists: bool | None = None
    packages: dict = field(default_factory=dict)  # wheels/apt inputs in the key (packages.py)

    def build_args(self) -> dict[str, str]:
        """The --build-arg values to pass (BuildKit fills its own platform args)."""
        return {a.name: a.value for a in self.args if a.origin != "buildkit"}

    def as_dict(self) -> dict:
        return {
            "name": self.name,
            "dockerfile": self.dockerfile,
            "dockerfile_sha256": self.dockerfile_sha256,
            "parent": {"kind": self.parent_kind, "name": self.parent, "ref": self.parent_ref},
            "args": [{"name": a.name, "value": a.value, "origin": a.origin} for a in self.args],
            "inputs": [{"path": i.path, "context": i.context_path, "sha256": i.sha256, "kind": i.kind}
                       for i in self.inputs],
            "sources": list(self.sources),
            "uses_stages": list(self.uses_stages),
            "network": self.network,
            "key": self.key,
            "image": self.image,
            "exists": self.exists,
            "packages": self.packages,
        }


@dataclass(frozen=True)
class Plan:
    image: str
    platform: str
    definition_dir: str
    build_id: str
    build_id_from: str
    stages: tuple[PlannedStage, ...]
    unpinned: tuple[d.Notice, ...] = field(default=())
    engine: dict | None = None

    def stage(self, name: str) -> PlannedStage:
        for s in self.stages:
            if s.name == name:
                return s
        raise KeyError(name)

    def as_dict(self) -> dict:
        return {
            "schema": PLAN_SCHEMA,
            "version": PLAN_VERSION,
            "image": self.image,
            "platform": self.platform,
            "definition": self.definition_dir,
            "build_id": self.build_id,
            "build_id_from": self.build_id_from,
            "unpinned": [{"file": n.file, "line": n.line, "key": n.key, "message": n.message}
                         for n in self.unpinned],
            "engine": self.engine,
            "stages": [s.as_dict() for s in self.stages],
        }


PRIMITIVE_CONTEXT = "patches/imagebuild_patching.py"
PRIMITIVE_DISPLAY = "<imagebuild>/patching.py"


def _primitive_sha256() -> str:
    from pathlib import Path

    # the file imagebuild/patching.py, found without importing it (start-up time)
    return sha256_tree(Path(__file__).with_name("patching.py"))


def stage_image(image: str, stage: str, key: str) -> str:
    """The tag of a stage image: one repository per image, the stage and its key in the tag."""
    return f"imagebuild/{image}:{stage}-{key.removeprefix('sha256:')[:STAGE_TAG_KEY_LEN]}"


def _buildkit_value(name: str, target: str) -> str:
    plat = target if name.startswith("TARGET") else _host_platform()
    os_, _, rest = plat.partition("/")
    arch, _, variant = rest.partition("/")
    return {"PLATFORM": plat, "OS": os_, "ARCH": arch, "VARIANT": variant}[name.removeprefix("TARGET")
                                                                          .removeprefix("BUILD")]


def _host_platform() -> str:
    import platform as _platform  # here: importing it costs every plan ~2 ms (docs/cli.md, "Start-up time")

    m = _platform.machine().lower()
    arch = {"x86_64": "amd64", "amd64": "amd64", "aarch64": "arm64", "arm64": "arm64"}.get(m, m)
    return f"linux/{arch}"


def build_id_of(defn: d.Definition) -> tuple[str, str]:
    """(build id, what it was derived from). The lock's hash once prefetch wrote one."""
    lock = defn.dir / LOCK_FILE
    if lock.is_file():
        return sha256_bytes(lock.read_bytes())[:16], d.display_path(defn.root, lock)
    return "unlocked-" + sha256_bytes(defn.env.path.read_bytes())[:16], defn.env.display


def make_plan(defn: d.Definition, exists: Callable[[str], bool | None] | None = None,
              engine: dict | None = None) -> Plan:
    build_id, build_id_from = build_id_of(defn)
    pkg_locked = packages_mod.lock_for_plan(defn)
    planned: dict[str, PlannedStage] = {}
    out: list[PlannedStage] = []
    for st in defn.stages:
        if st.parent.kind == "stage":
            parent_stage = planned[st.parent.name]
            parent_ref, parent_identity = parent_stage.image, parent_stage.key
        else:
            parent_ref = defn.images[st.parent.name].value
            parent_identity = parent_ref

        args: list[PlannedArg] = []
        key_args: dict[str, str] = {}
        for a in st.args:
            if a.origin == "versions.env":
                value = defn.env.get(a.name) or ""
                key_value = value
            elif a.origin == "default":
                value = key_value = a.default or ""
            elif a.origin == "buildkit":
                value = key_value = _buildkit_value(a.name, defn.platform)
            elif a.name == d.ARG_PARENT:
                value, key_value = parent_ref, parent_identity
            elif a.name == d.ARG_BUILD_ID:
                value = key_value = build_id
            elif a.name == d.ARG_IMAGE:
                value = key_value = defn.name
            elif a.name == d.ARG_STAGE:
                value = key_value = st.name
            else:  # STAGE_<NAME>
                dep = next(p for p in planned.values() if d.stage_arg(p.name) == a.name)
                value, key_value = dep.image, dep.key
            args.append(PlannedArg(a.name, value, a.origin))
            key_args[a.name] = key_value

        inputs = tuple(PlannedInput(d.display_path(defn.root, i.path), i.context_path,
                                    sha256_tree(i.path), i.kind) for i in st.inputs)
        if any(i.kind == "patch" for i in st.inputs):
            # the patch primitive is shipped into the context of every patching stage
            inputs += (PlannedInput(PRIMITIVE_DISPLAY, PRIMITIVE_CONTEXT, _primitive_sha256(), "primitive"),)
        sources = {name: defn.sources[name].pins() for name in st.sources}
        df_sha = sha256_bytes(st.dockerfile_bytes)
        key_doc = {
            "imagebuild-stage-key": KEY_VERSION,
            "platform": defn.platform,
            "parent": parent_identity,
            "dockerfile": df_sha,
            "args": key_args,
            "inputs": {i.context_path: i.sha256 for i in inputs},
            "sources": sources,
            "network": st.network,
        }
        pkgs = packages_mod.stage_key_inputs(defn, st, pkg_locked)
        if pkgs:  # wheels / apt packages it installs (absent: keys of other stages unchanged)
            key_doc["packages"] = pkgs
        key = "sha256:" + sha256_bytes(canonical_json(key_doc))
        uses = tuple(p.name for p in planned.values() if d.stage_arg(p.name) in key_args)
        ps = PlannedStage(
            name=st.name, dockerfile=st.dockerfile_display, dockerfile_sha256=df_sha,
            parent_kind=st.parent.kind, parent=st.parent.name, parent_ref=parent_ref,
            args=tuple(args), inputs=inputs, sources=tuple(st.sources), uses_stages=uses,
            network=st.network, key=key, image=stage_image(defn.name, st.name, key), packages=pkgs)
        if exists is not None:
            ps = _with_exists(ps, exists(ps.image))
        planned[st.name] = ps
        out.append(ps)
    return Plan(image=defn.name, platform=defn.platform, definition_dir=d.display_path(defn.root, defn.dir),
                build_id=build_id, build_id_from=build_id_from, stages=tuple(out),
                unpinned=defn.notices, engine=engine)


def _with_exists(ps: PlannedStage, value: bool | None) -> PlannedStage:
    from .records import replace

    return replace(ps, exists=value)
