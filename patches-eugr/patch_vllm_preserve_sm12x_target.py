"""Keep 12.1 in vLLM's CUDA 13 architecture allow-list, so TORCH_CUDA_ARCH_LIST=12.1a stays sm_121a.

Why: with CUDA >= 13, vLLM's CMakeLists.txt filters the requested architectures through a list
that ends at 12.0, so a requested 12.1a collapses to the 12.0 family entry and the sm_121a-only
code paths (and the arch-specific suffix) are lost. Adding 12.1 to that list preserves the target.
Switch: applied only when the build sets VLLM_PRESERVE_SM12X_TARGET=1 (the stage's Dockerfile
decides; the standard upstream build keeps its own architecture policy).
Ported from the seed's patch set (eugr/spark-vllm-docker, docker/patch_vllm_preserve_sm12x_target.py:
read for what it changes, not copied).
"""
from imagebuild_patching import Edit

SWITCH = "VLLM_PRESERVE_SM12X_TARGET"

EDITS = [
    Edit(
        file="CMakeLists.txt",
        anchor='  set(CUDA_SUPPORTED_ARCHS "7.5;8.0;8.6;8.7;8.9;9.0;10.0;11.0;12.0")\n',
        replacement=(
            "  # imagebuild-patch: preserve-sm12x-target (keep 12.1a instead of collapsing it to 12.0)\n"
            '  set(CUDA_SUPPORTED_ARCHS "7.5;8.0;8.6;8.7;8.9;9.0;10.0;11.0;12.0;12.1")\n'
        ),
        marker="imagebuild-patch: preserve-sm12x-target",
        # a CUDA 13 list that already carries 12.1 (no other branch of the file has these exact lists):
        # 12.1 alone, or with the 10.3 Blackwell subarchitecture too (a later allow-list)
        upstream=['"7.5;8.0;8.6;8.7;8.9;9.0;10.0;11.0;12.0;12.1"',
                  '"7.5;8.0;8.6;8.7;8.9;9.0;10.0;10.3;11.0;12.0;12.1"'],
        reason="12.1 added to the CUDA >= 13 CUDA_SUPPORTED_ARCHS",
    ),
]

# the sm_121a kernels depend on it: a tree without the CUDA architecture list fails, never skips
REQUIRED = True
