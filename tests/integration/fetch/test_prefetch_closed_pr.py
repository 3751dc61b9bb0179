"""A closed pull request whose ``refs/pull/N/head`` was deleted (issue 20, 1.1; the operators' log:
PR 550's ref was deleted and every PR head was then pinned by SHA). A bare number in ``*_PRS`` is
resolved from the pull-request API, which still names a closed PR's head: prefetch fetches that
commit by SHA, writes ``N@<sha>`` back and says so. Real git (a ``git daemon`` on loopback, reached
as ``https://github.com/example/...`` through git's ``url.insteadOf``) and a small HTTP stand-in for
the API on loopback."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tests.gitfixtures import git_daemon, git_root, upstreams  # noqa: F401  (pytest fixtures)
from tests.integration.fetch.test_prefetch import IMAGE, _edit_env, make_project, prefetch, read_lock


class _Api(BaseHTTPRequestHandler):
    answers: dict = {}  # (repo, number) -> JSON document
    asked: list = []

    def do_GET(self):  # noqa: N802
        parts = self.path.strip("/").split("/")  # repos/<owner>/<repo>/pulls/<n>
        key = (parts[2], int(parts[4])) if len(parts) == 5 and parts[4].isdigit() else None
        type(self).asked.append(key)
        doc = self.answers.get(key)
        body = json.dumps(doc or {"message": "Not Found"}).encode()
        self.send_response(200 if doc else 404)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *a):
        pass


@pytest.fixture
def api(monkeypatch, git_daemon):  # noqa: F811
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Api)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    _Api.answers, _Api.asked = {}, []
    monkeypatch.setenv("IMAGEBUILD_GITHUB_API", f"http://127.0.0.1:{server.server_address[1]}")
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    monkeypatch.setenv("GIT_CONFIG_COUNT", "1")
    monkeypatch.setenv("GIT_CONFIG_KEY_0", f"url.git://127.0.0.1:{git_daemon.port}/.insteadOf")
    monkeypatch.setenv("GIT_CONFIG_VALUE_0", "https://github.com/example/")
    try:
        yield _Api
    finally:
        server.shutdown()
        server.server_close()


def _github_project(tmp_path, ups, prs: str):
    root = make_project(tmp_path, ups, prs=prs)
    _edit_env(root, f"APP_REPO={ups.app.url(ups.daemon)}", f"APP_REPO=https://github.com/example/{ups.app.path_in_daemon}")
    return root


def test_a_bare_number_whose_ref_is_gone_is_pinned_from_the_api(upstreams, tmp_path, api):  # noqa: F811
    pr4 = upstreams.shas["pr4"]  # refs/pull/4/head deleted upstream; the commit is still served by SHA
    repo = upstreams.app.path_in_daemon.removesuffix(".git")
    api.answers = {(repo, 4): {"number": 4, "state": "closed", "merged": False, "head": {"sha": pr4}}}
    root = _github_project(tmp_path, upstreams, "4")
    r = prefetch(root, tmp_path / "cache")
    assert r.code == 0, r.err
    assert (repo, 4) in api.asked
    assert f"pinned 4@{pr4} from the pull-request API (closed)" in r.err
    env = (root / "docker-images" / IMAGE / "versions.env").read_text()
    assert any(line.startswith("APP_PRS=") and f"4@{pr4}" in line for line in env.splitlines()), env
    assert read_lock(root)["sources"]["APP"]["prs"] == [{"number": 4, "sha": pr4}]
    # the pin holds: the next run resolves nothing and needs no API
    api.asked.clear()
    r = prefetch(root, tmp_path / "cache")
    assert r.code == 0, r.err
    assert api.asked == []


@pytest.mark.parametrize("answer", [None, {"state": "closed", "merged": False},
                                    {"state": "closed", "head": {"sha": "not-a-sha"}}],
                         ids=["404", "no-head", "bad-sha"])
def test_without_a_head_from_the_api_it_stays_an_error_and_writes_nothing(upstreams, tmp_path, api, answer):  # noqa: F811
    repo = upstreams.app.path_in_daemon.removesuffix(".git")
    api.answers = {(repo, 4): answer} if answer else {}
    root = _github_project(tmp_path, upstreams, "4")
    env_before = (root / "docker-images" / IMAGE / "versions.env").read_text()
    r = prefetch(root, tmp_path / "cache")
    assert r.code == 1, (r.code, r.err)
    assert "Traceback" not in r.err
    assert "APP: pull request 4 not found" in r.err and "the pull-request API did not name its head either" in r.err
    assert "4@<sha>" in r.err
    assert (root / "docker-images" / IMAGE / "versions.env").read_text() == env_before
    assert not (root / "docker-images" / IMAGE / "lock.json").exists()
