"""prefetch on every shape the real vLLM tree has (tests/gitfixtures.py: make_realshape_upstreams),
served by a real git daemon on loopback: a CPU-only dependency excluded with a reason, a tag
through a variable set in an include()d file, GIT_SUBMODULES naming one of three submodules of
which another is unreachable, FetchContent_Populate, a double declaration, an override read only
from the environment; plus the errors seen on the real tree."""

from __future__ import annotations

import hashlib
import json
import os
import tarfile
from pathlib import Path

import pytest

from tests.conftest import run_cli, tree_state
from tests.gitfixtures import DropProxy, GitDaemon, UpstreamFactory, git, make_realshape_upstreams

IMAGE = "pf10-realshape"
EXCLUDE = ('    exclude:\n'
           '      oneDNN: "CPU-only; this image builds for CUDA"\n'
           '      arm_compute: "CPU-only (Arm Compute Library for the aarch64 CPU backend)"\n')
SOURCES = ("sources:\n"
           "  VL:\n" + EXCLUDE +
           "  CUTLASS: {dependency_of: VL}\n"
           "  TK: {dependency_of: VL, subdir: python/tk/tk}\n"
           "  FA: {dependency_of: VL, declares: vl-fa}\n"
           "  DG: {dependency_of: VL}\n")
DOCKERFILE = """ARG PARENT
FROM ${PARENT}
# one line gets every source extracted and every override set (docs/prefetch.md, "In the build")
RUN --mount=type=bind,from=imagebuild-src,target=/imagebuild/src \\
    . /imagebuild/src/imagebuild-src.sh \\
    && test -f "$VL_CUTLASS_SRC_DIR/include/cutlass/cutlass.h" && test -f "$TK_SRC_DIR/__init__.py" \\
    && test -f "$FA_SRC_DIR/csrc/cutlass/include/cutlass/cutlass.h" && test ! -e "$FA_SRC_DIR/csrc/ck" \\
    && test -f "$DG_SRC_DIR/third-party/two/two.h" && mkdir -p /out \\
    && cp "$IMAGEBUILD_SRC_VL/vl/pr1.py" /out/ && env | grep -E '_SRC_DIR=|CMAKE_ARGS=' | sort > /out/env.txt
"""


@pytest.fixture(autouse=True)
def _fast(monkeypatch):
    monkeypatch.setenv("IMAGEBUILD_RETRY_DELAY", "0.05")
    monkeypatch.setenv("IMAGEBUILD_GIT_RETRIES", "3")
    monkeypatch.setenv("IMAGEBUILD_GIT_TIMEOUT", "60")
    monkeypatch.delenv("IMAGEBUILD_CACHE", raising=False)
    monkeypatch.delenv("GITHUB_TOKEN", raising=False)


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    served = tmp_path_factory.mktemp("realshape") / "served"
    served.mkdir()
    with GitDaemon(served) as d:
        yield make_realshape_upstreams(UpstreamFactory(served, d))


def project(base: Path, rs, *, sources: str = SOURCES, env_extra: str = "", tk_ref: str = "v3.6.0",
            vl_ref: str = "dev/judgement", prs: str = "1") -> Path:
    root = base / "project"
    img = root / "docker-images" / IMAGE
    img.mkdir(parents=True, exist_ok=True)
    (img / "versions.env").write_text(
        "BASE_IMAGE=imagebuild-test/busybox:1\n"
        f"VL_REPO={rs.url('vl')}\nVL_REF={vl_ref}\nVL_PRS=\"{prs}\"\n"
        f"CUTLASS_REPO={rs.url('cutlass')}\nCUTLASS_REF=v4.4.2\n"
        f"TK_REPO={rs.url('tk')}\nTK_REF={tk_ref}\n"
        f"FA_REPO={rs.url('fa')}\nFA_REF={rs.shas['fa_pin']}\n"
        f"DG_REPO={rs.url('dg')}\nDG_REF={rs.shas['dg_pin']}\n" + env_extra)
    (img / "image.yaml").write_text("platform: linux/amd64\n" + sources +
                                    "stages:\n  - name: build\n    from: BASE_IMAGE\n    sources: [VL]\n")
    (img / "Dockerfile.build").write_text(DOCKERFILE)
    return root


def prefetch(root: Path, cache: Path, *args: str):
    return run_cli("--root", str(root), "prefetch", "--cache", str(cache), *args)


def lock_of(root: Path) -> dict:
    return json.loads((root / "docker-images" / IMAGE / "lock.json").read_text())


@pytest.fixture(scope="module")
def done(shapes, tmp_path_factory):
    base = tmp_path_factory.mktemp("rs-done")
    root = project(base, shapes)
    r = prefetch(root, base / "cache", "--json")
    assert r.code == 0, r.err
    return root, base / "cache", json.loads(r.out)["images"][0], r.err


def test_discovery_of_every_shape(done, shapes):
    root, _, rep, _ = done
    vl = lock_of(root)["sources"]["VL"]
    fc = {d["name"]: d for d in vl["fetchcontent"]}
    assert set(fc) == {"arm_compute", "cutlass", "dg", "oneDNN", "tk", "vl-fa"}
    # a tag through a variable set in an include()d file outside cmake/, with where it was set
    assert (fc["cutlass"]["file"], fc["cutlass"]["line"]) == ("CMakeLists.txt", 19)
    assert fc["cutlass"]["tag"] == "${CUTLASS_REVISION}"
    assert fc["cutlass"]["tag_resolved"] == {"value": "v4.4.2", "from": ["tools/cmake/revisions.cmake:2"],
                                             "unresolved": None}
    assert fc["tk"]["tag_resolved"]["value"] == "v3.6.0"  # a CACHE default
    # FetchContent_Populate with its own repository, under the CPU-only branch
    assert fc["arm_compute"]["kind"] == "populate" and fc["arm_compute"]["line"] == 3
    assert 'CMakeLists.txt:7: if (VL_TARGET_DEVICE STREQUAL "cpu")' in fc["arm_compute"]["when"]
    # a double declaration with other values is kept, not dropped
    assert fc["oneDNN"]["tag"] == "9c5be1cc59e368aebf0909e6cf20f981ea61462a"
    assert [(a["line"], a["tag"]) for a in fc["oneDNN"]["alternatives"]] == [(18, "v3.10")]
    assert any("'oneDNN' is declared more than once" in n and "v3.10 at cmake/cpu_extension.cmake:18" in n
               for n in rep["notices"])
    # GIT_SUBMODULES through a variable set in two branches: every path any branch asks for
    assert fc["vl-fa"]["submodule_paths"] == ["csrc/cutlass"]
    assert fc["dg"]["submodule_paths"] == ["third-party/one", "third-party/two"]
    # the one-argument FetchContent_Populate(dg) is not a second declaration
    assert fc["dg"]["kind"] == "declare" and fc["dg"]["alternatives"] == []
    # who pins what, and what is excluded on purpose
    assert {n: (d["pinned_by"], d["excluded"]) for n, d in fc.items()} == {
        "arm_compute": (None, "CPU-only (Arm Compute Library for the aarch64 CPU backend)"),
        "cutlass": ("CUTLASS", None), "dg": ("DG", None),
        "oneDNN": (None, "CPU-only; this image builds for CUDA"), "tk": ("TK", None), "vl-fa": ("FA", None)}
    assert [(x["name"], x["file"], x["line"]) for x in vl["excluded"]] == [
        ("arm_compute", "cmake/cpu_extension.cmake", 3), ("oneDNN", "cmake/cpu_extension.cmake", 15)]


def test_overrides_as_the_tree_reads_them(done):
    root, _, _, _ = done
    s = lock_of(root)["sources"]
    ov = {n: (s[n]["override"]["name"], s[n]["override"]["via"]) for n in ("CUTLASS", "TK", "FA", "DG")}
    assert ov == {"CUTLASS": ("VL_CUTLASS_SRC_DIR", "env"), "TK": ("TK_SRC_DIR", "env"),
                  "FA": ("FA_SRC_DIR", "env"), "DG": ("DG_SRC_DIR", "env")}
    assert s["TK"]["override"]["cmake_read_at"] == []  # environment only
    assert s["TK"]["override"]["env_read_at"][0] == "cmake/external/tk.cmake:2"
    assert s["CUTLASS"]["override"]["from"] == "the tree's SOURCE_DIR branch at CMakeLists.txt:17"


def test_submodules_as_declared_and_named_by_content(done, shapes):
    root, cache, _, _ = done
    s = lock_of(root)["sources"]
    fa = s["FA"]
    # only csrc/cutlass: aiter is never fetched, the unreachable csrc/ck is never asked for
    assert [x["path"] for x in fa["submodules"]] == ["csrc/cutlass"]
    assert fa["submodules"][0]["commit"] == shapes.shas["cutlass_v4.4.2"]
    assert fa["submodules_wanted"]["origin"].startswith("GIT_SUBMODULES of 'vl-fa' at cmake/external/fa.cmake:11")
    names = tarfile.open(root / fa["tarball"]).getnames()
    assert "./csrc/cutlass/include/cutlass/cutlass.h" in names
    assert not [n for n in names if n.startswith(("./csrc/ck", "./third_party/aiter"))]
    assert not [p for p in cache.iterdir() if "aiter" in p.name]
    dg = s["DG"]
    assert [x["path"] for x in dg["submodules"]] == ["third-party/one", "third-party/two"]
    # the name follows what was packed, not just the top-level tree
    assert Path(dg["tarball"]).name == f"dg-{dg['packed_id'][:12]}.tar"


def test_tag_through_variable_compared_with_pin(done, shapes, tmp_path):
    root, _, _, err = done
    s = lock_of(root)["sources"]
    assert s["TK"]["declared_as"]["tag_value"] == "v3.6.0" and s["TK"]["declared_as"]["matches"] is True
    assert s["CUTLASS"]["declared_as"]["matches"] is True and "differs from" not in err
    # the docs' old example: v3.5.1 against the tree's v3.6.0 is no longer silent
    # (an unjustified override is an error, test_prefetch_more.py; this one says why on its line)
    root2 = project(tmp_path, shapes, tk_ref="v3.5.1  # override: v3.6.0 breaks the sm_121a build")
    r = prefetch(root2, done[1])
    assert r.code == 0, r.err
    assert ("TK: pinned v3.5.1 (" + shapes.shas["tk_v3.5.1"][:12] + ") differs from v3.6.0") in r.err
    assert "kept on purpose: v3.6.0 breaks the sm_121a build" in r.err
    assert "GIT_TAG ${TK_TAG}, set at tools/cmake/revisions.cmake:3" in r.err
    tk = lock_of(root2)["sources"]["TK"]["declared_as"]
    assert (tk["matches"], tk["commit"]) == (False, shapes.shas["tk_v3.6.0"])


def test_plan_shows_every_mount_override_and_exclusion(done):
    root, _, _, _ = done
    r = run_cli("--root", str(root), "plan", IMAGE, "--no-engine", "--json")
    assert r.code == 0, r.err
    m = json.loads(r.out)["stages"][0]["mounts"]
    assert [x["name"] for x in m["mounts"]] == ["VL", "CUTLASS", "DG", "FA", "TK"]
    assert {o["name"]: o["value"] for x in m["mounts"] for o in x["overrides"]} == {
        "VL_CUTLASS_SRC_DIR": "/imagebuild/work/cutlass", "DG_SRC_DIR": "/imagebuild/work/dg",
        "FA_SRC_DIR": "/imagebuild/work/fa", "TK_SRC_DIR": "/imagebuild/work/tk"}
    assert [x["name"] for x in m["excluded"]] == ["arm_compute", "oneDNN"]
    text = run_cli("--root", str(root), "plan", IMAGE, "--no-engine").out
    assert "override    TK_SRC_DIR=/imagebuild/work/tk  (environment)" in text
    assert "excluded    oneDNN (VL at cmake/cpu_extension.cmake:15): CPU-only; this image builds for CUDA" in text


def test_missing_exclusion_names_file_line_branch_and_what_to_add(shapes, tmp_path):
    root = project(tmp_path, shapes, sources=SOURCES.replace(EXCLUDE, ""))
    before = tree_state(root)
    r = prefetch(root, tmp_path / "c")
    assert r.code == 2, r.err
    assert "Traceback" not in r.err
    assert ("VL declares the FetchContent dependency 'oneDNN' at cmake/cpu_extension.cmake:15 "
            "(GIT_REPOSITORY https://github.com/example/oneDNN.git, GIT_TAG 9c5be1cc59e368aebf0909e6cf20f981ea61462a)"
            in r.err)
    assert 'if (VL_TARGET_DEVICE STREQUAL "cpu") (CMakeLists.txt:7)' in r.err
    assert "FetchContent_Populate 'arm_compute' at cmake/cpu_extension.cmake:3" in r.err
    # the hint: the versions.env lines, the sources: entry with env:, or an exclusion with a reason
    assert "'ONEDNN_REPO=https://github.com/example/oneDNN.git' and 'ONEDNN_REF=9c5be1cc59e3" in r.err
    assert "env: FETCHCONTENT_SOURCE_DIR_ONEDNN" in r.err and "exclude: {oneDNN:" in r.err
    assert tree_state(root) == before
    # it said so before downloading any dependency: only the fork was fetched
    mirrors = [p.name for p in (tmp_path / "c").glob("*.git")]
    assert len(mirrors) == 1 and "vl" in mirrors[0], mirrors
    # when the keys exist already, it does not suggest adding them
    root2 = project(tmp_path / "b", shapes, sources=SOURCES.replace(EXCLUDE, ""),
                    env_extra=f"ONEDNN_REPO={shapes.url('cutlass')}\nONEDNN_REF={shapes.shas['cutlass_v4.3.0']}\n")
    r = prefetch(root2, tmp_path / "c")
    assert r.code == 2
    one = [ln for ln in r.err.splitlines() if "ONEDNN_REPO" in ln]
    assert one and all("add to" not in ln for ln in one)
    assert "versions.env already has ONEDNN_REPO: link it in image.yaml with 'sources: {ONEDNN: " \
           "{dependency_of: VL, declares: oneDNN, env: FETCHCONTENT_SOURCE_DIR_ONEDNN}}'" in r.err


@pytest.mark.parametrize("env,expected", [
    ("VL_CUTLAS_SRC_DIR", "names VL reads for 'cutlass': VL_CUTLASS_SRC_DIR (environment at CMakeLists.txt:13"),
    ("FETCHCONTENT_SOURCE_DIR_VL_FA", "FA_SRC_DIR (environment at cmake/external/fa.cmake:1"),
])
def test_unread_override_is_an_error_with_suggestions(shapes, tmp_path, env, expected):
    key = "CUTLASS" if "CUTLAS" in env else "FA"
    src = SOURCES.replace(f"  {key}: {{dependency_of: VL", f"  {key}: {{env: {env}, dependency_of: VL")
    root = project(tmp_path, shapes, sources=src)
    r = prefetch(root, tmp_path / "c")
    assert r.code == 2, r.err
    assert f"sources.{key}.env: override {env!r} of {key} is not read by the tree's CMake files" in r.err
    assert expected in r.err
    assert not (root / "docker-images" / IMAGE / "lock.json").exists()


def test_env_read_only_as_cmake_variable_goes_through_cmake_args(shapes, tmp_path):
    # FetchContent's own FETCHCONTENT_SOURCE_DIR_<NAME> keeps the dashes of the name: -D only
    src = SOURCES.replace("  FA: {dependency_of: VL", "  FA: {env: FETCHCONTENT_SOURCE_DIR_VL-FA, dependency_of: VL")
    root = project(tmp_path, shapes, sources=src)
    r = prefetch(root, tmp_path / "c")
    assert r.code == 0, r.err
    assert lock_of(root)["sources"]["FA"]["override"]["via"] == "cmake"
    plan = json.loads(run_cli("--root", str(root), "plan", IMAGE, "--no-engine", "--json").out)
    script_mounts = plan["stages"][0]["mounts"]["mounts"]
    fa = next(m for m in script_mounts if m["name"] == "FA")
    assert fa["overrides"] == [{"name": "FETCHCONTENT_SOURCE_DIR_VL-FA", "via": "cmake",
                                "value": "/imagebuild/work/fa"}]


def test_submodule_settings_against_the_declaration(shapes, tmp_path, done):
    # all of them: the unreachable one aborts, naming it, with a way out
    root = project(tmp_path / "a", shapes, sources=SOURCES.replace("declares: vl-fa", "declares: vl-fa, "
                                                                   "submodules: true"))
    r = prefetch(root, tmp_path / "c")
    assert r.code == 1, r.err
    assert f"FA:csrc/ck: submodule commit {shapes.shas['ck_lost']} could not be fetched" in r.err
    assert ("FA: submodules: true (all, recursively) in image.yaml, but 'vl-fa' at cmake/external/fa.cmake:11 asks "
            "for csrc/cutlass" in r.err)
    assert "list only the submodules it needs in sources.FA.submodules" in r.err
    # none: said, and the tarball name and the lock change with the content
    root = project(tmp_path / "b", shapes, sources=SOURCES.replace("  DG: {dependency_of: VL}",
                                                                   "  DG: {dependency_of: VL, submodules: false}"))
    r = prefetch(root, tmp_path / "c")
    assert r.code == 0, r.err
    assert ("DG: submodules: false (none) in image.yaml, but 'dg' at cmake/external/dg.cmake:7 asks for "
            "third-party/one, third-party/two; the tarball lacks third-party/one, third-party/two") in r.err
    dg, dg_full = lock_of(root)["sources"]["DG"], lock_of(done[0])["sources"]["DG"]
    assert dg["tree"] == dg_full["tree"] and dg["submodules"] == [] and dg["tarball"] != dg_full["tarball"]
    # a list of paths: exactly those; a path that is not a submodule is named with the ones there are
    root = project(tmp_path / "d", shapes, sources=SOURCES.replace(
        "declares: vl-fa", "declares: vl-fa, submodules: [csrc/cutlass, third_party/aiter]"))
    r = prefetch(root, tmp_path / "c")
    assert r.code == 0, r.err
    assert [x["path"] for x in lock_of(root)["sources"]["FA"]["submodules"]] == ["csrc/cutlass", "third_party/aiter"]
    assert "it also packs third_party/aiter, which the declaration does not ask for" in r.err
    root = project(tmp_path / "e", shapes, sources=SOURCES.replace("declares: vl-fa",
                                                                   "declares: vl-fa, submodules: [csrc/nope]"))
    r = prefetch(root, tmp_path / "c")
    assert r.code == 1 and "'csrc/nope' (from image.yaml) is not a submodule of commit" in r.err
    assert "its submodules: csrc/ck, csrc/cutlass, third_party/aiter" in r.err


def test_branch_pin_remembers_what_it_follows_and_refresh_moves_it(tmp_path):
    served = tmp_path / "served"
    served.mkdir()
    with GitDaemon(served) as d:
        rs = make_realshape_upstreams(UpstreamFactory(served, d))
        root = project(tmp_path, rs)
        r = prefetch(root, tmp_path / "c")
        assert r.code == 0, r.err
        env = (root / "docker-images" / IMAGE / "versions.env").read_text()
        assert f"VL_REF=dev/judgement@{rs.shas['vl_dev']}\n" in env
        assert f"CUTLASS_REF=v4.4.2@{rs.shas['cutlass_v4.4.2']}\n" in env
        lk = lock_of(root)["sources"]["VL"]
        assert (lk["ref"], lk["follows"]) == (rs.shas["vl_dev"], "dev/judgement")
        moved = rs.repos["vl"].commit({"vl/later.py": "L = 1\n"}, "later", branch="dev/judgement")
        r = prefetch(root, tmp_path / "c", "--json")  # the pin holds: nothing fetched
        assert r.code == 0 and json.loads(r.out)["network_operations"] == 0
        r = prefetch(root, tmp_path / "c", "--refresh", "VL", "--json")
        assert r.code == 0, r.err
        rep = json.loads(r.out)["images"][0]
        assert {"source": "VL", "ref": "dev/judgement", "from": rs.shas["vl_dev"], "to": moved} in rep["moved"]
        assert f"VL_REF=dev/judgement@{moved}\n" in (root / "docker-images" / IMAGE / "versions.env").read_text()


def test_only_changed_tarballs_are_repacked_and_damage_is_said(shapes, tmp_path):
    root = project(tmp_path, shapes)
    cache = tmp_path / "c"
    assert prefetch(root, cache).code == 0
    lk = lock_of(root)["sources"]
    stat = {n: os.stat(root / e["tarball"]) for n, e in lk.items()}
    # one pin changes: only that tarball is written
    env = root / "docker-images" / IMAGE / "versions.env"
    env.write_text(env.read_text().replace(f"CUTLASS_REF=v4.4.2@{shapes.shas['cutlass_v4.4.2']}",
                                           f"CUTLASS_REF=v4.3.0@{shapes.shas['cutlass_v4.3.0']}"
                                           "  # override: testing a repack of one changed pin"))
    r = prefetch(root, cache)
    assert r.code == 0, r.err
    lk2 = lock_of(root)["sources"]
    for n in ("VL", "TK", "FA", "DG"):
        st = os.stat(root / lk2[n]["tarball"])
        assert (st.st_ino, st.st_mtime_ns) == (stat[n].st_ino, stat[n].st_mtime_ns), n
    assert lk2["CUTLASS"]["tarball"] != lk["CUTLASS"]["tarball"]
    assert "unchanged (kept)" in r.err and "CUTLASS: packing" in r.err and "VL: packing" not in r.err
    # a damaged tarball is named, with why, and repacked to the lock's bytes
    tb = root / lk2["TK"]["tarball"]
    good = tb.read_bytes()
    tb.write_bytes(good[:50] + bytes([good[50] ^ 1]) + good[51:])
    r = prefetch(root, cache)
    assert r.code == 0, r.err
    assert f"TK: {lk2['TK']['tarball']} does not match the lock" in r.err and "repacking it" in r.err
    assert hashlib.sha256(tb.read_bytes()).hexdigest() == lk2["TK"]["sha256"]


def test_unresolvable_tag_is_said_in_output_and_lock(tmp_path):
    served = tmp_path / "served"
    served.mkdir()
    with GitDaemon(served) as d:
        f = UpstreamFactory(served, d)
        dep = f.create("dep", {"a.h": "// a\n"})
        app = f.create("app", {"CMakeLists.txt": "include(FetchContent)\nFetchContent_Declare(dep GIT_REPOSITORY "
                               "https://github.com/example/dep.git GIT_TAG ${FROM_THE_COMMAND_LINE})\n"})
        root = tmp_path / "p"
        img = root / "docker-images" / "u"
        img.mkdir(parents=True)
        (img / "versions.env").write_text(f"B=imagebuild-test/busybox:1\nAPP_REPO={app.url()}\nAPP_REF={app.head()}\n"
                                          f"DEP_REPO={dep.url()}\nDEP_REF={dep.head()}\n")
        (img / "image.yaml").write_text("platform: linux/amd64\nsources:\n  DEP: {dependency_of: APP}\n"
                                        "stages:\n  - name: s\n    from: B\n")
        (img / "Dockerfile.s").write_text("ARG PARENT\nFROM ${PARENT}\n")
        r = run_cli("--root", str(root), "prefetch", "--cache", str(tmp_path / "c"))
        assert r.code == 0, r.err
        assert ("APP: GIT_TAG ${FROM_THE_COMMAND_LINE} of 'dep' at CMakeLists.txt:2 cannot be resolved: "
                "FROM_THE_COMMAND_LINE is not set in the scanned CMake files") in r.err
        decl = json.loads((img / "lock.json").read_text())["sources"]["APP"]["fetchcontent"][0]
        assert decl["tag_resolved"]["value"] is None and "FROM_THE_COMMAND_LINE" in decl["tag_resolved"]["unresolved"]


# --------------------------------------------------------------------------------------------- errors seen


def test_unreachable_host_keeps_gits_cause(shapes, tmp_path):
    with DropProxy(1) as dead:
        port = dead.port
    root = project(tmp_path, shapes)
    env = root / "docker-images" / IMAGE / "versions.env"
    env.write_text(env.read_text().replace(shapes.url("tk").rsplit("/", 1)[0], f"git://127.0.0.1:{port}"))
    r = prefetch(root, tmp_path / "c")
    assert r.code == 1
    assert "errno=Connection refused" in r.err and "after 3 attempts" in r.err


def test_corrupt_remote_is_not_retried_and_its_message_shown(tmp_path):
    served = tmp_path / "served"
    served.mkdir()
    with GitDaemon(served) as d:
        f = UpstreamFactory(served, d)
        up = f.create("broken", {"a.bin": os.urandom(30000).hex(), "b.txt": "b\n"})
        blob = git("rev-parse", "HEAD:a.bin", cwd=up.bare)
        obj = up.bare / "objects" / blob[:2] / blob[2:]
        assert obj.is_file(), "the fixture expects a loose object"
        obj.chmod(0o644)
        data = bytearray(obj.read_bytes())
        data[12:20] = b"garbage!"
        obj.write_bytes(bytes(data))
        root = tmp_path / "p"
        img = root / "docker-images" / "b"
        img.mkdir(parents=True)
        (img / "versions.env").write_text(f"B=imagebuild-test/busybox:1\nX_REPO={up.url()}\nX_REF={up.head()}\n")
        (img / "image.yaml").write_text("platform: linux/amd64\nstages:\n  - name: s\n    from: B\n")
        (img / "Dockerfile.s").write_text("ARG PARENT\nFROM ${PARENT}\n")
        r = run_cli("--root", str(root), "prefetch", "--cache", str(tmp_path / "c"))
    assert r.code == 1
    assert "retrying" not in r.err
    assert "the remote said:" in r.err and "is corrupt" in r.err


class _CorruptingProxy(DropProxy):
    """Relays, but turns the pack signature into garbage (a server sending a bad pack)."""

    def _serve(self, client, action):
        import socket
        import threading

        upstream = socket.create_connection(("127.0.0.1", self.target_port), timeout=10)

        def down():
            try:
                while data := upstream.recv(65536):
                    client.sendall(data.replace(b"PACK", b"PACX"))
            except OSError:
                pass
            finally:
                try:
                    client.shutdown(socket.SHUT_WR)
                except OSError:
                    pass

        t = threading.Thread(target=down, daemon=True)
        t.start()
        try:
            while data := client.recv(65536):
                upstream.sendall(data)
        except OSError:
            pass
        t.join(timeout=30)
        client.close()
        upstream.close()


def test_bad_pack_header_fails_at_once(shapes, tmp_path):
    port = int(shapes.url("tk").split(":")[2].split("/")[0])
    with _CorruptingProxy(port) as proxy:
        root = project(tmp_path, shapes)
        env = root / "docker-images" / IMAGE / "versions.env"
        env.write_text(env.read_text().replace(f"TK_REPO={shapes.url('tk')}", f"TK_REPO={proxy.url('tk.git')}"))
        r = prefetch(root, tmp_path / "c")
    assert r.code == 1
    assert "bad pack header" in r.err and "retrying fetch" not in r.err.split("TK:")[-1]


def test_pr_conflict_names_the_earlier_pr(tmp_path):
    served = tmp_path / "served"
    served.mkdir()
    with GitDaemon(served) as d:
        f = UpstreamFactory(served, d)
        up = f.create("c", {"a.txt": "a\n", "b.txt": "b\n"})
        base = up.head()
        up.pull_request(1, {"x.txt": "x\n"})
        up.pull_request(2, {"a.txt": "two\n"})
        up.pull_request(3, {"a.txt": "three\n"})
        root = tmp_path / "p"
        img = root / "docker-images" / "c"
        img.mkdir(parents=True)
        (img / "versions.env").write_text(f"B=imagebuild-test/busybox:1\nC_REPO={up.url()}\nC_REF={base}\n"
                                          'C_PRS="1 2 3"\n')
        (img / "image.yaml").write_text("platform: linux/amd64\nstages:\n  - name: s\n    from: B\n")
        (img / "Dockerfile.s").write_text("ARG PARENT\nFROM ${PARENT}\n")
        r = run_cli("--root", str(root), "prefetch", "--cache", str(tmp_path / "cache"))
    assert r.code == 1
    assert "C: pull request 3" in r.err and "conflicts with the earlier PR PR 2 (a.txt)" not in r.err
    assert "conflicts with the earlier PR 2 (a.txt): a.txt" in r.err
    assert "drop or reorder PR 3 or PR 2 in C_PRS" in r.err
