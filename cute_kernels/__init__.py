"""cute-kernels: CuTe DSL kernels for sequence mixers at small batch / heads / sequence length.

Importing this package does not import CuTe DSL or touch a GPU; an op compiles its kernel (once per
configuration) on first call. The float64 references in `cute_kernels.reference` run anywhere.
"""

__version__ = "0.1.0"

from .ops import (
    affine_merge,
    chunk_gated_delta_rule,
    chunk_kda,
    decode_attention,
    fused_recurrent_gated_delta_rule,
    fused_recurrent_kda,
    last_plan,
    lse_merge,
)
from .runtime import UnsupportedDeviceError

__all__ = ["affine_merge", "chunk_gated_delta_rule", "chunk_kda", "decode_attention", "fused_recurrent_gated_delta_rule",
           "fused_recurrent_kda", "last_plan", "lse_merge", "UnsupportedDeviceError", "__version__"]
