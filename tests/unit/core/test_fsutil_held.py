"""core/fsutil.held: an exclusive flock for a with block (the gate's temp folder, the compiler cache's
take-back)."""

from __future__ import annotations

import fcntl
import os

import pytest

from imagebuild.core import fsutil


def _free(path) -> bool:
    fd = os.open(path, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


def test_held_excludes_others_for_the_block_and_lets_go_after(tmp_path):
    lock = tmp_path / "x.lock"
    with fsutil.held(lock):
        assert lock.is_file() and not _free(lock)
    assert _free(lock)


def test_held_lets_go_when_the_block_raises(tmp_path):
    lock = tmp_path / "x.lock"
    with pytest.raises(RuntimeError), fsutil.held(lock):
        raise RuntimeError("boom")
    assert _free(lock)
