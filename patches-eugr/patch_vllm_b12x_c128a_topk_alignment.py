"""Import _C128A_TOPK_ALIGNMENT where the B12X DeepSeek V4 sparse-MLA path uses it.

Why: local-inference-lab/vllm commit ad848fc41 made the DeepSeek V4 C128A top-k width dynamic
and rounds it with _C128A_TOPK_ALIGNMENT, which lives in compressor_utils (value 128) but was not
imported into sparse_mla.py: the first C128A decode raises NameError.
Switch: applied only when the build sets VLLM_PATCH_B12X_C128A_ALIGNMENT=1 (B12X builds).
Ported from the seed's patch set (eugr/spark-vllm-docker,
docker/patch_vllm_b12x_c128a_topk_alignment.py: read for what it changes, not copied).
"""
from imagebuild_patching import Edit

SWITCH = "VLLM_PATCH_B12X_C128A_ALIGNMENT"

EDITS = [
    Edit(
        file="vllm/models/deepseek_v4/sparse_mla.py",
        anchor=(
            "from vllm.v1.attention.backends.mla.compressor_utils import (\n"
            "    get_c128a_topk_width,\n"
            "    get_compressed_slot_mapping,\n"
            ")\n"
        ),
        replacement=(
            "from vllm.v1.attention.backends.mla.compressor_utils import (\n"
            "    _C128A_TOPK_ALIGNMENT,  # imagebuild-patch: b12x-c128a-alignment\n"
            "    get_c128a_topk_width,\n"
            "    get_compressed_slot_mapping,\n"
            ")\n"
        ),
        marker="imagebuild-patch: b12x-c128a-alignment",
        # the name is already bound: imported (any import list) or defined at module level
        upstream=["    _C128A_TOPK_ALIGNMENT,\n", "\n_C128A_TOPK_ALIGNMENT =", "import _C128A_TOPK_ALIGNMENT\n"],
        reason="_C128A_TOPK_ALIGNMENT imported from compressor_utils",
    ),
]
