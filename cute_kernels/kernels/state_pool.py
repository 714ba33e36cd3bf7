"""State-pool copies (every arch, SIMT): the chunked forward's states through a pool of slots, with FLA's -1.

`gather`: dense[n] = pool[idx[n]] (zeros where idx[n] = -1), the start states of a call from its pool slots.
`scatter`: pool[idx[n]] = dense[n] where idx[n] >= 0, the final states back into their slots.
Indices are read on the device only, so a captured call replays with new slots.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32

THREADS = 256
VEC = 4   # floats per access (16 bytes)


class StatePoolCopy:
    """One CTA per (sequence, head): 256 threads copy its K x V fp32 state in 16-byte pieces.

    Warp roles: none (every thread copies). No pipelines, no shared memory.
    Tensors: dense [N, H, K, V] fp32, pool [P, H, K, V] fp32, idx [N] int32."""

    def __init__(self, gather: bool, k_dim: int = 128, v_dim: int = 128):
        self.gather = gather
        self.k_dim, self.v_dim = k_dim, v_dim

    @cute.jit
    def __call__(self, dense: cute.Tensor, pool: cute.Tensor, idx: cute.Tensor, stream):
        self.kernel(dense, pool, idx).launch(grid=[dense.shape[1], dense.shape[0], 1], block=[THREADS, 1, 1],
                                             stream=stream)

    @cute.kernel
    def kernel(self, dense: cute.Tensor, pool: cute.Tensor, idx: cute.Tensor):
        tid, _, _ = cute.arch.thread_idx()
        head, n, _ = cute.arch.block_idx()
        slot = idx[n]
        pieces = self.v_dim // VEC
        per_thread = self.k_dim * pieces // THREADS
        buf = cute.make_rmem_tensor((VEC,), Float32)
        if cutlass.const_expr(self.gather):
            for i in cutlass.range_constexpr(per_thread):
                f = tid + THREADS * i
                r, c = f // pieces, f % pieces
                if slot >= 0:
                    cute.autovec_copy(cute.local_tile(pool[slot, head, r, None], (VEC,), (c,)), buf)
                else:
                    buf.fill(0.0)
                cute.autovec_copy(buf, cute.local_tile(dense[n, head, r, None], (VEC,), (c,)))
        else:
            if slot >= 0:
                for i in cutlass.range_constexpr(per_thread):
                    f = tid + THREADS * i
                    r, c = f // pieces, f % pieces
                    cute.autovec_copy(cute.local_tile(dense[n, head, r, None], (VEC,), (c,)), buf)
                    cute.autovec_copy(buf, cute.local_tile(pool[slot, head, r, None], (VEC,), (c,)))
