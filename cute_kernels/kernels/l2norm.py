"""q and k l2-normalized along their last dimension in one launch (every arch, SIMT): FLA's l2norm for
use_qk_l2norm_in_kernel, y = x / sqrt(sum x^2 + eps) in fp32, written in the input's 16-bit dtype.

One pass: each row is read once and written once (2 x 256 bytes per row at K = 128), where the torch form
(normalize of an fp32 copy, then a cast) moves about six times that.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32

THREADS = 256
WARPS = THREADS // 32
K = 128
VEC = K // 32          # elements per lane: one warp covers one row
ROWS_PER_WARP = 4      # rows a warp loads before it reduces them (loads in flight)
EPS = 1e-6             # as FLA's l2norm


class QKL2Norm:
    """Rows of q and k (each [B, T, H, 128], 16-bit, contiguous) normalized into qn and kn.

    Warp roles: none; warp w of CTA (c, y) takes rows (c * WARPS + w) * ROWS_PER_WARP + i of q (y = 0) or k (y = 1),
    lane l elements 4l .. 4l + 3 (one 8-byte access); a 5-step butterfly sums the squares. No shared memory, no
    pipelines."""

    def __init__(self, io_dtype):
        self.io_dtype = io_dtype

    @staticmethod
    def rows_view(t):
        """[B, T, H, K] (contiguous) as [B * T * H, K]."""
        rows = t.shape[0] * t.shape[1] * t.shape[2]
        return cute.make_tensor(t.iterator, cute.make_layout((rows, K), stride=(K, 1)))

    @cute.jit
    def __call__(self, q: cute.Tensor, k: cute.Tensor, qn: cute.Tensor, kn: cute.Tensor, stream):
        rows = q.shape[0] * q.shape[1] * q.shape[2]
        per_cta = WARPS * ROWS_PER_WARP
        self.kernel(self.rows_view(q), self.rows_view(k), self.rows_view(qn), self.rows_view(kn), rows).launch(
            grid=[(rows + per_cta - 1) // per_cta, 2, 1], block=[THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mK: cute.Tensor, mQn: cute.Tensor, mKn: cute.Tensor, rows: cutlass.Int32):
        tid, _, _ = cute.arch.thread_idx()
        cta, which, _ = cute.arch.block_idx()
        lane = tid % 32
        first = (cta * WARPS + tid // 32) * ROWS_PER_WARP
        x = [cute.make_rmem_tensor((VEC,), self.io_dtype) for _ in range(ROWS_PER_WARP)]
        for i in cutlass.range_constexpr(ROWS_PER_WARP):
            r = first + i
            if r < rows:
                if which == 0:
                    cute.autovec_copy(cute.local_tile(mQ[r, None], (VEC,), (lane,)), x[i])
                else:
                    cute.autovec_copy(cute.local_tile(mK[r, None], (VEC,), (lane,)), x[i])
        for i in cutlass.range_constexpr(ROWS_PER_WARP):
            r = first + i
            if r < rows:
                ss = Float32(0.0)
                for e in cutlass.range_constexpr(VEC):
                    ss = ss + Float32(x[i][e]) * Float32(x[i][e])
                for b in cutlass.range_constexpr(5):
                    ss = ss + cute.arch.shuffle_sync_bfly(ss, offset=16 >> b)
                rstd = cute.math.rsqrt(ss + Float32(EPS))
                y = cute.make_rmem_tensor((VEC,), self.io_dtype)
                for e in cutlass.range_constexpr(VEC):
                    y[e] = self.io_dtype(Float32(x[i][e]) * rstd)
                if which == 0:
                    cute.autovec_copy(y, cute.local_tile(mQn[r, None], (VEC,), (lane,)))
                else:
                    cute.autovec_copy(y, cute.local_tile(mKn[r, None], (VEC,), (lane,)))
