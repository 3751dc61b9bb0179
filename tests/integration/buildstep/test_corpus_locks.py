"""Hostile-input corpus, issue 34: the lock against versions.env, for real (a loopback git daemon, the
real engine).

- A git source whose URL carries a credential: prefetch records the URL without it; the planner
  compared that with versions.env's URL as written, so ``build`` said "stale" for ever (and printed
  the token). It compares both the way the lock records them, and says neither's userinfo.
- A moved pin: a pin edited in versions.env without ``prefetch``, while every stage is in the store,
  was built silently from the old source (exit 0). The lock check covers every stage of the plan."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from tests.buildfixtures import remove_images
from tests.conftest import run_cli
from tests.gitfixtures import git_daemon, git_root, upstreams  # noqa: F401  (pytest fixtures)
from tests.integration.fetch.test_prefetch import IMAGE as FORK
from tests.integration.fetch.test_prefetch import make_project, prefetch

pytestmark = pytest.mark.engine

TOKEN = "tok3n-corpus-locks-5151"


def _project(tmp_path: Path, ups, name: str) -> Path:
    """The prefetch tests' project (APP with PRs, its FetchContent deps), its image renamed so that
    no other test's images are touched on the shared engine."""
    root = make_project(tmp_path, ups)
    (root / "docker-images" / FORK).rename(root / "docker-images" / name)
    return root


def _edit(root: Path, name: str, old: str, new: str) -> None:
    p = root / "docker-images" / name / "versions.env"
    text = p.read_text()
    assert old in text
    p.write_text(text.replace(old, new))


def _build(root: Path, name: str, *args: str):
    return run_cli("--root", str(root), "build", name, "--no-gate", *args)


@pytest.fixture
def env(tmp_path, monkeypatch):
    monkeypatch.setenv("IMAGEBUILD_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("IMAGEBUILD_LOCK_DIR", str(tmp_path / "locks"))
    monkeypatch.setenv("IMAGEBUILD_GITHUB_API", "http://127.0.0.1:9")  # nothing listens: no PR states
    return tmp_path


def test_a_source_url_with_a_credential_builds_and_shows_its_token_nowhere(upstreams, env, engine_info,  # noqa: F811
                                                                          monkeypatch):
    tmp_path, name = env, "corpuscred"
    prefix = f"https://ci-bot:{TOKEN}@github.com/example/"
    monkeypatch.setenv("GIT_CONFIG_COUNT", "1")
    monkeypatch.setenv("GIT_CONFIG_KEY_0", f"url.git://127.0.0.1:{upstreams.daemon.port}/.insteadOf")
    monkeypatch.setenv("GIT_CONFIG_VALUE_0", prefix)
    root = _project(tmp_path, upstreams, name)
    _edit(root, name, f"APP_REPO={upstreams.app.url(upstreams.daemon)}",
          f"APP_REPO={prefix}{upstreams.app.path_in_daemon}")
    r = prefetch(root, tmp_path / "cache")
    assert r.code == 0, r.err
    lock = json.loads((root / "docker-images" / name / "lock.json").read_text())
    assert TOKEN not in json.dumps(lock)
    try:
        # the lock is current: plan marks nothing stale, build builds (before: "stale" for ever)
        r = run_cli("--root", str(root), "plan", name, "--json")
        assert r.code == 0, r.err
        mounts = [m for s in json.loads(r.out)["stages"] for m in s.get("mounted_sources") or []]
        assert mounts and not any(m.get("stale") for m in mounts), mounts
        r = _build(root, name)
        assert r.code == 0, r.err
        assert TOKEN not in r.out + r.err
        # the pin moved: stale, said without the token (before: the token, twice)
        _edit(root, name, f"APP_REF={upstreams.shas['app_base']}", f"APP_REF={upstreams.shas['app_main']}")
        r = _build(root, name)
        assert r.code == 1 and "is stale" in r.err, r.err
        assert TOKEN not in r.out + r.err and "ci-bot" not in r.err, r.err
        assert f"github.com/example/{upstreams.app.path_in_daemon}" in r.err
        r = run_cli("--root", str(root), "plan", name)
        assert "STALE" in r.out and TOKEN not in r.out + r.err, r.out
        for f in (tmp_path / "state").rglob("*"):
            if f.is_file():
                assert TOKEN.encode() not in f.read_bytes(), f
    finally:
        remove_images(f"imagebuild/{name}", name)


def test_a_moved_pin_is_never_built_from_the_store_silently(upstreams, env, engine_info):  # noqa: F811
    tmp_path, name = env, "corpuspin"
    root = _project(tmp_path, upstreams, name)
    r = prefetch(root, tmp_path / "cache")
    assert r.code == 0, r.err
    try:
        r = _build(root, name)
        assert r.code == 0, r.err
        # every stage is in the store now; the pin moves, and nobody runs prefetch
        _edit(root, name, f"APP_REF={upstreams.shas['app_base']}", f"APP_REF={upstreams.shas['app_main']}")
        for args in ((), ("--dry-run",), ("--from", "build")):
            r = _build(root, name, *args)
            assert r.code == 1, (args, r.code, r.err)  # before: 0, the image from the old source
            assert "is stale" in r.err and "imagebuild prefetch" in r.err, (args, r.err)
        # a moved PR list, the same
        _edit(root, name, f"APP_REF={upstreams.shas['app_main']}", f"APP_REF={upstreams.shas['app_base']}")
        assert _build(root, name).code == 0
        p = root / "docker-images" / name / "versions.env"
        text = p.read_text()
        moved = re.sub(r'APP_PRS="\S+ ', 'APP_PRS="', text)  # PR 1 dropped
        assert moved != text
        p.write_text(moved)
        r = _build(root, name)
        assert r.code == 1 and "is stale" in r.err, r.err
    finally:
        remove_images(f"imagebuild/{name}", name)
        shutil.rmtree(tmp_path / "cache", ignore_errors=True)
