"""The mission's commands as typed (issue 29, section 1), on a project whose ``example`` base image is
absent (no test bed imported it here): ``imagebuild prefetch``, ``imagebuild gate`` and ``imagebuild
sync PEER`` with no image, against the real engine and a real peer (tests/conftest.py).

The project: the built-in ``example`` definition with its base renamed to one no engine holds, and two
one-stage definitions on the busybox base, ``<x>a`` (its gate passes) and ``<x>b`` (its gate fails)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from imagebuild.core import identity
from tests.buildfixtures import remove_images
from tests.conftest import run_cli
from tests.peers import BUSYBOX, clear_peer
from tests.syncfixtures import _private_sync_cache, env  # noqa: F401 - fixture

pytestmark = [pytest.mark.engine, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[3]
X = f"mission{os.getpid()}"
A, B = f"{X}a", f"{X}b"
ABSENT = f"imagebuild-test/absent-{X}:bookworm"


def _definition(root: Path, name: str, gate: str) -> None:
    d = root / "docker-images" / name
    d.mkdir(parents=True)
    (d / "versions.env").write_text(f"BASE_IMAGE={BUSYBOX}\n")
    (d / "image.yaml").write_text("platform: linux/amd64\nstages:\n  - name: base\n    from: BASE_IMAGE\n")
    (d / "Dockerfile.base").write_text("ARG PARENT\nFROM ${PARENT}\n")
    (d / "gate.yaml").write_text(gate)


@pytest.fixture(scope="module")
def root(engine_info, tmp_path_factory):
    r = tmp_path_factory.mktemp("mission") / "project"
    shutil.copytree(REPO / "docker-images" / "example", r / "docker-images" / "example")
    env_file = r / "docker-images" / "example" / "versions.env"
    env_file.write_text(env_file.read_text().replace("BASE_IMAGE=imagebuild-test/debian:bookworm",
                                                     f"BASE_IMAGE={ABSENT}"))
    assert ABSENT in env_file.read_text()
    assert subprocess.run(["docker", "image", "inspect", ABSENT], capture_output=True).returncode != 0
    _definition(r, A, "checks:\n  - {id: busybox, kind: file, path: /bin/busybox}\n")
    _definition(r, B, "checks:\n  - {id: missing, kind: file, path: /no/such/file}\n")
    yield r
    remove_images(A, B)


@pytest.fixture(scope="module")
def prefetched(root):
    return run_cli("--root", str(root), "prefetch")


def test_prefetch_alone_goes_on_past_example(root, prefetched):
    r = prefetched
    assert r.code == 1, r.err + r.out
    lines = r.out.splitlines()
    # one line per image, in name order: example failed (its base is nowhere), the two others prefetched
    assert lines[0].startswith(f"example: failed (exit 1)  docker-images/example/versions.env: BASE_IMAGE: "
                               f"cannot resolve {ABSENT} to a digest"), r.out
    assert lines[1].startswith(f"{A}: unchanged  lock docker-images/{A}/lock.json  build id "), r.out
    assert any(ln.startswith(f"{B}: unchanged  lock docker-images/{B}/lock.json  build id ") for ln in lines), r.out
    # the error in full (with its hint) is on stderr; the images after it have their locks
    assert f"error: docker-images/example/versions.env: BASE_IMAGE: cannot resolve {ABSENT}" in r.err
    for name in (A, B):
        lock = json.loads((root / "docker-images" / name / "lock.json").read_text())
        assert lock["images"]["BASE_IMAGE"]["name"] == BUSYBOX.split(":")[0]
    assert not (root / "docker-images" / "example" / "lock.json").exists()
    j = run_cli("--root", str(root), "prefetch", "--json")
    doc = json.loads(j.out)
    assert j.code == 1 and doc["exit_code"] == 1
    rows = {i["image"]: i for i in doc["images"]}
    assert rows["example"]["status"] == "failed" and rows["example"]["error"]["exit_code"] == 1
    assert rows[A]["status"] == "unchanged" and rows[A]["error"] is None


def test_prefetch_alone_worst_exit_code_is_a_broken_definition(root, prefetched, tmp_path):
    broken = tmp_path / "p"
    shutil.copytree(root, broken)
    (broken / "docker-images" / B / "image.yaml").write_text("platform: linux/amd64\nstages: 7\n")
    r = run_cli("--root", str(broken), "prefetch")
    assert r.code == 2, r.err + r.out
    assert f"{B}: failed (exit 2)  image definition '{B}' has 1 problem" in r.out
    assert f"{A}: unchanged" in r.out and "example: failed (exit 1)" in r.out


@pytest.fixture(scope="module")
def built(root, prefetched):
    for name in (A, B):
        r = run_cli("--root", str(root), "build", name, "--no-gate", "--progress", "plain")
        assert r.code == 0, r.err + r.out
    return root


@pytest.fixture(scope="module")
def gated(built):
    return run_cli("--root", str(built), "gate")


def test_gate_alone_gates_what_was_built_and_not_yet_gated(built, gated):
    r = gated
    assert r.code == 4, r.err + r.out  # b's gate failed: the worst code
    tail = r.out.splitlines()[-3:]
    assert tail[0] == "example: skipped: no build recorded here (imagebuild build example)", r.out
    assert tail[1].startswith(f"{A}: passed {A}:b-") and tail[1].endswith(
        f": 1 passed, 0 failed, 0 skipped of 1; :local unchanged: imagebuild build {A} promotes it"), r.out
    assert tail[2].startswith(f"{B}: failed {B}:b-") and ": 0 passed, 1 failed, 0 skipped of 1" in tail[2], r.out
    assert "PASSED: 1 passed" in r.out and "FAILED: 0 passed, 1 failed" in r.out  # each gate's table
    # a second run: nothing left to gate, each said
    again = run_cli("--root", str(built), "gate", "--json")
    assert again.code == 0, again.err + again.out
    doc = json.loads(again.out)
    assert doc["schema"] == "imagebuild.gate-pending" and doc["exit_code"] == 0
    rows = {x["image"]: x for x in doc["images"]}
    assert rows["example"]["status"] == "skipped"
    assert rows[A]["status"] == "already-gated" and "already gated: passed (receipt " in rows[A]["detail"]
    assert rows[B]["status"] == "already-gated" and "already gated: failed (receipt " in rows[B]["detail"]
    # the flags that need an image say so
    bad = run_cli("--root", str(built), "gate", "--ref", f"{A}:candidate")
    assert bad.code == 2 and "--ref needs an IMAGE or REF" in bad.err


@pytest.fixture(scope="module")
def promoted(built, gated):
    r = run_cli("--root", str(built), "build", A, "--progress", "plain")  # the passing receipt promotes it
    assert r.code == 0, r.err + r.out
    return built


def test_sync_peer_alone_sends_every_promoted_local(promoted, peer):
    root = promoted
    clear_peer(peer, A, B)
    with env(IMAGEBUILD_SSH=peer.ssh_env):
        r = run_cli("--root", str(root), "sync", peer.addr)
        wrong = run_cli("--root", str(root), "sync", A)
        nothing = run_cli("--root", str(root), "sync", peer.addr, "--dry-run")
    assert r.code == 0, r.err + r.out
    tail = r.out.splitlines()[-3:]
    assert tail[0].startswith("example: skipped: "), r.out  # no example:local here, or not promoted here
    assert tail[1] == f"{A}: ok: {A}:local: {peer.addr} synced", r.out
    assert tail[2] == f"{B}: skipped: no {B}:local in the engine (never promoted here)", r.out
    got = peer.docker("image", "inspect", f"{A}:local")
    assert got.returncode == 0
    assert identity.from_inspect(json.loads(got.stdout)[0]).digest == identity.inspect(f"{A}:local").digest
    # an image's name where the peer goes: exit 2, with the right form
    assert wrong.code == 2
    assert f"error: '{A}' is an image of this project (docker-images/{A}/), not a peer" in wrong.err
    assert f"hint: imagebuild sync --image {A} PEER" in wrong.err
    assert nothing.code == 0 and f"{A}: ok: {A}:local: {peer.addr} unchanged" in nothing.out
    clear_peer(peer, A, B)
