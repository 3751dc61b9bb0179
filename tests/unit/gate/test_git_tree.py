"""The gate's `git-tree` check computes a folder's git tree id as git does: checked against git itself,
on the real b12x package (../shared/upstream snapshot 36bce2c1) and on the shapes git treats specially.

The hashing runs here with this Python, exactly the snippet the gate runs in the image."""

from __future__ import annotations

import compileall
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from imagebuild.core.errors import DefinitionError
from imagebuild.definition import gatespec
from imagebuild.gate import checks
from tests import realtrees
from tests.gitfixtures import git

DEFAULT = "\n".join(gatespec.GIT_TREE_EXCLUDE)


def hash_folder(path: Path, exclude: str = DEFAULT) -> dict:
    out = subprocess.run([sys.executable, "-c", checks._GIT_TREE, str(path), exclude],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def git_tree(repo: Path, folder: str) -> str:
    """The tree git itself records for ``folder`` after `git add -A` (in a fresh index)."""
    if not (repo / ".git").exists():
        git("init", "-q", "-b", "main", str(repo))
    git("add", "-A", ".", cwd=repo)
    tree = git("write-tree", cwd=repo)
    return git("rev-parse", f"{tree}:{folder}", cwd=repo)


def test_the_real_b12x_package_hashes_as_git_says(tmp_path):
    tree = realtrees.extract(realtrees.B12X, tmp_path)  # tmp/b12x: the repository's files
    want = git_tree(tree, "b12x")
    got = hash_folder(tree / "b12x")
    assert got["tree"] == want
    assert [f[2] for f in got["files"]] == sorted(git("ls-tree", "-r", "--name-only", want, cwd=tree).splitlines())
    # as installed: Python wrote its bytecode beside the sources; the package tree is the same
    assert compileall.compile_dir(str(tree / "b12x"), quiet=1)
    assert list((tree / "b12x").rglob("__pycache__"))
    after = hash_folder(tree / "b12x")
    assert after["tree"] == want and after["excluded"]
    assert all("__pycache__" in x for x in after["excluded"])
    # one byte of one module changed: another tree
    victim = next(p for p in sorted((tree / "b12x").rglob("*.py")) if p.stat().st_size)
    victim.write_bytes(victim.read_bytes() + b"\n")
    assert hash_folder(tree / "b12x")["tree"] != want


def test_modes_links_empty_folders_and_name_order_as_git(tmp_path):
    repo = tmp_path / "r"
    pkg = repo / "pkg"
    for rel, text in {"a.py": "A\n", "a-b.py": "x\n", "a/x.py": "y\n", "a.b/z.py": "z\n", "tool.sh": "#!/bin/sh\n",
                      "sub/deep/m.py": "M\n", "sub/data.json": "{}\n"}.items():
        (pkg / rel).parent.mkdir(parents=True, exist_ok=True)
        (pkg / rel).write_text(text)
    (pkg / "tool.sh").chmod(0o755)
    (pkg / "ro.py").write_text("R\n")
    (pkg / "ro.py").chmod(0o444)  # no write bit: still 100644 to git
    os.symlink("a.py", pkg / "link.py")
    os.symlink("../outside", pkg / "dangling")  # a link is its target text, wherever it points
    (pkg / "empty").mkdir()  # git records no empty folder
    (pkg / "only-bytecode" / "__pycache__").mkdir(parents=True)
    (pkg / "only-bytecode" / "__pycache__" / "x.cpython-312.pyc").write_bytes(b"\0")
    (pkg / "stray.pyc").write_bytes(b"\1")
    want = git_tree(repo, "pkg")  # `git add -A`: empty folders are nothing to git; the bytecode is added (no .gitignore)
    got = hash_folder(pkg)
    # with nothing excluded the hash takes the bytecode too, as git did; with the defaults it is what git
    # records once the bytecode is out of its index
    assert hash_folder(pkg, exclude="")["tree"] == want
    git("rm", "-q", "-r", "--cached", "pkg/stray.pyc", "pkg/only-bytecode", cwd=repo)
    assert got["tree"] == git("rev-parse", f"{git('write-tree', cwd=repo)}:pkg", cwd=repo)
    assert sorted(got["excluded"]) == ["only-bytecode/__pycache__", "stray.pyc"]
    modes = {rel: mode for mode, _, rel in got["files"]}
    assert modes["tool.sh"] == "100755" and modes["ro.py"] == "100644" and modes["link.py"] == "120000"
    assert "empty" not in str(got["files"])


def test_missing_folder_fails(tmp_path):
    r = subprocess.run([sys.executable, "-c", checks._GIT_TREE, str(tmp_path / "nope"), DEFAULT],
                       capture_output=True, text=True)
    assert r.returncode != 0 and "no such folder" in r.stderr


@pytest.mark.parametrize("body, where, needle", [
    ("{id: t, kind: git-tree, module: b12x}", "checks[t].tree", "needs `tree:`"),
    ("{id: t, kind: git-tree, module: b12x, tree: c9384d70}", "checks[t].tree", "40 lower-case hex"),
    ("{id: t, kind: git-tree, tree: " + "c" * 40 + "}", "checks[t]", "exactly one of `path`"),
    ("{id: t, kind: git-tree, module: b12x, path: /x, tree: " + "c" * 40 + "}", "checks[t]", "exactly one of"),
    ("{id: t, kind: git-tree, path: relative, tree: " + "c" * 40 + "}", "checks[t].path", "absolute path"),
    ("{id: t, kind: git-tree, module: b12x, exclude: [a/b], tree: " + "c" * 40 + "}", "checks[t].exclude", "names"),
])
def test_spec_errors(tmp_path, body, where, needle):
    spec = tmp_path / "gate.yaml"
    spec.write_text(f"checks:\n  - {body}\n")
    with pytest.raises(DefinitionError) as e:
        gatespec.load(spec)
    text = e.value.render()
    assert where in text and needle in text, text


def test_spec_defaults(tmp_path):
    spec = tmp_path / "gate.yaml"
    spec.write_text("checks:\n  - {id: t, kind: git-tree, module: b12x, tree: " + "c" * 40 + "}\n")
    c = gatespec.load(spec).checks[0]
    assert c.params == {"module": "b12x", "tree": "c" * 40, "exclude": ["__pycache__", "*.pyc"]}
