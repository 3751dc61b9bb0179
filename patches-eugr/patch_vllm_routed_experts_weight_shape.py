"""Load vector metadata (weight_shape) of compressed-tensors MoE checkpoints whole, not as a scalar.

Why: vLLM PR #43362 made RoutedExperts._load_single_value scalarize every value it loads. That is
right for per-expert input scales, but compressed-tensors MoE checkpoints load their 2-element
weight_shape through the same path, and scalarizing it fails. A destination slot with as many
elements as the loaded tensor now gets the tensor copied in; scalars behave as before.
Ported from the seed's patch set (eugr/spark-vllm-docker,
docker/patch_vllm_routed_experts_weight_shape.py: read for what it changes, not copied).
"""
from imagebuild_patching import Edit

EDITS = [
    Edit(
        file="vllm/model_executor/layers/fused_moe/routed_experts.py",
        anchor=(
            "        param_data = param.data\n"
            "\n"
            "        # Input scales can be loaded directly and should be equal.\n"
            "        param_data[expert_id] = self._to_scalar(loaded_weight)\n"
        ),
        replacement=(
            "        param_data = param.data\n"
            "\n"
            "        # imagebuild-patch: routed-experts-vector-value (weight_shape is a 2-vector)\n"
            "        slot = param_data[expert_id]\n"
            "        if slot.dim() > 0 and slot.numel() == loaded_weight.numel():\n"
            "            slot.copy_(loaded_weight.reshape(slot.shape))\n"
            "            return\n"
            "\n"
            "        # Input scales can be loaded directly and should be equal.\n"
            "        param_data[expert_id] = self._to_scalar(loaded_weight)\n"
        ),
        marker="imagebuild-patch: routed-experts-vector-value",
        # an equivalent guard: the loader copies a same-sized tensor into the expert's slot
        upstream=["numel() == loaded_weight.numel()"],
        reason="vector values are copied into the expert's slot",
    ),
]
