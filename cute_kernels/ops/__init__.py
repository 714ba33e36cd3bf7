from .linear_attention import chunk_gated_delta_rule, chunk_kda, last_plan
from .merge import affine_merge, lse_merge

__all__ = ["affine_merge", "chunk_gated_delta_rule", "chunk_kda", "last_plan", "lse_merge"]
