"""The cuda-targets check says why when the image's cuobjdump cannot run (issue 32): PyPI's real aarch64
cuobjdump 13.5.37 (its wheel is tagged manylinux_2_17, the program needs GLIBC_2.38) in the test bed's arm64
bookworm image (glibc 2.36), gated under emulation. Before, every file came back unreadable and the verdict
blamed the libraries. Needs the arm64 base and handler (scripts/testbed.sh) and about 300 KB from PyPI."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile

import pytest

from imagebuild.core import emulation
from tests.conftest import _engine_required, run_cli

pytestmark = pytest.mark.engine

ARM64_BASE = "imagebuild-test/debian-arm64:bookworm"


def _need(ok: bool, why: str) -> None:
    if not ok:
        if _engine_required() and os.environ.get("IMAGEBUILD_ARM64") != "0":
            pytest.fail(why)
        pytest.skip(why)


def test_a_cuobjdump_built_for_a_newer_glibc_is_named_as_the_reason(tmp_path, engine_info):
    h = emulation.handler_for("arm64")
    _need(h is not None and h.in_containers, "no aarch64 binfmt handler with the F flag")
    _need(subprocess.run(["docker", "image", "inspect", ARM64_BASE], capture_output=True).returncode == 0,
          f"{ARM64_BASE} missing")
    dl = subprocess.run([sys.executable, "-m", "pip", "download", "--isolated", "--no-deps", "--only-binary=:all:",
                         "--platform", "manylinux_2_17_aarch64", "--python-version", "3.11", "--implementation", "cp",
                         "-d", str(tmp_path), "nvidia-cuda-cuobjdump==13.5.37"], capture_output=True, text=True)
    if dl.returncode != 0:
        _need(False, f"PyPI does not answer: {dl.stderr[-300:]}")
    (whl,) = tmp_path.glob("nvidia_cuda_cuobjdump-*.whl")
    ctx = tmp_path / "ctx"
    ctx.mkdir()
    with zipfile.ZipFile(whl) as z:
        (ctx / "cuobjdump").write_bytes(z.read("nvidia/cu13/bin/cuobjdump"))
    (ctx / "cuobjdump").chmod(0o755)
    (ctx / "Dockerfile").write_text(f"FROM {ARM64_BASE}\nCOPY cuobjdump /opt/cuda/bin/cuobjdump\n")
    tag = f"imagebuild-test/cuobjdump-glibc:t{os.getpid()}"
    subprocess.run(["docker", "buildx", "build", "--load", "--platform", "linux/arm64", "--network", "none", "-q",
                    "-t", tag, str(ctx)], check=True, capture_output=True)
    try:
        spec = tmp_path / "gate.yaml"
        spec.write_text("checks:\n  - id: targets\n    kind: cuda-targets\n    path: /usr/lib\n"
                        "    sass: [sm_121a]\n    cuobjdump: /opt/cuda/bin/cuobjdump\n")
        r = run_cli("gate", tag, "--spec", str(spec))
        assert r.code == 4, r.out + r.err
        text = r.out + r.err
        assert "cuobjdump cannot run in the image (/opt/cuda/bin/cuobjdump)" in text, text
        assert "it needs GLIBC_2.38, the image's glibc is 2.36" in text, text
        assert "Traceback" not in text
    finally:
        subprocess.run(["docker", "image", "rm", tag], capture_output=True)
