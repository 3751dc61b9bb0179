"""``imagebuild prefetch --dry-run`` against real git upstreams: it resolves the PR heads and tag names
and says what versions.env and the lock would get, and writes neither (issue 23, section 4)."""

from __future__ import annotations

import json

import pytest

from tests.gitfixtures import git_daemon, git_root, upstreams  # noqa: F401  (pytest fixtures)
from tests.integration.fetch.test_prefetch import IMAGE, make_project, outputs, prefetch


@pytest.fixture(autouse=True)
def _fast_retries(monkeypatch):
    monkeypatch.setenv("IMAGEBUILD_RETRY_DELAY", "0.05")
    monkeypatch.setenv("IMAGEBUILD_GIT_RETRIES", "8")
    monkeypatch.setenv("IMAGEBUILD_GIT_TIMEOUT", "60")
    monkeypatch.delenv("IMAGEBUILD_CACHE", raising=False)
    monkeypatch.delenv("GITHUB_TOKEN", raising=False)


def test_dry_run_resolves_and_writes_nothing(upstreams, tmp_path):  # noqa: F811
    root = make_project(tmp_path, upstreams)
    before = outputs(root)
    env_before = (root / "docker-images" / IMAGE / "versions.env").read_text()
    r = prefetch(root, tmp_path / "cache", "--dry-run", "--json")
    assert r.code == 0, r.err
    assert outputs(root) == before and not (root / "docker-images" / IMAGE / "lock.json").exists()
    assert not (root / "deps-src").exists() or not any((root / "deps-src").rglob("*.tar*"))
    img = json.loads(r.out)["images"][0]
    assert img["status"] == "dry-run"
    would = img["would_write"]["versions_env"]["set"]
    shas = upstreams.shas
    assert would["APP_PRS"] == f"1@{shas['pr1']} 2@{shas['pr2']} 4@{shas['pr4']}"
    assert would["KERNELS_REF"] == f"v3.5.1@{shas['kernels_tag_sha']}"
    assert {x["source"] for x in img["would_write"]["lock"]["sources"] if x["changed"]} == {"APP", "DEP", "KERNELS"}
    human = prefetch(root, tmp_path / "cache", "--dry-run")
    assert human.code == 0 and "dry run: nothing written" in human.out and "would pin APP_PRS" in human.out
    assert (root / "docker-images" / IMAGE / "versions.env").read_text() == env_before

    # the real run writes exactly what the dry run said
    r = prefetch(root, tmp_path / "cache")
    assert r.code == 0, r.err
    env = (root / "docker-images" / IMAGE / "versions.env").read_text()
    for key, value in would.items():
        assert f'{key}="{value}"' in env or f"{key}={value}\n" in env, key
    # and a dry run now has nothing to change
    r = prefetch(root, tmp_path / "cache", "--dry-run", "--json")
    img = json.loads(r.out)["images"][0]
    assert r.code == 0 and (img["status"] == "unchanged" or img["would_write"]["versions_env"]["set"] == {})
