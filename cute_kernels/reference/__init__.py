"""Pure-torch (float64 by default) reference implementations: the specs the GPU kernels are tested against."""

from .linear_attention import (
    affine_merge,
    chunk_gated_delta_rule_ref,
    chunk_summaries,
    recurrent_gated_delta_rule,
    segment_summaries,
    segmented_gated_delta_rule_ref,
    split_chunks,
)
from .softmax_attention import attention_ref, decode_attention_ref, lse_merge, split_kv_partials

__all__ = [
    "recurrent_gated_delta_rule",
    "chunk_gated_delta_rule_ref",
    "chunk_summaries",
    "affine_merge",
    "split_chunks",
    "segment_summaries",
    "segmented_gated_delta_rule_ref",
    "attention_ref",
    "decode_attention_ref",
    "split_kv_partials",
    "lse_merge",
]
