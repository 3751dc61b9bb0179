"""The cheap parts of scripts/kernels.py (`make kernels`), without its downloads or compiles: what it
takes from pip's config, which CUDA minor it reads off torch's metadata, the stand-in files it makes
for the tree's fetched dependencies, and how it reads CMake's per-source architecture choice."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[3] / "scripts" / "kernels.py"


@pytest.fixture(scope="module")
def kernels():
    spec = importlib.util.spec_from_file_location("_kernels_script", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up there
    try:
        spec.loader.exec_module(mod)
        yield mod
    finally:
        sys.modules.pop(spec.name, None)


def test_pip_index_args_keep_index_and_cert_only(kernels):
    listing = "\n".join([
        ":env:.cert='/etc/ssl/certs/ca.crt'",
        ":env:.find-links='/opt/wheels'",
        "global.constraint='/etc/xdg/pip/constraints.txt'",
        "global.extra-index-url='file:///srv/a/simple file:///srv/b/simple'",
        "global.index-url='http://127.0.0.1:9/simple'",
    ])
    assert kernels.pip_index_args(listing) == [
        "--index-url", "http://127.0.0.1:9/simple",
        "--extra-index-url", "file:///srv/a/simple", "--extra-index-url", "file:///srv/b/simple",
        "--cert", "/etc/ssl/certs/ca.crt"]
    assert kernels.pip_index_args("") == []


def test_clean_pip_env_drops_find_links_and_constraints(kernels, monkeypatch):
    monkeypatch.setenv("PIP_FIND_LINKS", "/opt/wheels")
    monkeypatch.setenv("PIP_CONSTRAINT", "/x")
    monkeypatch.setenv("PIP_DEFAULT_TIMEOUT", "180")
    env = kernels.clean_pip_env()
    assert "PIP_FIND_LINKS" not in env and "PIP_CONSTRAINT" not in env
    assert env["PIP_DEFAULT_TIMEOUT"] == "180"
    assert env["PIP_CONFIG_FILE"] == os.devnull


def test_toolchain_pin_is_torchs_cuda_toolkit(kernels):
    # torch 2.13.0's x86_64 wheel metadata, as pip reports it (requires_dist)
    requires = ['filelock', 'cuda-toolkit[cublas,cudart,cufft,cufile,cupti,curand,cusolver,cusparse,nvjitlink,'
                'nvrtc,nvtx]==13.0.3; platform_system == "Linux"',
                'nvidia-cudnn-cu13==9.20.0.48; platform_system == "Linux"']
    assert kernels.toolchain_pin(requires) == "13.0.3"
    with pytest.raises(SystemExit, match="is it a CUDA build"):
        kernels.toolchain_pin(["filelock", "sympy>=1.13"])


def test_standins_hold_the_files_the_trees_cmake_names(kernels, tmp_path):
    tree = tmp_path / "trees" / "patched" / "vllm"
    (tree / "cmake" / "external_projects").mkdir(parents=True)
    (tree / "CMakeLists.txt").write_text("FetchContent_MakeAvailable(cutlass)\n")
    (tree / "cmake" / "external_projects" / "flashmla.cmake").write_text(
        'file(READ "${flashmla_SOURCE_DIR}/flash_mla/flash_mla_interface.py" X)\n'
        "set(S ${flashmla_SOURCE_DIR}/csrc/torch_api.cpp)\n")
    (tree / "cmake" / "external_projects" / "qutlass.cmake").write_text(
        'if(EXISTS "${qutlass_SOURCE_DIR}/qutlass/third_party/cutlass/include/cutlass/cutlass.h")\n')
    dirs = kernels.standins(tmp_path, tree)
    assert set(dirs) == {v for v, _n, _w in kernels.STANDINS} | {"VLLM_FLASH_ATTN_SRC_DIR"}
    assert dirs["VLLM_FLASH_ATTN_SRC_DIR"] == tmp_path / "trees" / "flash-attention"  # the real tree, not a stand-in
    assert dirs["FLASH_MLA_SRC_DIR"] == tmp_path / "standins" / "patched" / "flashmla"
    made = sorted(str(p.relative_to(tmp_path / "standins" / "patched"))
                  for p in (tmp_path / "standins").rglob("*") if p.is_file())
    assert made == ["flashmla/csrc/torch_api.cpp", "flashmla/flash_mla/flash_mla_interface.py",
                    "qutlass/qutlass/third_party/cutlass/include/cutlass/cutlass.h"]
    assert all(p.stat().st_size == 0 for p in (tmp_path / "standins").rglob("*") if p.is_file())
    assert not any(dirs["VLLM_CUTLASS_SRC_DIR"].iterdir())


def _cmd(target: str, src: str, codes: list[str]) -> dict:
    gen = " ".join(f"-gencode arch={c.replace('sm_', 'compute_')},code={c}" for c in codes)
    out = f"/b/CMakeFiles/{target}.dir/{src}.o"
    return {"file": f"/w/trees/patched/vllm/{src}", "output": out,
            "command": f"nvcc -DX {gen} -x cu -c /w/trees/patched/vllm/{src} -o {out}"}


def test_selection_reads_cmakes_per_source_targets(kernels, tmp_path):
    (tmp_path / "compile_commands.json").write_text(json.dumps([
        _cmd("_C", "csrc/nvfp4_kv_cache_kernels.cu", ["sm_121a"]),
        _cmd("_C", "csrc/cache_kernels.cu", ["sm_121a"]),
        {**_cmd("_C", "csrc/quantization/marlin/marlin.cu", []),
         "command": "nvcc -gencode arch=compute_80,code=sm_80 -gencode arch=compute_80,code=compute_80 "
                    "-c /w/trees/patched/vllm/csrc/quantization/marlin/marlin.cu -o x"},
        _cmd("_C", "csrc/torch_bindings.cpp", []),      # C++: no -gencode, not counted
    ]))
    sel = kernels.selection(tmp_path)
    assert sel == {"_C": {("sm_121a",): ["csrc/nvfp4_kv_cache_kernels.cu", "csrc/cache_kernels.cu"],
                          ("compute_80", "sm_80"): ["csrc/quantization/marlin/marlin.cu"]}}
    [line] = kernels.selection_lines(sel, {"sm_121a", "sm_121f"})
    assert line == ("_C: 3 CUDA sources, 2 within the gate's targets; outside them: "
                    "1 compute_80+sm_80 (e.g. csrc/quantization/marlin/marlin.cu)")


def test_object_of_gives_ninjas_relative_path_and_the_flags(kernels, tmp_path):
    c = _cmd("_C", "csrc/nvfp4_kv_cache_kernels.cu", ["sm_121a"])
    c["output"] = str(tmp_path / "CMakeFiles/_C.dir/csrc/nvfp4_kv_cache_kernels.cu.o")
    (tmp_path / "compile_commands.json").write_text(json.dumps([c]))
    assert kernels.object_of(tmp_path, "_C", "csrc/nvfp4_kv_cache_kernels.cu") == (
        "CMakeFiles/_C.dir/csrc/nvfp4_kv_cache_kernels.cu.o", ["-gencode arch=compute_121a,code=sm_121a"])
    with pytest.raises(SystemExit, match="no compile line"):
        kernels.object_of(tmp_path, "_C_stable_libtorch", "csrc/nvfp4_kv_cache_kernels.cu")
