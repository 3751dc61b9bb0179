"""Definition -> ordered stages with build args, inputs and content-addressed cache keys.

No side effects: planning reads files and never writes, builds or pulls anything. Whether a
stage image already exists is asked through an injected callable (the CLI passes the engine's
read-only lookup), so the plan works without a Docker engine.

A stage's key is the SHA-256 of a canonical JSON document holding exactly what the build hands
to the stage: the parent's key (or the base image reference), the target platform, the
Dockerfile's bytes, the values of the build args the Dockerfile declares (an earlier stage it
uses enters by its key), the digests of the context files and patches (and the patch primitive
for patching stages), every source tarball mounted into it (the stage's own sources and,
recursively, their FetchContent dependencies) by its locked sha256, the wheels and debs it
installs, the network flag, and the stage's SOURCE_DATE_EPOCH. Changing any of them changes
the key of that stage and of every stage built on it, and nothing else does
(tests/unit/plan/test_key_property.py). The parallelism knobs (MAX_JOBS, NVCC_THREADS,
CMAKE_BUILD_PARALLEL_LEVEL) are deliberately not in it: they are set per host and must not
change the output.

The build id names one build's inputs: the lock, every stage key, and the release's provenance
(definition digest and git revision); two different images never share it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from imagebuild.core import lock as lock_mod
from imagebuild.core.errors import UsageError
from imagebuild.core.fsutil import canonical_json, sha256_bytes, sha256_tree
from imagebuild.core.secrets import without_userinfo
from imagebuild.definition import reader as d
from imagebuild.plan import context_stream, package_inputs, provenance, source_mounts


def _without_userinfo(value: str) -> str:
    """``value`` without any URL userinfo (core/secrets.without_userinfo)."""
    return without_userinfo(value, ssh_user=False)


PLAN_SCHEMA = "imagebuild.plan"
PLAN_VERSION = 2
KEY_VERSION = 5  # 5: ARG SOURCE_DATE_EPOCH in every stage, records of when a tool ran left out (buildstep/reproducible.py); 4: the context is hashed as the stream BuildKit gets (context_stream.py); 3: layerclamp
BUILD_ID_VERSION = 2
DEFAULT_SOURCE_DATE_EPOCH = 315532800  # 1980-01-01T00:00:00Z: zip (wheels) cannot hold older times
PARENT_CONTEXT = "imagebuild-parent"  # the named build context holding a stage's parent stage

STAGE_TAG_KEY_LEN = 16


@dataclass(frozen=True)
class PlannedArg:
    name: str
    value: str
    origin: str  # versions.env | plan | buildkit | default | --set (a one-run override: build --set)


@dataclass(frozen=True)
class PlannedInput:
    path: str  # relative to the project root
    context_path: str
    sha256: str
    kind: str


@dataclass(frozen=True)
class MountedSource:
    """A source tarball handed to a stage (its own source or a FetchContent dependency of one)."""

    name: str
    tarball: str | None  # project-relative path from the lock (None: not prefetched)
    sha256: str | None  # locked sha256 of the tarball (None: not prefetched)
    dependency_of: str | None
    source_date_epoch: int | None
    stale: str | None = None  # why the lock does not match versions.env (None: it does)

    def key_value(self, defn: d.Definition) -> dict:
        if self.sha256:
            return {"sha256": self.sha256}
        src = defn.sources.get(self.name)
        return {"unlocked": src.pins() if src else None}

    def as_dict(self) -> dict:
        return {"name": self.name, "tarball": self.tarball, "sha256": self.sha256,
                "dependency_of": self.dependency_of, "source_date_epoch": self.source_date_epoch,
                "stale": self.stale}


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
    packages: dict = field(default_factory=dict)  # wheels/apt inputs in the key (package_inputs.py)
    mounts: tuple[MountedSource, ...] = ()  # every source tarball the stage gets
    source_date_epoch: int = DEFAULT_SOURCE_DATE_EPOCH
    stage_contexts: dict = field(default_factory=dict)  # named context -> earlier stage it holds
    src_mounts: dict | None = None  # what imagebuild-src gives it (source_mounts.py); None: no sources
    patch_check: tuple[dict, ...] = ()  # each patch checked by prefetch on the composed tree (the lock's)
    context_digest: str = ""  # sha256 of the context stream (context_stream.py): what the build sends

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
            "mounted_sources": [m.as_dict() for m in self.mounts],
            "source_date_epoch": self.source_date_epoch,
            "uses_stages": list(self.uses_stages),
            "network": self.network,
            "key": self.key,
            "image": self.image,
            "exists": self.exists,
            "packages": self.packages,
            "mounts": self.src_mounts,
            "patch_check": list(self.patch_check),
            "context_sha256": self.context_digest,
        }


def primitive_path():
    """The patch primitive's file (imagebuild/definition/patching.py), found without importing it."""
    from pathlib import Path

    return Path(__file__).parents[1] / "definition" / "patching.py"


def context_inputs(root, inputs) -> list:
    """(path on disk, context path, display) of a stage's planned inputs: what context_stream reads,
    in the plan and in the build alike."""
    return [(primitive_path() if i.kind == "primitive" else root / i.path, i.context_path, i.path) for i in inputs]


def _patch_check(lock: dict | None, st) -> tuple[dict, ...]:
    """What prefetch found for each of the stage's patches on the composed tree of its first source, or
    for a stage without sources on the trees of the stages it uses (the lock's
    ``sources.<NAME>.patch_check``): outcome and reason, ``stale`` when the patch file
    changed since, ``not-checked`` when the lock has no entry for it. Reads files' bytes only."""
    from imagebuild.core.fsutil import sha256_file

    patches = [i for i in st.inputs if i.kind == "patch"]
    if not patches:
        return ()
    locked = (lock or {}).get("sources") or {}
    # a stage without sources (glm53's runner, patching the installed vllm) was checked on the trees of
    # the stages it uses: its entries are under those sources
    names = [st.sources[0]] if st.sources else list(locked) if isinstance(locked, dict) else []
    by_name = {}
    for name in names:
        src = locked.get(name)
        per = (src.get("patch_check") or {}).get(st.name) if isinstance(src, dict) else None
        for e in per or []:
            if isinstance(e, dict):
                by_name.setdefault(e.get("patch"), e)
    if not st.sources and not by_name:
        return ()
    out = []
    for i in patches:
        e = by_name.get(i.path.name)
        if e is None:
            out.append({"patch": i.path.name, "outcome": "not-checked", "message": "no prefetch check in the lock",
                        "stale": False})
            continue
        stale = e.get("sha256") != "sha256:" + sha256_file(i.path)
        out.append({"patch": i.path.name, "outcome": str(e.get("outcome")), "message": str(e.get("message") or ""),
                    "stale": stale})
    return tuple(out)


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
    lock_sha256: str | None = None
    provenance: provenance.Provenance | None = None

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
            "lock_sha256": self.lock_sha256,
            "provenance": self.provenance.as_dict() if self.provenance else None,
            "stages": [s.as_dict() for s in self.stages],
        }


PRIMITIVE_CONTEXT = "patches/imagebuild_patching.py"
PRIMITIVE_DISPLAY = "<imagebuild>/patching.py"


def _primitive_sha256() -> str:
    return sha256_tree(primitive_path())


def stage_image(image: str, stage: str, key: str) -> str:
    """The name of a stage image (in the stage store's OCI layout): the stage and its key."""
    return f"imagebuild/{image}:{stage}-{key.removeprefix('sha256:')[:STAGE_TAG_KEY_LEN]}"


def stage_context(stage: str) -> str:
    """The named build context through which a later stage reads the stage ``stage``."""
    return f"imagebuild-stage-{stage}"


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


def mounted_sources(defn: d.Definition, lock: dict | None, stage: d.Stage) -> list[MountedSource]:
    """The stage's own sources plus, recursively, the FetchContent dependencies recorded for them
    (in the definition's ``sources:`` options and in the lock), each with its locked tarball."""
    locked = (lock or {}).get("sources") or {}
    deps: dict[str, set[str]] = {}
    for name, opt in defn.source_options.items():
        if opt.dependency_of:
            deps.setdefault(opt.dependency_of, set()).add(name)
    for name, entry in locked.items():
        if isinstance(entry, dict) and entry.get("dependency_of"):
            deps.setdefault(entry["dependency_of"], set()).add(name)
    order: list[str] = []
    todo = list(stage.sources)
    while todo:
        n = todo.pop(0)
        if n in order:
            continue
        order.append(n)
        todo += sorted(deps.get(n, ()))
    out = []
    for n in order:
        entry = locked.get(n) if isinstance(locked.get(n), dict) else None
        src = defn.sources.get(n)
        stale = None
        if entry is None:
            stale = "not in the lock (imagebuild prefetch packs it)"
        elif src is not None:
            want = src.pins()
            have = pr_pins(entry.get("prs"))
            # the lock records a URL without its userinfo (prefetch): versions.env's is compared the same way
            repo_had = without_userinfo(str(entry.get("repo") or ""), ssh_user=False)
            repo_want = without_userinfo(str(want["repo"] or ""), ssh_user=False)
            if repo_had != repo_want or entry.get("ref") != want["ref"] or have != want["prs"]:
                stale = (f"the lock has {entry.get('ref')!r} {have} from {repo_had!r}, "
                         f"versions.env says {want['ref']!r} {want['prs']} from {repo_want!r}")
            elif src.tree and entry.get("source_tree") != src.tree:
                stale = (f"the lock's composed tree is {entry.get('source_tree')!r}, versions.env pins "
                         f"{n}_TREE={src.tree} (imagebuild prefetch composes and checks it)")
        sde = entry.get("source_date_epoch") if entry else None
        out.append(MountedSource(
            n, entry.get("tarball") if entry else None, entry.get("sha256") if entry else None,
            (entry or {}).get("dependency_of") or (defn.source_options[n].dependency_of
                                                   if n in defn.source_options else None),
            sde if isinstance(sde, int) else None, stale))
        cg = entry.get("cargo") if entry else None
        if isinstance(cg, dict):  # its vendored Rust crates (source_mounts.CARGO_SUFFIX), checked like it
            out.append(MountedSource(n + source_mounts.CARGO_SUFFIX, cg.get("tarball"), cg.get("sha256"), n, None,
                                     stale))
            td = cg.get("toolchain_dist")
            for a in (td.get("archives") or ()) if isinstance(td, dict) else ():  # its pinned Rust toolchain
                if isinstance(a, dict):
                    out.append(MountedSource(f"{n}{source_mounts.RUST_SUFFIX}{a.get('component')}", a.get("tarball"),
                                             a.get("sha256"), n, None, stale))
    return out


def pr_pins(prs) -> list[str]:
    """The lock's PR list (``[{"number", "sha"}]``) in versions.env's ``N@sha`` form."""
    out = []
    for p in prs or []:
        if isinstance(p, dict):
            out.append(f"{p.get('number')}@{p.get('sha')}" if p.get("sha") else str(p.get("number")))
        else:
            out.append(str(p))
    return out


ORIGIN_SET = "--set"


def check_overrides(defn: d.Definition, overrides: dict[str, str]) -> None:
    """``build --set KEY=VALUE``: each KEY must be a build arg a stage of ``defn`` declares (an ARG that
    takes its value from versions.env or its default); not PARENT, IMAGE, STAGE or a STAGE_<NAME>
    (the plan's), nor BuildKit's own. Else exit 2, naming the args that can be set."""
    settable = sorted({a.name for st in defn.stages for a in st.args if a.origin in ("versions.env", "default")})
    for key in overrides:
        if key not in settable:
            close = d.difflib.get_close_matches(key, settable, n=1)
            raise UsageError(f"--set {key}=...: no stage of {defn.name} declares a build arg {key} it takes from "
                             "versions.env or a default", hint=(f"did you mean {close[0]}? " if close else "")
                             + f"args that can be set: {', '.join(settable) or 'none'}")


def build_id_of(defn: d.Definition, stage_keys: list[str], lock_sha256: str | None,
                prov: provenance.Provenance) -> str:
    """The build id: a digest of everything that makes the release image (module doc)."""
    doc = {"imagebuild-build-id": BUILD_ID_VERSION, "image": defn.name, "platform": defn.platform,
           "description": defn.description, "stages": stage_keys, "lock": lock_sha256,
           "definition": prov.definition_sha256, "revision": prov.revision, "source": prov.source_url}
    return sha256_bytes(canonical_json(doc))[:16]


def make_plan(defn: d.Definition, exists: Callable[[str], bool | None] | None = None,
              engine: dict | None = None, lock: dict | None = None,
              prov: provenance.Provenance | provenance.Pending | None = None,
              overrides: dict[str, str] | None = None) -> Plan:
    """The plan of ``defn``. ``exists(key)`` says whether a stage with that key is built (None:
    unknown); ``lock`` defaults to the definition's lock.json; ``prov`` to its git provenance (or
    the one a caller started asking for: provenance.start). ``overrides``: ``build --set`` values of
    build args (``check_overrides``), for this run only: each replaces the value its ARG gets from
    versions.env or its default, in the stage's args and its key (so a different key and build id)."""
    overrides = overrides or {}
    # git answers while the keys are computed
    pending = provenance.start(defn) if prov is None else prov if isinstance(prov, provenance.Pending) else None
    lock_path = lock_mod.lock_path(defn.dir)
    if lock is None:
        lock = lock_mod.read(defn.dir, d.display_path(defn.root, lock_path))
    lock_sha = sha256_bytes(lock_path.read_bytes()) if lock is not None and lock_path.is_file() else None
    pkg_locked = {"wheels": (lock or {}).get("wheels") or {}, "apt": (lock or {}).get("apt") or {}}
    planned: dict[str, PlannedStage] = {}
    out: list[PlannedStage] = []
    for st in defn.stages:
        if st.parent.kind == "stage":
            parent_stage = planned[st.parent.name]
            parent_ref, parent_identity = PARENT_CONTEXT, parent_stage.key
            parent_epoch = parent_stage.source_date_epoch
        else:
            parent_ref = defn.images[st.parent.name].value
            parent_identity = parent_ref
            parent_epoch = DEFAULT_SOURCE_DATE_EPOCH

        args: list[PlannedArg] = []
        key_args: dict[str, str] = {}
        stage_contexts: dict[str, str] = {}
        for a in st.args:
            if a.name in overrides and a.origin in ("versions.env", "default"):
                value = key_value = overrides[a.name]
                args.append(PlannedArg(a.name, value, ORIGIN_SET))
                key_args[a.name] = key_value
                continue
            if a.origin == "versions.env":
                # a credential in a URL (https://user:TOKEN@host/...) is for prefetch's git only: a stage
                # (offline) has no use for it, and a build arg lands in the plan, the record and the
                # image's history (issue 22, security 3); the lock records the URL the same way
                value = _without_userinfo(defn.env.get(a.name) or "")
                key_value = value
            elif a.origin == "default":
                value = key_value = a.default or ""
            elif a.origin == "buildkit":
                value = key_value = _buildkit_value(a.name, defn.platform)
            elif a.name == d.ARG_PARENT:
                value, key_value = parent_ref, parent_identity
            elif a.name == d.ARG_IMAGE:
                value = key_value = defn.name
            elif a.name == d.ARG_STAGE:
                value = key_value = st.name
            else:  # STAGE_<NAME>
                dep = next(p for p in planned.values() if d.stage_arg(p.name) == a.name)
                value, key_value = stage_context(dep.name), dep.key
                stage_contexts[value] = dep.name
            args.append(PlannedArg(a.name, value, a.origin))
            key_args[a.name] = key_value

        # the context's entries first: a FIFO or device among the inputs is refused by name before
        # anything reads it (a read would hang)
        context_stream.entries([(i.path, i.context_path, d.display_path(defn.root, i.path)) for i in st.inputs])
        inputs = tuple(PlannedInput(d.display_path(defn.root, i.path), i.context_path,
                                    sha256_tree(i.path), i.kind) for i in st.inputs)
        if any(i.kind == "patch" for i in st.inputs):
            # the patch primitive is shipped into the context of every patching stage
            inputs += (PlannedInput(PRIMITIVE_DISPLAY, PRIMITIVE_CONTEXT, _primitive_sha256(), "primitive"),)
        mounts = tuple(mounted_sources(defn, lock, st))
        sm = source_mounts.source_mounts(lock, st.name, st.sources) if st.sources else None
        src_mounts = sm.as_dict() if sm is not None else None
        epoch = max([parent_epoch, *(m.source_date_epoch for m in mounts if m.source_date_epoch)],
                    default=DEFAULT_SOURCE_DATE_EPOCH)
        # the context exactly as the build sends it (its mtimes are the stage's epoch)
        context = context_stream.digest(context_inputs(defn.root, inputs), epoch)
        df_sha = sha256_bytes(st.dockerfile_bytes)
        key_doc = {
            "imagebuild-stage-key": KEY_VERSION,
            "platform": defn.platform,
            "parent": parent_identity,
            "dockerfile": df_sha,
            "args": key_args,
            "context": context,  # the stream's bytes: names, types, modes, link targets, contents
            "sources": {m.name: m.key_value(defn) for m in mounts},
            "network": st.network,
            "source_date_epoch": epoch,
        }
        if sm is not None:  # the generated unpack script and manifest in imagebuild-src
            key_doc["generated"] = sm.key_inputs()["generated"]
        pkgs = package_inputs.stage_key_inputs(defn, st, pkg_locked)
        if pkgs:  # wheels / apt packages it installs (absent: keys of other stages unchanged)
            key_doc["packages"] = pkgs
        key = "sha256:" + sha256_bytes(canonical_json(key_doc))
        uses = tuple(p.name for p in planned.values() if d.stage_arg(p.name) in key_args)
        ps = PlannedStage(
            name=st.name, dockerfile=st.dockerfile_display, dockerfile_sha256=df_sha,
            parent_kind=st.parent.kind, parent=st.parent.name, parent_ref=parent_ref,
            args=tuple(args), inputs=inputs, sources=tuple(st.sources), uses_stages=uses,
            network=st.network, key=key, image=stage_image(defn.name, st.name, key), packages=pkgs,
            mounts=mounts, source_date_epoch=epoch, stage_contexts=stage_contexts, src_mounts=src_mounts,
            patch_check=_patch_check(lock, st), context_digest=context)
        if exists is not None:
            ps = _with_exists(ps, exists(ps.key))
        planned[st.name] = ps
        out.append(ps)
    prov = pending.result() if pending is not None else prov
    build_id = build_id_of(defn, [s.key for s in out], lock_sha, prov)
    return Plan(image=defn.name, platform=defn.platform, definition_dir=d.display_path(defn.root, defn.dir),
                build_id=build_id, build_id_from=_build_id_from(lock_sha), stages=tuple(out),
                unpinned=defn.notices, engine=engine, lock_sha256=lock_sha, provenance=prov)


def _build_id_from(lock_sha: str | None) -> str:
    return ("the lock, every stage key and the release's provenance" if lock_sha else
            "every stage key and the release's provenance (no lock yet: imagebuild prefetch writes one)")


def _with_exists(ps: PlannedStage, value: bool | None) -> PlannedStage:
    from dataclasses import replace

    return replace(ps, exists=value)
