"""linux/arm64 end to end on an x86-64 host, under QEMU user-mode emulation (issue 32): prefetch of real
arm64 debs (apt runs in the arm64 base under emulation) and real aarch64 wheels, `build --emulate` with
every stage under --network none, the gate in a container of the arm64 image (its receipt records the
emulation), promotion, and sync to a real peer whose kernel can run it. And the refusals: `--emulate`
for a platform no handler runs, and the gate of such an image.

The arm64 base and the aarch64 handler come from scripts/testbed.sh; where emulation cannot be set up
there, these tests skip with its reason (and fail in CI, where the test bed must provide them)."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest

from imagebuild.core import emulation
from tests.conftest import FIXTURES, _engine_required, run_cli
from tests.syncfixtures import env

pytestmark = [pytest.mark.engine, pytest.mark.slow]

ARM64_BASE = "imagebuild-test/debian-arm64:bookworm"
IMG = "ib-arm64"


def _need(cond: bool, msg: str) -> None:
    if cond:
        return
    if _engine_required() and os.environ.get("IMAGEBUILD_ARM64") != "0":
        pytest.fail(msg + " (scripts/testbed.sh sets it up; IMAGEBUILD_ARM64=0 skips the arm64 lane on purpose)")
    pytest.skip(msg)


@pytest.fixture(scope="module")
def arm64_base(engine_info):
    if os.environ.get("IMAGEBUILD_ARM64") == "0":
        pytest.skip("IMAGEBUILD_ARM64=0")
    h = emulation.handler_for("arm64")
    _need(emulation.docker_arch(engine_info.architecture or "") == "arm64" or (h is not None and h.in_containers),
          "no aarch64 binfmt handler with the F flag on this kernel")
    _need(subprocess.run(["docker", "image", "inspect", ARM64_BASE], capture_output=True).returncode == 0,
          f"{ARM64_BASE} missing")
    return ARM64_BASE


@pytest.fixture(scope="module")
def lane(tmp_path_factory, arm64_base):
    """The fixture project after prefetch and `build --emulate` (gated, promoted)."""
    root = tmp_path_factory.mktemp("arm64") / "project"
    shutil.copytree(FIXTURES / "arm64", root)
    state = tmp_path_factory.mktemp("arm64-state")
    with env(IMAGEBUILD_STATE_DIR=str(state)):
        pre = run_cli("--root", str(root), "prefetch", IMG, "--json")
        assert pre.code == 0, pre.err
        # no --emulate: refused before anything runs, saying how
        refused = run_cli("--root", str(root), "build", IMG)
        assert refused.code == 3 and "--emulate" in refused.err, refused.err
        built = run_cli("--root", str(root), "build", IMG, "--emulate", "--json")
    yield root, state, json.loads(pre.out), built
    subprocess.run(["docker", "image", "rm", f"{IMG}:local", f"{IMG}:previous", f"{IMG}:candidate"],
                   capture_output=True)


def test_prefetch_takes_arm64_debs_and_aarch64_wheels(lane):
    root, _, _, _ = lane
    lock = json.loads((root / "docker-images" / IMG / "lock.json").read_text())
    debs = [d["file"] if isinstance(d, dict) and "file" in d else str(d) for d in
            json.dumps(lock.get("apt", {})).split('"') if str(d).endswith(".deb")]
    assert debs and all("_arm64.deb" in d or "_all.deb" in d for d in debs), debs
    wheels = json.dumps(lock.get("wheels", {}))
    assert "aarch64" in wheels and "x86_64" not in wheels


def test_build_gate_promote_under_emulation(lane):
    root, state, _, built = lane
    assert built.code == 0, built.err
    doc = json.loads(built.out)
    assert doc.get("promoted") or doc.get("result") in ("passed", "promoted") or "local" in json.dumps(doc)
    inspect = json.loads(subprocess.run(["docker", "image", "inspect", f"{IMG}:local"], capture_output=True,
                                        check=True).stdout)[0]
    assert inspect["Architecture"] == "arm64"
    # the receipt says the gate ran under emulation, and how
    receipts = [json.loads(p.read_text()) for p in (state / "receipts").rglob("*.json")]
    (rec,) = [r for r in receipts if r.get("image", {}).get("definition") == IMG and r.get("result") == "passed"]
    emu = rec["emulated"]
    assert emu["image_arch"] == "arm64" and emu["host_arch"] == emulation.docker_arch(os.uname().machine)
    assert "qemu-aarch64" in emu["how"] or "lists linux/arm64" in emu["how"]
    assert emu["cpuinfo"]
    outcomes = {c["id"]: c["outcome"] for c in rec["checks"]}
    assert outcomes["runs-as-aarch64"] == "passed" and outcomes["extensions-aarch64"] == "passed"
    assert outcomes["cpuinfo-is-aarch64"] == "passed"


def test_the_arm64_image_syncs_to_a_peer_that_can_run_it(lane, peer):
    root, state, _, built = lane
    assert built.code == 0, built.err
    with env(IMAGEBUILD_STATE_DIR=str(state), IMAGEBUILD_SSH=peer.ssh_env):
        r = run_cli("--root", str(root), "sync", peer.addr, "--image", IMG, "--json")
    assert r.code == 0, r.err
    (p,) = json.loads(r.out)["peers"]
    assert p["status"] in ("synced", "unchanged"), p
    out = peer.docker("run", "--rm", "--pull", "never", "--platform", "linux/arm64", f"{IMG}:local", "uname", "-m")
    assert out.stdout.strip() == "aarch64", out.stderr


# ------------------------------------------------------------------------------ a platform nothing runs


def _foreign_arch() -> str | None:
    """An architecture this kernel has no enabled handler for (the test bed enables aarch64 alone)."""
    for arch in ("riscv64", "s390x", "ppc64le"):
        if emulation.handler_for(arch) is None:
            return arch
    return None


def _import(tag: str, platform: str) -> None:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        data = b"#!/bin/sh\necho hi\n"
        info = tarfile.TarInfo("bin/sh")
        info.size, info.mode = len(data), 0o755
        tar.addfile(info, io.BytesIO(data))
    subprocess.run(["docker", "import", "--platform", platform, "-", tag], input=buf.getvalue(), check=True,
                   capture_output=True)


def test_emulate_without_a_handler_is_refused_with_how_to_register(project, engine_info):
    arch = _foreign_arch()
    if arch is None:
        pytest.skip("every candidate architecture has a handler on this kernel")
    tag = f"imagebuild-test/noemu-{arch}:t{os.getpid()}"
    _import(tag, f"linux/{arch}")
    try:
        d = project / "docker-images" / "tiny"
        (d / "image.yaml").write_text((d / "image.yaml").read_text().replace("platform: linux/amd64",
                                                                            f"platform: linux/{arch}"))
        envf = d / "versions.env"
        envf.write_text(envf.read_text().replace("BASE_IMAGE=imagebuild-test/busybox:1", f"BASE_IMAGE={tag}"))
        r = run_cli("--root", str(project), "build", "tiny", "--emulate")
        assert r.code == 3, r.err
        assert f"the engine cannot run linux/{arch} code" in r.err
        assert "binfmt_misc" in r.err and f"update-binfmts --enable qemu-{emulation.qemu_name(arch)}" in r.err
        assert "Traceback" not in r.err
        # the gate of such an image is refused the same way, before any container starts
        spec = project / "adhoc-gate.yaml"
        spec.write_text("checks:\n  - id: sh\n    kind: command\n    run: /bin/sh -c true\n")
        g = run_cli("gate", tag, "--spec", str(spec))
        assert g.code == 3 and f"the engine cannot run linux/{arch} code" in g.err, g.err
    finally:
        subprocess.run(["docker", "image", "rm", tag], capture_output=True)


def test_the_kernel_table_is_read_as_the_kernel_wrote_it():
    """The handler the test bed registered is found by the ELF header of an aarch64 executable, and
    matches the interpreter file the kernel names."""
    h = emulation.handler_for("arm64")
    if h is None:
        pytest.skip("no aarch64 handler on this kernel")
    assert Path(h.interpreter).exists() and h.enabled
    assert emulation.handler_for("amd64") is None or emulation.handler_for("amd64") != h


def test_sync_refuses_a_peer_that_cannot_run_the_image(tmp_path, peer, engine_info):
    """A peer whose engine is another architecture and whose kernel has no handler for the image's: refused
    before anything is sent (exit 3), naming both architectures. (The peer shares this kernel, so the
    architecture is one the test bed registers no handler for.)"""
    arch = _foreign_arch()
    if arch is None:
        pytest.skip("every candidate architecture has a handler on this kernel")
    tag = f"imagebuild-test/noemu-{arch}:s{os.getpid()}"
    _import(tag, f"linux/{arch}")
    try:
        before = peer.link_bytes()
        with env(IMAGEBUILD_STATE_DIR=str(tmp_path / "state"), IMAGEBUILD_SSH=peer.ssh_env):
            r = run_cli("sync", peer.addr, "--image", tag, "--force", "--json")
        assert r.code == 3, r.out + r.err
        (p,) = json.loads(r.out)["peers"]
        assert p["status"] == "refused"
        assert f"is linux/{arch} and the peer's engine runs linux/amd64" in p["message"]
        assert f"no enabled binfmt_misc handler for {emulation.qemu_name(arch)}" in p["message"]
        assert peer.link_bytes() - before < 1 << 20  # the probe's few KB, no layer
        assert peer.docker("image", "inspect", tag).returncode != 0
    finally:
        subprocess.run(["docker", "image", "rm", tag], capture_output=True)
