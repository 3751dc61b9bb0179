"""What the sync tests share: a project with one gated definition, its images in the local engine,
and helpers to drive `imagebuild sync` against the real peers (tests/conftest.py: peer, peer_classic,
peer_small, peer_nodocker). Every image name carries this process's pid; everything is removed at
the end of the session."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from imagebuild.core import identity
from tests.conftest import run_cli
from tests.peers import (
    BUSYBOX,
    Peer,
    build_image,
    clear_peer,
    load_leases,  # noqa: F401 - the tests import it from here
    one_stage_project,
)

REPO = Path(__file__).resolve().parents[1]
NAME = f"synct{os.getpid()}"

DOCKERFILE = f"""\
FROM {BUSYBOX}
ARG BIG=8000000
RUN mkdir -p /data && head -c $BIG /dev/urandom > /data/big.bin
ARG V=1
RUN echo "version $V" > /data/version && head -c 50000 /dev/urandom > /data/top.bin
CMD ["sh"]
"""

GATE = """\
checks:
  - {id: version-file, kind: file, path: /data/version, contains: version}
"""


@dataclass
class SyncImages:
    root: Path
    name: str
    v1: str
    v2: str
    big: str  # a 300 MB incompressible layer: time to kill a transfer half-way
    big2: str  # big with another top layer
    ungated: str
    local: str

    def set_local(self, ref: str) -> None:
        subprocess.run(["docker", "tag", ref, self.local], check=True, capture_output=True)


def gate(root: Path, name: str, ref: str) -> None:
    r = run_cli("--root", str(root), "gate", name, "--ref", ref)
    assert r.code == 0, r.err + r.out


@pytest.fixture(scope="session", name="sync_images")
def sync_images_fixture(engine_info, tmp_path_factory):
    root = one_stage_project(tmp_path_factory.mktemp("syncproject"), NAME, GATE)
    ctx = tmp_path_factory.mktemp("syncctx")
    (ctx / "Dockerfile").write_text(DOCKERFILE)
    repo = f"imagebuild-test/{NAME}"
    imgs = SyncImages(root, NAME, f"{repo}:v1", f"{repo}:v2", f"{repo}:big", f"{repo}:big2", f"{repo}:ungated",
                      f"{NAME}:local")
    try:
        build_image(imgs.v1, ctx, V="1")
        build_image(imgs.v2, ctx, V="2")
        build_image(imgs.ungated, ctx, V="3")
        build_image(imgs.big, ctx, BIG="300000000", V="1")
        build_image(imgs.big2, ctx, BIG="300000000", V="2")
        for ref in (imgs.v1, imgs.v2, imgs.big, imgs.big2):
            gate(root, NAME, ref)
        imgs.set_local(imgs.v1)
        yield imgs
    finally:
        subprocess.run(["docker", "image", "rm", "-f", imgs.v1, imgs.v2, imgs.big, imgs.big2, imgs.ungated,
                        imgs.local, f"{NAME}:previous"], capture_output=True)


@pytest.fixture(autouse=True, scope="session")
def _private_sync_cache(tmp_path_factory):
    """The spool and the verified-file list of this session's syncs: never the developer's cache."""
    with env(XDG_CACHE_HOME=str(tmp_path_factory.mktemp("xdgcache"))):
        yield


@contextmanager
def env(**values: str | None):
    old = {k: os.environ.get(k) for k in values}
    for k, v in values.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def sync(imgs: SyncImages, peer: Peer, *args: str, ssh: str | None = None, source: str | None = None):
    """`imagebuild sync` in-process; returns (Result, report dict or None)."""
    with env(IMAGEBUILD_SSH=ssh or peer.ssh_env, DOCKER_HOST=source):
        r = run_cli("--root", str(imgs.root), "sync", *args, "--json")
    try:
        doc = json.loads(r.out)
    except ValueError:
        doc = None
    return r, doc


def sync_proc(imgs: SyncImages, peer: Peer, *args: str, extra_env: dict | None = None) -> subprocess.Popen:
    """`imagebuild sync` as its own process (to time it, or to kill it)."""
    e = {**os.environ, "IMAGEBUILD_SSH": peer.ssh_env, **(extra_env or {})}
    return subprocess.Popen([sys.executable, "-m", "imagebuild", "--root", str(imgs.root), "sync", *args, "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, env=e,
                            start_new_session=True)


def finish(proc: subprocess.Popen, timeout: float = 600) -> tuple[int, dict | None, str]:
    out, err = proc.communicate(timeout=timeout)
    try:
        doc = json.loads(out)
    except ValueError:
        doc = None
    return proc.returncode, doc, err


def reset(peer: Peer, *names: str) -> None:
    """Remove this session's images from the peer (every tag of our repositories and staging names) and
    empty its sync cache."""
    clear_peer(peer, *names, NAME, f"imagebuild-test/{NAME}")


def peer_identity(peer: Peer, ref: str) -> str | None:
    r = peer.docker("image", "inspect", ref)
    if r.returncode != 0:
        return None
    return identity.from_inspect(json.loads(r.stdout)[0]).digest


def peer_id(peer: Peer, ref: str) -> str | None:
    r = peer.docker("image", "inspect", "--format", "{{.Id}}", ref)
    return r.stdout.strip() if r.returncode == 0 else None


def listed(peer: Peer, ref: str) -> bool:
    repo, _, tag = ref.rpartition(":")
    rows = peer.docker("image", "ls", "--format", "{{.Repository}}:{{.Tag}}", repo).stdout.split()
    return ref in rows


def runs(peer: Peer, ref: str) -> str:
    r = peer.docker("run", "--rm", "--pull", "never", "--network", "none", ref, "cat", "/data/version")
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def cache_files(peer: Peer, *subdirs: str) -> list[str]:
    base = Path(peer.cache)
    out = []
    for sub in subdirs or ("incoming", "partial", "stage", "pending", "tmp", "attempts"):
        d = base / sub
        if d.is_dir():
            out += [str(p.relative_to(base)) for p in d.rglob("*")]
    return out


def wait_for(pred, timeout: float = 60, every: float = 0.02):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(every)
    raise AssertionError("timed out waiting")
