"""Declare the DSV4 vision wrapper multimodal (`supports_multimodal = True`).

Why (seed, 2026-08-31): vLLM's OpenAI layer decides whether a model takes `image_url` content by
reading the class attribute `supports_multimodal` (interfaces.supports_multimodal is a getattr
check); the day-0 wrapper subclasses the text model without it, so every image request was
refused. Applied to the plugin's source tree before it is installed. Whether the attribute is
True at run time is then decided by patch_dsv4_mm_gate.py (VLLM_DSV4_MM).
"""
from imagebuild_patching import Edit

EDITS = [
    Edit(
        file="dsv4_vision/model.py",
        anchor="class DeepseekV4VisionForCausalLM(DeepseekV4ForCausalLM):\n",
        replacement=(
            "class DeepseekV4VisionForCausalLM(DeepseekV4ForCausalLM):\n"
            "    # imagebuild-patch: dsv4-supports-multimodal (the OpenAI layer's image_url check)\n"
            "    supports_multimodal = True\n"
        ),
        marker="imagebuild-patch: dsv4-supports-multimodal",
        # the plugin declares it itself, or inherits SupportsMultiModal
        upstream=["    supports_multimodal = ", ", SupportsMultiModal"],
        reason="the wrapper class advertises multimodal input",
    ),
]
