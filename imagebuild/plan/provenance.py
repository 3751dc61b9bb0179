"""Where a definition came from, told truthfully: its content digest and its git revision.

- ``definition_sha256``: a digest of the definition folder's files and of every input it takes
  from outside that folder (the shared patch set), by relative name, x bit and content;
- ``revision``: the last commit that touched those paths, with ``-dirty`` appended when any of
  them differs from that commit or is not committed at all (``git status --porcelain``), or when
  a stage's context holds what no commit can: a gitignored file (``*.pyc``, ``__pycache__/``) or
  an empty folder inside a ``files:`` folder; None outside a git checkout.

Why dirty, not left out: the context stream (context_stream.py) sends a folder input as it is on
disk, empty folders included (they reach the image, so they are in the key). Dropping ignored
files or empty folders from the context would build something other than what the definition
folder holds, and silently (a deliberately ignored, locally made input would vanish from the
image). So what is built stays what is there, and the label stops claiming that a commit holds
it: ``dirty_paths`` names the first few such paths (remove them, or commit a file instead of the
folder, and the build is clean again).

Both go into the release image's labels and into the build id, so a label never names a commit
whose tree does not hold what was built. Read-only: only ``git log`` and ``git status`` run.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from imagebuild.core import lazy
from imagebuild.core.fsutil import canonical_json, sha256_bytes, sha256_tree
from imagebuild.definition import reader as d

run_mod = lazy.module("imagebuild.core.run")  # git, only when a build records provenance

DIRTY_SUFFIX = "-dirty"


@dataclass(frozen=True)
class Provenance:
    definition_sha256: str
    revision: str | None  # "<sha40>", "<sha40>-dirty", or None (no git)
    paths: tuple[str, ...]  # project-relative paths the digest and the revision cover
    source_url: str | None = None  # the project's git remote (credentials removed)
    dirty_paths: tuple[str, ...] = ()  # context paths no commit holds (ignored files, empty folders)

    @property
    def dirty(self) -> bool:
        return bool(self.revision and self.revision.endswith(DIRTY_SUFFIX))

    def as_dict(self) -> dict:
        return {"definition_sha256": self.definition_sha256, "revision": self.revision,
                "dirty": self.dirty, "paths": list(self.paths), "source_url": self.source_url,
                "dirty_paths": list(self.dirty_paths)}


def _paths(defn: d.Definition) -> list[Path]:
    outside = sorted({i.path for s in defn.stages for i in s.inputs if defn.dir not in i.path.parents})
    return [defn.dir, *outside]


def definition_sha256(defn: d.Definition) -> str:
    parts = [(d.display_path(defn.root, p), sha256_tree(p)) for p in _paths(defn)]
    return "sha256:" + sha256_bytes(canonical_json(parts))


def _in_git(root: Path) -> bool:
    return (Path(root) / ".git").exists() and run_mod.which("git") is not None


def _start_git(root: Path, *commands: list[str]) -> list:
    """Start independent git commands at once (plan runs three: ~3x faster than one after the
    other); ``.result()`` of each is (exit code, stdout)."""
    return [run_mod.Query(["git", "-C", str(root), *args]) for args in commands]


def _log_args(paths) -> list[str]:
    return ["log", "-1", "--format=%H", "--", *paths]


def _status_args(paths) -> list[str]:
    # --ignored=matching: an ignored file inside a stage's input folder reaches its context (_not_in_git)
    return ["status", "--porcelain", "--untracked-files=all", "--ignored=matching", "--", *paths]


DIRTY_PATHS_SHOWN = 5


def _inputs(defn: d.Definition) -> list[str]:
    """Project-relative paths of every stage input (files and folders the contexts are made of)."""
    return sorted({d.display_path(defn.root, i.path) for s in defn.stages for i in s.inputs})


def _empty_folders(defn: d.Definition) -> list[str]:
    """Empty folders inside the stages' folder inputs: they reach the image, no commit holds them."""
    out = []
    for rel in _inputs(defn):
        top = defn.root / rel
        if not top.is_dir() or top.is_symlink():
            continue
        for dirpath, dirnames, filenames in os.walk(top):
            if not dirnames and not filenames:
                out.append(d.display_path(defn.root, Path(dirpath)))
    return sorted(out)


def _unquote(path: str) -> str:
    return path[1:-1] if len(path) >= 2 and path[0] == path[-1] == '"' else path


def _not_in_git(changes: str, inputs: list[str]) -> tuple[bool, list[str]]:
    """(whether ``git status`` reports a change, the ignored paths inside a stage input): an ignored
    path counts only where a context holds it (a ``__pycache__`` beside a patch script does not)."""
    changed, ignored = False, []
    for line in changes.splitlines():
        if line.startswith("!! "):
            p = PurePosixPath(_unquote(line[3:].rstrip("/")))
            if any(p == PurePosixPath(i) or PurePosixPath(i) in p.parents for i in inputs):
                ignored.append(str(p))
        elif line.strip():
            changed = True
    return changed, ignored


_REMOTE_ARGS = ["remote", "get-url", "origin"]


def _revision(log: tuple[int, str], status: tuple[int, str], dirty_paths=()) -> str | None:
    (code, rev), (status_code, changes) = log, status
    if code != 0:
        return None
    dirty = status_code != 0 or bool(changes) or bool(dirty_paths)
    if len(rev) != 40:  # never committed: there is no commit to name
        return None if not dirty else "uncommitted" + DIRTY_SUFFIX
    return rev + (DIRTY_SUFFIX if dirty else "")


def _source_url(remote: tuple[int, str]) -> str | None:
    """The project's ``origin`` remote, without credentials (never put a token into a label)."""
    code, url = remote
    if code != 0 or not url:
        return None
    if "://" in url and "@" in url.split("://", 1)[1].split("/", 1)[0]:
        scheme, rest = url.split("://", 1)
        url = f"{scheme}://{rest.split('@', 1)[1]}"
    return url


class Pending:
    """The provenance of a definition, its git queries under way (``start``); ``result()`` waits."""

    def __init__(self, defn: d.Definition):
        self.defn = defn
        self.paths = [d.display_path(defn.root, p) for p in _paths(defn)]
        self.queries = (_start_git(defn.root, _log_args(self.paths), _status_args(self.paths), _REMOTE_ARGS)
                        if _in_git(defn.root) else None)

    def result(self) -> Provenance:
        digest = definition_sha256(self.defn)  # while git answers
        rev = url = None
        not_held: list[str] = []
        if self.queries is not None:
            not_held = _empty_folders(self.defn)
            log, (status_code, changes), remote = (q.result() for q in self.queries)
            changed, ignored = _not_in_git(changes, _inputs(self.defn))
            not_held = sorted(set(not_held) | set(ignored))
            rev = _revision(log, (status_code, "changed" if changed else ""), not_held)
            url = _source_url(remote)
        return Provenance(digest, rev, tuple(self.paths), url, tuple(not_held[:DIRTY_PATHS_SHOWN]))


def start(defn: d.Definition) -> Pending:
    """Start asking git about ``defn``, so that the caller works meanwhile (plan computes the keys)."""
    return Pending(defn)


def of(defn: d.Definition) -> Provenance:
    return start(defn).result()
