"""The fault corpus of issue 34 (round three) for prefetch: a prefetch that failed after packing left
its new tarballs in deps-src, beside the ones the lock names. It takes them with it now (real git
upstreams served by a loopback git daemon)."""

from __future__ import annotations

from tests.gitfixtures import git, git_daemon, git_root, upstreams  # noqa: F401 - fixtures
from tests.integration.fetch.test_prefetch import IMAGE, _fast_retries, make_project, prefetch  # noqa: F401


def _files(root):
    return sorted(str(p.relative_to(root)) for p in (root / "deps-src").rglob("*") if p.is_file())


def test_a_prefetch_that_fails_after_packing_leaves_no_new_tarball(upstreams, tmp_path):  # noqa: F811
    root = make_project(tmp_path, upstreams)
    cache = tmp_path / "cache"
    r = prefetch(root, cache)
    assert r.code == 0, r.err
    before = _files(root)
    img = root / "docker-images" / IMAGE
    lock_before = (img / "lock.json").read_text()
    # another composition of APP (PR 4 dropped: a new tarball), and a stage that now installs a wheel,
    # which --offline cannot fetch: the run packs APP, then fails at the packages step
    env = (img / "versions.env").read_text()
    sh = upstreams.shas
    env = env.replace(f'APP_PRS="1@{sh["pr1"]} 2@{sh["pr2"]} 4@{sh["pr4"]}"', f'APP_PRS="1@{sh["pr1"]} 2@{sh["pr2"]}"')
    assert "4@" not in env.split("APP_PRS=")[1].splitlines()[0], env
    (img / "versions.env").write_text(env)
    (img / "requirements.txt").write_text("six==1.16.0\n")
    y = img / "image.yaml"
    y.write_text("python: \"3.11\"\n" + y.read_text().replace("    sources: [APP]\n", "    sources: [APP]\n    requirements: requirements.txt\n"))
    r = prefetch(root, cache, "--offline")
    assert r.code != 0 and "internal error" not in r.err, r.err
    assert "packing" in r.err, r.err  # it did pack before it failed
    assert _files(root) == before, r.err
    assert (img / "lock.json").read_text() == lock_before
