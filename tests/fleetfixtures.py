"""Helpers for the fleet tests (remote engine, registry stage cache, release tags, sync through a
registry): a private copy of the five-stage ``staged`` definition under a name unique to the test
session (a build holds an engine-wide lock per image name), a real Debian ``docker-registry`` on
loopback, and base images put on a peer's engine."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.buildfixtures import IMAGE as STAGED
from tests.buildfixtures import remove_images, staged_project
from tests.conftest import run_cli, start_peer
from tests.peers import BUSYBOX, DEBIAN, Peer, joint_ssh, put_on_peer

GATE_SPEC = """\
# a gate that needs nothing but a shell (busybox)
description: the patched greet module is in place
checks:
  - id: greet-patched
    kind: file
    path: /opt/greet/greet.py
    contains: "imagebuild-patch: greet-loud"
"""


def unique_name(prefix: str = "fleet") -> str:
    return f"{prefix}-{secrets.token_hex(3)}"


def fleet_project(dst: Path, name: str, *, gate: bool = False, greet: dict[str, str] | None = None) -> Path:
    """The ``staged`` test definition (five stages, a prefetched tarball, a patch stage) as ``name``."""
    staged_project(dst, greet=greet)
    images = dst / "docker-images"
    for other in images.iterdir():
        if other.name != STAGED:
            shutil.rmtree(other)
    d = images / name
    (images / STAGED).rename(d)
    lock = json.loads((d / "lock.json").read_text())
    lock["image"] = name
    (d / "lock.json").write_text(json.dumps(lock, indent=2, sort_keys=True, ensure_ascii=True) + "\n")
    if gate:
        (d / "gate.yaml").write_text(GATE_SPEC)
    return dst


def remove_fleet_images(name: str, *, docker_host: str | None = None) -> None:
    """Every tag this test made of ``name`` (its release repository and its tags), on the local engine
    or on ``docker_host``."""
    if docker_host is None:
        remove_images(f"imagebuild/{name}", name)
        return
    env = {**os.environ, "DOCKER_HOST": docker_host}
    for repo in (f"imagebuild/{name}", name):
        r = subprocess.run(["docker", "image", "ls", "--format", "{{.Repository}}:{{.Tag}}", repo],
                           capture_output=True, text=True, env=env)
        tags = [t for t in r.stdout.split() if t and not t.endswith(":<none>")]
        if tags:
            subprocess.run(["docker", "image", "rm", "-f", *tags], capture_output=True, env=env)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Registry:
    """A real Debian ``docker-registry`` (distribution 2.8) on 127.0.0.1, its storage under ``dir``."""

    dir: Path
    port: int
    htpasswd: Path | None = None
    proc: subprocess.Popen | None = field(default=None, repr=False)

    @property
    def addr(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def log(self) -> Path:
        return self.dir / "registry.log"

    def start(self) -> Registry:
        self.dir.mkdir(parents=True, exist_ok=True)
        auth = ""
        if self.htpasswd:
            auth = f"auth:\n  htpasswd:\n    realm: imagebuild-test\n    path: {self.htpasswd}\n"
        (self.dir / "config.yml").write_text(
            "version: 0.1\nlog:\n  level: info\n  accesslog:\n    disabled: false\n"
            f"storage:\n  filesystem:\n    rootdirectory: {self.dir / 'data'}\n  delete:\n    enabled: true\n"
            f"http:\n  addr: {self.addr}\n{auth}")
        logf = open(self.log, "ab")
        self.proc = subprocess.Popen(["docker-registry", "serve", str(self.dir / "config.yml")], stdout=logf,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        logf.close()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                    return self
            except OSError:
                if self.proc.poll() is not None:
                    break
                time.sleep(0.1)
        raise RuntimeError(f"docker-registry did not start on {self.addr}: {self.log.read_text()[-800:]}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.proc = None

    def blob_path(self, digest: str) -> Path:
        h = digest.split(":", 1)[1]
        return self.dir / "data" / "docker" / "registry" / "v2" / "blobs" / "sha256" / h[:2] / h / "data"

    def blob_gets(self) -> list[tuple[str, int]]:
        """(digest, bytes written) of every successful blob GET in the access log so far."""
        out = []
        for line in self.log.read_text(errors="replace").splitlines():
            if '"GET /v2/' not in line or "/blobs/sha256:" not in line:
                continue
            try:
                req = line.split('"GET ', 1)[1].split(" ", 1)[0]
                status, size = line.split('" ', 1)[1].split()[:2]
            except (IndexError, ValueError):
                continue
            if status in ("200", "206"):
                out.append((req.rsplit("/", 1)[1], int(size)))
        return out


def start_registry(tmp: Path, *, htpasswd: Path | None = None) -> Registry:
    if shutil.which("docker-registry") is None:
        raise RuntimeError("docker-registry not installed (scripts/testbed.sh installs it)")
    return Registry(tmp, free_port(), htpasswd).start()


def ssh_shim(tmp: Path, peer) -> dict[str, str]:
    """Environment for a test that reaches the peer's engine over ssh: IMAGEBUILD_SSH (the peer's own
    ssh config), as imagebuild sync uses it."""
    return {"IMAGEBUILD_SSH": peer.ssh_env}


# --------------------------------------------------------------------------------------------- shared by the tests

STAGES = ["base", "tools", "app", "patched", "runner"]


@pytest.fixture(scope="session", name="registry")
def registry_fixture(tmp_path_factory):
    """One real docker-registry on loopback for the session's fleet and registry-fault tests (each
    test uses its own repository names)."""
    reg = start_registry(tmp_path_factory.mktemp("registry"))
    try:
        yield reg
    finally:
        reg.stop()


@pytest.fixture(scope="session", name="peer_ready")
def peer_ready_fixture(peer, engine_info):
    """The peer's engine with the base images the definition names (put there by the test, as an
    operator would with docker save | docker load)."""
    if subprocess.run(["docker", "image", "inspect", DEBIAN], capture_output=True).returncode != 0:
        pytest.fail(f"{DEBIAN} missing (scripts/testbed.sh imports it)")
    put_on_peer(peer, BUSYBOX, DEBIAN)
    return peer


@pytest.fixture(name="node")
def node_fixture(tmp_path, monkeypatch):
    """node(label) -> a fresh stage store for the builds that follow (another node's cache). The disk
    guard asks for 1 GiB here: these builds are a few MB, and the test machine's disk is shared."""
    monkeypatch.setenv("IMAGEBUILD_MIN_FREE_GB", "1")

    def use(label: str) -> Path:
        d = tmp_path / f"stages-{label}"
        monkeypatch.setenv("IMAGEBUILD_STAGES", str(d))
        return d
    return use


def build(root: Path, name: str, *args: str) -> tuple[int, dict | None, str]:
    res = run_cli("--root", str(root), "build", name, "--json", *args)
    return res.code, (json.loads(res.out) if res.code == 0 else None), res.err


def statuses(rec: dict) -> dict:
    return {s["name"]: s["status"] for s in rec["stages"]}


def engine_of(peer) -> str:
    return f"ssh://root@{peer.addr}"


def peer_engine_id(peer) -> str:
    return peer.docker("info", "--format", "{{.ID}}").stdout.strip()


@pytest.fixture(scope="session", name="netns_peers")
def netns_peers_fixture(tmp_path_factory, engine_info):
    """Two peers whose engines live in their own network namespace (scripts/peer.sh --engine-in-netns),
    the first with the containerd image store, the second with the classic one, as on real nodes: they cannot reach this host's loopback registry, only an ssh -R tunnel on their
    own loopback. One ssh config for all of them (IMAGEBUILD_SSH)."""
    started = []
    try:
        for i, store in enumerate(([], ["--classic-store"])):  # one of each image store
            started.append(start_peer(tmp_path_factory, f"peer-ns{i}", "--engine-in-netns", *store))
        peers = [p for p, _ in started]
        yield peers, joint_ssh(peers, tmp_path_factory.mktemp("netns-ssh") / "ssh_config")
    finally:
        for _, stop in started:
            stop()


veth_tx = Peer.tx_bytes  # veth_tx(peer): bytes this host sent to the peer over its link so far
