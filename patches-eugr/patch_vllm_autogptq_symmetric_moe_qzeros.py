"""Pass AutoGPTQ MoE zero-points to the Marlin MoE kernel only for asymmetric quantization.

Why: vLLM PR #43409 started passing w13_qzeros/w2_qzeros for every AutoGPTQ MoE layer; for
symmetric checkpoints that selects the zero-point kernel path of CUDA Marlin MoE and crashes at
startup (seen with Qwen3-Coder-Next AutoRound).
Ported from the seed's patch set (eugr/spark-vllm-docker,
docker/patch_vllm_autogptq_symmetric_moe_qzeros.py: read for what it changes, not copied).
"""
from imagebuild_patching import Edit

EDITS = [
    Edit(
        file="vllm/model_executor/layers/quantization/auto_gptq.py",
        anchor=(
            '            w1_zp=getattr(layer, "w13_qzeros", None),\n'
            '            w2_zp=getattr(layer, "w2_qzeros", None),\n'
        ),
        replacement=(
            "            # imagebuild-patch: autogptq-sym-qzeros (no zero-points when symmetric)\n"
            '            w1_zp=None if self.quant_config.is_sym else getattr(layer, "w13_qzeros", None),\n'
            '            w2_zp=None if self.quant_config.is_sym else getattr(layer, "w2_qzeros", None),\n'
        ),
        marker="imagebuild-patch: autogptq-sym-qzeros",
        # upstream's own guard (a conditional on is_sym right after the w13_qzeros getattr)
        upstream=['w1_zp=getattr(layer, "w13_qzeros", None)\n            if not self.quant_config.is_sym'],
        reason="zero-points dropped for symmetric AutoGPTQ MoE",
    ),
]
