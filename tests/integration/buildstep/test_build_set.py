"""``build --set KEY=VALUE``, a one-run override for experiments (issue 35, section 4): a different
input, so a different stage key and build id; recorded in the build record and the image's
build.json; gated, but never promoted to ``:local`` without ``--promote-set``."""

from __future__ import annotations

import json

import pytest

from tests.buildfixtures import image_id
from tests.conftest import run_cli
from tests.fleetfixtures import GATE_SPEC, fleet_project, remove_fleet_images, unique_name

pytestmark = pytest.mark.engine


def test_a_one_run_override_is_another_build_recorded_and_never_promoted_unasked(engine_info, tmp_path):
    name = unique_name("bset")
    root = fleet_project(tmp_path / "p", name)
    (root / "docker-images" / name / "gate.yaml").write_text(GATE_SPEC)
    build = lambda *extra: run_cli("--root", str(root), "build", name, "--json", "--force", *extra)  # noqa: E731
    try:
        r = build()
        assert r.code == 0, r.err
        plain = json.loads(r.out)
        local = image_id(f"{name}:local")
        assert local == plain["release"]["image_id"] and plain["overrides"] == {}

        r = build("--set", "TOOL_VERSION=9.9")
        assert r.code == 0, r.err
        rec = json.loads(r.out)
        assert rec["build_id"] != plain["build_id"]
        keys = {s["name"]: s["key"] for s in rec["stages"]}
        plain_keys = {s["name"]: s["key"] for s in plain["stages"]}
        assert keys["base"] == plain_keys["base"] and keys["tools"] != plain_keys["tools"]  # only from tools on
        assert rec["overrides"] == {"TOOL_VERSION": "9.9"}
        tools = next(s for s in rec["stages"] if s["name"] == "tools")
        assert tools["args"]["TOOL_VERSION"] == "9.9"
        # gated, not promoted: :local stays, :candidate is the experiment
        assert rec["promotion"]["status"] == "skipped" and "--promote-set" in rec["promotion"]["reason"]
        assert image_id(f"{name}:local") == local
        assert image_id(f"{name}:candidate") == rec["release"]["image_id"]
        assert "--promote-set promotes it" in r.err
        # the image says so, and diff names the value
        d = run_cli("--root", str(root), "diff", f"{name}:local", f"{name}:candidate", "--json")
        assert d.code == 0, d.err
        assert json.loads(d.out)["build_args"]["changed"] == [{"name": "tools TOOL_VERSION", "from": "1.0",
                                                               "to": "9.9"}]
        # asked for: promoted
        r = build("--set", "TOOL_VERSION=9.9", "--promote-set")
        assert r.code == 0, r.err
        assert json.loads(r.out)["promotion"]["status"] == "promoted"
        assert image_id(f"{name}:local") == rec["release"]["image_id"]
    finally:
        remove_fleet_images(name)


@pytest.mark.parametrize("argv, said", [
    (["--set", "NOPE=1"], "no stage of {name} declares a build arg NOPE"),
    (["--set", "TOOL_VERSON=1"], "did you mean TOOL_VERSION?"),
    (["--set", "PARENT=busybox"], "declares a build arg PARENT"),
    (["--set", "TOOL_VERSION"], "expected KEY=VALUE"),
    (["--set", "TOOL_VERSION=1", "--set", "TOOL_VERSION=2"], "--set TOOL_VERSION: given twice"),
])
def test_a_bad_override_is_exit_2_before_anything(engine_info, tmp_path, argv, said):
    name = unique_name("bset")
    root = fleet_project(tmp_path / "p", name)
    r = run_cli("--root", str(root), "build", name, *argv)
    assert r.code == 2 and said.format(name=name) in r.err, r.err
    assert not (root / ".imagebuild" / "builds").exists()
