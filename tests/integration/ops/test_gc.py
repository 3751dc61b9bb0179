"""imagebuild gc and df on a node with ten builds of one image (issue 9, item 6).

Builds 2 and 4 pass the gate and are promoted (:previous = build 2, :local = build 4); the others
stop at :candidate (the last one, build 9, is :candidate). With --keep 2 the kept builds are 2, 4,
8 and 9: each must still be a no-op rebuild after gc, and everything of the others must go."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from imagebuild.buildstep.stagestore import StageStore
from tests.buildfixtures import IMAGE, image_id, remove_images, staged_project
from tests.conftest import run_cli, tree_state

pytestmark = pytest.mark.engine

GATE = "checks:\n  - {id: greets, kind: file, path: /opt/greet/greet.py, contains: HELLO}\n"


def _build(root, i, *extra):
    motd = root / "docker-images" / IMAGE / "files" / "motd.txt"
    motd.write_text(f"build {i}\n")
    res = run_cli("--root", str(root), "build", IMAGE, "--json", *extra)
    assert res.code == 0, res.err
    return json.loads(res.out)


def _tags():
    out = subprocess.run(["docker", "image", "ls", "--format", "{{.Repository}}:{{.Tag}}", IMAGE],
                         capture_output=True, text=True, check=True).stdout.split()
    out += subprocess.run(["docker", "image", "ls", "--format", "{{.Repository}}:{{.Tag}}", f"imagebuild/{IMAGE}"],
                          capture_output=True, text=True, check=True).stdout.split()
    return sorted(out)


@pytest.fixture
def ten_builds(engine_info, tmp_path, monkeypatch):
    monkeypatch.setenv("IMAGEBUILD_CACHE", str(tmp_path / "gitcache"))
    remove_images(f"imagebuild/{IMAGE}", IMAGE)
    root = staged_project(tmp_path / "p")
    (root / "docker-images" / IMAGE / "gate.yaml").write_text(GATE)
    recs = [_build(root, i, *(() if i in (2, 4) else ("--no-gate",))) for i in range(10)]
    yield root, recs
    remove_images(f"imagebuild/{IMAGE}", IMAGE)


def test_gc_keeps_local_previous_and_the_last_builds(ten_builds, tmp_path):
    root, recs = ten_builds
    ids = [r["build_id"] for r in recs]
    assert len(set(ids)) == 10
    assert image_id(f"{IMAGE}:local") == recs[4]["release"]["image_id"]
    assert image_id(f"{IMAGE}:previous") == recs[2]["release"]["image_id"]
    store = StageStore.for_image(root, IMAGE)
    # leftovers of runs that died: a build's temporary folder, a prefetch's mirror .tmp, an old tarball
    (root / ".imagebuild" / "tmp" / "build-staged-dead" / "x").mkdir(parents=True)
    (root / ".imagebuild" / "tmp" / "build-staged-dead" / "x" / "f").write_bytes(b"0" * 4096)
    (tmp_path / "gitcache" / ".greet.git.abc123.tmp").mkdir(parents=True)
    old = root / "deps-src" / IMAGE / "src" / "greet-old.tar.gz"  # tarball format 1 (gzip)
    old.write_bytes(b"1" * 8192)
    old2 = old.with_name("greet-old2.tar")  # format 2 (plain tar): gc knows both
    old2.write_bytes(b"2" * 8192)

    before = (tree_state(root), tree_state(store.dir), _tags())
    res = run_cli("--root", str(root), "gc", IMAGE, "--keep", "2", "--dry-run", "--json")
    assert res.code == 0, res.err
    plan = json.loads(res.out)
    assert (tree_state(root), tree_state(store.dir), _tags()) == before  # a dry run changes nothing
    (ip,) = plan["images"]
    assert set(ip["kept_builds"]) == {ids[2], ids[4], ids[8], ids[9]}
    assert ip["kept_builds"][ids[4]] == ":local" and ip["kept_builds"][ids[2]] == ":previous"
    gone = {i["what"] for i in ip["remove"]}
    for n in (0, 1, 3, 5, 6, 7):
        assert f"{IMAGE}:b-{ids[n]}" in gone and f"imagebuild/{IMAGE}:release-{ids[n]}" in gone
    assert not any(ids[n] in w for n in (2, 4, 8, 9) for w in gone)
    kinds = {i["kind"] for i in ip["remove"]}
    assert {"release", "tag", "stage-ref", "blob", "run", "tmp", "tarball"} <= kinds
    assert any(i["kind"] == "mirror-tmp" for i in plan["shared"])
    assert plan["freed_bytes"] > 0
    text = run_cli("--root", str(root), "gc", IMAGE, "--keep", "2", "--dry-run")
    assert "would remove" in text.out and "would be freed" in text.out

    df_before = json.loads(run_cli("--root", str(root), "df", IMAGE, "--json").out)["images"][0]
    res = run_cli("--root", str(root), "gc", IMAGE, "--keep", "2", "--json")
    assert res.code == 0, res.err
    df_after = json.loads(run_cli("--root", str(root), "df", IMAGE, "--json").out)["images"][0]
    print(f"\ngc --keep 2 of ten builds: dry run said {plan['freed_bytes']} bytes; df before {df_before}; "
          f"after {df_after}; removed {len(ip['remove'])} items, kept builds {sorted(ip['kept_builds'].values())}")
    assert df_after["stage_store"]["bytes"] < df_before["stage_store"]["bytes"]
    assert df_after["runs"]["count"] == 4 and df_after["engine"]["releases"] == 4
    tags = _tags()
    for n in (0, 1, 3, 5, 6, 7):
        assert f"{IMAGE}:b-{ids[n]}" not in tags
    for n in (2, 4, 8, 9):
        assert f"{IMAGE}:b-{ids[n]}" in tags
    assert image_id(f"{IMAGE}:local") == recs[4]["release"]["image_id"]
    assert image_id(f"{IMAGE}:previous") == recs[2]["release"]["image_id"]
    assert not (root / ".imagebuild" / "tmp" / "build-staged-dead").exists()
    assert not (tmp_path / "gitcache" / ".greet.git.abc123.tmp").exists()
    assert not old.exists() and not old2.exists()
    assert all((root / t).is_file() for t in recs[9]["inputs"]["tarballs"])  # the current lock's files stay

    # every kept build is still a no-op rebuild: all stages skipped, the release already there
    for n in (2, 4, 8, 9):
        rec = _build(root, n, "--no-gate")
        assert {s["status"] for s in rec["stages"]} == {"skipped"}, n
        assert rec["release"]["built"] is False and rec["build_id"] == ids[n]
    # a second gc right away has nothing left to do but the four no-op runs just made
    again = json.loads(run_cli("--root", str(root), "gc", IMAGE, "--keep", "2", "--json").out)
    assert {i["kind"] for i in again["images"][0]["remove"]} <= {"run"}, again["images"][0]


def test_gc_never_removes_what_a_container_uses(ten_builds):
    root, recs = ten_builds
    ref = f"{IMAGE}:b-{recs[0]['build_id']}"
    name = f"imagebuild-test-gc-{os.getpid()}"
    subprocess.run(["docker", "create", "--name", name, ref, "true"], check=True, capture_output=True)
    try:
        plan = json.loads(run_cli("--root", str(root), "gc", IMAGE, "--keep", "1", "--json").out)
        kept = plan["images"][0]["kept_builds"]
        assert kept[recs[0]["build_id"]] == "used by a container"
        assert image_id(ref) is not None
    finally:
        subprocess.run(["docker", "rm", "-f", name], capture_output=True)
