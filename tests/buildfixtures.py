"""Helpers for the build tests: a private project copy whose ``staged`` definition has a lock and
a prefetched tarball (packed here, deterministically, for a fictional upstream), and cleanup of
the images the build tests create."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import shutil
import subprocess
import tarfile
from pathlib import Path

from imagebuild.core import lock as lock_mod
from imagebuild.core.fsutil import sha256_file
from tests.conftest import FIXTURES

IMAGE = "staged"
GREET_FILES = {"greet.py": 'def greet():\n    return "hello"\n', "README": "greet: a tiny upstream\n"}
GREET_EPOCH = 1700000000


def tar_bytes(files: dict[str, bytes]) -> bytes:
    """A plain GNU tar of ``./name`` entries, in the given order (a source tarball's shape, for the
    tests of what extracts it)."""
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.GNU_FORMAT) as tf:
        for n, data in files.items():
            ti = tarfile.TarInfo("./" + n)
            ti.size = len(data)
            tf.addfile(ti, io.BytesIO(data))
    return raw.getvalue()


def pack(files: dict[str, str], dest: Path) -> None:
    """A deterministic .tar.gz: sorted ``./name`` entries, fixed owner and mtime, no gzip time."""
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for name in sorted(files):
            data = files[name].encode()
            info = tarfile.TarInfo("./" + name)
            info.size, info.mtime, info.mode, info.uid, info.gid = len(data), GREET_EPOCH, 0o644, 0, 0
            tf.addfile(info, io.BytesIO(data))
    dest.parent.mkdir(parents=True, exist_ok=True)
    with open(dest, "wb") as f, gzip.GzipFile(fileobj=f, mode="wb", mtime=0, filename="") as gz:
        gz.write(raw.getvalue())


def put_blob(blobs: Path, data: bytes) -> str:
    """``data`` into an OCI layout's ``blobs/sha256/`` folder under its digest; the digest."""
    h = hashlib.sha256(data).hexdigest()
    (blobs / h).write_bytes(data)
    return "sha256:" + h


def staged_project(dst: Path, greet: dict[str, str] | None = None) -> Path:
    """Copy tests/fixtures/project to ``dst`` and give ``staged`` its lock and GREET tarball."""
    shutil.copytree(FIXTURES / "project", dst, symlinks=True)
    rel = f"deps-src/{IMAGE}/src/greet-000000000000.tar.gz"
    pack(greet or GREET_FILES, dst / rel)
    d = dst / "docker-images" / IMAGE
    lock_mod.update_sections(d, IMAGE, {"sources": {"GREET": {
        "repo": "https://example.invalid/greet.git", "ref": "0123456789abcdef0123456789abcdef01234567",
        "prs": [], "commit": "0123456789abcdef0123456789abcdef01234567", "tree": None,
        "source_date_epoch": GREET_EPOCH, "tarball": rel, "sha256": sha256_file(dst / rel),
        "dependency_of": None, "declared_as": None, "env": None, "subdir": None, "submodules": False}}})
    return dst


def image_id(ref: str) -> str | None:
    r = subprocess.run(["docker", "image", "inspect", "--format", "{{.Id}}", ref], capture_output=True, text=True)
    return r.stdout.strip() if r.returncode == 0 else None


def labels(ref: str) -> dict:
    r = subprocess.run(["docker", "image", "inspect", "--format", "{{json .Config.Labels}}", ref],
                       capture_output=True, text=True, check=True)
    return json.loads(r.stdout)


def cat(ref: str, path: str) -> str:
    r = subprocess.run(["docker", "run", "--rm", "--network", "none", ref, "cat", path],
                       capture_output=True, text=True, check=True)
    return r.stdout


def remove_images(*repos: str) -> None:
    """Remove every tag of the given repositories (what the build tests created)."""
    for repo in repos:
        r = subprocess.run(["docker", "image", "ls", "--format", "{{.Repository}}:{{.Tag}}", repo],
                           capture_output=True, text=True)
        tags = [t for t in r.stdout.split() if t and not t.endswith(":<none>")]
        if tags:
            subprocess.run(["docker", "image", "rm", "-f", *tags], capture_output=True)
