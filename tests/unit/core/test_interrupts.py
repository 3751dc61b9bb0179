"""core/interrupts.py: the first of SIGINT, SIGTERM, SIGHUP raises KeyboardInterrupt; those that follow
while its cleanup runs are swallowed (issue 22). Real signals, sent to this process (the main thread:
Python runs signal handlers only there). The real-process runs are in
tests/integration/buildstep/test_build_signals.py and tests/integration/gate/test_gate.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from imagebuild.core import interrupts


def _deliver(sig: int) -> None:
    os.kill(os.getpid(), sig)
    time.sleep(0.01)  # the handler runs at the next bytecode boundary; a sleep is one


@pytest.fixture(autouse=True)
def sigint_default():
    """These tests send SIGINT to this process: it must reach Python's handler whatever the suite was
    started with (``nohup make test &`` or a background job starts it with SIGINT ignored, and
    ``interrupts.install`` rightly keeps an ignored SIGINT ignored). Put back as it was after."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


@pytest.fixture
def installed():
    old = interrupts.install()
    yield
    interrupts.restore(old)


def test_the_first_signal_interrupts_and_the_rest_wait_for_its_cleanup(installed):
    cleaned = []
    with pytest.raises(KeyboardInterrupt):
        try:
            _deliver(signal.SIGINT)
            raise AssertionError("not interrupted")
        finally:  # the cleanup: later signals, even of another kind, go by without raising
            for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
                _deliver(sig)
            cleaned.append(True)
    assert cleaned == [True]
    assert interrupts.first() == signal.SIGINT


def test_install_starts_over_and_restore_gives_back_the_handlers():
    before = signal.getsignal(signal.SIGTERM)
    old = interrupts.install()
    try:
        with pytest.raises(KeyboardInterrupt):
            _deliver(signal.SIGTERM)
        _deliver(signal.SIGTERM)  # swallowed
        interrupts.install()  # a new run: the next signal interrupts again
        assert interrupts.first() is None
        with pytest.raises(KeyboardInterrupt):
            _deliver(signal.SIGHUP)
    finally:
        interrupts.restore(old)
    assert signal.getsignal(signal.SIGTERM) == before


def test_an_ignored_sigint_stays_ignored():
    """A background job or nohup inherits SIGINT ignored: imagebuild does not take it back."""
    code = ("import signal, os, time\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\n"
            "from imagebuild.core import interrupts\ninterrupts.install()\n"
            "os.kill(os.getpid(), signal.SIGINT); time.sleep(0.05)\n"
            "print(signal.getsignal(signal.SIGINT) == signal.SIG_IGN, signal.getsignal(signal.SIGTERM) == "
            "interrupts.handler)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["True", "True"]


# SIGTERM to process $1 as fast as sh can, until it is a zombie (or gone, or 20 s passed)
SHOOTER = r"""end=$(( $(date +%s) + 20 ))
while kill -TERM "$1" 2>/dev/null; do
  read -r st < "/proc/$1/stat" || break
  case "$st" in *") Z "*) break ;; esac
  [ "$(date +%s)" -lt "$end" ] || break
done"""


def _exit_under_fire(ignore: bool) -> int:
    """A process interrupted by SIGTERM exits 130 while another process keeps sending it SIGTERM
    until it has ended; returns its exit status."""
    code = ("import signal, os, sys, subprocess, time\nfrom imagebuild.core import interrupts\ninterrupts.install()\n"
            "try:\n    os.kill(os.getpid(), signal.SIGTERM); time.sleep(0.05)\nexcept KeyboardInterrupt:\n"
            f"    {'interrupts.ignore_until_exit()' if ignore else 'pass'}\n"
            "subprocess.Popen(['sh', '-c', SHOOTER, 'sh', str(os.getpid())], stdin=subprocess.DEVNULL,\n"
            "                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)\n"
            "time.sleep(0.2)\nsys.exit(130)\n")
    code = f"SHOOTER = {SHOOTER!r}\n" + code
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60).returncode


def test_after_the_cleanup_the_process_entry_ignores_them_until_exit():
    """The interpreter's exit puts Python-level handlers back to the default: a signal then would end
    the process by the signal instead of 130. main() (the process's entry) ignores them first."""
    assert [_exit_under_fire(ignore=True) for _ in range(3)] == [130] * 3
    # what it guards against: without it, a signal during the exit ends the process by the signal
    assert -signal.SIGTERM in [_exit_under_fire(ignore=False) for _ in range(5)]
