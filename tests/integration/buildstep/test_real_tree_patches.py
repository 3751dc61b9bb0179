"""Every patch (patches-eugr/ and both real images') checked against the real vLLM tree.

The tree is the public snapshot ../shared/upstream/vllm-28be48fa.tar.gz (local-inference-lab/vllm
at 28be48fa, 2026-05-24), extracted here. The real images pin a newer base (54f6e98 + PRs, not
public here), so the expected outcome of each patch on this snapshot is recorded below, with why:

  would-apply   the anchor is there once: the patch applies;
  not-needed    upstream already has the change (the patch's upstream string is there);
  failed        the snapshot has the code the patch repairs in another shape: the patch fails, naming
                its anchor (the build would stop there; prefetch warns);
  not-applicable  the snapshot does not have the code the patch targets (a file, or the regression
                the patch repairs, came later): the patch declares what it repairs (its file, its
                ``applies_if`` strings) and skips with the reason, as eugr's originals do. The test
                also proves the absence itself from the snapshot's files, so a real drift cannot
                hide behind this label (a drifted shape still fails: test_patch_shapes.py).

The checks go through `imagebuild patch IMAGE --src TREE --check [--stage STAGE] --json` (the same
primitive the build ships), which reports every patch, and through the primitive's own CLI per
patch.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from imagebuild.definition import patching
from imagebuild.definition import reader as definition
from tests import realtrees
from tests.conftest import run_cli

ROOT = realtrees.ROOT


@dataclass(frozen=True)
class Expect:
    outcome: str  # would-apply | not-needed | not-applicable | failed
    why: str
    # "not-applicable": True when the snapshot lacks the target; "failed": True when it has another shape
    proof: Callable[[Path], bool] | None = None


def _missing(rel: str) -> Callable[[Path], bool]:
    return lambda tree: not (tree / rel).exists()


def _lacks(rel: str, text: str) -> Callable[[Path], bool]:
    return lambda tree: (tree / rel).is_file() and text not in (tree / rel).read_text()


def _func_lacks(rel: str, func: str, text: str) -> Callable[[Path], bool]:
    def proof(tree: Path) -> bool:
        src = (tree / rel).read_text()
        start = src.index(f"def {func}(")
        end = src.find("\ndef ", start + 1)
        return text not in src[start:end if end > 0 else None]
    return proof


EUGR = "patches-eugr/"
EXPECTED: dict[str, Expect] = {
    EUGR + "patch_vllm_mrv2_speculator_cudagraph_pool.py": Expect(
        "not-applicable", "predates vLLM PR #53306: the V2 runner's CUDA-graph utils have no profiling pool at all",
        _lacks("vllm/v1/worker/gpu/cudagraph_utils.py", "graph_pool_handle")),
    EUGR + "patch_vllm_b12x_c128a_topk_alignment.py": Expect(
        "not-applicable", "predates the fork's dynamic C128A width (ad848fc41): no vllm/models/deepseek_v4/sparse_mla.py",
        _missing("vllm/models/deepseek_v4/sparse_mla.py")),
    EUGR + "patch_vllm_flashinfer_b12x_swigluoai.py": Expect(
        "not-applicable", "this fork has no upstream FlashInfer B12x MoE experts (fused_moe/experts/flashinfer_b12x_moe.py)",
        _missing("vllm/model_executor/layers/fused_moe/experts/flashinfer_b12x_moe.py")),
    EUGR + "patch_vllm_topk_softplus_sqrt_control_flow.py": Expect(
        "not-applicable", "predates vLLM PR #49408: topk_hash_softplus_sqrt has no XPU branch (no is_padding), so no misplaced return",
        _func_lacks("vllm/_custom_ops.py", "topk_hash_softplus_sqrt", "is_padding")),
    EUGR + "patch_vllm_preserve_sm12x_target.py": Expect(
        "would-apply", "the CUDA >= 13 allow-list ends at 12.0 (CMakeLists.txt:104)"),
    EUGR + "patch_vllm_diffusion_tensor_causal.py": Expect(
        "not-applicable", "predates vLLM PR #47914: build_attn_metadata takes no per-group causal argument",
        _lacks("vllm/v1/worker/gpu/attn_utils.py", "causal: bool | Mapping")),
    EUGR + "patch_vllm_gemma4_mtp_embedding_share.py": Expect(
        "not-applicable", "predates vLLM PR #43957: the draft embedding sharing has no width guard",
        _lacks("vllm/v1/spec_decode/llm_base_proposer.py", "same embedding width")),
    EUGR + "patch_vllm_sm120_cooperative_topk.py": Expect(
        "not-applicable", "predates vLLM PR #43008: the indexer never selects cooperative_topk (persistent_topk only)",
        _lacks("vllm/model_executor/layers/sparse_attn_indexer.py", "use_cooperative_topk")),
    EUGR + "patch_vllm_autogptq_symmetric_moe_qzeros.py": Expect(
        "not-needed", "the snapshot already passes the MoE zero-points only when not is_sym"),
    EUGR + "patch_vllm_disable_minimax_qk_rmsnorm_ipc.py": Expect(
        "not-applicable", "predates vLLM PR #43410's fused op: no minimax_rms_norm/rms_norm_tp.py",
        _missing("vllm/model_executor/layers/minimax_rms_norm/rms_norm_tp.py")),
    EUGR + "patch_vllm_routed_experts_weight_shape.py": Expect(
        "not-applicable", "predates vLLM PR #43362's RoutedExperts: no fused_moe/routed_experts.py",
        _missing("vllm/model_executor/layers/fused_moe/routed_experts.py")),
    EUGR + "patch_vllm_spark_kv_cache_cleanup.py": Expect(
        "would-apply", "both anchors of gpu_worker.py are there (KV sizing after profiling, initialize_from_config)"),
    "glm53-jovian-r12/patch_cuda_sm12x.py": Expect(
        "failed", "the snapshot has the feature it repairs (_get_backend_priorities) with the sm12x MLA branch in "
        "another shape (`major in (10, 12)`, no TRITON_MLA-first list of its own): loud, never skipped",
        lambda tree: "def _get_backend_priorities(" in (tree / "vllm/platforms/cuda.py").read_text()
        and "device_capability.major in (10, 12):" in (tree / "vllm/platforms/cuda.py").read_text()
        and "device_capability.major == 12:" not in (tree / "vllm/platforms/cuda.py").read_text()),
    "dsv4-flash-vision/patch_dsv4_plugin_register.py": Expect(
        "not-applicable", "targets the plugin's source tree (dsv4_vision/), not vLLM's", _missing("dsv4_vision/__init__.py")),
    "dsv4-flash-vision/patch_dsv4_supports_multimodal.py": Expect(
        "not-applicable", "targets the plugin's source tree (dsv4_vision/), not vLLM's", _missing("dsv4_vision/model.py")),
    "dsv4-flash-vision/patch_dsv4_mm_gate.py": Expect(
        "not-applicable", "targets the plugin's source tree (dsv4_vision/), not vLLM's", _missing("dsv4_vision/model.py")),
    "dsv4-flash-vision/patch_mm_hc_streams.py": Expect(
        "would-apply", "the V2 encoder runner and EAGLE speculator buffers are there"),
    "dsv4-flash-vision/patch_dspark_gate_bias_vl.py": Expect(
        "not-applicable", "predates the DSpark drafter: no models/deepseek_v4/nvidia/dspark.py",
        _missing("vllm/models/deepseek_v4/nvidia/dspark.py")),
}

IMAGES = ("glm53-jovian-r12", "dsv4-flash-vision")


def _key(path: Path) -> str:
    return (EUGR if path.parent.name == "patches-eugr" else path.parent.name + "/") + path.name


@pytest.fixture(scope="module")
def vllm_tree(tmp_path_factory):
    base = tmp_path_factory.mktemp("real-vllm")
    yield realtrees.extract(realtrees.VLLM, base)
    shutil.rmtree(base, ignore_errors=True)


def test_every_patch_of_both_images_has_an_expected_outcome():
    declared = set()
    for image in IMAGES:
        defn = definition.load(ROOT, image)
        declared |= {_key(i.path) for s in defn.stages for i in s.inputs if i.kind == "patch"}
    assert declared == set(EXPECTED)
    on_disk = {_key(p) for p in (ROOT / "patches-eugr").glob("patch_*.py")}
    assert on_disk <= declared, "every patch of patches-eugr/ is used by an image"


@pytest.mark.parametrize("key", sorted(EXPECTED))
def test_patch_on_the_real_tree(key, vllm_tree):
    exp = EXPECTED[key]
    path = ROOT / (key if key.startswith(EUGR) else f"docker-images/{key}")
    # the primitive's own CLI, as inside the image, --check: writes nothing
    r = subprocess.run([sys.executable, str(Path(patching.__file__)), "apply", "--check", "--json",
                        "--src", str(vllm_tree), str(path)], capture_output=True, text=True, timeout=120)
    (res,) = json.loads(r.stdout)["patches"]
    print(f"{key}: {res['outcome']} -- {exp.why}")
    assert r.returncode == (1 if exp.outcome == "failed" else 0), r.stderr
    assert res["outcome"] == exp.outcome, res
    if exp.outcome == "not-applicable":
        assert res["message"].startswith("not applicable: "), res["message"]
        assert exp.proof is not None and exp.proof(vllm_tree), f"{key}: the snapshot has the target after all"
    if exp.outcome == "failed":
        assert "not found" in res["message"], res["message"]
        assert exp.proof is not None and exp.proof(vllm_tree), f"{key}: the snapshot's shape is not the one said"


def _code(keys: list[str]) -> int:
    """`imagebuild patch --check`'s exit code for these patches: 1 when one fails."""
    return 1 if any(EXPECTED[k].outcome == "failed" for k in keys) else 0


@pytest.mark.parametrize("image", IMAGES)
def test_imagebuild_patch_check_reports_every_patch_of_every_stage(image, vllm_tree):
    """`imagebuild patch IMAGE --src TREE --check` (every stage) and `--stage S`: every patch reported,
    each with its expected outcome, exit 0 (issue 20: it used to stop at the first, with exit 1)."""
    from tests.conftest import tree_state

    before = tree_state(vllm_tree)
    defn = definition.load(ROOT, image)
    every = []
    for stage in defn.stages:
        keys = [_key(i.path) for i in stage.inputs if i.kind == "patch"]
        if not keys:
            continue
        every += keys
        res = run_cli("--root", str(ROOT), "patch", image, "--src", str(vllm_tree), "--check",
                      "--stage", stage.name, "--json")
        assert res.code == _code(keys), res.err
        assert [p["outcome"] for p in json.loads(res.out)["patches"]] == [EXPECTED[k].outcome for k in keys]
    res = run_cli("--root", str(ROOT), "patch", image, "--src", str(vllm_tree), "--check", "--json")
    assert res.code == _code(every), res.err
    assert [p["outcome"] for p in json.loads(res.out)["patches"]] == [EXPECTED[k].outcome for k in every]
    assert tree_state(vllm_tree) == before, "--check wrote nothing"


def test_applying_the_fitting_patches_then_again_is_idempotent(vllm_tree, tmp_path):
    """On a copy of the real tree: the patches that fit apply for real, then report already-applied."""
    fit = [ROOT / (k if k.startswith(EUGR) else f"docker-images/{k}")
           for k, e in sorted(EXPECTED.items()) if e.outcome in ("would-apply", "not-needed")]
    work = tmp_path / "vllm"
    files = {e.file for p in fit for e in patching.load_edits(p)}
    for rel in files:
        (work / rel).parent.mkdir(parents=True, exist_ok=True)
        (work / rel).write_bytes((vllm_tree / rel).read_bytes())
    first = patching.apply_all(fit, work)
    assert [r.outcome for r in first] == [
        "applied" if EXPECTED[_key(p)].outcome == "would-apply" else "not-needed" for p in fit]
    second = patching.apply_all(fit, work)
    assert [r.outcome for r in second] == [
        "already-applied" if EXPECTED[_key(p)].outcome == "would-apply" else "not-needed" for p in fit]
