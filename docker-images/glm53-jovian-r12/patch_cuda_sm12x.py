"""Put B12X first in vLLM's attention backend priorities for capability 12.x (GB10, sm_121).

Why (seed, 2026-09-02): the fork's sm12x MLA list offers only TRITON_MLA (no sparse attention)
and FLASHINFER_MLA_SPARSE_SM120 (head size 576 only); neither serves GLM-5.3's head-512 sparse
MLA, so every recipe had to pass --attention-backend B12X (and the MTP draft its own
"attention_backend": "B12X"). With B12X first, vLLM's automatic choice is the backend the lane
runs on. Applied in the runner stage to the installed vllm package (same relative path as in
the source tree, so `imagebuild patch glm53-jovian-r12 --src <vllm checkout>` checks it too).
"""
from imagebuild_patching import Edit

EDITS = [
    Edit(
        file="vllm/platforms/cuda.py",
        anchor=(
            "        elif device_capability.major == 12:\n"
            "            return [\n"
            "                AttentionBackendEnum.TRITON_MLA,\n"
        ),
        replacement=(
            "        elif device_capability.major == 12:\n"
            "            return [\n"
            "                AttentionBackendEnum.B12X,  # imagebuild-patch: sm12x-b12x\n"
            "                AttentionBackendEnum.TRITON_MLA,\n"
        ),
        marker="imagebuild-patch: sm12x-b12x",
        # the feature it repairs, not its shape (docs/patches.md): vLLM's backend priorities by device
        # capability. A tree that has them with the sm12x branch in another shape (28be48fa's
        # `major in (10, 12)`) fails, naming the anchor; only a tree without them is not applicable (and
        # the gate's sm12x-patch check refuses that image)
        applies_if=["_get_backend_priorities"],
        # the fork's own list already starting with B12X
        upstream=[
            "        elif device_capability.major == 12:\n"
            "            return [\n"
            "                AttentionBackendEnum.B12X,\n"
        ],
        reason="B12X first in the sm12x MLA priority list",
    ),
]
