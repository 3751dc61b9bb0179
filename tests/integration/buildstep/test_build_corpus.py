"""The fault corpus of issue 34 (round three) for build: a release reused on its label alone (a foreign
image carrying the right label was taken), and a stage-store ref edited to point at an older stage
(used and promoted, although the stage's own label names another key). Real builds on the real
engine."""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.fleetfixtures import build, fleet_project, remove_fleet_images, statuses, unique_name

pytestmark = pytest.mark.engine


def test_a_release_that_carries_the_right_label_but_other_layers_is_made_again(engine_info, tmp_path, monkeypatch):
    from tests.buildfixtures import cat
    from tests.peers import BUSYBOX

    name = unique_name()
    root = fleet_project(tmp_path / "p", name)
    try:
        monkeypatch.setenv("IMAGEBUILD_STAGES", str(tmp_path / "stages"))
        code, one, err = build(root, name, "--no-gate")
        assert code == 0, err
        release = f"imagebuild/{name}:release-{one['build_id']}"
        label = json.loads(subprocess.run(["docker", "image", "inspect", "--format", "{{json .Config.Labels}}",
                                           release], check=True, capture_output=True, text=True).stdout)
        key = "io.imagebuild.final-stage-manifest"
        # a foreign image with the very label the release carries, under the release's name
        ctx = tmp_path / "foreign"
        ctx.mkdir()
        (ctx / "Dockerfile").write_text(f"FROM {BUSYBOX}\nLABEL {key}={label[key]}\n")
        subprocess.run(["docker", "buildx", "build", "--network", "none", "--load", "-q", "-t", release, str(ctx)],
                       check=True, capture_output=True)
        code, two, err = build(root, name, "--no-gate")
        assert code == 0, err
        assert "do not extend that stage's: made again" in err, err
        assert json.loads(cat(f"{name}:candidate", "/opt/imagebuild/build.json"))["build_id"] == one["build_id"]
    finally:
        remove_fleet_images(name)


def test_a_stage_ref_edited_to_point_at_an_older_stage_is_not_used(engine_info, tmp_path, monkeypatch):
    from imagebuild.buildstep import stagestore
    from tests.buildfixtures import cat

    name = unique_name()
    root = fleet_project(tmp_path / "p", name)
    stages = tmp_path / "stages"
    try:
        monkeypatch.setenv("IMAGEBUILD_STAGES", str(stages))
        code, one, err = build(root, name, "--no-gate")
        assert code == 0, err
        runner = root / "docker-images" / name / "Dockerfile.runner"
        runner.write_text(runner.read_text() + 'RUN echo two > /opt/which\n')
        code, two, err = build(root, name, "--no-gate")
        assert code == 0, err
        assert statuses(two)["runner"] == "built" and cat(f"{name}:candidate", "/opt/which") == "two\n"
        k1 = next(s for s in one["stages"] if s["name"] == "runner")["key"]
        k2 = next(s for s in two["stages"] if s["name"] == "runner")["key"]
        store = stagestore.StageStore.for_image(root, name)
        ref1 = json.loads(store.ref_path(k1).read_text())
        ref2p = store.ref_path(k2)
        ref2 = json.loads(ref2p.read_text())
        ref2p.write_text(json.dumps({**ref2, "manifest": ref1["manifest"]}))  # the older stage, under the new key
        code, three, err = build(root, name, "--no-gate")
        assert code == 0, err
        assert "built for another key" in err, err
        assert statuses(three)["runner"] == "built", statuses(three)
        assert cat(f"{name}:candidate", "/opt/which") == "two\n"
    finally:
        remove_fleet_images(name)
