"""Real kernels, compiled here: the gate's cuda-targets check against device code that the real
vLLM tree's own CMake chose the architectures of (tests/cudakernels.py says how).

For glm53-jovian-r12's TORCH_CUDA_ARCH_LIST and CUDA minor, with the CUDA toolchain wheels from
PyPI and the 28be48fa tree from ../shared/upstream:
- the tree with patch_vllm_preserve_sm12x_target.py applied compiles its NVFP4 kernels for
  sm_121a, and the image's own cuda-targets check passes on the result;
- the unpatched tree collapses 12.1a to the 12.0 family (sm_120f), and a 12.0 build gives sm_120f
  too: the same check fails on both, naming the unexpected target and the missing sm_121a;
- through `imagebuild gate` in a real container (Debian with the toolchain's cuobjdump as
  /usr/local/cuda/bin/cuobjdump, the package found by `module: vllm`): exit 0 for the sm_121a object, exit 4 for the 12.0 one.
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


@pytest.fixture(scope="module")
def glm53():
    return definition.load(ROOT, IMAGE)


@pytest.fixture(scope="module")
def cuda_minor(glm53) -> str:
    base = glm53.env.get("CUDA_BASE")
    m = re.search(r":(\d+)\.(\d+)\.", base or "")
    assert m, f"CUDA_BASE {base!r}: no CUDA version in its tag"
    return f"{m.group(1)}.{m.group(2)}"


@pytest.fixture(scope="module")
def tc(cuda_minor):
    tc = cudakernels.toolchain(cuda_minor, cuobjdump=False)  # 13.0 has no cuobjdump wheel: cudakernels.cuobjdump()
    assert tc.release() == cuda_minor
    return tc


@pytest.fixture(scope="module")
def trees(tmp_path_factory):
    """(unpatched, patched) copies of the real vLLM tree."""
    base = tmp_path_factory.mktemp("vllm-trees")
    plain = realtrees.extract(realtrees.VLLM, base / "plain")
    patched = base / "patched" / "vllm"
    patched.parent.mkdir()
    shutil.copytree(plain, patched, symlinks=True)
    [res] = patching.apply_all([PATCH], patched)
    assert res.outcome == patching.APPLIED, res.as_dict()
    return plain, patched


@pytest.fixture(scope="module")
def spec_check(glm53):
    """glm53's own cuda-targets check, pointed at a folder of the test (its kernels regex set to
    the probe's, since the probe is not vLLM's FP4 code)."""
    spec = gatespec.load(glm53.dir / "gate.yaml")
    [check] = [c for c in spec.checks if c.kind == "cuda-targets"]
    return check


def _without_module(params: dict) -> dict:
    return {k: v for k, v in params.items() if k != "module"}


def _check_here(check, folder: Path, tc) -> tuple[bool, str]:
    import testinfra

    params = {**_without_module(check.params), "path": str(folder), "cuobjdump": str(cudakernels.cuobjdump()),
              "kernels": ["nvfp4_probe_dequant"]}
    c = gatespec.Check(check.id, check.kind, params)
    log: list[str] = []
    ctx = checks.Context(testinfra.get_host("local://"), "python3", {}, log.append)
    try:
        return True, checks.check_cuda_targets(ctx, c)
    except checks.CheckFailed as exc:
        return False, exc.detail


def test_the_real_tree_selects_sm_121a_only_when_patched(trees, glm53, cuda_minor, tmp_path):
    plain, patched = trees
    arch_list = glm53.env.get("TORCH_CUDA_ARCH_LIST")
    assert arch_list == "12.1a"
    good = cudakernels.vllm_arches(patched, arch_list, cuda_minor, tmp_path / "patched")
    assert good.cuda_archs == ["12.1a"] and good.fp4_archs == ["12.1a"], good
    assert good.gencode == ["-gencode arch=compute_121a,code=sm_121a"]
    bad = cudakernels.vllm_arches(plain, arch_list, cuda_minor, tmp_path / "plain")
    assert bad.cuda_archs == ["12.0"] and bad.fp4_archs == ["12.0f"], bad
    assert bad.gencode == ["-gencode arch=compute_120f,code=sm_120f"]


def test_sm_121a_kernels_pass_and_12_0_builds_fail_the_images_check(trees, glm53, cuda_minor, tc,
                                                                     spec_check, tmp_path):
    plain, patched = trees
    arch_list = glm53.env.get("TORCH_CUDA_ARCH_LIST")
    builds = {
        "patched-12.1a": cudakernels.vllm_arches(patched, arch_list, cuda_minor, tmp_path / "a"),
        "unpatched-12.1a": cudakernels.vllm_arches(plain, arch_list, cuda_minor, tmp_path / "b"),
        "patched-12.0": cudakernels.vllm_arches(patched, "12.0", cuda_minor, tmp_path / "c"),
    }
    results = {}
    for name, arches in builds.items():
        so = cudakernels.compile_so(tc, arches.gencode, tmp_path / name / "vllm" / "_C_stable_libtorch.abi3.so")
        (so.parent / "notcuda.so").write_bytes(Path("/bin/true").read_bytes())  # an ELF without device code
        results[name] = _check_here(spec_check, so.parent, tc)
    ok, detail = results["patched-12.1a"]
    assert ok, detail
    assert "1 CUDA ELF(s), 1 without device code; SASS sm_121a; PTX none" in detail
    for name in ("unpatched-12.1a", "patched-12.0"):
        ok, detail = results[name]
        assert not ok, (name, detail)
        assert "unexpected target sm_120f" in detail and "required target sm_121a is in no file" in detail


def test_kernels_compiled_out_fail(trees, glm53, cuda_minor, tc, spec_check, tmp_path):
    arches = cudakernels.vllm_arches(trees[1], glm53.env.get("TORCH_CUDA_ARCH_LIST"), cuda_minor, tmp_path / "a")
    folder = cudakernels.compile_so(tc, arches.gencode, tmp_path / "lib" / "k.so").parent
    import testinfra

    params = {**_without_module(spec_check.params), "path": str(folder), "cuobjdump": str(cudakernels.cuobjdump()),
              "kernels": ["cvt_fp16_to_fp4"]}  # vLLM's NVFP4 quantizer: not in the probe
    ctx = checks.Context(testinfra.get_host("local://"), "python3", {}, lambda s: None)
    with pytest.raises(checks.CheckFailed, match=r"no kernel matches /cvt_fp16_to_fp4/ \(of 1 kernels\)"):
        checks.check_cuda_targets(ctx, gatespec.Check("fp4", "cuda-targets", params))


@pytest.mark.engine
def test_gate_in_a_container_reads_the_targets(engine_ready, trees, glm53, cuda_minor, tc, spec_check,
                                               tmp_path, monkeypatch):
    monkeypatch.setenv("IMAGEBUILD_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("IMAGEBUILD_NO_GPU", "1")
    arch_list = glm53.env.get("TORCH_CUDA_ARCH_LIST")
    lines = ["checks:", "  - id: vllm-cuda-targets", "    kind: cuda-targets",
             "    module: vllm", f"    sass: {spec_check.params['sass']}",
             f"    require: {spec_check.params['require']}", "    kernels: [nvfp4_probe_dequant]"]
    spec = tmp_path / "gate.yaml"
    spec.write_text("\n".join(lines) + "\n")
    codes = {}
    for name, tree, archs in (("good", trees[1], arch_list), ("sm120", trees[1], "12.0")):
        arches = cudakernels.vllm_arches(tree, archs, cuda_minor, tmp_path / name / "cmake")
        ctx = tmp_path / name / "ctx"
        cudakernels.compile_so(tc, arches.gencode, ctx / "vllm" / "_C.abi3.so")
        (ctx / "vllm" / "__init__.py").write_text("")
        shutil.copy(cudakernels.cuobjdump(), ctx / "cuobjdump")
        (ctx / "Dockerfile").write_text(f"FROM {DEBIAN}\nCOPY vllm/ /usr/lib/python3/dist-packages/vllm/\n"
                                        "COPY cuobjdump /usr/local/cuda/bin/cuobjdump\n")
        tag = f"imagebuild-test/cuda-targets:{name}"
        subprocess.run(["docker", "buildx", "build", "--network", "none", "--load", "-q", "-t", tag, str(ctx)],
                       check=True, capture_output=True)
        try:
            r = run_cli("gate", tag, "--spec", str(spec))
        finally:
            subprocess.run(["docker", "image", "rm", "-f", tag], capture_output=True)
        codes[name] = (r.code, r.out + r.err)
    assert codes["good"][0] == 0, codes["good"][1]
    assert "/usr/lib/python3/dist-packages/vllm: 1 CUDA ELF(s)" in codes["good"][1]
    assert "by /usr/local/cuda/bin/cuobjdump" in codes["good"][1]
    assert codes["sm120"][0] == 4, codes["sm120"][1]
    assert "unexpected target sm_120f" in codes["sm120"][1]
