"""Tree pins, unit level: what a git tree id depends on (real git, randomised cases), how the composed
tree reaches the labels and build.json, and how a plan sees a lock made for another tree pin."""

from __future__ import annotations

import json
import random
from pathlib import Path
from types import SimpleNamespace

from imagebuild.buildstep import builder
from imagebuild.fetch import compose, gitcache
from imagebuild.plan import planner
from tests.gitfixtures import git

EPOCH = 1_700_000_000


def _commit(work: Path, files: dict[str, bytes], *, author: str, epoch: int, message: str,
            parent_branch: str = "main", branch: str | None = None) -> str:
    """Replace the work tree's files by ``files`` on a fresh branch and commit as ``author`` at ``epoch``."""
    git("checkout", "-q", "--orphan", branch or f"b{random.random()}", cwd=work)
    git("rm", "-q", "-r", "--cached", "--ignore-unmatch", ".", cwd=work)
    for p in work.iterdir():
        if p.name != ".git":
            _rm(p)
    for rel, data in files.items():
        f = work / rel
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_bytes(data)
    git("add", "-A", ".", cwd=work)
    git("-c", f"user.name={author}", "-c", f"user.email={author}@example.invalid", "commit", "-q",
        "--allow-empty", "-m", message, cwd=work, epoch=epoch)
    return git("rev-parse", "HEAD", cwd=work)


def _rm(p: Path) -> None:
    if p.is_dir():
        for q in p.iterdir():
            _rm(q)
        p.rmdir()
    else:
        p.unlink()


def _tree(work: Path, commit: str) -> str:
    return git("rev-parse", f"{commit}^{{tree}}", cwd=work)


def test_tree_changes_iff_file_content_changes(tmp_path):
    """Property, over seeded random file sets: the same files under another author, date and message
    give the same tree; any changed byte, a renamed file or an added file gives another."""
    work = tmp_path / "w"
    git("init", "-q", "-b", "main", str(work))
    rng = random.Random(29)
    for case in range(12):
        files = {f"d{rng.randrange(3)}/f{i}.py": rng.randbytes(rng.randrange(0, 64))
                 for i in range(rng.randrange(1, 6))}
        a = _commit(work, files, author="alice", epoch=EPOCH + case, message="one")
        b = _commit(work, files, author="bob", epoch=EPOCH + 10_000 + case, message=f"another {case}")
        assert a != b and _tree(work, a) == _tree(work, b), files
        victim = rng.choice(sorted(files))
        changed = dict(files)
        changed[victim] = files[victim] + b"\0"
        c = _commit(work, changed, author="alice", epoch=EPOCH + case, message="one")
        assert _tree(work, c) != _tree(work, a)
        renamed = {(k + "x" if k == victim else k): v for k, v in files.items()}
        assert _tree(work, _commit(work, renamed, author="alice", epoch=EPOCH, message="one")) != _tree(work, a)
        added = {**files, "new.txt": b""}
        assert _tree(work, _commit(work, added, author="alice", epoch=EPOCH, message="one")) != _tree(work, a)


def test_compose_gives_the_operators_tree_whoever_merged(tmp_path):
    """prefetch's composition (fixed identity, derived dates) and a merge made by someone else, at
    another time, give different commits and the same tree: what a tree pin compares."""
    up = tmp_path / "up"
    git("init", "-q", "-b", "main", str(up))
    (up / "a.py").write_text("A = 1\n")
    (up / "m.py").write_text("M = 0\n")
    git("add", "-A", cwd=up)
    git("commit", "-q", "-m", "base", cwd=up, epoch=EPOCH)
    base = git("rev-parse", "HEAD", cwd=up)
    heads = []
    for name, path, text, when in (("pr1", "p1.py", "P = 1\n", EPOCH + 5), ("pr2", "m.py", "M = 2\n", EPOCH + 9)):
        git("checkout", "-q", "-B", name, base, cwd=up)
        (up / path).write_text(text)
        git("add", "-A", cwd=up)
        git("commit", "-q", "-m", name, cwd=up, epoch=when)
        heads.append(git("rev-parse", "HEAD", cwd=up))
    pr1, pr2 = heads
    cache = gitcache.Cache(tmp_path / "cache", offline=True)
    m = cache.mirror(up.as_uri())
    git("clone", "-q", "--bare", str(up), str(m.path))
    for sha in (pr1, pr2):
        git("update-ref", f"refs/imagebuild/keep/{sha}", sha, cwd=m.path)
    ours = compose.compose(m, "X", base, [(1, pr1), (2, pr2)])
    # the operators' merge: a work tree, another identity, other dates
    git("checkout", "-q", "-B", "operators", base, cwd=up)
    for sha, when in ((pr1, EPOCH + 99_000), (pr2, EPOCH + 99_500)):
        git("-c", "user.name=operator", "-c", "user.email=op@example.invalid", "merge", "-q", "--no-ff", "-m",
            "merge", sha, cwd=up, epoch=when)
    theirs = git("rev-parse", "HEAD", cwd=up)
    assert theirs != ours.commit
    assert _tree(up, theirs) == ours.tree
    # in another order the files are the same here (no overlap): the tree too; a different file is not
    assert compose.compose(m, "X", base, [(2, pr2), (1, pr1)]).tree == ours.tree
    assert compose.compose(m, "X", base, [(1, pr1)]).tree != ours.tree


def _build(lock: dict) -> SimpleNamespace:
    plan = SimpleNamespace(stages=[], provenance=None, build_id="0" * 16, platform="linux/arm64", lock_sha256="1" * 64)
    return SimpleNamespace(plan=plan, lock=lock, epoch=EPOCH, defn=SimpleNamespace(name="img", description=None),
                           stages=[])


def test_labels_and_build_json_carry_the_composed_tree():
    t, c = "2" * 40, "3" * 40
    lock = {"sources": {
        "VLLM": {"commit": c, "ref": "4" * 40, "repo": "https://x/vllm", "prs": [{"number": 550, "sha": "5" * 40}],
                 "tree": t, "source_tree": t, "tree_pin": t, "sha256": "6" * 64, "version": "0.1.dev1+g333333333"},
        "TK": {"commit": "7" * 40, "ref": "7" * 40, "repo": "https://x/tk", "prs": [], "tree": "8" * 40,
               "source_tree": "9" * 40, "tree_pin": None, "sha256": "a" * 64, "version": None},
        "OLD": {"commit": "b" * 40, "ref": "b" * 40, "repo": "https://x/old", "prs": [], "tree": "c" * 40,
                "sha256": "d" * 64},  # a lock written before source_tree: no label entry, null in build.json
    }}
    labels, doc = builder._provenance(_build(lock))
    assert json.loads(labels["io.imagebuild.source-trees"]) == {"VLLM": t, "TK": "9" * 40}
    assert doc["sources"]["VLLM"]["source_tree"] == t and doc["sources"]["VLLM"]["tree_pin"] == t
    assert "'source_tree'" in doc["sources"]["VLLM"]["recreate"]
    assert doc["sources"]["TK"]["tree"] == "8" * 40 and doc["sources"]["TK"]["source_tree"] == "9" * 40
    assert doc["sources"]["OLD"]["source_tree"] is None and doc["sources"]["OLD"]["tree_pin"] is None
    # no composed source at all: no label
    labels, _ = builder._provenance(_build({"sources": {}}))
    assert "io.imagebuild.source-trees" not in labels


def test_a_lock_composed_for_another_tree_pin_is_stale_in_the_plan():
    src = SimpleNamespace(pins=lambda: {"repo": "https://x/v", "ref": "4" * 40, "prs": []}, tree="2" * 40)
    defn = SimpleNamespace(sources={"V": src}, source_options={})
    stage = SimpleNamespace(sources=("V",))
    entry = {"repo": "https://x/v", "ref": "4" * 40, "prs": [], "tarball": "deps-src/x.tar.gz", "sha256": "6" * 64,
             "source_tree": "2" * 40, "source_date_epoch": EPOCH}
    [ok] = planner.mounted_sources(defn, {"sources": {"V": entry}}, stage)
    assert ok.stale is None
    [bad] = planner.mounted_sources(defn, {"sources": {"V": {**entry, "source_tree": "3" * 40}}}, stage)
    assert bad.stale and "V_TREE=" + "2" * 40 in bad.stale and "3" * 40 in bad.stale
