"""imagebuild prefetch against real git upstreams served by a real `git daemon` on 127.0.0.1."""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

from tests.conftest import run_cli, tree_state
from tests.gitfixtures import (  # noqa: F401  (pytest fixtures)
    DropProxy,
    GitDaemon,
    UpstreamFactory,
    git,
    git_daemon,
    git_root,
    upstreams,
)

IMAGE = "fork"


@pytest.fixture(autouse=True)
def _fast_retries(monkeypatch):
    monkeypatch.setenv("IMAGEBUILD_RETRY_DELAY", "0.05")
    monkeypatch.setenv("IMAGEBUILD_GIT_RETRIES", "8")
    monkeypatch.setenv("IMAGEBUILD_GIT_TIMEOUT", "60")
    monkeypatch.delenv("IMAGEBUILD_CACHE", raising=False)
    monkeypatch.delenv("GITHUB_TOKEN", raising=False)


def make_project(base: Path, ups, *, via: DropProxy | None = None, prs: str = "1 2 4@{pr4}",
                 extra_env: str = "", sources_yaml: str | None = None) -> Path:
    """A project with one image: APP (fork with PRs), DEP (FetchContent dep with a submodule on a
    non-default branch), KERNELS (subdir, tag name to be pinned)."""
    root = base / "project"
    img = root / "docker-images" / IMAGE
    img.mkdir(parents=True)
    url = lambda r: ups.url(r, via)  # noqa: E731
    (img / "versions.env").write_text(
        "# pins for the fork test image\n"
        "BASE_IMAGE=imagebuild-test/busybox:1\n\n"
        "# the fork\n"
        f"APP_REPO={url(ups.app)}\n"
        f"APP_REF={ups.shas['app_base']}  # base commit\n"
        f'APP_PRS="{prs.format(**ups.shas)}"\n\n'
        f"DEP_REPO={url(ups.dep)}\n"
        f"DEP_REF={ups.shas['dep_pin']}\n"
        f"KERNELS_REPO={url(ups.kernels)}\n"
        "KERNELS_REF=v3.5.1\n" + extra_env)
    (img / "image.yaml").write_text(
        "platform: linux/amd64\n"
        "stages:\n"
        "  - name: build\n"
        "    from: BASE_IMAGE\n"
        "    sources: [APP]\n" +
        (sources_yaml if sources_yaml is not None else
         "sources:\n"
         "  APP:\n"
         "    scan_fetchcontent: true\n"
         "  DEP:\n"
         "    dependency_of: APP\n"
         "    declares: dep\n"
         "    env: APP_DEP_SRC_DIR\n"
         "    submodules: true\n"
         "  KERNELS:\n"
         "    dependency_of: APP\n"
         "    subdir: python/kernels/kernels\n"
         "    env: KERNELS_SRC_DIR\n"))
    (img / "Dockerfile.build").write_text("ARG PARENT\nFROM ${PARENT}\nRUN true\n")
    return root


def prefetch(root: Path, cache: Path, *args: str):
    return run_cli("--root", str(root), "prefetch", "--cache", str(cache), *args)


def outputs(root: Path) -> dict[str, str]:
    """Digests of everything prefetch writes (lock, versions.env, deps-src)."""
    out = {}
    for p in sorted([root / "docker-images" / IMAGE / "lock.json", root / "docker-images" / IMAGE / "versions.env"]
                    + list((root / "deps-src").rglob("*"))):
        if p.is_file():
            out[str(p.relative_to(root))] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def read_lock(root: Path) -> dict:
    return json.loads((root / "docker-images" / IMAGE / "lock.json").read_text())


@pytest.fixture(scope="module")
def done(upstreams, tmp_path_factory):  # noqa: F811
    """One successful prefetch (shared by the read-only checks below)."""
    base = tmp_path_factory.mktemp("pf-done")
    root = make_project(base, upstreams)
    r = prefetch(root, base / "cache")
    assert r.code == 0, r.err
    return root, base / "cache", r


def test_prefetch_pins_composes_and_locks(done, upstreams):  # noqa: F811
    root, cache, r = done
    env = (root / "docker-images" / IMAGE / "versions.env").read_text()
    shas = upstreams.shas
    # bare PR numbers and the tag name were pinned in place; comments and order kept
    assert f'APP_PRS="1@{shas["pr1"]} 2@{shas["pr2"]} 4@{shas["pr4"]}"' in env
    # a tag (or branch) name is pinned and remembered: NAME_REF=<name>@<sha>
    assert f"KERNELS_REF=v3.5.1@{shas['kernels_tag_sha']}\n" in env
    assert f"APP_REF={shas['app_base']}  # base commit\n" in env
    assert env.startswith("# pins for the fork test image\nBASE_IMAGE=")
    lk = read_lock(root)
    assert lk["schema"] == "imagebuild.lock" and lk["image"] == IMAGE
    app = lk["sources"]["APP"]
    assert app["prs"] == [{"number": 1, "sha": shas["pr1"]}, {"number": 2, "sha": shas["pr2"]},
                          {"number": 4, "sha": shas["pr4"]}]  # PR 4's ref is deleted, its SHA still fetched
    assert app["ref"] == shas["app_base"] and app["commit"] not in shas.values()
    # the version setuptools-scm would give the composed commit (no tags): its history counted
    dev, node = re.fullmatch(r"0\.1\.dev(\d+)\+g([0-9a-f]{9})", app["version"]).groups()
    assert node == app["commit"][:9] and int(dev) > 3 + 3  # the base's history, 3 PRs, 3 merges
    kernels = lk["sources"]["KERNELS"]
    # a dependency fetched shallow has no countable history, so no version (never a wrong one)
    assert kernels["version"] is None or kernels["version"].endswith("+g" + kernels["commit"][:9])
    # the composed tree contains every PR's change
    names = tarfile.open(root / app["tarball"]).getnames()
    assert {"./feature1.txt", "./feature4.txt", "./CMakeLists.txt", "./src/main.cpp"} <= set(names)
    assert "./NEWS" not in names  # main moved on after the base; the base is what counts
    with tarfile.open(root / app["tarball"]) as t:
        assert t.extractfile("./src/main.cpp").read() == b"int main() {\n  return 2;\n}\n"
        run_sh = t.getmember("./tools/run.sh")
        assert run_sh.mode == 0o755 and run_sh.uid == 0 and run_sh.uname == "" and \
            run_sh.mtime == app["source_date_epoch"]
        assert names == sorted(names, key=lambda n: n.split("/"))
    # a plain tar (tarball format 2: no gzip), which the real tools read
    assert app["tarball_format"] == 2 and app["tarball"].endswith(f"-{app['packed_id'][:12]}.tar")
    head = (root / app["tarball"]).read_bytes()[:512]
    assert head[257:265] == b"ustar  \0"  # a GNU header first (its checksum checked by frombuf), not gzip
    assert tarfile.TarInfo.frombuf(head, "utf-8", "surrogateescape").name == names[0]
    listed = subprocess.run(["tar", "-tf", str(root / app["tarball"])], check=True, capture_output=True,
                            text=True).stdout.split()
    assert [n.rstrip("/") for n in listed] == names
    # tree hash is the git tree of the composed commit
    assert app["tree"] == git("rev-parse", f"{app['commit']}^{{tree}}", cwd=_mirror(cache, "app"))
    assert app["fetchcontent"] and {d["name"] for d in app["fetchcontent"]} == {"dep", "kernels"}
    # the dependency: with its submodule, declared where
    dep = lk["sources"]["DEP"]
    assert dep["dependency_of"] == "APP" and dep["env"] == "APP_DEP_SRC_DIR"
    assert dep["submodules"] == [{"path": "third-party/sub", "url": upstreams.url(upstreams.sub),
                                  "commit": upstreams.shas["sub_main"]}]
    assert dep["override"]["via"] == "env" and dep["override"]["env_read_at"][0] == "CMakeLists.txt:5"
    assert dep["declared_as"]["file"] == "CMakeLists.txt" and dep["declared_as"]["line"] == 11
    dep_names = tarfile.open(root / dep["tarball"]).getnames()
    assert "./third-party/sub/sub.h" in dep_names and "./include/dep.h" in dep_names
    # subdir: only that folder, at the root of the archive
    k = lk["sources"]["KERNELS"]
    assert sorted(tarfile.open(root / k["tarball"]).getnames()) == ["./__init__.py", "./ops.py"]
    assert k["tree"] == git("rev-parse", f"{shas['kernels_tag_sha']}:python/kernels/kernels", cwd=upstreams.kernels.bare)
    # SHA256SUMS beside the tarballs, matching the lock
    sums = (root / "deps-src" / IMAGE / "src" / "SHA256SUMS").read_text().splitlines()
    assert sorted(sums) == sorted(f"{e['sha256']}  {Path(e['tarball']).name}" for e in lk["sources"].values())
    for e in lk["sources"].values():
        assert hashlib.sha256((root / e["tarball"]).read_bytes()).hexdigest() == e["sha256"]
        assert e["tarball"].startswith(f"deps-src/{IMAGE}/src/") and str(root) not in json.dumps(e)
    assert r.code == 0 and "pinned APP_PRS" in r.out


def _mirror(cache: Path, name: str) -> Path:
    found = [p for p in cache.iterdir() if p.name.startswith("127.0.0.1_") is False and name in p.name
             and p.suffix == ".git"]
    assert len(found) >= 1, list(cache.iterdir())
    return sorted(found, key=lambda p: len(p.name))[0]


def test_fresh_caches_give_identical_bytes(done, upstreams, tmp_path):  # noqa: F811
    root1, _, _ = done
    root2 = make_project(tmp_path, upstreams)
    r = prefetch(root2, tmp_path / "cache2", "--jobs", "1")
    assert r.code == 0, r.err
    assert outputs(root1) == outputs(root2)


def test_rerun_does_no_network_and_is_fast(done, upstreams, tmp_path):  # noqa: F811
    root, cache, _ = done
    before = outputs(root)
    t = time.monotonic()
    r = prefetch(root, cache, "--json")
    took = time.monotonic() - t
    assert r.code == 0, r.err
    rep = json.loads(r.out)
    assert rep["schema"] == "imagebuild.prefetch" and rep["network_operations"] == 0
    assert rep["images"][0]["status"] == "unchanged"
    assert outputs(root) == before
    assert took < 1.0


def test_rerun_with_dead_daemon_and_through_proxy_counts_zero(upstreams, tmp_path, git_daemon):  # noqa: F811
    with DropProxy(git_daemon.port) as proxy:
        root = make_project(tmp_path, upstreams, via=proxy)
        assert prefetch(root, tmp_path / "c").code == 0
        used = proxy.connections
        assert used > 0
        proxy.refuse = True  # the upstream is now down
        before = outputs(root)
        r = prefetch(root, tmp_path / "c")
        assert r.code == 0, r.err
        assert proxy.connections == used  # not one connection
        assert outputs(root) == before
        # a lost deps-src is rebuilt from the cache alone (--offline)
        for f in (root / "deps-src").rglob("*.tar"):
            f.unlink()
        r = prefetch(root, tmp_path / "c", "--offline")
        assert r.code == 0, r.err
        assert proxy.connections == used
        assert outputs(root) == before


def test_flaky_proxy_dropping_30_percent(upstreams, tmp_path, git_daemon, done):  # noqa: F811
    with DropProxy(git_daemon.port, drop_rate=0.3, seed=7) as proxy:
        root = make_project(tmp_path, upstreams, via=proxy)
        r = prefetch(root, tmp_path / "c", "--jobs", "4")
        assert r.code == 0, r.err
        assert proxy.dropped > 0, "the proxy dropped nothing: the test proved nothing"
        assert "retrying" in r.err
    # same content as the direct run (URLs differ, so compare the tarballs)
    assert {Path(e["tarball"]).name: e["sha256"] for e in read_lock(root)["sources"].values()} == \
        {Path(e["tarball"]).name: e["sha256"] for e in read_lock(done[0])["sources"].values()}


def _failing(tmp_path, ups, args=(), **kw):
    """A project prefetched once successfully, then changed by the caller; returns (root, cache)."""
    root = make_project(tmp_path, ups, **kw)
    cache = tmp_path / "cache"
    r = prefetch(root, cache, *args)
    assert r.code == 0, r.err
    return root, cache


def _edit_env(root: Path, old: str, new: str) -> None:
    p = root / "docker-images" / IMAGE / "versions.env"
    text = p.read_text()
    assert old in text
    p.write_text(text.replace(old, new))


def _assert_untouched(root: Path, before: dict, env_before: str) -> None:
    after = {k: v for k, v in tree_state(root).items() if "versions.env" not in k}
    assert after == before
    assert (root / "docker-images" / IMAGE / "versions.env").read_text() == env_before


def _snapshot(root: Path):
    return ({k: v for k, v in tree_state(root).items() if "versions.env" not in k},
            (root / "docker-images" / IMAGE / "versions.env").read_text())


@pytest.mark.parametrize("case", ["conflict", "unknown_pr", "bad_sha", "unreachable", "undeclared"])
def test_failures_name_the_source_and_leave_lock_untouched(case, upstreams, tmp_path, git_daemon,  # noqa: F811
                                                           monkeypatch):
    root, cache = _failing(tmp_path, upstreams)
    if case == "unreachable":
        monkeypatch.setenv("IMAGEBUILD_GIT_RETRIES", "3")  # the budget runs out in a fraction of a second
    s = upstreams.shas
    if case == "conflict":
        _edit_env(root, f'4@{s["pr4"]}"', f'4@{s["pr4"]} 3"')
    elif case == "unknown_pr":
        _edit_env(root, f'4@{s["pr4"]}"', f'4@{s["pr4"]} 99"')
    elif case == "bad_sha":
        _edit_env(root, f"DEP_REF={s['dep_pin']}", "DEP_REF=" + "deadbeef" * 5)
    elif case == "unreachable":
        port = git_daemon.port
        with DropProxy(port) as dead:
            dead_port = dead.port
        _edit_env(root, f"KERNELS_REPO=git://127.0.0.1:{port}/kernels.git",
                  f"KERNELS_REPO=git://127.0.0.1:{dead_port}/kernels.git")
    elif case == "undeclared":
        _edit_env(root, f'4@{s["pr4"]}"', f'4@{s["pr4"]} 5"')
    before, env_before = _snapshot(root)
    t = time.monotonic()
    r = prefetch(root, cache)
    assert time.monotonic() - t < 30
    assert r.code in (1, 2), (r.code, r.err)
    assert "Traceback" not in r.err
    err = r.err
    if case == "conflict":
        assert r.code == 1 and "APP: pull request 3" in err and "src/main.cpp" in err
    elif case == "unknown_pr":
        assert "APP: pull request 99 not found" in err and "refs/pull/99/head" in err
    elif case == "bad_sha":
        assert "DEP: commit deadbeef" in err and "DEP_REF" in err and "dep.git" in err
    elif case == "unreachable":
        assert "KERNELS" in err and f"127.0.0.1:{dead_port}/kernels.git" in err and "attempts" in err
    elif case == "undeclared":
        assert r.code == 2 and "'extra'" in err and "cmake/external_projects/extra.cmake:1" in err \
            and "APP" in err and "EXTRA_REPO" in err
    _assert_untouched(root, before, env_before)


def test_deleted_pr_ref_with_pinned_sha_fetches_into_fresh_cache(upstreams, tmp_path):  # noqa: F811
    root = make_project(tmp_path, upstreams, prs="4@{pr4}")
    r = prefetch(root, tmp_path / "fresh")
    assert r.code == 0, r.err
    assert read_lock(root)["sources"]["APP"]["prs"] == [{"number": 4, "sha": upstreams.shas["pr4"]}]
    # --refresh: the ref is gone, the pin stays, and it is said
    r = prefetch(root, tmp_path / "fresh", "--refresh", "APP")
    assert r.code == 0, r.err
    assert "refs/pull/4/head is gone upstream; keeping the pinned" in r.err + r.out


def test_refresh_reports_moved_pr(tmp_path):
    served = tmp_path / "served"
    served.mkdir()
    with GitDaemon(served) as d:
        f = UpstreamFactory(served, d)
        up = f.create("solo", {"a.txt": "a\n"})
        base = up.head()
        first = up.pull_request(7, {"b.txt": "b\n"})
        root = tmp_path / "p"
        img = root / "docker-images" / "solo"
        img.mkdir(parents=True)
        (img / "versions.env").write_text(f"BASE_IMAGE=imagebuild-test/busybox:1\nSOLO_REPO={up.url()}\n"
                                          f"SOLO_REF={base}\nSOLO_PRS=7\n")
        (img / "image.yaml").write_text("platform: linux/amd64\nstages:\n  - name: s\n    from: BASE_IMAGE\n")
        (img / "Dockerfile.s").write_text("ARG PARENT\nFROM ${PARENT}\n")
        r = run_cli("--root", str(root), "prefetch", "--cache", str(tmp_path / "c"))
        assert r.code == 0, r.err
        assert f"SOLO_PRS=7@{first}\n" in (img / "versions.env").read_text()
        moved = up.move_pull_request(7, {"b.txt": "b2\n"})
        # without --refresh the pin holds: nothing fetched
        r = run_cli("--root", str(root), "prefetch", "--cache", str(tmp_path / "c"), "--json")
        assert r.code == 0 and json.loads(r.out)["network_operations"] == 0
        r = run_cli("--root", str(root), "prefetch", "solo", "--refresh", "--cache", str(tmp_path / "c"), "--json")
        assert r.code == 0, r.err
        rep = json.loads(r.out)["images"][0]
        assert rep["moved"] == [{"source": "SOLO", "number": 7, "from": first, "to": moved}]
        assert f"SOLO_PRS=7@{moved}\n" in (img / "versions.env").read_text()


def test_offline_names_first_missing_object(upstreams, tmp_path):  # noqa: F811
    root = make_project(tmp_path, upstreams, prs="1@{pr1}")
    _edit_env(root, "KERNELS_REF=v3.5.1", f"KERNELS_REF={upstreams.shas['kernels_tag_sha']}")
    before = tree_state(root)
    r = prefetch(root, tmp_path / "empty", "--offline")
    assert r.code == 1
    assert "--offline" in r.err and "is not in the cache" in r.err and "APP_REF" in r.err
    assert tree_state(root) == before


def test_interrupted_prefetch_leaves_nothing_acceptable_and_resumes(upstreams, tmp_path, git_daemon):  # noqa: F811
    with DropProxy(git_daemon.port, stall_rate=1.0, stall_s=60) as proxy:
        root = make_project(tmp_path, upstreams, via=proxy)
        # one good run through a working proxy, then one that hangs on the network and is killed
        proxy.stall_rate = 0.0
        cache = tmp_path / "cache"
        assert prefetch(root, cache).code == 0
        good = outputs(root)
        # un-pin PRs 1 and 2 again: the next run must resolve them on the network
        _edit_env(root, f'APP_PRS="1@{upstreams.shas["pr1"]} 2@{upstreams.shas["pr2"]}', 'APP_PRS="1 2')
        env_before = (root / "docker-images" / IMAGE / "versions.env").read_text()
        fresh_cache = tmp_path / "cache-fresh"
        proxy.stall_rate = 1.0
        proc = subprocess.Popen([sys.executable, "-m", "imagebuild", "--root", str(root), "prefetch",
                                 "--cache", str(fresh_cache)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                env={**os.environ, "IMAGEBUILD_GIT_TIMEOUT": "120"})
        deadline = time.monotonic() + 20
        while proxy.stalled == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert proxy.stalled > 0
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        # nothing a build would accept: lock, tarballs, versions.env as before
        now = outputs(root)
        assert {k: v for k, v in now.items() if "versions.env" not in k} == \
            {k: v for k, v in good.items() if "versions.env" not in k}
        assert (root / "docker-images" / IMAGE / "versions.env").read_text() == env_before
        assert not list((root / "deps-src").rglob("*.tmp"))
        # the next run continues and completes
        proxy.stall_rate = 0.0
        r = prefetch(root, fresh_cache)
        assert r.code == 0, r.err
        assert outputs(root) == good


def test_interrupted_while_packing_leaves_no_accepted_tarball(done, upstreams, tmp_path):  # noqa: F811
    """A temp tarball left by a killed run is never taken for a real one, and is cleaned up."""
    root = make_project(tmp_path, upstreams)
    src = root / "deps-src" / IMAGE / "src"
    src.mkdir(parents=True)
    stale = src / ".app-000000000000.tar.999999.1.tmp"
    stale.write_bytes(b"half a tarball")
    r = prefetch(root, done[1])
    assert r.code == 0, r.err
    assert not stale.exists()
    assert outputs(root) == outputs(done[0])


def test_a_format_1_lock_is_repacked_as_a_plain_tar(done, tmp_path, monkeypatch):  # noqa: F811
    """A lock written by tarball format 1 (the same tar in gzip members, ``.tar.gz``) is not taken as
    up to date: the next prefetch repacks every source as format 2 (the very bytes a fresh run writes),
    and the old ``.tar.gz`` files go once the new lock is written."""
    import gzip
    import shutil

    from imagebuild.fetch import prefetch as prefetch_mod
    from imagebuild.fetch import tarball

    root = tmp_path / "project"
    shutil.copytree(done[0], root)
    good, lk = outputs(root), read_lock(root)
    src = root / "deps-src" / IMAGE / "src"
    sums = []
    for e in lk["sources"].values():  # what format 1 wrote: <name>-<id12>.tar.gz, named by a format-1 id
        old = root / e["tarball"]
        with monkeypatch.context() as m:
            m.setattr(tarball, "FORMAT", 1)
            pid = prefetch_mod.packed_id(e["tree"], e["submodules"], e["source_date_epoch"])
        gz = old.with_name(old.name.replace(e["packed_id"][:12] + tarball.SUFFIX, pid[:12] + ".tar.gz"))
        gz.write_bytes(gzip.compress(old.read_bytes(), compresslevel=6, mtime=0))
        old.unlink()
        e.update(tarball_format=1, packed_id=pid, tarball=str(gz.relative_to(root)),
                 sha256=hashlib.sha256(gz.read_bytes()).hexdigest())
        sums.append(f"{e['sha256']}  {gz.name}\n")
    (root / "docker-images" / IMAGE / "lock.json").write_text(json.dumps(lk, indent=2))
    (src / "SHA256SUMS").write_text("".join(sorted(sums)))
    r = prefetch(root, done[1], "--offline", "--json")
    assert r.code == 0, r.err
    rep = json.loads(r.out)["images"][0]
    assert rep["status"] == "ok" and "the lock's tarball is of format 1, this imagebuild packs format 2" in r.err
    new = read_lock(root)["sources"]
    assert {n: (e["tarball_format"], e["tarball"], e["sha256"]) for n, e in new.items()} == \
        {n: (2, e["tarball"], e["sha256"]) for n, e in read_lock(done[0])["sources"].items()}
    assert not list(src.glob("*.tar.gz"))  # the format-1 files went with the lock that named them
    assert {k: v for k, v in outputs(root).items() if "lock.json" not in k} == \
        {k: v for k, v in good.items() if "lock.json" not in k}


def test_cli_help_and_bad_flags(tmp_path):
    r = run_cli("prefetch", "--help")
    assert r.code == 0 and "--offline" in r.out and "IMAGEBUILD_CACHE" in r.out
    r = run_cli("--root", str(tmp_path), "prefetch", "--jobs", "0")
    assert r.code == 2
