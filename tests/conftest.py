"""Shared fixtures.

Tests that need a Docker engine use the ``engine`` fixture. When no engine answers they are
skipped on a developer's laptop, but FAIL when IMAGEBUILD_REQUIRE_ENGINE=1 (set by `make test`
after scripts/testbed.sh made sure an engine runs) or in CI (CI=true): a missing engine must
never pass silently.
"""

from __future__ import annotations

import hashlib
import io
import os
import shutil
import subprocess
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import dataclass
from pathlib import Path

import pytest

from imagebuild import cli, engine

FIXTURES = Path(__file__).parent / "fixtures"
BUSYBOX = "imagebuild-test/busybox:1"
DEBIAN = "imagebuild-test/debian:bookworm"


@dataclass
class Result:
    code: int
    out: str
    err: str


def run_cli(*argv: str) -> Result:
    """Run the CLI in-process (main(argv) -> exit code), capturing stdout and stderr."""
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        try:
            code = cli.main(list(argv))
        except SystemExit as exc:  # argparse's --help / usage errors
            code = exc.code if isinstance(exc.code, int) else 1
    return Result(code, out.getvalue(), err.getvalue())


@pytest.fixture
def project(tmp_path) -> Path:
    """A private copy of the test project (tests/fixtures/project)."""
    dst = tmp_path / "project"
    shutil.copytree(FIXTURES / "project", dst, symlinks=True)
    return dst


def tree_state(root: Path) -> dict[str, str]:
    """Every file under root with its content digest: to prove a command wrote nothing."""
    state = {}
    for p in sorted(root.rglob("*")):
        if p.is_symlink():
            state[str(p.relative_to(root))] = "L:" + os.readlink(p)
        elif p.is_file():
            try:
                state[str(p.relative_to(root))] = hashlib.sha256(p.read_bytes()).hexdigest()
            except PermissionError:
                state[str(p.relative_to(root))] = "unreadable"
        elif p.is_dir():
            state[str(p.relative_to(root)) + "/"] = "dir"
    return state


def _engine_required() -> bool:
    return os.environ.get("IMAGEBUILD_REQUIRE_ENGINE") == "1" or os.environ.get("CI") == "true"


@pytest.fixture(scope="session")
def engine_info():
    info = engine.probe()
    if not info.reachable:
        msg = f"no Docker engine: {info.detail} (run scripts/testbed.sh, or `make test`)"
        if _engine_required():
            pytest.fail(msg + " -- an engine is required here (IMAGEBUILD_REQUIRE_ENGINE=1 or CI)")
        pytest.skip(msg)
    for base in (BUSYBOX,):
        r = subprocess.run(["docker", "image", "inspect", base], capture_output=True)
        if r.returncode != 0:
            msg = f"base image {base} missing (scripts/testbed.sh imports it)"
            if _engine_required():
                pytest.fail(msg)
            pytest.skip(msg)
    return info


@pytest.fixture
def engine_ready(engine_info):
    return engine_info


@dataclass
class Peer:
    addr: str
    ssh_config: str
    docker_host: str
    ssh_env: str  # value for IMAGEBUILD_SSH

    def docker(self, *args: str, **kw) -> subprocess.CompletedProcess:
        """Run docker against the peer's own engine (directly, not over ssh)."""
        env = {**os.environ, "DOCKER_HOST": self.docker_host}
        return subprocess.run(["docker", *args], env=env, capture_output=True, text=True, **kw)


@pytest.fixture(scope="session")
def peer(tmp_path_factory):
    """A real peer node: own network namespace (10.77.0.2), sshd, own Docker engine (scripts/peer.sh).

    One per test session; stopped by pid at the end.
    """
    script = Path(__file__).resolve().parents[1] / "scripts" / "peer.sh"
    d = tmp_path_factory.mktemp("peer")
    r = subprocess.run(["bash", str(script), "up", str(d)], capture_output=True, text=True)
    if r.returncode != 0:
        msg = f"could not start the test peer: {r.stderr.strip()[-500:]}"
        if _engine_required():
            pytest.fail(msg)
        pytest.skip(msg)
    vals = dict(line.split("=", 1) for line in r.stdout.splitlines() if "=" in line)
    try:
        yield Peer(vals["PEER_ADDR"], vals["PEER_SSH_CONFIG"], vals["PEER_DOCKER_HOST"],
                   vals["IMAGEBUILD_SSH"].strip("'"))
    finally:
        subprocess.run(["bash", str(script), "down", str(d)], capture_output=True)


@pytest.fixture(scope="session", autouse=True)
def _shared_stage_store(tmp_path_factory):
    """One stage store (state.stages_dir) for the whole test session: stage images are keyed by
    content, so every test's private project copy reuses what an earlier test built, as two clones
    on one build node do. A developer's own ~/.cache/imagebuild/stages is never touched."""
    old = os.environ.get("IMAGEBUILD_STAGES")
    os.environ["IMAGEBUILD_STAGES"] = str(tmp_path_factory.mktemp("stages"))
    yield
    if old is None:
        os.environ.pop("IMAGEBUILD_STAGES", None)
    else:
        os.environ["IMAGEBUILD_STAGES"] = old
