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
