"""Gate the DSV4 multimodal branch behind VLLM_DSV4_MM=1; default off (the verified text lane).

Why (seed, 2026-09-01): with the wrapper multimodal, the fork's V2 runner takes its always-embed
multimodal arm, which passes wrong-rank input ids and degenerates the logits, and the AOT trace
freezes the dummy's 2-D embedding shape. The text-only lane was verified exact with that branch
off. `supports_multimodal` now follows VLLM_DSV4_MM (read when the plugin's model module is
imported, in every vLLM process): unset or 0 = text only (image requests are refused cleanly),
1 = the experimental multimodal branch (with patch_mm_hc_streams.py's buffer shapes).
Applied to the plugin's source tree after patch_dsv4_supports_multimodal.py.
"""
from imagebuild_patching import Edit

EDITS = [
    Edit(
        file="dsv4_vision/model.py",
        anchor="    supports_multimodal = True\n",
        replacement=(
            "    # imagebuild-patch: dsv4-mm-gate/flag (VLLM_DSV4_MM=1 turns the multimodal branch on)\n"
            '    supports_multimodal = os.environ.get("VLLM_DSV4_MM", "0") == "1"\n'
        ),
        marker="imagebuild-patch: dsv4-mm-gate/flag",
        upstream=['os.environ.get("VLLM_DSV4_MM"'],
        reason="multimodal only with VLLM_DSV4_MM=1",
    ),
    Edit(
        file="dsv4_vision/model.py",
        anchor="from __future__ import annotations\n",
        replacement=(
            "from __future__ import annotations\n"
            "\n"
            "import os  # imagebuild-patch: dsv4-mm-gate/import\n"
        ),
        marker="imagebuild-patch: dsv4-mm-gate/import",
        upstream=["\nimport os\n"],
        reason="os imported for the flag",
    ),
]
