"""gc's accounting without an engine (issue 21): the bytes a removal frees are the layers no image
left shares, counted once; planning reads manifests and configs, never a layer; checkouts claim
their builds of the shared stage store."""

from __future__ import annotations

import json

import pytest

from imagebuild.buildstep import owners
from imagebuild.buildstep.stagestore import StageStore
from imagebuild.core.context import Context
from imagebuild.ops import gc
from tests.buildfixtures import put_blob

# `docker history --human=false` of a release of the example image, oldest row first: an imported
# base, ARG/ENV rows (no layer), two COPY rows whose layers are empty (size 0), RUN rows, the release
ROWS = [(649895936, ""), (0, "ARG PY_OPT_LEVEL=2"), (0, "ENV PYTHONOPTIMIZE=2"),
        (12288, "RUN |1 PY_OPT_LEVEL=2 /bin/sh -c python3 --version # buildkit"), (0, "ARG GREETING_VERSION=1.2.0"),
        (0, "COPY app/ /opt/app/ # buildkit"), (1163264, "RUN |1 GREETING_VERSION=1.2.0 /bin/sh -c true # buildkit"),
        (0, "COPY app/greeting.txt /opt/app/greeting.txt # buildkit"), (1048576, "RUN /bin/sh -c mkdir # buildkit"),
        (0, "ENTRYPOINT []"), (0, 'CMD ["python3"]'), (20480, "ADD release.tar / # buildkit")]


def test_layer_sizes_follow_the_rows_that_made_layers():
    assert gc.layer_sizes(ROWS, 7) == [649895936, 12288, 0, 1163264, 0, 1048576, 20480]
    assert gc.layer_sizes([(5, "RUN a"), (0, "ENV X=1"), (7, "RUN b")], 2) == [5, 7]
    assert gc.layer_sizes([(2002944, "")], 1) == [2002944]
    # commands that say nothing: the sized rows are taken as the lowest layers, never more than n
    assert gc.layer_sizes([(0, "weird"), (4, "RUN"), (0, "odd")], 4) == [4, 0, 0, 0]


def test_chain_ids_make_a_layer_shared_only_with_its_whole_stack():
    a = gc._chain_ids(["sha256:base", "sha256:x"])
    b = gc._chain_ids(["sha256:other", "sha256:x"])
    assert a[0] == "sha256:base" and a[1] != b[1]  # the same diff on another base is another layer


def test_exclusive_counts_what_no_image_left_shares_once():
    base, mid = ("c-base",), ("c-base", "c-mid")
    view = gc.EngineView(layers={"old": (*mid, "c-old"), "new": (*mid, "c-new"), "other": base},
                         sizes={"c-base": 2_000_000, "c-mid": 50_000, "c-old": 3_000, "c-new": 4_000})
    assert view.exclusive({"old"}) == 3_000  # not the base (other shares it), not mid (new does)
    assert view.exclusive({"old", "new"}) == 3_000 + 4_000 + 50_000  # mid once
    assert view.exclusive({"old", "new", "other"}) == 2_057_000
    assert view.exclusive(()) == 0


def _store_with_a_kept_stage(root, image):
    """A stage store with one stage (manifest, config, one layer) that a run record keeps."""
    store = StageStore.for_image(root, image)
    blobs = store.dir / "blobs" / "sha256"
    blobs.mkdir(parents=True)

    def put(data: bytes) -> str:
        return put_blob(blobs, data)

    layer = put(b"\x1f\x8b not json, a layer" * 100)
    config = put(json.dumps({"rootfs": {"diff_ids": [layer]}}).encode())
    manifest = put(json.dumps({"config": {"digest": config}, "layers": [{"digest": layer}]}).encode())
    stale = put(b"a blob nothing names")
    key = "sha256:" + "cd" * 32
    (store.dir / "refs").mkdir()
    (store.dir / "refs" / f"{'cd' * 32}.json").write_text(json.dumps(
        {"schema": "imagebuild.stage-ref", "version": 1, "key": key, "stage": "base", "manifest": manifest}))
    run = root / ".imagebuild" / "builds" / image / "20260101T000000.000000Z-000001"
    run.mkdir(parents=True)
    (run / "record.json").write_text(json.dumps({"build_id": "1" * 16, "stages": [{"name": "base", "key": key}]}))
    return store, layer, manifest, stale


@pytest.fixture
def no_engine(monkeypatch):
    monkeypatch.setattr(gc, "engine_images", lambda *a, **k: [])
    monkeypatch.setattr(gc, "engine_view", lambda *a, **k: gc.EngineView(), raising=False)


def test_planning_never_reads_a_layer_blob(project, monkeypatch, no_engine, tmp_path):
    monkeypatch.setenv("IMAGEBUILD_STAGES", str(tmp_path / "stages"))
    store, layer, manifest, stale = _store_with_a_kept_stage(project, "tiny")
    read = []
    real = StageStore.read_json_blob

    def reading(self, digest):
        assert digest != layer, "gc read a layer blob"
        read.append(digest)
        return real(self, digest)

    monkeypatch.setattr(StageStore, "read_json_blob", reading)
    p = gc.plan_image(Context(project), "tiny", 3, None, set())
    assert [i.why for i in p.keep if i.kind == "stage-ref"] == ["a kept build's stage"]
    assert [i.what for i in p.remove if i.kind == "blob"] == [stale[:19]]
    assert p.store_index == [manifest] and read  # the index keeps the manifest, found from the ref alone


def test_a_deleted_checkout_claims_nothing_and_claims_merge(tmp_path):
    store = tmp_path / "store"
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    owners.claim(store, a, "b1", ["k1", "k2"])
    owners.claim(store, a, "b2", ["k2", "k3"])
    owners.claim(store, b, "b9", ["k9"])
    (mine,) = [c for c in owners.claims(store) if c.root == str(a)]
    assert mine.builds == {"b1": ["k1", "k2"], "b2": ["k2", "k3"]} and mine.keys == {"k1", "k2", "k3"}
    assert [c.root for c in owners.others(store, a)] == [str(b)]
    b.rmdir()  # that checkout is gone: its claims keep nothing
    assert owners.others(store, a) == []
    owners.write(store, a, {"b2": ["k3"]})  # gc: this checkout now claims only what it kept
    assert owners.read(owners.owner_path(store, a)).builds == {"b2": ["k3"]}


def test_claims_of_another_checkout_keep_its_stages(project, monkeypatch, no_engine, tmp_path):
    monkeypatch.setenv("IMAGEBUILD_STAGES", str(tmp_path / "stages"))
    store, layer, manifest, stale = _store_with_a_kept_stage(project, "tiny")
    other = tmp_path / "other"
    other.mkdir()
    key = "sha256:" + "cd" * 32
    owners.claim(store.dir, other, "2" * 16, [key])
    (project / ".imagebuild" / "builds" / "tiny" / "20260101T000000.000000Z-000001" / "record.json").unlink()
    p = gc.plan_image(Context(project), "tiny", 0, None, set())  # this project keeps nothing of it
    assert [i.why for i in p.keep if i.kind == "stage-ref"] == [f"a stage of another checkout ({other})"]
    assert not any(i.kind == "stage-ref" for i in p.remove)
