"""Real git upstreams for tests: repositories, a loopback ``git daemon``, a flaky TCP proxy.

Everything here is real: repositories are made with the ``git`` binary, served by a real
``git daemon`` on 127.0.0.1 (free port, ``uploadpack.allowAnySHA1InWant=true`` so raw SHAs can
be fetched like on GitHub), and the proxy is a real TCP relay that drops a fraction of the
connections it accepts. Tests reach nothing but loopback.

Use it from a test module::

    from tests.gitfixtures import git_daemon, upstreams  # noqa: F401  (pytest fixtures)

or build your own layout with :class:`UpstreamFactory` and :class:`GitDaemon`.

Commits are made with a fixed identity and fixed, increasing dates, so the same sequence of
calls gives the same commit SHAs on every machine: tests may compare SHAs across sessions.
"""

from __future__ import annotations

import os
import random
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

# Commit dates start here and advance one minute per commit (deterministic SHAs).
BASE_EPOCH = 1_700_000_000


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _git_env(epoch: int | None = None) -> dict[str, str]:
    env = dict(os.environ)
    # Isolate from the user's and system's git configuration.
    env.update({
        "GIT_CONFIG_NOSYSTEM": "1",
        "GIT_CONFIG_GLOBAL": os.devnull,
        "GIT_TERMINAL_PROMPT": "0",
        "GIT_AUTHOR_NAME": "Upstream Dev",
        "GIT_AUTHOR_EMAIL": "dev@upstream.test",
        "GIT_COMMITTER_NAME": "Upstream Dev",
        "GIT_COMMITTER_EMAIL": "dev@upstream.test",
        # file:// submodules (used only while making fixtures) need this since git 2.38.1
        "GIT_ALLOW_PROTOCOL": "file:git:http:https:ssh",
    })
    if epoch is not None:
        env["GIT_AUTHOR_DATE"] = f"@{epoch} +0000"
        env["GIT_COMMITTER_DATE"] = f"@{epoch} +0000"
    return env


def git(*args: str, cwd: Path | str | None = None, epoch: int | None = None, check: bool = True) -> str:
    """Run git (tests only; the package itself goes through imagebuild/run.py)."""
    proc = subprocess.run(["git", *args], cwd=cwd, env=_git_env(epoch), capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise AssertionError(f"git {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout}{proc.stderr}")
    return proc.stdout.strip()


@dataclass
class Upstream:
    """One upstream repository: a bare repo under the served base dir plus a work clone."""

    name: str
    bare: Path  # <base>/<name>.git, what the daemon serves
    work: Path  # a non-bare clone used to make commits
    factory: UpstreamFactory

    @property
    def path_in_daemon(self) -> str:
        return f"{self.name}.git"

    def url(self, daemon: GitDaemon | None = None) -> str:
        """git:// URL through ``daemon`` (default: the factory's daemon), or file:// when none."""
        d = daemon or self.factory.daemon
        return d.url(self.path_in_daemon) if d else self.bare.as_uri()

    def commit(self, files: dict[str, str | bytes | None], message: str, *, branch: str = "main",
               push: bool = True, executable: tuple[str, ...] = ()) -> str:
        """Write (str/bytes) or delete (None) files on ``branch``, commit, push; returns the SHA."""
        self._switch(branch)
        for rel, content in files.items():
            p = self.work / rel
            if content is None:
                git("rm", "-q", "-r", "--", rel, cwd=self.work)
                continue
            p.parent.mkdir(parents=True, exist_ok=True)
            if isinstance(content, bytes):
                p.write_bytes(content)
            else:
                p.write_text(content)
            git("add", "--", rel, cwd=self.work)
            if rel in executable:
                git("update-index", "--chmod=+x", "--", rel, cwd=self.work)
        git("commit", "-q", "--allow-empty", "-m", message, cwd=self.work, epoch=self.factory.tick())
        sha = git("rev-parse", "HEAD", cwd=self.work)
        if push:
            git("push", "-q", "origin", f"HEAD:refs/heads/{branch}", cwd=self.work)
        return sha

    def _switch(self, branch: str) -> None:
        current = git("symbolic-ref", "-q", "--short", "HEAD", cwd=self.work, check=False)
        if current == branch:
            return
        exists = git("rev-parse", "-q", "--verify", f"refs/heads/{branch}", cwd=self.work, check=False)
        if exists:
            git("checkout", "-q", branch, cwd=self.work)
        else:
            git("checkout", "-q", "-b", branch, cwd=self.work)

    def branch_from(self, branch: str, start: str) -> None:
        """Create ``branch`` at commit/branch ``start`` in the work clone (not pushed until a commit)."""
        git("checkout", "-q", "-B", branch, start, cwd=self.work)

    def head(self, branch: str = "main") -> str:
        return git("rev-parse", f"refs/heads/{branch}", cwd=self.bare)

    def tag(self, name: str, rev: str = "main", *, annotated: bool = True) -> str:
        """Tag ``rev`` and push the tag; returns the tagged commit's SHA."""
        if annotated:
            git("tag", "-a", "-m", f"release {name}", name, rev, cwd=self.work, epoch=self.factory.tick())
        else:
            git("tag", name, rev, cwd=self.work)
        git("push", "-q", "origin", f"refs/tags/{name}", cwd=self.work)
        return git("rev-parse", f"{name}^{{commit}}", cwd=self.work)

    def pull_request(self, number: int, files: dict[str, str | bytes | None], *, base: str = "main",
                     message: str | None = None, commits: int = 1) -> str:
        """A PR branch from ``base`` with ``commits`` commits, pushed as ``refs/pull/N/head``."""
        self.branch_from(f"pr-{number}", base)
        sha = ""
        for i in range(commits):
            msg = message or f"PR #{number}"
            if commits > 1:
                msg += f" ({i + 1}/{commits})"
            chunk = files if i == commits - 1 else {f"pr{number}/step{i}.txt": f"step {i}\n"}
            sha = self.commit(chunk, msg, branch=f"pr-{number}", push=False)
        git("push", "-q", "-f", "origin", f"{sha}:refs/pull/{number}/head", cwd=self.work)
        self._switch(base)
        return sha

    def move_pull_request(self, number: int, files: dict[str, str | bytes | None],
                          message: str | None = None) -> str:
        """Push a new commit on top of an existing PR (its head moves)."""
        self._switch(f"pr-{number}")
        sha = self.commit(files, message or f"PR #{number} update", branch=f"pr-{number}", push=False)
        git("push", "-q", "-f", "origin", f"{sha}:refs/pull/{number}/head", cwd=self.work)
        self._switch("main")
        return sha

    def delete_ref(self, ref: str) -> None:
        """Delete a ref on the server (a closed PR); its objects stay (fetchable by SHA)."""
        git("update-ref", "-d", ref, cwd=self.bare)

    def add_submodule(self, path: str, sub: Upstream, *, url: str | None = None, branch: str = "main",
                      rev: str | None = None) -> str:
        """Add ``sub`` as a submodule at ``path`` (URL relative, ``../<sub>.git``, by default)."""
        self._switch(branch)
        rel_url = url or f"../{sub.name}.git"
        # Add from the local bare repo, then rewrite the recorded URL (no network needed here).
        git("-c", "protocol.file.allow=always", "submodule", "add", "-q", sub.bare.as_uri(), path,
            cwd=self.work)
        if rev:
            git("checkout", "-q", rev, cwd=self.work / path)
            git("add", path, cwd=self.work)
        git("config", "-f", ".gitmodules", f"submodule.{path}.url", rel_url, cwd=self.work)
        git("add", ".gitmodules", cwd=self.work)
        git("commit", "-q", "-m", f"add submodule {path}", cwd=self.work, epoch=self.factory.tick())
        git("push", "-q", "origin", f"HEAD:refs/heads/{branch}", cwd=self.work)
        return git("rev-parse", "HEAD", cwd=self.work)


class UpstreamFactory:
    """Makes upstream repositories under ``base`` (the directory a GitDaemon serves)."""

    def __init__(self, base: Path, daemon: GitDaemon | None = None):
        self.base = Path(base)
        self.base.mkdir(parents=True, exist_ok=True)
        self.works = self.base.parent / (self.base.name + "-work")
        self.works.mkdir(parents=True, exist_ok=True)
        self.daemon = daemon
        self._epoch = BASE_EPOCH
        self.repos: dict[str, Upstream] = {}

    def tick(self) -> int:
        self._epoch += 60
        return self._epoch

    def create(self, name: str, files: dict[str, str | bytes] | None = None, *,
               message: str = "initial import") -> Upstream:
        """A new repository with one commit on ``main`` (``files`` or a README)."""
        bare = self.base / f"{name}.git"
        git("init", "-q", "--bare", "-b", "main", str(bare))
        git("config", "uploadpack.allowAnySHA1InWant", "true", cwd=bare)
        git("config", "uploadpack.allowFilter", "true", cwd=bare)
        git("config", "uploadpack.allowReachableSHA1InWant", "true", cwd=bare)
        work = self.works / name
        git("init", "-q", "-b", "main", str(work))
        git("remote", "add", "origin", bare.as_uri(), cwd=work)
        up = Upstream(name, bare, work, self)
        up.commit(files or {"README.md": f"# {name}\n"}, message)
        self.repos[name] = up
        return up


class GitDaemon:
    """A real ``git daemon`` serving ``base`` on 127.0.0.1:<free port> (upload-pack only)."""

    def __init__(self, base: Path, log: Path | None = None):
        self.base = Path(base)
        self.log = log or (self.base.parent / "git-daemon.log")
        self.port = 0
        self.proc: subprocess.Popen | None = None

    def start(self) -> GitDaemon:
        for _ in range(5):
            self.port = free_port()
            logf = open(self.log, "ab")  # noqa: SIM115 - lives as long as the daemon
            self.proc = subprocess.Popen(
                ["git", "daemon", "--reuseaddr", "--export-all", f"--base-path={self.base}",
                 f"--port={self.port}", "--listen=127.0.0.1", "--enable=upload-pack",
                 "--informative-errors", "--verbose", str(self.base)],
                env=_git_env(), stdout=logf, stderr=logf,
            )
            logf.close()
            if wait_port(self.port, timeout=10, proc=self.proc):
                return self
            self.stop()
        raise RuntimeError(f"git daemon did not start (log: {self.log})")

    def url(self, path: str) -> str:
        return f"git://127.0.0.1:{self.port}/{path}"

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def __enter__(self) -> GitDaemon:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def wait_port(port: int, timeout: float = 10.0, proc: subprocess.Popen | None = None) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            return False
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return True
        except OSError:
            time.sleep(0.05)
    return False


class DropProxy:
    """A loopback TCP relay to ``target_port`` that drops a fraction of the connections.

    ``drop_rate`` (0..1) of accepted connections are closed at once (seeded, so a run is
    repeatable); ``stall_rate`` of them are accepted and then never answered for ``stall_s``.
    ``connections`` counts every accepted connection, ``dropped``/``stalled`` the faulty ones:
    a test proves "no network fetch" by a connection count that did not move. ``refuse=True``
    makes it close every connection (a host that is down).
    """

    def __init__(self, target_port: int, *, drop_rate: float = 0.0, stall_rate: float = 0.0,
                 stall_s: float = 30.0, seed: int = 1234):
        self.target_port = target_port
        self.drop_rate = drop_rate
        self.stall_rate = stall_rate
        self.stall_s = stall_s
        self.refuse = False
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self.connections = 0
        self.dropped = 0
        self.stalled = 0
        self._sock: socket.socket | None = None
        self._stop = threading.Event()
        self.port = 0
        self._threads: list[threading.Thread] = []

    def start(self) -> DropProxy:
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(64)
        self._sock.settimeout(0.2)
        self.port = self._sock.getsockname()[1]
        t = threading.Thread(target=self._accept_loop, daemon=True, name=f"dropproxy-{self.port}")
        t.start()
        self._threads.append(t)
        return self

    def url(self, path: str) -> str:
        return f"git://127.0.0.1:{self.port}/{path}"

    def reset_counts(self) -> None:
        with self._lock:
            self.connections = self.dropped = self.stalled = 0

    def _accept_loop(self) -> None:
        assert self._sock is not None
        while not self._stop.is_set():
            try:
                client, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with self._lock:
                self.connections += 1
                roll = self._rng.random()
                if self.refuse or roll < self.drop_rate:
                    self.dropped += 1
                    action = "drop"
                elif roll < self.drop_rate + self.stall_rate:
                    self.stalled += 1
                    action = "stall"
                else:
                    action = "relay"
            if action == "drop":
                _close_hard(client)
                continue
            t = threading.Thread(target=self._serve, args=(client, action), daemon=True)
            t.start()

    def _serve(self, client: socket.socket, action: str) -> None:
        if action == "stall":
            self._stop.wait(self.stall_s)
            _close_hard(client)
            return
        try:
            upstream = socket.create_connection(("127.0.0.1", self.target_port), timeout=10)
        except OSError:
            _close_hard(client)
            return
        upstream.settimeout(None)
        client.settimeout(None)

        def pump(src: socket.socket, dst: socket.socket) -> None:
            try:
                while True:
                    data = src.recv(65536)
                    if not data:
                        break
                    dst.sendall(data)
            except OSError:
                pass
            finally:
                for s in (dst,):
                    try:
                        s.shutdown(socket.SHUT_WR)
                    except OSError:
                        pass

        t = threading.Thread(target=pump, args=(upstream, client), daemon=True)
        t.start()
        pump(client, upstream)
        t.join(timeout=120)
        client.close()
        upstream.close()

    def stop(self) -> None:
        self._stop.set()
        if self._sock:
            self._sock.close()
        for t in self._threads:
            t.join(timeout=2)

    def __enter__(self) -> DropProxy:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _close_hard(sock: socket.socket) -> None:
    """Close with RST (SO_LINGER 0): the client sees 'connection reset', like a flaky network."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    except OSError:
        pass
    sock.close()


# --- the standard upstream set -------------------------------------------------------------------

CMAKE_TEMPLATE = """cmake_minimum_required(VERSION 3.20)
project(app LANGUAGES CXX)
include(FetchContent)

if (DEFINED ENV{{APP_DEP_SRC_DIR}})
  set(APP_DEP_SRC_DIR $ENV{{APP_DEP_SRC_DIR}})
endif()
if(APP_DEP_SRC_DIR)
  FetchContent_Declare(dep SOURCE_DIR ${{APP_DEP_SRC_DIR}})
else()
FetchContent_Declare(
  dep
  GIT_REPOSITORY https://github.com/example/dep.git
  GIT_TAG {dep_sha}
  GIT_SUBMODULES "third-party/sub"
  GIT_PROGRESS TRUE
)
endif()
include(cmake/external_projects/kernels.cmake)
add_executable(app src/main.cpp)
"""

KERNELS_CMAKE_TEMPLATE = """# kernels: only a subdirectory is used
FetchContent_Declare(
        kernels
        GIT_REPOSITORY https://github.com/example/kernels.git
        GIT_TAG        {kernels_tag}
        GIT_SHALLOW    TRUE
)
# (read from the environment only, as vLLM reads TRITON_KERNELS_SRC_DIR)
message(STATUS "kernels override: $ENV{{KERNELS_SRC_DIR}}")
"""


@dataclass
class Upstreams:
    """The standard set (see :func:`make_standard_upstreams`); SHAs of interest by name."""

    factory: UpstreamFactory
    daemon: GitDaemon
    app: Upstream
    dep: Upstream
    sub: Upstream
    kernels: Upstream
    shas: dict[str, str] = field(default_factory=dict)

    def url(self, repo: Upstream, via: DropProxy | None = None) -> str:
        return via.url(repo.path_in_daemon) if via else repo.url(self.daemon)


def make_standard_upstreams(factory: UpstreamFactory, daemon: GitDaemon) -> Upstreams:
    """A vLLM-like layout, small enough for seconds:

    - ``sub``: a plain repo, used as a submodule of ``dep`` at ``third-party/sub``.
    - ``dep``: a FetchContent dependency with that submodule (relative URL ``../sub.git``);
      the pinned commit ``dep_pin`` lies on a NON-default branch ``dev`` (DeepGEMM's case) and is
      not reachable from ``main``.
    - ``kernels``: a repo whose useful part is the subdirectory ``python/kernels/kernels``,
      tagged ``v3.5.1`` (annotated), ``kernels_tag_sha`` the tagged commit.
    - ``app``: the fork. ``main`` has ``CMakeLists.txt`` declaring ``dep`` (GIT_TAG dep_pin,
      submodules) and ``cmake/external_projects/kernels.cmake`` declaring ``kernels`` (v3.5.1).
      ``app_base`` is the base commit. Pull requests:
        * #1 ``pr1``: adds ``feature1.txt`` (clean)
        * #2 ``pr2``: edits ``src/main.cpp`` (clean, on top of #1 in order)
        * #3 ``pr3``: edits ``src/main.cpp`` the same line differently (conflicts with #2)
        * #4 ``pr4``: adds ``feature4.txt``; its ref was DELETED (closed PR), SHA still served
        * #5 ``pr5``: adds a third FetchContent_Declare (``extra``) that nothing pins
      ``app`` also has the annotated tag ``v1.0`` at ``app_base``.
    """
    shas: dict[str, str] = {}
    sub = factory.create("sub", {"sub.h": "#define SUB 1\n"})
    shas["sub_main"] = sub.head()

    dep = factory.create("dep", {"CMakeLists.txt": "project(dep)\n", "include/dep.h": "int dep();\n"})
    shas["dep_main"] = dep.head()
    dep.branch_from("dev", "main")
    dep.commit({"include/dep.h": "int dep(int);\n"}, "dev work", branch="dev")
    shas["dep_pin"] = dep.add_submodule("third-party/sub", sub, branch="dev")
    dep.commit({"later.txt": "after the pin\n"}, "later dev work", branch="dev")
    shas["dep_dev_head"] = dep.head("dev")

    kernels = factory.create("kernels", {
        "README.md": "# kernels\n",
        "python/kernels/kernels/__init__.py": "VERSION = '3.5.1'\n",
        "python/kernels/kernels/ops.py": "def op():\n    return 1\n",
        "python/kernels/setup.py": "# not needed\n",
    })
    shas["kernels_tag_sha"] = kernels.tag("v3.5.1")
    kernels.commit({"python/kernels/kernels/ops.py": "def op():\n    return 2\n"}, "after the tag")

    app = factory.create("app", {
        "CMakeLists.txt": CMAKE_TEMPLATE.format(dep_sha=shas["dep_pin"]),
        "cmake/external_projects/kernels.cmake": KERNELS_CMAKE_TEMPLATE.format(kernels_tag="v3.5.1"),
        "src/main.cpp": "int main() {\n  return 0;\n}\n",
        "tools/run.sh": "#!/bin/sh\necho run\n",
    })
    # make tools/run.sh executable (mode must survive into tarballs)
    app.commit({"tools/run.sh": "#!/bin/sh\necho run\n"}, "make run.sh executable", executable=("tools/run.sh",))
    shas["app_base"] = app.head()
    app.tag("v1.0")
    shas["pr1"] = app.pull_request(1, {"feature1.txt": "one\n"})
    shas["pr2"] = app.pull_request(2, {"src/main.cpp": "int main() {\n  return 2;\n}\n"})
    shas["pr3"] = app.pull_request(3, {"src/main.cpp": "int main() {\n  return 3;\n}\n"})
    shas["pr4"] = app.pull_request(4, {"feature4.txt": "four\n"})
    app.delete_ref("refs/pull/4/head")
    shas["pr5"] = app.pull_request(5, {
        "cmake/external_projects/extra.cmake":
            "FetchContent_Declare(extra GIT_REPOSITORY https://github.com/example/extra.git GIT_TAG v9)\n",
    })
    # main moves on after the base (so "base" != "main" matters)
    app.commit({"NEWS": "later on main\n"}, "later on main")
    shas["app_main"] = app.head()
    return Upstreams(factory, daemon, app, dep, sub, kernels, shas)


# --- pytest fixtures ------------------------------------------------------------------------------

@pytest.fixture(scope="session")
def git_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("git-upstreams")


@pytest.fixture(scope="session")
def git_daemon(git_root) -> Iterator[GitDaemon]:
    """A session-wide ``git daemon`` serving ``<git_root>/served`` on 127.0.0.1."""
    if shutil.which("git") is None:
        pytest.fail("git is required for the git tests")
    served = git_root / "served"
    served.mkdir(exist_ok=True)
    d = GitDaemon(served, log=git_root / "git-daemon.log").start()
    yield d
    d.stop()


@pytest.fixture(scope="session")
def upstreams(git_daemon) -> Upstreams:
    """The standard upstream set (:func:`make_standard_upstreams`), made once per session.

    Treat it as read-only; a test that must change an upstream makes its own with
    ``UpstreamFactory(tmp_path / "served", daemon)`` and a private ``GitDaemon``.
    """
    factory = UpstreamFactory(git_daemon.base, git_daemon)
    return make_standard_upstreams(factory, git_daemon)


@pytest.fixture
def drop_proxy(git_daemon) -> Iterator[DropProxy]:
    """A fresh proxy to the session daemon (no faults until the test sets drop_rate etc.)."""
    p = DropProxy(git_daemon.port).start()
    yield p
    p.stop()


# --- the real vLLM tree's shapes, written from scratch ---------------------------------------------

VL_CMAKE = """cmake_minimum_required(VERSION 3.20)
project(vl LANGUAGES CXX)
include(FetchContent)
include(${{CMAKE_CURRENT_LIST_DIR}}/tools/cmake/revisions.cmake)

if (NOT VL_TARGET_DEVICE STREQUAL "cuda")
  if (VL_TARGET_DEVICE STREQUAL "cpu")
    include(${{CMAKE_CURRENT_LIST_DIR}}/cmake/cpu_extension.cmake)
  endif()
  return()
endif()

if (DEFINED ENV{{VL_CUTLASS_SRC_DIR}})
  set(VL_CUTLASS_SRC_DIR $ENV{{VL_CUTLASS_SRC_DIR}})
endif()
if(VL_CUTLASS_SRC_DIR)
  FetchContent_Declare(cutlass SOURCE_DIR ${{VL_CUTLASS_SRC_DIR}})
else()
  FetchContent_Declare(
      cutlass
      GIT_REPOSITORY https://github.com/example/cutlass.git
      GIT_TAG ${{CUTLASS_REVISION}}
      GIT_SHALLOW TRUE
  )
endif()
FetchContent_MakeAvailable(cutlass)

include(cmake/external/tk.cmake)
include(cmake/external/fa.cmake)
include(cmake/external/dg.cmake)
"""

VL_REVISIONS = """# revisions kept in one place, outside cmake/ (found through the include above)
set(CUTLASS_REVISION "v4.4.2")
set(TK_TAG "{tk_tag}" CACHE STRING "the tk tag FetchContent takes")
"""

VL_TK = """# read from the environment only (as vLLM reads TRITON_KERNELS_SRC_DIR)
if (DEFINED ENV{{TK_SRC_DIR}})
  FetchContent_Declare(tk SOURCE_DIR $ENV{{TK_SRC_DIR}})
else()
  FetchContent_Declare(
    tk
    GIT_REPOSITORY https://github.com/example/tk.git
    GIT_TAG ${{TK_TAG}}
    SOURCE_SUBDIR python/tk/tk
  )
endif()
FetchContent_MakeAvailable(tk)
"""

VL_FA = """if (DEFINED ENV{{FA_SRC_DIR}})
  set(FA_SRC_DIR $ENV{{FA_SRC_DIR}})
endif()
if(FA_SRC_DIR)
  FetchContent_Declare(vl-fa SOURCE_DIR ${{FA_SRC_DIR}})
else()
  set(FA_GIT_SUBMODULES "")
  if(VL_GPU_LANG STREQUAL "CUDA")
    set(FA_GIT_SUBMODULES "csrc/cutlass")
  endif()
  FetchContent_Declare(
    vl-fa
    GIT_REPOSITORY https://github.com/example/fa.git
    GIT_TAG {fa_sha}
    GIT_SUBMODULES ${{FA_GIT_SUBMODULES}}
  )
endif()
FetchContent_MakeAvailable(vl-fa)
"""

VL_DG = """if (DEFINED ENV{{DG_SRC_DIR}})
  set(DG_SRC_DIR $ENV{{DG_SRC_DIR}})
endif()
if(DG_SRC_DIR)
  FetchContent_Declare(dg SOURCE_DIR ${{DG_SRC_DIR}})
else()
  FetchContent_Declare(
    dg
    GIT_REPOSITORY https://github.com/example/dg.git
    GIT_TAG {dg_sha}
    GIT_SUBMODULES "third-party/one" "third-party/two"
  )
endif()
FetchContent_Populate(dg)
"""

VL_CPU = """# CPU-only dependencies (as vLLM's cmake/cpu_extension.cmake)
if(VL_ARM)
  FetchContent_Populate(arm_compute
      SUBBUILD_DIR "${{FETCHCONTENT_BASE_DIR}}/arm_compute-subbuild"
      SOURCE_DIR   "${{FETCHCONTENT_BASE_DIR}}/arm_compute-src"
      GIT_REPOSITORY https://github.com/example/ComputeLibrary.git
      GIT_TAG        v52.6.0
  )
endif()
set(FETCHCONTENT_SOURCE_DIR_ONEDNN "$ENV{{FETCHCONTENT_SOURCE_DIR_ONEDNN}}" CACHE PATH "local oneDNN")
if(FETCHCONTENT_SOURCE_DIR_ONEDNN)
  FetchContent_Declare(oneDNN SOURCE_DIR ${{FETCHCONTENT_SOURCE_DIR_ONEDNN}})
else()
  if(VL_ARM)
    FetchContent_Declare(oneDNN GIT_REPOSITORY https://github.com/example/oneDNN.git
                         GIT_TAG 9c5be1cc59e368aebf0909e6cf20f981ea61462a)
  else()
    FetchContent_Declare(oneDNN GIT_REPOSITORY https://github.com/example/oneDNN.git GIT_TAG v3.10)
  endif()
endif()
"""


@dataclass
class RealShapes:
    """:func:`make_realshape_upstreams`: repositories and SHAs of interest."""

    factory: UpstreamFactory
    repos: dict[str, Upstream]
    shas: dict[str, str] = field(default_factory=dict)

    def url(self, name: str) -> str:
        return self.repos[name].url()


def make_realshape_upstreams(factory: UpstreamFactory, *, tk_tag: str = "v3.6.0") -> RealShapes:
    """Every shape the real vLLM tree has (see ../shared/upstream/README.md), small:

    - ``cutlass``: tags ``v4.4.2`` (what the fork's tag variable names) and ``v4.3.0``.
    - ``tk``: the useful part is ``python/tk/tk``; tags ``v3.5.1`` and ``v3.6.0``.
    - ``fa``: three submodules: ``csrc/cutlass`` (the cutlass repo, reachable), ``third_party/aiter``
      (reachable, never asked for) and ``csrc/ck``, whose recorded commit the server does NOT have
      (an unreachable commit, as ROCm's composable_kernel was).
    - ``dg``: pinned on a non-default branch, two submodules, both asked for.
    - ``vl``: the fork (branch ``dev/judgement`` as its base, PR 1). Its CMake files: cutlass with an
      override branch and ``GIT_TAG ${CUTLASS_REVISION}`` set in an include()d file outside cmake/;
      tk with an env-only override and a tag from a CACHE default; fa with ``GIT_SUBMODULES`` through
      a variable set in two branches; dg declared, then ``FetchContent_Populate(dg)``; a CPU-only
      file included under ``if (VL_TARGET_DEVICE STREQUAL "cpu")`` with ``FetchContent_Populate
      (arm_compute GIT_REPOSITORY ...)`` and oneDNN declared twice with other tags.
    """
    shas: dict[str, str] = {}
    repos: dict[str, Upstream] = {}
    cutlass = repos["cutlass"] = factory.create("cutlass", {"include/cutlass/cutlass.h": "// 4.3\n"})
    shas["cutlass_v4.3.0"] = cutlass.tag("v4.3.0")
    cutlass.commit({"include/cutlass/cutlass.h": "// 4.4.2\n"}, "cutlass 4.4.2")
    shas["cutlass_v4.4.2"] = cutlass.tag("v4.4.2")

    tk = repos["tk"] = factory.create("tk", {"python/tk/tk/__init__.py": "V = '3.5.1'\n", "README.md": "tk\n"})
    shas["tk_v3.5.1"] = tk.tag("v3.5.1")
    tk.commit({"python/tk/tk/__init__.py": "V = '3.6.0'\n"}, "tk 3.6.0")
    shas["tk_v3.6.0"] = tk.tag("v3.6.0")

    aiter = repos["aiter"] = factory.create("aiter", {"aiter.py": "# big, not needed\n"})
    ck = factory.create("ck", {"ck.h": "// ck\n"})
    fa = repos["fa"] = factory.create("fa", {"CMakeLists.txt": "project(fa)\n", "csrc/fa.cu": "// fa\n"})
    fa.add_submodule("csrc/cutlass", cutlass, rev=shas["cutlass_v4.4.2"])
    fa.add_submodule("third_party/aiter", aiter)
    fa.add_submodule("csrc/ck", ck)
    # the ck commit fa records is one the ck server never got (made locally, not pushed)
    lost = ck.commit({"ck.h": "// unpushed\n"}, "never pushed", push=False)
    git("-C", str(fa.work / "csrc/ck"), "fetch", "-q", str(ck.work), lost)
    git("-C", str(fa.work / "csrc/ck"), "checkout", "-q", lost)
    git("add", "csrc/ck", cwd=fa.work)
    shas["fa_pin"] = fa.commit({}, "point csrc/ck at an unreachable commit")
    shas["ck_lost"] = lost

    one = factory.create("one", {"one.h": "// one\n"})
    two = factory.create("two", {"two.h": "// two\n"})
    dg = repos["dg"] = factory.create("dg", {"CMakeLists.txt": "project(dg)\n"})
    dg.branch_from("nv_dev", "main")
    dg.commit({"dg.cu": "// dev\n"}, "dev work", branch="nv_dev")
    dg.add_submodule("third-party/one", one, branch="nv_dev")
    shas["dg_pin"] = dg.add_submodule("third-party/two", two, branch="nv_dev")

    vl = repos["vl"] = factory.create("vl", {
        "CMakeLists.txt": VL_CMAKE.format(),
        "tools/cmake/revisions.cmake": VL_REVISIONS.format(tk_tag=tk_tag),
        "cmake/external/tk.cmake": VL_TK.format(),
        "cmake/external/fa.cmake": VL_FA.format(fa_sha=shas["fa_pin"]),
        "cmake/external/dg.cmake": VL_DG.format(dg_sha=shas["dg_pin"]),
        "cmake/cpu_extension.cmake": VL_CPU.format(),
        "vl/__init__.py": "VERSION = '0.1'\n",
    })
    shas["vl_main"] = vl.head()
    vl.branch_from("dev/judgement", "main")
    shas["vl_dev"] = vl.commit({"vl/judgement.py": "J = 1\n"}, "judgement work", branch="dev/judgement")
    shas["vl_pr1"] = vl.pull_request(1, {"vl/pr1.py": "P = 1\n"}, base="dev/judgement")
    return RealShapes(factory, repos, shas)


class GitHubApi:
    """A stand-in for GitHub's pull-request API on 127.0.0.1 (``GET /repos/OWNER/REPO/pulls/N``):
    ``states[(owner, repo, n)]`` is the JSON document it answers, anything else a 404; ``seen_auth``
    records each request's Authorization header. Point imagebuild at it with ``IMAGEBUILD_GITHUB_API=
    api.url``."""

    def __init__(self):
        import json
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        self.states: dict = {}
        self.seen_auth: list = []
        api = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802
                api.seen_auth.append(self.headers.get("Authorization"))
                parts = self.path.strip("/").split("/")  # repos/<owner>/<repo>/pulls/<n>
                st = api.states.get((parts[1], parts[2], int(parts[4]))) \
                    if len(parts) == 5 and parts[4].isdigit() else None
                body = json.dumps(st or {"message": "Not Found"}).encode()
                self.send_response(200 if st else 404)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *a):
                pass

        self._srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self._srv.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self._srv.server_address[1]}"

    def stop(self) -> None:
        self._srv.shutdown()
        self._srv.server_close()

