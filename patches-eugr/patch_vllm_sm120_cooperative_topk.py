"""Select the cooperative sparse-attention top-k kernel on SM90 only, never on SM12x.

Why: vLLM PR #43008 picks cooperative_topk on every device with capability >= 9.0. It needs a
thread-block-cluster launch that only SM90 supports here; on DGX Spark (SM12.1) it fails at launch
with "cooperative_topk launch failed: invalid argument". Other devices keep the persistent_topk
path the selector already falls back to.
Ported from the seed's patch set (eugr/spark-vllm-docker,
docker/patch_vllm_sm120_cooperative_topk.py: read for what it changes, not copied).
"""
from imagebuild_patching import Edit

EDITS = [
    Edit(
        file="vllm/model_executor/layers/sparse_attn_indexer.py",
        anchor=(
            "            and logits.stride(0) % 4 == 0  # TMA 16-byte alignment\n"
            "            and current_platform.has_device_capability(90)\n"
        ),
        replacement=(
            "            and logits.stride(0) % 4 == 0  # TMA 16-byte alignment\n"
            "            # imagebuild-patch: sm120-cooperative-topk (cluster launch: SM90 only)\n"
            "            and current_platform.is_device_capability(90)\n"
        ),
        marker="imagebuild-patch: sm120-cooperative-topk",
        applies_if=["cooperative_topk"],  # the cooperative top-k selection of vLLM PR #43008: not there -> not applicable
        upstream=["and current_platform.is_device_capability(90)\n",
                  "device_capability.to_int() == 90"],
        reason="cooperative_topk restricted to capability 9.0",
    ),
]
