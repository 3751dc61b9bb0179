"""Host checks: can this machine build and ship images? Each problem comes with what to do.

Checks only read: they ask the engine, the tools and the peers questions and change nothing.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from imagebuild.core import context as context_mod
from imagebuild.core import engine as engine_mod
from imagebuild.core import run as run_mod
from imagebuild.core.errors import OperationFailed
from imagebuild.core.remote import check_destination, host_key_trouble, ssh_argv

GIB = 1 << 30
# Real images need ~40 GB of build cache and layers; a stage build fails late when the disk fills.
DISK_FAIL_GIB = 5
DISK_WARN_GIB = 60
MEM_WARN_GIB = 16
MIN_BUILDKIT = (0, 11)
MIN_ENGINE = 23


@dataclass(frozen=True)
class Check:
    name: str
    status: str  # ok | warn | fail
    detail: str
    fix: str | None = None

    def as_dict(self) -> dict:
        return {"name": self.name, "status": self.status, "detail": self.detail, "fix": self.fix}


def _version_tuple(text: str) -> tuple[int, ...]:
    m = re.search(r"(\d+)\.(\d+)(?:\.(\d+))?", text or "")
    return tuple(int(x) for x in m.groups() if x is not None) if m else ()


def check_engine() -> tuple[list[Check], engine_mod.EngineInfo]:
    out: list[Check] = []
    if run_mod.which("docker") is None:
        out.append(Check("docker CLI", "fail", "not found on PATH",
                         "install the docker CLI (Debian: apt-get install docker.io)"))
        return out, engine_mod.EngineInfo(False, detail="no docker CLI")
    info = engine_mod.probe()
    if not info.reachable:
        host = os.environ.get("DOCKER_HOST")
        out.append(Check("engine", "fail", f"not reachable: {info.detail}",
                         f"start dockerd listening at DOCKER_HOST={host}, or unset DOCKER_HOST" if host
                         else "start dockerd (or set DOCKER_HOST); on a test machine: scripts/testbed.sh"))
        return out, info
    v = _version_tuple(info.server_version or "")
    status = "ok" if v and v[0] >= MIN_ENGINE else "warn"
    out.append(Check("engine", status, f"Docker {info.server_version} ({info.architecture})",
                     None if status == "ok" else f"upgrade to Docker >= {MIN_ENGINE} for BuildKit features "
                     "used here (cache mounts, OCI layout export and build contexts)"))
    if info.containerd_store:
        out.append(Check("image store", "ok", f"containerd snapshotter ({info.storage_driver})"))
    else:
        out.append(Check("image store", "warn", f"classic store ({info.storage_driver})",
                         'set {"features":{"containerd-snapshotter":true}} in /etc/docker/daemon.json and '
                         "restart dockerd: digest-stable images and OCI export need it"))
    return out, info


def check_buildx(engine_version: str | None = None) -> list[Check]:
    try:
        text = run_mod.output(["docker", "buildx", "version"], timeout=15)
    except OperationFailed as exc:
        return [Check("buildx", "fail", exc.message.splitlines()[0],
                      "install the docker-buildx plugin (Debian 13: docker-buildx) into "
                      "~/.docker/cli-plugins or /usr/local/lib/docker/cli-plugins")]
    out = [Check("buildx", "ok", text.split("\n")[0])]
    try:
        insp = run_mod.output(["docker", "buildx", "inspect"], timeout=15)
    except OperationFailed as exc:
        out.append(Check("buildkit", "warn", f"cannot inspect the builder: {exc.message.splitlines()[0]}"))
        return out
    out.append(check_builder(insp))
    m = re.search(r"BuildKit(?: version)?:\s*(\S+)", insp, re.I)
    bk = m.group(1) if m else "unknown"
    v = _version_tuple(bk)
    if not v or v == (0, 0, 0):
        # distribution builds (Debian's) report v0.0.0+unknown; the engine embeds BuildKit
        eng = _version_tuple(engine_version or "")
        ok = bool(eng) and eng[0] >= MIN_ENGINE
        return out + [Check("buildkit", "ok" if ok else "warn",
                            f"BuildKit {bk} (a distribution build; embedded in Docker {engine_version})",
                            None if ok else f"use Docker >= {MIN_ENGINE} (BuildKit >= 0.11)")]
    ok = v[:2] >= MIN_BUILDKIT
    out.append(Check("buildkit", "ok" if ok else "warn", f"BuildKit {bk}",
                     None if ok else f"BuildKit >= {'.'.join(map(str, MIN_BUILDKIT))} is needed for "
                     "OCI layout export and build contexts; upgrade the engine"))
    return out


def check_builder(inspect_text: str) -> Check:
    """Which buildx builder ``docker buildx build`` uses here (``docker buildx use`` or
    ``BUILDX_BUILDER`` select it): its name and driver, from ``docker buildx inspect``."""
    name = re.search(r"^Name:\s*(\S+)", inspect_text, re.M)
    driver = re.search(r"^Driver:\s*(\S+)", inspect_text, re.M)
    if not name:
        return Check("buildx builder", "warn", "docker buildx inspect named no builder",
                     "docker buildx ls lists them; docker buildx use default selects the engine's own")
    drv = driver.group(1) if driver else "unknown"
    if drv == "docker":
        return Check("buildx builder", "ok", f"{name.group(1)} (driver docker: the engine's own BuildKit and image store)")
    return Check("buildx builder", "warn", f"{name.group(1)} (driver {drv})",
                 "imagebuild's stages and releases go into the engine's image store, which the docker driver "
                 "writes directly; with another driver each result is copied in (slower), and the engine's "
                 "cache is not the builder's: docker buildx use default")


NVIDIA_RUNTIME_FIX = ("install the NVIDIA container toolkit (nvidia-container-toolkit) and run `nvidia-ctk runtime "
                      "configure --runtime=docker`, then restart dockerd; without it the gate's `requires: gpu` "
                      "checks are SKIPPED (gate --require-gpu fails them)")


def check_nvidia_runtime() -> Check:
    """Can the engine give a container the GPUs (``docker run --gpus all``, what the gate's GPU checks
    need)? An ``nvidia`` runtime in ``docker info``, or CDI specs; absent is a warning."""
    try:
        text = run_mod.output(["docker", "info", "--format", "{{json .Runtimes}}"], timeout=15)
        runtimes = sorted(json.loads(text or "{}"))
    except (OperationFailed, ValueError, TypeError):
        runtimes = []
    cdi = [d for d in ("/etc/cdi", "/var/run/cdi") if Path(d).is_dir() and any(Path(d).glob("*nvidia*"))]
    if "nvidia" in runtimes or cdi:
        how = "nvidia runtime" if "nvidia" in runtimes else f"CDI specs in {', '.join(cdi)}"
        return Check("nvidia runtime", "ok", f"{how}: the gate runs GPU checks with --gpus all")
    tool = next((t for t in ("nvidia-ctk", "nvidia-container-runtime") if run_mod.which(t)), None)
    detail = (f"{tool} is installed but the engine has no nvidia runtime (runtimes: {', '.join(runtimes) or '?'})"
              if tool else f"no NVIDIA container runtime (engine runtimes: {', '.join(runtimes) or '?'})")
    return Check("nvidia runtime", "warn", detail, NVIDIA_RUNTIME_FIX)


def check_skopeo(registry: str | None) -> Check:
    """skopeo: the registry stage cache, release tags and sync --via registry copy through it
    (core/registry.py). Missing: a failure when imagebuild.yaml names a registry, else a warning."""
    fix = "install skopeo (apt-get install skopeo): the registry stage cache and sync --via registry use it"
    if run_mod.which("skopeo") is None:
        return Check("skopeo", "fail" if registry else "warn",
                     "not found on PATH" + (f", and imagebuild.yaml names a registry ({registry})" if registry
                                            else ": --cache-registry, rollback --registry and sync --via "
                                            "registry cannot work"), fix)
    return check_tool("skopeo", ["--version"], fix)


def check_disk(paths: list[tuple[str, Path]]) -> list[Check]:
    out = []
    seen = set()
    for label, p in paths:
        p = Path(p)
        while not p.exists() and p != p.parent:
            p = p.parent
        try:
            st = os.statvfs(p)
        except OSError:
            continue
        dev = os.stat(p).st_dev
        if dev in seen:
            continue
        seen.add(dev)
        free = st.f_bavail * st.f_frsize / GIB
        status = "fail" if free < DISK_FAIL_GIB else "warn" if free < DISK_WARN_GIB else "ok"
        out.append(Check(f"disk ({label})", status, f"{free:.1f} GiB free at {p}",
                         None if status == "ok" else
                         f"free space: a real image build needs ~{DISK_WARN_GIB} GiB (docker builder prune, "
                         "docker image prune)"))
    return out


def check_memory() -> Check:
    try:
        info = {}
        for line in Path("/proc/meminfo").read_text().splitlines():
            k, _, v = line.partition(":")
            info[k] = int(v.split()[0]) * 1024
        avail = info.get("MemAvailable", 0) / GIB
        total = info.get("MemTotal", 0) / GIB
    except (OSError, ValueError):
        return Check("memory", "warn", "cannot read /proc/meminfo")
    status = "ok" if avail >= MEM_WARN_GIB else "warn"
    return Check("memory", status, f"{avail:.1f} GiB available of {total:.1f} GiB",
                 None if status == "ok" else "compiling vLLM needs memory: stop serving containers, or "
                 "expect MAX_JOBS to be sized down")


def check_tool(name: str, version_args: list[str], fix: str) -> Check:
    if shutil.which(name) is None:
        return Check(name, "fail", "not found on PATH", fix)
    try:
        text = run_mod.output([name, *version_args], timeout=10, check=False)
    except OperationFailed as exc:
        return Check(name, "warn", exc.message, fix)
    return Check(name, "ok", (text.splitlines() or [""])[0][:80])


def check_peer(host: str) -> list[Check]:
    try:
        proc = run_mod.run(ssh_argv(host, "docker", "version", "--format", "'{{.Server.Version}}'"),
                           check=False, timeout=20)
    except OperationFailed as exc:
        return [Check(f"peer {host}", "fail", exc.message, "check the host name and that sshd runs there")]
    text = proc.stdout.decode("utf-8", "replace").strip()
    if proc.returncode == 255:
        key = host_key_trouble(text, host)
        if key is not None:
            return [Check(f"peer {host}", "fail", f"ssh refused it: {key[0]}", key[1])]
        return [Check(f"peer {host}", "fail", f"ssh failed: {text.splitlines()[-1] if text else 'exit 255'}",
                      f"make `ssh {host} true` work without a password (ssh-copy-id {host}; check ~/.ssh/config)")]
    if proc.returncode != 0:
        return [Check(f"peer {host}", "fail", f"reachable, but its Docker engine did not answer: "
                      f"{text.splitlines()[-1] if text else proc.returncode}",
                      f"start dockerd on {host}, or set DOCKER_HOST for the ssh user there")]
    out = [Check(f"peer {host}", "ok", f"ssh ok, Docker {text.splitlines()[-1]}")]
    rs = run_mod.run(ssh_argv(host, "rsync", "--version"), check=False, timeout=20)
    if rs.returncode != 0:
        out.append(Check(f"peer {host} rsync", "fail", "rsync not found on the peer",
                         f"install rsync on {host} (apt-get install rsync)"))
    else:
        out.append(Check(f"peer {host} rsync", "ok", rs.stdout.decode().splitlines()[0][:80]))
    out += check_peer_sync(host)
    return out


def check_peer_sync(host: str) -> list[Check]:
    """What ``imagebuild sync`` needs on the peer (one read-only probe through the sync agent)."""
    from imagebuild.ship import peer as peer_mod

    conn = peer_mod.Connection(host)
    try:
        st = peer_mod.probe(conn, "imagebuild-doctor/none:none", "imagebuild-doctor/none:none", "0" * 64, None)
    except OperationFailed as exc:
        return [Check(f"peer {host} sync", "fail", exc.message, "imagebuild doctor --debug shows the agent's output")]
    finally:
        conn.close()
    out = []
    need = ["flock", "tar", "stat", "df", "sha256sum", "base64", "mktemp"]
    missing = [t for t in need if t not in st.tools and t not in ("base64", "mktemp")]
    out.append(Check(f"peer {host} sync tools", "fail" if missing else "ok",
                     f"missing: {', '.join(missing)}" if missing else "flock, tar, stat, df, sha256sum",
                     f"install them on {host} (apt-get install util-linux coreutils tar)" if missing else None))
    if st.docker_error is None:
        out.append(Check(f"peer {host} image store", "ok",
                         f"{st.store} store (Docker {st.server_version}); sync sends only the layers it lacks"))
        if st.containerd_store and "ctr" not in st.tools:
            out.append(Check(f"peer {host} leases", "warn", "ctr not found: gc --peer cannot remove the leases a "
                             "docker load interrupted on the peer leaves",
                             f"install containerd's ctr on {host} (it ships with containerd)"))
    if st.signers == "none":
        out.append(Check(f"peer {host} receipts", "warn", "the peer has no allowed-signers file: it takes any receipt "
                         "that holds together, signed or not (docs/gate.md#what-an-unsigned-receipt-proves)",
                         f"put the builders' keys in ~/.config/imagebuild/allowed_signers on {host} "
                         "(docs/sync.md#signed-receipts-on-the-peer)"))
    elif st.signers == "broken":
        out.append(Check(f"peer {host} receipts", "fail", "IMAGEBUILD_ALLOWED_SIGNERS on the peer names no file: "
                         "it refuses every sync", f"fix IMAGEBUILD_ALLOWED_SIGNERS on {host}"))
    elif st.signers == "file":
        out.append(Check(f"peer {host} receipts", "ok", "the peer verifies receipts' signatures"))
    cache_ok = st.df_cache is not None
    free = st.df_cache.available if st.df_cache else 0
    detail = f"{st.cache or '?'}: {free / GIB:.1f} GiB free" + ("" if cache_ok else " (cannot check)")
    status = "ok" if cache_ok and free / GIB >= DISK_FAIL_GIB else "warn"
    out.append(Check(f"peer {host} sync cache", status, detail,
                     None if status == "ok" else f"free disk on {host}: sync needs room for the layers it sends "
                     "and for the load"))
    return out


def check_receipts(cfg) -> list[Check]:
    """Whether receipts are signed here and whether this host verifies them: without both, a receipt
    proves only that whoever could write the state folder wrote one that holds together."""
    from imagebuild.core.errors import UsageError
    from imagebuild.gate import signing

    out = []
    try:
        key = signing.signing_key(cfg)
        out.append(Check("receipt signing", "ok", f"the gate signs receipts with {key}") if key is not None else
                   Check("receipt signing", "warn", "receipts are written unsigned: a peer or a later check can "
                         "tell them from a forgery only by their consistency (docs/gate.md#what-an-unsigned-"
                         "receipt-proves)", "create ~/.ssh/id_ed25519 or set IMAGEBUILD_SIGNING_KEY "
                         "(docs/gate.md#signed-receipts)"))
    except UsageError as exc:
        out.append(Check("receipt signing", "fail", exc.message, exc.hint))
    try:
        allowed = signing.allowed_signers(cfg)
        out.append(Check("receipt verification", "ok", f"receipts must verify against {allowed}")
                   if allowed is not None else
                   Check("receipt verification", "warn", "no allowed-signers file: a receipt that holds together is "
                         "taken, signed or not; anyone who can write the state folder can forge one "
                         "(docs/gate.md#what-an-unsigned-receipt-proves)",
                         "list the builders' keys in ~/.config/imagebuild/allowed_signers "
                         "(docs/gate.md#signed-receipts)"))
    except UsageError as exc:
        out.append(Check("receipt verification", "fail", exc.message, exc.hint))
    return out


def run_checks(ctx: context_mod.Context | Path | None, peers: list[str]) -> list[Check]:
    """Every host check, and each peer's (those named and, in a project, imagebuild.yaml's ``peers:``)."""
    ctx = context_mod.maybe(ctx)
    for host in peers:  # before anything runs: a name that ssh would read as an option is refused (exit 2)
        check_destination(host, "doctor --peer")
    root = ctx.root if ctx is not None else None
    checks, info = check_engine()
    if info.reachable:
        checks += check_buildx(info.server_version)
    paths = [("project", root or Path.cwd())]
    if info.reachable:
        paths.append(("docker", Path(info.root_dir or "/var/lib/docker")))
    checks += check_disk(paths)
    checks.append(check_memory())
    checks.append(check_tool("git", ["--version"], "install git (apt-get install git)"))
    checks.append(check_tool("rsync", ["--version"], "install rsync (apt-get install rsync)"))
    checks.append(check_tool("ssh", ["-V"], "install an SSH client (apt-get install openssh-client)"))
    checks.append(check_skopeo(ctx.config.registry if ctx is not None else None))
    if info.reachable:
        checks.append(check_nvidia_runtime())
    checks += check_receipts(ctx.config if ctx is not None else None)
    configured = list(ctx.config.peers) if ctx is not None else []
    for host in dict.fromkeys([*configured, *peers]):
        checks += check_peer(host)
    return checks
