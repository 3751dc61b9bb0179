"""``imagebuild df`` lists this project's images; the other checkouts' images that share the stage
store are counted, and listed (marked) only with --all (issue 23, section 4)."""

from __future__ import annotations

import json

import pytest

from tests.conftest import run_cli

pytestmark = pytest.mark.engine


def test_df_is_scoped_to_this_project(project, tmp_path, monkeypatch, engine_info):
    stages = tmp_path / "stages"
    (stages / "someone-elses-image").mkdir(parents=True)  # another checkout built this one
    (stages / "tiny").mkdir()
    monkeypatch.setenv("IMAGEBUILD_STAGES", str(stages))
    monkeypatch.setenv("IMAGEBUILD_STATE_DIR", str(tmp_path / "state"))
    res = run_cli("--root", str(project), "df", "--json")
    assert res.code == 0, res.err
    doc = json.loads(res.out)
    names = [r["image"] for r in doc["images"]]
    assert "someone-elses-image" not in names and {"tiny", "staged", "mirror"} <= set(names)
    assert doc["other_images"] == 1 and all(r["this_project"] for r in doc["images"])
    human = run_cli("--root", str(project), "df")
    assert "someone-elses-image" not in human.out
    assert "+ 1 image(s) of other checkouts in the shared stage store (imagebuild df --all)" in human.out
    doc = json.loads(run_cli("--root", str(project), "df", "--all", "--json").out)
    other = [r for r in doc["images"] if r["image"] == "someone-elses-image"]
    assert len(other) == 1 and other[0]["this_project"] is False
    human = run_cli("--root", str(project), "df", "--all")
    assert "someone-elses-image*" in human.out and "not this project's" in human.out
