"""Colour only on a terminal (issue 23): ``error:`` in red on a terminal's stderr, never in a pipe
or a log, never under NO_COLOR; PASS/FAIL the same on stdout. The real CLI, on a real pseudo-terminal."""

from __future__ import annotations

import os
import pty
import subprocess
import sys
from pathlib import Path

import pytest

from imagebuild.cli import common as cli

REPO = Path(__file__).resolve().parents[3]
FIXTURE = REPO / "tests" / "fixtures" / "project"
ARGV = [sys.executable, "-m", "imagebuild", "--root", str(FIXTURE), "plan", "nosuch", "--no-engine"]


def _stderr_on_a_terminal(env: dict) -> bytes:
    master, slave = pty.openpty()
    try:
        proc = subprocess.Popen(ARGV, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=slave, cwd=REPO,
                                env=env)
        os.close(slave)
        chunks = []
        while True:
            try:
                data = os.read(master, 4096)
            except OSError:  # EIO: the child closed the terminal
                break
            if not data:
                break
            chunks.append(data)
        assert proc.wait(timeout=60) == 2
        return b"".join(chunks)
    finally:
        os.close(master)


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "NO_COLOR"}
    return {**env, "PYTHONPATH": str(REPO), **extra}


def test_error_is_red_on_a_terminal_only():
    tty = _stderr_on_a_terminal(_env())
    assert tty.startswith(b"\x1b[31merror:\x1b[0m image definition 'nosuch'"), tty
    assert b"\x1b" not in _stderr_on_a_terminal(_env(NO_COLOR="1"))
    piped = subprocess.run(ARGV, capture_output=True, cwd=REPO, env=_env())
    assert piped.returncode == 2 and piped.stderr.startswith(b"error: ") and b"\x1b" not in piped.stderr


class _Stream:
    def __init__(self, tty: bool):
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


@pytest.mark.parametrize("line,coloured", [
    ("PASS     version-file  file  ok", "\x1b[32mPASS\x1b[0m     version-file  file  ok"),
    ("FAILED: 1 passed, 1 failed", "\x1b[31mFAILED\x1b[0m: 1 passed, 1 failed"),
    ("PASSED  img:local  identity sha256:ab", "\x1b[32mPASSED\x1b[0m  img:local  identity sha256:ab"),
    ("SKIPPED  gpu  no GPU", "SKIPPED  gpu  no GPU"),
])
def test_verdicts_are_coloured_on_a_terminal_only(monkeypatch, line, coloured):
    monkeypatch.delenv("NO_COLOR", raising=False)
    assert cli.verdicts(line, _Stream(True)) == coloured
    assert cli.verdicts(line, _Stream(False)) == line
    monkeypatch.setenv("NO_COLOR", "1")
    assert cli.verdicts(line, _Stream(True)) == line
