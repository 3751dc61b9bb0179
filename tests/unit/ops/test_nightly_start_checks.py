"""nightly checks what its last steps need before its first one (issue 22): a report folder it
cannot write, or a peer sync would refuse, is exit 2 at once, before prefetch, build or gate ran
(on main both were found hours later: the report lost with an internal error, the peer refused
after the gate). No engine is asked: nothing runs."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import run_cli, tree_state


@pytest.fixture
def state(tmp_path, monkeypatch) -> Path:
    d = tmp_path / "state"
    monkeypatch.setenv("IMAGEBUILD_STATE_DIR", str(d))
    monkeypatch.setenv("IMAGEBUILD_GIT_RETRIES", "1")  # on old code the run would reach the network first
    return d


def _nothing_ran(state: Path) -> None:
    # at most the nightly's lock file and the (empty) default report folder: no build record, no
    # prefetch, no report
    left = set(tree_state(state)) if state.exists() else set()
    assert left <= {"nightly.lock", "nightly/"}, left


@pytest.mark.parametrize("where, says", [
    ("a-file", "is not a folder"),
    ("under-a-file", "cannot make the folder"),
    ("/proc/imagebuild-reports", "cannot make the folder /proc/imagebuild-reports"),
])
def test_a_report_folder_that_cannot_be_written(project, state, tmp_path, where, says):
    f = tmp_path / "afile"
    f.write_text("not a folder\n")
    rdir = {"a-file": str(f), "under-a-file": str(f / "reports")}.get(where, where)
    r = run_cli("--root", str(project), "nightly", "tiny", "--no-peers", "--no-gc", "--report-dir", rdir)
    assert r.code == 2, r.err
    assert "--report-dir" in r.err and says in r.err, r.err
    assert "internal error" not in r.err and "Traceback" not in r.err
    assert "tiny:" not in r.err  # no step of the image ran
    assert f.read_text() == "not a folder\n"
    _nothing_ran(state)


def test_the_default_report_folder_is_checked_too(project, state):
    state.mkdir()
    (state / "nightly").write_text("")  # a file where the folder belongs
    r = run_cli("--root", str(project), "nightly", "tiny", "--no-peers", "--no-gc")
    assert r.code == 2 and "the nightly report folder" in r.err and "is not a folder" in r.err, r.err
    assert not (state / "builds").exists()


@pytest.mark.parametrize("peer, says", [
    ("-oProxyCommand=touch {marker}", "not an SSH destination"),
    ("a b", "not an SSH destination"),
    ("@rack9", "no peer list '@rack9' in imagebuild.yaml"),
])
def test_a_peer_sync_would_refuse(project, state, tmp_path, peer, says):
    marker = tmp_path / "ran"
    peer = peer.format(marker=marker)
    r = run_cli("--root", str(project), "nightly", "tiny", "--no-gc", "--report-dir", str(tmp_path / "r"),
                "--peer", "dgx4", f"--peer={peer}")
    assert r.code == 2, r.err
    assert says in r.err and "tiny:" not in r.err, r.err
    assert not marker.exists()
    assert not (tmp_path / "r").exists()  # refused before even the report folder was made
    _nothing_ran(state)


def test_a_peer_list_from_imagebuild_yaml_is_checked_before_the_first_step(project, state, tmp_path):
    """--peers @LIST reads imagebuild.yaml at the start: a broken list there is exit 2 naming its line."""
    (project / "imagebuild.yaml").write_text("peers: [dgx4]\npeer_lists:\n  rack: ['-oFoo']\n")
    r = run_cli("--root", str(project), "nightly", "tiny", "--no-gc", "--report-dir", str(tmp_path / "r"),
                "--peer", "@rack")
    assert r.code == 2, r.err
    assert "imagebuild.yaml:3" in r.err and "peer_lists.rack" in r.err and "tiny:" not in r.err, r.err
    _nothing_ran(state)


@pytest.mark.parametrize("var", ["IMAGEBUILD_STATE_DIR", "IMAGEBUILD_STAGES", "IMAGEBUILD_LOCK_DIR"])
@pytest.mark.parametrize("kind", ["a-file", "under-proc"])
def test_an_unusable_folder_is_named_before_the_first_step(project, tmp_path, monkeypatch, kind, var):
    """The nightly's lock lives in the state folder: an IMAGEBUILD_STATE_DIR that is a file was an
    internal error (FileExistsError) there; the stage store and the lock folder were found by each
    image's build, after its prefetch."""
    f = tmp_path / "a-file"
    f.write_text("not a folder\n")
    if var != "IMAGEBUILD_STATE_DIR":
        monkeypatch.setenv("IMAGEBUILD_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv(var, str(f) if kind == "a-file" else "/proc/imagebuild-x")
    monkeypatch.setenv("IMAGEBUILD_GIT_RETRIES", "1")
    before = tree_state(project)
    r = run_cli("--root", str(project), "nightly", "tiny", "--no-peers", "--no-gc")
    assert r.code == 2 and var in r.err, r.err
    assert "internal error" not in r.err and "tiny:" not in r.err, r.err
    assert tree_state(project) == before and f.read_text() == "not a folder\n"
