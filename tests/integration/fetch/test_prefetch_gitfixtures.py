"""The git test fixtures themselves (tests/gitfixtures.py) behave like the upstreams they model."""

from __future__ import annotations

import subprocess

from tests.gitfixtures import DropProxy, git, git_daemon, git_root, upstreams  # noqa: F401


def _ls_remote(url: str) -> dict[str, str]:
    out = git("ls-remote", url)
    return {ref: sha for sha, ref in (line.split("\t") for line in out.splitlines())}


def test_daemon_serves_pull_refs_tags_and_deleted_pr_by_sha(upstreams, tmp_path):  # noqa: F811
    refs = _ls_remote(upstreams.url(upstreams.app))
    assert refs["refs/pull/1/head"] == upstreams.shas["pr1"]
    assert refs["refs/pull/5/head"] == upstreams.shas["pr5"]
    assert "refs/pull/4/head" not in refs  # closed PR: ref deleted
    assert refs["refs/tags/v1.0^{}"] == upstreams.shas["app_base"]
    # ...but its SHA is still served (uploadpack.allowAnySHA1InWant)
    repo = tmp_path / "r.git"
    git("init", "-q", "--bare", str(repo))
    git("fetch", "-q", upstreams.url(upstreams.app), upstreams.shas["pr4"], cwd=repo)
    assert git("cat-file", "-t", upstreams.shas["pr4"], cwd=repo) == "commit"
    # the dep pin is on a non-default branch only
    git("fetch", "-q", upstreams.url(upstreams.dep), "refs/heads/main:refs/heads/main", cwd=repo)
    r = subprocess.run(["git", "merge-base", "--is-ancestor", upstreams.shas["dep_pin"], "main"], cwd=repo)
    assert r.returncode != 0


def test_shas_are_deterministic(upstreams, tmp_path):  # noqa: F811
    from tests.gitfixtures import GitDaemon, UpstreamFactory, make_standard_upstreams

    served = tmp_path / "served"
    served.mkdir()
    with GitDaemon(served) as d:
        again = make_standard_upstreams(UpstreamFactory(served, d), d)
        assert again.shas == upstreams.shas
        assert _ls_remote(again.url(again.app))["refs/pull/2/head"] == upstreams.shas["pr2"]


def test_drop_proxy_drops_and_counts(git_daemon, upstreams):  # noqa: F811
    with DropProxy(git_daemon.port, drop_rate=1.0) as p:
        r = subprocess.run(["git", "ls-remote", p.url("app.git")], capture_output=True)
        assert r.returncode != 0
        assert p.connections >= 1 and p.dropped == p.connections
    with DropProxy(git_daemon.port, drop_rate=0.0) as p:
        assert "refs/pull/1/head" in _ls_remote(p.url("app.git"))
        assert p.connections == 1 and p.dropped == 0
