"""Put topk_hash_softplus_sqrt's XPU-only `return` back inside the XPU branch.

Why: vLLM PR #49408 (commit d6dbdb9) left the early `return` of the XPU branch at function level,
so on CUDA the torch.ops._moe_C.topk_softplus_sqrt kernel call after it is dead code and the
routing outputs are never written. Upstream's fix is PR #49452.
Ported from the seed's patch set (eugr/spark-vllm-docker,
docker/patch_vllm_topk_softplus_sqrt_control_flow.py: read for what it changes, not copied).
"""
from imagebuild_patching import Edit

EDITS = [
    Edit(
        file="vllm/_custom_ops.py",
        anchor="    return\n    torch.ops._moe_C.topk_softplus_sqrt(\n",
        replacement=(
            "        return  # imagebuild-patch: topk-softplus-sqrt-xpu-return\n"
            "\n"
            "    torch.ops._moe_C.topk_softplus_sqrt(\n"
        ),
        marker="imagebuild-patch: topk-softplus-sqrt-xpu-return",
        applies_if=["is_padding"],  # the XPU branch of vLLM PR #49408: not there -> not applicable
        # PR #49452's shape: the return indented into the XPU branch, then the CUDA kernel call
        upstream=["        return\n\n    torch.ops._moe_C.topk_softplus_sqrt(\n"],
        reason="the XPU return moved into its branch; the CUDA kernel call runs again",
    ),
]
