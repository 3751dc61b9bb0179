"""Issue 21: gitignored files (``*.pyc``, ``__pycache__/``) and empty folders inside a definition's
``files:`` folder reach the image (the context stream sends a folder as it is on disk), while the
revision label said clean. Now the build is marked dirty and says which paths no commit holds;
an ignored file no context holds (a ``__pycache__`` beside a patch script) leaves it clean. A real
``git`` repository, the real planner."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from tests.buildfixtures import IMAGE, staged_project
from tests.conftest import run_cli
from tests.gitfixtures import git

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="needs git")


@pytest.fixture
def repo(tmp_path):
    root = staged_project(tmp_path / "p")
    d = root / "docker-images" / IMAGE
    y = d / "image.yaml"
    y.write_text(y.read_text().replace("files: [files/tool.sh]", "files: [files/tool.sh, files/tree]"))
    (d / "files" / "tree" / "pkg").mkdir(parents=True)
    (d / "files" / "tree" / "pkg" / "mod.py").write_text("X = 1\n")
    (root / ".gitignore").write_text("__pycache__/\n*.pyc\n/.imagebuild/\n")
    git("init", "-q", cwd=root)
    git("add", "-A", cwd=root)
    git("commit", "-qm", "definitions", cwd=root)
    return root, d, git("rev-parse", "HEAD", cwd=root)


def provenance(root) -> dict:
    res = run_cli("--root", str(root), "plan", IMAGE, "--json", "--no-engine")
    assert res.code == 0, res.err
    return json.loads(res.out)["provenance"]


def test_committed_is_clean(repo):
    root, _, head = repo
    p = provenance(root)
    assert p["revision"] == head and p["dirty"] is False and p["dirty_paths"] == []


def test_an_ignored_file_in_a_files_folder_marks_the_build_dirty(repo):
    root, d, head = repo
    cache = d / "files" / "tree" / "pkg" / "__pycache__"
    cache.mkdir()
    (cache / "mod.cpython-311.pyc").write_bytes(b"\x00pyc")
    assert git("status", "--porcelain", cwd=root) == ""  # git itself sees nothing
    p = provenance(root)
    assert p["revision"] == head + "-dirty" and p["dirty"] is True
    assert p["dirty_paths"] == [f"docker-images/{IMAGE}/files/tree/pkg/__pycache__"]
    shutil.rmtree(cache)
    (d / "files" / "tree" / "stray.pyc").write_bytes(b"\x00")  # an ignored file, not a folder
    p = provenance(root)
    assert p["revision"] == head + "-dirty" and p["dirty_paths"] == [f"docker-images/{IMAGE}/files/tree/stray.pyc"]
    os.unlink(d / "files" / "tree" / "stray.pyc")
    assert provenance(root)["revision"] == head


def test_an_empty_folder_in_a_files_folder_marks_the_build_dirty(repo):
    root, d, head = repo
    (d / "files" / "tree" / "empty" / "deeper").mkdir(parents=True)
    assert git("status", "--porcelain", cwd=root) == ""  # git does not hold folders
    p = provenance(root)
    assert p["revision"] == head + "-dirty"
    assert p["dirty_paths"] == [f"docker-images/{IMAGE}/files/tree/empty/deeper"]
    res = run_cli("--root", str(root), "plan", IMAGE, "--no-engine")
    assert res.code == 0 and "held by no commit: docker-images/" in res.out


def test_an_ignored_file_no_context_holds_leaves_it_clean(repo):
    root, d, head = repo
    cache = d / "__pycache__"  # python imported patch_greet.py: beside it, in no stage's context
    cache.mkdir()
    (cache / "patch_greet.cpython-311.pyc").write_bytes(b"\x00pyc")
    assert provenance(root)["revision"] == head
