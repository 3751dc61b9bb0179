"""Limit the EAGLE draft-embedding width guard to drafts that own their embedding (Gemma4 MTP fix).

Why: vLLM PR #43957 added an embedding-width guard for EAGLE3 to the draft embedding sharing in
llm_base_proposer.py. Gemma4 MTP deliberately takes the target backbone's embedding before its
pre_projection; under the guard it keeps its own 1024-wide embedding, concatenates it with the
2816-wide backbone hidden states and crashes in the 5632-wide pre_projection
(vllm-project/vllm issue #47794). The guarded block now runs only for EAGLE-style drafts (those
with has_own_embed_tokens).
Ported from the seed's patch set (eugr/spark-vllm-docker,
docker/patch_vllm_gemma4_mtp_embedding_share.py: read for what it changes, not copied).
"""
from imagebuild_patching import Edit

EDITS = [
    Edit(
        file="vllm/v1/spec_decode/llm_base_proposer.py",
        anchor=(
            "            if share_embeddings:\n"
            "                draft_embed = self.model.model.embed_tokens\n"
        ),
        replacement=(
            "            # imagebuild-patch: gemma4-mtp-embedding-share (width guard for EAGLE-style drafts only)\n"
            '            if share_embeddings and hasattr(self.model, "has_own_embed_tokens"):\n'
            "                draft_embed = self.model.model.embed_tokens\n"
        ),
        marker="imagebuild-patch: gemma4-mtp-embedding-share",
        applies_if=["draft_embed"],  # the draft embedding sharing of vLLM PR #43957: not there -> not applicable
        upstream=['if share_embeddings and hasattr(self.model, "has_own_embed_tokens"):'],
        reason="the width-guarded sharing applies to EAGLE-style drafts only",
    ),
]
