"""Run the patch runner (``imagebuild_patching.py apply ...``) on a lazily populated tree. Standard
library only; run as a script, in the process ``patchcheck.check_lazy`` starts.

The tree was laid out by the parent as a skeleton: every folder, every symlink, and every file at its
path, size, mode and mtime, but without its bytes (a sparse file). Listing, ``stat``, ``exists`` all
see the whole tree as extracted. The bytes of a file are written into it the first time anything in
this process opens it (or renames, links or truncates it): an audit hook (``sys.addaudithook``) sees
every ``open`` before it happens, and reads the blob from a ``git cat-file --batch`` whose pipes the
parent passed in (this process starts nothing). So a patch may read any file, at import or while it
applies, and reads what the full unpack would hold.

What it cannot follow (a subprocess, an ``exec``, ``ctypes``: something that could read the tree
outside Python's ``open``) ends the run with exit code ``FALLBACK`` and the reason on stderr after
``FALLBACK_TAG``; the parent then checks on the whole tree extracted.

    python3 lazytree.py MANIFEST.json STATE -- PATCHING.py apply --src DIR ...

MANIFEST: {"root": DIR, "epoch": N, "fds": [[write_fd, read_fd], ...], "files": {rel: [i, sha]}}
(``i`` indexes ``fds``: one cat-file per repository). STATE: the paths already holding their own
bytes (hydrated, or replaced by a patch), one a line, appended here and read by the next run.
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
        self.files = manifest["files"]
        self.state = state
        self.done: set[str] = set()
        try:
            with open(state, encoding="utf-8") as f:
                self.done = {ln.rstrip("\n") for ln in f if ln.strip()}
        except FileNotFoundError:
            pass
        self.busy = False

    def _rel(self, path) -> str | None:
        if isinstance(path, int) or path is None:
            return None
        if isinstance(path, bytes):
            path = os.fsdecode(path)
        path = os.path.abspath(os.fspath(path))
        if path == self.root or not path.startswith(self.root + os.sep):
            return None
        return path[len(self.root) + 1:]

    def _mark(self, rel: str) -> None:
        self.done.add(rel)
        with open(self.state, "a", encoding="utf-8") as f:
            f.write(rel + "\n")

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

    def hydrate(self, path) -> None:
        rel = self._rel(path)
        if rel is None or rel in self.done or rel not in self.files:
            return
        self.busy = True
        try:
            i, sha = self.files[rel]
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
            self._mark(rel)
        finally:
            self.busy = False

    def replaced(self, path) -> None:
        rel = self._rel(path)
        if rel is not None and rel in self.files and rel not in self.done:
            self.busy = True
            try:
                self._mark(rel)
            finally:
                self.busy = False

    def hook(self, event: str, args: tuple) -> None:
        if self.busy:
            return
        if event == "open":
            self.hydrate(args[0])
        elif event == "os.rename":  # os.rename, os.replace: the source keeps its bytes, the target is new
            self.hydrate(args[0])
            self.replaced(args[1])
        elif event == "os.link":
            self.hydrate(args[0])
        elif event == "os.truncate":
            self.hydrate(args[0])
        elif event == "os.remove":
            self.replaced(args[0])
        elif event.startswith(_UNFOLLOWED):
            sys.stderr.write(f"{FALLBACK_TAG} {event} (something may read the tree outside Python's open)\n")
            sys.stderr.flush()
            os._exit(FALLBACK)


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
    sys.addaudithook(lazy.hook)
    return mod.main(argv[4:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
