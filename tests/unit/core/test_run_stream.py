"""run.stream ends when its child ends, whatever else still holds the child's pipe (issue 34: an ssh
ControlMaster holds the stdio of rsync's ssh, a mux client, until the peer closes the channel; a frozen
rsync receiver then hung `sync` for ever)."""

from __future__ import annotations

import os
import signal
import time

from imagebuild.core import run


def _holder_pids(marker: str) -> list[int]:
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/cmdline", "rb") as f:
                    if marker.encode() in f.read():
                        out.append(int(d))
            except OSError:
                pass
    return out


def test_a_pipe_held_by_a_process_outside_the_child_does_not_hold_the_call():
    """The child hands its output pipe to a process in another session (as a mux client hands its stdio
    to the master), prints, and exits 3: the call returns 3 with what it printed, at once."""
    marker = f"ibstream{os.getpid()}"
    lines: list[str] = []
    t0 = time.monotonic()
    try:
        rc = run.stream(["sh", "-c", f"setsid sh -c 'sleep 60; : {marker}' & echo hello; echo bye; exit 3"],
                        lines.append)
        took = time.monotonic() - t0
    finally:
        for pid in _holder_pids(marker):
            os.kill(pid, signal.SIGKILL)
    assert rc == 3 and lines == ["hello\n", "bye\n"]
    assert took < 5, took


def test_everything_the_child_wrote_is_read_before_it_ends():
    lines: list[str] = []
    rc = run.stream(["sh", "-c", "i=0; while [ $i -lt 2000 ]; do echo line $i; i=$((i+1)); done; printf tail"],
                    lines.append)
    assert rc == 0 and len(lines) == 2001
    assert lines[0] == "line 0\n" and lines[1999] == "line 1999\n" and lines[-1] == "tail"


def test_carriage_returns_end_lines_with_split_cr():
    lines: list[str] = []
    assert run.stream(["printf", "a\\rb\\r\\nc"], lines.append, split_cr=True) == 0
    assert lines == ["a\n", "b\n", "c"]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_a_child_of_run_dies_with_its_parent_killed_by_sigkill(tmp_path):
    """issue 34: after kill -9 of gc, the `docker image rm` it ran went on with gc's lock released. A
    child of run.run gets SIGKILL when its parent dies, however it dies."""
    import subprocess
    import sys

    pidfile = tmp_path / "child.pid"
    code = ("from imagebuild.core import run; "
            f"run.run(['sh', '-c', 'echo $$ > {pidfile}; exec sleep 60'])")
    parent = subprocess.Popen([sys.executable, "-c", code])
    child = None
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not (pidfile.exists() and pidfile.read_text().strip()):
            time.sleep(0.02)
        child = int(pidfile.read_text())
        assert _alive(child)
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and _alive(child):
            time.sleep(0.02)
        assert not _alive(child), "the child outlived its parent's kill -9"
    finally:
        if parent.poll() is None:
            parent.kill()
        if child is not None and _alive(child):
            os.kill(child, signal.SIGKILL)
