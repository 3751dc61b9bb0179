"""Cache keys: a change reaches exactly the stage that consumes it and every stage built on it."""

from __future__ import annotations

import json

import pytest

from imagebuild.definition import reader as definition
from imagebuild.plan import planner as plan
from tests.conftest import run_cli, tree_state

IMG = "docker-images/tiny"
STAGES = ["base", "tools", "app", "runner"]


def keys(root):
    p = plan.make_plan(definition.load(root, "tiny"))
    return {s.name: s.key for s in p.stages}


def changed(before, after):
    return [n for n in STAGES if before[n] != after[n]]


def test_plan_json_valid_and_ordered(project):
    before = tree_state(project)
    res = run_cli("--root", str(project), "plan", "tiny", "--json", "--no-engine")
    assert res.code == 0, res.err
    data = json.loads(res.out)
    assert data["schema"] == "imagebuild.plan" and data["version"] == 2
    assert [s["name"] for s in data["stages"]] == STAGES
    app = data["stages"][2]
    assert app["parent"] == {"kind": "stage", "name": "tools", "ref": "imagebuild-parent"}
    assert app["uses_stages"] == ["base"]
    args = {a["name"]: (a["value"], a["origin"]) for a in app["args"]}
    assert args["APP_FLAVOUR"] == ("plain vanilla", "versions.env")
    assert args["APP_COLOUR"] == ("blue", "default")
    assert args["STAGE_BASE"] == ("imagebuild-stage-base", "plan")
    assert {i["context"] for i in app["inputs"]} == {"patches/patch_hello.py", "patches/patch_shared.py",
                                                      "patches/imagebuild_patching.py"}
    # the patch primitive is an input of patching stages only, so a change to it rebuilds them
    assert [i["kind"] for i in app["inputs"]].count("primitive") == 1
    assert all(i["kind"] != "primitive" for s in data["stages"] if s["name"] != "app" for i in s["inputs"])
    runner = {a["name"]: a["value"] for a in data["stages"][3]["args"]}
    assert runner["TARGETARCH"] == "amd64" and runner["RUNNER_USER"] == "root"
    assert all(s["key"].startswith("sha256:") and len(s["key"]) == 71 for s in data["stages"])
    assert all(isinstance(s["exists"], bool) for s in data["stages"])  # read from the stage store, no engine
    # no host paths, no timestamps
    assert str(project) not in res.out
    assert tree_state(project) == before


def test_plan_is_deterministic(project):
    assert keys(project) == keys(project)


def test_dockerfile_byte_changes_stage_and_later_only(project):
    before = keys(project)
    p = project / IMG / "Dockerfile.tools"
    p.write_bytes(p.read_bytes() + b"\n")
    assert changed(before, keys(project)) == ["tools", "app", "runner"]


def test_first_and_last_dockerfile(project):
    before = keys(project)
    p = project / IMG / "Dockerfile.runner"
    p.write_bytes(p.read_bytes().replace(b"sh", b"sh ", 1))
    assert changed(before, keys(project)) == ["runner"]
    before = keys(project)
    p = project / IMG / "Dockerfile.base"
    p.write_bytes(p.read_bytes() + b"#")
    assert changed(before, keys(project)) == STAGES


@pytest.mark.parametrize("key, value, expect", [
    ("TOOL_VERSION", "1.1", ["tools", "app", "runner"]),
    ("APP_FLAVOUR", '"rocky road"', ["app", "runner"]),
    ("RUNNER_USER", "nobody", ["runner"]),
    ("UNUSED_PIN", "43", []),
    ("BASE_IMAGE", "imagebuild-test/busybox:2", STAGES),
])
def test_versions_env_value_reaches_declaring_stages_and_descendants(project, key, value, expect):
    before = keys(project)
    env = project / IMG / "versions.env"
    lines = [f"{key}={value}" if ln.startswith(f"{key}=") else ln for ln in env.read_text().splitlines()]
    env.write_text("\n".join(lines) + "\n")
    assert changed(before, keys(project)) == expect


def test_stage_arg_dependency_propagates(project):
    """app uses base's image through STAGE_BASE: a change to base reaches app even via that path."""
    p = plan.make_plan(definition.load(project, "tiny"))
    assert p.stage("app").uses_stages == ("base",)


def test_input_file_and_patch_changes(project):
    before = keys(project)
    (project / IMG / "files" / "tool.sh").write_text("#!/bin/sh\necho tool2\n")
    assert changed(before, keys(project)) == ["tools", "app", "runner"]
    before = keys(project)
    (project / "patches-eugr" / "patch_shared.py").write_text("print('changed')\n")
    assert changed(before, keys(project)) == ["app", "runner"]


def test_executable_bit_is_part_of_the_key(project):
    before = keys(project)
    (project / IMG / "files" / "tool.sh").chmod(0o644)
    assert changed(before, keys(project)) == ["tools", "app", "runner"]


def test_key_does_not_depend_on_location(project, tmp_path):
    import shutil

    other = tmp_path / "elsewhere" / "proj"
    shutil.copytree(project, other)
    assert keys(project) == keys(other)


def test_unpinned_reported(project):
    p = plan.make_plan(definition.load(project, "tiny"))
    msgs = [n.message for n in p.unpinned]
    assert any("pull request 15 is not pinned" in m for m in msgs)
    assert any("has no digest" in m for m in msgs)


def test_help_is_complete():
    res = run_cli("--help")
    assert res.code == 0
    for word in ("list", "plan", "validate", "doctor", "exit codes", "IMAGEBUILD_ROOT"):
        assert word in res.out
    for cmd in ("list", "plan", "validate", "doctor"):
        r = run_cli(cmd, "--help")
        assert r.code == 0 and "exit codes" in r.out and "--json" in r.out


def test_bad_flag_exits_2():
    res = run_cli("plan", "--frobnicate")
    assert res.code == 2


def test_patch_primitive_change_reaches_patching_stages_only(project, monkeypatch, tmp_path):
    before = keys(project)
    changed_primitive = tmp_path / "patching.py"  # the primitive with one more line, as an upgrade may
    changed_primitive.write_text(plan.primitive_path().read_text() + "# changed\n")
    monkeypatch.setattr(plan, "primitive_path", lambda: changed_primitive)
    assert changed(before, keys(project)) == ["app", "runner"]


def test_source_script_exports_commit_and_version_of_each_source():
    from imagebuild.plan import source_mounts

    lock = {"sources": {"VLLM": {"tarball": "deps-src/x/vllm-1.tar.gz", "sha256": "a" * 64,
                                 "commit": "06f922207" + "0" * 31, "version": "0.1.dev20489+g06f922207"},
                        "OLD": {"tarball": "deps-src/x/old.tar.gz", "sha256": "b" * 64}}}
    script = source_mounts.source_mounts(lock, "s", ["VLLM", "OLD"]).script()
    assert "export IMAGEBUILD_VERSION_VLLM=0.1.dev20489+g06f922207\n" in script
    assert f"export IMAGEBUILD_COMMIT_VLLM={'06f922207' + '0' * 31}" in script
    assert "IMAGEBUILD_VERSION_OLD" not in script and "IMAGEBUILD_COMMIT_OLD" not in script
    # the version is part of what the stage receives, so of its key
    other = {"sources": {**lock["sources"], "VLLM": {**lock["sources"]["VLLM"], "version": "0.1.dev1+g06f922207"}}}
    a = source_mounts.source_mounts(lock, "s", ["VLLM"]).key_inputs()
    b = source_mounts.source_mounts(other, "s", ["VLLM"]).key_inputs()
    assert a["tarballs"] == b["tarballs"] and a["generated"] != b["generated"]
