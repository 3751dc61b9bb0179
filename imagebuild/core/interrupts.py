"""Signals that end a run: SIGINT, SIGTERM and SIGHUP all behave like Ctrl-C.

The first one raises ``KeyboardInterrupt``, so every ``finally`` runs: child processes are stopped,
temporary folders removed, the run record written, locks released, and the CLI exits 130. The
ones that follow while that cleanup runs (a second Ctrl-C, a SIGTERM sent after it, a burst of
them) are swallowed: they would otherwise raise in the middle of the cleanup and leave a child,
a temporary folder or a container behind, or end the process by the signal (143) instead of 130.
A cleanup is bounded by itself (``run.stream`` kills a child after a grace period); ``kill -9``
still ends a run at once.

Only the C module ``_signal`` is imported: the ``signal`` module builds its enums at import,
about 1 ms of every start.
"""

from __future__ import annotations

import _signal
from collections.abc import Iterator
from contextlib import contextmanager

SIGNALS = (_signal.SIGINT, _signal.SIGTERM, _signal.SIGHUP)

_first: list[int] = []  # the signal that started the cleanup, once one came


def handler(signum, frame) -> None:
    """The first signal raises ``KeyboardInterrupt``; later ones return at once (the cleanup goes on)."""
    if _first:
        return
    _first.append(signum)
    raise KeyboardInterrupt


def first() -> int | None:
    """The signal that interrupted this run (None when none did)."""
    return _first[0] if _first else None


def install() -> dict[int, object]:
    """``handler`` for the three signals (main thread only; elsewhere nothing changes). A SIGINT
    inherited as ignored (a background job, nohup) stays ignored. Returns the handlers replaced."""
    _first.clear()
    old: dict[int, object] = {}
    for sig in SIGNALS:
        try:
            prev = _signal.getsignal(sig)
            if sig == _signal.SIGINT and prev == _signal.SIG_IGN:
                continue
            _signal.signal(sig, handler)
            old[sig] = prev
        except (ValueError, OSError):  # not the main thread (tests call main() in-process from threads)
            pass
    return old


def restore(old: dict[int, object]) -> None:
    """Put back the handlers ``install`` replaced."""
    for sig, prev in old.items():
        try:
            _signal.signal(sig, prev if prev is not None else _signal.SIG_DFL)
        except (ValueError, OSError, TypeError):
            pass


def ignore_until_exit() -> None:
    """After an interrupted run's cleanup, in the process's own entry point: the three signals are
    ignored from now on. The interpreter's exit sets Python-level handlers back to the default
    before the process ends, and a signal arriving then would kill it (143, or -2) instead of the
    130 the cleanup has already earned."""
    for sig in SIGNALS:
        try:
            if _signal.getsignal(sig) == handler:
                _signal.signal(sig, _signal.SIG_IGN)
        except (ValueError, OSError):
            pass


@contextmanager
def as_interrupt() -> Iterator[None]:
    """For a library caller that did not ``install``: the three signals behave as above inside the
    block, and are put back after it. Inside the CLI (already installed) it changes nothing."""
    try:
        ours = _signal.getsignal(_signal.SIGTERM) == handler
    except (ValueError, OSError):
        ours = True
    if ours:
        yield
        return
    old = install()
    try:
        yield
    finally:
        restore(old)
