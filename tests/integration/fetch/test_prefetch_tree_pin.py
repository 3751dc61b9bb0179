"""Tree pins (``NAME_TREE``): prefetch computes the git tree of what it composed and refuses, writing
nothing, when it is not the pinned one; and every pin that differs from the tree is reported in one run.

Real git: upstreams served by a loopback ``git daemon`` (tests/gitfixtures.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import run_cli, tree_state
from tests.gitfixtures import (  # noqa: F401  (pytest fixtures)
    GitDaemon,
    UpstreamFactory,
    git,
    git_daemon,
    git_root,
    upstreams,
)
from tests.integration.fetch.test_prefetch import IMAGE, _edit_env, make_project, prefetch, read_lock


@pytest.fixture(autouse=True)
def _env(monkeypatch):
    monkeypatch.setenv("IMAGEBUILD_RETRY_DELAY", "0.05")
    monkeypatch.setenv("IMAGEBUILD_GIT_RETRIES", "3")
    monkeypatch.delenv("IMAGEBUILD_CACHE", raising=False)
    monkeypatch.delenv("GITHUB_TOKEN", raising=False)


def _solo_project(root: Path, url: str, base: str, prs: str, tree: str) -> Path:
    img = root / "docker-images" / "solo"
    img.mkdir(parents=True)
    (img / "versions.env").write_text(
        f"BASE_IMAGE=imagebuild-test/busybox:1\nSOLO_REPO={url}\nSOLO_REF={base}\n"
        f'SOLO_PRS="{prs}"\nSOLO_TREE={tree}  # the tree the operators composed\n')
    (img / "image.yaml").write_text("platform: linux/amd64\nstages:\n  - name: s\n    from: BASE_IMAGE\n"
                                    "    sources: [SOLO]\n")
    (img / "Dockerfile.s").write_text("ARG PARENT\nFROM ${PARENT}\n")
    return img


def test_tree_pin_passes_the_same_files_and_refuses_a_moved_head(tmp_path):
    served = tmp_path / "served"
    served.mkdir()
    with GitDaemon(served) as d:
        f = UpstreamFactory(served, d)
        up = f.create("solo", {"a.txt": "a\n", "src/m.py": "X = 1\n"})
        base = up.head()
        head7 = up.pull_request(7, {"b.txt": "b\n"})
        head8 = up.pull_request(8, {"src/m.py": "X = 2\n"})
        # the same files, committed by someone else at another time, on another branch: the same tree
        up.branch_from("operators", base)
        up.commit({"b.txt": "b\n", "src/m.py": "X = 2\n"}, "the operators' composition, squashed", branch="operators")
        want = git("rev-parse", "refs/heads/operators^{tree}", cwd=up.bare)

        img = _solo_project(tmp_path / "ok", up.url(), base, "7 8", want)
        r = run_cli("--root", str(tmp_path / "ok"), "prefetch", "--cache", str(tmp_path / "c"), "--json")
        assert r.code == 0, r.err
        e = json.loads((img / "lock.json").read_text())["sources"]["SOLO"]
        assert e["source_tree"] == want and e["tree_pin"] == want and e["tree"] == want
        assert e["commit"] != git("rev-parse", "refs/heads/operators", cwd=up.bare)  # another commit, same tree

        # a PR head moved upstream: a fresh definition with the same bare numbers composes other files
        moved = up.move_pull_request(8, {"src/m.py": "X = 3\n"})
        root = tmp_path / "moved"
        img = _solo_project(root, up.url(), base, "7 8", want)
        before = tree_state(root)
        r = run_cli("--root", str(root), "prefetch", "--cache", str(tmp_path / "c"))
        assert r.code == 2, (r.code, r.err)
        assert "Traceback" not in r.err
        err = r.err
        assert "versions.env:5: SOLO_TREE" in err and f"not the pinned tree {want}" in err
        got = err.split("is tree ", 1)[1].split()[0]
        assert len(got) == 40 and got != want
        # the heads it used: the base and every PR head, as resolved (the moved one among them)
        assert f"SOLO_REF={base}" in err and f"7@{head7}" in err and f"8@{moved}" in err and head8 not in err
        # nothing written: no lock, no tarball, no folder, versions.env byte for byte
        assert tree_state(root) == before
        assert not (root / "deps-src").exists() and not (img / "lock.json").exists()

        # pinning the heads that give the tree passes again, even after the move (the commit is kept upstream)
        _edit_env_at(img, '"7 8"', f'"7@{head7} 8@{head8}"')
        r = run_cli("--root", str(root), "prefetch", "--cache", str(tmp_path / "c"))
        assert r.code == 0, r.err
        assert json.loads((img / "lock.json").read_text())["sources"]["SOLO"]["source_tree"] == want

        # a changed tree pin is never taken from the fast path: it is composed and refused
        _edit_env_at(img, f"SOLO_TREE={want}", f"SOLO_TREE={got}")
        lock_before = (img / "lock.json").read_bytes()
        r = run_cli("--root", str(root), "prefetch", "--cache", str(tmp_path / "c"))
        assert r.code == 2 and f"is tree {want}" in r.err and f"not the pinned tree {got}" in r.err, r.err
        assert (img / "lock.json").read_bytes() == lock_before


def _edit_env_at(img: Path, old: str, new: str) -> None:
    p = img / "versions.env"
    text = p.read_text()
    assert old in text
    p.write_text(text.replace(old, new))


def _composed_tree(upstreams, prs: list[str]) -> str:  # noqa: F811
    """The tree of APP's base with the PR heads merged in order, computed here with git itself."""
    repo = upstreams.app.bare
    tree = git("rev-parse", f"{upstreams.shas['app_base']}^{{tree}}", cwd=repo)
    cur = upstreams.shas["app_base"]
    for pr in prs:
        tree = git("merge-tree", "--write-tree", cur, upstreams.shas[pr], cwd=repo).splitlines()[0]
        cur = git("commit-tree", tree, "-p", cur, "-p", upstreams.shas[pr], "-m", "x", cwd=repo)
    return tree


def test_every_pin_that_differs_from_the_tree_is_reported_in_one_run(upstreams, tmp_path):  # noqa: F811
    """Two dependency pins differ from what the composed tree declares, and a dependency's tree pin is
    wrong: one run names all three (the old code stopped at the first, one per run)."""
    s = upstreams.shas
    root = make_project(tmp_path, upstreams, prs="1@{pr1}",
                        extra_env=f"APP_TREE={_composed_tree(upstreams, ['pr1'])}\nKERNELS_TREE={'0' * 40}\n")
    _edit_env(root, f"DEP_REF={s['dep_pin']}", f"DEP_REF={s['dep_dev_head']}")
    _edit_env(root, "KERNELS_REF=v3.5.1", f"KERNELS_REF={upstreams.kernels.head()}")
    before = tree_state(root)
    r = prefetch(root, tmp_path / "c")
    assert r.code == 2, (r.code, r.err)
    err = r.err
    assert "has 3 problems" in err, err
    assert "DEP_REF: DEP: pinned" in err and f"differs from {s['dep_pin']}" in err
    assert "KERNELS_REF: KERNELS: pinned" in err and "differs from v3.5.1" in err
    assert "KERNELS_TREE: KERNELS: the tree of KERNELS_REF=" in err and f"not the pinned tree {'0' * 40}" in err
    assert tree_state(root) == before


def test_wrong_tree_of_the_fork_and_of_a_dependency_in_one_run(upstreams, tmp_path):  # noqa: F811
    """A composition that is not the pinned tree stops before its FetchContent is read; a dependency's
    wrong tree pin is still reported in the same run."""
    right = _composed_tree(upstreams, ["pr1", "pr2"])
    root = make_project(tmp_path, upstreams, prs="1@{pr1} 2@{pr2}",
                        extra_env=f"APP_TREE={_composed_tree(upstreams, ['pr1'])}\nDEP_TREE={'1' * 40}\n")
    before = tree_state(root)
    r = prefetch(root, tmp_path / "c")
    assert r.code == 2, (r.code, r.err)
    assert "has 2 problems" in r.err, r.err
    assert f"APP_TREE: APP: the composition of APP_REF={upstreams.shas['app_base']} + " \
           f"APP_PRS=\"1@{upstreams.shas['pr1']} 2@{upstreams.shas['pr2']}\" is tree {right}" in r.err
    assert "DEP_TREE: DEP: the tree of DEP_REF=" in r.err
    assert tree_state(root) == before
    # the right trees pass; the lock carries them
    _edit_env(root, f"APP_TREE={_composed_tree(upstreams, ['pr1'])}", f"APP_TREE={right}")
    _edit_env(root, f"DEP_TREE={'1' * 40}\n", "")
    r = prefetch(root, tmp_path / "c")
    assert r.code == 0, r.err
    lock = read_lock(root)["sources"]
    assert lock["APP"]["tree_pin"] == lock["APP"]["source_tree"] == right
    assert lock["DEP"]["tree_pin"] is None and len(lock["DEP"]["source_tree"]) == 40
    assert (root / "docker-images" / IMAGE / "lock.json").is_file()
