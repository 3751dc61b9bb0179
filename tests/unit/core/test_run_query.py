"""run.Query: the short read-only queries plan starts with os.posix_spawnp (its git provenance)."""

from __future__ import annotations

import os
import time

import pytest

from imagebuild.core import run
from imagebuild.core.errors import OperationFailed


def test_it_gives_the_exit_code_and_the_stripped_output():
    assert run.Query(["sh", "-c", "printf ' hello\\n'; echo oops >&2"]).result() == (0, "hello")
    assert run.Query(["sh", "-c", "echo no; exit 3"]).result() == (3, "no")


def test_queries_run_at_once():
    t0 = time.monotonic()
    queries = [run.Query(["sleep", "0.5"]) for _ in range(3)]
    assert [q.result()[0] for q in queries] == [0, 0, 0]
    assert time.monotonic() - t0 < 1.4  # one after the other would take 1.5 s


def test_large_output_is_read_whole():
    code, out = run.Query(["head", "-c", "300000", "/dev/zero"]).result()
    assert code == 0 and out == "\0" * 300000


def test_a_query_past_its_timeout_is_killed_and_reaped():
    q = run.Query(["sleep", "30"], timeout=0.3)
    t0 = time.monotonic()
    code, _ = q.result()
    assert code == -9 and time.monotonic() - t0 < 5
    with pytest.raises(ChildProcessError):
        os.waitpid(q.pid, os.WNOHANG)  # already reaped: no zombie left


def test_a_missing_command_is_a_clear_error():
    with pytest.raises(OperationFailed, match="no-such-tool-xyz: command not found"):
        run.Query(["no-such-tool-xyz", "--version"])


def test_the_child_reads_no_stdin_and_gets_none_of_our_descriptors(tmp_path):
    with open(tmp_path / "f", "w") as mine:
        q = run.Query(["sh", "-c", "readlink /proc/self/fd/0; ls /proc/$$/fd"])
        code, out = q.result()
        ours = {str(mine.fileno()), str(q._fd)}
    stdin, *fds = out.split("\n")
    assert code == 0 and stdin == "/dev/null"
    assert not ours & set(fds), fds
