"""The engine's ``:local`` of an image is shared by every checkout on the node (issue 35, section 4):
when a promotion replaces a ``:local`` that another checkout promoted (a build it claims in the shared
stage store, buildstep/owners.py, and this one does not), the promotion says so, and the build record
names that checkout; replacing this checkout's own ``:local`` says nothing of the kind."""

from __future__ import annotations

import json
import shutil

import pytest

from tests.buildfixtures import image_id
from tests.conftest import run_cli
from tests.fleetfixtures import GATE_SPEC, fleet_project, remove_fleet_images, unique_name

pytestmark = pytest.mark.engine


def _build(root, name: str, motd: str):
    (root / "docker-images" / name / "files" / "motd.txt").write_text(motd + "\n")
    return run_cli("--root", str(root), "build", name, "--json", "--force")


def test_a_promotion_over_another_checkouts_local_says_so(engine_info, tmp_path):
    name = unique_name("ploc")
    a = fleet_project(tmp_path / "a", name)
    (a / "docker-images" / name / "gate.yaml").write_text(GATE_SPEC)
    b = tmp_path / "b"
    shutil.copytree(a, b, symlinks=True)  # another clone: its own state folder, the same stage store and engine
    try:
        r = _build(a, name, "from a")
        assert r.code == 0, r.err
        a_local = image_id(f"{name}:local")
        assert "another checkout" not in r.err
        r = _build(a, name, "from a, again")  # a replaces its own :local: nothing to say
        assert r.code == 0 and "another checkout" not in r.err, r.err
        a_local = image_id(f"{name}:local")
        r = _build(b, name, "from b")
        assert r.code == 0, r.err
        rec = json.loads(r.out)
        assert image_id(f"{name}:local") == rec["release"]["image_id"] != a_local
        assert image_id(f"{name}:previous") == a_local
        assert f"{name}:local holds build " in r.err and f"of another checkout ({a.resolve()})" in r.err, r.err
        assert f"imagebuild rollback {name} brings it back" in r.err
        assert rec["promotion"]["replaced_other"] == str(a.resolve())
    finally:
        remove_fleet_images(name)
