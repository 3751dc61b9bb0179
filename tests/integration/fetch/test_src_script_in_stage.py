"""The generated ``imagebuild-src.sh`` run inside the test bed's base images (a plain ``docker run``
with no network, the context bind-mounted read-only as a stage's ``RUN --mount`` has it): it extracts
a plain tar (tarball format 2) and a gzip one (a lock packed by format 1, or the Rust toolchain's
archives) with the image's own tar, GNU's (Debian) or BusyBox's, whose ``-xf`` reads no gzip."""

from __future__ import annotations

import gzip
import hashlib
import subprocess

import pytest

from imagebuild.plan import source_mounts
from tests.buildfixtures import tar_bytes

pytestmark = pytest.mark.engine


@pytest.mark.parametrize("image", ["imagebuild-test/busybox:1", "imagebuild-test/debian:bookworm"])
def test_the_stage_script_extracts_format_2_and_format_1_tarballs(engine_ready, tmp_path, image):
    new, old = tar_bytes({"new.txt": b"format 2\n"}), gzip.compress(tar_bytes({"old.txt": b"format 1\n"}), mtime=0)
    lock = {"sources": {
        "NEW": {"tarball": "deps-src/i/src/new-0.tar", "sha256": hashlib.sha256(new).hexdigest(), "tarball_format": 2},
        "OLD": {"tarball": "deps-src/i/src/old-0.tar.gz", "sha256": hashlib.sha256(old).hexdigest(),
                "tarball_format": 1, "dependency_of": "NEW", "override": {"name": "OLD_SRC_DIR", "via": "env"}}}}
    ms = source_mounts.source_mounts(lock, "build", ["NEW"])
    assert [m.file for m in ms.mounts] == ["NEW.tar", "OLD.tar.gz"]
    ctx = tmp_path / "ctx"
    ctx.mkdir()
    (ctx / "NEW.tar").write_bytes(new)
    (ctx / "OLD.tar.gz").write_bytes(old)
    for name, data in ms.files().items():
        (ctx / name).write_bytes(data)
    r = subprocess.run(["docker", "run", "--rm", "--network", "none", "-v", f"{ctx}:{source_mounts.MOUNT}:ro", image,
                        "sh", "-c", f". {source_mounts.MOUNT}/{source_mounts.SCRIPT} && "
                        'cat "$IMAGEBUILD_SRC_NEW/new.txt" "$OLD_SRC_DIR/old.txt"'],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout == "format 2\nformat 1\n"
