"""Run the patch runner (``imagebuild_patching.py apply ...``) on a lazily populated tree. Standard
library only; run as a script, in the process ``patchcheck.check_lazy`` starts.

Nothing is laid out up front. A path is made the first time the run looks it up, as the full unpack
would have it (a folder, a symlink, or a file of the right size, mode and mtime without its bytes): the
stat-like calls that raise no audit event (``os.stat``, ``os.lstat``, ``os.access``, ``os.readlink``:
so ``os.path.exists``, pathlib's ``exists``/``stat``, shutil) are wrapped, and an audit hook
(``sys.addaudithook``) sees the rest before it happens. A folder's entries are made when it is listed
(``os.listdir``, ``os.scandir``: so ``os.walk``, ``glob``). A file's bytes are written into it the first
time it is opened (or renamed, linked, truncated), read from a ``git cat-file --batch`` whose pipes the
parent passed in (this process starts nothing). So a patch may read, list or stat any path, at import
or while it applies, and sees what the full unpack would hold.

What it cannot follow (a subprocess, an ``exec``, ``ctypes``: something that could read the tree
outside Python's ``open``) ends the run with exit code ``FALLBACK`` and the reason on stderr after
``FALLBACK_TAG``; the parent then checks on the whole tree extracted.

    python3 lazytree.py MANIFEST.json STATE -- PATCHING.py apply --src DIR ...

MANIFEST: {"root": DIR, "epoch": N, "fds": [[write_fd, read_fd], ...], "files": {rel: [i, sha, mode,
size]}, "links": {rel: target}} (``i`` indexes ``fds``: one cat-file per repository). STATE: what is
made, listed, or the run's own (bytes written, replaced or removed: never touched again), one a line,
appended here and read by the second run on the same tree.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys

FALLBACK = 75
FALLBACK_TAG = "imagebuild-lazytree-fallback:"
# what may read the tree outside this process's ``open``: the parent redoes the check on a full unpack
_UNFOLLOWED = ("subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty",
               "pty.spawn", "ctypes.dlopen", "ctypes.dlsym", "ctypes.call_function", "os.startfile")


class _Lazy:
    def __init__(self, manifest: dict, state: str):
        self.root = os.path.realpath(manifest["root"])
        self.epoch = int(manifest["epoch"])
        self.fds = [tuple(p) for p in manifest["fds"]]
        self.files = manifest["files"]  # rel -> [cat-file index, sha, mode, size]
        self.links = manifest["links"]  # rel -> target
        self.children: dict[str, set] = {}
        for rel in (*self.files, *self.links):
            parent, _, name = rel.rpartition("/")
            self.children.setdefault(parent, set()).add(name)
            while parent:
                parent, _, name = parent.rpartition("/")
                kids = self.children.setdefault(parent, set())
                if name in kids:
                    break
                kids.add(name)
        self.state = state
        # made: on disk as the tree has it; own: holds its own bytes, or was replaced or removed by the
        # patch run (never touched again); listed: a folder with all its entries made
        self.made: set[str] = {""}
        self.own: set[str] = set()
        self.listed: set[str] = set()
        try:
            with open(state, encoding="utf-8") as f:
                for ln in f:
                    kind, rel = ln[0], ln[2:].rstrip("\n")
                    {"m": self.made, "o": self.own, "l": self.listed}[kind].add(rel)
        except FileNotFoundError:
            pass
        self._log = open(state, "a", encoding="utf-8")  # noqa: SIM115 (for the process's life)
        self.busy = False

    def _note(self, kind: str, rel: str) -> None:
        {"m": self.made, "o": self.own, "l": self.listed}[kind].add(rel)
        self._log.write(f"{kind} {rel}\n")
        self._log.flush()

    def _rel(self, path) -> str | None:
        if isinstance(path, int) or path is None:
            return None
        if isinstance(path, bytes):
            path = os.fsdecode(path)
        path = os.path.normpath(os.path.abspath(os.fspath(path)))
        if path == self.root:
            return ""
        if not path.startswith(self.root + os.sep):
            return None
        return path[len(self.root) + 1:]

    # -- making the tree as it is, one path at a time

    def _make_one(self, rel: str) -> None:
        """``rel`` (its parent made) on disk as the tree has it: a folder, a symlink, a file of the right
        size, mode and mtime without its bytes."""
        if rel in self.made or rel in self.own:
            return
        full = os.path.join(self.root, rel)
        if rel in self.files:
            _i, _sha, mode, size = self.files[rel]
            fd = os.open(full, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o755 if mode == "100755" else 0o644)
            try:
                if size:
                    os.ftruncate(fd, size)
            finally:
                os.close(fd)
            os.utime(full, (self.epoch, self.epoch))
        elif rel in self.links:
            os.symlink(self.links[rel], full)
        else:
            os.mkdir(full, 0o755)
        self._note("m", rel)

    def make(self, rel: str, *, depth: int = 0) -> str:
        """Make every component of ``rel`` the tree has (so that a lookup of it finds, or misses, what the
        full unpack would); symlinks inside the tree are followed. Returns the path resolved."""
        if rel in self.made and rel not in self.links:
            return rel
        parts = rel.split("/") if rel else []
        cur = ""
        for k, name in enumerate(parts):
            nxt = f"{cur}/{name}" if cur else name
            if nxt in self.own:
                cur = nxt
                continue
            if name in self.children.get(cur, ()):
                self._make_one(nxt)
            else:
                return nxt
            if nxt in self.links and depth < 40:
                target = os.path.normpath(os.path.join(cur, self.links[nxt]))
                if target.startswith("../") or target == ".." or os.path.isabs(target):
                    return nxt
                target = "" if target == "." else target
                rest = "/".join(parts[k + 1:])
                return self.make(f"{target}/{rest}" if target and rest else target or rest, depth=depth + 1)
            cur = nxt
        return cur

    def list(self, rel: str) -> None:
        if rel in self.listed or rel in self.own:
            return
        rel = self.make(rel)
        if rel in self.children and rel not in self.listed:
            for name in sorted(self.children[rel]):
                self._make_one(f"{rel}/{name}" if rel else name)
            self._note("l", rel)

    def hydrate(self, rel: str) -> None:
        if rel in self.own or rel not in self.files or rel not in self.made:
            return
        i, sha, _mode, _size = self.files[rel]
        data = self._blob(i, sha)
        full = os.path.join(self.root, rel)
        fd = os.open(full, os.O_WRONLY)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        finally:
            os.close(fd)
        os.utime(full, (self.epoch, self.epoch))
        self._note("o", rel)

    def whole(self, rel: str) -> None:
        """``rel`` and everything under it made, with its bytes (it is being moved)."""
        rel = self.make(rel)
        if rel in self.files:
            self.hydrate(rel)
        elif rel in self.children:
            self.list(rel)
            for name in self.children[rel]:
                self.whole(f"{rel}/{name}" if rel else name)

    def _blob(self, i: int, sha: str) -> bytes:
        w, r = self.fds[i]
        os.write(w, (sha + "\n").encode())
        header = bytearray()
        while not header.endswith(b"\n"):
            b = os.read(r, 1)
            if not b:
                raise OSError(f"lazy tree: git cat-file ended while reading {sha}")
            header += b
        parts = header.decode().split()
        if len(parts) != 3 or parts[0] != sha or parts[1] != "blob":
            raise OSError(f"lazy tree: blob {sha} missing: {header.decode().strip()}")
        want, data = int(parts[2]) + 1, bytearray()
        while len(data) < want:
            chunk = os.read(r, want - len(data))
            if not chunk:
                raise OSError(f"lazy tree: git cat-file ended while reading {sha}")
            data += chunk
        return bytes(data[:-1])

    # -- what the patch run does

    def touch(self, path, how: str) -> None:
        if self.busy:
            return
        self.busy = True
        try:
            self._touch(path, how)
        finally:
            self.busy = False

    def _touch(self, path, how: str) -> None:
        rel = self._rel(path)
        if rel is None:
            return
        got = self.make(rel)
        if how == "open":
            if got in self.children:
                self.list(got)
            self.hydrate(got)
        elif how == "list":
            self.list(got)
        elif how == "move":
            self.whole(got)
            self._note("o", got)
        elif how == "gone":  # replaced, removed, or made by the patch run: its own from now on
            if got in self.children:
                self.list(got)
            self._note("o", got)

    def hook(self, event: str, args: tuple) -> None:
        if self.busy:
            return
        if event == "open":
            self.touch(args[0], "open")
        elif event in ("os.listdir", "os.scandir"):
            self.touch(args[0] if args[0] is not None else ".", "list")
        elif event == "os.rename":  # os.rename, os.replace: the source moves with its bytes
            self.touch(args[0], "move")
            self.touch(args[1], "gone")
        elif event == "os.link":
            self.touch(args[0], "open")
            self.touch(args[1], "stat")
        elif event in ("os.truncate", "os.utime", "os.chmod", "os.chown", "os.chflags"):
            self.touch(args[0], "open")
        elif event in ("os.remove", "os.rmdir"):
            self.touch(args[0], "gone")
        elif event in ("os.mkdir", "os.symlink", "os.chdir", "os.mkfifo", "os.mknod"):
            self.touch(args[1] if event == "os.symlink" else args[0], "stat")
        elif event.startswith(_UNFOLLOWED):
            sys.stderr.write(f"{FALLBACK_TAG} {event} (something may read the tree outside Python's open)\n")
            sys.stderr.flush()
            os._exit(FALLBACK)

    def wrap_os(self) -> None:
        """stat-like calls raise no audit event: os.stat, os.lstat, os.access, os.readlink (and so
        os.path.exists/isfile/getsize, pathlib's exists/stat/is_file, shutil) make the path first."""
        for name in ("stat", "lstat", "access", "readlink"):
            orig = getattr(os, name)

            def wrapped(path, *a, _orig=orig, **kw):
                if kw.get("dir_fd") is None:
                    self.touch(path, "stat")
                return _orig(path, *a, **kw)

            setattr(os, name, wrapped)


def main(argv: list[str]) -> int:
    if len(argv) < 4 or argv[2] != "--":
        print("usage: lazytree.py MANIFEST STATE -- PATCHING.py ARGS...", file=sys.stderr)
        return 2
    with open(argv[0], encoding="utf-8") as f:
        manifest = json.load(f)
    lazy = _Lazy(manifest, argv[1])
    script = argv[3]
    # the runner as its patches import it (imagebuild_patching), loaded before the hook: its own file
    # is outside the tree
    spec = importlib.util.spec_from_file_location("imagebuild_patching", script)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["imagebuild_patching"] = mod
    spec.loader.exec_module(mod)
    lazy.wrap_os()
    sys.addaudithook(lazy.hook)
    return mod.main(argv[4:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
