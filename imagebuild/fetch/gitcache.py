"""A local cache of bare git mirrors, one per repository URL, fetched by raw commit SHA.

Layout: ``<cache>/<slug>-<hash12>.git`` (``slug`` from the URL's last components, ``hash12`` the
first 12 hex digits of the URL's SHA-256), a bare repository. Every commit prefetch asked for is
kept under ``refs/imagebuild/keep/<sha>`` (so a deleted PR ref upstream never loses it here);
composed merges under ``refs/imagebuild/composed/<sha>``; tags looked up under
``refs/imagebuild/tags/<name>``. Only missing objects are fetched; deps are fetched shallow.

All git runs go through ``imagebuild.run``. Network operations (``ls_remote``, ``fetch``) retry
transient failures with exponential backoff (``IMAGEBUILD_GIT_RETRIES``, default 5 attempts;
``IMAGEBUILD_RETRY_DELAY``, default 1 s, doubling, at most 30 s; ``IMAGEBUILD_GIT_TIMEOUT`` per
attempt, default 1800 s); a permanent answer (no such ref, no such commit, no such repository)
is not retried. ``offline=True`` refuses every network operation and names what is missing.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import random
import re
import shutil
import tempfile
import threading
import time
from collections.abc import Iterable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from imagebuild.core import run as run_mod
from imagebuild.core import secrets, state
from imagebuild.core.errors import CommandFailed, OperationFailed

log = logging.getLogger("imagebuild")

SHA_RE = re.compile(r"[0-9a-f]{40}\Z")
KEEP = "refs/imagebuild/keep/"
COMPOSED = "refs/imagebuild/composed/"
TAGS = "refs/imagebuild/tags/"

# Answers from a server that retrying cannot change.
_PERMANENT = (
    "not our ref", "couldn't find remote ref", "no such remote ref", "repository not found",
    "does not appear to be a git repository", "no such repository", "repository not exported",
    "access denied", "authentication failed", "could not read username", "invalid refspec",
    "remote error: upload-pack: not our ref", "the requested url returned error: 404",
    "the requested url returned error: 403", "unadvertised object",
    # the server's repository (or the pack it sends) is broken: retrying gets the same bytes
    "possible repository corruption", "is corrupt", "corrupt loose object", "bad pack header",
    "pack has bad object", "packfile is invalid", "bad object",
)

_GIT_ENV = {"GIT_TERMINAL_PROMPT": "0", "LC_ALL": "C", "LANGUAGE": "C", "GIT_ASKPASS": "",
            "SSH_ASKPASS": ""}


def default_cache_dir(explicit: str | os.PathLike | None = None) -> Path:
    """``explicit`` (--cache), else ``$IMAGEBUILD_CACHE``, else ``$XDG_CACHE_HOME/imagebuild/git``
    (``~/.cache/imagebuild/git`` when XDG_CACHE_HOME is unset)."""
    if explicit:
        return Path(explicit).expanduser().resolve()
    env = os.environ.get("IMAGEBUILD_CACHE")
    if env:
        return Path(env).expanduser().resolve()
    return state.cache_home().expanduser().resolve() / "imagebuild" / "git"


def redact(url: str) -> str:
    """A URL fit for messages and the lock: any ``user:password@`` part removed (core/secrets.py)."""
    return secrets.without_userinfo(url, ssh_user=False)


@dataclass(frozen=True)
class RetryPolicy:
    attempts: int = 5
    delay: float = 1.0
    max_delay: float = 30.0
    timeout: float = 1800.0

    @classmethod
    def from_env(cls) -> RetryPolicy:
        def num(name: str, default: float, kind=float):
            raw = os.environ.get(name)
            if raw is None or raw == "":
                return default
            try:
                v = kind(raw)
            except ValueError:
                raise OperationFailed(f"${name}={raw!r} is not a number") from None
            if v < 0 or (kind is int and v < 1):
                raise OperationFailed(f"${name}={raw!r} is out of range")
            return v
        return cls(attempts=num("IMAGEBUILD_GIT_RETRIES", 5, int), delay=num("IMAGEBUILD_RETRY_DELAY", 1.0),
                   timeout=num("IMAGEBUILD_GIT_TIMEOUT", 1800.0))

    def sleep(self, attempt: int) -> None:
        d = min(self.max_delay, self.delay * (2 ** attempt))
        time.sleep(d * random.uniform(0.75, 1.25))


class RemoteMissing(OperationFailed):
    """The server answered, and it does not have what was asked for (not retried)."""


class RemoteUnreachable(OperationFailed):
    """The retry budget ran out on transient failures."""


class OfflineMissing(OperationFailed):
    """--offline and the cache lacks an object."""


def is_permanent(output: str) -> bool:
    low = output.lower()
    return any(p in low for p in _PERMANENT)


def _last_error_line(output: str) -> str:
    """Git's own error, with its cause: the last ``fatal:``/``error:`` line and the lines git
    prints after it (``errno=Connection refused`` follows ``unable to connect``), plus what the
    remote itself said (``remote: fatal: ... is corrupt``)."""
    lines = [ln.strip() for ln in output.strip().splitlines() if ln.strip()]
    if not lines:
        return "(no output)"
    local = [i for i, ln in enumerate(lines) if not ln.startswith("remote:")]
    idx = next((i for i in reversed(local) if lines[i].lower().startswith(("fatal:", "error:"))), None)
    if idx is None:
        text = lines[local[-1]] if local else lines[-1]
    else:
        # the first of a run of fatal lines is git's own cause ("fatal: early EOF" comes before
        # "fatal: unpack-objects failed"); keep the run and the plain lines after it
        start = idx
        while start - 1 in local and lines[start - 1].lower().startswith(("fatal:", "error:")) and start > idx - 3:
            start -= 1
        tail = [lines[i] for i in range(start, min(len(lines), idx + 4)) if i in local]
        text = tail[0]
        for ln in tail[1:]:
            text += (" " if text.endswith(":") else "; ") + ln
    remote = [ln[len("remote:"):].strip() for ln in lines if ln.startswith("remote:")]
    remote = [r for r in remote if r.lower().startswith(("fatal:", "error:", "aborting"))]
    if remote:
        said = list(dict.fromkeys(remote))[-2:]
        text += " (the remote said: " + "; ".join(said) + ")"
    return text


class Stats:
    """Counts network operations (a no-change re-run must show zero)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.ls_remote = 0
        self.fetch = 0
        self.retries = 0

    def add(self, what: str, n: int = 1) -> None:
        with self._lock:
            setattr(self, what, getattr(self, what) + n)

    @property
    def network(self) -> int:
        return self.ls_remote + self.fetch


class Cache:
    """The mirror cache folder; hands out one ``Mirror`` per URL."""

    def __init__(self, root: Path, *, offline: bool = False, policy: RetryPolicy | None = None):
        self.root = Path(root)
        self.offline = offline
        self.policy = policy or RetryPolicy.from_env()
        self.stats = Stats()
        self._mirrors: dict[str, Mirror] = {}
        self._lock = threading.Lock()

    def mirror(self, url: str) -> Mirror:
        with self._lock:
            m = self._mirrors.get(url)
            if m is None:
                m = self._mirrors[url] = Mirror(self, url)
            return m


def mirror_dirname(url: str) -> str:
    h = hashlib.sha256(url.encode()).hexdigest()[:12]
    tail = re.sub(r"\.git/?\Z", "", redact(url).rstrip("/"))
    parts = [p for p in re.split(r"[/:]", tail) if p][-2:]
    slug = re.sub(r"[^A-Za-z0-9._-]+", "_", "-".join(parts))[:60] or "repo"
    return f"{slug}-{h}.git"


class Mirror:
    """One bare mirror. Thread-safe per instance; a file lock guards it across processes."""

    def __init__(self, cache: Cache, url: str):
        self.cache = cache
        self.url = url
        self.path = cache.root / mirror_dirname(url)
        self._tlock = threading.RLock()

    # -- local ------------------------------------------------------------------------------------

    @property
    def exists(self) -> bool:
        return (self.path / "HEAD").is_file() and (self.path / "objects").is_dir()

    @contextmanager
    def locked(self):
        """Exclusive use of this mirror (threads in this process and other processes)."""
        with self._tlock:
            self.cache.root.mkdir(parents=True, exist_ok=True)
            lockfile = self.path.with_name(self.path.name + ".lock")
            with open(lockfile, "a+b") as fh:
                fcntl.flock(fh, fcntl.LOCK_EX)
                try:
                    yield
                finally:
                    fcntl.flock(fh, fcntl.LOCK_UN)

    def ensure(self) -> None:
        """Create the bare repository if needed (atomically: init in a temp folder, rename)."""
        if self.exists:
            return
        self.cache.root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{self.path.name}.", suffix=".tmp", dir=self.cache.root))
        try:
            run_mod.run(["git", "init", "-q", "--bare", str(tmp)], env=_GIT_ENV)
            for k, v in (("gc.auto", "0"), ("core.logAllRefUpdates", "false"), ("fetch.writeCommitGraph", "false"),
                         ("imagebuild.url", redact(self.url))):
                run_mod.run(["git", "config", k, v], cwd=tmp, env=_GIT_ENV)
            try:
                os.rename(tmp, self.path)
            except OSError:
                if not self.exists:  # someone else created it meanwhile: fine; else re-raise
                    raise
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)

    def git(self, *args: str, check: bool = True, input: bytes | None = None, env: dict | None = None):
        full = dict(_GIT_ENV)
        if env:
            full.update(env)
        return run_mod.run(["git", "--git-dir", str(self.path), *args], check=check, input=input, env=full)

    def out(self, *args: str, **kw) -> str:
        return self.git(*args, **kw).stdout.decode("utf-8", "replace").strip()

    def missing(self, shas: Iterable[str]) -> list[str]:
        """Those of ``shas`` whose commit is not in the mirror (order kept, duplicates dropped)."""
        want = list(dict.fromkeys(shas))
        if not want:
            return []
        if not self.exists:
            return want
        data = "".join(f"{s}^{{commit}}\n" for s in want).encode()
        out = self.git("cat-file", "--batch-check", input=data).stdout.decode().splitlines()
        return [s for s, line in zip(want, out, strict=True) if line.endswith(" missing")]

    def is_shallow(self) -> bool:
        return (self.path / "shallow").is_file() and (self.path / "shallow").stat().st_size > 0

    def local_ref(self, ref: str) -> str | None:
        if not self.exists:
            return None
        r = self.git("rev-parse", "-q", "--verify", f"{ref}^{{commit}}", check=False)
        return r.stdout.decode().strip() or None if r.returncode == 0 else None

    # -- network ----------------------------------------------------------------------------------

    def _network(self, what: str, argv: Sequence[str], source: str, *, watch: bool = False) -> str:
        """Run a network git command with retries; return its output. ``watch``: git's progress is
        read as it comes, and a heartbeat names the source, the time and the bytes received so far."""
        if self.cache.offline:
            raise OfflineMissing(f"{source}: --offline: {what} needs the network ({redact(self.url)})",
                                 hint="run without --offline once to fill the cache")
        pol = self.cache.policy
        last = ""
        for attempt in range(pol.attempts):
            if attempt:
                self.cache.stats.add("retries")
                log.info("  %s: retrying %s (attempt %d of %d): %s", source, what, attempt + 1, pol.attempts,
                         _last_error_line(last))
                pol.sleep(attempt - 1)
            try:
                # over https a stalled transfer (under 1 kB/s for 60 s) fails and is retried; for
                # git:// and ssh the per-attempt timeout bounds it
                full = ["git", "-c", "http.lowSpeedLimit=1000", "-c", "http.lowSpeedTime=60", *argv]
                if watch:
                    rc, out = _watched(full, source, redact(self.url), pol.timeout)
                else:
                    r = run_mod.run(full, env=_GIT_ENV, timeout=pol.timeout, check=False)
                    rc, out = r.returncode, r.stdout.decode("utf-8", "replace")
            except OperationFailed as exc:  # timed out
                last = exc.message
                continue
            if rc == 0:
                return out
            last = out
            if is_permanent(out):
                raise RemoteMissing(f"{source}: {what} failed on {redact(self.url)}: {_last_error_line(out)}")
        raise RemoteUnreachable(
            f"{source}: {what} from {redact(self.url)} failed after {pol.attempts} attempts: "
            f"{_last_error_line(last)}",
            hint="check the network, the URL in versions.env and any proxy; retries: IMAGEBUILD_GIT_RETRIES; "
            "--offline works from the cache only")

    def ls_remote(self, patterns: Sequence[str], source: str) -> dict[str, str]:
        """``git ls-remote URL patterns...`` -> {ref: sha} (peeled tags as ``ref^{}``)."""
        self.cache.stats.add("ls_remote")
        out = self._network("ls-remote", ["ls-remote", self.url, *patterns], source)
        refs: dict[str, str] = {}
        for line in out.splitlines():
            if "\t" in line:
                sha, ref = line.split("\t", 1)
                if SHA_RE.match(sha):
                    refs[ref] = sha
        return refs

    def fetch(self, shas: Sequence[str], source: str, *, shallow: bool = False,
              refspecs: Sequence[str] = ()) -> None:
        """Fetch commits by raw SHA (kept under refs/imagebuild/keep/) plus ``refspecs``."""
        with self.locked():
            self.ensure()
            want = self.missing(shas)
            unshallow = not shallow and self.is_shallow()
            if not want and not refspecs and not unshallow:
                return
            if unshallow and not want:
                want = list(dict.fromkeys(shas))
            argv = ["--git-dir", str(self.path), "fetch", "--progress", "--no-tags", "--no-recurse-submodules",
                    "--no-write-fetch-head", "--no-auto-gc"]
            if shallow:
                argv.append("--depth=1")
            elif unshallow:
                argv.append("--unshallow")
            argv.append(self.url)
            argv += [f"{s}:{KEEP}{s}" for s in want] + list(refspecs)
            self.cache.stats.add("fetch")
            log.info("  %s: fetching %s from %s", source,
                     ", ".join(s[:12] for s in want) + (" + refs" if refspecs else ""), redact(self.url))
            self._network("fetch", argv, source, watch=True)
            still = self.missing(want)
            if still:
                raise RemoteMissing(f"{source}: {redact(self.url)} did not send commit {still[0]}")

    def keep(self, sha: str) -> None:
        """Protect a commit already here (e.g. one fetched under another ref)."""
        self.git("update-ref", f"{KEEP}{sha}", sha)


HEARTBEAT_ENV = "IMAGEBUILD_HEARTBEAT_S"  # as for build (docs/prefetch.md)
DEFAULT_HEARTBEAT_S = 30.0


# git's progress meters: "Receiving objects:  45% (1234/2743), 12.30 MiB | 1.20 MiB/s"
_METER = re.compile(r"(?:remote: )?[A-Z][a-z]+(?: [a-z]+)*: +\d+% \(")


def _heartbeat_every() -> float:
    try:
        return float(os.environ.get(HEARTBEAT_ENV) or DEFAULT_HEARTBEAT_S)
    except ValueError:
        return DEFAULT_HEARTBEAT_S


def _watched(argv: list[str], source: str, url: str, timeout: float) -> tuple[int, str]:
    """Run a ``git fetch --progress``: (exit code, its output less the progress meters). Every
    ``$IMAGEBUILD_HEARTBEAT_S`` seconds (default 30) a line names the source, the time it has taken
    and git's last progress line (objects and bytes received, the rate), so a long fetch never looks
    hung; the attempt is killed after ``timeout`` seconds."""
    kept: list[str] = []
    latest = [""]
    t0 = time.monotonic()
    stop = threading.Event()

    def on_line(text: str) -> None:
        text = text.strip()
        if not text:
            return
        if _METER.match(text):
            latest[0] = text.removeprefix("remote: ").strip()
            return
        kept.append(text)

    def beat() -> None:
        every = _heartbeat_every()
        while every > 0 and not stop.wait(every):
            el = int(time.monotonic() - t0)
            log.info("  %s: still fetching from %s (%d:%02d:%02d): %s", source, url, el // 3600, el // 60 % 60,
                     el % 60, latest[0] or "nothing received yet")

    th = threading.Thread(target=beat, daemon=True)
    th.start()
    try:
        rc = run_mod.stream(argv, on_line, env=_GIT_ENV, split_cr=True, timeout=timeout)
    finally:
        stop.set()
        th.join(timeout=5)
    if latest[0]:
        log.debug("  %s: %s", source, latest[0])
    return rc, "\n".join(kept) + "\n"


def safe_run(fn, *args, **kw):
    """Call ``fn`` turning a CommandFailed from a local git run into OperationFailed with its text."""
    try:
        return fn(*args, **kw)
    except CommandFailed as exc:
        raise OperationFailed(exc.message) from None
