"""A wheel whose program cannot run on the stage's glibc is refused at prefetch (issue 32): PyPI's real
aarch64 nvidia-cuda-cuobjdump (tagged manylinux_2_17, its cuobjdump linked against GLIBC_2.38) for a
bookworm stage (glibc 2.36), and taken for a stage that declares 2.38. About 300 KB of download."""

from __future__ import annotations

import shutil

import pytest

from imagebuild.core import lock as lock_mod
from imagebuild.core.errors import OperationFailed
from imagebuild.definition import reader as d
from imagebuild.fetch import packages
from tests.conftest import FIXTURES

ARM = "ib-pkgs-arm"
CUOBJDUMP = "nvidia-cuda-cuobjdump==13.5.37\n"


@pytest.fixture
def state(tmp_path, monkeypatch):
    monkeypatch.setenv("IMAGEBUILD_STATE_DIR", str(tmp_path / "state"))


def _arm(tmp_path, glibc: str):
    root = tmp_path / "project"
    shutil.copytree(FIXTURES / "packages", root)
    img = root / "docker-images" / ARM
    (img / "requirements-py.txt").write_text(CUOBJDUMP)
    y = img / "image.yaml"
    y.write_text(y.read_text().replace('python: "3.11"', f'python: {{version: "3.11", glibc: "{glibc}"}}'))
    return root, d.load(root, ARM)


def test_a_program_that_needs_a_newer_glibc_is_refused(tmp_path, state):
    root, defn = _arm(tmp_path, "2.36")
    assert defn.python.glibc == "2.36"
    with pytest.raises(OperationFailed) as ei:
        packages.prefetch_wheels(defn)
    msg = ei.value.message
    assert "nvidia_cuda_cuobjdump-13.5.37-" in msg and "nvidia/cu13/bin/cuobjdump needs glibc 2.38" in msg
    assert "stage's glibc 2.36" in msg and "python.glibc" in msg
    assert not (root / "deps-src" / ARM / "wheels" / "pydeps").exists()  # nothing half-written
    assert lock_mod.read(root / "docker-images" / ARM) is None


def test_the_same_program_is_taken_where_the_glibc_is_new_enough(tmp_path, state):
    _, defn = _arm(tmp_path, "2.38")
    section = packages.prefetch_wheels(defn)
    (w,) = section["pydeps"]["files"]
    assert w["name"] == "nvidia-cuda-cuobjdump" and "aarch64" in w["filename"]
