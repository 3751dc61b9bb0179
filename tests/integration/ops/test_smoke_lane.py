"""The smoke lane (`make smoke`): the real sources built here, offline, as far as the machine allows.

A test-only definition (tests/fixtures/smoke/docker-images/glm53-smoke) reuses glm53-jovian-r12's
repository URLs, build settings and stages: apt -> torch -> vllm-wheel -> b12x-wheel -> runner,
with the real definition's Dockerfile.apt, Dockerfile.torch and Dockerfile.b12x-wheel copied in as
they are. On this x86-64 machine without CUDA or GitHub:

  - the sources are the public snapshots of vLLM (28be48fa) and b12x (36bce2c1), served from a
    loopback git daemon as the https://github.com/local-inference-lab/ remotes (STAND-IN commits,
    on the branches the real pins follow); prefetch packs them as it would the real ones;
  - the base is the Debian bookworm test image, amd64, CPython 3.11 (STAND-IN for CUDA 13.2 arm64);
  - torch is 2.13.0+cpu from a local file index (STAND-IN for the cu130 index, unreachable here);
    everything else comes from PyPI and Debian's archive through the package prefetch;
  - the b12x wheel is the real one (pure Python); the vLLM wheel is built with
    VLLM_TARGET_DEVICE=empty (no kernels, so no CMake and no FetchContent dependency), from the
    prefetched tarball, after the patches of patches-eugr that fit the snapshot;
  - the runner installs both, and the gate imports them;
  - then the whole chain is built again with --no-cache: every stage's manifest and the release's
    identity must come out the same (a difference fails naming the files that differ).

Every stage runs with --network none. Runs under `make smoke` (IMAGEBUILD_SMOKE=1) and in CI (CI=true),
skipped otherwise: about 6 minutes on the 2-core machine (measured 5 min 47 s: prefetch 14 s, build
and gate 288 s) and about 300 MB of downloads. It prints its timings.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from tests import realtrees, reprocheck
from tests.conftest import run_cli
from tests.gitfixtures import GitDaemon, UpstreamFactory, free_port

ROOT = realtrees.ROOT
IMAGE = "glm53-smoke"
SMOKE = ROOT / "tests" / "fixtures" / "smoke"
REAL = ROOT / "docker-images" / "glm53-jovian-r12"
REUSED = ("Dockerfile.apt", "Dockerfile.torch", "Dockerfile.b12x-wheel", "files/cuda13-wheel-links.sh")
TORCH_WHEEL_DIRS = (os.environ.get("IMAGEBUILD_SMOKE_WHEELS", ""), "/opt/wheels")

pytestmark = pytest.mark.skipif(os.environ.get("IMAGEBUILD_SMOKE") != "1" and os.environ.get("CI") != "true",
                                reason="the smoke lane runs from `make smoke` (IMAGEBUILD_SMOKE=1) and in CI: "
                                       "about 6 minutes, ~300 MB")


def _torch_wheel() -> Path:
    for d in TORCH_WHEEL_DIRS:
        if d and Path(d).is_dir():
            found = sorted(Path(d).glob("torch-2.13.0+cpu-cp311-cp311-*x86_64.whl"))
            if found:
                return found[0]
    pytest.skip("no torch-2.13.0+cpu cp311 x86-64 wheel on this machine (/opt/wheels or $IMAGEBUILD_SMOKE_WHEELS): "
                "the cu130 index it stands in for is not reachable here")


def _torch_index(base: Path, wheel: Path) -> str:
    """STAND-IN for the cu130 index: a PEP 503 folder whose torch page links the local wheel."""
    page = base / "torch-index" / "torch"
    page.mkdir(parents=True)
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    (page / "index.html").write_text(f'<html><body><a href="{wheel.as_uri()}#sha256={digest}">{wheel.name}</a>'
                                     "</body></html>\n")
    return (base / "torch-index").as_uri() + "/"


def _project(base: Path, index_url: str) -> Path:
    root = base / "project"
    shutil.copytree(SMOKE / "docker-images", root / "docker-images")
    shutil.copytree(ROOT / "patches-eugr", root / "patches-eugr")
    img = root / "docker-images" / IMAGE
    for rel in REUSED:  # the real definition's own files, unchanged
        (img / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REAL / rel, img / rel)
    env = (img / "versions.env").read_text()
    env = env.replace("SMOKE_TORCH_INDEX_URL=file:///nonexistent/written-by-the-test",
                      f"SMOKE_TORCH_INDEX_URL={index_url}")
    (img / "versions.env").write_text(env)
    return root


def _remove_images() -> None:
    out = subprocess.run(["docker", "image", "ls", "--format", "{{.Repository}}:{{.Tag}}"],
                         capture_output=True, text=True).stdout.split()
    mine = [r for r in out if r.startswith((f"imagebuild/{IMAGE}:", f"{IMAGE}:"))]
    if mine:
        subprocess.run(["docker", "image", "rm", "-f", *mine], capture_output=True)


def test_smoke_lane_builds_the_real_trees_offline(engine_ready, tmp_path, monkeypatch):
    wheel = _torch_wheel()
    trees = tmp_path / "trees"
    vllm_tree = realtrees.extract(realtrees.VLLM, trees)
    b12x_tree = realtrees.extract(realtrees.B12X, trees)
    served = tmp_path / "served"
    served.mkdir()
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
        root = _project(tmp_path, _torch_index(tmp_path, wheel))
        t0 = time.monotonic()
        r = run_cli("--root", str(root), "prefetch", IMAGE, "--cache", str(tmp_path / "cache"), "--json")
        timings["prefetch (sources, base image, apt, wheels)"] = time.monotonic() - t0
        assert r.code == 0, r.err
    # the daemon is gone: from here on nothing but the prefetched files
    lock = json.loads((root / "docker-images" / IMAGE / "lock.json").read_text())
    assert set(lock["sources"]) == {"VLLM", "B12X"} and {"torch", "runner"} <= set(lock["wheels"])
    monkeypatch.setenv("IMAGEBUILD_MIN_FREE_GB", os.environ.get("IMAGEBUILD_MIN_FREE_GB", "2"))
    try:
        t0 = time.monotonic()
        b = run_cli("--root", str(root), "build", IMAGE, "--json")
        timings["build (5 stages, --network none) + gate"] = time.monotonic() - t0
        print(b.err[-6000:])
        assert b.code == 0, b.err[-4000:]
        rec = json.loads(b.out)
        assert [s["name"] for s in rec["stages"]] == ["apt", "torch", "vllm-wheel", "b12x-wheel", "runner"]
        assert all(s["network"] in (False, "none") for s in rec["stages"])
        assert rec["promotion"]["status"] == "promoted", rec["promotion"]
        stage_s = {s["name"]: round(s.get("seconds") or 0, 1) for s in rec["stages"]}
        # the same pins give the same image: a second build without any cache (every RUN step runs
        # again) gives every stage's manifest and the release's identity again (issue 30)
        t0 = time.monotonic()
        b2 = run_cli("--root", str(root), "build", IMAGE, "--no-cache", "--no-gate", "--json")
        timings["second build (5 stages, --no-cache)"] = time.monotonic() - t0
        assert b2.code == 0, b2.err[-4000:]
        rec2 = json.loads(b2.out)
        assert all(s["status"] == "built" for s in rec2["stages"]), rec2["stages"]
        diff = reprocheck.differences(rec, rec2, root=root, image=IMAGE)
        assert not diff, "the second --no-cache build differs:\n" + diff
        assert rec2["release"]["identity"] == rec["release"]["identity"]
    finally:
        _remove_images()
        shutil.rmtree(trees, ignore_errors=True)
        shutil.rmtree(served, ignore_errors=True)
    summary = {"timings_s": {k: round(v, 1) for k, v in timings.items()}, "stages_s": stage_s,
               "torch_wheel": wheel.name, "lock_wheels": {k: len(v["files"]) for k, v in lock["wheels"].items()}}
    print("SMOKE LANE", json.dumps(summary, indent=2))
