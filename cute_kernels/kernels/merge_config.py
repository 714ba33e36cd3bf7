"""Launch shapes of the affine-merge variants (plain Python: the ops check sizes without importing cutlass)."""

from __future__ import annotations

# impl -> (threads per CTA, V columns per CTA)
AFFINE_MERGE_CONFIG = {"simt": (128, 16), "staged": (256, 32), "prefetch": (256, 8), "ring": (256, 8),
                       "regs": (256, 8),   # K = 128 only
                       "tc": (256, 64)}   # tc: kernels/sm90/affine_merge_tc.py (SM90 tensor cores, K = 128 only)


def affine_merge_fits(impl: str, k_dim: int, v_dim: int) -> bool:
    """Whether variant `impl` handles K = k_dim, V = v_dim (whole 16-byte M pieces per thread, whole V tiles)."""
    threads, block_v = AFFINE_MERGE_CONFIG[impl]
    if impl in ("tc", "regs"):   # built for K = 128 only
        return k_dim == 128 and v_dim % block_v == 0
    return (k_dim % 4 == 0 and v_dim % block_v == 0 and (k_dim * block_v) % threads == 0
            and threads % block_v == 0 and (k_dim * k_dim // 4) % threads == 0)


# Variants that can publish each start state as they store it (`publish`: the one-pass forward's early correction
# spins on these counts): one count per (slot, head), to which every CTA of the (sequence, head) adds 1.
PUBLISHING_IMPLS = ("regs", "tc")


def affine_merge_writers(impl: str, v_dim: int) -> int:
    """How many CTAs of variant `impl` write one (slot, head)'s start state: what a published count reaches."""
    return v_dim // AFFINE_MERGE_CONFIG[impl][1]
