"""Let the V2 runner's encoder-runner and speculator embedding buffers follow the model's shape.

Why (seed, 2026-09-01, "encoder-runner + speculator buffer shape-follow patches"): both buffers
are preallocated as [max_num_tokens, hidden_size], but DeepSeek V4's embeddings feed its
hyper-connection streams and the tilelang mHC kernels are rank-strict: copying a [T, hc, D]
embedding into the 2-D buffer fails. Each buffer is reallocated once, with the trailing shape of
the first embedding that does not fit, before the copy. Only the multimodal branch
(VLLM_DSV4_MM=1) reaches this code; the text lane never fills these buffers.
Applied to the installed vllm package (the path is the same in a source tree).
"""
from imagebuild_patching import Edit

EDITS = [
    Edit(
        file="vllm/v1/worker/gpu/mm/encoder_runner.py",
        anchor=(
            "        # Copy to the pre-allocated buffer for CUDA graphs.\n"
            "        self.inputs_embeds[: x.shape[0]] = x\n"
        ),
        replacement=(
            "        # imagebuild-patch: mm-hc-streams/encoder (the buffer follows the embedding's shape)\n"
            "        if x.shape[1:] != self.inputs_embeds.shape[1:]:\n"
            "            self.inputs_embeds = torch.zeros(\n"
            "                (self.max_num_tokens, *x.shape[1:]), dtype=self.dtype, device=self.device\n"
            "            )\n"
            "        # Copy to the pre-allocated buffer for CUDA graphs.\n"
            "        self.inputs_embeds[: x.shape[0]] = x\n"
        ),
        marker="imagebuild-patch: mm-hc-streams/encoder",
        upstream=["x.shape[1:] != self.inputs_embeds.shape[1:]"],
        reason="encoder-runner embedding buffer follows the model's embedding shape",
    ),
    Edit(
        file="vllm/v1/worker/gpu/spec_decode/eagle/speculator.py",
        anchor=(
            "                self.inputs_embeds[:num_input_tokens] = self.model.embed_input_ids(\n"
            "                    self.input_buffers.input_ids[:num_input_tokens],\n"
            "                    multimodal_embeddings=mm_embeds,\n"
            "                    is_multimodal=is_mm_embed,\n"
            "                )\n"
        ),
        replacement=(
            "                # imagebuild-patch: mm-hc-streams/speculator (the buffer follows the draft's shape)\n"
            "                embeds = self.model.embed_input_ids(\n"
            "                    self.input_buffers.input_ids[:num_input_tokens],\n"
            "                    multimodal_embeddings=mm_embeds,\n"
            "                    is_multimodal=is_mm_embed,\n"
            "                )\n"
            "                if embeds.shape[1:] != self.inputs_embeds.shape[1:]:\n"
            "                    self.inputs_embeds = torch.zeros(\n"
            "                        (self.max_num_tokens, *embeds.shape[1:]),\n"
            "                        dtype=self.inputs_embeds.dtype,\n"
            "                        device=self.inputs_embeds.device,\n"
            "                    )\n"
            "                self.inputs_embeds[:num_input_tokens] = embeds\n"
        ),
        marker="imagebuild-patch: mm-hc-streams/speculator",
        upstream=["embeds.shape[1:] != self.inputs_embeds.shape[1:]"],
        reason="speculator embedding buffer follows the draft's embedding shape",
    ),
]
