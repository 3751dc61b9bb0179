"""glm53's vllm-cuda-targets check, as glm53 runs it, on small real kernels in the shapes of a vLLM
package (tests/cudakernels.py: PyPI's toolchain wheels, the architectures chosen by the real trees'
own CMake):

- ``vllm_flash_attn/_vllm_fa2_C.abi3.so``: an FA2-shaped kernel compiled for what flash-attention
  bce29425's own CMake gives a 12.1a build (FA2_ARCHS "8.0+PTX": sm_80 + compute_80);
- ``_C.abi3.so``: an NVFP4-shaped kernel compiled for what vLLM's CMake gives it (sm_121a with
  patch_vllm_preserve_sm12x_target.py, sm_120f without: the collapse to the 12.0 family).

With the image's own toolkit (CUDA_BASE's minor, 13.0) the FA2 library built per its own list
passes; the collapsed NVFP4 library fails; FA2's PTX from a newer toolkit (13.2: PTX ISA 9.2) fails
for the nodes' R580 driver (CUDA 13.0: PTX ISA up to 9.0), the message naming the library and both
versions; a library that should carry sm_121a and does not fails, and so does a target nobody asked
for. The PTX ISA versions are read by the check itself with the real cuobjdump (-ptx).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from imagebuild.definition import gatespec, patching
from imagebuild.definition import reader as definition
from imagebuild.gate import checks
from tests import cudakernels, realtrees
from tests.conftest import DEBIAN, run_cli

ROOT = Path(__file__).resolve().parents[3]
IMAGE = "glm53-jovian-r12"
PATCH = ROOT / "patches-eugr" / "patch_vllm_preserve_sm12x_target.py"
NEWER = "13.2"  # a toolkit newer than the nodes' driver takes (FACTS: nvcc 13.2.78 writes .version 9.2)
FA2 = "vllm_flash_attn/_vllm_fa2_C.abi3.so"


@pytest.fixture(scope="module")
def glm53():
    return definition.load(ROOT, IMAGE)


@pytest.fixture(scope="module")
def image_minor(glm53) -> str:
    m = re.search(r":(\d+)\.(\d+)\.", glm53.env.get("CUDA_BASE") or "")
    assert m, f"CUDA_BASE {glm53.env.get('CUDA_BASE')!r}: no CUDA version in its tag"
    return f"{m.group(1)}.{m.group(2)}"


@pytest.fixture(scope="module")
def check(glm53):
    spec = gatespec.load(glm53.dir / "gate.yaml")
    [c] = [c for c in spec.checks if c.kind == "cuda-targets"]
    return c


@pytest.fixture(scope="module")
def built(tmp_path_factory, glm53, image_minor):
    """{name: shared object}: the kernels of every case, compiled once."""
    work = tmp_path_factory.mktemp("ptx")
    vllm = realtrees.extract(realtrees.VLLM, work / "plain")
    patched = work / "patched" / "vllm"
    shutil.copytree(vllm, patched, symlinks=True)
    [res] = patching.apply_all([PATCH], patched)
    assert res.outcome == patching.APPLIED, res.as_dict()
    fa = realtrees.extract(realtrees.FLASH_ATTN, work / "fa")
    arch_list = glm53.env.get("TORCH_CUDA_ARCH_LIST")
    good = cudakernels.vllm_arches(patched, arch_list, image_minor, work / "cm-good")
    collapsed = cudakernels.vllm_arches(vllm, arch_list, image_minor, work / "cm-collapsed")
    fa2 = cudakernels.fa2_arches(fa, good.cuda_archs, image_minor, work / "cm-fa2")
    # flash-attention's own list for a 12.x build, as its README says (CMakeLists.txt:140)
    assert fa2.fa2_archs == ["8.0+PTX"], fa2
    assert fa2.gencode == ["-gencode arch=compute_80,code=sm_80", "-gencode arch=compute_80,code=compute_80"]
    assert collapsed.gencode == ["-gencode arch=compute_120f,code=sm_120f"], collapsed
    tc = cudakernels.toolchain(image_minor, cuobjdump=False)
    assert tc.release() == image_minor
    newer = cudakernels.toolchain(NEWER)
    out = work / "so"
    so = {
        "nvfp4-good": cudakernels.compile_so(tc, good.gencode, out / "nvfp4-good.so"),
        "nvfp4-collapsed": cudakernels.compile_so(tc, collapsed.gencode, out / "nvfp4-collapsed.so"),
        # an NVFP4-shaped library built for FA2's list: no sm_121a where it must have it
        "nvfp4-no-sm121a": cudakernels.compile_so(tc, fa2.gencode, out / "nvfp4-no-sm121a.so"),
        "fa2": cudakernels.compile_so(tc, fa2.gencode, out / "fa2.so", cudakernels.FA2_CU),
        "fa2-newer": cudakernels.compile_so(newer, fa2.gencode, out / "fa2-newer.so", cudakernels.FA2_CU),
        "fa2-extra": cudakernels.compile_so(tc, [*fa2.gencode, "-gencode arch=compute_90,code=sm_90"],
                                            out / "fa2-extra.so", cudakernels.FA2_CU),
    }
    return so


def _package(tmp: Path, nvfp4: Path, fa2: Path) -> Path:
    pkg = tmp / "vllm"
    (pkg / "vllm_flash_attn").mkdir(parents=True)
    shutil.copy(nvfp4, pkg / "_C.abi3.so")
    shutil.copy(fa2, pkg / FA2)
    return pkg


def _gate(check, folder: Path) -> tuple[bool, str, list[str]]:
    """glm53's check as glm53 runs it, on ``folder``: only the folder, the cuobjdump (the wheel's,
    as the image's own is /usr/local/cuda/bin) and the kernel names (the probes') differ."""
    import testinfra

    params = {k: v for k, v in check.params.items() if k != "module"}
    params.update(path=str(folder), cuobjdump=str(cudakernels.cuobjdump()),
                  kernels=["nvfp4_probe_dequant"])
    log: list[str] = []
    ctx = checks.Context(testinfra.get_host("local://"), "python3", {}, log.append)
    try:
        return True, checks.check_cuda_targets(ctx, gatespec.Check(check.id, check.kind, params)), log
    except checks.CheckFailed as exc:
        return False, exc.detail, log


def test_glm53_states_the_nodes_driver_and_fa2s_own_list(check):
    assert check.params["driver"] == {"name": "R580", "cuda": "13.0", "ptx_isa": "9.0"}
    [lib] = check.params["libraries"]
    assert lib["files"] == "vllm_flash_attn/_vllm_fa2_C*.so" and lib["targets"] == ["sm_80", "compute_80"]


def test_fa2_built_per_its_own_list_passes(built, check, tmp_path):
    ok, detail, log = _gate(check, _package(tmp_path, built["nvfp4-good"], built["fa2"]))
    assert ok, detail
    assert "SASS sm_121a, sm_80; PTX compute_80" in detail
    assert "vllm_flash_attn/_vllm_fa2_C*.so: 1 file(s), sm_80+compute_80 as its build asks" in detail
    assert "PTX ISA 9.0, driver R580 (CUDA 13.0) takes up to 9.0" in detail
    assert any(line.rstrip().endswith(f"{FA2}: SASS sm_80; PTX compute_80; PTX ISA compute_80=9.0; 1 kernels")
               for line in log), log


def test_nvfp4_collapsed_to_12_0_fails(built, check, tmp_path):
    ok, detail, _ = _gate(check, _package(tmp_path, built["nvfp4-collapsed"], built["fa2"]))
    assert not ok
    assert "unexpected target sm_120f in 1 file(s), e.g. " in detail and "/vllm/_C.abi3.so" in detail
    assert "required target sm_121a is in no file" in detail


def test_fa2_ptx_from_a_newer_toolkit_than_the_driver_takes_fails(built, check, tmp_path):
    pkg = _package(tmp_path, built["nvfp4-good"], built["fa2-newer"])
    ok, detail, _ = _gate(check, pkg)
    assert not ok
    assert (f"1 PTX image(s) that driver R580 (CUDA 13.0) cannot JIT, as it takes PTX ISA up to 9.0: "
            f"{pkg / FA2} (compute_80) is PTX ISA 9.2") in detail, detail
    # what cuobjdump itself extracts from that library: the PTX text's own .version
    ptx = subprocess.run([str(cudakernels.cuobjdump()), "-ptx", str(pkg / FA2)], capture_output=True,
                         text=True, check=True).stdout
    assert re.search(r"^\.version 9\.2$", ptx, re.M) and re.search(r"^\.target sm_80$", ptx, re.M)


def test_a_library_without_its_sm_121a_fails(built, check, tmp_path):
    ok, detail, _ = _gate(check, _package(tmp_path, built["nvfp4-no-sm121a"], built["fa2"]))
    assert not ok
    assert re.search(r"1 file\(s\) carry no SASS for sm_121a, sm_121f, e\.g\. \S+/vllm/_C\.abi3\.so", detail), detail


def test_a_target_nobody_asked_for_fails(built, check, tmp_path):
    ok, detail, _ = _gate(check, _package(tmp_path, built["nvfp4-good"], built["fa2-extra"]))
    assert not ok
    assert re.search(r"unexpected target sm_90 in 1 file\(s\), e\.g\. \S+/vllm_flash_attn/_vllm_fa2_C\.abi3\.so",
                     detail), detail


@pytest.mark.engine
def test_gate_in_a_container_refuses_ptx_the_driver_cannot_jit(engine_ready, built, check, tmp_path, monkeypatch):
    """`imagebuild gate` on a real container: the PTX pass runs with the image's own sh and grep."""
    monkeypatch.setenv("IMAGEBUILD_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("IMAGEBUILD_NO_GPU", "1")
    p = check.params
    [lib] = p["libraries"]
    spec = tmp_path / "gate.yaml"
    spec.write_text("\n".join([
        "checks:", "  - id: vllm-cuda-targets", "    kind: cuda-targets", "    module: vllm",
        f"    sass: {p['sass']}", f"    require: {p['require']}", "    kernels: [nvfp4_probe_dequant]",
        f"    driver: {{name: {p['driver']['name']}, cuda: \"{p['driver']['cuda']}\"}}",
        "    libraries:", f"      - files: {lib['files']}", f"        targets: {lib['targets']}",
        "        why: flash-attention CMakeLists.txt:140"]) + "\n")
    codes = {}
    for name, fa2 in (("good", built["fa2"]), ("newer", built["fa2-newer"])):
        ctx = tmp_path / name
        _package(ctx, built["nvfp4-good"], fa2)
        (ctx / "vllm" / "__init__.py").write_text("")
        shutil.copy(cudakernels.cuobjdump(), ctx / "cuobjdump")
        (ctx / "Dockerfile").write_text(f"FROM {DEBIAN}\nCOPY vllm/ /usr/lib/python3/dist-packages/vllm/\n"
                                        "COPY cuobjdump /usr/local/cuda/bin/cuobjdump\n")
        tag = f"imagebuild-test/cuda-ptx:{name}"
        subprocess.run(["docker", "buildx", "build", "--network", "none", "--load", "-q", "-t", tag, str(ctx)],
                       check=True, capture_output=True)
        try:
            r = run_cli("gate", tag, "--spec", str(spec))
        finally:
            subprocess.run(["docker", "image", "rm", "-f", tag], capture_output=True)
        codes[name] = (r.code, r.out + r.err)
    assert codes["good"][0] == 0, codes["good"][1]
    assert codes["newer"][0] == 4, codes["newer"][1]
    assert ("/usr/lib/python3/dist-packages/vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so (compute_80) is PTX ISA 9.2"
            in codes["newer"][1]), codes["newer"][1]
