"""Real CUDA device code, compiled here without a GPU: the toolchain from PyPI, the architecture
rule from the real vLLM tree's own CMake functions.

- ``toolchain(version)``: NVIDIA's CUDA toolchain wheels (nvcc, nvvm, crt, cccl, runtime headers,
  cuobjdump) for this host, pinned to one CUDA minor, installed once into the test cache
  (``$XDG_CACHE_HOME/imagebuild-tests/cuda-<minor>``). Where the index is not reachable the tests
  are skipped with the reason; in CI (CI=true) or with IMAGEBUILD_REQUIRE_CUDA_WHEELS=1 they fail.
- ``vllm_arches(tree, arch_list, cuda)``: what a vLLM tree compiles for a TORCH_CUDA_ARCH_LIST.
  CMake (project mode, no language enabled, so no compiler or torch is needed) includes the tree's
  ``cmake/utils.cmake`` and runs, as the tree's CMakeLists.txt has them, the block that sets
  ``CUDA_SUPPORTED_ARCHS``, the block that filters the requested architectures through it, and the
  block that picks the NVFP4 kernels' architectures; ``set_gencode_flags_for_srcs`` then gives the
  ``-gencode`` flags those kernels get. The blocks are cut from the tree's file, never rewritten,
  so a patched tree (patch_vllm_preserve_sm12x_target.py) gives the patched answer.
- ``fa2_arches(fa_tree, cuda_archs, cuda, work)``: what flash-attention's own CMake (the tree vLLM
  declares, bce29425) compiles its FA2 library for, given the CUDA_ARCHS vLLM's CMake hands it: its
  ``CUDA_SUPPORTED_ARCHS`` statements, its filter of CUDA_ARCHS and its ``FA2_ARCHS`` statement,
  cut from its CMakeLists.txt, with its own ``cmake/utils.cmake``.
- ``compile_so(tc, flags, out)``: a small kernel compiled with those flags into a shared object.
- ``cuobjdump()``: the cuobjdump of the oldest CUDA minor that has a wheel (13.2): it reads the
  files of older toolkits too (13.0 has no cuobjdump wheel).

The only rule written here is torch's spelling of an arch list entry as a ``-gencode`` flag
(``12.1a`` -> ``arch=compute_121a,code=sm_121a``; ``+PTX`` adds ``code=compute_121a``), which is
what torch puts into CMAKE_CUDA_FLAGS before vLLM's CMake reads it back.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGES = ("nvidia-cuda-nvcc", "nvidia-nvvm", "nvidia-cuda-crt", "nvidia-cuda-cccl",
            "nvidia-cuda-runtime", "nvidia-cuda-cuobjdump")

PROBE_CU = r"""
// a block-scaled FP4-shaped kernel: 16 e2m1 values per byte pair, one scale per block
__global__ void nvfp4_probe_dequant(const unsigned char* q, const float* scale, float* out, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  unsigned char b = q[i / 2];
  int v = (i & 1) ? (b >> 4) : (b & 15);
  out[i] = (v & 8 ? -1.0f : 1.0f) * (float)(v & 7) * scale[i / 16];
}
extern "C" void nvfp4_probe(const unsigned char* q, const float* s, float* o, int n) {
  nvfp4_probe_dequant<<<(n + 255) / 256, 256>>>(q, s, o, n);
}
"""


FA2_CU = r"""
// an FA2-shaped kernel: one query row against a block of keys, softmax-weighted sum of values
__global__ void flash_fwd_probe_kernel(const float* q, const float* k, const float* v, float* o, int n, int d) {
  int row = blockIdx.x, j = threadIdx.x;
  if (j >= d) return;
  float m = -1e30f, l = 0.f, acc = 0.f;
  for (int t = 0; t < n; ++t) {
    float s = q[row * d + j] * k[t * d + j];
    float m2 = fmaxf(m, s), p = __expf(s - m2), c = __expf(m - m2);
    l = l * c + p; acc = acc * c + p * v[t * d + j]; m = m2;
  }
  o[row * d + j] = acc / l;
}
extern "C" void flash_fwd_probe(const float* q, const float* k, const float* v, float* o, int rows, int n, int d) {
  flash_fwd_probe_kernel<<<rows, d>>>(q, k, v, o, n, d);
}
"""

CUOBJDUMP_MINOR = "13.2"  # the first CUDA minor with an nvidia-cuda-cuobjdump wheel


def required() -> bool:
    return os.environ.get("CI") == "true" or os.environ.get("IMAGEBUILD_REQUIRE_CUDA_WHEELS") == "1"


def _unavailable(msg: str):
    if required():
        pytest.fail(msg + " -- required in CI (IMAGEBUILD_REQUIRE_CUDA_WHEELS)")
    pytest.skip(msg)


@dataclass(frozen=True)
class Toolchain:
    root: Path      # .../nvidia/cu13
    version: str    # the CUDA minor, e.g. "13.2"

    @property
    def nvcc(self) -> Path:
        return self.root / "bin" / "nvcc"

    @property
    def cuobjdump(self) -> Path:
        return self.root / "bin" / "cuobjdump"

    def release(self) -> str:
        out = subprocess.run([str(self.nvcc), "--version"], capture_output=True, text=True, check=True).stdout
        return re.search(r"release ([0-9.]+)", out).group(1)


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "imagebuild-tests"


def toolchain(version: str, *, cuobjdump: bool = True) -> Toolchain:
    """The CUDA ``version`` (major.minor) toolchain wheels, installed once (atomically) per host.
    ``cuobjdump=False`` for a minor that has no cuobjdump wheel (13.0, 13.1: the first is 13.2);
    a newer minor's cuobjdump reads its files."""
    dest = cache_dir() / f"cuda-{version}"
    major = version.split(".")[0]
    tc = Toolchain(dest / "nvidia" / f"cu{major}", version)
    if tc.nvcc.is_file() and (tc.cuobjdump.is_file() or not cuobjdump):
        return tc
    packages = [p for p in PACKAGES if cuobjdump or p != "nvidia-cuda-cuobjdump"]
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".cuda-{version}.", dir=dest.parent))
    try:
        res = subprocess.run(
            [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-deps",
             "--only-binary", ":all:", "--target", str(tmp), *(f"{p}=={version}.*" for p in packages)],
            capture_output=True, text=True, timeout=900)
        if res.returncode != 0:
            tail = [ln for ln in res.stderr.splitlines() if "is ignored" not in ln][-3:]
            _unavailable(f"cannot install the CUDA {version} toolchain wheels from the configured index: "
                         + " | ".join(tail))
        if dest.exists():  # another process won the race
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            os.replace(tmp, dest)
    finally:
        if tmp.exists() and tmp != dest:
            shutil.rmtree(tmp, ignore_errors=True)
    assert tc.nvcc.is_file(), f"{tc.nvcc}: the nvcc wheel has another layout"
    return tc


def torch_gencode(arch_list: str) -> str:
    """The -gencode flags torch gives for a TORCH_CUDA_ARCH_LIST (entries split on ; or space)."""
    flags = []
    for entry in re.split(r"[;\s]+", arch_list.strip()):
        base = entry.removesuffix("+PTX").replace(".", "")
        flags.append(f"-gencode arch=compute_{base},code=sm_{base}")
        if entry.endswith("+PTX"):
            flags.append(f"-gencode arch=compute_{base},code=compute_{base}")
    return " ".join(flags)


def enclosing_if(text: str, needle: str, *, file: str = "CMakeLists.txt") -> str:
    """The innermost ``if(...) ... endif()`` block of ``text`` around the first line holding ``needle``."""
    lines = text.splitlines()
    at = next((i for i, ln in enumerate(lines) if needle in ln), None)
    assert at is not None, f"{file}: no line holds {needle!r}"
    stack, best = [], None
    for i, ln in enumerate(lines):
        s = ln.strip().lower()
        if re.match(r"if\s*\(", s):
            stack.append(i)
        elif re.match(r"endif\s*\(", s) and stack:
            start = stack.pop()
            if start <= at <= i and (best is None or i - start < best[1] - best[0]):
                best = (start, i)
    assert best is not None, f"{file}: the line holding {needle!r} is in no if() block"
    return "\n".join(lines[best[0]: best[1] + 1])


def cuobjdump() -> Path:
    """The cuobjdump of CUOBJDUMP_MINOR's wheel (installed with that toolchain)."""
    return toolchain(CUOBJDUMP_MINOR).cuobjdump


def statement(text: str, needle: str, *, file: str = "CMakeLists.txt") -> str:
    """The whole CMake command (its parentheses balanced) that starts on the first line holding ``needle``."""
    lines = text.splitlines()
    at = next((i for i, ln in enumerate(lines) if needle in ln), None)
    assert at is not None, f"{file}: no line holds {needle!r}"
    depth, out = 0, []
    for ln in lines[at:]:
        out.append(ln)
        depth += ln.count("(") - ln.count(")")
        if depth <= 0:
            break
    return "\n".join(out)


@dataclass(frozen=True)
class Arches:
    cuda_archs: list[str]   # after the supported-arch filter
    fp4_archs: list[str]    # the NVFP4 kernels'
    gencode: list[str]      # the NVFP4 kernels' -gencode flags (each "-gencode arch=...,code=...")


def vllm_arches(tree: Path, arch_list: str, cuda_version: str, work: Path) -> Arches:
    """Run the tree's own CMake for ``arch_list`` and a CUDA ``cuda_version`` compiler."""
    cm = (tree / "CMakeLists.txt").read_text(encoding="utf-8")
    blocks = [enclosing_if(cm, "set(CUDA_SUPPORTED_ARCHS"),
              enclosing_if(cm, "clear_cuda_arches(CUDA_ARCH_FLAGS)"),
              enclosing_if(cm, "cuda_archs_loose_intersection(FP4_ARCHS")]
    src = work / "src"
    src.mkdir(parents=True, exist_ok=True)
    utils = (tree / "cmake" / "utils.cmake").resolve()
    (src / "CMakeLists.txt").write_text("\n".join([
        "cmake_minimum_required(VERSION 3.22)",
        "project(vllm_arch_selection LANGUAGES NONE)",
        f'include("{utils}")',
        f"set(CMAKE_CUDA_COMPILER_VERSION {cuda_version})",
        f'set(CMAKE_CUDA_FLAGS "{torch_gencode(arch_list)}")',
        'set(VLLM_GPU_LANG "CUDA")',
        *blocks,
        'set_gencode_flags_for_srcs(SRCS probe.cu CUDA_ARCHS "${FP4_ARCHS}")',
        "get_property(_opts SOURCE probe.cu PROPERTY COMPILE_OPTIONS)",
        'file(WRITE "${CMAKE_BINARY_DIR}/arches.txt"',
        '  "CUDA_ARCHS=${CUDA_ARCHS}\\nFP4_ARCHS=${FP4_ARCHS}\\nGENCODE=${_opts}\\n")',
    ]) + "\n")
    build = work / "build"
    res = subprocess.run(["cmake", "-S", str(src), "-B", str(build)], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr
    out = dict(ln.split("=", 1) for ln in (build / "arches.txt").read_text().splitlines() if "=" in ln)
    gencode = [f"-gencode arch={a},code={c}" for a, c in re.findall(r"arch=(compute_\w+),code=(\w+)", out["GENCODE"])]
    split = lambda v: [x for x in v.split(";") if x]  # noqa: E731
    return Arches(split(out["CUDA_ARCHS"]), split(out["FP4_ARCHS"]), gencode)


@dataclass(frozen=True)
class FA2Arches:
    cuda_archs: list[str]   # CUDA_ARCHS after flash-attention's own filter
    fa2_archs: list[str]    # FA2_ARCHS
    gencode: list[str]      # the -gencode flags of the FA2 sources


def fa2_arches(fa_tree: Path, cuda_archs: list[str], cuda_version: str, work: Path) -> FA2Arches:
    """Run flash-attention's own CMake statements for the CUDA_ARCHS vLLM hands it (vLLM sets
    CUDA_ARCHS before FetchContent_MakeAvailable, so FA's ``if (NOT CUDA_ARCHS)`` keeps it)."""
    cm = (fa_tree / "CMakeLists.txt").read_text(encoding="utf-8")
    blocks = [statement(cm, 'set(CUDA_SUPPORTED_ARCHS'),
              enclosing_if(cm, 'list(APPEND CUDA_SUPPORTED_ARCHS'),
              statement(cm, "cuda_archs_loose_intersection(CUDA_ARCHS"),
              statement(cm, "cuda_archs_loose_intersection(FA2_ARCHS")]
    src = work / "src"
    src.mkdir(parents=True, exist_ok=True)
    utils = (fa_tree / "cmake" / "utils.cmake").resolve()
    (src / "CMakeLists.txt").write_text("\n".join([
        "cmake_minimum_required(VERSION 3.22)",
        "project(fa2_arch_selection LANGUAGES NONE)",
        f'include("{utils}")',
        f"set(CMAKE_CUDA_COMPILER_VERSION {cuda_version})",
        f'set(CUDA_ARCHS "{";".join(cuda_archs)}")',
        'set(VLLM_GPU_LANG "CUDA")',
        *blocks,
        'set_gencode_flags_for_srcs(SRCS probe.cu CUDA_ARCHS "${FA2_ARCHS}")',
        "get_property(_opts SOURCE probe.cu PROPERTY COMPILE_OPTIONS)",
        'file(WRITE "${CMAKE_BINARY_DIR}/arches.txt"',
        '  "CUDA_ARCHS=${CUDA_ARCHS}\\nFA2_ARCHS=${FA2_ARCHS}\\nGENCODE=${_opts}\\n")',
    ]) + "\n")
    build = work / "build"
    res = subprocess.run(["cmake", "-S", str(src), "-B", str(build)], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr
    out = dict(ln.split("=", 1) for ln in (build / "arches.txt").read_text().splitlines() if "=" in ln)
    gencode = [f"-gencode arch={a},code={c}" for a, c in re.findall(r"arch=(compute_\w+),code=(\w+)", out["GENCODE"])]
    split = lambda v: [x for x in v.split(";") if x]  # noqa: E731
    return FA2Arches(split(out["CUDA_ARCHS"]), split(out["FA2_ARCHS"]), gencode)


def compile_so(tc: Toolchain, gencode: list[str], out: Path, source: str = PROBE_CU) -> Path:
    """``source`` (PROBE_CU) compiled with ``gencode`` into the shared object ``out``."""
    assert gencode, "no -gencode flag: the tree selected no architecture for these kernels"
    out.parent.mkdir(parents=True, exist_ok=True)
    cu = out.with_suffix(".cu")
    cu.write_text(source)
    flags = [f for g in gencode for f in g.split(" ", 1)]
    # -L: the 13.0 wheels' nvcc.profile links from lib64, the wheels install lib (13.2's names lib)
    res = subprocess.run([str(tc.nvcc), "-shared", "-Xcompiler", "-fPIC", f"-L{tc.root / 'lib'}", *flags,
                          "-o", str(out), str(cu)], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, f"nvcc {' '.join(flags)}: {res.stderr[-2000:]}"
    cu.unlink()
    return out
