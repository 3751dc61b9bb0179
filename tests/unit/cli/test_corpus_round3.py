"""The hostile-input corpus of issue 34 (round three), section 2: each case once gave an internal error
or a wrong answer. Each now gets a clear error naming the file, key or variable, exit 2, no traceback,
nothing written (docs/security.md)."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from tests.conftest import run_cli, tree_state

TINY = "docker-images/tiny"


def _clear(r, code: int, *names: str) -> None:
    assert r.code == code, (r.code, r.err)
    assert "internal error" not in r.err and "Traceback" not in r.err, r.err
    for n in names:
        assert n in r.err, (n, r.err)


def _loop(path: Path) -> None:
    """``path`` becomes a symlink loop (a -> b -> a)."""
    path.unlink()
    other = path.with_name(path.name + ".other")
    os.symlink(other.name, path)
    os.symlink(path.name, other)


@pytest.mark.parametrize("what, named", [
    ("versions.env", "versions.env: is a symlink loop"),
    ("Dockerfile.app", "'Dockerfile.app' is a symlink loop"),
    ("files/tool.sh", "'files/tool.sh' is a symlink loop"),
    ("image.yaml", "image.yaml: is a symlink loop"),
])
@pytest.mark.parametrize("command", ["validate", "plan"])
def test_a_symlink_loop_in_a_definition_is_named(project, what, named, command):
    _loop(project / TINY / what)
    r = run_cli("--root", str(project), command, "tiny")
    _clear(r, 2, named)


def _folder_input(project: Path) -> Path:
    """tiny's tools stage declares the folder files/extra too."""
    y = project / TINY / "image.yaml"
    y.write_text(y.read_text().replace("files: [files/tool.sh]", "files: [files/tool.sh, files/extra]"))
    d = project / TINY / "files/extra"
    d.mkdir()
    (d / "ok.txt").write_text("fine\n")
    return d


@pytest.mark.parametrize("command", ["validate", "plan", "build"])
def test_a_file_name_that_is_not_utf8_in_a_declared_folder_is_named(project, command):
    d = _folder_input(project)
    (d / os.fsdecode(b"bad\xffname")).write_text("x\n")
    before = tree_state(project)
    argv = ["build", "tiny", "--dry-run"] if command == "build" else [command, "tiny"]
    r = run_cli("--root", str(project), *argv)
    _clear(r, 2, "files/extra/bad\\udcffname", "not UTF-8")
    assert tree_state(project) == before


def test_a_file_name_that_is_not_utf8_elsewhere_in_the_definition_folder_does_not_crash_plan(project):
    (project / TINY / os.fsdecode(b"notes-\xfe.txt")).write_text("not an input\n")
    r = run_cli("--root", str(project), "plan", "tiny")
    _clear(r, 0)


@pytest.mark.parametrize("kind", ["fifo", "socket"])
def test_a_special_file_inside_a_declared_folder_fails_validate_as_it_fails_plan(project, kind):
    d = _folder_input(project)
    sock = None
    if kind == "fifo":
        os.mkfifo(d / "special")
    else:
        sock = socket.socket(socket.AF_UNIX)
        cwd = os.getcwd()
        os.chdir(d)  # a socket path is at most 107 bytes
        try:
            sock.bind("special")
        finally:
            os.chdir(cwd)
    try:
        for command in ("validate", "plan"):
            r = run_cli("--root", str(project), command, "tiny")
            _clear(r, 2, "special")
            assert ("FIFO" if kind == "fifo" else "socket") in r.err, r.err
    finally:
        if sock is not None:
            sock.close()


@pytest.mark.parametrize("argv", [["doctor", "--peer", "somehost"], ["gc", "--peer", "somehost"],
                                  ["nightly", "tiny", "--peers", "somehost"]])
def test_unbalanced_quotes_in_imagebuild_ssh_are_named(project, monkeypatch, argv):
    monkeypatch.setenv("IMAGEBUILD_SSH", "ssh -o 'ProxyCommand=nc")
    r = run_cli("--root", str(project), *argv)
    _clear(r, 2, "IMAGEBUILD_SSH", "No closing quotation")


@pytest.mark.parametrize("var", ["IMAGEBUILD_STATE_DIR", "IMAGEBUILD_LOCK_DIR", "IMAGEBUILD_STAGES"])
@pytest.mark.parametrize("kind", ["a-file", "under-proc"])
def test_build_dry_run_checks_the_folders_a_build_writes_in(project, tmp_path, monkeypatch, var, kind):
    f = tmp_path / "a-file"
    f.write_text("not a folder\n")
    monkeypatch.setenv(var, str(f) if kind == "a-file" else "/proc/imagebuild-x")
    before = tree_state(project)
    r = run_cli("--root", str(project), "build", "tiny", "--dry-run")
    _clear(r, 2, var)
    assert tree_state(project) == before
    assert f.read_text() == "not a folder\n"


def test_build_dry_run_makes_no_folder(project, tmp_path, monkeypatch):
    monkeypatch.setenv("IMAGEBUILD_STATE_DIR", str(tmp_path / "new" / "state"))
    r = run_cli("--root", str(project), "build", "tiny", "--dry-run")
    _clear(r, 0)
    assert not (tmp_path / "new").exists()


@pytest.mark.parametrize("text", [
    "root:$6$secretHASHvalue0123456789:19000:0:99999:7:::\ndaemon:*:19000:0:99999:7:::\n",
    "secretHASHvalue0123456789: 1\nother_secretHASHvalue: 2\n",
])
def test_gate_spec_that_is_some_other_file_quotes_nothing_of_it(project, tmp_path, text):
    f = tmp_path / "shadow"
    f.write_text(text)
    r = run_cli("--root", str(project), "gate", "tiny", "--spec", str(f), "--ref", "imagebuild-none:x")
    _clear(r, 2, "not a gate spec")
    assert "secretHASH" not in r.err and "daemon" not in r.err, r.err


def _two_failing_patches(tmp_path):
    from tests.unit.buildstep.test_patch_check_scratch import PATCH, _project

    ok = PATCH.format(extra="", anchor="x = 1\n", replacement="x = 2  # patched: p0\n", marker="patched: p0")
    bad = [PATCH.format(extra="", anchor=f"missing {i}\n", replacement=f"y  # patched: q{i}\n",
                        marker=f"patched: q{i}") for i in (1, 2)]
    # a patch whose first edit applies (after patch_a) and whose second one fails
    two = ('from imagebuild_patching import Edit\nEDITS = [Edit(file="app.py", anchor="x = 2", '
           'replacement="x = 3  # patched: t1", marker="patched: t1"), Edit(file="app.py", anchor="nowhere\\n", '
           'replacement="z  # patched: t2\\n", marker="patched: t2")]\n')
    return _project(tmp_path, {"patch_a.py": ok, "patch_b.py": bad[0], "patch_c.py": bad[1], "patch_d.py": two})


def test_patch_check_gives_every_failing_patch_its_reason(tmp_path):
    root, src = _two_failing_patches(tmp_path)
    r = run_cli("--root", str(root), "patch", "pc", "--src", str(src), "--check")
    assert r.code == 1, r.err
    assert "missing 1" in r.out and "missing 2" in r.out, r.out  # both reasons, not the first one's only
    assert "nowhere" in r.out, r.out
    assert "3 patches failed" in r.err, r.err


def test_patch_check_json_holds_the_failing_edit(tmp_path):
    import json

    root, src = _two_failing_patches(tmp_path)
    r = run_cli("--root", str(root), "patch", "pc", "--src", str(src), "--check", "--json")
    assert r.code == 1, r.err
    by = {p["patch"]: p for p in json.loads(r.out)["patches"]}
    assert [e["outcome"] for e in by["patch_b.py"]["edits"]] == ["failed"], by["patch_b.py"]
    assert "missing 1" in by["patch_b.py"]["edits"][0]["message"]
    assert [e["outcome"] for e in by["patch_d.py"]["edits"]] == ["would-apply", "failed"], by["patch_d.py"]


def test_doctor_warns_when_receipts_are_unsigned_or_not_verified(tmp_path, monkeypatch):
    """docs/gate.md said nothing takes a receipt at its word; without an allowed-signers file a consistent
    forgery is taken. doctor says so."""
    from imagebuild.ops import doctor

    monkeypatch.setenv("IMAGEBUILD_SIGNING_KEY", "none")
    monkeypatch.setenv("IMAGEBUILD_ALLOWED_SIGNERS", "none")
    got = {c.name: c for c in doctor.check_receipts(None)}
    assert got["receipt signing"].status == "warn" and "unsigned" in got["receipt signing"].detail
    assert got["receipt verification"].status == "warn" and "forge" in got["receipt verification"].detail
    key, signers = tmp_path / "key", tmp_path / "allowed_signers"
    key.write_text("k\n")
    signers.write_text("builder ssh-ed25519 AAAA\n")
    monkeypatch.setenv("IMAGEBUILD_SIGNING_KEY", str(key))
    monkeypatch.setenv("IMAGEBUILD_ALLOWED_SIGNERS", str(signers))
    assert {c.status for c in doctor.check_receipts(None)} == {"ok"}


def test_docs_say_what_an_unsigned_receipt_proves():
    text = (Path(__file__).resolve().parents[3] / "docs" / "gate.md").read_text()
    assert "at its word" not in text
    assert "### What an unsigned receipt proves" in text and "consistent forgery" in text


def test_a_run_folder_that_is_a_link_out_of_the_state_folder_is_not_followed(project, tmp_path, monkeypatch):
    import json

    from imagebuild.core import runs

    state = tmp_path / "state"
    monkeypatch.setenv("IMAGEBUILD_STATE_DIR", str(state))
    outside = tmp_path / "outside"
    (outside / "logs").mkdir(parents=True)
    record = {"status": "running", "owner": "nohost:1", "build_id": "f" * 16, "started": "2026-01-01T00:00:00Z"}
    (outside / "record.json").write_text(json.dumps(record))
    (outside / "logs" / "base.log").write_text("SECRET-OUTSIDE-LOG\n")
    d = state / "builds" / "tiny"
    d.mkdir(parents=True)
    (d / "20260101T000000Z-aaaaaa").symlink_to(outside, target_is_directory=True)
    before = (outside / "record.json").read_text()
    assert runs.list_runs(project, "tiny") == []
    runs.mark_abandoned(project, "tiny")
    assert (outside / "record.json").read_text() == before  # nothing written through the link
    r = run_cli("--root", str(project), "log", "tiny")
    assert "SECRET-OUTSIDE-LOG" not in r.out + r.err and "internal error" not in r.err, r.err


def test_a_patch_that_writes_to_an_absolute_path_at_import_leaves_the_checkout_alone(tmp_path):
    from tests.unit.buildstep.test_patch_check_scratch import PATCH, _project

    target = (tmp_path / "src" / "app.py").resolve()
    side = PATCH.format(extra=f"import pathlib\ntry:\n    pathlib.Path({str(target)!r}).write_text('clobbered\\n')\n"
                              "except OSError:\n    pass",
                        anchor="x = 1\n", replacement="x = 2  # patched: p1\n", marker="patched: p1")
    root, src = _project(tmp_path, {"patch_a.py": side})
    before = tree_state(src)
    r = run_cli("--root", str(root), "patch", "pc", "--src", str(src), "--check", "--json")
    assert "internal error" not in r.err, r.err
    assert tree_state(src) == before, (target.read_text(), r.err)
