"""plan -> staged BuildKit builds, offline, reproducible, cached by key, with safe promotion.

``build(ctx, image, options)`` runs one image's plan (docs/build.md); ``ctx`` is the command's
``context.Context`` (project root, state folder, engine, output):

1. **Checks before anything runs**: definition + plan, the ``--from``/``--until`` range, every
   prefetched input the stages to build need (sha256 against the lock, lock against
   versions.env), then the guards (platform, one build of the image per engine, serving
   containers, disk; ``guards.py``). A refusal here means docker never started.
2. **Stages in order.** A stage whose key is in the stage store (``stagestore.py``: an OCI
   layout per image, a ref per key) is skipped; ``--no-cache`` rebuilds the requested range.
   Every stage is exported into that layout, its own layers' file times are clamped to its
   ``SOURCE_DATE_EPOCH`` (``layerclamp.py``: the same key gives the same bytes), and the next
   stage builds ``FROM`` it through the named context
   ``imagebuild-parent``; earlier stages a Dockerfile names (``${STAGE_<NAME>}``) arrive the same
   way. ``--network none`` unless the stage declares ``network: true``; the build context holds
   exactly the stage's declared inputs; prefetched inputs come as named contexts
   (``imagebuild-src``, ``imagebuild-wheels``, ``imagebuild-apt``), bind-mounted, never copied.
3. **Release image**: the final stage plus provenance (labels, ``/opt/imagebuild/lock.json`` and
   ``build.json``), loaded into the engine as ``imagebuild/<image>:release-<build id>`` and tagged
   ``<image>:b-<build id>`` and ``<image>:candidate`` (promote.py).
4. **Gate and promotion**: unless a passing receipt exists for this identity and the
   definition's current gate spec, the candidate is gated; ``:local`` moves only on such a
   receipt, and never when it already holds that identity (``:previous`` stays).

Each run has its own folder, ``<state>/builds/<image>/<run id>/`` (record.json, logs/), listed
by ``imagebuild log``. Every child process runs through ``run.py``: Ctrl-C, SIGTERM and SIGHUP
stop the running ``docker buildx build`` and remove the run's temporary files.
"""

from __future__ import annotations

import datetime as _dt
import json
import logging
import os
import secrets
import shutil
import tarfile
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from imagebuild.buildstep import (
    compilecache,
    compilecache_share,
    guards,
    layerclamp,
    owners,
    registry_cache,
    reprodiff,
    reproducible,
)
from imagebuild.buildstep import progress as progress_mod
from imagebuild.buildstep import promote as promote_mod
from imagebuild.buildstep.stagestore import StageStore
from imagebuild.core import context as context_mod
from imagebuild.core import engine as engine_mod
from imagebuild.core import fsutil, remote_engine, state
from imagebuild.core import lock as lock_mod
from imagebuild.core import registry as registry_mod
from imagebuild.core import run as run_mod
from imagebuild.core import runs as runs_mod
from imagebuild.core.errors import (
    DefinitionError,
    GateFailed,
    OperationFailed,
    Problem,
    UsageError,
)
from imagebuild.core.fsutil import (
    atomic_write_bytes,
    atomic_write_json,
    sha256_bytes,
    sha256_file,
    usable_dir,
)
from imagebuild.definition import patchcheck, patching
from imagebuild.definition import reader as defn_mod
from imagebuild.plan import planner as plan_mod
from imagebuild.plan import source_mounts

log = logging.getLogger("imagebuild")

RECORD_SCHEMA = "imagebuild.build"
RECORD_VERSION = 2
DRY_RUN_SCHEMA = "imagebuild.build-plan"
DEFAULT_SOURCE_DATE_EPOCH = plan_mod.DEFAULT_SOURCE_DATE_EPOCH
IMAGE_META_DIR = "/opt/imagebuild"
PATCH_RECORD = f"{IMAGE_META_DIR}/patches.json"
PRIMITIVE_NAME = plan_mod.PRIMITIVE_CONTEXT
NAMED_SRC, NAMED_WHEELS, NAMED_APT = "imagebuild-src", "imagebuild-wheels", "imagebuild-apt"
RECORD_SOURCE_CONTEXT = "imagebuild-record-src"
PROGRESS_CHOICES = progress_mod.MODES
LABEL_PREFIX = "io.imagebuild"
# The release's files arrive as one deterministic tar, extracted by ADD: unlike COPY (which gives
# a folder it creates the build's wall-clock time), every entry, folders included, keeps the tar's
# SOURCE_DATE_EPOCH, so the release layer is the same bytes for the same inputs.
RELEASE_TAR = "release.tar"
RELEASE_DOCKERFILE = f"ARG PARENT\nFROM ${{PARENT}}\nADD {RELEASE_TAR} /\n"
# one compression for every stage (a chain that mixes them reuses blobs and changes digests)
# File times are clamped afterwards by layerclamp.py, in one pass (BuildKit's rewrite-timestamp
# compressed each new layer twice and re-read the parent layers: docs/build.md, Reproducibility).
STAGE_OUTPUT = "type=oci,dest={dest},tar=false,name={name},compression=zstd,force-compression=false"
LOAD_OUTPUT = "type=docker,oci-mediatypes=true"
HEARTBEAT_ENV = progress_mod.HEARTBEAT_ENV
DEFAULT_HEARTBEAT_S = progress_mod.DEFAULT_HEARTBEAT_S
# Build args BuildKit's Dockerfile frontend reads itself (no ARG declares them, so no step's cache and
# no stage key holds them): the lint rule that every stage's `ARG PARENT` / `FROM ${PARENT}` trips (the
# parent always comes as a build arg, so an empty default is the convention, not a mistake), and the
# name `docker buildx history ls` shows for the build (`<image>/<stage>`, not the context folder's).
DOCKERFILE_CHECK_ARG = "BUILDKIT_DOCKERFILE_CHECK"
DOCKERFILE_CHECK = "skip=InvalidDefaultArgInFrom"
BUILD_NAME_ARG = "BUILDKIT_BUILD_NAME"


@dataclass(frozen=True)
class Options:
    from_stage: str | None = None
    until_stage: str | None = None
    no_cache: bool = False
    force: bool = False
    dry_run: bool = False
    jobs: int | None = None
    emulate: bool = False
    gate: bool = True  # run the gate (when installed and the definition has a spec)
    progress: str | None = None  # auto | tty | plain | quiet | rawjson; None: from the environment (progress.py)
    registry: str | None = None  # HOST[:PORT][/PREFIX]: the shared stage cache and release tags (docs/fleet.md)
    check_repro: bool = False  # build the selected stages once more and compare (no release): docs/build.md
    overrides: dict[str, str] = field(default_factory=dict)  # build --set KEY=VALUE: this run's build args
    promote_set: bool = False  # --promote-set: a build with overrides may move :local (never without it)


@dataclass
class StageRun:
    name: str
    key: str
    image: str
    action: str  # build | pull (registry cache) | skip (exists) | reuse (before --from) | not-requested
    reason: str
    network: str
    args: dict = field(default_factory=dict)
    contexts: dict = field(default_factory=dict)
    seconds: float | None = None
    log: str | None = None
    status: str = "pending"  # pending | built | pulled | skipped | failed
    manifest: str | None = None  # the stage's OCI manifest digest in the stage store
    patches: dict | None = None
    compiler_cache: dict | None = None  # the compile's ccache figures (compilecache.py)

    def as_dict(self) -> dict:
        return {"name": self.name, "key": self.key, "image": self.image, "action": self.action,
                "reason": self.reason, "status": self.status, "network": self.network,
                "args": self.args, "named_contexts": self.contexts, "seconds": self.seconds,
                "log": self.log, "manifest": self.manifest, "patches": self.patches,
                **({"compiler_cache": self.compiler_cache} if self.compiler_cache is not None else {})}


# --------------------------------------------------------------------------------------------- helpers


def _iso(epoch: int) -> str:
    return _dt.datetime.fromtimestamp(epoch, _dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _now() -> str:
    return _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def runs_dir(ctx: context_mod.Context, image: str) -> Path:
    """Where the records of an image's runs live: one folder per run."""
    return ctx.state / "builds" / image


def new_run_id() -> str:
    """A run's id: its UTC start time to the microsecond (so ids sort by start, even for runs a
    second apart) and a random suffix (so two hosts sharing a state folder never collide)."""
    return _dt.datetime.now(_dt.UTC).strftime("%Y%m%dT%H%M%S.%fZ") + "-" + secrets.token_hex(3)


def tmp_root(ctx: context_mod.Context) -> Path:
    return ctx.state / "tmp"


def _select(plan: plan_mod.Plan, opts: Options) -> tuple[int, int]:
    names = [s.name for s in plan.stages]
    for flag, value in (("--from", opts.from_stage), ("--until", opts.until_stage)):
        if value is not None and value not in names:
            raise UsageError(f"{flag} {value!r}: no such stage in {plan.image}",
                             hint=f"stages: {', '.join(names)}")
    first = names.index(opts.from_stage) if opts.from_stage else 0
    last = names.index(opts.until_stage) if opts.until_stage else len(names) - 1
    if first > last:
        raise UsageError(f"--from {opts.from_stage} comes after --until {opts.until_stage}",
                         hint=f"stages build in this order: {' -> '.join(names)}")
    return first, last


@dataclass(frozen=True)
class VerifiedFile:
    name: str  # file name in the named context
    path: Path


def check_lock_current(defn: defn_mod.Definition, stage: plan_mod.PlannedStage) -> None:
    """Raise when a source the stage mounts is pinned otherwise in versions.env than in the lock
    (``imagebuild prefetch`` brings the lock up to date), or when there is no lock at all."""
    if stage.mounts and not lock_mod.lock_path(defn.dir).is_file():  # never prefetched: absent, not "stale"
        raise OperationFailed(f"stage {stage.name!r} mounts source {stage.mounts[0].name}, but "
                              f"{defn.rel(lock_mod.lock_path(defn.dir))} does not exist: the image was never "
                              "prefetched", hint=f"imagebuild prefetch {defn.name} makes it (it pins and packs every source)")
    for m in stage.mounts:
        if m.stale:
            lock_disp = defn.rel(lock_mod.lock_path(defn.dir))
            raise OperationFailed(f"stage {stage.name!r} mounts source {m.name}, but {lock_disp} is stale: {m.stale}",
                                  hint=f"imagebuild prefetch {defn.name}")


def verify_sources(defn: defn_mod.Definition, stage: plan_mod.PlannedStage) -> list[VerifiedFile]:
    """Check every tarball mounted into a stage (its sources and their FetchContent dependencies)
    against the lock, and the lock against versions.env; raise before docker starts."""
    if not stage.mounts:
        return []
    root = defn.root
    lock_disp = defn.rel(lock_mod.lock_path(defn.dir))
    out = []
    check_lock_current(defn, stage)
    for m in stage.mounts:
        if not m.tarball or not m.sha256:
            raise OperationFailed(f"{lock_disp}: sources.{m.name}: no tarball/sha256; stage {stage.name!r} needs it",
                                  hint=f"imagebuild prefetch {defn.name}")
        rel = PurePosixPath(m.tarball)
        if rel.is_absolute() or ".." in rel.parts:
            raise OperationFailed(f"{lock_disp}: sources.{m.name}.tarball {m.tarball!r} must be a path inside "
                                  "the project", hint=f"imagebuild prefetch {defn.name}")
        path = root / rel
        if not path.is_file():
            raise OperationFailed(f"{m.tarball}: prefetched tarball of {m.name} not found (stage {stage.name!r})",
                                  hint=f"imagebuild prefetch {defn.name}")
        got = sha256_file(path)
        if got != m.sha256:
            raise OperationFailed(
                f"{m.tarball}: sha256 {got} does not match the lock ({lock_disp}: sources.{m.name}.sha256 "
                f"= {m.sha256}); refusing to build stage {stage.name!r} from a changed tarball",
                hint=f"the file was modified or corrupted: re-create it with `imagebuild prefetch {defn.name}`")
        out.append(VerifiedFile(source_mounts.context_file(m.name, m.tarball), path))
    return out


def _lock_files_for(lock: dict | None, section: str, stage: str) -> dict[str, str] | None:
    """{file name: sha256} recorded by package prefetch for a stage, when the lock has them."""
    sec = (lock or {}).get(section)
    if not isinstance(sec, dict):
        return None
    entry = sec.get(stage)
    files = None
    if isinstance(entry, dict):
        files = entry.get("files", entry)
    if isinstance(files, list):
        out = {}
        for f in files:
            if isinstance(f, dict) and f.get("sha256") and not f.get("from_stage"):  # else in a stage above's folder
                name = f.get("file") or f.get("filename") or f.get("name") or f.get("path")
                if name:
                    out[PurePosixPath(str(name)).name] = f["sha256"]
        return out or None
    if isinstance(files, dict):
        out = {PurePosixPath(str(k)).name: (v.get("sha256") if isinstance(v, dict) else v)
               for k, v in files.items()}
        return {k: v for k, v in out.items() if isinstance(v, str) and len(v) == 64} or None
    return None


def verify_package_dir(defn: defn_mod.Definition, lock: dict | None, kind: str, stage: str) -> Path | None:
    """``deps-src/<image>/<kind>/<stage>/`` when it exists, its files checked against the lock."""
    d = state.deps_dir(defn.root, defn.name) / kind / stage
    if not d.is_dir():
        return None
    want = _lock_files_for(lock, kind, stage)
    if want:
        for name, sha in sorted(want.items()):
            p = d / name
            if not p.is_file():
                raise OperationFailed(f"{defn.rel(p)}: listed in the lock ({kind}.{stage}) but "
                                      "missing", hint=f"imagebuild prefetch {defn.name}")
            got = sha256_file(p)
            if got != sha:
                raise OperationFailed(f"{defn.rel(p)}: sha256 {got} does not match the lock "
                                      f"({sha}); refusing to build stage {stage!r}",
                                      hint=f"re-create it with `imagebuild prefetch {defn.name}`")
    return d


def _fix_mtimes(top: Path, epoch: int) -> None:
    for dirpath, dirnames, filenames in os.walk(top):
        for n in filenames + dirnames:
            os.utime(Path(dirpath) / n, (epoch, epoch), follow_symlinks=False)
    os.utime(top, (epoch, epoch))


def make_context(root: Path, stage: plan_mod.PlannedStage, dest: Path, epoch: int) -> None:
    """The stage's context folder, extracted from the very stream the plan hashed into the stage's key
    (plan/context_stream.py): the stream is written again from the inputs, its digest must equal the
    plan's (an input changed since planning is refused), and only then is it extracted."""
    from imagebuild.plan import context_stream

    dest.mkdir(parents=True, exist_ok=True)
    ents = context_stream.entries(plan_mod.context_inputs(root, stage.inputs))
    stream = dest.parent / (dest.name + ".tar")
    with open(stream, "wb") as f:
        got = context_stream.write(ents, epoch, f)
    try:
        if stage.context_digest and got != stage.context_digest:
            raise OperationFailed(f"stage {stage.name!r}: its inputs changed since the plan was made (context "
                                  f"{got[:19]}, the plan's {stage.context_digest[:19]})",
                                  hint="run the build again: the plan is made anew from the files as they are")
        with tarfile.open(stream) as tf:
            tf.extractall(dest, filter="tar")
    finally:
        stream.unlink(missing_ok=True)
    _fix_mtimes(dest, epoch)


def context_dir_name(kind: str, digest: str) -> str:
    """The folder name of a build context: unique to its content. buildx keeps one snapshot of a local
    context per folder *name* on the engine, and sends only the files whose size and mtime changed;
    every file here has the same mtime (SOURCE_DATE_EPOCH), so a same-size edit under a reused name
    (``context``) arrived as the old bytes (seen: a release layer holding another image's build.json,
    a stage built from the previous tool.sh)."""
    return f"{kind}-{digest.split(':', 1)[-1][:20]}"


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _parallel_args(stage: plan_mod.PlannedStage, jobs: guards.Jobs, explicit_jobs: bool) -> dict[str, str]:
    """Values for the parallelism knobs the stage declares: the rule's, unless pinned."""
    values = jobs.values()
    out = {}
    for a in stage.args:
        if a.name in guards.PARALLEL_KNOBS:
            pinned = a.origin in ("versions.env", plan_mod.ORIGIN_SET)
            if not pinned or (explicit_jobs and a.name != "NVCC_THREADS"):
                out[a.name] = values[a.name]
    return out


# --------------------------------------------------------------------------------------------- progress

Progress = progress_mod.Progress  # what the run shows on stderr (progress.py)


# --------------------------------------------------------------------------------------------- docker


def buildx_argv(*, context: Path, dockerfile: Path, build_args: dict, contexts: dict, labels: dict,
                network: str | None, platform: str, no_cache: bool, output: str | None, tag: str | None,
                metadata: Path | None, rerun: str | None = None, name: str | None = None) -> list[str]:
    """The ``docker buildx build`` command line of one stage (also shown by ``--dry-run``).

    ``rerun`` (imagebuild's ``--no-cache``): every RUN step runs again, but cache mounts (a compiler
    cache) are kept. BuildKit's own ``--no-cache`` empties every cache mount a step uses, so it is
    not used; instead a host entry unique to the run (``--add-host imagebuild-rerun-<id>``) is part
    of each RUN step's cache key. It lives in the build container's /etc/hosts only: no layer, no
    config, no history holds it, so the output is the same bytes. ``no_cache``: BuildKit's own.
    ``name``: the build's name in BuildKit's history (``<image>/<stage>``). The output is BuildKit's
    structured progress (rawjson), which ``progress.Decoder`` reads.
    """
    argv = ["docker", "buildx", "build", "--progress=rawjson", "--provenance=false", "--sbom=false",
            "--platform", platform, "--file", str(dockerfile)]
    if network:
        argv += ["--network", network]
    if no_cache:
        argv.append("--no-cache")
    if rerun:
        argv += ["--add-host", f"imagebuild-rerun-{rerun}:127.0.0.1"]
    if metadata is not None:
        argv += ["--metadata-file", str(metadata)]
    for k, v in build_args.items():
        argv += ["--build-arg", f"{k}={v}"]
    argv += ["--build-arg", f"{DOCKERFILE_CHECK_ARG}={DOCKERFILE_CHECK}"]
    if name:
        argv += ["--build-arg", f"{BUILD_NAME_ARG}={name}"]
    for k, v in contexts.items():
        argv += ["--build-context", f"{k}={v}"]
    for k, v in labels.items():
        argv += ["--label", f"{k}={v}"]
    if output is None:  # into the engine (--load), with OCI media types: a registry takes it as pushed (a plain
        # --load into the containerd store names zstd layers with a Docker type no registry client parses)
        argv += ["--output", LOAD_OUTPUT]
    else:
        argv += ["--output", output]
    if tag:
        argv += ["--tag", tag]
    argv.append(str(context))
    return argv


class _StageFailed(Exception):
    def __init__(self, code: int):
        self.code = code


def _buildx(argv: list[str], *, log_path: Path, progress: Progress, label: str, epoch: int) -> dict:
    """Run one ``docker buildx build``; its output goes to ``log_path`` (and to ``progress``).
    Returns the metadata file's content when the command wrote one."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    meta = Path(argv[argv.index("--metadata-file") + 1]) if "--metadata-file" in argv else None
    dec = progress_mod.Decoder()
    progress.start(label, str(log_path), decoder=dec)
    try:
        with open(log_path, "w", encoding="utf-8") as logf:
            def on_line(text: str) -> None:
                with progress.lock:
                    plain = dec.feed(text)
                if plain:
                    logf.write(plain)
                    logf.flush()
                progress.feed(text, dec, plain)

            # SOURCE_DATE_EPOCH in the environment too: buildx passes it on as the build arg
            rc = run_mod.stream(argv, on_line, env={"SOURCE_DATE_EPOCH": str(epoch)},
                                hint="docker buildx is needed (scripts/testbed.sh installs it)")
            if rc != 0:
                logf.write(f"\nimagebuild: docker buildx build exited {rc}\n")
                raise _StageFailed(rc)
    finally:
        progress.stop()
    if meta is None:
        return {}
    try:
        return json.loads(meta.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}


def _inspect(ref: str) -> dict:
    text = run_mod.output(["docker", "image", "inspect", "--format", "{{json .}}", ref], timeout=60,
                          hint="is the Docker engine healthy? (imagebuild doctor)")
    return json.loads(text.splitlines()[-1])


def _source_place(where: str, built: Path, source: Path, shown: str) -> str:
    """BuildKit's place (``napper.Dockerfile:4``) in the Dockerfile as built (``built``: the stage's own
    with ``ARG SOURCE_DATE_EPOCH`` after each FROM) as the place in the stage's own file (``source``,
    shown as ``shown``: ``docker-images/IMAGE/Dockerfile.napper:3``); ``where`` as it is otherwise."""
    name, _, num = where.rpartition(":")
    if name != built.name or not num.isdigit():
        return where
    try:
        gen = built.read_text(encoding="utf-8", errors="replace").splitlines()
        own = source.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return where
    j = 0
    for i, ln in enumerate(gen[:int(num)], start=1):
        if j < len(own) and ln == own[j]:  # a line of the stage's own file (the others were inserted)
            j += 1
            if i == int(num):
                return f"{shown}:{j}"
    return where


def _failure(what: str, log_path: Path, code: int, place=None) -> str:
    """A failed ``docker buildx build`` said once, as the nightly report says it (buildstep/buildlog.py):
    where (``Dockerfile.check:4``), the RUN's own exit code (``RUN exit 3``: docker buildx itself
    exits 1), the step, and that step's own output lines; without a failing RUN (the engine, a
    missing base), the end of the log. The log's path goes in the hint."""
    from imagebuild.buildstep import buildlog

    info = buildlog.explain_file(log_path)
    if info is None or info["exit_code"] is None:
        tail = info["tail"] if info else []
        return (f"{what} failed (docker buildx build exit {code})" + ("; the end of its log:\n" if tail else "")
                + "\n".join("  | " + ln for ln in tail))
    where = place(info["where"]) if place is not None and info["where"] else info["where"]
    lines = [f"{what} failed" + (f" at {where}" if where else "")
             + f": {buildlog.run_exit(info['exit_code'])}"]
    if info["step"]:
        lines.append(f"  step: {info['step']}")
    out = info["output"]
    lines.append("  its output:" if out else "  it printed nothing")
    lines += ["  | " + ln for ln in out]
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------- the build


@dataclass
class Build:
    ctx: context_mod.Context
    defn: defn_mod.Definition
    plan: plan_mod.Plan
    opts: Options
    lock: dict | None
    store: StageStore
    stages: list[StageRun]
    first: int
    last: int
    run_id: str
    engine_id: str | None = None
    warnings: list[str] = field(default_factory=list)
    cache: object | None = None  # registry_cache.StageCache with a registry (attach)
    found: dict = field(default_factory=dict)  # stage name -> registry_cache.Found (action "pull")

    @property
    def root(self) -> Path:
        return self.ctx.root

    @property
    def dir(self) -> Path:
        return runs_dir(self.ctx, self.defn.name) / self.run_id

    @property
    def epoch(self) -> int:
        """The release's SOURCE_DATE_EPOCH: the final stage's."""
        return self.plan.stages[-1].source_date_epoch

    def manifest(self, stage: str) -> str:
        r = next(s for s in self.stages if s.name == stage)
        if not r.manifest:
            raise OperationFailed(f"stage {stage!r} has no image in the stage store ({self.store.dir})",
                                  hint=f"imagebuild build {self.defn.name}")
        return r.manifest


def prepare(ctx: context_mod.Context, image: str, opts: Options) -> Build:
    """Everything that can be checked without starting docker builds (guards excepted)."""
    root = ctx.root
    if opts.jobs is not None and opts.jobs < 1:
        raise UsageError(f"--jobs {opts.jobs}: expected a positive number")
    progress_mod.resolve_mode(opts.progress, isatty=False)  # a bad --progress or environment value: said now
    defn = defn_mod.load(root, image)
    lock = lock_mod.read(defn.dir, ctx.show(lock_mod.lock_path(defn.dir)))
    info = ctx.engine
    if not info.reachable and not opts.dry_run:
        raise engine_mod.unreachable_error(info)
    store = StageStore.for_image(root, defn.name)
    plan_mod.check_overrides(defn, opts.overrides)
    plan = plan_mod.make_plan(defn, exists=lambda key: store.lookup(key) is not None, engine=info.as_dict(),
                              lock=lock, overrides=opts.overrides)
    if plan.unpinned and lock is None:
        log.info("note: %d unpinned item(s) (imagebuild prefetch pins them)", len(plan.unpinned))
    first, last = _select(plan, opts)
    runs: list[StageRun] = []
    for i, s in enumerate(plan.stages):
        ref = store.lookup(s.key)
        if i < first:
            action, reason = "reuse", f"before --from {opts.from_stage}"
            if ref is None:
                raise UsageError(f"--from {opts.from_stage}: the earlier stage {s.name!r} is not built "
                                 f"(no {s.image} in the stage store)",
                                 hint=f"build it first: imagebuild build {image} --until {s.name}")
        elif i > last:
            action, reason = "not-requested", f"after --until {opts.until_stage}"
        elif opts.no_cache:
            action, reason = "build", "--no-cache"
        elif ref is not None:
            action, reason = "skip", "stage with this key is built"
        else:
            action, reason = "build", "no stage with this key"
        r = StageRun(s.name, s.key, s.image, action, reason, "default" if s.network else "none")
        if action in ("skip", "reuse") and ref is not None:
            r.manifest = ref.manifest
            r.patches = ref.patches
        runs.append(r)
    return Build(ctx, defn, plan, opts, lock, store, runs, first, last, new_run_id(), info.id)


def _check_inputs(b: Build) -> dict[str, dict]:
    """Check the lock against versions.env for every stage of the plan (a stage taken from the store
    was built from the lock's sources: a moved pin must not pass because nothing is rebuilt), then
    verify every prefetched input of the stages to build; returns the named-context sources."""
    for st in b.plan.stages:
        check_lock_current(b.defn, st)
    return {r.name: inputs_of(b, b.plan.stage(r.name)) for r in b.stages
            if r.action == "build" or (b.opts.check_repro and r.action == "skip")}


def inputs_of(b: Build, st: plan_mod.PlannedStage) -> dict:
    return {"src": verify_sources(b.defn, st), "wheels": verify_package_dir(b.defn, b.lock, "wheels", st.name),
            "apt": verify_package_dir(b.defn, b.lock, "apt", st.name)}


def _guards(b: Build, *, lock: guards.BuildLock | None) -> None:
    info = (b.plan.engine or {})
    if not b.opts.emulate:  # a foreign platform without --emulate: refused first
        guards.check_platform(b.plan.platform, emulate=False, engine_arch=info.get("architecture"))
    prov = b.plan.provenance
    if prov is not None and prov.dirty_paths:  # provenance.py: why a committed definition is still dirty
        b.warnings.append(f"revision {prov.revision}: a stage's context holds what no commit holds (gitignored "
                          f"or an empty folder): {', '.join(prov.dirty_paths)}")
    eng = remote_engine.active()
    if info.get("reachable"):  # a local base of another platform: refused before anything runs (exit 2)
        notes = guards.check_base_platforms(b.defn)
        for note in notes:
            log.debug("%s", note)
        if eng is not None and notes and any(r.action == "build" for r in b.stages):
            remote_engine.refuse_missing_bases(eng, notes)
        _check_pinned_bases(b)
    if b.opts.emulate:  # after the bases (a wrong base is the definition's error, whatever the host runs)
        warn = guards.check_platform(b.plan.platform, emulate=True, engine_arch=info.get("architecture"))
        if warn:
            b.warnings.append(warn)
    if lock is not None:
        lock.acquire(command="imagebuild build " + b.defn.name)
    if not info.get("reachable"):
        return
    warn = guards.check_serving(force=b.opts.force)
    if warn:
        b.warnings.append(warn)
    to_build = [r.name for r in b.stages if r.action == "build"]
    if to_build:
        paths, measured = [b.ctx.state], []
        if eng is not None:  # the engine's node: its data root, measured there (remote_engine.facts)
            measured, note = remote_engine.disk_free(eng)
            if note:
                b.warnings.append(note)
        elif info.get("root_dir") and Path(info["root_dir"]).exists():
            paths.append(Path(info["root_dir"]))
        warn = guards.check_disk(paths, force=b.opts.force, measured=measured,
                                 export_gib=guards.export_space_gib(b.store, to_build))
        if warn:
            b.warnings.append(warn)


def _stage_contexts(b: Build, st: plan_mod.PlannedStage, *, dry: bool = False) -> dict[str, str]:
    """The named contexts through which a stage reads earlier stages (its parent, ``STAGE_*``)."""
    def ctx(stage: str) -> str:
        if dry:
            r = next(s for s in b.stages if s.name == stage)
            return b.store.context(r.manifest) if r.manifest else f"oci-layout://{b.store.dir}@<{stage}>"
        return b.store.context(b.manifest(stage))

    out = {}
    if st.parent_kind == "stage":
        out[plan_mod.PARENT_CONTEXT] = ctx(st.parent)
    for name, stage in st.stage_contexts.items():
        out[name] = ctx(stage)
    return out


def dockerfile_for_build(b: Build, st: plan_mod.PlannedStage) -> Path:
    """The stage's Dockerfile as BuildKit gets it (``reproducible.dockerfile_for_build``: ``ARG
    SOURCE_DATE_EPOCH`` after every FROM), kept beside the stage's log (``logs/<stage>.Dockerfile``):
    the line numbers in BuildKit's messages are this file's."""
    path = b.dir / "logs" / f"{st.name}.Dockerfile"
    path.parent.mkdir(parents=True, exist_ok=True)
    text = (b.root / st.dockerfile).read_bytes().decode("utf-8", "surrogateescape")
    atomic_write_bytes(path, reproducible.dockerfile_for_build(text, cpuinfo=_emulated_arm64(b)).encode(
        "utf-8", "surrogateescape"))
    return path


def _emulated_arm64(b: Build) -> bool:
    """An arm64 build on another architecture's engine (``--emulate``): its RUNs get an AArch64 cpuinfo."""
    from imagebuild.core import emulation

    engine_arch = (b.plan.engine or {}).get("architecture")
    return bool(b.opts.emulate) and emulation.arch_of(b.plan.platform) == "arm64" \
        and guards.host_arch(engine_arch) != "arm64"


def _cpuinfo_context(b: Build, tmp: Path) -> dict[str, str]:
    """The named context holding the AArch64 cpuinfo the RUNs of an emulated arm64 build mount."""
    if not _emulated_arm64(b):
        return {}
    from imagebuild.core import emulation

    d = tmp / "cpuinfo"
    d.mkdir(parents=True, exist_ok=True)
    (d / "cpuinfo").write_text(emulation.aarch64_cpuinfo(os.cpu_count() or 1), encoding="ascii")
    return {reproducible.CPUINFO_CONTEXT: str(d)}


def _stage_argv(b: Build, st: plan_mod.PlannedStage, *, ctx: Path, named: dict, meta: Path | None,
                jobs: guards.Jobs, dry: bool = False, dockerfile: Path | None = None,
                rerun: str | None = None) -> list[str]:
    contexts = {**named, **_stage_contexts(b, st, dry=dry)}
    args = {**st.build_args(), "SOURCE_DATE_EPOCH": str(st.source_date_epoch),
            **_parallel_args(st, jobs, b.opts.jobs is not None)}
    labels = {f"{LABEL_PREFIX}.image": b.defn.name, f"{LABEL_PREFIX}.stage": st.name,
              f"{LABEL_PREFIX}.stage-key": st.key}
    if rerun is None and b.opts.no_cache:
        rerun = b.run_id.rsplit("-", 1)[-1]
    return buildx_argv(context=ctx, dockerfile=dockerfile or b.root / st.dockerfile, build_args=args,
                       contexts=contexts, labels=labels, network=None if st.network else "none",
                       platform=b.plan.platform, no_cache=False, rerun=rerun,
                       output=STAGE_OUTPUT.format(dest=b.store.dir, name=st.image),
                       tag=None, metadata=meta, name=f"{b.defn.name}/{st.name}")


def build(ctx: context_mod.Context | Path, image: str, opts: Options) -> dict:
    """Run the build; returns the build record (also written under the run's folder)."""
    ctx = context_mod.of(ctx)
    defn_mod.check_image_name(image)
    guards.min_free_gib()  # a bad setting is said before the engine is asked anything
    _check_folders(ctx)
    b = prepare(ctx, image, opts)
    registry_cache.attach(b)  # stages the registry holds are pulled, not built: their inputs need not be here
    named = _check_inputs(b)  # before the lock and before docker: a tampered input stops here
    blk = guards.BuildLock(guards.build_lock_path(b.engine_id, b.defn.name), b.defn.name)
    try:
        _guards(b, lock=blk)
        # this project's claim on the build in the shared stage store: gc elsewhere leaves it alone
        owners.claim(b.store.dir, b.ctx.root, b.plan.build_id, [s.key for s in b.plan.stages])
        _remove_stale_tmp(b)
        for w in b.warnings:
            log.warning("warning: %s", w)
        return _run(b, named)
    finally:
        blk.release()


def _check_folders(ctx: context_mod.Context, create: bool = True) -> None:
    """The folders a build writes in, checked before anything starts (a run record never stays
    ``running`` because one of them is unusable): the stage store, the lock folder, then the state
    folder (last: a refusal leaves the project as it was). ``create`` False (``--dry-run``): the
    same checks, nothing made."""
    usable_dir(state.stages_dir(), state.STAGES_ENV if os.environ.get(state.STAGES_ENV) else "the stage store",
               hint=f"{state.STAGES_ENV} names a folder this user can write (default "
               "$XDG_CACHE_HOME/imagebuild/stages)", create=create)
    guards.usable_lock_dir(guards.lock_top(), create=create)
    usable_dir(tmp_root(ctx), "IMAGEBUILD_STATE_DIR" if os.environ.get("IMAGEBUILD_STATE_DIR") else
               "the state folder", hint="IMAGEBUILD_STATE_DIR names a folder this user can write (default "
               "<project>/.imagebuild)", create=create)


def _remove_stale_tmp(b: Build) -> None:
    """Temporary folders of this image's earlier runs: with the image's lock held, no other run
    of it is alive, so whatever they left (a kill -9, a power cut) goes now."""
    top = tmp_root(b.ctx)
    for p in sorted(top.glob(f"build-{b.defn.name}-*")) if top.is_dir() else ():
        log.info("removing %s (left by an earlier run that did not end cleanly)", p)
        shutil.rmtree(p, ignore_errors=True)
    for p in layerclamp.remove_stale_tmp(b.store):
        log.info("removed %s (left by an earlier run that did not end cleanly)", p)
    for r in runs_mod.mark_abandoned(b.ctx, b.defn.name):
        log.info("run %s of %s: recorded as %s (its process %s is gone, it never finished)", r.run_id,
                 b.defn.name, runs_mod.ABANDONED, r.record.get("owner"))


def _record(b: Build, status: str, started: str, **extra) -> dict:
    rec = {
        "schema": RECORD_SCHEMA, "version": RECORD_VERSION, "image": b.defn.name, "run_id": b.run_id,
        "build_id": b.plan.build_id, "build_id_from": b.plan.build_id_from, "platform": b.plan.platform,
        "status": status, "owner": runs_mod.owner(),  # host:pid: a record left running by a dead owner is abandoned
        "started": started, "finished": _now(),  # a record of a run: it holds times, explicitly
        "source_date_epoch": b.epoch,
        "options": {"from": b.opts.from_stage, "until": b.opts.until_stage, "no_cache": b.opts.no_cache,
                    "force": b.opts.force, "jobs": b.opts.jobs, "emulate": b.opts.emulate,
                    "progress": b.opts.progress, "check_repro": b.opts.check_repro,
                    "promote_set": b.opts.promote_set},
        "overrides": dict(sorted(b.opts.overrides.items())),  # build --set: this run's build args
        "stage_store": str(b.store.dir),
        "engine": remote_engine.record(b.engine_id),
        "registry": b.cache.as_dict() if b.cache is not None else None,
        "inputs": {"tarballs": sorted({m.tarball for s in b.plan.stages for m in s.mounts if m.tarball})},
        "warnings": b.warnings,
        "stages": [r.as_dict() for r in b.stages],
        "patches": _merged_patches(b),
        **extra,
    }
    atomic_write_json(b.dir / "record.json", rec)
    return rec


def _merged_patches(b: Build) -> dict:
    out: dict = {}
    for r in b.stages:
        if r.patches:
            out.update(r.patches.get("patches") or {})
    return out


def _run(b: Build, named: dict) -> dict:
    started = _now()
    try:
        rec = _run_stages(b, named, started)
    except KeyboardInterrupt:  # Ctrl-C, SIGTERM, SIGHUP: the child was stopped, the temp folder is gone
        _record(b, "interrupted", started, release=None, promotion=None)
        raise
    except BaseException as exc:
        if b.cache is not None:  # what was built before the failure still reaches the registry
            b.cache.finish()
            _join_ccache_pushes(b)
        _record_unfinished(b, started, exc)
        raise
    if b.cache is not None:
        b.cache.finish()
        _join_ccache_pushes(b)
        b.warnings.extend(w for w in b.cache.warnings if w not in b.warnings)
        rec = _record(b, rec["status"], started, release=rec.get("release"), promotion=rec.get("promotion"),
                      **{k: rec[k] for k in ("publish",) if k in rec})
    return rec


def _join_ccache_pushes(b: Build) -> None:
    """What each compiler cache's push did (compilecache_share.py, on the push thread), into its stage's
    figures, once the pushes are done."""
    done = compilecache_share.pushed(b.cache)
    for r in b.stages:
        if r.compiler_cache is not None and r.name in done:
            r.compiler_cache["pushed"] = done[r.name]


def _record_unfinished(b: Build, started: str, exc: BaseException) -> None:
    """A run that stopped on an error no step recorded still ends ``failed``, never ``running``."""
    try:
        rec = json.loads(fsutil.read_text(b.dir / "record.json"))
        if isinstance(rec, dict) and rec.get("status") == "running":
            _record(b, "failed", started, release=None, promotion=None,
                    error=getattr(exc, "message", None) or f"{type(exc).__name__}: {exc}")
    except (OSError, ValueError):
        pass


def _run_stages(b: Build, named: dict, started: str) -> dict:
    progress = Progress(b.opts.progress)
    jobs = guards.host_jobs(b.opts.jobs)
    total = len(b.stages)
    top = tmp_root(b.ctx)
    top.mkdir(parents=True, exist_ok=True)
    b.dir.mkdir(parents=True, exist_ok=True)
    _record(b, "running", started, release=None, promotion=None)
    progress.begin([r.name for r in b.stages], extra=("release",) if b.last == total - 1 else ())
    outcome = "interrupted"
    try:
        with tempfile.TemporaryDirectory(prefix=f"build-{b.defn.name}-", dir=top) as tmp_s:
            tmp = Path(tmp_s)
            empty = tmp / "empty"
            empty.mkdir()
            for i, r in enumerate(b.stages, start=1):
                st = b.plan.stage(r.name)
                head = f"[{i}/{total}] {r.name}"
                progress.stage(r.name)
                if r.action == "pull":
                    if _pull_stage(b, r, st, tmp / r.name, progress, head):
                        progress.finish(r.name, "pulled", r.seconds)
                        continue
                    r.action, r.reason = "build", "the registry cache did not give it (see the warning)"
                    named[r.name] = inputs_of(b, st)
                if r.action != "build":
                    r.status = "skipped"
                    progress.finish(r.name, "reused" if r.action == "reuse" else "skipped", 0,
                                    note=r.reason if r.action != "skip" else "")
                    progress.info("%s: %s (%s) %s", head, r.action, r.reason, r.image)
                    continue
                try:
                    _build_stage(b, r, st, named[r.name], tmp / r.name, empty, jobs, progress, head, started)
                finally:
                    if r.status in ("built", "failed"):
                        progress.finish(r.name, r.status, r.seconds, note=compilecache.line(r.compiler_cache))
                if b.cache is not None:
                    b.cache.push(r.name, r.key, r.manifest)
            if b.opts.check_repro:
                repro = _check_repro(b, named, tmp, empty, jobs, progress)
                rec = _record(b, "ok" if repro["same"] else NOT_REPRODUCIBLE, started, release=None,
                              promotion=None, repro=repro)
                outcome = "done"
                progress.end(outcome)
                return rec
            if b.last != total - 1:
                rec = _record(b, "ok", started, release=None, promotion=None)
                outcome = "done"
                progress.end(outcome)
                progress.info("stopped after stage %s (--until): no release image", b.opts.until_stage)
                return rec
            progress.stage("release")
            release = _release(b, tmp / "release", progress, started)
            progress.finish("release", "built" if release.get("built") else "skipped")
        outcome = "done"
    except Exception:
        outcome = "failed"
        raise
    finally:
        progress.end(outcome)
    promotion = _gate_and_promote(b, release, started)
    publish = _publish_release(b, release, promotion, started)
    return _record(b, "ok", started, release=release, promotion=promotion,
                   **({"publish": publish} if publish is not None else {}))


def stage_inputs(b: Build, st: plan_mod.PlannedStage, inputs: dict, tmp: Path, empty: Path) -> tuple[Path, dict]:
    """The stage's context folder and its named contexts (``imagebuild-src``: its verified source
    tarballs and the generated unpack script; ``imagebuild-wheels``, ``imagebuild-apt``), made under
    ``tmp`` exactly as the build sends them (``inputs``: ``inputs_of``); ``empty`` stands for none."""
    ctx = tmp / context_dir_name("context", st.key)
    make_context(b.root, st, ctx, st.source_date_epoch)
    src_dir = tmp / context_dir_name(NAMED_SRC, st.key)
    src_dir.mkdir()
    for vf in inputs["src"]:
        _link_or_copy(vf.path, src_dir / vf.name)
    # the generated unpack script + manifest (extract every source, set every override; source_mounts.py)
    for fname, data in source_mounts.source_mounts(b.lock, st.name, st.sources).files().items():
        (src_dir / fname).write_bytes(data)
    return ctx, {NAMED_SRC: str(src_dir), NAMED_WHEELS: str(inputs["wheels"] or empty),
                 NAMED_APT: str(inputs["apt"] or empty)}


def _build_stage(b: Build, r: StageRun, st: plan_mod.PlannedStage, inputs: dict, tmp: Path, empty: Path,
                 jobs: guards.Jobs, progress: Progress, head: str, started: str) -> None:
    ctx, named = stage_inputs(b, st, inputs, tmp, empty)
    named.update(_cpuinfo_context(b, tmp))
    src_dir = Path(named[NAMED_SRC])
    seeded = _seed_compiler_cache(b, st, progress, head)
    cache_id = compilecache.give(b.root / st.dockerfile, src_dir, named, empty)
    meta = tmp / "metadata.json"
    argv = _stage_argv(b, st, ctx=ctx, named=named, meta=meta, jobs=jobs, dockerfile=dockerfile_for_build(b, st))
    r.args = {**st.build_args(), "SOURCE_DATE_EPOCH": str(st.source_date_epoch),
              **_parallel_args(st, jobs, b.opts.jobs is not None)}
    r.contexts = {NAMED_SRC: sorted(p.name for p in src_dir.iterdir()),
                  NAMED_WHEELS: b.ctx.show(inputs["wheels"]) if inputs["wheels"] else None,
                  NAMED_APT: b.ctx.show(inputs["apt"]) if inputs["apt"] else None,
                  **{k: v.split("@", 1)[1] for k, v in _stage_contexts(b, st).items()}}
    log_path = b.dir / "logs" / f"{st.name}.log"
    r.log = b.ctx.show(log_path)
    progress.info("%s: building (%s, network %s), log: %s", head, r.reason, r.network, r.log)
    t0 = time.monotonic()
    b.store.dir.mkdir(parents=True, exist_ok=True)
    try:
        md = _buildx(argv, log_path=log_path, progress=progress, label=st.name, epoch=st.source_date_epoch)
        manifest = md.get("containerimage.digest")
        if not isinstance(manifest, str) or not b.store.complete(manifest):
            raise OperationFailed(f"stage {st.name!r}: BuildKit reported success but its image is not complete in "
                                  f"{b.store.dir} (manifest {manifest!r}); not treating it as built",
                                  hint=f"see {log_path}; is the engine's BuildKit new enough? (imagebuild doctor)")
        manifest = _clamp_times(b, st, manifest, log_path, progress, head)
        patches = None
        if any(inp.kind == "patch" for inp in st.inputs):
            patches = _read_patch_record(b, st, manifest, tmp, progress) or {
                "schema": patching.RECORD_SCHEMA, "version": patching.RECORD_VERSION, "patches": {},
                "note": f"no {PATCH_RECORD} in the stage"}
    except _StageFailed as exc:
        r.seconds = round(time.monotonic() - t0, 3)
        r.status = "failed"
        _record(b, "failed", started, failed_stage=st.name, release=None, promotion=None)
        raise OperationFailed(
            _failure(f"stage {st.name!r} of {b.defn.name}", log_path, exc.code,
                     lambda w: _source_place(w, b.dir / "logs" / f"{st.name}.Dockerfile", b.root / st.dockerfile,
                                             st.dockerfile)),
            hint=f"full log: {log_path}; the release was not reached: :local and :candidate were not "
            "touched") from None
    b.store.commit(st.key, st.name, manifest, patches=patches)
    r.manifest, r.patches = manifest, patches
    if cache_id:
        r.compiler_cache = compilecache.take_back(cache_id, stage_context=b.store.context(manifest),
                                                  platform=b.plan.platform, tmp=tmp, run_id=b.run_id,
                                                  log_path=log_path)
        if r.compiler_cache is not None:
            r.compiler_cache.update(seeded)
            if b.cache is not None:  # in the background; its outcome joins the figures after cache.finish()
                compilecache_share.push(b.cache, cache_id, st.name, r.compiler_cache)
        progress.info("%s: %s", head, compilecache.line(r.compiler_cache) or "ccache: no figures (see the log)")
    r.seconds = round(time.monotonic() - t0, 3)
    r.status = "built"
    progress.info("%s: built in %.1f s -> %s", head, r.seconds, st.image)


def _seed_compiler_cache(b: Build, st: plan_mod.PlannedStage, progress: Progress, head: str) -> dict:
    """Where the stage's compiler cache comes from (``seeded_from``: host | registry | none): with a
    registry and no host copy, the registry's (compilecache_share.py), pulled and verified first."""
    try:
        cache_id = compilecache.cache_id_of((b.root / st.dockerfile).read_text(errors="replace"))
    except OSError:
        cache_id = None
    if cache_id is None:
        return {}
    if not compilecache_share.host_empty(cache_id):
        return {"seeded_from": "host"}
    if b.cache is not None:
        got = compilecache_share.pull(b.cache, cache_id, st.name)
        if got is not None:
            progress.info("%s: compiler cache from the registry (%s, %.1f MiB, %d files, in %.1f s)", head,
                          got["digest"][:19], got["bytes"] / 2**20, got["files"], got["seconds"])
            return {"seeded_from": "registry", "pulled": got}
        if not compilecache_share.host_empty(cache_id):  # another clone's take-back filled it meanwhile
            return {"seeded_from": "host"}
    return {"seeded_from": "none"}


NOT_REPRODUCIBLE = "not-reproducible"  # the record's status when --check-repro found a difference
REPRO_SCHEMA = "imagebuild.repro-check"


def _check_repro(b: Build, named: dict, tmp: Path, empty: Path, jobs: guards.Jobs, progress: Progress) -> dict:
    """``--check-repro``: every selected stage (built or found in the store just now) is built once
    more, from the same parent, without BuildKit's cache for its RUN steps (a fresh rerun host entry),
    exported and clamped as any build, and its manifest compared with the stage store's. A
    difference is named file by file (``reprodiff``). The second build's blobs are removed and the
    stage store is left as it was: its refs never name the second build."""
    out = []
    selected = [(i, r) for i, r in enumerate(b.stages, start=1) if b.first < i <= b.last + 1]
    for i, r in selected:
        st = b.plan.stage(r.name)
        head = f"[check {i}/{len(b.stages)}] {r.name}"
        first = b.manifest(r.name)
        progress.stage(r.name)
        t0 = time.monotonic()
        second = _second_build(b, st, named[r.name], tmp / f"check-{r.name}", empty, jobs, progress, head)
        try:
            diffs = reprodiff.diff(b.store, first, second, len(_parent_diff_ids(b, st)))
        finally:
            if second != first:
                _forget_manifest(b, second, first)
        same = second == first
        progress.finish(r.name, "same" if same else "differs", round(time.monotonic() - t0, 3))
        if same:
            progress.info("%s: built again: the same manifest %s", head, first)
        else:
            progress.info("%s: built again: %s, not %s; %d path(s) differ%s", head, second, first, len(diffs),
                          "".join(f"\n  {d.line()}" for d in diffs[:REPRO_SHOWN]) +
                          (f"\n  ... and {len(diffs) - REPRO_SHOWN} more (--json)" if len(diffs) > REPRO_SHOWN else ""))
        out.append({"name": r.name, "key": r.key, "first": first, "second": second, "same": same,
                    "seconds": round(time.monotonic() - t0, 3),
                    "differences": [d.as_dict() for d in diffs]})
    return {"schema": REPRO_SCHEMA, "version": 1, "same": all(x["same"] for x in out), "stages": out}


REPRO_SHOWN = 20  # differing paths said per stage (--json has them all)


def _second_build(b: Build, st: plan_mod.PlannedStage, inputs: dict, tmp: Path, empty: Path, jobs: guards.Jobs,
                  progress: Progress, head: str) -> str:
    """The stage built once more into the stage store, not committed: its (clamped) manifest."""
    tmp.mkdir(parents=True)
    ctx, named = stage_inputs(b, st, inputs, tmp, empty)
    named.update(_cpuinfo_context(b, tmp))
    meta = tmp / "metadata.json"
    argv = _stage_argv(b, st, ctx=ctx, named=named, meta=meta, jobs=jobs, dockerfile=dockerfile_for_build(b, st),
                       rerun="check-" + secrets.token_hex(4))
    log_path = b.dir / "logs" / f"{st.name}.check.log"
    progress.info("%s: building again to compare (log: %s)", head, b.ctx.show(log_path))
    try:
        md = _buildx(argv, log_path=log_path, progress=progress, label=st.name, epoch=st.source_date_epoch)
    except _StageFailed as exc:
        raise OperationFailed(_failure(f"the second build of stage {st.name!r}", log_path, exc.code),
                              hint=f"full log: {log_path}") from None
    manifest = md.get("containerimage.digest")
    if not isinstance(manifest, str) or not b.store.complete(manifest):
        raise OperationFailed(f"stage {st.name!r}: BuildKit reported success but the second build's image is not "
                              f"complete in {b.store.dir} (manifest {manifest!r})", hint=f"see {log_path}")
    return _clamp_times(b, st, manifest, log_path, progress, head)


def _forget_manifest(b: Build, manifest: str, instead: str) -> None:
    """The check's second manifest out of the stage store: ``index.json`` names ``instead`` again,
    and its blobs that no ref names are removed."""
    blobs = b.store.manifest_blobs(manifest) or []
    size = b.store.blob(instead).stat().st_size if b.store.blob(instead).is_file() else 0
    layerclamp._index_names(b.store, manifest, instead, size)
    layerclamp._remove_unless_named(b.store, [manifest, *blobs], keep=set())


def _missing_base(b: Build, ref: defn_mod.ImageRef) -> OperationFailed:
    """A pinned base the engine does not hold, said as prefetch says it (and why, when its tag moved)."""
    by_digest = f"{ref.name}@{ref.digest}"
    why = ""
    if ref.tag:
        tagged = f"{ref.name}:{ref.tag}"
        proc = run_mod.run(["docker", "image", "inspect", "--format", "{{.Id}}", tagged], check=False, timeout=60)
        if proc.returncode == 0:
            why = f" (the local {tagged} is another image: its tag moved off the pinned digest)"
    return OperationFailed(f"{b.defn.env.display}: {ref.key}: {by_digest} is not in the local engine{why}",
                           hint=f"imagebuild prefetch {b.defn.name} pulls the pinned digest; or load it (docker "
                           "load) or pull it where the registry is reachable")


def _check_pinned_bases(b: Build) -> None:
    """A base pinned by digest whose tag now names another local image: BuildKit may still answer the
    stage from its cache, and the build would stop only after it, reading the base's layers. Said
    before anything is built, in prefetch's words."""
    parents = {b.plan.stage(r.name).parent for r in b.stages if r.action == "build"
               and b.plan.stage(r.name).parent_kind != "stage"}
    for key in sorted(parents & set(b.defn.images)):
        ref = b.defn.images[key]
        if ref.digest is None or not ref.tag:
            continue
        proc = run_mod.run(["docker", "image", "inspect", "--format", "{{.Id}}", ref.value], check=False, timeout=60)
        if proc.returncode != 0 and "no such image" in proc.stdout.decode("utf-8", "replace").lower():
            err = _missing_base(b, ref)
            if "tag moved" in err.message:
                raise err


def _parent_diff_ids(b: Build, st: plan_mod.PlannedStage) -> list[str]:
    """The layers a stage starts from (diff ids, base first): its parent stage's or its base image's."""
    if st.parent_kind == "stage":
        return b.store.diff_ids(b.manifest(st.parent))
    if st.parent_ref == "scratch":
        return []
    ref = b.defn.images.get(st.parent)
    if ref is not None and ref.digest is not None:
        proc = run_mod.run(["docker", "image", "inspect", "--format", "{{.Id}}", st.parent_ref], check=False,
                           timeout=60)
        if proc.returncode != 0 and "no such image" in proc.stdout.decode("utf-8", "replace").lower():
            raise _missing_base(b, ref)
    text = run_mod.output(["docker", "image", "inspect", "--format", "{{json .RootFS.Layers}}", st.parent_ref],
                          timeout=60, hint="is the Docker engine healthy? (imagebuild doctor)")
    layers = json.loads(text.splitlines()[-1])
    return list(layers) if isinstance(layers, list) else []


def _clamp_times(b: Build, st: plan_mod.PlannedStage, manifest: str, log_path: Path, progress: Progress,
                 head: str) -> str:
    """The stage's own layers with no file time later than its SOURCE_DATE_EPOCH (layerclamp.py):
    the same key gives the same bytes. Returns the stage's manifest after it."""
    progress.start(st.name, str(log_path), label="clamping file times")
    try:
        done = layerclamp.clamp_stage(b.store, manifest, _parent_diff_ids(b, st), st.source_date_epoch)
    finally:
        progress.stop()
    with open(log_path, "a", encoding="utf-8") as f:
        f.write(f"imagebuild: {done.summary()}: {manifest} -> {done.manifest}\n")
    progress.info("%s: %s", head, done.summary())
    return done.manifest


def _read_patch_record(b: Build, st: plan_mod.PlannedStage, manifest: str, tmp: Path,
                       progress: Progress) -> dict | None:
    """``/opt/imagebuild/patches.json`` of a built stage, copied out by a one-line BuildKit build."""
    d = tmp / "patch-record"
    (d / "ctx").mkdir(parents=True)
    df = d / "Dockerfile"
    df.write_text(f"FROM {RECORD_SOURCE_CONTEXT} AS stage\nFROM scratch\nCOPY --from=stage {PATCH_RECORD} /\n")
    argv = buildx_argv(context=d / "ctx", dockerfile=df, build_args={}, contexts={
        RECORD_SOURCE_CONTEXT: b.store.context(manifest)}, labels={}, network="none", platform=b.plan.platform,
        no_cache=False, output=f"type=local,dest={d / 'out'}", tag=None, metadata=None,
        name=f"{b.defn.name}/{st.name} (patch record)")
    quiet = Progress("quiet")
    quiet.every = 0
    try:
        _buildx(argv, log_path=d / "log", progress=quiet, label=st.name, epoch=st.source_date_epoch)
        return json.loads((d / "out" / "patches.json").read_text(encoding="utf-8"))
    except (_StageFailed, OSError, ValueError):
        return None


def _provenance(b: Build) -> tuple[dict, dict]:
    """(labels, build.json) of the release image: deterministic for the same inputs."""
    keys = {s.name: s.key for s in b.plan.stages}
    prov = b.plan.provenance
    sources = {n: s.get("commit") for n, s in sorted(((b.lock or {}).get("sources") or {}).items())
               if isinstance(s, dict) and s.get("commit")}
    labels = {
        "org.opencontainers.image.created": _iso(b.epoch),
        "org.opencontainers.image.version": promote_mod.build_tag(b.plan.build_id),
        "org.opencontainers.image.title": b.defn.name,
        f"{LABEL_PREFIX}.image": b.defn.name,
        f"{LABEL_PREFIX}.build-id": b.plan.build_id,
        f"{LABEL_PREFIX}.stage-keys": json.dumps(keys, sort_keys=True, separators=(",", ":")),
        f"{LABEL_PREFIX}.sources": json.dumps(sources, sort_keys=True, separators=(",", ":")),
        f"{LABEL_PREFIX}.platform": b.plan.platform,
    }
    trees = {n: s["source_tree"] for n, s in sorted(((b.lock or {}).get("sources") or {}).items())
             if isinstance(s, dict) and s.get("source_tree")}
    if trees:  # the git tree of each composed source: the files, whoever merged them (docs/prefetch.md)
        labels[f"{LABEL_PREFIX}.source-trees"] = json.dumps(trees, sort_keys=True, separators=(",", ":"))
    if b.defn.description:
        labels["org.opencontainers.image.description"] = b.defn.description
    if prov is not None:
        labels[f"{LABEL_PREFIX}.definition-sha256"] = prov.definition_sha256
        if prov.revision:
            labels["org.opencontainers.image.revision"] = prov.revision
        if prov.source_url:
            labels["org.opencontainers.image.source"] = prov.source_url
    if b.plan.lock_sha256:
        labels[f"{LABEL_PREFIX}.lock-sha256"] = b.plan.lock_sha256
    doc = {"schema": "imagebuild.image", "version": 2, "image": b.defn.name, "build_id": b.plan.build_id,
           "platform": b.plan.platform, "source_date_epoch": b.epoch,
           "provenance": prov.as_dict() if prov else None,
           # build --set: the values no versions.env holds, as the plan gave them to the stages
           "overrides": dict(sorted({a.name: a.value for st in b.plan.stages for a in st.args
                                     if a.origin == plan_mod.ORIGIN_SET}.items())),
           # the build args that reached each stage (versions.env's, the plan's; never the host's MAX_JOBS):
           # `imagebuild diff` names a changed versions.env value from them
           "stages": [{"name": s.name, "key": s.key, "image": s.image, "args": _recorded_args(s)} for s in b.plan.stages],
           "sources": _source_provenance(b), "lock_sha256": b.plan.lock_sha256, "patches": _merged_patches(b)}
    return labels, doc


def _recorded_args(st: plan_mod.PlannedStage) -> dict[str, str]:
    """The build args of a stage as its record keeps them: what its key holds (versions.env's, the
    plan's, a one-run --set), without the parallelism knobs a build sets from the host unless pinned."""
    return {a.name: a.value for a in st.args if a.origin != "buildkit"
            and (a.name not in guards.PARALLEL_KNOBS or a.origin == "versions.env")}


def _source_provenance(b: Build) -> dict:
    """Each locked source's commit; a composed commit (base + PRs, made by prefetch) is marked
    local-only, with how to recreate it from the lock."""
    out = {}
    for n, s in sorted(((b.lock or {}).get("sources") or {}).items()):
        if not isinstance(s, dict) or not s.get("commit"):
            continue
        prs = plan_mod.pr_pins(s.get("prs"))
        entry = {"commit": s.get("commit"), "version": s.get("version"), "repo": s.get("repo"), "ref": s.get("ref"),
                 "prs": prs,
                 "tree": s.get("tree"), "source_tree": s.get("source_tree"), "tree_pin": s.get("tree_pin"),
                 "tarball_sha256": s.get("sha256")}
        if prs:
            entry["local_only"] = True
            entry["recreate"] = (f"imagebuild prefetch {b.defn.name} (--offline from its mirror cache): "
                                 f"{s.get('ref')} with PR heads {', '.join(prs)} merged in that order, with a fixed "
                                 "identity and date (docs/prefetch.md); the result's tree must equal 'source_tree'")
        else:
            entry["local_only"] = False
        out[n] = entry
    return out


def release_tar(files: dict[str, bytes], epoch: int, extra: dict[str, bytes] | None = None) -> bytes:
    """``/opt/imagebuild/<name>`` for each of ``files``, and each absolute path of ``extra``, as a tar
    whose bytes depend on nothing else: sorted entries, owner root, mode 0755/0644, every mtime
    ``epoch``; the folders above each file come first."""
    import io
    import tarfile
    from pathlib import PurePosixPath

    members = {f"{IMAGE_META_DIR.lstrip('/')}/{n}": data for n, data in files.items()}
    members.update({p.lstrip("/"): data for p, data in (extra or {}).items()})
    dirs = sorted({str(q) for m in members for q in PurePosixPath(m).parents if str(q) != "."},
                  key=lambda x: x.split("/"))
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for d in dirs:
            ti = tarfile.TarInfo(d)
            ti.type, ti.mode, ti.mtime = tarfile.DIRTYPE, 0o755, epoch
            tf.addfile(ti)
        for name in sorted(members, key=lambda x: x.split("/")):
            ti = tarfile.TarInfo(name)
            ti.size, ti.mode, ti.mtime = len(members[name]), 0o644, epoch
            tf.addfile(ti, io.BytesIO(members[name]))
    return buf.getvalue()


def eugr_build_metadata(b: Build) -> bytes:
    """eugr's ``build-metadata.yaml`` (the fields its audit scripts read: build_date, vllm_version,
    vllm_commit, flashinfer_commit, gpu_arch, base image, build_args), from the lock and the plan:
    deterministic, like build.json. A field imagebuild cannot know is null (flashinfer comes from a
    PyPI wheel here, so it has a version, not a commit)."""
    import yaml

    lock = b.lock or {}
    sources = lock.get("sources") or {}
    vllm = sources.get("VLLM") if isinstance(sources.get("VLLM"), dict) else {}
    wheels = {}
    for entry in (lock.get("wheels") or {}).values():
        for w in (entry or {}).get("files") or [] if isinstance(entry, dict) else []:
            if isinstance(w, dict) and w.get("name") and w.get("version"):
                wheels[str(w["name"]).lower().replace("_", "-")] = str(w["version"])
    images = lock.get("images") or {}
    root = next((v for v in images.values() if isinstance(v, dict)), {}) if isinstance(images, dict) else {}
    build_args = {f"{k}_version": wheels[d] for k, d in (("torch", "torch"), ("torchvision", "torchvision"),
                                                         ("flashinfer", "flashinfer-python"),
                                                         ("cutlass_dsl", "nvidia-cutlass-dsl")) if d in wheels}
    for n, s in sorted(sources.items()):
        if isinstance(s, dict) and n != "VLLM" and not s.get("dependency_of"):
            build_args[f"{n.lower()}_repo"] = s.get("repo")
            build_args[f"{n.lower()}_ref"] = s.get("ref")
            build_args[f"{n.lower()}_commit"] = s.get("commit")
    doc = {
        "build_date": _iso(b.epoch),
        "build_script_commit": b.plan.provenance.revision if b.plan.provenance else None,
        "imagebuild_build_id": b.plan.build_id,
        "vllm_version": vllm.get("version"),
        "vllm_commit": vllm.get("commit"),
        "vllm_repo": vllm.get("repo"),
        "flashinfer_commit": None,
        "flashinfer_version": wheels.get("flashinfer-python"),
        "gpu_arch": b.defn.env.get("TORCH_CUDA_ARCH_LIST"),
        "base_image": root.get("ref") or root.get("image") if isinstance(root, dict) else None,
        "build_args": build_args,
    }
    return yaml.safe_dump(doc, sort_keys=False, default_flow_style=False).encode()


FINAL_MANIFEST_LABEL = f"{LABEL_PREFIX}.final-stage-manifest"


def release_ref(image: str, build_id: str) -> str:
    return f"imagebuild/{image}:release-{build_id}"


def _extends(image: dict, stage_diff_ids: list[str]) -> bool:
    """Whether the engine image ``image`` (``docker image inspect``) holds the layers ``stage_diff_ids``,
    in order, below its own (a release adds one layer to its final stage)."""
    layers = list(((image.get("RootFS") or {}).get("Layers")) or [])
    return bool(stage_diff_ids) and layers[:len(stage_diff_ids)] == stage_diff_ids and \
        len(layers) > len(stage_diff_ids)


def _release(b: Build, tmp: Path, progress: Progress, started: str) -> dict:
    final = b.plan.stages[-1]
    labels, doc = _provenance(b)
    lock_bytes = lock_mod.lock_path(b.defn.dir).read_bytes() if b.lock is not None else None
    ref = release_ref(b.defn.name, b.plan.build_id)
    final_run = b.stages[-1]
    rebuild = b.opts.no_cache and final_run.action == "build"
    # the release records the final stage's manifest it was made from; one made from another (a
    # poisoned stage store, another store, an older build) is never reused by its tag name alone
    final_manifest = b.manifest(final.name)
    labels[FINAL_MANIFEST_LABEL] = final_manifest
    have = engine_mod.existing_tags(ref.split(":", 1)[0])
    if ref in have and not rebuild:
        found = _inspect(ref)
        made_from = ((found.get("Config") or {}).get("Labels") or {}).get(FINAL_MANIFEST_LABEL)
        if made_from != final_manifest:
            log.warning("warning: release: %s was made from another final stage (%s, this build's is %s): "
                        "made again", ref, (made_from or "not recorded")[:19], final_manifest[:19])
            rebuild = True
        elif not _extends(found, b.store.diff_ids(final_manifest)):
            # a label is only a claim: an image made elsewhere can carry the right one
            log.warning("warning: release: %s says it was made from the final stage %s, but its layers do not "
                        "extend that stage's: made again", ref, final_manifest[:19])
            rebuild = True
    if ref in have and not rebuild:
        progress.info("release: %s exists (made from the final stage %s)", ref, final_manifest[:19])
        built = False
    else:
        files = {"build.json": (json.dumps(doc, indent=2, sort_keys=True) + "\n").encode()}
        if lock_bytes is not None:
            files["lock.json"] = lock_bytes
        extra = {b.defn.build_metadata: eugr_build_metadata(b)} if b.defn.build_metadata else None
        data = release_tar(files, b.epoch, extra)
        ctx = tmp / context_dir_name("context", sha256_bytes(data))
        ctx.mkdir(parents=True)
        (ctx / RELEASE_TAR).write_bytes(data)
        _fix_mtimes(ctx, b.epoch)
        df = tmp / "Dockerfile.release"
        df.write_text(RELEASE_DOCKERFILE)
        log_path = b.dir / "logs" / "release.log"
        argv = buildx_argv(context=ctx, dockerfile=df, build_args={"PARENT": plan_mod.PARENT_CONTEXT,
                                                                   "SOURCE_DATE_EPOCH": str(b.epoch)},
                           contexts={plan_mod.PARENT_CONTEXT: b.store.context(b.manifest(final.name))},
                           labels=labels, network="none", platform=b.plan.platform, no_cache=rebuild,
                           output=None, tag=ref, metadata=None, name=f"{b.defn.name}/release")
        progress.info("release: loading %s into the engine", ref)
        try:
            _buildx(argv, log_path=log_path, progress=progress, label="release", epoch=b.epoch)
        except _StageFailed as exc:
            progress.finish("release", "failed")
            _record(b, "failed", started, failed_stage="release", release=None, promotion=None)
            raise OperationFailed(_failure(f"the release step of {b.defn.name}", log_path, exc.code),
                                  hint=f"full log: {log_path}; :local and :candidate were not touched") from None
        built = True
    from imagebuild.core import identity as identity_mod

    data = _inspect(ref)
    wanted = [promote_mod.ref(b.defn.name, promote_mod.build_tag(b.plan.build_id)),
              promote_mod.ref(b.defn.name, promote_mod.CANDIDATE)]
    have = {t.removeprefix("docker.io/library/") for t in data.get("RepoTags") or []}
    for t in wanted:
        if t not in have:  # one inspect on a no-op build, not one per tag
            promote_mod.tag(data.get("Id") or ref, t)
    ident = identity_mod.from_inspect(data)
    progress.info("candidate: %s (identity %s)", ", ".join(wanted), ident.digest)
    return {"ref": ref, "built": built, "tags": wanted, "image_id": ident.local_id,
            "identity": ident.digest, "labels": labels}


def _gate_and_promote(b: Build, release: dict, started: str) -> dict:
    name = b.defn.name
    if not b.opts.gate:
        return {"status": "skipped", "reason": "--no-gate: stopped at :candidate"}
    if not promote_mod.gate_available():
        log.info("gate not installed: stopped at %s:candidate (:local unchanged)", name)
        return {"status": "skipped", "reason": "the gate is not installed (imagebuild.gate): stopped at :candidate"}
    if b.defn.gate is None:
        log.info("%s has no gate spec: stopped at %s:candidate (:local unchanged)", name, name)
        return {"status": "skipped", "reason": "the definition has no gate spec: stopped at :candidate"}
    from imagebuild.definition import gatespec
    from imagebuild.gate import receipts

    spec_digest = gatespec.digest(b.defn.gate)
    cand = promote_mod.ref(name, promote_mod.CANDIDATE)
    gated = False
    try:
        if receipts.find_passing(b.ctx, release["identity"], spec_digest, spec=b.defn.gate):
            log.info("gate: identity %s already passed this gate spec (%s): not gating again",
                     release["identity"], spec_digest[:19])
        else:
            from imagebuild.gate import runner as gate_mod  # imports pytest: only when a gate runs

            gate_mod.run_gate(b.ctx.root, name, release["image_id"] or cand)
            gated = True
    except GateFailed as exc:
        exc.record = _record(b, "gate-failed", started, release=release,  # build --json prints it (exit 4)
                             promotion={"status": "gate-failed", "reason": exc.message})
        raise
    if b.opts.overrides and not b.opts.promote_set:  # an experiment: gated, never :local unless asked
        sets = " ".join(f"--set {k}=..." for k in sorted(b.opts.overrides))
        log.info("%s: built with %s: stopped at %s:candidate (:local unchanged; --promote-set promotes it)",
                 name, sets, name)
        return {"status": "skipped", "gated": gated, "reason": f"built with {sets} (a one-run override): never "
                "promoted to :local without --promote-set; stopped at :candidate"}
    p = promote_mod.promote(b.ctx, name, release["image_id"] or cand, spec_digest=spec_digest)
    return {"status": "promoted" if p.moved else "unchanged", "gated": gated, **p.as_dict()}


def dry_run(ctx: context_mod.Context | Path, image: str, opts: Options) -> dict:
    """What ``build`` would do, with every docker command it would run (nothing is built)."""
    guards.min_free_gib()
    _check_folders(context_mod.of(ctx), create=False)  # what the build would refuse, the dry run refuses too
    b = prepare(context_mod.of(ctx), image, opts)
    registry_cache.attach(b)
    _check_inputs(b)
    _guards(b, lock=None)
    for w in b.warnings:
        log.warning("warning: %s", w)
    jobs = guards.host_jobs(opts.jobs)
    stages = []
    tmp = tmp_root(b.ctx) / "<run>"
    for r in b.stages:
        st = b.plan.stage(r.name)
        d = r.as_dict()
        d["args"] = {**st.build_args(), "SOURCE_DATE_EPOCH": str(st.source_date_epoch),
                     **_parallel_args(st, jobs, opts.jobs is not None)}
        d["sources"] = [m.name for m in st.mounts]
        if r.action == "build":
            named = {NAMED_SRC: str(tmp / r.name / context_dir_name(NAMED_SRC, st.key)), NAMED_WHEELS: str(tmp / "empty"),
                     NAMED_APT: str(tmp / "empty")}
            cache_id = compilecache.cache_id_of((b.root / st.dockerfile).read_text(errors="replace"))
            if cache_id:
                named[compilecache.NAMED_CCACHE] = str(compilecache.host_dir(cache_id))
            d["command"] = _stage_argv(b, st, ctx=tmp / r.name / context_dir_name("context", st.key), named=named,
                                       meta=tmp / r.name / "metadata.json", jobs=jobs, dry=True)
        else:
            d["command"] = None
        stages.append({k: d[k] for k in ("name", "key", "image", "action", "reason", "network", "args",
                                         "sources", "command")})
    return {"schema": DRY_RUN_SCHEMA, "version": 2, "image": b.defn.name, "platform": b.plan.platform,
            "build_id": b.plan.build_id, "source_date_epoch": b.epoch, "warnings": b.warnings,
            "stage_store": str(b.store.dir),
            "release": b.last == len(b.stages) - 1, "stages": stages}


# --------------------------------------------------------------------------------------------- patch command


def patch_set(defn: defn_mod.Definition, stage: str | None = None) -> list[Path]:
    stages = [s for s in defn.stages if stage is None or s.name == stage]
    if stage is not None and not stages:
        raise UsageError(f"--stage {stage!r}: no such stage in {defn.name}",
                         hint=f"stages: {', '.join(s.name for s in defn.stages)}")
    return [i.path for s in stages for i in s.inputs if i.kind == "patch"]


def patch(ctx: context_mod.Context | Path, image: str, src: Path, *, check: bool, stage: str | None = None) -> dict:
    """Apply (or with ``check`` only check) an image's patch set to a checkout ``src``."""
    defn = defn_mod.load(context_mod.of(ctx).root, image)
    if not Path(src).is_dir():
        raise UsageError(f"--src {src}: not a folder", hint="a checkout of the source the patches apply to")
    paths = patch_set(defn, stage)
    if not paths:
        raise DefinitionError([Problem(defn.rel(defn.dir / defn_mod.IMAGE_FILE),
                                       "no stage declares patches" + (f" ({stage})" if stage else ""),
                                       key="patches")], image=image)
    results = patchcheck.check(paths, Path(src)) if check else patching.apply_all(paths, Path(src), write=True)
    doc = {"schema": patching.RECORD_SCHEMA, "version": patching.RECORD_VERSION, "image": image,
           "check": check, "patches": [r.as_dict() for r in results]}
    failed = [r for r in results if r.outcome == patching.FAILED]
    if failed:
        raise PatchFailed(doc, failed[0].message if len(failed) == 1 else
                          f"{len(failed)} patches failed: {', '.join(r.patch for r in failed)} (each one's reason above)")
    return doc


class PatchFailed(OperationFailed):
    def __init__(self, doc: dict, message: str):
        super().__init__(message, hint="fix the patch's anchor for this upstream, then re-run with --check")
        self.doc = doc


# ---------------------------------------------------------------------------------------------
# the registry stage cache (registry_cache.py) and the release tags (registry_release.py), seen from a build


def _pull_stage(b, r, st, tmp: Path, progress, head: str) -> bool:
    """Pull stage ``r`` into the store (verified, then its ref committed); False: build it instead."""
    found = b.found[r.name]
    progress.info("%s: pulling from the registry cache %s (key %s, manifest %s)", head, b.cache.reg, r.key[:19],
                  found.digest[:19])
    t0 = time.monotonic()
    manifest = b.cache.pull(found)
    if manifest is None:
        return False
    patches = None
    if any(inp.kind == "patch" for inp in st.inputs):
        tmp.mkdir(parents=True, exist_ok=True)
        patches = _read_patch_record(b, st, manifest, tmp, progress) or {
            "schema": patching.RECORD_SCHEMA, "version": patching.RECORD_VERSION,
            "patches": {}, "note": f"no {PATCH_RECORD} in the stage"}
    b.store.commit(r.key, r.name, manifest, patches=patches)
    r.manifest, r.patches, r.status = manifest, patches, "pulled"
    r.seconds = round(time.monotonic() - t0, 3)
    progress.info("%s: pulled in %.1f s -> %s", head, r.seconds, st.image)
    return True


def _publish_release(b, release: dict, promotion: dict, started: str) -> dict | None:
    """After the gate: the release tags in the registry (registry_release.publish), only when the gate
    passed (``:local`` moved here, or already held this image). The record's ``publish``."""
    from imagebuild.buildstep import registry_release
    from imagebuild.core.errors import GuardRefused

    if b.cache is None:
        return None
    if promotion.get("status") not in ("promoted", "unchanged"):
        return {"status": "skipped", "reason": f"the gate did not pass here ({promotion.get('status')}): "
                "nothing is tagged in the registry"}
    if b.cache.down:
        return {"status": "skipped", "reason": f"the registry was dropped: {b.cache.down}"}
    try:
        doc = registry_release.publish(b.cache.reg, b.defn.name, release, b.plan.build_id)
    except registry_mod.RegistryError as exc:
        # the build, its gate and its promotion here stand: a registry that fails now (stopped, a 500, a
        # cut connection) is a warning, the record says the publish failed, the exit is 0
        b.cache.drop(f"registry {b.cache.reg} failed while publishing the release: {exc.message}")
        return {"status": "failed", "reason": exc.message}
    except GuardRefused as exc:
        _record(b, "failed", started, failed_stage="publish", release=release, promotion=promotion,
                publish={"status": "refused", "reason": exc.message})
        raise
    return {"status": "published", **doc}
