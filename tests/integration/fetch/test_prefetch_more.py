"""prefetch: GitHub PR states over a loopback HTTP API, declared-tag overrides, tarball bytes."""

from __future__ import annotations

import hashlib
import io
import json
import subprocess
import tarfile

import pytest

from imagebuild.fetch import gitcache, tarball
from tests.gitfixtures import (  # noqa: F401
    DropProxy,
    GitDaemon,
    GitHubApi,
    UpstreamFactory,
    git,
    git_daemon,
    git_root,
    upstreams,
)
from tests.integration.fetch.test_prefetch import IMAGE, _edit_env, make_project, prefetch, read_lock

TOKEN = "sekrit-token-0123456789"


@pytest.fixture(autouse=True)
def _env(monkeypatch):
    monkeypatch.setenv("IMAGEBUILD_RETRY_DELAY", "0.05")
    monkeypatch.setenv("IMAGEBUILD_GIT_RETRIES", "3")
    monkeypatch.delenv("IMAGEBUILD_CACHE", raising=False)
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")


@pytest.fixture
def github_api(monkeypatch):
    api = GitHubApi()
    monkeypatch.setenv("IMAGEBUILD_GITHUB_API", api.url)
    yield api
    api.stop()


def _github_urls(monkeypatch, daemon_port: int) -> None:
    """https://github.com/example/* -> the loopback git daemon (git's url.<base>.insteadOf)."""
    monkeypatch.setenv("GIT_CONFIG_COUNT", "1")
    monkeypatch.setenv("GIT_CONFIG_KEY_0", f"url.git://127.0.0.1:{daemon_port}/.insteadOf")
    monkeypatch.setenv("GIT_CONFIG_VALUE_0", "https://github.com/example/")


def test_github_pr_states_reported_token_never_shown(upstreams, git_daemon, github_api, monkeypatch,  # noqa: F811
                                                     tmp_path):
    _github_urls(monkeypatch, git_daemon.port)
    monkeypatch.setenv("GITHUB_TOKEN", TOKEN)
    github_api.states = {("example", "app", 1): {"state": "open", "merged": False},
                         ("example", "app", 4): {"state": "closed", "merged": False}}
    root = make_project(tmp_path, upstreams, prs="1 4@{pr4}")
    _edit_env(root, f"APP_REPO=git://127.0.0.1:{git_daemon.port}/app.git", "APP_REPO=https://github.com/example/app.git")
    r = prefetch(root, tmp_path / "c", "--json")
    assert r.code == 0, r.err
    rep = json.loads(r.out)["images"][0]
    assert rep["pr_states"] == [{"source": "APP", "number": 1, "state": "open", "merged": False}]
    r = prefetch(root, tmp_path / "c", "--refresh")
    assert r.code == 0, r.err
    assert "APP: PR 4 is closed and unmerged" in r.err
    assert "refs/pull/4/head is gone upstream; keeping the pinned" in r.err
    assert f"Bearer {TOKEN}" in github_api.seen_auth
    lock_text = (root / "docker-images" / IMAGE / "lock.json").read_text()
    for text in (r.out, r.err, lock_text):
        assert TOKEN not in text
    assert read_lock(root)["sources"]["APP"]["repo"] == "https://github.com/example/app.git"


def test_github_api_unreachable_is_not_an_error(upstreams, git_daemon, monkeypatch, tmp_path):  # noqa: F811
    _github_urls(monkeypatch, git_daemon.port)
    with DropProxy(git_daemon.port) as dead:
        dead_port = dead.port
    monkeypatch.setenv("IMAGEBUILD_GITHUB_API", f"http://127.0.0.1:{dead_port}")
    root = make_project(tmp_path, upstreams, prs="1")
    _edit_env(root, f"APP_REPO=git://127.0.0.1:{git_daemon.port}/app.git", "APP_REPO=https://github.com/example/app.git")
    r = prefetch(root, tmp_path / "c", "--json")
    assert r.code == 0, r.err
    assert json.loads(r.out)["images"][0]["pr_states"] == []


def test_pin_differing_from_declared_tag_is_an_error_unless_justified(upstreams, tmp_path):  # noqa: F811
    """A dependency pin that overrides what the tree declares is an error naming the key, unless its
    versions.env line says why (`# override: <reason>`); then it is kept and reported with the reason."""
    root = make_project(tmp_path, upstreams, prs="1")
    head = upstreams.kernels.head()
    _edit_env(root, "KERNELS_REF=v3.5.1", f"KERNELS_REF={head}")
    env_before = (root / "docker-images" / IMAGE / "versions.env").read_text()
    r = prefetch(root, tmp_path / "c")
    assert r.code == 2, r.err
    assert "KERNELS: pinned" in r.err and "differs from v3.5.1" in r.err and \
        "cmake/external_projects/kernels.cmake:2" in r.err and "KERNELS_REF" in r.err and "# override:" in r.err
    assert (root / "docker-images" / IMAGE / "versions.env").read_text() == env_before
    assert not (root / "docker-images" / IMAGE / "lock.json").exists()
    # justified on its line: kept, and the reason is in the report and the lock
    _edit_env(root, f"KERNELS_REF={head}", f"KERNELS_REF={head}  # override: the tag's kernels miscompute on GB10")
    r = prefetch(root, tmp_path / "c")
    assert r.code == 0, r.err
    assert "kept on purpose: the tag's kernels miscompute on GB10" in r.err
    decl = read_lock(root)["sources"]["KERNELS"]["declared_as"]
    assert decl["override_reason"] == "the tag's kernels miscompute on GB10"
    # the pin that equals the declared tag says nothing
    root2 = make_project(tmp_path / "b", upstreams, prs="1")
    r = prefetch(root2, tmp_path / "c")
    assert r.code == 0 and "differs from" not in r.err


def test_dependency_the_tree_no_longer_declares_is_a_warning(upstreams, tmp_path):  # noqa: F811
    root = make_project(tmp_path, upstreams, prs="1",
                        extra_env=f"OLD_REPO={upstreams.url(upstreams.sub)}\nOLD_REF={upstreams.shas['sub_main']}\n",
                        sources_yaml="sources:\n  DEP: {dependency_of: APP, submodules: true}\n"
                        "  KERNELS: {dependency_of: APP, subdir: python/kernels/kernels}\n"
                        "  OLD: {dependency_of: APP}\n")
    r = prefetch(root, tmp_path / "c", "--json")
    assert r.code == 0, r.err
    rep = json.loads(r.out)["images"][0]
    assert any("OLD:" in n and "declares no such FetchContent dependency" in n for n in rep["notices"])
    assert read_lock(root)["sources"]["OLD"]["declared_as"] is None


def test_tarball_bytes_large_file_symlink_modes(tmp_path):
    served = tmp_path / "served"
    served.mkdir()
    f = UpstreamFactory(served)
    big = hashlib.sha256(b"seed").digest() * (300_000)  # ~9.6 MB: larger than the writer's buffer
    up = f.create("big", {"a/big.bin": big, "a/x.sh": "#!/bin/sh\n", "z.txt": "z\n", "a-b/c.txt": "c\n"})
    git("symbolic-ref", "HEAD", "refs/heads/main", cwd=up.work)
    (up.work / "link").symlink_to("a/x.sh")
    git("add", "link", cwd=up.work)
    sha = up.commit({}, "add link")
    cache = gitcache.Cache(tmp_path / "cache", offline=True)
    m = cache.mirror(up.bare.as_uri())
    git("clone", "-q", "--bare", str(up.bare), str(m.path))
    entries = [tarball.Entry(p, mode, s, m) for mode, s, p in tarball.list_tree(m, sha)]
    d1 = tarball.pack(entries, tmp_path / "one.tar", 1_700_000_123)
    d2 = tarball.pack(list(reversed(entries)), tmp_path / "two.tar", 1_700_000_123)
    raw = (tmp_path / "one.tar").read_bytes()
    assert d1 == d2 == hashlib.sha256(raw).hexdigest() and raw == (tmp_path / "two.tar").read_bytes()
    assert not raw.startswith(b"\x1f\x8b") and raw[257:265] == b"ustar  \0"  # a plain GNU tar, no gzip
    assert len(raw) % 10240 == 0
    with tarfile.open(fileobj=io.BytesIO(raw), mode="r:") as t:
        names = t.getnames()
        assert names == ["./a", "./a/big.bin", "./a/x.sh", "./a-b", "./a-b/c.txt", "./link", "./z.txt"]
        assert t.extractfile("./a/big.bin").read() == big
        link = t.getmember("./link")
        assert link.issym() and link.linkname == "a/x.sh"
        for mem in t.getmembers():
            assert (mem.uid, mem.gid, mem.uname, mem.gname, mem.mtime) == (0, 0, "", "", 1_700_000_123)
        assert t.getmember("./a").isdir() and t.getmember("./a").mode == 0o755
    assert not list(tmp_path.glob(".*.tmp"))
    # the same order GNU tar --sort=name gives for the extracted tree
    out = tmp_path / "x"
    out.mkdir()
    subprocess.run(["tar", "-xf", str(tmp_path / "one.tar"), "-C", str(out)], check=True)
    listed = subprocess.run(["bash", "-c", f'tar --sort=name -C "{out}" -cf - . | tar -tf -'], check=True,
                            capture_output=True, text=True).stdout.split()
    assert [n.rstrip("/") for n in listed if n != "./"] == names
