"""A closed pull request whose ``refs/pull/N/head`` was deleted (issue 20, 1.1; the operators' log:
PR 550's ref was deleted and every PR head was then pinned by SHA). A bare number in ``*_PRS`` is
resolved from the pull-request API, which still names a closed PR's head: prefetch fetches that
commit by SHA, writes ``N@<sha>`` back and says so. Real git (a ``git daemon`` on loopback, reached
as ``https://github.com/example/...`` through git's ``url.insteadOf``) and a small HTTP stand-in for
the API on loopback."""

from __future__ import annotations

import pytest

from tests.gitfixtures import git_daemon, git_root, upstreams  # noqa: F401  (pytest fixtures)
from tests.integration.fetch.test_prefetch import IMAGE, _edit_env, make_project, prefetch, read_lock
from tests.integration.fetch.test_prefetch_more import _github_urls, github_api  # noqa: F401  (a fixture)


@pytest.fixture
def api(github_api, git_daemon, monkeypatch):  # noqa: F811
    """The loopback GitHub API stand-in (test_prefetch_more.py), the fork reached as github.com."""
    _github_urls(monkeypatch, git_daemon.port)
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    return github_api


def _github_project(tmp_path, ups, prs: str):
    root = make_project(tmp_path, ups, prs=prs)
    _edit_env(root, f"APP_REPO={ups.app.url(ups.daemon)}", f"APP_REPO=https://github.com/example/{ups.app.path_in_daemon}")
    return root


def test_a_bare_number_whose_ref_is_gone_is_pinned_from_the_api(upstreams, tmp_path, api):  # noqa: F811
    pr4 = upstreams.shas["pr4"]  # refs/pull/4/head deleted upstream; the commit is still served by SHA
    repo = upstreams.app.path_in_daemon.removesuffix(".git")
    api.states = {("example", repo, 4): {"number": 4, "state": "closed", "merged": False, "head": {"sha": pr4}}}
    root = _github_project(tmp_path, upstreams, "4")
    r = prefetch(root, tmp_path / "cache")
    assert r.code == 0, r.err
    assert len(api.seen_auth) == 1  # the API was asked, once
    assert f"pinned 4@{pr4} from the pull-request API (closed)" in r.err
    env = (root / "docker-images" / IMAGE / "versions.env").read_text()
    assert any(line.startswith("APP_PRS=") and f"4@{pr4}" in line for line in env.splitlines()), env
    assert read_lock(root)["sources"]["APP"]["prs"] == [{"number": 4, "sha": pr4}]
    # the pin holds: the next run resolves nothing and needs no API
    api.seen_auth.clear()
    r = prefetch(root, tmp_path / "cache")
    assert r.code == 0, r.err
    assert api.seen_auth == []


@pytest.mark.parametrize("answer", [None, {"state": "closed", "merged": False},
                                    {"state": "closed", "head": {"sha": "not-a-sha"}}],
                         ids=["404", "no-head", "bad-sha"])
def test_without_a_head_from_the_api_it_stays_an_error_and_writes_nothing(upstreams, tmp_path, api, answer):  # noqa: F811
    repo = upstreams.app.path_in_daemon.removesuffix(".git")
    api.states = {("example", repo, 4): answer} if answer else {}
    root = _github_project(tmp_path, upstreams, "4")
    env_before = (root / "docker-images" / IMAGE / "versions.env").read_text()
    r = prefetch(root, tmp_path / "cache")
    assert r.code == 1, (r.code, r.err)
    assert "Traceback" not in r.err
    assert "APP: pull request 4 not found" in r.err and "the pull-request API did not name its head either" in r.err
    assert "4@<sha>" in r.err
    assert (root / "docker-images" / IMAGE / "versions.env").read_text() == env_before
    assert not (root / "docker-images" / IMAGE / "lock.json").exists()


def test_every_number_without_a_head_is_named_at_once(upstreams, tmp_path):  # noqa: F811
    """The log's "PR heads 260-270" and "master + 6/5 PRs" disagree: prefetch names every number in
    the list that is no pull request with a head, not only the first."""
    root = make_project(tmp_path, upstreams, prs="1 77 2 78")
    env_before = (root / "docker-images" / IMAGE / "versions.env").read_text()
    r = prefetch(root, tmp_path / "cache")
    assert r.code == 1, r.err
    assert "pull requests 77, 78 not found" in r.err and "Traceback" not in r.err
    assert (root / "docker-images" / IMAGE / "versions.env").read_text() == env_before


def test_a_pin_that_follows_a_branch_must_be_on_it(upstreams, tmp_path):  # noqa: F811
    """NAME_REF=<branch>@<sha>: prefetch checks that the commit is in the branch's history (the
    definition's b12x pin says master@139e0404...; the log only says "master 139e0405")."""
    shas = upstreams.shas
    root = make_project(tmp_path, upstreams, prs="2")
    _edit_env(root, f"APP_REF={shas['app_base']}", f"APP_REF=main@{shas['app_base']}")
    r = prefetch(root, tmp_path / "cache")
    assert r.code == 0, r.err
    assert "is on main" in r.err
    # a PR head is no commit of main
    root2 = make_project(tmp_path / "two", upstreams, prs="2")
    _edit_env(root2, f"APP_REF={shas['app_base']}", f"APP_REF=main@{shas['pr1']}")
    env_before = (root2 / "docker-images" / IMAGE / "versions.env").read_text()
    r = prefetch(root2, tmp_path / "cache2")
    assert r.code == 2, r.err
    assert f"APP_REF=main@{shas['pr1']}: that commit is not on main" in r.err and "versions.env:" in r.err
    assert (root2 / "docker-images" / IMAGE / "versions.env").read_text() == env_before
