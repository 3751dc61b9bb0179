"""Read-only and build-side access to the Docker engine (through python-on-whales).

Planning only asks questions here (is an engine reachable, which images exist); nothing in
this module is called during planning that could change the engine's state.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from . import run as run_mod
from .errors import OperationFailed

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

    def as_dict(self) -> dict:
        return {"reachable": self.reachable, "server_version": self.server_version,
                "storage_driver": self.storage_driver, "containerd_store": self.containerd_store,
                "architecture": self.architecture, "root_dir": self.root_dir, "detail": self.detail}


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
                      info.get("Architecture"), info.get("DockerRootDir"))


def unreachable_reason(output: str, info: dict | None = None) -> str:
    """Why ``docker info`` got no engine, in the CLI's own words (never its JSON document)."""
    errors = [str(e) for e in ((info or {}).get("ServerErrors") or []) if e]
    lines = [ln.strip() for ln in output.splitlines() if ln.strip() and not ln.lstrip().startswith("{")]
    reason = (errors or [ln for ln in lines if "connect" in ln.lower() or "error" in ln.lower()] or lines
              or ["docker info failed without saying why"])[0]
    reason = reason.removeprefix("ERROR: ").removeprefix("error: ")
    host = os.environ.get("DOCKER_HOST")
    if host and host not in reason:
        reason += f" (DOCKER_HOST={host})"
    return reason[:300]


def existing_tags(repository: str) -> set[str]:
    """All ``repo:tag`` names the engine holds for ``repository`` (one call, not one per stage)."""
    # One plain CLI call: planning stays fast (python-on-whales' import alone costs ~0.3 s).
    text = run_mod.output(["docker", "image", "ls", "--format", "{{.Repository}}:{{.Tag}}", repository],
                          timeout=PROBE_TIMEOUT_S, hint="is the Docker engine healthy? (imagebuild doctor)")
    return {line.strip() for line in text.splitlines() if line.strip()}
