"""``imagebuild rollback IMAGE --dry-run`` against the real engine: it says which tag would move where
and moves none (issue 23, section 4)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest

from tests.conftest import run_cli
from tests.peers import BUSYBOX, DEBIAN

pytestmark = pytest.mark.engine


def _id(ref: str) -> str:
    return subprocess.run(["docker", "image", "inspect", "--format", "{{.Id}}", ref], capture_output=True,
                          text=True, check=True).stdout.strip()


@pytest.fixture
def tagged(project, engine_info):
    name = f"rbdry-{os.getpid()}"  # its own name: no other test's tags are touched
    shutil.copytree(project / "docker-images" / "tiny", project / "docker-images" / name)
    subprocess.run(["docker", "tag", BUSYBOX, f"{name}:local"], check=True, capture_output=True)
    subprocess.run(["docker", "tag", DEBIAN, f"{name}:previous"], check=True, capture_output=True)
    yield project, name
    subprocess.run(["docker", "image", "rm", f"{name}:local", f"{name}:previous"], capture_output=True)


def test_rollback_dry_run_moves_no_tag(tagged):
    root, name = tagged
    local, previous = _id(f"{name}:local"), _id(f"{name}:previous")
    r = run_cli("--root", str(root), "rollback", name, "--dry-run")
    assert r.code == 0, r.err
    assert f"{name}:local    would move -> {previous[:19]}  (from {local[:19]})" in r.out
    assert f"{name}:previous would move -> {local[:19]}" in r.out and "dry run: no tag moved" in r.out
    assert _id(f"{name}:local") == local and _id(f"{name}:previous") == previous
    doc = json.loads(run_cli("--root", str(root), "rollback", name, "--dry-run", "--json").out)
    assert doc["dry_run"] is True and doc["local_id"] == previous and doc["previous_id"] == local
    # without --dry-run the tags swap, as before
    r = run_cli("--root", str(root), "rollback", name)
    assert r.code == 0 and _id(f"{name}:local") == previous and _id(f"{name}:previous") == local
    assert f"{name}:local    -> {previous[:19]}\n" in r.out
