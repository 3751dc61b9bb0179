"""A credential in a source URL is used, never stored (issue 22, security 3): with
``APP_REPO=https://user:TOKEN@github.com/...`` prefetch fetches (real git through ``url.insteadOf``
to a loopback ``git daemon``), and neither the lock, nor versions.env's other lines, nor the report,
nor the packed tarballs hold the token. Credentials belong in git's credential helpers."""

from __future__ import annotations

import json

from tests.gitfixtures import git_daemon, git_root, upstreams  # noqa: F401  (pytest fixtures)
from tests.integration.fetch.test_prefetch import IMAGE, _edit_env, make_project, prefetch, read_lock

TOKEN = "tok3n-never-stored-4242"


def test_a_token_in_a_repo_url_reaches_no_file(upstreams, tmp_path, monkeypatch):  # noqa: F811
    prefix = f"https://ci-bot:{TOKEN}@github.com/example/"
    monkeypatch.setenv("GIT_CONFIG_COUNT", "1")
    monkeypatch.setenv("GIT_CONFIG_KEY_0", f"url.git://127.0.0.1:{upstreams.daemon.port}/.insteadOf")
    monkeypatch.setenv("GIT_CONFIG_VALUE_0", prefix)
    monkeypatch.setenv("IMAGEBUILD_GITHUB_API", "http://127.0.0.1:9")  # nothing listens: no PR states
    root = make_project(tmp_path, upstreams, prs="1 2 4@{pr4}")
    _edit_env(root, f"APP_REPO={upstreams.app.url(upstreams.daemon)}", f"APP_REPO={prefix}{upstreams.app.path_in_daemon}")
    r = prefetch(root, tmp_path / "cache", "--json")
    assert r.code == 0, r.err
    assert TOKEN not in r.out + r.err
    lock = read_lock(root)
    assert lock["sources"]["APP"]["repo"] == f"https://github.com/example/{upstreams.app.path_in_daemon}"
    written = [root / "docker-images" / IMAGE / "lock.json", *sorted((root / "deps-src").rglob("*"))]
    for f in written:
        if f.is_file():
            assert TOKEN.encode() not in f.read_bytes(), f
    # the next run sees nothing changed (the lock's URL without the credential is the same source)
    r = prefetch(root, tmp_path / "cache", "--json")
    assert r.code == 0, r.err
    assert json.loads(r.out)["images"][0]["status"] == "unchanged"
