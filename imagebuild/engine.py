"""Read-only and build-side access to the Docker engine (through python-on-whales).

Planning only asks questions here (is an engine reachable, which images exist); nothing in
this module is called during planning that could change the engine's state.
"""

from __future__ import annotations

import json
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
    try:
        info = json.loads(text.strip().splitlines()[-1]) if text.strip() else {}
    except json.JSONDecodeError:
        info = {}
    if proc.returncode != 0 or not info.get("ServerVersion"):
        reason = next((ln for ln in text.splitlines() if "Cannot connect" in ln or "error" in ln.lower()),
                      text.strip()[:200] or "docker info failed")
        return EngineInfo(False, detail=reason)
    status = dict(info.get("DriverStatus") or [])
    containerd = info.get("Driver", "").startswith("overlayfs") or "io.containerd" in status.get(
        "driver-type", "")
    return EngineInfo(True, info.get("ServerVersion"), info.get("Driver"), containerd,
                      info.get("Architecture"), info.get("DockerRootDir"), id=info.get("ID") or info.get("Name"))


def existing_tags(repository: str) -> set[str]:
    """All ``repo:tag`` names the engine holds for ``repository`` (one call, not one per stage)."""
    # One plain CLI call: planning stays fast (python-on-whales' import alone costs ~0.3 s).
    text = run_mod.output(["docker", "image", "ls", "--format", "{{.Repository}}:{{.Tag}}", repository],
                          timeout=PROBE_TIMEOUT_S, hint="is the Docker engine healthy? (imagebuild doctor)")
    return {line.strip() for line in text.splitlines() if line.strip()}
