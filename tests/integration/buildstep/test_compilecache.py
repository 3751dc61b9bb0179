"""The compiler cache is imagebuild's (buildstep/compilecache.py): kept on the host, given to the stage,
taken back after it, and so it outlives BuildKit's cache mounts; its figures reach the build record."""

from __future__ import annotations

import json
import subprocess
import uuid

import pytest

from imagebuild.buildstep import compilecache
from tests.buildfixtures import remove_images
from tests.conftest import run_cli

DOCKERFILE = """\
ARG PARENT
FROM ${PARENT}
COPY src/ /src/
RUN --mount=type=bind,from=imagebuild-src,target=/imagebuild/src \\
    --mount=type=bind,from=imagebuild-ccache,target=/imagebuild/ccache \\
    --mount=type=cache,id=CACHE_ID,target=/root/.ccache \\
    . /imagebuild/src/imagebuild-ccache.sh \\
    && for f in /src/*.cpp; do ccache g++ -O1 -c "$f" -o "/tmp/$(basename "$f" .cpp).o"; done
"""


def _drop_cache_mount(cache_id: str) -> None:
    """Drop this test's cache mount only (the engine is shared: never anything else)."""
    out = subprocess.run(["docker", "buildx", "du", "--verbose", "--filter", "type=exec.cachemount"],
                         capture_output=True, text=True, check=True).stdout
    ids, cur = [], None
    for ln in out.splitlines():
        if ln.startswith("ID:"):
            cur = ln.split(":", 1)[1].strip()
        elif ln.startswith("Description:") and cache_id in ln and cur:
            ids.append(cur)
    assert ids, f"no cache mount {cache_id} in the builder:\n{out}"
    for i in ids:
        subprocess.run(["docker", "buildx", "prune", "-f", "--filter", "type=exec.cachemount", "--filter", f"id={i}"],
                       capture_output=True, text=True, check=True)
    out = subprocess.run(["docker", "buildx", "du", "--verbose", "--filter", "type=exec.cachemount"],
                         capture_output=True, text=True, check=True).stdout
    assert cache_id not in out, out


def _clean_up(name: str, cache_id: str) -> None:
    """The test's images and its cache mount (when still there)."""
    remove_images(f"imagebuild/{name}", name)
    try:
        _drop_cache_mount(cache_id)
    except (AssertionError, subprocess.CalledProcessError):
        pass


def _compile_project(tmp_path, monkeypatch, name: str) -> tuple:
    """A one-stage project whose stage compiles src/*.cpp through the compiler cache (its host copy
    under tmp_path): (root, the image folder, the cache id)."""
    root = tmp_path / "p"
    monkeypatch.setenv(compilecache.ENV_DIR, str(tmp_path / "ccache-host"))
    cache_id = f"imagebuild-test-ccache-{uuid.uuid4().hex[:12]}"
    d = root / "docker-images" / name
    (d / "src").mkdir(parents=True)
    (d / "versions.env").write_text("BASE_IMAGE=imagebuild-test/debian:bookworm\n")
    (d / "image.yaml").write_text("platform: linux/amd64\nstages:\n  - name: compile\n    from: BASE_IMAGE\n"
                                  "    files: [src]\n")
    (d / "Dockerfile.compile").write_text(DOCKERFILE.replace("CACHE_ID", cache_id))
    return root, d, cache_id


def _source(d, i: int, body: str = "") -> None:
    (d / "src" / f"f{i}.cpp").write_text(f"#include <vector>\nint f{i}() {{ std::vector<int> v({i}); {body}"
                                         "return (int)v.size(); }\n")


def test_compiler_cache_outlives_cache_mounts(engine_info, tmp_path, monkeypatch):
    root, d, cache_id = _compile_project(tmp_path, monkeypatch, "ccown")
    for i in range(4):
        _source(d, i)

    def build(*args) -> dict:
        res = run_cli("--root", str(root), "build", "ccown", "--json", "--no-gate", *args)
        assert res.code == 0, res.err
        rec = json.loads(res.out)
        st = next(s for s in rec["stages"] if s["name"] == "compile")
        return st

    try:
        # --dry-run shows the context the build will pass
        res = run_cli("--root", str(root), "build", "ccown", "--json", "--dry-run")
        assert res.code == 0, res.err
        cmd = json.loads(res.out)["stages"][0]["command"]
        assert f"{compilecache.NAMED_CCACHE}={compilecache.host_dir(cache_id)}" in cmd, cmd
        st = build("--no-cache")
        cc = st["compiler_cache"]
        assert (cc["hits"], cc["misses"]) == (0, 4), cc
        host = compilecache.host_dir(cache_id)
        assert (host / compilecache.STATS_FILE).is_file() and cc["cache_bytes"] > 0
        key = st["key"]
        # the loss of BuildKit's cache mounts: the next build seeds the mount from the host copy
        _drop_cache_mount(cache_id)
        st = build("--no-cache")
        cc = st["compiler_cache"]
        assert (cc["hits"], cc["misses"], cc["hit_rate"]) == (4, 0, 1.0), cc
        assert st["key"] == key  # never part of the stage key
        # never in a layer: the image holds no ccache folder and no seed
        out = subprocess.run(["docker", "run", "--rm", "--network", "none", "ccown:candidate", "sh", "-c",
                              "ls -A /root/.ccache /imagebuild/ccache 2>/dev/null | wc -l"],
                             capture_output=True, text=True, check=True).stdout
        assert out.strip() == "0", out
        # df shows it
        res = run_cli("--root", str(root), "df", "ccown", "--json")
        assert res.code == 0, res.err
        rows = json.loads(res.out)["compiler_caches"]
        assert any(r["id"] == cache_id and r["bytes"] > 0 for r in rows), rows
        # the figures reach the nightly report and the history page: one source changed, so the
        # nightly builds the stage again with 3 hits and 1 miss
        (d / "gate.yaml").write_text("description: the stage's objects were compiled\npython: python3\ntimeout: 60\n"
                                     "checks:\n  - id: objects\n    kind: command\n    run: ls /tmp/f0.o /tmp/f3.o\n")
        (d / "image.yaml").write_text((d / "image.yaml").read_text() + "gate: gate.yaml\n")
        _source(d, 0, "v.push_back(7); ")
        reports = tmp_path / "reports"
        res = run_cli("--root", str(root), "nightly", "ccown", "--no-peers", "--no-gc", "--report-dir", str(reports),
                      "--json")
        assert res.code == 0, res.err
        (im,) = json.loads(res.out)["images"]
        cc = next(s for s in im["stages"] if s["name"] == "compile")["compiler_cache"]
        assert (cc["hits"], cc["misses"]) == (3, 1), cc
        res = run_cli("--root", str(root), "report", "ccown", "--report-dir", str(reports))
        assert res.code == 0, res.err
        assert "| compile | miss | built |" in res.out and "ccache 75.0% hit (3 hits, 1 misses, 0 uncacheable" in res.out, \
            res.out
        res = run_cli("--root", str(root), "report", "--history", "--html", "--report-dir", str(reports))
        assert res.code == 0, res.err
        assert "compiler-cache hit rate per night" in res.out
    finally:
        _clean_up("ccown", cache_id)


def test_the_take_back_brings_only_what_the_compile_changed(engine_info, tmp_path, monkeypatch):
    """After the first take-back (the whole mount) the host copy and the mount are one generation: the
    next compile's take-back brings only its new entries (a delta); what it brings is enough (after the
    mount is dropped, everything hits from the host copy); and whenever the mount may not be the host
    copy (a compile that failed and so was never taken back, or a host copy removed) it brings the
    whole mount again."""
    root, d, cache_id = _compile_project(tmp_path, monkeypatch, "ccdelta")

    def build(*args, ok: bool = True) -> dict | None:
        res = run_cli("--root", str(root), "build", "ccdelta", "--json", "--no-gate", *args)
        if not ok:
            assert res.code != 0, res.out
            return None
        assert res.code == 0, res.err
        return next(s for s in json.loads(res.out)["stages"] if s["name"] == "compile")["compiler_cache"]

    for i in range(6):
        _source(d, i)
    host = compilecache.host_dir(cache_id)
    try:
        cc = build("--no-cache")
        assert cc["take_back"] == "full" and (cc["hits"], cc["misses"]) == (0, 6), cc
        whole = cc["take_back_files"]
        gen1 = (host / compilecache.GENERATION_FILE).read_text()
        # one source changed: a delta of its entries (and ccache's own counters), not the whole cache
        _source(d, 2, "v.push_back(7); ")
        cc = build()
        assert cc["take_back"] == "delta" and (cc["hits"], cc["misses"]) == (5, 1), cc
        # (its new entries, their counter files and the figures: never every counter file of the cache,
        # which zeroing the counters before the compile rewrote)
        assert 0 < cc["take_back_files"] < whole // 2, (cc, whole)
        assert (host / compilecache.GENERATION_FILE).read_text() != gen1
        # what the delta brought is in the host copy: a builder without the mount hits everything
        _drop_cache_mount(cache_id)
        cc = build("--no-cache")
        assert (cc["hits"], cc["misses"]) == (6, 0) and cc["take_back"] == "delta", cc
        # a compile that fails is never taken back: the next take-back is the whole mount
        (d / "src" / "f9.cpp").write_text("int f9() { return undeclared; }\n")
        build(ok=False)
        (d / "src" / "f9.cpp").unlink()
        _source(d, 3, "v.push_back(8); ")
        cc = build()
        assert cc["take_back"] == "full" and (cc["hits"], cc["misses"]) == (5, 1), cc
        # the host copy removed while the mount is warm: the whole mount again, and the host copy is whole
        import shutil
        shutil.rmtree(host)
        _source(d, 4, "v.push_back(9); ")
        cc = build()
        assert cc["take_back"] == "full" and (cc["hits"], cc["misses"]) == (5, 1), cc
        _drop_cache_mount(cache_id)
        cc = build("--no-cache")
        assert (cc["hits"], cc["misses"]) == (6, 0), cc
    finally:
        _clean_up("ccdelta", cache_id)


@pytest.mark.parametrize("text, want", [
    (DOCKERFILE.replace("CACHE_ID", "x-ccache"), "x-ccache"),
    (DOCKERFILE.replace("CACHE_ID", "x").replace("from=imagebuild-ccache", "from=other"), None),
])
def test_cache_id_of(text, want):
    assert compilecache.cache_id_of(text) == want
