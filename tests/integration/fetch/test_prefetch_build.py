"""From prefetch to a real offline build: the one-line imagebuild-src mechanism (every source
extracted, every override set), an excluded dependency the build needs failing under --network
none with the reason in the log, and a bundle carried to another project that builds with no
network at all."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from tests.buildfixtures import cat, remove_images
from tests.conftest import DEBIAN, run_cli, tree_state
from tests.gitfixtures import GitDaemon, UpstreamFactory, make_realshape_upstreams
from tests.integration.fetch.test_prefetch_realshapes import IMAGE, lock_of, prefetch, project

pytestmark = pytest.mark.engine


@pytest.fixture(autouse=True)
def _fast(monkeypatch):
    monkeypatch.setenv("IMAGEBUILD_RETRY_DELAY", "0.05")
    monkeypatch.setenv("IMAGEBUILD_GIT_RETRIES", "3")
    monkeypatch.delenv("IMAGEBUILD_CACHE", raising=False)


@pytest.fixture(scope="module")
def built(tmp_path_factory, engine_info):
    """The real-shape image prefetched from a git daemon that is stopped before anything is built."""
    base = tmp_path_factory.mktemp("pf-build")
    served = base / "served"
    served.mkdir()
    with GitDaemon(served) as d:
        rs = make_realshape_upstreams(UpstreamFactory(served, d))
        root = project(base, rs)
        r = prefetch(root, base / "cache")
        assert r.code == 0, r.err
    remove_images(f"imagebuild/{IMAGE}", IMAGE)
    yield root, rs, base
    remove_images(f"imagebuild/{IMAGE}", IMAGE)


def test_one_line_gets_every_source_and_override(built):
    root, rs, _ = built
    r = run_cli("--root", str(root), "build", IMAGE, "--json", "--no-gate", "--no-cache")
    assert r.code == 0, r.err
    rec = json.loads(r.out)
    st = rec["stages"][0]
    assert st["status"] == "built" and st["network"] == "none"
    assert st["named_contexts"]["imagebuild-src"] == ["CUTLASS.tar", "DG.tar", "FA.tar", "TK.tar",
                                                      "VL.tar", "imagebuild-src.json", "imagebuild-src.sh"]
    cand = f"{IMAGE}:candidate"
    assert cat(cand, "/out/pr1.py") == "P = 1\n"  # the composed fork (dev/judgement + PR 1)
    assert cat(cand, "/out/env.txt").splitlines() == [
        "DG_SRC_DIR=/imagebuild/work/dg", "FA_SRC_DIR=/imagebuild/work/fa", "IMAGEBUILD_CMAKE_ARGS=",
        "TK_SRC_DIR=/imagebuild/work/tk", "VL_CUTLASS_SRC_DIR=/imagebuild/work/cutlass"]
    log = Path(root / st["log"]).read_text()
    assert "imagebuild-src: oneDNN is excluded on purpose (CPU-only; this image builds for CUDA" in log


def test_bundle_carries_everything_to_a_node_without_network(built, tmp_path):
    root, rs, _ = built
    out1, out2 = tmp_path / "one.tar", tmp_path / "two.tar"
    r = run_cli("--root", str(root), "bundle", IMAGE, "-o", str(out1), "--json")
    assert r.code == 0, r.err
    assert json.loads(r.out)["files"] == 8  # lock, versions.env, 5 tarballs, src/SHA256SUMS
    assert run_cli("--root", str(root), "bundle", IMAGE, "-o", str(out2)).code == 0
    assert out1.read_bytes() == out2.read_bytes()  # deterministic
    names = subprocess.run(["tar", "-tf", str(out1)], capture_output=True, text=True, check=True).stdout.split()
    assert names[-2:] == ["SHA256SUMS", "imagebuild-bundle.json"]
    # plain tools can check it too
    x = tmp_path / "x"
    x.mkdir()
    subprocess.run(["tar", "-xf", str(out1), "-C", str(x)], check=True)
    subprocess.run(["sha256sum", "-c", "--quiet", "SHA256SUMS"], cwd=x, check=True)

    # the target: the project checked out (the definition as committed before prefetch), nothing prefetched
    target = project(tmp_path / "node", rs)  # its git URLs lead nowhere now: the daemon is stopped
    # a damaged bundle changes nothing
    bad = tmp_path / "bad.tar"
    data = bytearray(out1.read_bytes())
    data[len(data) // 3] ^= 0xFF
    bad.write_bytes(bytes(data))
    before = tree_state(target)
    r = run_cli("--root", str(target), "unbundle", str(bad))
    assert r.code == 1 and "Traceback" not in r.err
    assert re.search(r"is damaged|does not match|not a readable bundle", r.err), r.err
    assert tree_state(target) == before
    # the good one: verified, in place, and the build needs nothing else
    r = run_cli("--root", str(target), "unbundle", str(out1))
    assert r.code == 0, r.err
    assert f"replaced docker-images/{IMAGE}/versions.env" in r.out
    assert lock_of(target) == lock_of(root)
    assert run_cli("--root", str(target), "prefetch", IMAGE, "--offline", "--cache",
                   str(tmp_path / "empty-cache")).code == 0  # the fast path: nothing to fetch
    r = run_cli("--root", str(target), "build", IMAGE, "--no-cache", "--no-gate", "--json")
    assert r.code == 0, r.err
    assert cat(f"{IMAGE}:candidate", "/out/pr1.py") == "P = 1\n"


def test_bundle_refuses_a_damaged_local_tarball(built, tmp_path):
    root, _, _ = built
    tb = root / lock_of(root)["sources"]["TK"]["tarball"]
    good = tb.read_bytes()
    try:
        tb.write_bytes(good[:-1] + bytes([good[-1] ^ 1]))
        r = run_cli("--root", str(root), "bundle", IMAGE, "-o", str(tmp_path / "b.tar"))
        assert r.code == 1 and "refusing to bundle a damaged file" in r.err and "TK" not in r.out
        assert not list(tmp_path.iterdir())
    finally:
        tb.write_bytes(good)


NEEDY_CMAKE = """cmake_minimum_required(VERSION 3.20)
project(needy NONE)
include(FetchContent)
FetchContent_Declare(cpuonly GIT_REPOSITORY https://github.com/example/cpuonly.git GIT_TAG v1.0)
FetchContent_MakeAvailable(cpuonly)
"""


def test_excluded_dependency_the_build_needs_fails_offline_and_says_why(tmp_path, engine_info):
    r = subprocess.run(["docker", "image", "inspect", DEBIAN], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"{DEBIAN} is not here (scripts/testbed.sh imports it)")
    served = tmp_path / "served"
    served.mkdir()
    image = "pf10-excluded"
    with GitDaemon(served) as d:
        up = UpstreamFactory(served, d).create("needy", {"CMakeLists.txt": NEEDY_CMAKE})
        root = tmp_path / "p"
        img = root / "docker-images" / image
        img.mkdir(parents=True)
        (img / "versions.env").write_text(f"BASE_IMAGE={DEBIAN}\nNEEDY_REPO={up.url()}\nNEEDY_REF={up.head()}\n")
        (img / "image.yaml").write_text(
            "platform: linux/amd64\nsources:\n  NEEDY:\n    exclude: {cpuonly: \"CPU-only; this image builds for "
            "CUDA\"}\nstages:\n  - name: cfg\n    from: BASE_IMAGE\n    sources: [NEEDY]\n")
        (img / "Dockerfile.cfg").write_text(
            "ARG PARENT\nFROM ${PARENT}\nRUN --mount=type=bind,from=imagebuild-src,target=/imagebuild/src \\\n"
            "    . /imagebuild/src/imagebuild-src.sh && cmake -S \"$IMAGEBUILD_SRC_NEEDY\" -B /tmp/b "
            "$IMAGEBUILD_CMAKE_ARGS\n")
        assert run_cli("--root", str(root), "prefetch", "--cache", str(tmp_path / "c")).code == 0
    remove_images(f"imagebuild/{image}", image)
    try:
        r = run_cli("--root", str(root), "build", image, "--no-gate")
        assert r.code == 1, r.err
        m = re.search(r"full log: (\S+?);", r.err)
        assert m, r.err
        log = Path(m.group(1)).read_text()
        assert "imagebuild-src: cpuonly is excluded on purpose (CPU-only; this image builds for CUDA" in log
        assert re.search(r"(?i)could not resolve host|failed to clone|unable to access", log), log[-2000:]
    finally:
        remove_images(f"imagebuild/{image}", image)
