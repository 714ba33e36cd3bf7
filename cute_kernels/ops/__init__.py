from .last import last_plan
from .merge import affine_merge, lse_merge
from .torch_ops import chunk_gated_delta_rule, chunk_kda, decode_attention  # registers torch.ops.cute_kernels.*

__all__ = ["affine_merge", "chunk_gated_delta_rule", "chunk_kda", "decode_attention", "last_plan", "lse_merge"]
