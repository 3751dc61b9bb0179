"""Build contexts never answered from an earlier context's snapshot on the engine: buildx keeps one
snapshot of a local context per folder name and sends only the files whose size or mtime changed,
and every file imagebuild hands BuildKit has the same mtime (SOURCE_DATE_EPOCH). A same-size edit
under a reused folder name arrived as the old bytes; the folder names are now unique to their
content (build.context_dir_name)."""

from __future__ import annotations

import json
import subprocess

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


def test_a_release_made_from_another_final_stage_is_never_reused(engine_info, tmp_path, monkeypatch):
    """Issue 21: the release was reused by its tag name alone, so a poisoned release-<build id> (from
    another stage store, or an image of a stale key) was promoted. The release records the final
    stage's manifest it was made from, and a release made from another one is made again."""
    from tests.buildfixtures import cat
    from tests.peers import BUSYBOX

    name = unique_name()
    root = fleet_project(tmp_path / "p", name)
    try:
        monkeypatch.setenv("IMAGEBUILD_STAGES", str(tmp_path / "stages"))
        code, one, err = build(root, name, "--no-gate")
        assert code == 0, err
        release = f"imagebuild/{name}:release-{one['build_id']}"
        labels = json.loads(subprocess.run(["docker", "image", "inspect", "--format", "{{json .Config.Labels}}",
                                            release], check=True, capture_output=True, text=True).stdout)
        assert labels["io.imagebuild.final-stage-manifest"].startswith("sha256:")
        # poison the release tag: same name, another image
        subprocess.run(["docker", "tag", BUSYBOX, release], check=True, capture_output=True)
        code, two, err = build(root, name, "--no-gate")
        assert code == 0, err
        assert two["build_id"] == one["build_id"] and statuses(two) == dict.fromkeys(STAGES, "skipped")
        assert "was made from another final stage (not recorded" in err and "made again" in err
        assert json.loads(cat(f"{name}:candidate", "/opt/imagebuild/build.json"))["build_id"] == one["build_id"]
        # the release made again is reused from now on
        code, three, err = build(root, name, "--no-gate")
        assert code == 0 and "made again" not in err and "exists (made from the final stage" in err
    finally:
        remove_fleet_images(name)


def test_a_clone_under_umask_077_builds_the_same_image(engine_info, tmp_path, monkeypatch):
    """Issue 21, case 1: a clone whose files are 0600 gave the same keys and build id but another
    image (files -rw------- inside), and the b-<build id> tag moved to it. The context is the
    normalized stream now: same keys, same image, files 0644 inside."""
    import os
    import shutil

    name = unique_name()
    root = fleet_project(tmp_path / "p", name)
    clone = tmp_path / "clone"
    shutil.copytree(root, clone, symlinks=True)
    for p in (clone / "docker-images").rglob("*"):
        if not p.is_symlink():
            os.chmod(p, 0o700 if p.is_dir() else (0o700 if p.stat().st_mode & 0o111 else 0o600))
    try:
        monkeypatch.setenv("IMAGEBUILD_STAGES", str(tmp_path / "stages-a"))
        code, one, err = build(root, name, "--no-gate")
        assert code == 0, err
        tag = f"{name}:b-{one['build_id']}"
        first = subprocess.run(["docker", "image", "inspect", "--format", "{{.Id}}", tag], check=True,
                               capture_output=True, text=True).stdout.strip()
        monkeypatch.setenv("IMAGEBUILD_STAGES", str(tmp_path / "stages-b"))  # nothing shared but the engine
        monkeypatch.setenv("IMAGEBUILD_STATE_DIR", str(tmp_path / "state-b"))
        code, two, err = build(clone, name, "--no-gate")
        assert code == 0, err
        assert {s["name"]: s["key"] for s in two["stages"]} == {s["name"]: s["key"] for s in one["stages"]}
        assert two["build_id"] == one["build_id"]
        again = subprocess.run(["docker", "image", "inspect", "--format", "{{.Id}}", tag], check=True,
                               capture_output=True, text=True).stdout.strip()
        assert again == first  # the tag did not move
        mode = subprocess.run(["docker", "run", "--rm", "--network", "none", "--entrypoint", "stat", tag,
                               "-c", "%a", "/opt/staged/tool.sh"], check=True, capture_output=True, text=True)
        assert mode.stdout.strip() in ("644", "755"), mode.stdout
    finally:
        remove_fleet_images(name)
