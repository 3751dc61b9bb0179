"""Guard rails checked before a build starts anything: all of them run before docker builds.

- **Platform**: the definition's target platform must match the host's architecture; a
  foreign platform needs ``--emulate`` (QEMU must then be set up by the operator). No silent
  emulated builds.
- **Base platforms** (``check_base_platforms``): every base image a stage uses that is local must
  be of the definition's platform. BuildKit takes a local linux/amd64 base for ``--platform
  linux/arm64`` with exit 0 and labels the result arm64 while it runs x86-64 code; ``--emulate``
  does not change that (it runs foreign code, it cannot turn an amd64 base into an arm64 one).
- **Serving containers**: building while a model is served OOM-kills one of them on GB10's
  128 GB of unified memory. A running container counts as *serving* when any of the patterns
  below matches it. Exit 3; ``--force`` overrides with a warning.
- **Parallelism**: ``MAX_JOBS`` / ``NVCC_THREADS`` / ``CMAKE_BUILD_PARALLEL_LEVEL`` for the
  stages that declare them, from free memory and cores (rule in ``jobs_rule``), unless set.
- **Disk**: free space under Docker's data root and the state folder before the build.
- **One build per image**: an exclusive lock file naming its holder (pid, host, command). ``gc``
  and ``rollback`` of the image hold the same lock while they work, so neither runs beside a build.

Serving patterns (environment, comma separated; each replaces its default):

    IMAGEBUILD_SERVING_COMMANDS  globs on the container's full command
                                 (default: *vllm serve*, *vllm.entrypoints.openai.api_server*)
    IMAGEBUILD_SERVING_LABELS    label keys or key=value (default: imagebuild.role=serve)
    IMAGEBUILD_SERVING_NAMES     globs on the container name (default: none)
    IMAGEBUILD_SERVING_IMAGES    globs on the image reference (default: none)
"""

from __future__ import annotations

import errno
import fcntl
import fnmatch
import json
import logging
import os
import platform as _platform
import shutil
import socket
from dataclasses import dataclass, field
from pathlib import Path

from imagebuild.core import fsutil
from imagebuild.core import run as run_mod
from imagebuild.core.errors import (
    DefinitionError,
    GuardRefused,
    OperationFailed,
    Problem,
)

log = logging.getLogger("imagebuild")

DEFAULT_SERVING_COMMANDS = ("*vllm serve*", "*vllm.entrypoints.openai.api_server*")
DEFAULT_SERVING_LABELS = ("imagebuild.role=serve",)
DEFAULT_MIN_FREE_GIB = 10.0

# jobs rule (documented in docs/build.md)
JOB_MEMORY_GIB = 4.0  # what one compile job (nvcc / cc1plus on CUDA kernels) may take at peak
RESERVED_MEMORY_GIB = 8.0  # left to the OS, dockerd, BuildKit
PARALLEL_KNOBS = ("MAX_JOBS", "NVCC_THREADS", "CMAKE_BUILD_PARALLEL_LEVEL")



# ------------------------------------------------------------------------------------------ platform


def host_arch(engine_arch: str | None = None) -> str:
    """The architecture builds run on natively (the engine's, else this machine's), Docker-style."""
    from imagebuild.core import emulation

    return emulation.docker_arch(engine_arch or _platform.machine())


def check_platform(target: str, *, emulate: bool, engine_arch: str | None = None) -> str | None:
    """Refuse a foreign target platform unless ``emulate``. Returns a warning when emulating."""
    want = target.split("/")[1] if "/" in target else target
    have = host_arch(engine_arch)
    if want == have:
        return None
    if emulate:
        from imagebuild.core import emulation

        how = emulation.check(target, engine_arch=engine_arch)
        return (f"building {target} on a linux/{have} host under emulation (--emulate, {how}): expect it to be "
                "many times slower")
    raise GuardRefused(f"the definition targets {target} but this host builds linux/{have}",
                       hint="build on a host of that architecture (DGX Spark is linux/arm64), or pass "
                       "--emulate to build under QEMU deliberately")


def base_images(defn) -> dict[str, str]:
    """versions.env key -> image reference, for every base image the stages use: the ``from:``
    parents, and ``${KEY}`` in a Dockerfile's FROM, ``COPY --from`` or ``RUN --mount from=``."""
    from imagebuild.definition.dockerfile import variable

    out = {key: ref.value for key, ref in defn.images.items()}
    for st in defn.stages:
        p = st.parsed
        names = [fr.variable for fr in p.froms] + [variable(c.from_stage) for c in p.copies if c.from_stage]
        names += [variable(v) for v, _ in p.mount_froms]
        plan_args = {a.name for a in st.args if a.origin == "plan"}
        for name in names:
            if name and name not in plan_args and defn.env.get(name) is not None:
                out.setdefault(name, defn.env.get(name))
    return out


def image_platform(ref: str, target: str | None = None) -> str | None:
    """``os/arch[/variant]`` of the local image ``ref`` (``docker image inspect``), None when it is not
    local. When the engine can (API >= 1.49) and the image holds ``target`` too, ``target``."""
    fmt = "{{.Os}}/{{.Architecture}}/{{.Variant}}"
    proc = run_mod.run(["docker", "image", "inspect", "--format", fmt, ref], check=False, timeout=30)
    text = proc.stdout.decode("utf-8", "replace").strip()
    if proc.returncode != 0:
        if "no such image" in text.lower() or "not found" in text.lower():
            return None
        raise OperationFailed(f"docker image inspect {ref} failed: {text.splitlines()[-1] if text else ''}",
                              hint="is the Docker engine healthy? (imagebuild doctor)")
    have = text.splitlines()[0].rstrip("/")
    if target and not _same_platform(have, target):
        # a multi-platform image in the containerd store shows one platform; ask for the target's
        alt = run_mod.run(["docker", "image", "inspect", "--platform", target, "--format", fmt, ref],
                          check=False, timeout=30)
        if alt.returncode == 0 and _same_platform(alt.stdout.decode().strip().rstrip("/"), target):
            return target
    return have


def _same_platform(have: str, want: str) -> bool:
    h, w = have.split("/"), want.split("/")
    return h[:2] == w[:2] and (len(w) < 3 or (h[2:3] or [""])[0] == w[2])


def check_base_platforms(defn, engine=None) -> list[str]:
    """Refuse (exit 2, naming versions.env:line) a local base image whose platform is not the
    definition's. Returns notes for base images that are not local (BuildKit resolves them for the
    platform when it pulls). ``engine``: an ``engine.EngineInfo``; an unreachable engine checks
    nothing (the build stops on it anyway)."""
    if engine is not None and not getattr(engine, "reachable", True):
        return []
    problems, notes = [], []
    for key, ref in sorted(base_images(defn).items()):
        have = image_platform(ref, defn.platform)
        if have is None:
            notes.append(f"{key}: {ref} is not local: BuildKit resolves it for {defn.platform} when it pulls")
        elif not _same_platform(have, defn.platform):
            problems.append(Problem(
                defn.env.display, f"base image {ref!r} is {have} (docker image inspect), but image.yaml's "
                f"platform is {defn.platform}: the build would label {defn.platform} an image that runs "
                f"{have} code", line=defn.env.line_of(key), key=key,
                hint=f"pin the {defn.platform} image (imagebuild prefetch pulls the pinned digest for the "
                "definition's platform) or change 'platform:'; --emulate does not help: it runs foreign "
                f"code under QEMU, it cannot turn a {have} base into {defn.platform}"))
    if problems:
        raise DefinitionError(problems, image=defn.name)
    return notes


# ------------------------------------------------------------------------------------------ serving


@dataclass(frozen=True)
class ServingPatterns:
    commands: tuple[str, ...] = DEFAULT_SERVING_COMMANDS
    labels: tuple[str, ...] = DEFAULT_SERVING_LABELS
    names: tuple[str, ...] = ()
    images: tuple[str, ...] = ()

    @classmethod
    def from_env(cls, env: dict | None = None) -> ServingPatterns:
        env = os.environ if env is None else env

        def get(var: str, default: tuple[str, ...]) -> tuple[str, ...]:
            if var not in env:
                return default
            return tuple(p.strip() for p in env[var].split(",") if p.strip())

        return cls(get("IMAGEBUILD_SERVING_COMMANDS", DEFAULT_SERVING_COMMANDS),
                   get("IMAGEBUILD_SERVING_LABELS", DEFAULT_SERVING_LABELS),
                   get("IMAGEBUILD_SERVING_NAMES", ()), get("IMAGEBUILD_SERVING_IMAGES", ()))

    def match(self, c: dict) -> str | None:
        """Why container ``c`` (a ``docker ps --format json`` row) counts as serving, or None."""
        command = (c.get("Command") or "").strip('"')
        for pat in self.commands:
            if fnmatch.fnmatchcase(command, pat):
                return f"command matches {pat!r}"
        labels = _labels(c.get("Labels") or "")
        for pat in self.labels:
            k, eq, v = pat.partition("=")
            if k in labels and (not eq or labels[k] == v):
                return f"label {pat!r}"
        for name in (c.get("Names") or "").split(","):
            for pat in self.names:
                if fnmatch.fnmatchcase(name, pat):
                    return f"name matches {pat!r}"
        for pat in self.images:
            if fnmatch.fnmatchcase(c.get("Image") or "", pat):
                return f"image matches {pat!r}"
        return None


def _labels(text: str) -> dict[str, str]:
    out = {}
    for part in text.split(","):
        k, _, v = part.partition("=")
        if k:
            out[k.strip()] = v
    return out


@dataclass(frozen=True)
class ServingContainer:
    id: str
    name: str
    image: str
    why: str


def serving_containers(patterns: ServingPatterns | None = None) -> list[ServingContainer]:
    patterns = patterns or ServingPatterns.from_env()
    text = run_mod.output(["docker", "ps", "--no-trunc", "--format", "{{json .}}"], timeout=30,
                          hint="is the Docker engine healthy? (imagebuild doctor)")
    found = []
    for line in text.splitlines():
        line = line.strip()
        if not line.startswith("{"):
            continue
        c = json.loads(line)
        why = patterns.match(c) or _exec_match(c.get("ID", ""), patterns)
        if why:
            found.append(ServingContainer(c.get("ID", "")[:12], c.get("Names", ""), c.get("Image", ""), why))
    return found


def _exec_match(cid: str, patterns: ServingPatterns) -> str | None:
    """A process of container ``cid`` whose command line matches a serving pattern: eugr's launcher
    starts ``sleep infinity`` and ``docker exec``s ``vllm serve``, so the container's own command
    says nothing. ``docker top`` lists every process in it (one ps on the host, no exec)."""
    if not cid or not patterns.commands:
        return None
    res = run_mod.run(["docker", "top", cid, "-o", "pid,args"], check=False, timeout=15)  # top needs the pid
    if res.returncode != 0:  # the container ended in between: not serving
        return None
    for row in res.stdout.decode("utf-8", "replace").splitlines()[1:]:  # first line: the header
        proc = row.strip().partition(" ")[2].strip()
        for pat in patterns.commands:
            if fnmatch.fnmatchcase(proc, pat):
                shown = proc if len(proc) <= 60 else proc[:57] + "..."
                return f"process {shown!r} matches {pat!r} (started by docker exec)"
    return None


def check_serving(*, force: bool, patterns: ServingPatterns | None = None) -> str | None:
    """Refuse (exit 3) while a serving container runs; with ``force`` return a warning instead."""
    found = serving_containers(patterns)
    if not found:
        return None
    names = "; ".join(f"{c.name} ({c.id}, {c.image}: {c.why})" for c in found)
    if force:
        return f"building while serving containers run (--force): {names}; the build may OOM-kill them"
    raise GuardRefused(f"a serving container is running: {names}",
                       hint="stop it first (building while serving OOM-kills one of them on 128 GB unified "
                       "memory), or pass --force; which containers count: IMAGEBUILD_SERVING_* (docs/build.md)")


# ------------------------------------------------------------------------------------------ jobs


@dataclass(frozen=True)
class Jobs:
    max_jobs: int
    nvcc_threads: int
    rule: str
    explicit: dict = field(default_factory=dict)

    def values(self) -> dict[str, str]:
        return {"MAX_JOBS": str(self.max_jobs), "NVCC_THREADS": str(self.nvcc_threads),
                "CMAKE_BUILD_PARALLEL_LEVEL": str(self.max_jobs)}


def available_memory_gib() -> float:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) / (1024 * 1024)
    except OSError:
        pass
    return 0.0


def jobs_rule(cores: int, mem_gib: float, *, jobs: int | None = None, env: dict | None = None,
              where: str | None = None) -> Jobs:
    """MAX_JOBS = clamp(floor((available memory - 8 GiB) / 4 GiB), 1, cores);
    NVCC_THREADS = 2 when MAX_JOBS >= 4, else 1 (ninja then runs MAX_JOBS // NVCC_THREADS jobs).
    ``--jobs N`` or MAX_JOBS / NVCC_THREADS in the environment win over the rule."""
    env = os.environ if env is None else env
    by_mem = int((mem_gib - RESERVED_MEMORY_GIB) // JOB_MEMORY_GIB)
    max_jobs = max(1, min(cores, by_mem))
    rule = (f"min({cores} cores, ({mem_gib:.1f} GiB available - {RESERVED_MEMORY_GIB:g}) / "
            f"{JOB_MEMORY_GIB:g} GiB per job) = {max_jobs}") + (f" (on {where})" if where else "")
    explicit = {}
    if jobs is not None:
        max_jobs, explicit["MAX_JOBS"] = jobs, "--jobs"
    elif env.get("MAX_JOBS", "").isdigit() and int(env["MAX_JOBS"]) > 0:
        max_jobs, explicit["MAX_JOBS"] = int(env["MAX_JOBS"]), "environment"
    nvcc = 2 if max_jobs >= 4 else 1
    if env.get("NVCC_THREADS", "").isdigit() and int(env["NVCC_THREADS"]) > 0:
        nvcc, explicit["NVCC_THREADS"] = int(env["NVCC_THREADS"]), "environment"
    return Jobs(max_jobs, nvcc, rule, explicit)


def host_jobs(jobs: int | None = None) -> Jobs:
    """The rule on the node whose engine builds: this machine, or the ``--engine`` node's memory and
    cores (remote_engine.facts)."""
    from imagebuild.core import remote_engine

    eng = remote_engine.active()
    if eng is not None:
        f = remote_engine.facts(eng)
        return jobs_rule(f.cores, f.mem_available_gib, jobs=jobs, where=eng.display)
    return jobs_rule(os.cpu_count() or 1, available_memory_gib(), jobs=jobs)


# ------------------------------------------------------------------------------------------ disk


def free_gib(path: Path) -> float:
    p = Path(path)
    while not p.exists() and p != p.parent:
        p = p.parent
    return shutil.disk_usage(p).free / (1 << 30)


def min_free_gib() -> float:
    v = os.environ.get("IMAGEBUILD_MIN_FREE_GB")
    try:
        n = float(v) if v else DEFAULT_MIN_FREE_GIB
    except ValueError:
        n = None
    if n is None or not 0 <= n < 1e6:  # (nan, inf and negative numbers too)
        from imagebuild.core.errors import UsageError, excerpt

        raise UsageError(f"IMAGEBUILD_MIN_FREE_GB={excerpt(v)}: expected a number of GiB >= 0",
                         hint="e.g. IMAGEBUILD_MIN_FREE_GB=10") from None
    return n


# The reproducible export holds each new layer twice for a while (BuildKit's blob, then the one
# with clamped file times, layerclamp.py, before the first is removed): temporary space of about
# this many times the stage's compressed size, on top of IMAGEBUILD_MIN_FREE_GB.
EXPORT_SPACE_FACTOR = 2.0


def export_space_gib(store, stages: list[str]) -> float:
    """Temporary space the reproducible export of ``stages`` needs, estimated from the last build of
    each stage in the stage store (0 for a stage never built): its own layers, i.e. those beyond the
    longest other stage image in the store whose layers are a prefix of its own (its parent)."""
    layers: dict[str, list[tuple[str, int]]] = {}
    for ref in store.refs():
        m = store.read_json_blob(ref.manifest) or {}
        layers[ref.manifest] = [(la.get("digest"), int(la.get("size") or 0)) for la in m.get("layers") or []]
    last: dict[str, int] = {}
    for ref in store.refs():
        if ref.stage not in stages:
            continue
        mine = layers.get(ref.manifest) or []
        parent = max((len(v) for k, v in layers.items() if k != ref.manifest and len(v) < len(mine)
                      and mine[:len(v)] == v), default=0)
        own = sum(size for _, size in mine[parent:])
        last[ref.stage] = max(last.get(ref.stage, 0), own)
    return EXPORT_SPACE_FACTOR * sum(last.values()) / (1 << 30)


def check_disk(paths: list[Path], *, force: bool, export_gib: float = 0.0,
               measured: list[tuple[str, float]] | None = None) -> str | None:
    """Refuse when a path has less free space than IMAGEBUILD_MIN_FREE_GB plus the reproducible
    export's temporary space (``export_gib``). ``measured``: (what, free GiB) measured elsewhere
    (the data root of an ``--engine`` node)."""
    need = min_free_gib() + export_gib
    low = [(str(p), free_gib(p)) for p in paths if p is not None] + list(measured or [])
    low = [(p, f) for p, f in low if f < need]
    if not low:
        return None
    what = ", ".join(f"{p}: {f:.1f} GiB free" for p, f in low)
    need_s = f"{need:.1f} GiB" + (f" ({min_free_gib():g} + {export_gib:.1f} for the reproducible export)"
                                  if export_gib else "")
    if force:
        return f"low disk space (--force): {what}; need {need_s}"
    raise GuardRefused(f"not enough free disk space before the build: {what} (need {need_s})",
                       hint="free space (imagebuild gc, then docker builder prune), lower "
                       "IMAGEBUILD_MIN_FREE_GB, or pass --force")


# ------------------------------------------------------------------------------------------ build lock


LOCK_DIR_ENV = "IMAGEBUILD_LOCK_DIR"


def build_lock_path(engine_id: str | None, image: str) -> Path:
    """One lock per (engine, image), in a host-wide folder: two clones or two state folders that
    share one engine get the same lock. ``$IMAGEBUILD_LOCK_DIR`` (default
    ``<tmp>/imagebuild-locks``) holds one folder per engine."""
    import re

    top = lock_top()
    eng = re.sub(r"[^A-Za-z0-9_.-]", "_", engine_id or "unknown-engine")[:80]
    d = usable_lock_dir(top / eng)
    for p in (top, d):
        try:
            os.chmod(p, 0o1777)  # shared by every user of the engine, like /tmp
        except OSError:
            pass
    return d / f"{image}.lock"


def lock_top() -> Path:
    import tempfile

    return Path(os.environ.get(LOCK_DIR_ENV) or Path(tempfile.gettempdir()) / "imagebuild-locks")


def usable_lock_dir(path: Path, create: bool = True) -> Path:
    """``path`` (the lock folder or one of its engine folders) made and writable, else a UsageError
    naming IMAGEBUILD_LOCK_DIR (``create`` False: checked, not made)."""
    from imagebuild.core.fsutil import usable_dir

    return usable_dir(path, LOCK_DIR_ENV if os.environ.get(LOCK_DIR_ENV) else "the build lock folder",
                      hint=f"{LOCK_DIR_ENV} names a folder every user of the engine can write (default "
                      "<tmp>/imagebuild-locks)", create=create)


class BuildLock:
    """An exclusive, process-lifetime lock on one image's builds (flock: released when the holder
    dies, so no stale locks). The file names the holder for the refusal message."""

    def __init__(self, path: Path, image: str):
        self.path = Path(path)
        self.image = image
        self._fd: int | None = None

    def acquire(self, command: str = "imagebuild build") -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno not in (errno.EAGAIN, errno.EACCES):
                raise
            holder = self.holder()
            who = (f"pid {holder.get('pid')} on {holder.get('host')} ({holder.get('command')})"
                   if holder else "another process")
            cmd = str((holder or {}).get("command") or "")
            what = (f"{self.image!r} is busy" if cmd.startswith("imagebuild ") and not cmd.startswith("imagebuild build")
                    else f"another build of {self.image!r} is running")  # gc and rollback take the lock too
            raise GuardRefused(f"{what}: {who}", hint=f"wait for it to finish; the lock is {self.path}") from None
        info = {"schema": "imagebuild.buildlock", "version": 1, "image": self.image, "pid": os.getpid(),
                "host": socket.gethostname(), "command": command}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(info, sort_keys=True) + "\n").encode(), 0)
        self._fd = fd

    def holder(self) -> dict | None:
        try:
            return json.loads(fsutil.read_text(self.path) or "null")
        except (OSError, ValueError):
            return None

    def release(self) -> None:
        if self._fd is not None:
            try:
                os.ftruncate(self._fd, 0)
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)
                os.close(self._fd)
                self._fd = None

    @classmethod
    def held(cls, engine_id: str | None, image: str, command: str) -> BuildLock:
        """The image's lock, taken for ``command`` (``imagebuild gc IMAGE``, ``imagebuild rollback
        IMAGE``): what changes an image's builds or tags holds it, as a build does; GuardRefused
        (exit 3) while another holds it."""
        lk = cls(build_lock_path(engine_id, image), image)
        lk.acquire(command=command)
        return lk

    def __enter__(self) -> BuildLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()
