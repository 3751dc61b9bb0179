"""Malformed definitions: each gives exit 2, names the file and the line or key, and writes nothing."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.conftest import run_cli, tree_state

IMG = "docker-images/tiny"
SHA = "0123456789abcdef0123456789abcdef01234567"


def _edit(rel, old, new):
    def f(root: Path):
        p = root / rel
        text = p.read_text()
        assert old in text, (rel, old)
        p.write_text(text.replace(old, new, 1))
    return f


def _write(rel, text):
    def f(root: Path):
        (root / rel).write_text(text)
    return f


def _append(rel, text):
    def f(root: Path):
        with open(root / rel, "a") as fh:
            fh.write(text)
    return f


def _remove(rel):
    def f(root: Path):
        (root / rel).unlink()
    return f


def _unreadable(rel):
    def f(root: Path):
        os.chmod(root / rel, 0)
    return f


# (id, mutation, file named in the message, line or key named, words that must appear)
CASES = [
    ("env-syntax", _append(f"{IMG}/versions.env", "NOT A PIN\n"), f"{IMG}/versions.env", ":13", "expected KEY=VALUE"),
    ("env-spaces", _append(f"{IMG}/versions.env", "X = 1\n"), f"{IMG}/versions.env", ":13", "spaces around"),
    ("env-shell-eval", _append(f"{IMG}/versions.env", "X=$(date)\n"), f"{IMG}/versions.env", ":13", "bash would interpret"),
    ("env-duplicate", _append(f"{IMG}/versions.env", "TOOL_VERSION=2\n"), f"{IMG}/versions.env", ":13", "duplicate key"),
    ("short-sha", _edit(f"{IMG}/versions.env", f"DEMO_REF={SHA}", "DEMO_REF=0123456"), f"{IMG}/versions.env", "DEMO_REF", "short or malformed commit sha"),
    ("upper-sha", _edit(f"{IMG}/versions.env", f"DEMO_REF={SHA}", "DEMO_REF=" + SHA.upper()), f"{IMG}/versions.env", "DEMO_REF", "lower-case"),
    ("pr-short-sha", _edit(f"{IMG}/versions.env", "12@89abcdef", "12@89abcdef "), f"{IMG}/versions.env", "DEMO_PRS", "not a full 40-hex"),
    ("pr-garbage", _edit(f"{IMG}/versions.env", " 15\"", " fifteen\""), f"{IMG}/versions.env", "DEMO_PRS", "invalid pull request"),
    ("pr-duplicate", _edit(f"{IMG}/versions.env", " 15\"", " 12\""), f"{IMG}/versions.env", "DEMO_PRS", "listed twice"),
    ("missing-ref", _edit(f"{IMG}/versions.env", f"DEMO_REF={SHA}\n", ""), f"{IMG}/versions.env", "DEMO_REF", "no DEMO_REF"),
    ("bad-repo-url", _edit(f"{IMG}/versions.env", "https://example.invalid/demo.git", "ftp:/nope"), f"{IMG}/versions.env", "DEMO_REPO", "invalid repository URL"),
    ("prs-without-repo", _append(f"{IMG}/versions.env", "LONELY_PRS=1\n"), f"{IMG}/versions.env", "LONELY_PRS", "no matching LONELY_REPO"),
    ("tree-not-sha", _append(f"{IMG}/versions.env", "DEMO_TREE=237bc2b7\n"), f"{IMG}/versions.env", ":13: DEMO_TREE", "not a git tree id"),
    ("tree-without-repo", _append(f"{IMG}/versions.env", f"LONELY_TREE={SHA}\n"), f"{IMG}/versions.env", "LONELY_TREE", "no matching LONELY_REPO"),
    ("bad-digest", _edit(f"{IMG}/versions.env", "busybox:1", "busybox:1@sha256:abc"), f"{IMG}/versions.env", "BASE_IMAGE", "invalid digest"),
    ("bad-image-ref", _edit(f"{IMG}/versions.env", "imagebuild-test/busybox:1", "Not_An_Image"), f"{IMG}/versions.env", "BASE_IMAGE", "invalid image reference"),
    ("unknown-stage", _edit(f"{IMG}/image.yaml", "from: tools", "from: toolz"), f"{IMG}/image.yaml", ":10", "did you mean 'tools'"),
    ("forward-stage", _edit(f"{IMG}/image.yaml", "from: base\n", "from: runner\n"), f"{IMG}/image.yaml", ":7", "later stage"),
    ("unknown-yaml-key", _edit(f"{IMG}/image.yaml", "  - name: runner", "  - name: runner\n    dockerfiel: x"), f"{IMG}/image.yaml", ":13", "did you mean 'dockerfile'"),
    ("yaml-syntax", _edit(f"{IMG}/image.yaml", "stages:", "stages: ["), f"{IMG}/image.yaml", ":", "invalid YAML"),
    ("no-platform", _edit(f"{IMG}/image.yaml", "platform: linux/amd64\n", ""), f"{IMG}/image.yaml", "platform", "missing required key"),
    ("bad-platform", _edit(f"{IMG}/image.yaml", "linux/amd64", "windows/amd64"), f"{IMG}/image.yaml", ":2", "invalid platform"),
    ("duplicate-stage", _edit(f"{IMG}/image.yaml", "  - name: runner", "  - name: tools"), f"{IMG}/image.yaml", ":12", "duplicate stage name"),
    ("bad-stage-name", _edit(f"{IMG}/image.yaml", "  - name: runner", "  - name: Run Ner"), f"{IMG}/image.yaml", ":12", "invalid stage name"),
    ("arg-without-value", _edit(f"{IMG}/Dockerfile.tools", "ARG TOOL_VERSION", "ARG TOOL_VERSIONS"), f"{IMG}/Dockerfile.tools", ":3", "no value"),
    ("stage-arg-unknown", _edit(f"{IMG}/Dockerfile.app", "ARG STAGE_BASE", "ARG STAGE_NOPE"), f"{IMG}/Dockerfile.app", ":2", "no earlier stage"),
    ("missing-dockerfile", _remove(f"{IMG}/Dockerfile.runner"), f"{IMG}/image.yaml", "dockerfile", "not found"),
    ("unreadable-dockerfile", _unreadable(f"{IMG}/Dockerfile.tools"), f"{IMG}/Dockerfile.tools", "", "cannot read"),
    ("unreadable-versions", _unreadable(f"{IMG}/versions.env"), f"{IMG}/versions.env", "", "cannot read"),
    ("missing-versions", _remove(f"{IMG}/versions.env"), f"{IMG}/versions.env", "", "missing"),
    ("literal-from", _edit(f"{IMG}/Dockerfile.base", "FROM ${PARENT}", "FROM ubuntu:24.04"), f"{IMG}/Dockerfile.base", ":2", "outside versions.env"),
    ("syntax-directive", _edit(f"{IMG}/Dockerfile.base", "ARG PARENT", "# syntax=docker/dockerfile:1\nARG PARENT"), f"{IMG}/Dockerfile.base", ":1", "frontend image"),
    ("from-arg-not-global", _write(f"{IMG}/Dockerfile.base", "FROM ${PARENT}\nARG PARENT\n"), f"{IMG}/Dockerfile.base", ":1", "before the first FROM"),
    ("undeclared-copy", _edit(f"{IMG}/Dockerfile.tools", "COPY files/tool.sh", "COPY files/other.sh"), f"{IMG}/Dockerfile.tools", ":4", "not declared"),
    ("copy-url", _edit(f"{IMG}/Dockerfile.tools", "COPY files/tool.sh", "ADD https://example.invalid/x.tgz"), f"{IMG}/Dockerfile.tools", ":4", "needs the network"),
    ("traversal-file", _edit(f"{IMG}/image.yaml", "files: [files/tool.sh]", "files: [../../../etc/passwd]"), f"{IMG}/image.yaml", ":8", "no '..'"),
    ("absolute-file", _edit(f"{IMG}/image.yaml", "files: [files/tool.sh]", "files: [/etc/passwd]"), f"{IMG}/image.yaml", ":8", "no absolute"),
    ("missing-file", _edit(f"{IMG}/image.yaml", "files: [files/tool.sh]", "files: [files/nope.sh]"), f"{IMG}/image.yaml", ":8", "not found"),
    ("bad-patch-name", _edit(f"{IMG}/image.yaml", "patches: [patch_hello.py,", "patches: [files/tool.sh,"), f"{IMG}/image.yaml", ":11", "patch_*.py"),
    ("unknown-source", _edit(f"{IMG}/image.yaml", "  - name: runner", "  - name: runner\n    sources: [VLLM]"), f"{IMG}/image.yaml", ":13", "unknown git source"),
    ("plan-arg-in-env", _append(f"{IMG}/versions.env", "PARENT=evil\n"), f"{IMG}/versions.env", ":13", "provided by imagebuild"),
    ("no-parent-from", _write(f"{IMG}/Dockerfile.runner", "ARG STAGE_BASE\nFROM ${STAGE_BASE}\n"), f"{IMG}/Dockerfile.runner", "PARENT", "never builds FROM ${PARENT}"),
    ("not-utf8", lambda r: (r / IMG / "Dockerfile.app").write_bytes(b"FROM \xff\xfe\n"), f"{IMG}/Dockerfile.app", "", "not valid UTF-8"),
    ("empty-stages", _edit(f"{IMG}/image.yaml", "stages:", "stages: []\nold_stages:"), f"{IMG}/image.yaml", "stages", "non-empty list"),
]


@pytest.mark.parametrize("case", [c for c in CASES if c[2] is not None], ids=lambda c: c[0])
def test_malformed_definition(project, case):
    _id, mutate, file, where, needle = case
    mutate(project)
    if _id.startswith("unreadable") and os.geteuid() == 0:
        # root reads everything: make the file unreadable in a way root notices (a folder)
        target = project / file
        target.chmod(0o644)
        target.unlink()
        target.mkdir()
        needle = "is a folder"  # a folder where a file belongs is named as such, not "missing"
    before = tree_state(project)
    res = run_cli("--root", str(project), "plan", "tiny", "--no-engine")
    assert res.code == 2, res
    assert "Traceback" not in res.err
    assert res.out == ""
    assert file in res.err, res.err
    assert where in res.err, res.err
    assert needle in res.err, res.err
    assert tree_state(project) == before


def test_symlink_escape_refused(project):
    os.symlink("/etc/passwd", project / IMG / "files" / "escape")
    (project / IMG / "image.yaml").write_text(
        (project / IMG / "image.yaml").read_text().replace("files: [files/tool.sh]", "files: [files/escape]"))
    res = run_cli("--root", str(project), "plan", "tiny", "--no-engine")
    assert res.code == 2
    assert "outside its folder" in res.err and f"{IMG}/image.yaml:8" in res.err


def test_all_problems_in_one_run(project):
    _edit(f"{IMG}/versions.env", f"DEMO_REF={SHA}", "DEMO_REF=0123456")(project)
    _edit(f"{IMG}/image.yaml", "from: tools", "from: toolz")(project)
    _edit(f"{IMG}/Dockerfile.tools", "ARG TOOL_VERSION", "ARG TOOL_VERSIONS")(project)
    res = run_cli("--root", str(project), "plan", "tiny", "--no-engine")
    assert res.code == 2
    assert "3 problems" in res.err
    for needle in ("DEMO_REF", "toolz", "TOOL_VERSIONS"):
        assert needle in res.err


@pytest.mark.parametrize("name", ["../x", "/etc", "a/b", "UPPER", "", ".hidden", "x..y/../z"])
def test_image_name_must_be_identifier(project, name):
    res = run_cli("--root", str(project), "plan", name, "--no-engine")
    assert res.code == 2
    assert "invalid image name" in res.err


def test_unknown_image_suggests(project):
    res = run_cli("--root", str(project), "plan", "tinny", "--no-engine")
    assert res.code == 2
    assert "did you mean 'tiny'" in res.err


def test_debug_shows_traceback(project):
    _edit(f"{IMG}/image.yaml", "from: tools", "from: toolz")(project)
    res = run_cli("--root", str(project), "--debug", "plan", "tiny", "--no-engine")
    assert res.code == 2
    assert "Traceback" in res.err


def test_validate_reports_and_exits_2(project):
    _edit(f"{IMG}/image.yaml", "from: tools", "from: toolz")(project)
    res = run_cli("--root", str(project), "validate", "tiny", "--json")
    assert res.code == 2
    import json

    data = json.loads(res.out)
    (r,) = data["results"]
    assert r["valid"] is False and r["problems"][0]["line"] == 10


def test_unreadable_file_as_unprivileged_user(project, tmp_path):
    """A file the running user cannot read: run the real CLI as 'nobody' (root reads everything)."""
    import shutil
    import subprocess
    import sys

    if os.geteuid() != 0 or not shutil.which("setpriv"):
        pytest.skip("needs root and setpriv to switch to an unprivileged user")
    os.chmod(project / IMG / "Dockerfile.tools", 0)
    for p in [tmp_path, *tmp_path.parents]:
        if p != Path("/"):
            os.chmod(p, os.stat(p).st_mode | 0o005)
    for p in project.rglob("*"):
        if p.name != "Dockerfile.tools":
            os.chmod(p, os.stat(p).st_mode | (0o005 if p.is_dir() else 0o004))
    src = str(Path(__file__).resolve().parents[3])
    r = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-c",
                        f"import sys; sys.path.insert(0, {src!r}); from imagebuild.cli.main import main; "
                        f"sys.exit(main(['--root', {str(project)!r}, 'plan', 'tiny', '--no-engine']))"],
                       capture_output=True, text=True)
    assert r.returncode == 2, r.stderr
    assert f"{IMG}/Dockerfile.tools: cannot read: Permission denied" in r.stderr
    assert "Traceback" not in r.stderr
