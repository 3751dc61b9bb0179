"""Compose a fork: its base commit, then each pull-request head merged in the listed order.

Merges run inside the bare mirror (``git merge-tree --write-tree``, no work tree) and are
committed with a fixed identity and a date derived from the inputs (the later committer time of
the two parents), so the same inputs give the same composed commit on every machine. A conflict
stops with the pull-request number and the conflicting paths.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from imagebuild.core.errors import OperationFailed
from imagebuild.fetch.gitcache import COMPOSED, Mirror

IDENTITY = {"GIT_AUTHOR_NAME": "imagebuild", "GIT_AUTHOR_EMAIL": "imagebuild@localhost",
            "GIT_COMMITTER_NAME": "imagebuild", "GIT_COMMITTER_EMAIL": "imagebuild@localhost"}


@dataclass(frozen=True)
class Composed:
    commit: str  # the composed commit (the base itself when there are no PRs)
    tree: str  # the tree of the whole composed commit
    epoch: int  # its committer time (SOURCE_DATE_EPOCH)


class MergeConflict(OperationFailed):
    def __init__(self, source: str, number: int, sha: str, paths: list[str],
                 culprits: list[tuple[int, list[str]]] | None = None):
        self.source, self.number, self.paths = source, number, paths
        self.culprits = culprits or []  # earlier PRs that changed the conflicting paths: (number, paths)
        shown = ", ".join(paths[:20]) + (f" (+{len(paths) - 20} more)" if len(paths) > 20 else "")
        if self.culprits:
            withs = "; ".join(f"{n} ({', '.join(ps[:5])}{' ...' if len(ps) > 5 else ''})"
                              for n, ps in self.culprits)
            what = f"conflicts with the earlier {'PR' if len(self.culprits) == 1 else 'PRs'} {withs}"
            hint = (f"drop or reorder PR {number} or PR {', '.join(str(n) for n, _ in self.culprits)} in "
                    f"{source}_PRS, or pin a PR head that was rebased onto the others")
        else:
            what = f"conflicts with the base {source}_REF (no earlier PR changed these paths)"
            hint = f"pin a head of PR {number} that was rebased onto {source}_REF, or drop it from {source}_PRS"
        super().__init__(f"{source}: pull request {number} ({sha[:12]}) {what}: {shown}", hint=hint)


def commit_time(m: Mirror, sha: str) -> int:
    return int(m.out("show", "-s", "--format=%ct", sha))


MIN_GIT = (2, 38)  # git merge-tree --write-tree


def check_git_version(version_text: str) -> None:
    """Refuse, with a hint, a git too old to merge without a work tree."""
    m = re.search(r"(\d+)\.(\d+)", version_text)
    if m and (int(m.group(1)), int(m.group(2))) < MIN_GIT:
        raise OperationFailed(f"{version_text.strip()} cannot compose pull requests: 'git merge-tree "
                              f"--write-tree' needs git >= {MIN_GIT[0]}.{MIN_GIT[1]}",
                              hint="install a newer git (Ubuntu 24.04 ships 2.43)")


SCM_NODE_DIGITS = 9  # the seed's build reported 0.1.dev20489+g06f922207


def scm_version(m: Mirror, commit: str) -> str | None:
    """The version setuptools-scm's default scheme gives a checkout of ``commit`` that has no tags
    (prefetch fetches none): ``0.1.dev<commits in its history>+g<first 9 hex digits>``, the form
    the operators' own build of the fork reported. The count is the composed history's, so every
    base or PR head change moves it, and the node names the composed commit. None for a shallow
    mirror, whose history cannot be counted."""
    if m.is_shallow():
        return None
    count = int(m.out("rev-list", "--count", commit))
    return f"0.1.dev{count}+g{commit[:SCM_NODE_DIGITS]}"


def compose(m: Mirror, source: str, ref: str, prs: list[tuple[int, str]]) -> Composed:
    if prs:
        check_git_version(m.out("version"))
    current = ref
    epoch = commit_time(m, ref)
    for i, (number, sha) in enumerate(prs):
        r = m.git("merge-tree", "--write-tree", "--name-only", "--no-messages", current, sha, check=False)
        out = r.stdout.decode("utf-8", "replace").splitlines()
        if r.returncode == 1:
            paths = sorted(dict.fromkeys(p for p in out[1:] if p.strip()))
            raise MergeConflict(source, number, sha, paths, _culprits(m, ref, prs[:i], paths))
        if r.returncode != 0 or not out:
            raise OperationFailed(f"{source}: merging pull request {number} ({sha[:12]}) failed: "
                                  + (out[-1] if out else f"git merge-tree exit {r.returncode}"))
        tree = out[0].strip()
        epoch = max(epoch, commit_time(m, sha))
        date = f"@{epoch} +0000"
        env = dict(IDENTITY, GIT_AUTHOR_DATE=date, GIT_COMMITTER_DATE=date)
        current = m.out("commit-tree", tree, "-p", current, "-p", sha,
                        "-m", f"imagebuild: merge pull request #{number} ({sha})", env=env)
    if current != ref:
        m.git("update-ref", f"{COMPOSED}{current}", current)
    tree = m.out("rev-parse", f"{current}^{{tree}}")
    return Composed(current, tree, epoch)


def _culprits(m: Mirror, ref: str, earlier: list[tuple[int, str]], paths: list[str]) -> list[tuple[int, list[str]]]:
    """The earlier PRs whose own changes (from their merge base with the base ref) touch ``paths``."""
    out = []
    want = set(paths)
    for number, sha in earlier:
        base = m.git("merge-base", ref, sha, check=False).stdout.decode().strip()
        if not base:
            continue
        changed = set(m.out("diff", "--name-only", "--no-renames", base, sha).splitlines())
        hit = sorted(want & changed)
        if hit:
            out.append((number, hit))
    return out


def subtree(m: Mirror, source: str, commit: str, subdir: str | None) -> str:
    """The tree hash of ``subdir`` in ``commit`` (the whole tree when None)."""
    if not subdir:
        return m.out("rev-parse", f"{commit}^{{tree}}")
    r = m.git("rev-parse", "-q", "--verify", f"{commit}:{subdir}", check=False)
    sha = r.stdout.decode().strip()
    if r.returncode != 0 or not sha or m.out("cat-file", "-t", sha) != "tree":
        raise OperationFailed(f"{source}: subdir {subdir!r} is not a folder in commit {commit[:12]}",
                              hint=f"fix sources.{source}.subdir in image.yaml")
    return sha
