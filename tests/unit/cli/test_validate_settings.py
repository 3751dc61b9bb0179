"""``imagebuild validate`` also checks the project's imagebuild.yaml (issue 23, section 4)."""

from __future__ import annotations

import json

from tests.conftest import run_cli, tree_state


def test_validate_reports_a_bad_imagebuild_yaml(project):
    (project / "imagebuild.yaml").write_text("peers: [dgx4]\nregistyr: 127.0.0.1:5000/ib\n")
    before = tree_state(project)
    res = run_cli("--root", str(project), "validate")
    assert res.code == 2, res
    assert "imagebuild.yaml:2: registyr: unknown key 'registyr'" in res.err and "did you mean 'registry'" in res.err
    assert "Traceback" not in res.err
    res = run_cli("--root", str(project), "validate", "tiny", "--json")
    assert res.code == 2
    doc = json.loads(res.out)
    assert doc["results"][0]["valid"] is True
    assert doc["settings"]["valid"] is False and doc["settings"]["problems"][0]["line"] == 2
    assert tree_state(project) == before


def test_validate_says_a_good_imagebuild_yaml_is_ok(project):
    res = run_cli("--root", str(project), "validate", "--json")
    assert res.code == 0 and json.loads(res.out)["settings"] == {"file": "imagebuild.yaml", "present": False,
                                                                 "valid": True, "problems": []}
    (project / "imagebuild.yaml").write_text("peers: [dgx4]\n")
    res = run_cli("--root", str(project), "validate")
    assert res.code == 0 and "imagebuild.yaml: ok" in res.out
