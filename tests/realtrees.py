"""The real upstream trees in ../shared/upstream/ (snapshots with provenance), for tests.

The tests extract them themselves. When the folder is missing they are skipped with the reason,
outside CI; in CI (CI=true) or with IMAGEBUILD_REQUIRE_REAL_TREES=1 a missing snapshot fails.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import tarfile
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.gitfixtures import git

ROOT = Path(__file__).resolve().parents[1]
UPSTREAM = ROOT.parent / "shared" / "upstream"


@dataclass(frozen=True)
class Snapshot:
    name: str          # top folder inside the tarball
    tarball: str
    sha256: str        # from ../shared/upstream/README.md
    commit: str        # the upstream commit the snapshot is (README.md)
    top: bool = True   # the tarball has the top folder ``name``/ (False: its files are at the top)


VLLM = Snapshot("vllm", "vllm-28be48fa.tar.gz",
                "434d26d8746a4d4e947d99b9d9f70dd5376f557977b4f0775d50a46e85b4afc4",
                "28be48fa944d8c58aeffd1ab1b56e27828c6b268")
B12X = Snapshot("b12x", "b12x-36bce2c1.tar.gz",
                "ff6cfa7d2ac164bf74a0b48d4bc34f736308bef445aca309f84ce003cb92480b",
                "36bce2c1552ba2d47dc09f20a6f64fbfc8ec4ff8")
# the commit vLLM's vllm_flash_attn.cmake declares; a subset (CMakeLists.txt, cmake/, csrc/flash_attn/, ...)
FLASH_ATTN = Snapshot("flash-attention", "flash-attention-bce29425-subset.tar.gz",
                      "31b29160c5c6d5de4bb5b39daa9c88bdede061fce4b444188240ea2861e2d535",
                      "bce29425653ec0fbc579d329883030e832d15ada", top=False)


def required() -> bool:
    return os.environ.get("CI") == "true" or os.environ.get("IMAGEBUILD_REQUIRE_REAL_TREES") == "1"


def tarball(snap: Snapshot) -> Path:
    path = UPSTREAM / snap.tarball
    if not path.is_file():
        msg = (f"real upstream snapshot {path} is absent (the tests that run on the real trees need "
               f"../shared/upstream/ beside the project)")
        if required():
            pytest.fail(msg + " -- required in CI")
        pytest.skip(msg)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    assert digest == snap.sha256, f"{path}: sha256 {digest}, README.md says {snap.sha256}"
    return path


def extract(snap: Snapshot, dest: Path) -> Path:
    """Extract the snapshot under dest; returns the tree (dest/<name>)."""
    path = tarball(snap)
    tree = dest / snap.name
    if not tree.is_dir():
        dest.mkdir(parents=True, exist_ok=True)
        with tarfile.open(path) as tf:
            tf.extractall(dest if snap.top else tree, filter="data")
    assert tree.is_dir(), f"{path} has no top folder {snap.name}/"
    return tree


def stand_in_commit(up, snapshot_tree: Path, branch: str) -> str:
    """STAND-IN commit: the snapshot's tree, committed on ``branch`` of ``up``; returns its SHA."""
    work = up.work
    git("rm", "-q", "-r", ".", cwd=work)
    subprocess.run(["cp", "-a", f"{snapshot_tree}/.", str(work)], check=True)
    git("add", "-A", ".", cwd=work)
    sha = up.commit({}, f"STAND-IN: the tree of the public snapshot {snapshot_tree.name}")
    git("push", "-q", "origin", f"{sha}:refs/heads/{branch}", cwd=work)
    return sha
