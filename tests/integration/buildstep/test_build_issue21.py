"""Issue 21 against the real engine: what reaches the image is what the key covers (a retargeted
folder link, a new empty folder), a gate-failed build still prints its record with ``--json``, the
diff names a patch digest once, and a base whose tag moved off its pin is said before any stage
is built, in prefetch's words."""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.conftest import run_cli
from tests.fleetfixtures import fleet_project, remove_fleet_images, unique_name

pytestmark = pytest.mark.engine


def _build(root, name, *args):
    return run_cli("--root", str(root), "build", name, "--json", *args)


def test_a_gate_failed_build_prints_its_record_and_the_diff_names_each_digest_once(engine_info, tmp_path,
                                                                                    monkeypatch):
    name = unique_name("gjson")
    root = fleet_project(tmp_path / "p", name, gate=True)
    d = root / "docker-images" / name
    monkeypatch.setenv("IMAGEBUILD_STAGES", str(tmp_path / "stages"))
    monkeypatch.setenv("IMAGEBUILD_NO_GPU", "1")
    try:
        res = _build(root, name)
        assert res.code == 0, res.err
        assert json.loads(res.out)["promotion"]["status"] == "promoted"
        # another patch script (same edit) and a gate that fails: exit 4, and the record on stdout
        patch = d / "patch_greet.py"
        patch.write_text(patch.read_text().replace('reason="louder greeting"', 'reason="louder greeting (v2)"'))
        gate = d / "gate.yaml"
        gate.write_text(gate.read_text().replace('contains: "imagebuild-patch: greet-loud"',
                                                 'contains: "no-such-text"'))
        res = _build(root, name)
        assert res.code == 4, res.err
        rec = json.loads(res.out)
        assert rec["status"] == "gate-failed" and rec["promotion"]["status"] == "gate-failed"
        assert rec["release"]["identity"].startswith("sha256:")
        # what changed from :local to the failed candidate: the patch digest, written once
        r = run_cli("--root", str(root), "diff", f"{name}:local", f"{name}:candidate")
        assert r.code == 0, r.err
        assert "`patch_greet.py`: applied sha256:" in r.out and "sha256:sha256:" not in r.out, r.out
    finally:
        remove_fleet_images(name)


def test_a_base_tag_moved_off_its_pin_is_said_before_any_stage_is_built(engine_info, tmp_path, monkeypatch):
    from tests.peers import BUSYBOX, DEBIAN

    name = unique_name("moved")
    base = f"imagebuild-test/{name}-base:1"
    digest = subprocess.run(["docker", "image", "inspect", "--format", "{{.Id}}", BUSYBOX], check=True,
                            capture_output=True, text=True).stdout.strip()
    d = tmp_path / "p" / "docker-images" / name
    d.mkdir(parents=True)
    (d / "versions.env").write_text(f"BASE_IMAGE={base}@{digest}\n")
    (d / "image.yaml").write_text("platform: linux/amd64\nstages:\n  - name: one\n    from: BASE_IMAGE\n")
    (d / "Dockerfile.one").write_text("ARG PARENT\nFROM ${PARENT}\nRUN echo one > /one\n")
    monkeypatch.setenv("IMAGEBUILD_STAGES", str(tmp_path / "stages"))
    subprocess.run(["docker", "tag", BUSYBOX, base], check=True, capture_output=True)
    try:
        res = _build(tmp_path / "p", name, "--no-gate")
        assert res.code == 0, res.err
        subprocess.run(["docker", "tag", DEBIAN, base], check=True, capture_output=True)  # the tag moves
        (d / "Dockerfile.one").write_text("ARG PARENT\nFROM ${PARENT}\nRUN echo two > /one\n")  # a stage to build
        res = _build(tmp_path / "p", name, "--no-gate")
        assert res.code == 1, res.err
        assert (f"docker-images/{name}/versions.env: BASE_IMAGE: imagebuild-test/{name}-base@{digest} is not in "
                "the local engine") in res.err
        assert "tag moved off the pinned digest" in res.err and f"imagebuild prefetch {name}" in res.err
        assert "healthy" not in res.err and "building" not in res.err
    finally:
        subprocess.run(["docker", "image", "rm", base], capture_output=True)
        remove_fleet_images(name)


def _sh(ref: str, script: str) -> str:
    return subprocess.run(["docker", "run", "--rm", "--network", "none", "--entrypoint", "sh", ref, "-c", script],
                          check=True, capture_output=True, text=True).stdout


def test_a_retargeted_folder_link_and_a_new_empty_folder_each_give_a_new_key_and_reach_the_image(
        engine_info, tmp_path, monkeypatch):
    """Issue 21, case 2: after ``src/inc -> sub`` became ``src/inc -> sub2`` every stage was skipped
    and the image held the old link; an empty folder reached the image outside the key. Both are in
    the context stream now: a new key, a built stage, and the image (read back from the engine) holds
    what the definition holds; the old target again gives the old key and the old image back."""
    import os

    name = unique_name("ctx")
    root = fleet_project(tmp_path / "p", name)
    d = root / "docker-images" / name
    y = d / "image.yaml"
    y.write_text(y.read_text().replace("files: [files/tool.sh]", "files: [files/tool.sh, files/tree]"))
    df = d / "Dockerfile.tools"
    df.write_text(df.read_text() + "COPY files/tree /opt/tree\n")
    src = d / "files" / "tree" / "src"
    (src / "sub").mkdir(parents=True)
    (src / "sub2").mkdir()
    (src / "sub" / "a.txt").write_text("a\n")
    (src / "sub2" / "b.txt").write_text("b\n")
    os.symlink("sub", src / "inc")
    monkeypatch.setenv("IMAGEBUILD_STAGES", str(tmp_path / "stages"))

    def build():
        res = _build(root, name, "--no-gate")
        assert res.code == 0, res.err
        rec = json.loads(res.out)
        return rec, {s["name"]: (s["key"], s["status"]) for s in rec["stages"]}

    look = "readlink /opt/tree/src/inc; ls /opt/tree/src/inc/; ls -a /opt/tree/src | tr '\\n' ' '"
    try:
        one, k1 = build()
        assert _sh(f"{name}:candidate", look).splitlines()[:2] == ["sub", "a.txt"]

        os.unlink(src / "inc")
        os.symlink("sub2", src / "inc")  # the same name, another folder
        two, k2 = build()
        assert k2["tools"][0] != k1["tools"][0] and k2["tools"][1] == "built"
        assert k2["base"] == (k1["base"][0], "skipped") and two["build_id"] != one["build_id"]
        for ref in (f"{name}:candidate", f"{name}:b-{two['build_id']}"):
            assert _sh(ref, look).splitlines()[:2] == ["sub2", "b.txt"], ref

        (src / "empty").mkdir()  # an empty folder: nothing git could hold, but it reaches the image
        three, k3 = build()
        assert k3["tools"][0] not in (k1["tools"][0], k2["tools"][0]) and k3["tools"][1] == "built"
        assert "empty" in _sh(f"{name}:candidate", look).splitlines()[2].split()
        assert _sh(f"{name}:candidate", "test -d /opt/tree/src/empty && ls -A /opt/tree/src/empty | wc -l").strip() \
            == "0"

        (src / "empty").rmdir()
        os.unlink(src / "inc")
        os.symlink("sub", src / "inc")  # back to the first tree: its key, its image
        four, k4 = build()
        assert k4["tools"] == (k1["tools"][0], "skipped") and four["build_id"] == one["build_id"]
        out = _sh(f"{name}:candidate", look).splitlines()
        assert out[:2] == ["sub", "a.txt"] and "empty" not in out[2].split()
    finally:
        remove_fleet_images(name)


def test_an_ignored_file_that_reaches_the_image_gives_a_dirty_revision_label(engine_info, tmp_path, monkeypatch):
    """Issue 21, provenance: a ``__pycache__`` inside a ``files:`` folder reached the image while the
    revision label named the clean commit. It still reaches the image (what is built is what is
    there), and the label, build.json and the record say ``-dirty`` and why."""
    from tests.buildfixtures import cat, labels
    from tests.gitfixtures import git

    name = unique_name("prov")
    root = fleet_project(tmp_path / "p", name)
    d = root / "docker-images" / name
    y = d / "image.yaml"
    y.write_text(y.read_text().replace("files: [files/tool.sh]", "files: [files/tool.sh, files/tree]"))
    df = d / "Dockerfile.tools"
    df.write_text(df.read_text() + "COPY files/tree /opt/tree\n")
    (d / "files" / "tree").mkdir()
    (d / "files" / "tree" / "mod.py").write_text("X = 1\n")
    (root / ".gitignore").write_text("__pycache__/\n*.pyc\n/.imagebuild/\n")
    git("init", "-q", cwd=root)
    git("add", "-A", cwd=root)
    git("commit", "-qm", "definitions", cwd=root)
    head = git("rev-parse", "HEAD", cwd=root)
    monkeypatch.setenv("IMAGEBUILD_STAGES", str(tmp_path / "stages"))
    try:
        res = _build(root, name, "--no-gate")
        assert res.code == 0, res.err
        assert labels(f"{name}:candidate")["org.opencontainers.image.revision"] == head
        (d / "files" / "tree" / "__pycache__").mkdir()
        (d / "files" / "tree" / "__pycache__" / "mod.cpython-311.pyc").write_text("not from git\n")
        res = _build(root, name, "--no-gate")
        assert res.code == 0, res.err
        rec = json.loads(res.out)
        assert cat(f"{name}:candidate", "/opt/tree/__pycache__/mod.cpython-311.pyc") == "not from git\n"
        assert labels(f"{name}:candidate")["org.opencontainers.image.revision"] == head + "-dirty"
        doc = json.loads(cat(f"{name}:candidate", "/opt/imagebuild/build.json"))
        assert doc["provenance"]["dirty_paths"] == [f"docker-images/{name}/files/tree/__pycache__"]
        assert any("no commit holds" in w for w in rec["warnings"]) and "no commit holds" in res.err
    finally:
        remove_fleet_images(name)
