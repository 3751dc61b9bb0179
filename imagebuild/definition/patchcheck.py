"""``patch --check`` and prefetch's patch check: a patch set applied twice, in another process, to a
scratch tree (docs/patches.md). Nothing of a patch runs in imagebuild's own process."""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path

from imagebuild.core import fsutil, lazy
from imagebuild.core import run as run_mod
from imagebuild.core.errors import OperationFailed
from imagebuild.definition import patching

log = lazy.logger()


NO_NAMESPACE = 97  # the exit of _read_only's wrapper when it could not make the folders read-only


def _read_only(folders: list[str], argv: list[str]) -> list[str]:
    """``argv`` run in a mount namespace of its own where each of ``folders`` is bind-mounted read-only
    onto itself (util-linux unshare and mount; root). ``argv`` when there is nothing to guard or no
    unshare; the wrapper exits NO_NAMESPACE when it cannot."""
    if not folders or run_mod.which("unshare") is None:
        return argv
    script = ('while [ "$1" != -- ]; do mount --bind "$1" "$1" 2>/dev/null && '
              'mount -o remount,bind,ro "$1" "$1" 2>/dev/null || exit 97; shift; done; shift; exec "$@"')
    return ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c", script, "sh", *folders, "--",
            *argv]


def check(paths: list, src: Path, *, copy: bool = True) -> list:
    """The patches run in another process on a scratch copy of ``src`` (never imported into this one:
    a patch module's import-time code runs only there), applied twice; a patch the second run still
    changes is not idempotent and fails. Outcomes as a check reports them (``would-apply``).
    ``copy=False``: ``src`` is a scratch tree already, and is used (and changed) as it is."""
    with tempfile.TemporaryDirectory(prefix="imagebuild-patch-check-") as tmp:
        scratch = Path(tmp) / "src"
        if copy:
            shutil.copytree(src, scratch, symlinks=True, ignore=shutil.ignore_patterns(".git"))
        else:
            scratch = Path(src)
        # the checkout and the patches' folders are read-only to the patch process (its own mount
        # namespace): a patch that writes to an absolute path at import changes neither
        guard = sorted({str(Path(src).resolve()), *(str(Path(x).resolve().parent) for x in paths)}) if copy else []
        runs = _run_twice(paths, scratch, Path(tmp), [], (), guard)
    return _outcomes(paths, runs)


def check_lazy(paths: list, entries: list, epoch: int) -> tuple[list | None, str | None]:
    """The same check on a lazily populated tree instead of a full unpack: ``entries`` are the tree's
    files as (path, git mode, blob sha, git dir), what the tarball was packed from, with ``epoch`` its
    mtime. Nothing is laid out up front: a path is made (folder, symlink, or file at its size, mode and
    mtime) when the patch run first looks it up, a folder's entries when it is listed, and a file gets
    its bytes from the git mirror when it is first opened (definition/lazytree.py). (outcomes, None), or (None, reason) when a patch did something the lazy
    tree cannot follow (a subprocess, ctypes): then the caller checks on the whole tree."""
    from imagebuild.definition import lazytree

    with tempfile.TemporaryDirectory(prefix="imagebuild-patch-check-") as tmp:
        scratch = Path(tmp) / "src"
        scratch.mkdir()
        mirrors: dict[str, int] = {}
        for _p, _m, _s, gd in entries:
            mirrors.setdefault(str(gd), len(mirrors))
        by_mirror: dict[int, list] = {}
        for e in entries:
            by_mirror.setdefault(mirrors[str(e[3])], []).append(e)
        procs = [run_mod.popen(["git", "--git-dir", gd, "cat-file", "--batch"]) for gd in mirrors]
        try:
            files, links = _manifest(by_mirror, list(mirrors))
            fds = [(p.stdin.fileno(), p.stdout.fileno()) for p in procs]
            manifest = Path(tmp) / "manifest.json"
            manifest.write_text(json.dumps({"root": str(scratch), "epoch": epoch, "fds": fds, "files": files,
                                            "links": links}))
            state = Path(tmp) / "hydrated"
            runner = [sys.executable, lazytree.__file__, str(manifest), str(state), "--"]
            runs = _run_twice(paths, scratch, Path(tmp), runner, [fd for pair in fds for fd in pair])
        finally:
            for p in procs:
                run_mod.check_popen(p)
    if isinstance(runs, str):
        return None, runs
    return _outcomes(paths, runs), None


def _manifest(by_mirror: dict, git_dirs: list) -> tuple[dict, dict]:
    """({path: [mirror index, sha, mode, size]} of the files, {path: target} of the symlinks): what the
    lazy tree makes a path from (sizes from ``git cat-file --batch-check``, nothing extracted)."""
    files: dict[str, list] = {}
    links: dict[str, str] = {}
    for i, group in sorted(by_mirror.items()):
        blobs = sorted({sha for _p, _m, sha, _g in group})
        out = run_mod.run(["git", "--git-dir", git_dirs[i], "cat-file", "--batch-check"],
                          input="".join(s + "\n" for s in blobs).encode()).stdout.decode()
        sizes = {}
        for line in out.splitlines():
            parts = line.split()
            if len(parts) == 3 and parts[1] == "blob":
                sizes[parts[0]] = int(parts[2])
        symlinks = [e for e in group if e[1] == "120000"]
        if symlinks:
            raw = run_mod.run(["git", "--git-dir", git_dirs[i], "cat-file", "--batch"],
                              input="".join(e[2] + "\n" for e in symlinks).encode()).stdout
            pos = 0
            for e in symlinks:
                nl = raw.index(b"\n", pos)
                n = int(raw[pos:nl].split()[2])
                links[e[0]] = raw[nl + 1:nl + 1 + n].decode("utf-8", "surrogateescape")
                pos = nl + 1 + n + 1
        for path, mode, sha, _g in group:
            if mode == "120000":
                continue
            if sha not in sizes:
                raise OperationFailed(f"object {sha} ({path}) is missing from {git_dirs[i]}",
                                      hint="run prefetch again (without --offline) to fetch it")
            files[path] = [i, sha, mode, sizes[sha]]
    return files, links


def _run_twice(paths: list, scratch: Path, tmp: Path, runner: list, pass_fds, guard: list[str] = ()) -> list | str:
    """The patch set applied twice to ``scratch``: each run's record, or (lazy runner) the reason it
    could not follow a patch. ``guard``: folders the patch process sees read-only (``_read_only``)."""
    from imagebuild.definition import lazytree

    runs = []
    guard = list(guard)
    for i in (1, 2):
        record = tmp / f"run{i}.json"
        argv = [*(runner or [sys.executable]), patching.__file__, "apply", "--src", str(scratch),
                "--keep-going", "--record", str(record), *map(str, paths)]
        # what a patch does at import, relative to where it runs, stays there (cwd)
        res = run_mod.run(_read_only(guard, argv), check=False, timeout=600, pass_fds=pass_fds, cwd=scratch)
        if guard and res.returncode == NO_NAMESPACE and not record.exists():
            if i == 1:
                log.warning("warning: patch --check could not make %s read-only to the patches (a mount "
                            "namespace needs root): a patch that writes to an absolute path at import is not "
                            "contained", ", ".join(guard))
            guard = []
            res = run_mod.run(argv, check=False, timeout=600, pass_fds=pass_fds, cwd=scratch)
        if runner and res.returncode == lazytree.FALLBACK:
            out = res.stdout.decode("utf-8", "replace") if res.stdout else ""
            why = next((ln.split(lazytree.FALLBACK_TAG, 1)[1].strip() for ln in out.splitlines()
                        if lazytree.FALLBACK_TAG in ln), f"exit {res.returncode}")
            return f"a patch did what the lazy tree cannot follow: {why}"
        try:
            runs.append(json.loads(fsutil.read_text(record))["patches"])
        except (OSError, ValueError, KeyError):
            raise OperationFailed("the patch check in a scratch copy recorded nothing",
                                  hint="run it with --debug to see the patch run") from None
    return runs


def _outcomes(paths: list, runs: list) -> list:
    out = []
    for p in map(Path, paths):
        first, second = runs[0].get(p.name), runs[1].get(p.name)
        if first is None:
            out.append(patching.PatchOutcome(p.name, patching.FAILED, [], "the patch did not run"))
            continue
        outcome, message = first["outcome"], first.get("message") or ""
        if outcome == patching.APPLIED:
            outcome = patching.WOULD_APPLY
            if second is not None and second["outcome"] not in (patching.ALREADY, patching.NOT_NEEDED):
                outcome = patching.FAILED
                message = (f"patch {p.name}: not idempotent: applied once, a second run gave "
                           f"{second['outcome']!r} ({(second.get('message') or '').splitlines()[0][:160]})")
        edits = [patching.EditOutcome(e["file"], patching.WOULD_APPLY if e["outcome"] == patching.APPLIED
                                      else e["outcome"], e.get("message") or "") for e in first.get("edits") or []]
        out.append(patching.PatchOutcome(p.name, outcome, edits, message, first.get("sha256")))
    return out
