"""The one place where imagebuild starts subprocesses.

Every command is logged as ``+ cmd`` (at debug level) and, when it fails, raises
``CommandFailed`` carrying the command, its exit code and the tail of its output. Secrets are
never put on a command line here: pass them through ``env`` (values are not logged).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from imagebuild.core import lazy
from imagebuild.core.errors import CommandFailed, OperationFailed

# logging (~10 ms), subprocess (~5 ms) and shlex are imported when used: `plan` runs git through
# ``Query`` (os.posix_spawn) and needs none of them
log = lazy.logger()
shlex = lazy.module("shlex")
subprocess = lazy.module("subprocess")


def which(name: str) -> str | None:
    """The executable ``name`` on PATH, as ``shutil.which`` finds it (without importing shutil)."""
    if os.sep in name:
        return name if os.path.isfile(name) and os.access(name, os.X_OK) else None
    for folder in os.environ.get("PATH", os.defpath).split(os.pathsep):
        path = os.path.join(folder or os.curdir, name)
        if os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    return None


def _announce(argv: Sequence[str]) -> list[str]:
    argv = [str(a) for a in argv]
    if lazy.debugging():  # -v: "+ cmd" for every command
        log.debug("+ %s", shlex.join(argv))
    return argv


# The engine every ``docker`` child talks to (remote_engine.use): DOCKER_HOST or DOCKER_CONTEXT, and
# a PATH whose ``ssh`` is $IMAGEBUILD_SSH. A value of None removes that variable from the child's
# environment. Empty: the engine the environment names (the local one by default).
_engine_env: dict[str, str | None] = {}


def set_engine_env(env: Mapping[str, str | None] | None) -> dict[str, str | None]:
    """Point every child started from now on at an engine (``{}`` or None: the environment's own);
    returns the previous setting, for restoring it."""
    global _engine_env
    old = _engine_env
    _engine_env = dict(env or {})
    return old


def engine_env() -> dict[str, str | None]:
    return dict(_engine_env)


def _environ(env: Mapping[str, str] | None) -> dict[str, str] | None:
    """The child's environment: ours, the engine's (set_engine_env), plus ``env`` (whose values are
    never logged)."""
    if env is None and not _engine_env:
        return None
    merged: dict[str, str | None] = {**os.environ, **_engine_env, **(env or {})}
    return {k: v for k, v in merged.items() if v is not None}


_SETPRIV: list[str | None] = []


def _dying_with_parent(argv: list[str]) -> list[str]:
    """``argv`` run so that it gets SIGKILL when the thread that started it dies, even by ``kill -9``
    (util-linux ``setpriv --pdeathsig``, when installed; else ``argv`` as it is). Only for a child
    waited for where it was started: a killed ``gc`` must not leave its ``docker image rm`` running
    with the lock released."""
    if not _SETPRIV:
        _SETPRIV.append(which("setpriv"))
    if _SETPRIV[0] is None or which(argv[0]) is None:  # a missing command is said as one, not by setpriv
        return argv
    return [_SETPRIV[0], "--pdeathsig", "KILL", "--", *argv]


def run(argv: Sequence[str], *, check: bool = True, capture: bool = True, timeout: float | None = None,
        env: Mapping[str, str] | None = None, cwd: Path | str | None = None, input: bytes | None = None,
        hint: str | None = None, pass_fds: Sequence[int] = ()) -> subprocess.CompletedProcess:
    """Run ``argv``; with ``capture`` stdout and stderr are returned (combined in ``.stdout``).
    ``pass_fds``: descriptors the child inherits (as ``subprocess`` keeps them). The child dies with
    this process (``_dying_with_parent``)."""
    argv = _announce(argv)
    try:
        proc = subprocess.run(
            _dying_with_parent(argv), cwd=cwd, env=_environ(env), input=input, timeout=timeout,
            pass_fds=tuple(pass_fds),
            stdout=subprocess.PIPE if capture else None,
            stderr=subprocess.STDOUT if capture else None,
        )
    except FileNotFoundError:
        raise OperationFailed(f"{argv[0]}: command not found", hint=hint or f"install {argv[0]}") from None
    except subprocess.TimeoutExpired:
        raise OperationFailed(f"command timed out after {timeout:g} s: {shlex.join(argv)}", hint=hint) from None
    if check and proc.returncode != 0:
        out = proc.stdout.decode("utf-8", "replace") if capture and proc.stdout else ""
        raise CommandFailed(argv, proc.returncode, out, hint=hint)
    return proc


class Query:
    """A short read-only query started with ``os.posix_spawn``: stdout to a pipe, no stdin, stderr
    dropped. For what ``plan`` asks git (three at once, while it computes the keys): no subprocess
    import, and a cheaper start than ``subprocess.Popen``. ``result()`` waits for it."""

    def __init__(self, argv: Sequence[str], *, timeout: float = 10):
        self.argv = _announce(argv)
        self.timeout = timeout
        read_fd, write_fd = os.pipe()  # both close-on-exec; the child's dup2 onto 1 is inherited
        try:
            actions = [(os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
                       (os.POSIX_SPAWN_DUP2, write_fd, 1),
                       (os.POSIX_SPAWN_OPEN, 2, os.devnull, os.O_WRONLY, 0)]
            # the full path: posix_spawnp would try an execve in every PATH folder before it
            program = which(self.argv[0]) or self.argv[0]
            self.pid = os.posix_spawn(program, self.argv, _environ(None) or os.environ, file_actions=actions)
        except FileNotFoundError:
            os.close(read_fd)
            raise OperationFailed(f"{self.argv[0]}: command not found", hint=f"install {self.argv[0]}") from None
        except BaseException:
            os.close(read_fd)
            raise
        finally:
            os.close(write_fd)
        self._fd = read_fd

    def result(self) -> tuple[int, str]:
        """(exit code, stdout stripped); a query that outlives its timeout is killed (exit -9)."""
        import select
        import time

        chunks = []
        deadline = time.monotonic() + self.timeout
        try:
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not select.select([self._fd], [], [], left)[0]:
                    os.kill(self.pid, 9)
                    break
                chunk = os.read(self._fd, 65536)
                if not chunk:
                    break
                chunks.append(chunk)
        finally:
            os.close(self._fd)
            _, status = os.waitpid(self.pid, 0)
        return os.waitstatus_to_exitcode(status), b"".join(chunks).decode("utf-8", "replace").strip()


def output(argv: Sequence[str], **kw) -> str:
    """Run ``argv`` and return its (decoded, stripped) output."""
    return run(argv, **kw).stdout.decode("utf-8", "replace").strip()


def popen(argv: Sequence[str], *, env: Mapping[str, str] | None = None, cwd: Path | str | None = None,
          stdin: bool = True, hint: str | None = None, merge_stderr: bool = False) -> subprocess.Popen:
    """Start ``argv`` with pipes (stdin optional, stdout binary, stderr captured, or into stdout with
    ``merge_stderr``) for streaming.

    The caller reads/writes the pipes, then calls ``check_popen`` to reap it and raise
    ``CommandFailed`` on a non-zero exit.
    """
    argv = _announce(argv)
    try:
        return subprocess.Popen(argv, cwd=cwd, env=_environ(env), stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT if merge_stderr else subprocess.PIPE)
    except FileNotFoundError:
        raise OperationFailed(f"{argv[0]}: command not found", hint=hint or f"install {argv[0]}") from None


def communicate(proc: subprocess.Popen, *, timeout: float, data: bytes | None = None) -> tuple[int | None, bytes, bytes]:
    """Feed ``data`` to a process started by ``popen`` and wait for it: (exit code, stdout, stderr);
    the exit code is None when it did not end within ``timeout`` seconds (it is then killed)."""
    try:
        out, err = proc.communicate(data, timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        return None, out or b"", err or b""
    return proc.returncode, out or b"", err or b""


def wait(proc: subprocess.Popen, timeout: float) -> int | None:
    """The exit code of a process started by ``popen``, or None when it has not ended within
    ``timeout`` seconds (it is left running)."""
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        return None


def detach(argv: Sequence[str], *, timeout: float, hint: str | None = None) -> tuple[int | None, str]:
    """Run ``argv`` that puts itself in the background once it is ready (``ssh -f``: a master
    connection, a tunnel): in its own session, no stdin or stdout, its stderr into a file (never a
    pipe that anyone waits on: the background part outlives this call). Returns (exit code, stderr);
    the exit code is None when it did not get ready within ``timeout`` seconds."""
    import tempfile

    argv = _announce(argv)
    with tempfile.TemporaryFile() as errf:
        try:
            rc = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=errf,
                                env=_environ(None), timeout=timeout, start_new_session=True).returncode
        except FileNotFoundError:
            raise OperationFailed(f"{argv[0]}: command not found", hint=hint or f"install {argv[0]}") from None
        except subprocess.TimeoutExpired:
            rc = None
        errf.seek(0)
        return rc, errf.read().decode("utf-8", "replace").strip()


def check_popen(proc: subprocess.Popen, *, hint: str | None = None) -> None:
    """Wait for a process started by ``popen``; raise CommandFailed when it failed."""
    if proc.stdin and not proc.stdin.closed:
        proc.stdin.close()
    err = proc.stderr.read() if proc.stderr else b""
    rc = proc.wait()
    if rc != 0:
        raise CommandFailed(list(proc.args), rc, err.decode("utf-8", "replace"), hint=hint)


# --------------------------------------------------------------------------------------------- streaming

KILL_GRACE_S = 10.0


def _read_until_exit(proc, on_line, split_cr: bool) -> None:
    """Call ``on_line`` for each line ``proc`` writes, until its pipe closes or, once ``proc`` has
    ended, nothing more is there to read."""
    import select

    fd = proc.stdout.fileno()
    buf = b""

    def lines(data: bytes) -> bytes:
        if split_cr:
            data = data.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        *whole, rest = data.split(b"\n")
        for raw in whole:
            on_line(raw.decode("utf-8", "replace") + "\n")
        return rest

    ended = False
    while True:
        if select.select([fd], [], [], 0 if ended else 0.2)[0]:
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            buf = lines(buf + chunk)
            continue
        if ended:  # the child ended and what it wrote is read: whoever else holds the pipe is not waited for
            break
        # what the child wrote before it ended is in the pipe by now: one more look, without waiting
        ended = proc.poll() is not None
    if buf:
        on_line(buf.decode("utf-8", "replace"))


def stream(argv: Sequence[str], on_line, *, env: Mapping[str, str] | None = None,
           cwd: Path | str | None = None, hint: str | None = None, split_cr: bool = False,
           die_with_parent: bool = False, timeout: float | None = None) -> int:
    """Run ``argv``, calling ``on_line(text)`` for each line of its combined output; return its
    exit code.

    The child runs in its own process group. When this process is interrupted (Ctrl-C, or
    SIGTERM/SIGHUP, which the CLI turns into the same ``KeyboardInterrupt``), the whole group
    gets SIGTERM, then SIGKILL after ``KILL_GRACE_S``: a killed build leaves no ``docker buildx
    build`` (or BuildKit session) behind.

    ``split_cr``: a carriage return also ends a line (progress meters such as rsync's).
    ``die_with_parent``: the child gets SIGKILL when this process dies, even by ``kill -9`` (through
    util-linux ``setpriv --pdeathsig``, when installed): a killed sync leaves no rsync sending on.
    ``timeout``: the group is killed after that many seconds, silent or not (OperationFailed).

    The output is read until the child has ended, not until its pipe closes: a pipe something else
    still holds (an ssh ControlMaster holds the stdio of every mux client, rsync's ssh included, until
    the peer closes the channel) never ends the call late.
    """
    import signal
    import time

    if die_with_parent and which("setpriv"):
        argv = ["setpriv", "--pdeathsig", "KILL", "--", *argv]
    argv = _announce(argv)
    try:
        proc = subprocess.Popen(argv, cwd=cwd, env=_environ(env), stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    except FileNotFoundError:
        raise OperationFailed(f"{argv[0]}: command not found", hint=hint or f"install {argv[0]}") from None
    timer = None
    if timeout:
        import threading

        def expire() -> None:
            timer.expired = True
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

        timer = threading.Timer(timeout, expire)
        timer.daemon, timer.expired = True, False
        timer.start()
    try:
        assert proc.stdout is not None
        _read_until_exit(proc, on_line, split_cr)
        rc = proc.wait()
        if timer is not None and timer.expired:
            raise OperationFailed(f"command timed out after {timeout:g} s: {shlex.join(argv)}", hint=hint)
        return rc
    except BaseException:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        deadline = time.monotonic() + KILL_GRACE_S
        while proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
        raise
    finally:
        if timer is not None:
            timer.cancel()
        if proc.stdout:
            proc.stdout.close()
