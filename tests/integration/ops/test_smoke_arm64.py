"""The arm64 smoke lane (`make smoke-arm64`): glm53-jovian-r12's stage chain for linux/arm64, built on this
x86-64 machine under QEMU user-mode emulation with PyPI's real aarch64 wheels (issue 32).

The test-only definition (tests/fixtures/smoke-arm64/docker-images/glm53-smoke-arm64) takes the real
definition's Dockerfile.torch, Dockerfile.b12x-wheel and both requirement files as they are:
  - torch 2.13.0 (PyPI's aarch64 wheel is the CUDA 13.0 build), flashinfer-python 0.6.17 and the runner's
    set, resolved and prefetched by imagebuild for linux/arm64, CPython 3.11 (bookworm's; Debian has no
    3.12 for arm64);
  - the sources are the public snapshots of vLLM (28be48fa) and b12x (36bce2c1), served from a loopback git
    daemon as the real remotes; the b12x wheel is the real one, the vLLM wheel has no kernels
    (VLLM_TARGET_DEVICE=empty);
  - the base is the test bed's arm64 Debian bookworm (STAND-IN for the CUDA 13.2 Ubuntu base);
  - every stage with --network none, under emulation (`build --emulate`); the gate runs under emulation
    too, and what needs a GPU is skipped, never passed.
Then the runner is synced to a real peer and run there.

About 7 GB of downloads and 40-60 minutes on the 2-core machine (apt and pip under QEMU): only under
`make smoke-arm64` (IMAGEBUILD_SMOKE_ARM64=1), not in CI. It prints its timings, sizes and gate table.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from tests import realtrees
from tests.conftest import run_cli
from tests.gitfixtures import GitDaemon, UpstreamFactory, free_port
from tests.syncfixtures import env

ROOT = realtrees.ROOT
IMAGE = "glm53-smoke-arm64"
SMOKE = ROOT / "tests" / "fixtures" / "smoke-arm64"
REAL = ROOT / "docker-images" / "glm53-jovian-r12"
REUSED = ("Dockerfile.torch", "Dockerfile.b12x-wheel", "files/cuda13-wheel-links.sh",
          "requirements-torch.txt", "requirements-runner.txt")
ARM64_BASE = "imagebuild-test/debian-arm64:bookworm"

pytestmark = [pytest.mark.skipif(os.environ.get("IMAGEBUILD_SMOKE_ARM64") != "1",
                                 reason="the arm64 smoke lane runs from `make smoke-arm64` (IMAGEBUILD_SMOKE_ARM64=1): "
                                        "about 7 GB and 40-60 minutes under QEMU"),
              pytest.mark.engine, pytest.mark.slow]


def _project(base: Path) -> Path:
    root = base / "project"
    shutil.copytree(SMOKE / "docker-images", root / "docker-images")
    shutil.copytree(ROOT / "patches-eugr", root / "patches-eugr")
    img = root / "docker-images" / IMAGE
    for rel in REUSED:  # the real definition's own files, unchanged
        (img / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REAL / rel, img / rel)
    return root


def _remove_images() -> None:
    out = subprocess.run(["docker", "image", "ls", "--format", "{{.Repository}}:{{.Tag}}"],
                         capture_output=True, text=True).stdout.split()
    mine = [r for r in out if r.startswith((f"imagebuild/{IMAGE}:", f"{IMAGE}:"))]
    if mine:
        subprocess.run(["docker", "image", "rm", "-f", *mine], capture_output=True)


def _du(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def test_arm64_smoke_lane_with_the_real_wheels(engine_ready, tmp_path, monkeypatch, peer):
    if subprocess.run(["docker", "image", "inspect", ARM64_BASE], capture_output=True).returncode != 0:
        pytest.fail(f"{ARM64_BASE} missing: scripts/testbed.sh imports it where emulation can be set up")
    trees = tmp_path / "trees"
    vllm_tree = realtrees.extract(realtrees.VLLM, trees)
    b12x_tree = realtrees.extract(realtrees.B12X, trees)
    served = tmp_path / "served"
    served.mkdir()
    state = Path(os.environ.get("IMAGEBUILD_SMOKE_ARM64_STATE") or tmp_path / "state")
    monkeypatch.setenv("IMAGEBUILD_STATE_DIR", str(state))
    timings: dict[str, float] = {}
    with GitDaemon(served) as d:
        f = UpstreamFactory(served, d)
        vllm = f.create("local-inference-lab/vllm")
        realtrees.stand_in_commit(vllm, vllm_tree, "dev/jovian-judgement")
        b12x = f.create("local-inference-lab/b12x")
        realtrees.stand_in_commit(b12x, b12x_tree, "master")
        monkeypatch.setenv("GIT_CONFIG_COUNT", "1")
        monkeypatch.setenv("GIT_CONFIG_KEY_0", f"url.git://127.0.0.1:{d.port}/.insteadOf")
        monkeypatch.setenv("GIT_CONFIG_VALUE_0", "https://github.com/")
        monkeypatch.setenv("IMAGEBUILD_GITHUB_API", f"http://127.0.0.1:{free_port()}")
        root = _project(tmp_path)
        t0 = time.monotonic()
        r = run_cli("--root", str(root), "prefetch", IMAGE, "--cache", str(tmp_path / "cache"), "--json")
        timings["prefetch"] = time.monotonic() - t0
        print(r.err[-3000:])
        assert r.code == 0, r.err[-4000:]
    lock = json.loads((root / "docker-images" / IMAGE / "lock.json").read_text())
    wheels = {st: v["files"] for st, v in lock["wheels"].items()}
    assert all("x86_64" not in w["filename"] for ws in wheels.values() for w in ws)
    deps = root / "deps-src" / IMAGE
    sizes = {"downloaded (deps-src)": _du(deps)}
    # a wheel the runner installs from the torch stage is recorded in both stages (from_stage), stored once:
    # listed once
    largest = sorted({(w.get("size") or 0, w["filename"]) for ws in wheels.values() for w in ws}, reverse=True)[:8]
    monkeypatch.setenv("IMAGEBUILD_MIN_FREE_GB", os.environ.get("IMAGEBUILD_MIN_FREE_GB", "2"))
    try:
        t0 = time.monotonic()
        b = run_cli("--root", str(root), "build", IMAGE, "--emulate", "--json")
        timings["build (5 stages, --network none, emulated) + gate"] = time.monotonic() - t0
        print(b.err[-6000:])
        assert b.code == 0, b.err[-4000:]
        rec = json.loads(b.out)
        assert [s["name"] for s in rec["stages"]] == ["apt", "torch", "vllm-wheel", "b12x-wheel", "runner"]
        assert all(s["network"] in (False, "none") for s in rec["stages"])
        assert rec["promotion"]["status"] == "promoted", rec["promotion"]
        stage_s = {s["name"]: round(s.get("seconds") or 0, 1) for s in rec["stages"]}
        receipt = [json.loads(p.read_text()) for p in (state / "receipts").rglob("*.json")]
        (rc,) = [x for x in receipt if x.get("image", {}).get("definition") == IMAGE and x["result"] == "passed"]
        assert rc["emulated"]["image_arch"] == "arm64"
        table = {c["id"]: c["outcome"] + (" (requires a GPU)" if c["requires_gpu"] else "") for c in rc["checks"]}
        assert table["device-capability"] == "skipped (requires a GPU)"
        inspect = json.loads(subprocess.run(["docker", "image", "inspect", f"{IMAGE}:local"], capture_output=True,
                                            check=True).stdout)[0]
        sizes["image (uncompressed)"] = inspect.get("Size") or 0
        # the runner reaches a peer, verified there
        t0 = time.monotonic()
        with env(IMAGEBUILD_SSH=peer.ssh_env):
            s = run_cli("--root", str(root), "sync", peer.addr, "--json")
        timings["sync to a peer"] = time.monotonic() - t0
        assert s.code == 0, s.err[-3000:]
        out = peer.docker("run", "--rm", "--pull", "never", "--platform", "linux/arm64", f"{IMAGE}:local",
                          "python3", "-c", "import b12x, platform; print(platform.machine())")
        assert out.stdout.strip().endswith("aarch64"), out.stderr
    finally:
        _remove_images()
        shutil.rmtree(trees, ignore_errors=True)
        shutil.rmtree(served, ignore_errors=True)
    summary = {"timings_s": {k: round(v, 1) for k, v in timings.items()}, "stages_s": stage_s,
               "sizes_gb": {k: round(v / 1e9, 2) for k, v in sizes.items()},
               "wheels_per_stage": {k: len(v) for k, v in wheels.items()},
               "largest_wheels": [f"{n} ({s / 1e6:.0f} MB)" for s, n in largest],
               "gate": table}
    print("SMOKE ARM64", json.dumps(summary, indent=2))
