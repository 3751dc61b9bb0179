"""Real peers and the test images put on them, for the pytest fixtures (tests/conftest.py,
tests/syncfixtures.py, tests/fleetfixtures.py) and the benchmarks (benchmarks/bench_sync.py,
benchmarks/bench_fleet.py).

A peer is a real node made by scripts/peer.sh: its own network namespace, sshd, its own Docker engine
(or none, --no-docker), in a slot of its own (namespace ibpN, 10.77.N.0/24) held by an flock, so that
parallel sessions of other clones never share a namespace or an address. Nothing here knows pytest: a
peer that does not start raises PeerError, and tests/conftest.py turns that into a failure or a skip.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

PEER_SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "peer.sh"
_SLOT_DIR = Path("/tmp/imagebuild-peer-slots")

# the base images scripts/testbed.sh imports into this host's engine
BUSYBOX = "imagebuild-test/busybox:1"
DEBIAN = "imagebuild-test/debian:bookworm"


class PeerError(RuntimeError):
    """scripts/peer.sh up failed (what it printed is in the message)."""


@dataclass
class Peer:
    addr: str
    ssh_config: str
    docker_host: str
    ssh_env: str  # value for IMAGEBUILD_SSH
    cache: str = ""  # the peer's sync cache (IMAGEBUILD_PEER_CACHE of its ssh sessions), on this host's disk
    data_root: str = ""  # its engine's data root
    veth: str = ""  # the host side of its link (byte counters: /sys/class/net/VETH/statistics)
    dir: str = ""
    name: str = ""

    def docker(self, *args: str, **kw) -> subprocess.CompletedProcess:
        """Run docker against the peer's own engine (directly, not over ssh)."""
        env = {**os.environ, "DOCKER_HOST": self.docker_host}
        return subprocess.run(["docker", *args], env=env, capture_output=True, text=True, **kw)

    def _counter(self, which: str) -> int:
        return int((Path("/sys/class/net") / self.veth / "statistics" / which).read_text())

    def link_bytes(self) -> int:
        """Bytes that crossed the peer's link so far, both directions."""
        return self._counter("tx_bytes") + self._counter("rx_bytes")

    def tx_bytes(self) -> int:
        """Bytes this host sent to the peer over its link so far."""
        return self._counter("tx_bytes")


def peer_slot():
    """A free peer slot N (namespace ibpN, 10.77.N.0/24, bridge 172.29.N.0/24), held by an flock for this
    process: parallel test sessions of other clones never share a namespace or an address."""
    _SLOT_DIR.mkdir(exist_ok=True)
    existing = {ln.split()[0] for ln in subprocess.run(["ip", "netns", "list"], capture_output=True,
                                                        text=True).stdout.splitlines() if ln.strip()}
    for n in range(100, 250):
        if f"ibp{n}" in existing:
            continue
        f = open(_SLOT_DIR / f"{n}.lock", "w")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            f.close()
            continue
        return n, f
    raise RuntimeError("no free peer slot in 100-249")


def start_peer(d: Path | None, name: str, *options: str) -> tuple[Peer, Callable[[], None]]:
    """Start a peer (scripts/peer.sh up D OPTIONS) in its own slot; returns (Peer, stop). With d None the
    peer lives in a fresh temporary folder that stop removes. If it does not start, stop runs and
    PeerError says why."""
    n, slot = peer_slot()
    env = {**os.environ, "PEER_NS": f"ibp{n}", "PEER_ADDR": f"10.77.{n}.2", "HOST_ADDR": f"10.77.{n}.1",
           "PEER_VETH": f"ibpv{n}", "PEER_BRIDGE": f"ibpbr{n}", "PEER_BRIDGE_CIDR": f"172.29.{n}.1/24"}
    temporary = d is None
    if d is None:
        d = Path(tempfile.mkdtemp(prefix=f"bench-{name}-"))
    r = subprocess.run(["bash", str(PEER_SCRIPT), "up", str(d), *options], capture_output=True, text=True, env=env)

    def stop():
        subprocess.run(["bash", str(PEER_SCRIPT), "down", str(d)], capture_output=True, env=env)
        slot.close()
        if temporary:
            shutil.rmtree(d, ignore_errors=True)

    if r.returncode != 0:
        stop()
        raise PeerError(f"could not start the test peer ({name} {' '.join(options)}): {r.stderr.strip()[-500:]}")
    vals = dict(line.split("=", 1) for line in r.stdout.splitlines() if "=" in line)
    return Peer(vals["PEER_ADDR"], vals["PEER_SSH_CONFIG"], vals["PEER_DOCKER_HOST"], vals["IMAGEBUILD_SSH"].strip("'"),
                vals.get("PEER_CACHE", ""), vals.get("PEER_DATA_ROOT", ""), vals.get("PEER_VETH", ""), str(d),
                name), stop


def joint_ssh(peers: Iterable[Peer], config: Path) -> str:
    """One ssh config (written to ``config``) that reaches every one of ``peers``; returns the value for
    IMAGEBUILD_SSH."""
    config.write_text("".join(Path(p.ssh_config).read_text() + "\n" for p in peers))
    return f"ssh -F {config}"


def clear_peer(peer: Peer, *repos: str, containers: bool = True) -> None:
    """Remove from the peer every tag of ``repos`` and the staging names (imagebuild-incoming), and
    every container (unless containers=False); empty its sync cache. The base images stay."""
    out = peer.docker("image", "ls", "--format", "{{.Repository}}:{{.Tag}}").stdout.split()
    ours = [t for t in out if t.split(":")[0] in (*repos, "imagebuild-incoming")]
    if containers:
        for c in peer.docker("ps", "-aq").stdout.split():
            peer.docker("rm", "-f", c)
    if ours:
        peer.docker("image", "rm", "-f", *ours)
    if peer.cache:
        subprocess.run(["rm", "-rf", peer.cache], check=True)
        Path(peer.cache).mkdir(parents=True, exist_ok=True)


def load_leases(peer: Peer) -> list[str]:
    """The moby namespace's leases that look like a docker load's (only the gc.expire label)."""
    info = peer.docker("info", "--format", "{{json .Containerd}}").stdout
    try:
        addr = json.loads(info)["Address"]
    except (ValueError, KeyError, TypeError):
        return []
    out = subprocess.run(["ctr", "-a", addr, "-n", "moby", "leases", "ls"], capture_output=True, text=True).stdout
    rows = [ln.split() for ln in out.splitlines()[1:] if ln.strip()]
    return [r[0] for r in rows if len(r) == 3 and r[2].startswith("containerd.io/gc.expire=") and "," not in r[2]]


def put_on_peer(peer: Peer, *refs: str) -> None:
    """Copy images from the local engine to a peer's engine (set-up, not the tool)."""
    for ref in refs:
        if peer.docker("image", "inspect", ref).returncode == 0:
            continue
        save = subprocess.Popen(["docker", "save", ref], stdout=subprocess.PIPE)
        load = subprocess.run(["docker", "load"], stdin=save.stdout, capture_output=True, text=True,
                              env={**os.environ, "DOCKER_HOST": peer.docker_host})
        save.wait()
        if load.returncode != 0 or save.returncode != 0:
            raise RuntimeError(f"could not put {ref} on the peer: {load.stderr[-400:]}")


# --------------------------------------------------------------------------------------------- test images


def build_image(tag: str, ctx: Path, **args: str) -> None:
    """Build ctx/Dockerfile into this host's engine as ``tag``, without network, with build args ``args``."""
    argv = ["docker", "buildx", "build", "--network", "none", "--load", "-q", "-t", tag]
    for k, v in args.items():
        argv += ["--build-arg", f"{k}={v}"]
    subprocess.run([*argv, str(ctx)], check=True, capture_output=True)


def one_stage_project(root: Path, name: str, gate: str) -> Path:
    """A project under root with one definition ``name``: a single stage FROM the busybox base and the
    gate spec ``gate`` (the definition the sync images are gated by)."""
    d = root / "docker-images" / name
    d.mkdir(parents=True)
    (d / "versions.env").write_text(f"BASE_IMAGE={BUSYBOX}\n")
    (d / "image.yaml").write_text("platform: linux/amd64\nstages:\n  - name: base\n    from: BASE_IMAGE\n")
    (d / "Dockerfile.base").write_text("ARG PARENT\nFROM ${PARENT}\n")
    (d / "gate.yaml").write_text(gate)
    return root
