"""The free-disk guard counts the reproducible export's temporary space (issue 9, item 6)."""

from __future__ import annotations

import hashlib
import json

import pytest

from imagebuild.buildstep import guards
from imagebuild.buildstep.stagestore import StageStore
from imagebuild.core.errors import GuardRefused


def _blob(store: StageStore, data: bytes) -> str:
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    p = store.blob(digest)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_bytes(data)
    return digest


def _stage(store: StageStore, stage: str, key_char: str, layer_sizes: list[int]) -> None:
    config = _blob(store, b'{"rootfs": {"diff_ids": []}}')
    layers = [{"digest": _blob(store, bytes([i]) * 8), "size": size} for i, size in enumerate(layer_sizes)]
    manifest = _blob(store, json.dumps({"config": {"digest": config}, "layers": layers}).encode())
    store.commit("sha256:" + key_char * 64, stage, manifest)


def test_export_space_is_twice_the_last_build_of_each_stage_to_build(tmp_path):
    store = StageStore(tmp_path / "layout")
    gib = 1 << 30
    _stage(store, "torch", "a", [3 * gib, 2 * gib])
    _stage(store, "vllm", "b", [gib])
    assert guards.export_space_gib(store, ["torch"]) == pytest.approx(2 * 5)
    assert guards.export_space_gib(store, ["torch", "vllm"]) == pytest.approx(2 * 6)
    assert guards.export_space_gib(store, ["never-built"]) == 0


def test_check_disk_adds_the_export_space_and_says_so(tmp_path, monkeypatch):
    monkeypatch.setenv("IMAGEBUILD_MIN_FREE_GB", "0")
    free = guards.free_gib(tmp_path)
    assert guards.check_disk([tmp_path], force=False, export_gib=0) is None
    with pytest.raises(GuardRefused) as exc:
        guards.check_disk([tmp_path], force=False, export_gib=free + 100)
    assert "for the reproducible export" in exc.value.message
    warn = guards.check_disk([tmp_path], force=True, export_gib=free + 100)
    assert warn and "--force" in warn


def test_only_a_stage_s_own_layers_count_not_its_parent_s(tmp_path):
    store = StageStore(tmp_path / "layout")
    gib = 1 << 30
    base = _blob(store, b"base")
    own = _blob(store, b"own")
    cfg = _blob(store, b'{"rootfs": {"diff_ids": []}}')
    parent = _blob(store, json.dumps({"config": {"digest": cfg}, "layers": [
        {"digest": base, "size": 8 * gib}]}).encode())
    child = _blob(store, json.dumps({"config": {"digest": cfg}, "layers": [
        {"digest": base, "size": 8 * gib}, {"digest": own, "size": gib}]}).encode())
    store.commit("sha256:" + "c" * 64, "cuda", parent)
    store.commit("sha256:" + "d" * 64, "wheel", child)
    assert guards.export_space_gib(store, ["wheel"]) == pytest.approx(2 * 1)
    assert guards.export_space_gib(store, ["cuda"]) == pytest.approx(2 * 8)
