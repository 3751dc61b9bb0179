"""Read-only and build-side access to the Docker engine (through python-on-whales).

Planning only asks questions here (is an engine reachable, which images exist); nothing in
this module is called during planning that could change the engine's state.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass

from imagebuild.core import fsutil, lazy
from imagebuild.core.errors import OperationFailed
from imagebuild.core.secrets import without_userinfo

run_mod = lazy.module("imagebuild.core.run")  # plan on a local socket starts no process (ImageQuery)

PROBE_TIMEOUT_S = 8


@dataclass(frozen=True)
class EngineInfo:
    reachable: bool
    server_version: str | None = None
    storage_driver: str | None = None
    containerd_store: bool | None = None
    architecture: str | None = None
    root_dir: str | None = None
    detail: str | None = None
    id: str | None = None  # the engine's own ID (docker info .ID): names it across clones and state folders

    def as_dict(self) -> dict:
        return {"reachable": self.reachable, "server_version": self.server_version,
                "storage_driver": self.storage_driver, "containerd_store": self.containerd_store,
                "architecture": self.architecture, "root_dir": self.root_dir, "detail": self.detail,
                "id": self.id}


def probe() -> EngineInfo:
    """Ask the engine about itself; never raises (an unreachable engine is an answer)."""
    if run_mod.which("docker") is None:
        return EngineInfo(False, detail="docker CLI not found on PATH")
    try:
        proc = run_mod.run(["docker", "info", "--format", "{{json .}}"], check=False,
                           timeout=PROBE_TIMEOUT_S)
    except OperationFailed as exc:
        return EngineInfo(False, detail=exc.message)
    text = proc.stdout.decode("utf-8", "replace")
    info: dict = {}
    for line in text.splitlines():
        if line.startswith("{"):
            try:
                info = json.loads(line)
            except json.JSONDecodeError:
                pass
    if proc.returncode != 0 or not info.get("ServerVersion"):
        return EngineInfo(False, detail=unreachable_reason(text, info))
    status = dict(info.get("DriverStatus") or [])
    containerd = info.get("Driver", "").startswith("overlayfs") or "io.containerd" in status.get(
        "driver-type", "")
    return EngineInfo(True, info.get("ServerVersion"), info.get("Driver"), containerd,
                      info.get("Architecture"), info.get("DockerRootDir"), id=info.get("ID") or info.get("Name"))


def unreachable_error(info: EngineInfo) -> OperationFailed:
    """The one error of every command that needs the engine and has none (exit 1): the engine of
    ``--engine`` or the environment's, why ``docker info`` got no answer, and what to do. Said as
    ``build`` and ``doctor`` say it, never as a registry that "does not answer"."""
    from imagebuild.core import remote_engine
    from imagebuild.core.secrets import without_userinfo

    eng = remote_engine.active()
    if eng is not None:
        return OperationFailed(f"the engine {eng.display} (--engine) is not reachable: {info.detail}",
                               hint=f"check it from here: DOCKER_HOST={without_userinfo(str(eng.host))} docker info "
                               "(ssh keys, the "
                               "docker CLI on that node, IMAGEBUILD_SSH)")
    return OperationFailed(f"no Docker engine reachable: {info.detail}",
                           hint="start dockerd (scripts/testbed.sh) and check with `imagebuild doctor`")


def unreachable_reason(output: str, info: dict | None = None) -> str:
    """Why ``docker info`` got no engine, in the CLI's own words (never its JSON document)."""
    errors = [str(e) for e in ((info or {}).get("ServerErrors") or []) if e]
    lines = [ln.strip() for ln in output.splitlines() if ln.strip() and not ln.lstrip().startswith("{")]
    reason = (errors or [ln for ln in lines if "connect" in ln.lower() or "error" in ln.lower()] or lines
              or ["docker info failed without saying why"])[0]
    reason = reason.removeprefix("ERROR: ").removeprefix("error: ")
    engine = run_mod.engine_env()  # an --engine of the running command (remote_engine.use)
    host = engine.get("DOCKER_HOST") or (f"docker context {engine['DOCKER_CONTEXT']}" if engine.get("DOCKER_CONTEXT")
                                         else os.environ.get("DOCKER_HOST"))
    if host and host not in reason:
        reason += f" (DOCKER_HOST={host})" if "://" in host else f" ({host})"
    return without_userinfo(reason)[:300]


def existing_tags(repository: str) -> set[str]:
    """All ``repo:tag`` names the engine holds for ``repository`` (one call, not one per stage)."""
    # One plain CLI call: planning stays fast (python-on-whales' import alone costs ~0.3 s).
    text = run_mod.output(["docker", "image", "ls", "--format", "{{.Repository}}:{{.Tag}}", repository],
                          timeout=PROBE_TIMEOUT_S, hint="is the Docker engine healthy? (imagebuild doctor)")
    return {line.strip() for line in text.splitlines() if line.strip()}


# ------------------------------------------------------------------------------------------ plan's query

_UNAME_ARCH = {"amd64": "x86_64", "arm64": "aarch64", "386": "i686", "arm": "armv7l"}


def local_socket() -> str | None:
    """The engine's Unix socket when the docker CLI would use one directly (DOCKER_HOST unset or
    unix://, no docker context selected); None otherwise (tcp://, ssh://, a context)."""
    host = os.environ.get("DOCKER_HOST")
    if host:
        return host[len("unix://"):] if host.startswith("unix://") else None
    if os.environ.get("DOCKER_CONTEXT", "default") != "default":
        return None
    config = os.path.join(os.environ.get("DOCKER_CONFIG") or os.path.expanduser("~/.docker"), "config.json")
    try:
        current = json.loads(fsutil.read_bytes(config, 1 << 20)).get("currentContext")
    except (OSError, ValueError, AttributeError):  # a FIFO or /dev/zero there is fsutil.UnfitFile, an OSError
        current = None
    return None if current and current != "default" else "/var/run/docker.sock"


class EngineQuery:
    """Is the engine there, and its version: what ``plan`` asks (built stages come from the stage
    store, not the engine).

    On a local Unix socket the question goes to the engine's API as soon as the query is made,
    without a docker CLI process (``docker info`` alone takes ~70 ms), and the answer is read by
    ``result()``, after the definition was read meanwhile. It asks ``/_ping`` (~1 ms to answer;
    ``/version`` takes ~12 ms, as it asks containerd and runc): its ``Server`` header names the
    engine's version, and when the process at the other end of the socket is ``dockerd`` itself
    (SO_PEERCRED), the engine runs on this kernel, whose machine name is what ``docker info``
    reports as the architecture. Behind anything else (a proxy, a forwarded socket, another engine)
    ``/version`` is asked. Anywhere but a Unix socket (tcp://, ssh://, a docker context)
    ``result()`` runs ``probe``. Read only."""

    def __init__(self):
        self.path = local_socket()
        self._sock = None
        self._error: OSError | None = None
        if self.path is None:
            return
        try:
            self._sock = self._ask(b"/_ping")
        except OSError as exc:
            self._error = exc

    def _ask(self, endpoint: bytes):
        import _socket  # the C module: socket.py would add selectors, enum flags, ... (~2 ms)

        sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
        try:
            sock.settimeout(PROBE_TIMEOUT_S)
            sock.connect(self.path)
            sock.sendall(b"GET " + endpoint + b" HTTP/1.0\r\nHost: docker\r\n\r\n")
        except OSError:
            sock.close()
            raise
        return sock

    def result(self) -> EngineInfo:
        if self.path is None:
            return probe()
        if self._error is not None:
            return EngineInfo(False, detail=self._unreachable(self._error))
        try:
            try:
                status, headers, _ = _read_http(self._sock)
                peer = _peer_command(self._sock)
            finally:
                self._sock.close()
            if status != 200:
                raise ValueError(f"HTTP {status} for /_ping")
            server = headers.get("server", "")
            if peer == "dockerd" and server.startswith("Docker/"):
                return EngineInfo(True, server[len("Docker/"):].split(" ", 1)[0], architecture=os.uname().machine)
            sock = self._ask(b"/version")
            try:
                status, _, body = _read_http(sock)
            finally:
                sock.close()
            version = json.loads(body) if body.strip() else None
            if status != 200 or not isinstance(version, dict):
                raise ValueError(f"HTTP {status} for /version")
        except (OSError, ValueError) as exc:
            return EngineInfo(False, detail=f"the engine at unix://{self.path} did not answer: {exc}")
        arch = str(version.get("Arch") or "")
        return EngineInfo(True, version.get("Version"), architecture=_UNAME_ARCH.get(arch, arch) or None)

    def _unreachable(self, exc: OSError) -> str:
        if isinstance(exc, PermissionError):
            reason = (f"permission denied while trying to connect to the Docker daemon socket at "
                      f"unix://{self.path}")
        else:
            reason = (f"Cannot connect to the Docker daemon at unix://{self.path}. Is the docker daemon "
                      f"running? ({exc.strerror or exc})")
        host = os.environ.get("DOCKER_HOST")
        return without_userinfo(reason + (f" (DOCKER_HOST={host})" if host and host not in reason else ""))


def _read_http(sock) -> tuple[int, dict[str, str], bytes]:
    """(HTTP status, headers with lower-case names, body) of an HTTP/1.0 answer, read to its end."""
    chunks = []
    while True:
        data = sock.recv(65536)
        if not data:
            break
        chunks.append(data)
    head, _, body = b"".join(chunks).partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = lines[0].split()
    if len(status) < 2 or not status[1].isdigit():
        raise ValueError("not an HTTP answer")
    headers = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if sep:
            headers[name.strip().lower()] = value.strip()
    return int(status[1]), headers, body


def _peer_command(sock) -> str | None:
    """The command name of the process at the other end of a Unix socket (SO_PEERCRED, then
    /proc/PID/comm), or None when it cannot be told."""
    import _socket

    try:
        cred = sock.getsockopt(_socket.SOL_SOCKET, _socket.SO_PEERCRED, 12)  # struct ucred: pid, uid, gid
        pid = int.from_bytes(cred[:4], sys.byteorder)
        with open(f"/proc/{pid}/comm", encoding="utf-8") as f:
            return f.read().strip() or None
    except (OSError, AttributeError, ValueError):
        return None
