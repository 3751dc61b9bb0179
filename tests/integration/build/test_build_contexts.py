"""Build contexts never answered from an earlier context's snapshot on the engine: buildx keeps one
snapshot of a local context per folder name and sends only the files whose size or mtime changed,
and every file imagebuild hands BuildKit has the same mtime (SOURCE_DATE_EPOCH). A same-size edit
under a reused folder name arrived as the old bytes; the folder names are now unique to their
content (build.context_dir_name)."""

from __future__ import annotations

import json

import pytest

from tests.conftest import run_cli
from tests.fleetfixtures import fleet_project, remove_fleet_images, unique_name

pytestmark = pytest.mark.engine

STAGES = ["base", "tools", "app", "patched", "runner"]


def build(root, name, *args):
    res = run_cli("--root", str(root), "build", name, "--json", *args)
    return res.code, (json.loads(res.out) if res.code == 0 else None), res.err


def statuses(rec):
    return {s["name"]: s["status"] for s in rec["stages"]}


def test_a_same_size_edit_reaches_the_stage_and_the_release(engine_info, tmp_path, monkeypatch):
    """A stage's key names its inputs, so the stage built for a key must hold exactly those bytes: an
    edit that keeps a file's size (and, as every context file, its SOURCE_DATE_EPOCH mtime) must not be
    answered from BuildKit's snapshot of an earlier context (docs/build.md, "Build contexts")."""
    from tests.buildfixtures import cat

    name = unique_name()
    root = fleet_project(tmp_path / "p", name)
    d = root / "docker-images" / name
    try:
        monkeypatch.setenv("IMAGEBUILD_STAGES", str(tmp_path / "stages"))
        code, one, err = build(root, name, "--no-gate")
        assert code == 0, err
        # only the release changes (a new file in the definition: a new definition digest and build id;
        # build.json keeps its size): its context goes to the engine right after the last release's
        (d / "NOTES.md").write_text("notes\n")
        code, two, err = build(root, name, "--no-gate")
        assert code == 0, err
        assert statuses(two) == dict.fromkeys(STAGES, "skipped") and two["build_id"] != one["build_id"]
        doc = json.loads(cat(f"{name}:candidate", "/opt/imagebuild/build.json"))
        assert doc["build_id"] == two["build_id"]
        # a stage input edited in place, same size
        tool = d / "files" / "tool.sh"
        before = tool.read_text()
        after = before.replace("tool", "TOOL")
        assert len(after) == len(before) and after != before
        tool.write_text(after)
        code, three, err = build(root, name, "--no-gate")
        assert code == 0, err
        assert statuses(three)["tools"] == "built"
        assert cat(f"{name}:candidate", "/opt/staged/tool.sh") == after
        assert json.loads(cat(f"{name}:candidate", "/opt/imagebuild/build.json"))["build_id"] == three["build_id"]
    finally:
        remove_fleet_images(name)


def test_build_metadata_writes_eugrs_audit_file_into_the_release(engine_info, tmp_path, monkeypatch):
    """image.yaml `build_metadata:`: the release also carries eugr's build-metadata.yaml at that
    path, from the lock and the plan (deterministic: a rebuild gives the same bytes)."""
    import yaml

    from tests.buildfixtures import cat

    name = unique_name()
    root = fleet_project(tmp_path / "p", name)
    d = root / "docker-images" / name
    y = d / "image.yaml"
    y.write_text(y.read_text() + "build_metadata: /workspace/build-metadata.yaml\n")
    (d / "versions.env").write_text((d / "versions.env").read_text() + "TORCH_CUDA_ARCH_LIST=12.1a\n")
    try:
        monkeypatch.setenv("IMAGEBUILD_STAGES", str(tmp_path / "stages"))
        code, one, err = build(root, name, "--no-gate")
        assert code == 0, err
        text = cat(f"{name}:candidate", "/workspace/build-metadata.yaml")
        meta = yaml.safe_load(text)
        assert meta["gpu_arch"] == "12.1a" and meta["imagebuild_build_id"] == one["build_id"]
        assert meta["build_date"].endswith("Z") and "vllm_commit" in meta and "build_args" in meta
        assert meta["flashinfer_commit"] is None  # a wheel from an index: no commit to name
        code, two, err = build(root, name, "--no-gate", "--no-cache")
        assert code == 0, err
        assert cat(f"{name}:candidate", "/workspace/build-metadata.yaml") == text
    finally:
        remove_fleet_images(name)

    # bad values name the key
    y.write_text(y.read_text().replace("/workspace/build-metadata.yaml", "/opt/imagebuild/x.yaml"))
    res = run_cli("--root", str(root), "validate", name)
    assert res.code == 2 and "build_metadata" in res.err and "outside /opt/imagebuild" in res.err
