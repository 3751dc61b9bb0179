"""Accept a per-request torch.Tensor causal mask in the V2 runner's attention metadata builder.

Why: vLLM PR #47914 typed build_attn_metadata's `causal` as bool or a per-KV-group
Mapping[int, bool] and reads it with causal.get(i, True). DiffusionGemma passes a torch.Tensor
causal mask per request, which has no .get: the model crashes building its metadata.
Ported from the seed's patch set (eugr/spark-vllm-docker,
docker/patch_vllm_diffusion_tensor_causal.py: read for what it changes, not copied).
"""
from imagebuild_patching import Edit

EDITS = [
    Edit(
        file="vllm/v1/worker/gpu/attn_utils.py",
        anchor="    causal: bool | Mapping[int, bool] = True,\n",
        replacement=(
            "    causal: bool | Mapping[int, bool] | torch.Tensor = True,"
            "  # imagebuild-patch: diffusion-tensor-causal/signature\n"
        ),
        marker="imagebuild-patch: diffusion-tensor-causal/signature",
        applies_if=["causal: bool | Mapping", "group_causal"],  # the per-group causal argument of vLLM PR #47914: not there -> not applicable
        upstream=["causal: bool | Mapping[int, bool] | torch.Tensor"],
        reason="a Tensor causal mask is an accepted type",
    ),
    Edit(
        file="vllm/v1/worker/gpu/attn_utils.py",
        anchor="        group_causal = causal if isinstance(causal, bool) else causal.get(i, True)\n",
        replacement=(
            "        # imagebuild-patch: diffusion-tensor-causal/group (a Tensor mask applies to every group)\n"
            "        if isinstance(causal, (bool, torch.Tensor)):\n"
            "            group_causal = causal\n"
            "        else:\n"
            "            group_causal = causal.get(i, True)\n"
        ),
        marker="imagebuild-patch: diffusion-tensor-causal/group",
        applies_if=["causal: bool | Mapping", "group_causal"],  # the per-group causal argument of vLLM PR #47914: not there -> not applicable
        upstream=["isinstance(causal, (bool, torch.Tensor))"],
        reason="a Tensor causal mask is passed through to every KV-cache group",
    ),
]
