"""Let the B12X DSpark draft loader skip the Vision-Exp MoE gate tensors it cannot bind.

Why (seed, 2026-08-31/09-01): every MoE layer of DeepSeek-V4-Flash-Vision-Exp also ships
`ffn.gate.bias_vl` (vision-aware routing), and the DSpark draft's loader maps every name it sees
into its params_dict: the draft load dies with a KeyError on the first bias_vl (and on gate
tensors the draft has no parameter for). Image-token routing is not on the text path, so the
loader now skips bias_vl and names it has no parameter for. The seed's "DSpark gate patch"
hard-coded /usr/local/lib/python3.12/dist-packages; here the stage finds the installed vllm's
root itself (the venv root of the fork) and passes it as --src.
"""
from imagebuild_patching import Edit

EDITS = [
    Edit(
        file="vllm/models/deepseek_v4/nvidia/dspark.py",
        anchor=(
            '                if name.endswith(".ffn.gate.bias"):\n'
            "                    name = name.replace(\n"
            '                        ".ffn.gate.bias", ".ffn.gate.e_score_correction_bias"\n'
            "                    )\n"
            "                param = params_dict[name]\n"
        ),
        replacement=(
            "                # imagebuild-patch: dspark-gate-bias-vl (no draft parameter for bias_vl)\n"
            '                if name.endswith(".ffn.gate.bias_vl"):\n'
            "                    continue\n"
            '                if name.endswith(".ffn.gate.bias"):\n'
            "                    name = name.replace(\n"
            '                        ".ffn.gate.bias", ".ffn.gate.e_score_correction_bias"\n'
            "                    )\n"
            "                if name not in params_dict:\n"
            "                    continue\n"
            "                param = params_dict[name]\n"
        ),
        marker="imagebuild-patch: dspark-gate-bias-vl",
        upstream=['name.endswith(".ffn.gate.bias_vl")'],
        reason="DSpark draft loading skips gate tensors it has no parameter for",
    ),
]
