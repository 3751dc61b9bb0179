"""Turn off MiniMax's fused all-reduce + QK RMSNorm (CUDA IPC) op on multi-node DGX Spark.

Why: vLLM PR #43410 added a fused minimax_allreduce_rms_qk op that allocates a Lamport workspace
over CUDA IPC; across two Spark nodes that allocation fails at startup. With the op handle set to
None the layer takes its unfused path. (A git revert of the PR no longer applies cleanly.)
Ported from the seed's patch set (eugr/spark-vllm-docker,
docker/patch_vllm_disable_minimax_qk_rmsnorm_ipc.py: read for what it changes, not copied).
"""
from imagebuild_patching import Edit

EDITS = [
    Edit(
        file="vllm/model_executor/layers/minimax_rms_norm/rms_norm_tp.py",
        anchor='_MINIMAX_FUSED_AR_RMS_QK = getattr(torch.ops._C, "minimax_allreduce_rms_qk", None)\n',
        replacement=(
            "# imagebuild-patch: minimax-qk-rmsnorm-ipc-off (the fused op's CUDA IPC workspace fails "
            "across Spark nodes)\n"
            "_MINIMAX_FUSED_AR_RMS_QK = None\n"
        ),
        marker="imagebuild-patch: minimax-qk-rmsnorm-ipc-off",
        upstream=["_MINIMAX_FUSED_AR_RMS_QK = None"],
        reason="the fused MiniMax QK RMSNorm op is not used",
    ),
]
