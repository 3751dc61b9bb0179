"""gc against builds and other clones, and the bytes gc and df count (issue 21).

- gc and rollback take the image's build lock: while another process holds it (a build) they
  refuse (exit 3) and change nothing; gc's removals all happen with the lock held, so a build
  started meanwhile is refused instead of losing its stages.
- Two checkouts share one stage store and one engine: gc in one never removes the builds the
  other made, and gc, log and df of an image the checkout has no definition of exit 2.
- Bytes: a release that shares its base with other images frees only its own layers."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from imagebuild.buildstep import guards
from imagebuild.buildstep.stagestore import StageStore
from imagebuild.core import engine
from tests.buildfixtures import image_id, put_blob
from tests.conftest import run_cli, tree_state
from tests.fleetfixtures import GATE_SPEC, fleet_project, remove_fleet_images, unique_name

pytestmark = pytest.mark.engine

REPO = Path(__file__).resolve().parents[3]


def _build(root: Path, name: str, motd: str, *extra: str) -> dict:
    (root / "docker-images" / name / "files" / "motd.txt").write_text(motd + "\n")
    res = run_cli("--root", str(root), "build", name, "--json", *extra)
    assert res.code == 0, res.err
    return json.loads(res.out)


def _tags(name: str) -> list[str]:
    out = []
    for repo in (name, f"imagebuild/{name}"):
        out += subprocess.run(["docker", "image", "ls", "--format", "{{.Repository}}:{{.Tag}}", repo],
                              capture_output=True, text=True, check=True).stdout.split()
    return sorted(out)


def _hold_lock(name: str) -> subprocess.Popen:
    """Another process holding the image's build lock, as a running build does."""
    proc = subprocess.Popen(
        [sys.executable, "-c", "import time; from imagebuild.buildstep import guards; from imagebuild.core import engine; "
         f"lk = guards.BuildLock(guards.build_lock_path(engine.probe().id, {name!r}), {name!r}); "
         f"lk.acquire('imagebuild build {name}'); print('held', flush=True); time.sleep(120)"],
        stdout=subprocess.PIPE, text=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.stdout.readline().strip() == "held"
    return proc


@pytest.fixture
def two_promoted(engine_info, tmp_path):
    """An image with a build no tag holds, two promoted builds (:previous, :local) and one that
    stopped at :candidate."""
    name = unique_name("gcl")
    root = fleet_project(tmp_path / "p", name)
    (root / "docker-images" / name / "gate.yaml").write_text(GATE_SPEC)
    recs = [_build(root, name, motd, *extra) for motd, *extra in
            (("zero", "--no-gate"), ("one",), ("two",), ("three", "--no-gate"))]
    yield root, name, recs
    remove_fleet_images(name)


def test_gc_and_rollback_refuse_while_a_build_holds_the_lock(two_promoted):
    root, name, recs = two_promoted
    recs = recs[1:]
    store = StageStore.for_image(root, name)
    local = image_id(f"{name}:local")
    assert local == recs[1]["release"]["image_id"]
    before = (tree_state(root), tree_state(store.dir), _tags(name))
    holder = _hold_lock(name)
    try:
        for argv in (("gc", name, "--keep", "0"), ("gc", name, "--keep", "0", "--dry-run"), ("gc",),
                     ("rollback", name)):
            res = run_cli("--root", str(root), *argv)
            assert res.code == 3, (argv, res.out, res.err)
            assert f"pid {holder.pid}" in res.err and "is running" in res.err, res.err
        assert (tree_state(root), tree_state(store.dir), _tags(name)) == before  # nothing removed, no tag moved
        assert image_id(f"{name}:local") == local
    finally:
        holder.kill()
        holder.wait()
    res = run_cli("--root", str(root), "rollback", name)  # the holder is gone: the lock is free again
    assert res.code == 0, res.err
    assert image_id(f"{name}:local") == recs[0]["release"]["image_id"]
    res = run_cli("--root", str(root), "gc", name, "--keep", "0")
    assert res.code == 0, res.err


def test_gc_removes_with_the_lock_held_and_a_build_meanwhile_is_refused(two_promoted, monkeypatch):
    """docker image rm slowed down by a build that starts during it: the build is refused (exit 3)
    and every removal gc makes sees the lock held."""
    from imagebuild.core import run as run_mod
    from imagebuild.ops import gc as gc_mod

    root, name, recs = two_promoted
    lock = guards.build_lock_path(engine.probe().id, name)
    seen: list[tuple[str, bool]] = []
    builds: list[subprocess.CompletedProcess] = []
    real_run, real_remove = run_mod.run, gc_mod._remove

    def run(argv, *a, **kw):
        if list(argv[:3]) == ["docker", "image", "rm"]:
            seen.append(("docker image rm", gc_mod._lock_free(lock)))
            if not builds:  # a real build of the image, in another process, while gc removes
                builds.append(subprocess.run(
                    [sys.executable, "-m", "imagebuild", "--root", str(root), "build", name, "--no-gate"],
                    capture_output=True, text=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                    timeout=300))
        return real_run(argv, *a, **kw)

    def remove(path):
        seen.append((str(path), gc_mod._lock_free(lock)))
        return real_remove(path)

    monkeypatch.setattr(run_mod, "run", run)
    monkeypatch.setattr(gc_mod, "_remove", remove)
    res = run_cli("--root", str(root), "gc", name, "--keep", "0")
    monkeypatch.undo()
    assert res.code == 0, res.err
    assert len(seen) > 3 and seen[0][0] == "docker image rm"
    assert [s for s in seen if s[1]] == []  # never while the lock was free
    (b,) = builds
    assert b.returncode == 3, b.stderr
    assert f"'{name}' is busy" in b.stderr and f"imagebuild gc {name}" in b.stderr, b.stderr
    assert gc_mod._lock_free(lock)  # released when gc ended
    # what gc kept still rebuilds as a no-op: the candidate (build three) lost nothing
    rec = _build(root, name, "three", "--no-gate")
    assert {s["status"] for s in rec["stages"]} == {"skipped"}
    assert rec["release"]["built"] is False and rec["build_id"] == recs[3]["build_id"]
    assert f"{name}:b-{recs[0]['build_id']}" not in _tags(name)  # the build nothing kept went


def test_gc_in_one_clone_never_removes_what_another_clone_built(engine_info, tmp_path):
    name = unique_name("gcc")
    a = fleet_project(tmp_path / "a", name)
    b = tmp_path / "b"
    shutil.copytree(a, b, symlinks=True)  # another clone: its own state folder, the same stage store and engine
    c = fleet_project(tmp_path / "c", unique_name("gco"))  # a checkout with no definition of `name`
    try:
        mine = [_build(a, name, f"a{i}", "--no-gate") for i in range(3)]
        theirs = _build(b, name, "b0", "--no-gate")  # the last build: :candidate
        ids = [r["build_id"] for r in mine]
        store = StageStore.for_image(a, name)
        before = (_tags(name), tree_state(store.dir))

        for argv in (("gc", name, "--keep", "1"), ("gc", name, "--keep", "1", "--dry-run"), ("log", name),
                     ("df", name)):
            res = run_cli("--root", str(c), *argv)
            assert res.code == 2, (argv, res.out, res.err)
            assert "no such image in this project" in res.err and name in res.err, res.err
            assert "they belong to another checkout" in res.err, res.err  # its stages really are in the store
        res = run_cli("--root", str(c), "gc", "--keep", "0")  # every image of c: not `name`
        assert res.code == 0, res.err
        assert (_tags(name), tree_state(store.dir)) == before

        res = run_cli("--root", str(b), "gc", name, "--keep", "1", "--json")
        assert res.code == 0, res.err
        (ip,) = json.loads(res.out)["images"]
        assert set(ip["kept_builds"]) == {theirs["build_id"]}
        assert set(ip["other_checkouts"]) == set(ids) and set(ip["other_checkouts"].values()) == {str(a)}
        assert not any(i in it["what"] for i in ids for it in ip["remove"]), ip["remove"]
        tags = _tags(name)
        for i in ids:
            assert f"{name}:b-{i}" in tags and f"imagebuild/{name}:release-{i}" in tags
        for i, motd in ((0, "a0"), (2, "a2")):  # a's builds are still no-op rebuilds
            rec = _build(a, name, motd, "--no-gate")
            assert {s["status"] for s in rec["stages"]} == {"skipped"}, rec["stages"]
            assert rec["release"]["built"] is False and rec["build_id"] == ids[i]

        res = run_cli("--root", str(a), "gc", name, "--keep", "1", "--json")  # a's own gc: its own builds only
        assert res.code == 0, res.err
        (ip,) = json.loads(res.out)["images"]
        assert theirs["build_id"] in ip["kept_builds"] or theirs["build_id"] in ip["other_checkouts"]
        tags = _tags(name)
        assert f"{name}:b-{ids[1]}" not in tags and f"{name}:b-{ids[2]}" in tags  # a's unkept build went
        assert f"{name}:b-{theirs['build_id']}" in tags
        rec = _build(b, name, "b0", "--no-gate")  # b's build lost nothing
        assert {s["status"] for s in rec["stages"]} == {"skipped"} and rec["release"]["built"] is False
    finally:
        remove_fleet_images(name)


def _history_total(ref: str) -> int:
    out = subprocess.run(["docker", "history", "--human=false", "--format", "{{.Size}}", ref],
                         capture_output=True, text=True, check=True).stdout.split()
    return sum(int(x) for x in out)


def test_gc_and_df_count_only_the_layers_no_other_image_shares(engine_info, tmp_path):
    """Two images on one base (busybox) and two builds of one of them: removing the older build
    frees its own top layers (a few KB), not the base every image shares (MBs)."""
    x, y = unique_name("gcx"), unique_name("gcy")
    rx, ry = fleet_project(tmp_path / "x", x), fleet_project(tmp_path / "y", y)
    try:
        old = _build(rx, x, "old", "--no-gate")
        _build(rx, x, "new", "--no-gate")
        _build(ry, y, "y", "--no-gate")
        base = _history_total("imagebuild-test/busybox:1")
        whole = _history_total(f"{x}:b-{old['build_id']}")
        assert base > 1_000_000 and whole > base

        also = f"{y}:also-{old['build_id']}"  # another repository's tag on x's old build: removing x's frees nothing
        subprocess.run(["docker", "tag", f"{x}:b-{old['build_id']}", also], check=True, capture_output=True)
        res = run_cli("--root", str(rx), "gc", x, "--keep", "1", "--dry-run", "--json")
        assert res.code == 0, res.err
        assert [i["bytes"] for i in json.loads(res.out)["images"][0]["remove"] if i["kind"] in ("release", "tag")] \
            == [0, 0]
        subprocess.run(["docker", "image", "rm", also], check=True, capture_output=True)

        res = run_cli("--root", str(rx), "gc", x, "--keep", "1", "--dry-run", "--json")
        assert res.code == 0, res.err
        (ip,) = json.loads(res.out)["images"]
        engine_items = [i for i in ip["remove"] if i["kind"] in ("release", "tag")]
        assert {i["what"] for i in engine_items} == {f"imagebuild/{x}:release-{old['build_id']}",
                                                     f"{x}:b-{old['build_id']}"}
        freed_engine = sum(i["bytes"] for i in engine_items)
        assert 0 < freed_engine < 200_000, engine_items  # its own layers: the motd and the release files
        assert sorted(i["bytes"] for i in engine_items)[0] == 0  # the second tag of the same image frees nothing

        df_before = json.loads(run_cli("--root", str(rx), "df", x, "--json").out)["images"][0]["engine"]["bytes"]
        assert 0 < df_before < base  # x's images alone hold only their own layers, not the shared base
        res = run_cli("--root", str(rx), "gc", x, "--keep", "1", "--json")
        assert res.code == 0, res.err
        df_after = json.loads(run_cli("--root", str(rx), "df", x, "--json").out)["images"][0]["engine"]["bytes"]
        print(f"\nbase layer {base} B; old build {whole} B in all; gc freed {freed_engine} B in the engine; "
              f"df of {x}'s engine images {df_before} -> {df_after} B")
        assert df_before - df_after == freed_engine  # what gc said it frees is what df no longer counts
        assert image_id(f"{y}:candidate") and image_id(f"{x}:candidate")
    finally:
        remove_fleet_images(x)
        remove_fleet_images(y)


def test_gc_dry_run_reads_no_layer_peak_memory(engine_info, tmp_path):
    """A kept stage with a 50 MB layer: planning gc reads its manifest and config, never the layer
    (gc --dry-run read every kept layer into memory, 479 MB on the example)."""
    name = unique_name("gcm")
    root = fleet_project(tmp_path / "p", name)
    store = StageStore.for_image(root, name)
    blobs = store.dir / "blobs" / "sha256"
    blobs.mkdir(parents=True)

    def put(data: bytes) -> str:
        return put_blob(blobs, data)

    layer = put(os.urandom(50 << 20))
    config = put(json.dumps({"rootfs": {"type": "layers", "diff_ids": [layer]}}).encode())
    manifest = put(json.dumps({"schemaVersion": 2, "config": {"digest": config, "size": 1},
                               "layers": [{"digest": layer, "size": 50 << 20}]}).encode())
    key = "sha256:" + "ab" * 32
    (store.dir / "refs").mkdir()
    (store.dir / "refs" / f"{'ab' * 32}.json").write_text(json.dumps(
        {"schema": "imagebuild.stage-ref", "version": 1, "key": key, "stage": "base", "manifest": manifest}))
    run = root / ".imagebuild" / "builds" / name / "20260101T000000.000000Z-000001"
    run.mkdir(parents=True)
    (run / "record.json").write_text(json.dumps({"build_id": "0" * 16, "status": "succeeded",
                                                 "stages": [{"name": "base", "key": key}]}))
    # peak resident memory (VmHWM) after planning against resident memory (VmRSS) before it, in KiB
    code = ("import json, re, sys; from imagebuild.core.context import Context; from imagebuild.ops import gc; "
            "vm = lambda k: int(re.search(k + r':\\s+(\\d+)', open('/proc/self/status').read()).group(1)); "
            "ctx = Context(sys.argv[1]); ctx.engine; before = vm('VmRSS'); "
            "p = gc.plan_image(ctx, sys.argv[2], 3, ctx.engine.id, set()); after = vm('VmHWM'); "
            "print(json.dumps({'kib': after - before, 'kept': [i.what for i in p.keep if i.kind == 'stage-ref'], "
            "'blobs': [i.what for i in p.remove if i.kind == 'blob']}))")
    proc = subprocess.run([sys.executable, "-c", code, str(root), name], capture_output=True, text=True, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=120)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"\nplanning gc of a store with a kept 50 MiB layer: peak RSS grew {doc['kib']} KiB")
    assert doc["kept"] and doc["blobs"] == []  # the stage is kept with its blobs
    assert doc["kib"] < 16 << 10  # well below the layer's 50 MiB (reading it: over 100 MiB)
