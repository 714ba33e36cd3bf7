from .last import last_plan
from .merge import affine_merge, lse_merge
from .torch_ops import (  # registers torch.ops.cute_kernels.*
    chunk_gated_delta_rule,
    chunk_kda,
    decode_attention,
    fused_recurrent_gated_delta_rule,
    fused_recurrent_kda,
)

__all__ = ["affine_merge", "chunk_gated_delta_rule", "chunk_kda", "decode_attention", "fused_recurrent_gated_delta_rule",
           "fused_recurrent_kda", "last_plan", "lse_merge"]
