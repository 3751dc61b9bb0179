"""Build on another node's engine: ``imagebuild build IMAGE --engine ssh://[USER@]HOST[:PORT]``, or
``--engine NAME`` for a docker context (``docker context create NAME --docker host=ssh://dgx3``).

While ``use(engine)`` is active every child process imagebuild starts (run.py is the only place
that starts them) gets that engine in its environment: ``DOCKER_HOST`` (ssh://, tcp://, unix://)
or ``DOCKER_CONTEXT`` (with ``DOCKER_HOST`` removed). So every engine call of a build goes there:
the probe, the guards (serving containers, base-image platforms), every ``docker buildx build``
(BuildKit on that node; the build contexts, the prefetched inputs and the stage store's OCI layouts
travel over the same connection, as buildx sends local contexts), the release load, the tags, the
gate's container and the promotion.

What the engine cannot say about its host comes over ssh when the engine is reached over ssh (an
``ssh://`` engine, or a context whose endpoint is one): available memory and cores (MAX_JOBS),
free disk under its data root, its GPUs (the gate). For other endpoints, ``docker info`` gives the
cores and the total memory; the disk is then not checked, with a warning.

ssh: the command is ``$IMAGEBUILD_SSH`` (default ``ssh``), as for sync and doctor. For the docker
CLI (which runs plain ``ssh``) a two-line wrapper named ``ssh`` runs that command; one master
connection (``ControlMaster``) is opened for the build and closed at its end, so each of the
build's docker calls costs a session on it, not a new ssh handshake (measured: 0.36 s instead of
0.70 s a call).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import shlex
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from imagebuild.core import remote
from imagebuild.core import run as run_mod
from imagebuild.core.errors import OperationFailed, UsageError
from imagebuild.core.secrets import without_userinfo

log = logging.getLogger("imagebuild")

_SSH_RE = re.compile(r"^ssh://(?:(?P<user>[A-Za-z0-9_][A-Za-z0-9._-]*)@)?"
                     r"(?P<host>[A-Za-z0-9_][A-Za-z0-9._-]*|\[[0-9A-Fa-f:.]+\])"
                     r"(?::(?P<port>\d{1,5}))?/?$")
_CONTEXT_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]*$")
FACTS_TIMEOUT_S = 60


@dataclass(frozen=True)
class Engine:
    """Where a build's engine calls go (see the module doc)."""

    spec: str  # as given on the command line
    kind: str  # ssh | tcp | unix | context
    host: str | None  # the docker endpoint: ssh://..., tcp://..., unix://...
    context: str | None = None  # the docker context's name (kind "context")

    @property
    def ssh(self) -> tuple[str, str | None] | None:
        """(``[user@]host``, port) when the engine is reached over ssh."""
        m = _SSH_RE.match(self.host or "")
        if not m:
            return None
        dest = f"{m['user']}@{m['host']}" if m["user"] else m["host"]
        return dest, m["port"]

    @property
    def display(self) -> str:
        """The engine as messages and records name it: never a password written in the URL."""
        host = without_userinfo(str(self.host))
        return f"{self.context} ({host})" if self.context else host

    def as_dict(self) -> dict:
        return {"spec": without_userinfo(self.spec), "kind": self.kind,
                "endpoint": without_userinfo(self.host) if self.host else None, "context": self.context}


def resolve(spec: str) -> Engine:
    """``--engine`` as an Engine; exit 2 for a malformed value or an unknown docker context."""
    spec = (spec or "").strip()
    if not spec:
        raise UsageError("--engine: expected ssh://[USER@]HOST[:PORT] or the name of a docker context")
    if "://" in spec:
        scheme = spec.split("://", 1)[0]
        if scheme == "ssh":
            if not _SSH_RE.match(spec):
                raise UsageError(f"--engine {spec!r}: expected ssh://[USER@]HOST[:PORT]",
                                 hint="e.g. --engine ssh://root@dgx3 (keys, not passwords: the build never prompts)")
            return Engine(spec, "ssh", spec.rstrip("/"))
        if scheme in ("tcp", "unix"):
            return Engine(spec, scheme, spec)
        raise UsageError(f"--engine {spec!r}: unknown scheme {scheme!r}",
                         hint="ssh://[USER@]HOST[:PORT], tcp://HOST:PORT, unix:///PATH, or a docker context name")
    if not _CONTEXT_RE.match(spec):
        raise UsageError(f"--engine {spec!r}: not a docker context name nor ssh://HOST")
    proc = run_mod.run(["docker", "context", "inspect", "--format", "{{json .Endpoints.docker.Host}}", spec],
                       check=False, timeout=30)
    text = proc.stdout.decode("utf-8", "replace").strip()
    if proc.returncode != 0:
        raise UsageError(f"--engine {spec}: no docker context of that name ({text.splitlines()[-1] if text else ''})",
                         hint="docker context ls; create one with docker context create NAME --docker host=ssh://HOST")
    try:
        host = json.loads(text.splitlines()[-1])
    except (ValueError, IndexError):
        host = None
    return Engine(spec, "context", host if isinstance(host, str) else None, context=spec)


# --------------------------------------------------------------------------------------------- active engine

_active: list[Engine] = []


def active() -> Engine | None:
    """The engine of the running command, None for the environment's own (local) engine."""
    return _active[-1] if _active else None


@contextlib.contextmanager
def use(engine: Engine | None) -> Iterator[Engine | None]:
    """Send every child process's engine calls to ``engine`` until the block ends (None: no change)."""
    if engine is None:
        yield None
        return
    mux = _Mux(engine) if engine.ssh else None
    env: dict[str, str | None] = {"DOCKER_HOST": engine.host, "DOCKER_CONTEXT": None}
    if engine.kind == "context":
        env = {"DOCKER_CONTEXT": engine.context, "DOCKER_HOST": None}
    if mux is not None:
        env["PATH"] = f"{mux.wrapper_dir}{os.pathsep}{os.environ.get('PATH', '')}"
    old = run_mod.set_engine_env(env)
    _active.append(engine)
    _facts.pop(engine, None)
    try:
        if mux is not None:
            mux.open()
        yield engine
    finally:
        _active.pop()
        run_mod.set_engine_env(old)
        if mux is not None:
            mux.close()


class _Mux:
    """One ssh master connection for the build (ControlMaster), used by the docker CLI's ``ssh``
    through a wrapper that runs ``$IMAGEBUILD_SSH``; a call that finds no master connects by itself."""

    def __init__(self, engine: Engine):
        self.engine = engine
        dest, port = engine.ssh or ("", None)
        self.dest, self.port = dest, port
        base = remote.ssh_command()
        exe = base[0] if os.path.isabs(base[0]) else shutil.which(base[0])
        if exe is None:
            raise OperationFailed(f"{base[0]}: command not found (the ssh command for --engine {engine.spec})",
                                  hint="install an ssh client, or set IMAGEBUILD_SSH")
        self.base = [exe, *base[1:]]
        top = Path(tempfile.gettempdir()) / f"imagebuild-ssh-{os.getuid()}"
        tag = hashlib.sha256(shlex.join(self.base).encode()).hexdigest()[:16]
        self.wrapper_dir = top / tag
        self.control = top / f"cm-{os.getpid()}-{hashlib.sha256(engine.host.encode()).hexdigest()[:10]}"
        self.opened = False
        self._write_wrapper()

    def _write_wrapper(self) -> None:
        self.wrapper_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.wrapper_dir.parent, 0o700)
        script = ("#!/bin/sh\n# written by imagebuild (remote_engine.py): the docker CLI's ssh is $IMAGEBUILD_SSH,\n"
                  "# through the build's master connection when there is one\n"
                  f'exec {shlex.join(self.base)} ${{IMAGEBUILD_SSH_CONTROL:+-o ControlMaster=no -o '
                  f'"ControlPath=$IMAGEBUILD_SSH_CONTROL"}} "$@"\n')
        target = self.wrapper_dir / "ssh"
        try:
            if target.read_text() == script:
                return
        except OSError:
            pass
        tmp = self.wrapper_dir / f".ssh.{os.getpid()}"
        tmp.write_text(script)
        os.chmod(tmp, 0o755)
        os.replace(tmp, target)

    def _argv(self, *extra: str) -> list[str]:
        argv = [*self.base, "-o", "BatchMode=yes", "-o", f"ConnectTimeout={remote.CONNECT_TIMEOUT_S}",
                "-o", f"ControlPath={self.control}"]
        if self.port:
            argv += ["-p", self.port]
        return [*argv, *extra, "--", remote.check_destination(self.dest, "--engine")]

    def open(self) -> None:
        try:
            proc = run_mod.run(self._argv("-o", "ControlMaster=yes", "-o", "ControlPersist=600", "-o",
                                          "ServerAliveInterval=15", "-N", "-f"),
                               check=False, timeout=60, input=b"")
        except OperationFailed as exc:
            log.debug("ssh master connection to %s: %s", self.dest, exc.message)
            return
        if proc.returncode == 0 and self.control.exists():
            self.opened = True
            run_mod.set_engine_env({**run_mod.engine_env(), "IMAGEBUILD_SSH_CONTROL": str(self.control)})
        else:
            out = proc.stdout.decode("utf-8", "replace").strip()
            log.debug("no ssh master connection to %s (%s): each docker call connects by itself", self.dest, out)

    def close(self) -> None:
        if not self.opened:
            return
        with contextlib.suppress(OperationFailed):
            run_mod.run(self._argv("-O", "exit"), check=False, timeout=30)
        with contextlib.suppress(OSError):
            self.control.unlink()


# --------------------------------------------------------------------------------------------- the node's facts


@dataclass(frozen=True)
class Facts:
    """What the engine's node has: for MAX_JOBS, the disk guard and the gate."""

    cores: int
    mem_available_gib: float  # MemAvailable over ssh; else the engine's total memory (docker info)
    data_root: str | None
    disk_free_gib: float | None  # free under data_root (ssh only)
    gpus: tuple[str, ...] | None  # nvidia-smi's names (ssh only; None: unknown)
    source: str  # "ssh" or "docker info"
    notes: tuple[str, ...] = field(default_factory=tuple)

    def as_dict(self) -> dict:
        return {"cores": self.cores, "mem_available_gib": round(self.mem_available_gib, 2),
                "data_root": self.data_root, "disk_free_gib": None if self.disk_free_gib is None else
                round(self.disk_free_gib, 2), "gpus": list(self.gpus) if self.gpus is not None else None,
                "source": self.source, "notes": list(self.notes)}


_facts: dict[Engine, Facts] = {}

_FACTS_SCRIPT = ("echo @@nproc; nproc 2>/dev/null || getconf _NPROCESSORS_ONLN; echo @@meminfo; "
                 "grep -E '^(MemAvailable|MemTotal):' /proc/meminfo; echo @@df; df -Pk {root} 2>/dev/null | tail -n 1; "
                 "echo @@gpus; if command -v nvidia-smi >/dev/null 2>&1; then "
                 "nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null || true; else echo '@@no-nvidia-smi'; fi")


def facts(engine: Engine) -> Facts:
    """The engine node's cores, memory, free disk and GPUs (cached for the command)."""
    got = _facts.get(engine)
    if got is None:
        got = _facts[engine] = _read_facts(engine)
    return got


def _read_facts(engine: Engine) -> Facts:
    proc = run_mod.run(["docker", "info", "--format", "{{json .}}"], check=False, timeout=FACTS_TIMEOUT_S)
    info: dict = {}
    for line in proc.stdout.decode("utf-8", "replace").splitlines():
        if line.startswith("{"):
            with contextlib.suppress(ValueError):
                info = json.loads(line)
    if proc.returncode != 0 or not info.get("ServerVersion"):
        raise OperationFailed(f"the engine {engine.display} does not answer docker info",
                              hint=f"check it: DOCKER_HOST={without_userinfo(str(engine.host))} docker info")
    cores = int(info.get("NCPU") or 1)
    total = float(info.get("MemTotal") or 0) / (1 << 30)
    root = info.get("DockerRootDir") or None
    ssh = engine.ssh
    if ssh is None:
        return Facts(cores, total, root, None, None, "docker info",
                     (f"{engine.display} is not reached over ssh: MAX_JOBS uses its total memory ({total:.1f} GiB) "
                      "and its free disk is not checked",))
    dest, port = ssh
    script = _FACTS_SCRIPT.format(root=shlex.quote(root or "/"))
    argv = [*remote.ssh_command(), "-o", "BatchMode=yes", "-o", f"ConnectTimeout={remote.CONNECT_TIMEOUT_S}"]
    ctl = run_mod.engine_env().get("IMAGEBUILD_SSH_CONTROL")
    if ctl:
        argv += ["-o", "ControlMaster=no", "-o", f"ControlPath={ctl}"]
    if port:
        argv += ["-p", port]
    proc = run_mod.run([*argv, "--", remote.check_destination(dest, "--engine"), script], check=False,
                       timeout=FACTS_TIMEOUT_S)
    text = proc.stdout.decode("utf-8", "replace")
    if proc.returncode != 0:
        raise OperationFailed(f"cannot read {dest}'s memory and disk over ssh (exit {proc.returncode}): "
                              f"{text.strip().splitlines()[-1] if text.strip() else 'no output'}",
                              hint=f"the engine answered, the ssh command did not: check `{shlex.join(argv)} {dest} true`")
    sect: dict[str, list[str]] = {}
    cur = None
    for line in text.splitlines():
        if line.startswith("@@") and line[2:] in ("nproc", "meminfo", "df", "gpus"):
            cur = line[2:]
            sect[cur] = []
        elif cur:
            sect[cur].append(line.strip())
    with contextlib.suppress(ValueError, IndexError):
        cores = int(sect["nproc"][0])
    mem = {ln.split(":")[0]: int(ln.split()[1]) for ln in sect.get("meminfo", []) if ":" in ln}
    avail = mem.get("MemAvailable", mem.get("MemTotal", 0)) / (1 << 20) or total
    free = None
    with contextlib.suppress(ValueError, IndexError):
        free = int(sect["df"][0].split()[3]) / (1 << 20)
    gl = [g for g in sect.get("gpus", []) if g]
    gpus = () if gl == ["@@no-nvidia-smi"] else tuple(gl)
    return Facts(cores, avail, root, free, gpus, "ssh")


# --------------------------------------------------------------------------------------------- for build.py


def refuse_missing_bases(engine: Engine, notes: list[str]) -> None:
    """Base images the engine lacks: a build there would ask a registry (Docker Hub) for them."""
    missing = "; ".join(n.split(" is not local", 1)[0] for n in notes)
    raise OperationFailed(f"the engine {engine.display} lacks base image(s) {missing}: a build there would try to pull "
                          "them", hint="put them on that node first (docker save REF | ssh HOST docker load), or "
                          "build on an engine that has them")


def disk_free(engine: Engine) -> tuple[list[tuple[str, float]], str | None]:
    """([(where, free GiB)], note) for the disk guard: the engine node's data root."""
    f = facts(engine)
    if f.disk_free_gib is None:
        return [], (f"free disk of {engine.display}'s data root not checked: "
                    + (f.notes[0] if f.notes else "not measurable"))
    return [(f"{engine.display}:{f.data_root}", f.disk_free_gib)], None


def record(engine_id: str | None) -> dict:
    """The build record's ``engine``: which engine built, and (remote) the node's facts."""
    eng = active()
    if eng is None:
        return {"endpoint": "local", "id": engine_id, "facts": None}
    return {"endpoint": eng.display, **eng.as_dict(), "id": engine_id,
            "facts": _facts[eng].as_dict() if eng in _facts else None}
