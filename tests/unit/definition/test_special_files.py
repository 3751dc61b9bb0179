"""A FIFO, socket or device where a definition names a file is named and never read (issue 22, "FIFOs":
a read would hang until someone writes). Each case hung or passed on old code; each runs the real
CLI in a child process under a timeout, so a hang fails the test instead of stopping the suite.
And imagebuild.yaml's problems are its own: titled by that file, a bad byte by line and column,
`validate` reads it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import run_cli, tree_state

REPO = Path(__file__).resolve().parents[3]
TINY = Path("docker-images") / "tiny"


def cli(project: Path, *argv: str, timeout: float = 30) -> subprocess.CompletedProcess:
    t0 = time.monotonic()
    try:
        r = subprocess.run([sys.executable, "-m", "imagebuild", "--root", str(project), *argv], capture_output=True,
                           text=True, timeout=timeout, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    except subprocess.TimeoutExpired:
        raise AssertionError(f"imagebuild {' '.join(argv)} hung ({timeout} s)") from None
    assert time.monotonic() - t0 < timeout
    return r


def _fifo(path: Path) -> None:
    if path.exists():
        path.unlink()
    os.mkfifo(path)


def _edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new, 1))


@pytest.mark.parametrize("command", [["validate", "tiny"], ["plan", "tiny", "--no-engine"]])
def test_a_fifo_dockerfile_is_named_not_read(project, command):
    _fifo(project / TINY / "Dockerfile.app")
    r = cli(project, *command)
    assert r.returncode == 2, r.stderr
    assert "Dockerfile.app is a FIFO, not a Dockerfile" in r.stderr and "image.yaml:9" in r.stderr, r.stderr


def test_a_fifo_in_files_is_refused_by_validate_too(project):
    """plan and build refused it already; validate said ok."""
    _fifo(project / TINY / "files" / "tool.sh")
    for argv in (["validate", "tiny"], ["plan", "tiny", "--no-engine"], ["build", "tiny", "--dry-run"]):
        r = cli(project, *argv)
        assert r.returncode == 2, (argv, r.stderr)
        assert "'files/tool.sh' is a FIFO" in r.stderr and "image.yaml:8" in r.stderr, (argv, r.stderr)


@pytest.mark.parametrize("key, name", [("apt", "apt.txt"), ("requirements", "reqs.txt")])
def test_a_fifo_package_list_is_named_not_read(project, key, name):
    _edit(project / TINY / "image.yaml", "    files: [files/tool.sh]\n", f"    files: [files/tool.sh]\n    {key}: {name}\n")
    _fifo(project / TINY / name)
    r = cli(project, "validate", "tiny")
    assert r.returncode == 2, r.stderr
    assert f"'{name}' is a FIFO, expected a file" in r.stderr, r.stderr


def test_a_package_list_that_is_a_folder_is_named(project):
    _edit(project / TINY / "image.yaml", "    files: [files/tool.sh]\n", "    files: [files/tool.sh]\n    apt: apt.txt\n")
    (project / TINY / "apt.txt").mkdir()
    r = run_cli("--root", str(project), "validate", "tiny")
    assert r.code == 2 and "'apt.txt' is a folder, expected a file" in r.err, r.err


def test_an_oversized_dockerfile_is_refused_unread(project):
    with open(project / TINY / "Dockerfile.app", "r+b") as f:
        f.truncate(200 << 20)  # sparse: nothing written
    r = run_cli("--root", str(project), "validate", "tiny")
    assert r.code == 2 and "Dockerfile.app: is 209715200 bytes: larger than 8388608 bytes" in r.err, r.err


def _config(project: Path, kind: str) -> None:
    cfg = project / "imagebuild.yaml"
    if kind == "folder":
        cfg.mkdir()
    elif kind == "fifo":
        os.mkfifo(cfg)
    elif kind == "utf8":
        cfg.write_bytes(b"peers: [caf\xe9]\n")
    elif kind == "big":
        with open(cfg, "wb") as f:
            f.truncate(200 << 20)
    else:
        cfg.write_text("peerz: [dgx4]\n")


CONFIG_CASES = {
    "folder": "imagebuild.yaml: is a folder, expected a file",
    "fifo": "imagebuild.yaml: is not a regular file, expected a file",
    "utf8": "imagebuild.yaml:1: not valid UTF-8 text (byte 0xe9 at line 1, column 12)",
    "big": "imagebuild.yaml: is 209715200 bytes: larger than 1048576 bytes (1 MiB)",
    "key": "imagebuild.yaml:1: peerz: unknown key 'peerz'",
}


@pytest.mark.parametrize("kind", list(CONFIG_CASES))
def test_imagebuild_yaml_problems_are_its_own_and_validate_reads_it(project, kind):
    _config(project, kind)
    before = tree_state(project) if kind != "fifo" else None
    r = cli(project, "validate")  # the whole project: its definitions and its imagebuild.yaml
    assert r.returncode == 2, r.stderr
    assert "error: imagebuild.yaml has 1 problem:" in r.stderr, r.stderr
    assert CONFIG_CASES[kind] in r.stderr, r.stderr
    assert "image definition has" not in r.stderr and "position" not in r.stderr and "Traceback" not in r.stderr
    assert "tiny: ok" in r.stdout  # the definitions are still checked and listed
    r = cli(project, "validate", "--json")
    doc = json.loads(r.stdout)
    assert r.returncode == 2 and all(x["valid"] for x in doc["results"]), doc
    assert doc["settings"]["file"] == "imagebuild.yaml" and doc["settings"]["valid"] is False, doc["settings"]
    assert CONFIG_CASES[kind].rsplit(": ", 1)[1].replace("'", "") in json.dumps(doc["settings"]["problems"]).replace(
        "'", ""), doc["settings"]
    r = cli(project, "sync", "--dry-run", "--image", "tiny")  # a command that uses it
    assert r.returncode == 2 and "error: imagebuild.yaml has 1 problem:" in r.stderr, r.stderr
    if before is not None:
        assert tree_state(project) == before


@pytest.mark.parametrize("text, says", [
    ("", "Dockerfile.app:1: is empty: no instruction, no FROM"),
    ("\n# only a comment\n\n", "Dockerfile.app:1: is empty: no instruction, no FROM"),
    ("\n\nARG X\nRUN true\n", "Dockerfile.app:3: no FROM instruction (the first is ARG on line 3)"),
])
def test_a_dockerfile_without_from_is_named_with_a_line(project, text, says):
    """The empty Dockerfile's error had no line (issue 22)."""
    (project / TINY / "Dockerfile.app").write_text(text)
    r = run_cli("--root", str(project), "validate", "tiny")
    assert r.code == 2 and f"docker-images/tiny/{says}" in r.err, r.err


@pytest.mark.parametrize("kind, says", [
    ("fifo", "is not a regular file (a FIFO, socket or device), expected a bundle file"),
    ("folder", "is a folder, expected a bundle file"),
    ("empty", "expected a bundle file, got an empty name"),
])
def test_unbundle_names_what_is_there_instead_of_a_bundle(project, tmp_path, kind, says):
    """A FIFO or folder given as the bundle was reported as "no such bundle file"; '' as '.'."""
    path = {"fifo": tmp_path / "b.tar", "folder": tmp_path / "b.tar", "empty": ""}[kind]
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "folder":
        path.mkdir()
    before = tree_state(project)
    r = cli(project, "unbundle", str(path))
    assert r.returncode == 2 and says in r.stderr, r.stderr
    assert "no such bundle file" not in r.stderr
    assert tree_state(project) == before


def test_a_gate_spec_problem_is_titled_by_the_spec_and_a_bad_byte_by_line(tmp_path):
    spec = tmp_path / "gate.yaml"
    spec.write_bytes(b"checks:\n  - {id: caf\xe9, kind: command, run: x}\n")
    r = run_cli("gate", "imagebuild-test/busybox:1", "--spec", str(spec))
    assert r.code == 2, r.err
    assert "error: gate spec has 1 problem:" in r.err and "image definition" not in r.err, r.err
    assert "gate.yaml:2: not valid UTF-8 text (byte 0xe9 at line 2, column 13)" in r.err and "position" not in r.err
    (tmp_path / "folder").mkdir()
    r = run_cli("gate", "imagebuild-test/busybox:1", "--spec", str(tmp_path / "folder"))
    assert r.code == 2 and "gate spec has 1 problem" in r.err and "is a folder, expected a gate spec file" in r.err


def test_gate_spec_empty_is_not_the_current_folder(project):
    r = run_cli("--root", str(project), "gate", "tiny", "--spec", "")
    assert r.code == 2 and "--spec: expected a gate spec file, got an empty name" in r.err, r.err
