"""plan -> staged BuildKit builds, offline, cached by key, with provenance and safe promotion.

``build(root, image, options)`` runs one image's plan (docs/build.md):

1. **Checks before anything runs**: definition + plan, the ``--from``/``--until`` range, every
   prefetched input the stages to build need (sha256 against the lock), then the guards
   (platform, build lock, serving containers, disk; ``guards.py``). A refusal here means docker
   never started.
2. **Stages in order.** A stage whose image (``imagebuild/<image>:<stage>-<key16>``, from the
   plan) exists is skipped; ``--no-cache`` rebuilds the requested range. Each stage is built by
   BuildKit through python-on-whales' ``docker.buildx.build``: ``FROM`` its parent via the
   ``PARENT`` build arg, ``--network none`` unless the stage declares ``network: true``, a build
   context holding exactly the stage's declared inputs (plus the patch primitive for stages with
   patches), and the prefetched inputs as named build contexts (``imagebuild-src``,
   ``imagebuild-wheels``, ``imagebuild-apt``; contracts §3) so they are bind-mounted, never
   copied into a layer. The log of each stage goes to
   ``.imagebuild/builds/<image>/<build-id>/logs/<stage>.log`` (streamed to stderr when it is a
   terminal, or with ``-v``); a failure names the stage and shows the log's tail and path.
3. **Release image**: the final stage plus provenance (OCI labels, build id, stage keys, the
   lock at ``/opt/imagebuild/lock.json``, ``/opt/imagebuild/build.json``), tagged
   ``<image>:b-<build id>`` and ``<image>:candidate`` (promote.py).
4. **Gate and promotion**: when the gate is installed and the definition has a gate spec, the
   candidate is gated and promoted to ``:local`` only on a passing receipt for exactly its
   identity. Otherwise the build stops at ``:candidate``.

Reproducibility: ``SOURCE_DATE_EPOCH`` comes from the lock (newest pinned source commit) or is
fixed at 315532800 (1980-01-01, the earliest time a zip/wheel can hold). Stage images are
exported without provenance attestations; the stages chosen by ``--reproducible`` (default: the
final stage) are exported as OCI with ``rewrite-timestamp=true`` and ``docker load``-ed, so
rebuilding such a stage with ``--no-cache`` gives the same image digest. The release step is
COPY-only from a context with fixed mtimes, so it is digest-stable without the OCI round trip.
"""

from __future__ import annotations

import datetime as _dt
import io
import json
import logging
import os
import shutil
import sys
import tarfile
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from . import definition as defn_mod
from . import engine as engine_mod
from . import guards, patching, source_mounts, state
from . import lock as lock_mod
from . import plan as plan_mod
from . import promote as promote_mod
from . import run as run_mod
from .errors import DefinitionError, GateFailed, OperationFailed, Problem, UsageError
from .fsutil import atomic_write_json, canonical_json, sha256_bytes, sha256_file

log = logging.getLogger("imagebuild")

RECORD_SCHEMA = "imagebuild.build"
RECORD_VERSION = 1
DRY_RUN_SCHEMA = "imagebuild.build-plan"
DEFAULT_SOURCE_DATE_EPOCH = 315532800  # 1980-01-01T00:00:00Z: zip (wheels) cannot hold older times
IMAGE_META_DIR = "/opt/imagebuild"
PATCH_RECORD = f"{IMAGE_META_DIR}/patches.json"
PRIMITIVE_NAME = plan_mod.PRIMITIVE_CONTEXT
NAMED_SRC, NAMED_WHEELS, NAMED_APT = "imagebuild-src", "imagebuild-wheels", "imagebuild-apt"
LOG_TAIL_LINES = 30
REPRODUCIBLE_CHOICES = ("final", "all", "none")
LABEL_PREFIX = "io.imagebuild"
RELEASE_DOCKERFILE = "ARG PARENT\nFROM ${PARENT}\nCOPY opt/ /opt/\n"


@dataclass(frozen=True)
class Options:
    from_stage: str | None = None
    until_stage: str | None = None
    no_cache: bool = False
    force: bool = False
    dry_run: bool = False
    jobs: int | None = None
    emulate: bool = False
    reproducible: str = "final"
    gate: bool = True  # run the gate (when installed and the definition has a spec)
    stream: bool | None = None  # None: stream when stderr is a terminal


@dataclass
class StageRun:
    name: str
    key: str
    image: str
    action: str  # build | skip (exists) | reuse (before --from) | not-requested (after --until)
    reason: str
    network: str
    reproducible: bool
    args: dict = field(default_factory=dict)
    contexts: dict = field(default_factory=dict)
    seconds: float | None = None
    log: str | None = None
    status: str = "pending"  # pending | built | skipped | failed
    image_id: str | None = None
    patches: dict | None = None

    def as_dict(self) -> dict:
        return {"name": self.name, "key": self.key, "image": self.image, "action": self.action,
                "reason": self.reason, "status": self.status, "network": self.network,
                "reproducible": self.reproducible, "args": self.args, "named_contexts": self.contexts,
                "seconds": self.seconds, "log": self.log, "image_id": self.image_id, "patches": self.patches}


# --------------------------------------------------------------------------------------------- helpers


def source_date_epoch(lock: dict | None) -> int:
    """Newest commit time among the pinned sources, else the fixed default."""
    times = [s.get("source_date_epoch") for s in ((lock or {}).get("sources") or {}).values()
             if isinstance(s, dict) and isinstance(s.get("source_date_epoch"), int)]
    return max(times) if times else DEFAULT_SOURCE_DATE_EPOCH


def _iso(epoch: int) -> str:
    return _dt.datetime.fromtimestamp(epoch, _dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _now() -> str:
    return _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def build_dir(root: Path, image: str, build_id: str) -> Path:
    return state.state_dir(root) / "builds" / image / build_id


def lock_file(root: Path, image: str) -> Path:
    return state.state_dir(root) / "locks" / f"{image}.lock"


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


def _source_closure(lock: dict, names: Iterable[str]) -> list[str]:
    """The sources a stage lists plus, recursively, the FetchContent deps recorded for them."""
    srcs = lock.get("sources") or {}
    out: list[str] = []
    todo = list(names)
    while todo:
        n = todo.pop(0)
        if n in out:
            continue
        out.append(n)
        todo += sorted(k for k, v in srcs.items() if isinstance(v, dict) and v.get("dependency_of") == n)
    return out


@dataclass(frozen=True)
class VerifiedFile:
    name: str  # file name in the named context
    path: Path


def verify_sources(root: Path, defn: defn_mod.Definition, lock: dict | None, stage_sources: tuple[str, ...],
                   stage: str) -> list[VerifiedFile]:
    """Check every tarball a stage mounts against the lock's sha256; raise before docker starts."""
    if not stage_sources:
        return []
    lock_disp = defn_mod.display_path(root, lock_mod.lock_path(defn.dir))
    if lock is None:
        raise OperationFailed(f"stage {stage!r} mounts git sources ({', '.join(stage_sources)}) but "
                              f"{lock_disp} does not exist", hint=f"imagebuild prefetch {defn.name}")
    out = []
    for name in _source_closure(lock, stage_sources):
        entry = (lock.get("sources") or {}).get(name)
        if not isinstance(entry, dict) or not entry.get("tarball") or not entry.get("sha256"):
            raise OperationFailed(f"{lock_disp}: sources.{name}: missing (or without tarball/sha256); "
                                  f"stage {stage!r} needs it", hint=f"imagebuild prefetch {defn.name}")
        rel = PurePosixPath(entry["tarball"])
        if rel.is_absolute() or ".." in rel.parts:
            raise OperationFailed(f"{lock_disp}: sources.{name}.tarball {entry['tarball']!r} must be a path "
                                  "inside the project", hint=f"imagebuild prefetch {defn.name}")
        path = root / rel
        if not path.is_file():
            raise OperationFailed(f"{entry['tarball']}: prefetched tarball of {name} not found (stage {stage!r})",
                                  hint=f"imagebuild prefetch {defn.name}")
        got = sha256_file(path)
        if got != entry["sha256"]:
            raise OperationFailed(
                f"{entry['tarball']}: sha256 {got} does not match the lock ({lock_disp}: sources.{name}.sha256 "
                f"= {entry['sha256']}); refusing to build stage {stage!r} from a changed tarball",
                hint=f"the file was modified or corrupted: re-create it with `imagebuild prefetch {defn.name}`")
        out.append(VerifiedFile(f"{name}.tar.gz", path))
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
            if isinstance(f, dict) and f.get("sha256"):
                name = f.get("file") or f.get("filename") or f.get("name") or f.get("path")
                if name:
                    out[PurePosixPath(str(name)).name] = f["sha256"]
        return out or None
    if isinstance(files, dict):
        out = {PurePosixPath(str(k)).name: (v.get("sha256") if isinstance(v, dict) else v)
               for k, v in files.items()}
        return {k: v for k, v in out.items() if isinstance(v, str) and len(v) == 64} or None
    return None


def verify_package_dir(root: Path, defn: defn_mod.Definition, lock: dict | None, kind: str,
                       stage: str) -> Path | None:
    """``deps-src/<image>/<kind>/<stage>/`` when it exists, its files checked against the lock."""
    d = state.deps_dir(root, defn.name) / kind / stage
    if not d.is_dir():
        return None
    want = _lock_files_for(lock, kind, stage)
    if want:
        for name, sha in sorted(want.items()):
            p = d / name
            if not p.is_file():
                raise OperationFailed(f"{defn_mod.display_path(root, p)}: listed in the lock ({kind}.{stage}) but "
                                      "missing", hint=f"imagebuild prefetch {defn.name}")
            got = sha256_file(p)
            if got != sha:
                raise OperationFailed(f"{defn_mod.display_path(root, p)}: sha256 {got} does not match the lock "
                                      f"({sha}); refusing to build stage {stage!r}",
                                      hint=f"re-create it with `imagebuild prefetch {defn.name}`")
    return d


def _fix_mtimes(top: Path, epoch: int) -> None:
    for dirpath, dirnames, filenames in os.walk(top):
        for n in filenames + dirnames:
            os.utime(Path(dirpath) / n, (epoch, epoch), follow_symlinks=False)
    os.utime(top, (epoch, epoch))


def make_context(root: Path, stage: plan_mod.PlannedStage, dest: Path, epoch: int) -> None:
    """A folder holding exactly the stage's declared inputs (and the patch primitive)."""
    dest.mkdir(parents=True, exist_ok=True)
    for inp in stage.inputs:
        if inp.kind == "primitive":
            continue  # copied from the installed package below
        src = root / inp.path
        target = dest / inp.context_path
        target.parent.mkdir(parents=True, exist_ok=True)
        if src.is_dir():
            shutil.copytree(src, target, symlinks=True, dirs_exist_ok=True)
        else:
            shutil.copy2(src, target)
    if any(i.kind == "primitive" for i in stage.inputs):
        (dest / PRIMITIVE_NAME).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(patching.__file__, dest / PRIMITIVE_NAME)
    _fix_mtimes(dest, epoch)


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
            pinned = a.origin == "versions.env"
            if not pinned or (explicit_jobs and a.name != "NVCC_THREADS"):
                out[a.name] = values[a.name]
    return out


def _git_revision(root: Path, defn: defn_mod.Definition) -> str | None:
    """The last commit that touched the definition (its folder or the shared patch set): stable
    across commits that do not change the image, so they do not change its digest."""
    if not (root / ".git").exists() or run_mod.which("git") is None:
        return None
    paths = [defn_mod.display_path(root, defn.dir), defn_mod.SHARED_PATCHES_DIR]
    proc = run_mod.run(["git", "-C", str(root), "log", "-1", "--format=%H", "--", *paths], check=False, timeout=10)
    rev = proc.stdout.decode().strip()
    return rev if proc.returncode == 0 and len(rev) == 40 else None


def _git_source_url(root: Path) -> str | None:
    if not (root / ".git").exists() or run_mod.which("git") is None:
        return None
    proc = run_mod.run(["git", "-C", str(root), "remote", "get-url", "origin"], check=False, timeout=10)
    url = proc.stdout.decode().strip()
    if proc.returncode != 0 or not url:
        return None
    # never put credentials (https://user:token@host/...) into a label
    if "://" in url and "@" in url.split("://", 1)[1].split("/", 1)[0]:
        scheme, rest = url.split("://", 1)
        url = f"{scheme}://{rest.split('@', 1)[1]}"
    return url


# --------------------------------------------------------------------------------------------- docker


def _docker():
    # imported lazily: python-on-whales' import costs ~0.3 s, and a no-op build never needs it
    from python_on_whales import docker

    return docker


def _buildx(*, context: Path, dockerfile: Path, tag: str, build_args: dict, contexts: dict, labels: dict,
            network: str | None, platform: str, no_cache: bool, oci_dest: Path | None, log_path: Path,
            stream: bool) -> None:
    """One BuildKit build through python-on-whales, its output streamed to the log file."""
    from python_on_whales.exceptions import DockerException

    kw = dict(context_path=str(context), file=str(dockerfile), tags=[tag], build_args=build_args,
              build_contexts=contexts, labels=labels, network=network, platforms=[platform],
              cache=not no_cache, progress="plain", provenance=False, sbom=False, stream_logs=True)
    if oci_dest is not None:
        kw["output"] = {"type": "oci", "dest": str(oci_dest), "rewrite-timestamp": "true"}
    else:
        kw["load"] = True
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w", encoding="utf-8") as logf:
        try:
            for line in _docker().buildx.build(**kw):
                logf.write(line)
                logf.flush()
                if stream:
                    sys.stderr.write(line)
                    sys.stderr.flush()
        except DockerException as exc:
            logf.write(f"\nimagebuild: docker buildx build exited {exc.return_code}\n")
            raise _StageFailed(exc.return_code) from None
    if oci_dest is not None:
        run_mod.run(["docker", "load", "-i", str(oci_dest)], timeout=3600,
                    hint="the OCI export of the stage could not be loaded into the engine")


class _StageFailed(Exception):
    def __init__(self, code: int):
        self.code = code


def _inspect(ref: str) -> dict:
    text = run_mod.output(["docker", "image", "inspect", "--format", "{{json .}}", ref], timeout=60,
                          hint="is the Docker engine healthy? (imagebuild doctor)")
    return json.loads(text.splitlines()[-1])


def _tail(path: Path, n: int = LOG_TAIL_LINES) -> str:
    try:
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join(lines[-n:])


def read_patch_record(image_ref: str) -> dict | None:
    """``/opt/imagebuild/patches.json`` from an image (None when it has none)."""
    proc = run_mod.run(["docker", "create", "--network", "none", image_ref, "true"], check=False, timeout=60)
    cid = proc.stdout.decode().strip().splitlines()[-1] if proc.returncode == 0 else None
    if not cid:
        return None
    try:
        cp = run_mod.run(["docker", "cp", f"{cid}:{PATCH_RECORD}", "-"], check=False, timeout=60)
        if cp.returncode != 0:
            return None
        with tarfile.open(fileobj=io.BytesIO(cp.stdout)) as tf:
            member = tf.getmembers()[0]
            f = tf.extractfile(member)
            return json.loads(f.read().decode()) if f else None
    except (ValueError, IndexError, tarfile.TarError):
        return None
    finally:
        run_mod.run(["docker", "rm", "-f", cid], check=False, timeout=60)


# --------------------------------------------------------------------------------------------- the build


@dataclass
class Build:
    root: Path
    defn: defn_mod.Definition
    plan: plan_mod.Plan
    opts: Options
    lock: dict | None
    epoch: int
    stages: list[StageRun]
    first: int
    last: int
    tags: set | None = None  # the engine's imagebuild/<image>:* tags when the build started
    warnings: list[str] = field(default_factory=list)
    record: dict = field(default_factory=dict)

    @property
    def dir(self) -> Path:
        return build_dir(self.root, self.defn.name, self.plan.build_id)


def prepare(root: Path, image: str, opts: Options) -> Build:
    """Everything that can be checked without starting docker builds (guards excepted)."""
    if opts.reproducible not in REPRODUCIBLE_CHOICES:
        raise UsageError(f"--reproducible {opts.reproducible!r}: expected one of {', '.join(REPRODUCIBLE_CHOICES)}")
    if opts.jobs is not None and opts.jobs < 1:
        raise UsageError(f"--jobs {opts.jobs}: expected a positive number")
    defn = defn_mod.load(root, image)
    lock = lock_mod.read(defn.dir, defn_mod.display_path(root, lock_mod.lock_path(defn.dir)))
    info = engine_mod.probe()
    if not info.reachable and not opts.dry_run:
        raise OperationFailed(f"no Docker engine reachable: {info.detail}",
                              hint="start dockerd (scripts/testbed.sh) and check with `imagebuild doctor`")
    tags = engine_mod.existing_tags(f"imagebuild/{defn.name}") if info.reachable else None
    plan = plan_mod.make_plan(defn, exists=(lambda r: r in tags) if tags is not None else None,
                              engine=info.as_dict())
    if plan.unpinned and lock is None:
        log.info("note: %d unpinned item(s) (imagebuild prefetch pins them)", len(plan.unpinned))
    first, last = _select(plan, opts)
    epoch = source_date_epoch(lock)
    n = len(plan.stages)
    runs: list[StageRun] = []
    for i, s in enumerate(plan.stages):
        repro = opts.reproducible == "all" or (opts.reproducible == "final" and i == n - 1)
        if i < first:
            action, reason = "reuse", f"before --from {opts.from_stage}"
            if s.exists is False:
                raise UsageError(f"--from {opts.from_stage}: the earlier stage {s.name!r} has no image "
                                 f"({s.image})", hint=f"build it first: imagebuild build {image} --until {s.name}")
        elif i > last:
            action, reason = "not-requested", f"after --until {opts.until_stage}"
        elif opts.no_cache:
            action, reason = "build", "--no-cache"
        elif s.exists:
            action, reason = "skip", "image with this key exists"
        else:
            action, reason = "build", "no image with this key" if s.exists is False else "engine unknown"
        runs.append(StageRun(s.name, s.key, s.image, action, reason, "default" if s.network else "none", repro))
    return Build(root, defn, plan, opts, lock, epoch, runs, first, last, tags)


def _check_inputs(b: Build) -> dict[str, dict[str, Path]]:
    """Verify every prefetched input of the stages to build; returns the named-context sources."""
    out = {}
    for r in b.stages:
        if r.action != "build":
            continue
        st = b.plan.stage(r.name)
        out[r.name] = {
            "src": verify_sources(b.root, b.defn, b.lock, st.sources, st.name),
            "wheels": verify_package_dir(b.root, b.defn, b.lock, "wheels", st.name),
            "apt": verify_package_dir(b.root, b.defn, b.lock, "apt", st.name),
        }
    return out


def _guards(b: Build, *, lock: guards.BuildLock | None) -> None:
    info = (b.plan.engine or {})
    warn = guards.check_platform(b.plan.platform, emulate=b.opts.emulate, engine_arch=info.get("architecture"))
    if warn:
        b.warnings.append(warn)
    if lock is not None:
        lock.acquire(command="imagebuild build " + b.defn.name)
    if not info.get("reachable"):
        return
    warn = guards.check_serving(force=b.opts.force)
    if warn:
        b.warnings.append(warn)
    paths = [state.state_dir(b.root)]
    if info.get("root_dir") and Path(info["root_dir"]).exists():
        paths.append(Path(info["root_dir"]))
    if any(r.action == "build" for r in b.stages):
        warn = guards.check_disk(paths, force=b.opts.force)
        if warn:
            b.warnings.append(warn)


def dry_run(root: Path, image: str, opts: Options) -> dict:
    b = prepare(root, image, opts)
    _check_inputs(b)
    _guards(b, lock=None)
    for w in b.warnings:
        log.warning("warning: %s", w)
    jobs = guards.host_jobs(opts.jobs)
    stages = []
    for r in b.stages:
        st = b.plan.stage(r.name)
        d = r.as_dict()
        d["args"] = {**st.build_args(), "SOURCE_DATE_EPOCH": str(b.epoch),
                     **_parallel_args(st, jobs, opts.jobs is not None)}
        d["sources"] = list(st.sources)
        stages.append({k: d[k] for k in ("name", "key", "image", "action", "reason", "network", "reproducible",
                                         "args", "sources")})
    return {"schema": DRY_RUN_SCHEMA, "version": 1, "image": b.defn.name, "platform": b.plan.platform,
            "build_id": b.plan.build_id, "source_date_epoch": b.epoch, "warnings": b.warnings,
            "release": b.last == len(b.stages) - 1, "stages": stages}


def build(root: Path, image: str, opts: Options) -> dict:
    """Run the build; returns the build record (also written under the state folder)."""
    root = Path(root).resolve()
    b = prepare(root, image, opts)
    named = _check_inputs(b)  # before the lock and before docker: a tampered input stops here
    blk = guards.BuildLock(lock_file(root, b.defn.name), b.defn.name)
    try:
        _guards(b, lock=blk)
        for w in b.warnings:
            log.warning("warning: %s", w)
        return _run(b, named)
    finally:
        blk.release()


def _record(b: Build, status: str, started: str, **extra) -> dict:
    rec = {
        "schema": RECORD_SCHEMA, "version": RECORD_VERSION, "image": b.defn.name, "build_id": b.plan.build_id,
        "build_id_from": b.plan.build_id_from, "platform": b.plan.platform, "status": status,
        "started": started, "finished": _now(),  # a record of a run: it holds times, explicitly
        "source_date_epoch": b.epoch,
        "options": {"from": b.opts.from_stage, "until": b.opts.until_stage, "no_cache": b.opts.no_cache,
                    "force": b.opts.force, "jobs": b.opts.jobs, "emulate": b.opts.emulate,
                    "reproducible": b.opts.reproducible},
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


def _previous_record(b: Build) -> dict:
    try:
        return json.loads((b.dir / "record.json").read_text())
    except (OSError, ValueError):
        return {}


def _run(b: Build, named: dict) -> dict:
    started = _now()
    stream = b.opts.stream if b.opts.stream is not None else (sys.stderr.isatty() or log.isEnabledFor(logging.DEBUG))
    jobs = guards.host_jobs(b.opts.jobs)
    prev = {s["name"]: s for s in _previous_record(b).get("stages", []) if isinstance(s, dict)}
    total = len(b.stages)
    tmp_root = state.state_dir(b.root) / "tmp"
    tmp_root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="build-", dir=tmp_root) as tmp_s:
        tmp = Path(tmp_s)
        empty = tmp / "empty"
        empty.mkdir()
        for i, r in enumerate(b.stages, start=1):
            st = b.plan.stage(r.name)
            head = f"[{i}/{total}] {r.name}"
            if r.action != "build":
                r.status = "skipped"
                log.info("%s: %s (%s) %s", head, r.action, r.reason, r.image)
            else:
                _build_stage(b, r, st, named[r.name], tmp / r.name, empty, jobs, stream, head, started)
            if any(inp.kind == "patch" for inp in st.inputs) and r.action != "not-requested":
                old = prev.get(r.name) or {}
                if r.status == "skipped" and old.get("key") == r.key and old.get("patches") is not None:
                    r.patches = old["patches"]
                else:
                    r.patches = read_patch_record(r.image) or {"schema": patching.RECORD_SCHEMA,
                                                               "version": patching.RECORD_VERSION, "patches": {},
                                                               "note": f"no {PATCH_RECORD} in the image"}
        if b.last != total - 1:
            rec = _record(b, "ok", started, release=None, promotion=None)
            log.info("stopped after stage %s (--until): no release image", b.opts.until_stage)
            return rec
        release = _release(b, tmp / "release", stream, started)
    promotion = _gate_and_promote(b, release, started)
    return _record(b, "ok", started, release=release, promotion=promotion)


def _build_stage(b: Build, r: StageRun, st: plan_mod.PlannedStage, inputs: dict, tmp: Path, empty: Path,
                 jobs: guards.Jobs, stream: bool, head: str, started: str) -> None:
    ctx = tmp / "context"
    make_context(b.root, st, ctx, b.epoch)
    src_dir = tmp / NAMED_SRC
    src_dir.mkdir()
    for vf in inputs["src"]:
        _link_or_copy(vf.path, src_dir / vf.name)
    # the generated unpack script + manifest (extract every source, set every override; source_mounts.py)
    for fname, data in source_mounts.source_mounts(b.lock, st.name, st.sources).files().items():
        (src_dir / fname).write_bytes(data)
    contexts = {NAMED_SRC: str(src_dir), NAMED_WHEELS: str(inputs["wheels"] or empty),
                NAMED_APT: str(inputs["apt"] or empty)}
    args = {**st.build_args(), "SOURCE_DATE_EPOCH": str(b.epoch), **_parallel_args(st, jobs, b.opts.jobs is not None)}
    labels = {f"{LABEL_PREFIX}.image": b.defn.name, f"{LABEL_PREFIX}.stage": st.name,
              f"{LABEL_PREFIX}.stage-key": st.key}
    r.args = {k: v for k, v in args.items()}
    r.contexts = {NAMED_SRC: sorted(p.name for p in src_dir.iterdir()),
                  NAMED_WHEELS: defn_mod.display_path(b.root, inputs["wheels"]) if inputs["wheels"] else None,
                  NAMED_APT: defn_mod.display_path(b.root, inputs["apt"]) if inputs["apt"] else None}
    log_path = b.dir / "logs" / f"{st.name}.log"
    r.log = defn_mod.display_path(b.root, log_path) if b.root in log_path.parents else str(log_path)
    log.info("%s: building (%s, network %s)%s", head, r.reason, r.network,
             ", reproducible export" if r.reproducible else "")
    t0 = time.monotonic()
    dockerfile = b.root / st.dockerfile
    try:
        _buildx(context=ctx, dockerfile=dockerfile, tag=st.image, build_args=args, contexts=contexts, labels=labels,
                network=None if st.network else "none", platform=b.plan.platform, no_cache=b.opts.no_cache,
                oci_dest=(tmp / "oci.tar") if r.reproducible else None, log_path=log_path, stream=stream)
    except _StageFailed as exc:
        r.seconds = round(time.monotonic() - t0, 3)
        r.status = "failed"
        _record(b, "failed", started, failed_stage=st.name, release=None, promotion=None)
        raise OperationFailed(
            f"stage {st.name!r} of {b.defn.name} failed (docker buildx build exit {exc.code}); last lines of its "
            f"log:\n" + "\n".join("  | " + ln for ln in _tail(log_path).splitlines()),
            hint=f"full log: {log_path}; :local and :candidate were not touched") from None
    finally:
        (tmp / "oci.tar").unlink(missing_ok=True)
    r.seconds = round(time.monotonic() - t0, 3)
    r.status = "built"
    r.image_id = promote_mod.image_id(st.image)
    log.info("%s: built in %.1f s -> %s", head, r.seconds, st.image)


def _provenance(b: Build) -> tuple[dict, dict]:
    """(labels, build.json) of the release image: deterministic for the same inputs."""
    keys = {s.name: s.key for s in b.plan.stages}
    lock_sha = sha256_file(lock_mod.lock_path(b.defn.dir)) if b.lock is not None else None
    sources = {n: s.get("commit") for n, s in sorted(((b.lock or {}).get("sources") or {}).items())
               if isinstance(s, dict) and s.get("commit")}
    labels = {
        "org.opencontainers.image.created": _iso(b.epoch),
        "org.opencontainers.image.version": promote_mod.build_tag(b.plan.build_id),
        "org.opencontainers.image.title": b.defn.name,
        f"{LABEL_PREFIX}.image": b.defn.name,
        f"{LABEL_PREFIX}.build-id": b.plan.build_id,
        f"{LABEL_PREFIX}.build-id-from": b.plan.build_id_from,
        f"{LABEL_PREFIX}.stage-keys": json.dumps(keys, sort_keys=True, separators=(",", ":")),
        f"{LABEL_PREFIX}.sources": json.dumps(sources, sort_keys=True, separators=(",", ":")),
        f"{LABEL_PREFIX}.platform": b.plan.platform,
    }
    if b.defn.description:
        labels["org.opencontainers.image.description"] = b.defn.description
    rev = _git_revision(b.root, b.defn)
    if rev:
        labels["org.opencontainers.image.revision"] = rev
    url = _git_source_url(b.root)
    if url:
        labels["org.opencontainers.image.source"] = url
    if lock_sha:
        labels[f"{LABEL_PREFIX}.lock-sha256"] = lock_sha
    doc = {"schema": "imagebuild.image", "version": 1, "image": b.defn.name, "build_id": b.plan.build_id,
           "build_id_from": b.plan.build_id_from, "platform": b.plan.platform, "source_date_epoch": b.epoch,
           "stages": [{"name": s.name, "key": s.key, "image": s.image} for s in b.plan.stages],
           "sources": sources, "lock_sha256": lock_sha, "patches": _merged_patches(b)}
    return labels, doc


def _release(b: Build, tmp: Path, stream: bool, started: str) -> dict:
    final = b.plan.stages[-1]
    labels, doc = _provenance(b)
    lock_bytes = lock_mod.lock_path(b.defn.dir).read_bytes() if b.lock is not None else None
    rkey = "sha256:" + sha256_bytes(canonical_json({"imagebuild-release": 1, "final": final.key, "labels": labels,
                                                    "doc": doc, "lock": sha256_bytes(lock_bytes or b"")}))
    ref = f"imagebuild/{b.defn.name}:release-{rkey.removeprefix('sha256:')[:plan_mod.STAGE_TAG_KEY_LEN]}"
    final_run = b.stages[-1]
    rebuild = b.opts.no_cache and final_run.action == "build"
    if ref in (b.tags or ()) and not rebuild:
        log.info("release: %s exists", ref)
        built = False
    else:
        ctx = tmp / "context"
        meta = ctx / "opt" / "imagebuild"
        meta.mkdir(parents=True)
        if lock_bytes is not None:
            (meta / "lock.json").write_bytes(lock_bytes)
        (meta / "build.json").write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
        _fix_mtimes(ctx, b.epoch)
        df = tmp / "Dockerfile.release"
        df.write_text(RELEASE_DOCKERFILE)
        log_path = b.dir / "logs" / "release.log"
        try:
            _buildx(context=ctx, dockerfile=df, tag=ref, build_args={"PARENT": final.image,
                                                                     "SOURCE_DATE_EPOCH": str(b.epoch)},
                    contexts={}, labels=labels, network="none", platform=b.plan.platform, no_cache=rebuild,
                    oci_dest=None, log_path=log_path, stream=stream)
        except _StageFailed as exc:
            _record(b, "failed", started, failed_stage="release", release=None, promotion=None)
            raise OperationFailed(f"the release step of {b.defn.name} failed (exit {exc.code}):\n" +
                                  "\n".join("  | " + ln for ln in _tail(log_path).splitlines()),
                                  hint=f"full log: {log_path}") from None
        built = True
    from . import identity as identity_mod

    data = _inspect(ref)
    wanted = [promote_mod.ref(b.defn.name, promote_mod.build_tag(b.plan.build_id)),
              promote_mod.ref(b.defn.name, promote_mod.CANDIDATE)]
    have = {t.removeprefix("docker.io/library/") for t in data.get("RepoTags") or []}
    for t in wanted:
        if t not in have:  # one inspect on a no-op build, not one per tag
            promote_mod.tag(ref, t)
    tags = wanted
    ident = identity_mod.from_inspect(data)
    log.info("candidate: %s (identity %s)", ", ".join(tags), ident.digest)
    return {"ref": ref, "key": rkey, "built": built, "tags": tags, "image_id": ident.local_id,
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
    from . import receipts

    cand = promote_mod.ref(name, promote_mod.CANDIDATE)
    try:
        if receipts.find_passing(b.root, release["identity"]):
            log.info("gate: %s already has a passing receipt for identity %s", cand, release["identity"])
        else:
            from . import gate as gate_mod  # imports pytest: only when a gate runs

            gate_mod.run_gate(b.root, name, cand)
    except GateFailed as exc:
        _record(b, "gate-failed", started, release=release,
                promotion={"status": "gate-failed", "reason": exc.message})
        raise
    p = promote_mod.promote(b.root, name, cand)
    return {"status": "promoted", **p.as_dict()}


# --------------------------------------------------------------------------------------------- patch command


def patch_set(defn: defn_mod.Definition, stage: str | None = None) -> list[Path]:
    stages = [s for s in defn.stages if stage is None or s.name == stage]
    if stage is not None and not stages:
        raise UsageError(f"--stage {stage!r}: no such stage in {defn.name}",
                         hint=f"stages: {', '.join(s.name for s in defn.stages)}")
    return [i.path for s in stages for i in s.inputs if i.kind == "patch"]


def patch(root: Path, image: str, src: Path, *, check: bool, stage: str | None = None) -> dict:
    """Apply (or with ``check`` only check) an image's patch set to a checkout ``src``."""
    defn = defn_mod.load(root, image)
    if not Path(src).is_dir():
        raise UsageError(f"--src {src}: not a folder", hint="a checkout of the source the patches apply to")
    paths = patch_set(defn, stage)
    if not paths:
        raise DefinitionError([Problem(defn_mod.display_path(root, defn.dir / defn_mod.IMAGE_FILE),
                                       "no stage declares patches" + (f" ({stage})" if stage else ""),
                                       key="patches")], image=image)
    results = patching.apply_all(paths, Path(src), write=not check)
    doc = {"schema": patching.RECORD_SCHEMA, "version": patching.RECORD_VERSION, "image": image,
           "check": check, "patches": [r.as_dict() for r in results]}
    failed = [r for r in results if r.outcome == patching.FAILED]
    if failed:
        raise PatchFailed(doc, failed[0].message)
    return doc


class PatchFailed(OperationFailed):
    def __init__(self, doc: dict, message: str):
        super().__init__(message, hint="fix the patch's anchor for this upstream, then re-run with --check")
        self.doc = doc
