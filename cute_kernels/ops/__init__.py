from .decode import decode_attention
from .last import last_plan
from .linear_attention import chunk_gated_delta_rule, chunk_kda
from .merge import affine_merge, lse_merge
from . import torch_ops  # noqa: E402,F401  (registers torch.ops.cute_kernels.*)

__all__ = ["affine_merge", "chunk_gated_delta_rule", "chunk_kda", "decode_attention", "last_plan", "lse_merge"]
