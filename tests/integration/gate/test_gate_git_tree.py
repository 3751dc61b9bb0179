"""The `git-tree` gate check in a real container: the installed package folder of the test image (pip,
copied in from this run's environment) hashes to the tree git computes over the same files here."""

from __future__ import annotations

import json
import shutil
import textwrap
from pathlib import Path

import pip
import pytest

from tests.conftest import run_cli
from tests.gitfixtures import git
from tests.integration.gate.test_gate import gate_image, state  # noqa: F401  (pytest fixtures)

pytestmark = pytest.mark.engine


def _git_tree_of_pip(tmp_path: Path) -> str:
    """git's tree of the pip folder exactly as the test image got it (no __pycache__)."""
    repo = tmp_path / "repo"
    shutil.copytree(Path(pip.__file__).parent, repo / "pip", ignore=shutil.ignore_patterns("__pycache__"))
    git("init", "-q", "-b", "main", str(repo))
    git("add", "-A", "-f", ".", cwd=repo)
    return git("rev-parse", f"{git('write-tree', cwd=repo)}:pip", cwd=repo)


def test_git_tree_check_passes_the_same_files_and_fails_others(gate_image, state, tmp_path):  # noqa: F811
    want = _git_tree_of_pip(tmp_path)
    other = "c" * 40
    spec = tmp_path / "gate.yaml"
    spec.write_text(textwrap.dedent(f"""\
        checks:
          - {{id: bytecode, kind: command, run: python3 -m compileall -q /usr/lib/python3/dist-packages/pip}}
          - {{id: by-module, kind: git-tree, module: pip, tree: '{want}'}}
          - {{id: by-path, kind: git-tree, path: /usr/lib/python3/dist-packages/pip, tree: '{want}'}}
          - {{id: bytecode-counted, kind: git-tree, module: pip, tree: '{want}', exclude: []}}
          - {{id: wrong-tree, kind: git-tree, module: pip, tree: '{other}'}}
          - {{id: no-folder, kind: git-tree, path: /opt/nothing-here, tree: '{want}'}}
        """))
    # the first check writes bytecode beside the sources, as pip does when it installs a wheel
    r = run_cli("gate", gate_image, "--spec", str(spec), "--json")
    assert r.code == 4, r.out + r.err
    out = {c["id"]: (c["outcome"], c["detail"]) for c in json.loads(r.out)["checks"]}
    assert out["by-module"][0] == "passed" and f"git tree {want}" in out["by-module"][1], out
    assert out["by-path"][0] == "passed", out
    assert out["wrong-tree"][0] == "failed"
    assert f"git tree {want}" in out["wrong-tree"][1] and f"expected {other}" in out["wrong-tree"][1]
    assert out["no-folder"][0] == "failed" and "no such folder" in out["no-folder"][1]
    assert out["bytecode"][0] == "passed"
    # left out by default; counted when nothing is excluded: another tree
    assert "excluded (__pycache__, *.pyc)" in out["by-module"][1]
    assert out["bytecode-counted"][0] == "failed" and f"expected {want}" in out["bytecode-counted"][1]
