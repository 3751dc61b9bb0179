"""The mirror definition end to end: real upstreams on a loopback git daemon -> imagebuild prefetch
(pins, composes the fork from base + two PR heads, packs tarballs, writes the lock) -> imagebuild
build, every stage under --network none, the C++ library's FetchContent dependency taken only
from the prefetched tarball."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest

from tests.buildfixtures import cat, image_id, remove_images
from tests.conftest import FIXTURES, run_cli
from tests.gitfixtures import UpstreamFactory, git_daemon, git_root  # noqa: F401  (pytest fixtures)

pytestmark = pytest.mark.engine

IMAGE = "mirror"
EXT_CMAKE = """cmake_minimum_required(VERSION 3.20)
project(fastext LANGUAGES CXX)
include(FetchContent)
FetchContent_Declare(
  mathdep
  GIT_REPOSITORY https://github.com/example/mathdep.git
  GIT_TAG {sha}
)
FetchContent_MakeAvailable(mathdep)
add_library(fastext SHARED src/fastext.cpp)
target_link_libraries(fastext PRIVATE mathdep)
"""


UPSTREAMS: dict = {}  # the fixture's upstream repositories, for tests that move a pin


@pytest.fixture(scope="module")
def mirror_project(git_daemon, tmp_path_factory, engine_info):  # noqa: F811
    factory = UpstreamFactory(git_daemon.base, git_daemon)
    mathdep = factory.create("mathdep", {
        "CMakeLists.txt": "cmake_minimum_required(VERSION 3.20)\nproject(mathdep LANGUAGES CXX)\n"
                          "add_library(mathdep INTERFACE)\n"
                          "target_include_directories(mathdep INTERFACE ${CMAKE_CURRENT_SOURCE_DIR}/include)\n",
        "include/mathdep.h": "inline int triple(int x) { return 3 * x; }\n"})
    factory.create("fastext", {
        "CMakeLists.txt": EXT_CMAKE.format(sha=mathdep.head()),
        "src/fastext.cpp": '#include "mathdep.h"\nextern "C" int fast_triple(int x) { return triple(x); }\n'})
    greet = factory.create("greetpkg", {
        "greetpkg/__init__.py": '"""greetpkg"""\nVERSION = "1.0"\n\n\ndef greet():\n    return "hello"\n'})
    greet.pull_request(1, {"greetpkg/pr1.py": 'NAME = "pr1"\n'})
    greet.pull_request(2, {"greetpkg/__init__.py":
                           '"""greetpkg"""\nVERSION = "1.0+pr2"\n\n\ndef greet():\n    return "hello"\n'})

    UPSTREAMS.update(mathdep=mathdep, greet=greet)
    base = tmp_path_factory.mktemp("mirror")
    UPSTREAMS["cache"] = base / "cache"
    root = base / "project"
    shutil.copytree(FIXTURES / "project", root, symlinks=True)
    env = root / "docker-images" / IMAGE / "versions.env"
    env.write_text(env.read_text().replace("git://127.0.0.1:9/", git_daemon.url("").rstrip("/") + "/")
                   .replace("MATHDEP_REF=main", f"MATHDEP_REF={mathdep.head()}"))
    r = run_cli("--root", str(root), "prefetch", IMAGE, "--cache", str(base / "cache"))
    assert r.code == 0, r.err
    remove_images(f"imagebuild/{IMAGE}", IMAGE)
    yield root
    remove_images(f"imagebuild/{IMAGE}", IMAGE)


def test_mirror_builds_end_to_end_offline(mirror_project):
    root = mirror_project
    lock = json.loads((root / "docker-images" / IMAGE / "lock.json").read_text())
    assert len(lock["sources"]["GREETPKG"]["prs"]) == 2
    assert lock["sources"]["MATHDEP"]["dependency_of"] == "FASTEXT"
    res = run_cli("--root", str(root), "build", IMAGE, "--json")
    assert res.code == 0, res.err
    rec = json.loads(res.out)
    assert [s["status"] for s in rec["stages"]] == ["built"] * 6
    assert all(s["network"] == "none" for s in rec["stages"])
    ext = next(s for s in rec["stages"] if s["name"] == "ext")
    assert ext["named_contexts"]["imagebuild-src"] == ["FASTEXT.tar", "MATHDEP.tar", "imagebuild-src.json",
                                                      "imagebuild-src.sh"]
    cand = f"{IMAGE}:candidate"
    # the composed fork (both PR heads), the C++ library (its dependency from the tarball), the patch
    out = subprocess.run(["docker", "run", "--rm", "--network", "none", cand, "python3", "/opt/mirror/smoke.py"],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["hello", "42", "pr1", "1.0+pr2"]
    patches = json.loads(cat(cand, "/opt/imagebuild/patches.json"))["patches"]
    assert patches["patch_greetpkg.py"]["outcome"] == "applied"
    assert cat(cand, "/opt/imagebuild/lock.json") == (root / "docker-images" / IMAGE / "lock.json").read_text()
    cfg = json.loads(subprocess.run(["docker", "image", "inspect", "--format", "{{json .Config}}", cand],
                                    capture_output=True, text=True, check=True).stdout)
    assert cfg["Cmd"] == ["bash"] and not cfg.get("Entrypoint")
    # SOURCE_DATE_EPOCH: the newest pinned source commit
    newest = max(s["source_date_epoch"] for s in lock["sources"].values())
    assert rec["source_date_epoch"] == newest
    # the composed fork is a local-only commit, and the image says how to make it again
    doc = json.loads(cat(cand, "/opt/imagebuild/build.json"))
    assert doc["sources"]["GREETPKG"]["local_only"] is True and "PR heads 1@" in doc["sources"]["GREETPKG"]["recreate"]
    assert doc["sources"]["GREETPKG"]["tree"] == lock["sources"]["GREETPKG"]["tree"]
    # the composed tree (what a NAME_TREE pin names) is in build.json and in a label
    assert doc["sources"]["GREETPKG"]["source_tree"] == lock["sources"]["GREETPKG"]["source_tree"]
    labels = json.loads(subprocess.run(["docker", "image", "inspect", "--format", "{{json .Config.Labels}}", cand],
                                       capture_output=True, text=True, check=True).stdout)
    assert json.loads(labels["io.imagebuild.source-trees"]) == {
        n: e["source_tree"] for n, e in lock["sources"].items()}
    assert doc["sources"]["MATHDEP"]["local_only"] is False


def test_mirror_tampered_prefetched_tarball_refused(mirror_project):
    root = mirror_project
    lock = json.loads((root / "docker-images" / IMAGE / "lock.json").read_text())
    tb = root / lock["sources"]["MATHDEP"]["tarball"]
    good = tb.read_bytes()
    before = image_id(f"{IMAGE}:candidate")
    try:
        tb.write_bytes(good[:100] + bytes([good[100] ^ 0xFF]) + good[101:])
        res = run_cli("--root", str(root), "build", IMAGE, "--from", "ext", "--no-cache")
        assert res.code == 1
        assert "MATHDEP" in res.err and "does not match the lock" in res.err
        assert image_id(f"{IMAGE}:candidate") == before
    finally:
        tb.write_bytes(good)


def test_a_dependency_pin_change_rebuilds_the_stage_and_the_image_matches_its_lock(mirror_project):
    """Issue 9, item 1, as seen: DEPA_REF moved, prefetch, build printed `src skipped` and the image held
    the old dependency while its lock named the new commit. The key covers every mounted tarball."""
    root = mirror_project  # last test of the module: it moves the fixture's MATHDEP pin
    res = run_cli("--root", str(root), "build", IMAGE, "--json")
    assert res.code == 0, res.err
    before = {s["name"]: s["key"] for s in json.loads(res.out)["stages"]}
    new = UPSTREAMS["mathdep"].commit({"include/mathdep.h": "inline int triple(int x) { return 3 * x + 1000; }\n"},
                                      "mathdep v2")
    env = root / "docker-images" / IMAGE / "versions.env"
    text = env.read_text()
    old = next(ln for ln in text.splitlines() if ln.startswith("MATHDEP_REF="))
    # a pin past what the tree declares: an override, which must say why (docs/prefetch.md)
    env.write_text(text.replace(old, f"MATHDEP_REF={new}  # override: testing that a moved dependency pin rebuilds"))
    r = run_cli("--root", str(root), "prefetch", IMAGE, "--cache", str(UPSTREAMS["cache"]))
    assert r.code == 0, r.err
    res = run_cli("--root", str(root), "build", IMAGE, "--json")
    assert res.code == 0, res.err
    rec = json.loads(res.out)
    status = {s["name"]: s["status"] for s in rec["stages"]}
    assert status == {"base": "skipped", "toolchain": "skipped", "ext": "built", "pkg": "built",
                      "patches": "built", "runner": "built"}
    assert {s["name"]: s["key"] for s in rec["stages"]}["ext"] != before["ext"]
    cand = f"{IMAGE}:candidate"
    out = subprocess.run(["docker", "run", "--rm", "--network", "none", cand, "python3", "/opt/mirror/smoke.py"],
                         capture_output=True, text=True)
    assert out.stdout.split()[:2] == ["hello", "1042"], out.stdout + out.stderr  # the new dependency's code
    in_image = json.loads(cat(cand, "/opt/imagebuild/lock.json"))
    assert in_image["sources"]["MATHDEP"]["commit"] == new
