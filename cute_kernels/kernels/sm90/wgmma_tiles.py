"""Small SM90 building blocks of the chunked linear-attention kernels: swizzled 16-bit smem tiles, wgmma products on
them, and the accumulator -> smem -> global epilogue. Every product is issued by one
warpgroup (128 threads, `wtid` its thread index) with 64 x n x 16 atoms, 16-bit operands and an fp32 accumulator.
The [B, T, ...] tensor views (`flat`, `thd`) live in `kernels.views` (every arch).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32
from cutlass.cute.nvgpu import warp, warpgroup

from ..views import flat, thd  # noqa: F401  (wt.flat / wt.thd: the kernels' tensor views)


def smem_layout(rows: int, cols: int, dtype, stages: int = 1, mn_view: bool = False):
    """Swizzled smem layout of `stages` row-major [rows, cols] 16-bit tiles, indexed (row, col, stage): a K-major
    wgmma A (M=rows, K=cols). With `mn_view` the same bytes indexed (col, row, stage): an MN-major A (M=cols, K=rows)
    or MN-major B (N=cols, K=rows); both views map every element to the same address (tests/test_gdn_sm90.py)."""
    from cutlass.tensor_utils import LayoutEnum

    if mn_view:
        return sm90_utils.make_smem_layout_a(LayoutEnum.COL_MAJOR, (cols, 64, rows), dtype, stages)
    return sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, (rows, 64, cols), dtype, stages)


def first_stage(layout):
    """The (row, col) layout of stage 0 of a `smem_layout`."""
    return cute.slice_(layout, (None, None, 0))


def smem_view(field, io_dtype, rows, cols, stages=1, mn_view=False):
    """(row, col, stage) view of a swizzled 16-bit smem struct field (see `smem_layout`)."""
    layout = smem_layout(rows, cols, io_dtype, stages, mn_view)
    return field.get_tensor(layout.outer, swizzle=layout.inner)


def make_mma(io_dtype, a_mn_major: bool, b_mn_major: bool, n: int = 64):
    """A one-warpgroup tiled MMA with (64 x n x 16) atoms, 16-bit operands from smem, fp32 accumulator."""
    major = lambda mn: warpgroup.OperandMajorMode.MN if mn else warpgroup.OperandMajorMode.K
    op = warpgroup.MmaF16BF16Op(io_dtype, Float32, (64, n, 16), warpgroup.OperandSource.SMEM,
                                major(a_mn_major), major(b_mn_major))
    return cute.make_tiled_mma(cute.make_mma_atom(op), (1, 1, 1))


@cute.jit
def gemm(io_dtype, wtid, acc, sA, sB, a_mn_major: bool, b_mn_major: bool, accumulate: bool, n: int = 64,
         wait: bool = True):
    """acc (+)= A B on one warpgroup (A: (M, K), B: (N, K) smem views); waits for it unless `wait=False` (then the
    caller's `warpgroup.wait_group(0)` does). The tiled MMA is built here, not shared: its accumulate flag is IR
    state that must be defined in the control-flow region that uses it."""
    tiled_mma = make_mma(io_dtype, a_mn_major, b_mn_major, n)
    thr = tiled_mma.get_slice(wtid)
    tCrA = tiled_mma.make_fragment_A(thr.partition_A(sA))
    tCrB = tiled_mma.make_fragment_B(thr.partition_B(sB))
    warpgroup.fence()
    for kb in cutlass.range_constexpr(cute.size(tCrA, mode=[2])):
        tiled_mma.set(warpgroup.Field.ACCUMULATE, accumulate or kb != 0)
        cute.gemm(tiled_mma, acc, tCrA[None, None, kb], tCrB[None, None, kb], acc)
    warpgroup.commit_group()
    if cutlass.const_expr(wait):
        warpgroup.wait_group(0)


@cute.jit
def store_acc(io_dtype, wtid, tiled_mma, acc, dst):
    """Accumulator (fp32 registers of `tiled_mma`'s C layout) -> 16-bit smem tile `dst` with stmatrix."""
    atom = cute.make_copy_atom(warp.StMatrix8x8x16bOp(False, 4), io_dtype)
    tiled = cute.make_tiled_copy_C(atom, tiled_mma)
    thr = tiled.get_slice(wtid)
    frag = cute.make_rmem_tensor_like(acc, io_dtype)
    frag.store(acc.load().to(io_dtype))
    cute.copy(tiled, tiled.retile(frag), thr.partition_D(dst))


@cute.jit
def store_rows(io_dtype, wtid, sO, mO, t0, head, v0, L):
    """A warpgroup's [64 x 64] 16-bit tile from smem to mO[t0 + r, head, v0 : v0 + 64] for r < L, in 16-byte
    vectors (mO: a [tokens, H, D] tensor; 128 threads as 16 rows x 8 vectors per pass)."""
    atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), io_dtype, num_bits_per_copy=128)
    tiled = cute.make_tiled_copy_tv(atom, cute.make_layout((16, 8), stride=(8, 1)), cute.make_layout((1, 8)))
    thr = tiled.get_slice(wtid)
    gO = cute.local_tile(cute.domain_offset((t0, cute.assume(v0, divby=64)), mO[None, head, None]), (64, 64), (0, 0))
    src = thr.partition_S(sO)
    dst = thr.partition_D(gO)
    coords = thr.partition_S(cute.make_identity_tensor((64, 64)))
    for m in cutlass.range_constexpr(cute.size(src, mode=[1])):
        r, _ = coords[(0, 0), m, 0]
        if r < L:
            cute.copy(tiled, src[None, m, None], dst[None, m, None])


def make_mma_rs(io_dtype, b_mn_major: bool, n: int = 64):
    """A one-warpgroup tiled MMA with (64 x n x 16) atoms, A (K-major, 16-bit) from registers, B from smem."""
    b_major = warpgroup.OperandMajorMode.MN if b_mn_major else warpgroup.OperandMajorMode.K
    op = warpgroup.MmaF16BF16Op(io_dtype, Float32, (64, n, 16), warpgroup.OperandSource.RMEM,
                                warpgroup.OperandMajorMode.K, b_major)
    return cute.make_tiled_mma(cute.make_mma_atom(op), (1, 1, 1))


@cute.jit
def acc_to_a(io_dtype, acc):
    """An fp32 accumulator of a 64 x N wgmma (one atom: per thread ((2, 2, N / 8), 1, 1) values -- column pairs,
    rows r and r + 8, N / 8 groups of 8 columns) as the 16-bit A operand of an RS wgmma with K = N: the same
    values, converted, viewed as ((2, 2, 2), 1, N / 16), i.e. k-block kb = column groups 2 kb and 2 kb + 1."""
    frag = cute.make_rmem_tensor_like(acc, io_dtype)
    frag.store(acc.load().to(io_dtype))
    return _as_a(frag)


@cute.jit
def _as_a(frag):
    """A 16-bit copy of an accumulator fragment viewed as an RS wgmma's A operand (see `acc_to_a`)."""
    lay = frag.layout
    s = lay.stride[0]
    groups = lay.shape[0][2]
    a_layout = cute.make_layout(((2, 2, 2), lay.shape[1], groups // 2),
                                stride=((s[0], s[1], s[2]), lay.stride[1], 2 * s[2]))
    return cute.make_tensor(frag.iterator, a_layout)


@cute.jit
def gemm_rs(io_dtype, wtid, acc, rA, sB, b_mn_major: bool, accumulate: bool, n: int = 64, wait: bool = True):
    """acc (+)= A B on one warpgroup, A from registers (`acc_to_a`), B an (N, K) smem view."""
    tiled_mma = make_mma_rs(io_dtype, b_mn_major, n)
    thr = tiled_mma.get_slice(wtid)
    tCrB = tiled_mma.make_fragment_B(thr.partition_B(sB))
    warpgroup.fence()
    for kb in cutlass.range_constexpr(cute.size(rA, mode=[2])):
        tiled_mma.set(warpgroup.Field.ACCUMULATE, accumulate or kb != 0)
        cute.gemm(tiled_mma, acc, rA[None, None, kb], tCrB[None, None, kb], acc)
    warpgroup.commit_group()
    if cutlass.const_expr(wait):
        warpgroup.wait_group(0)


@cute.jit
def split_hi_lo(io_dtype, src, s_hi, s_lo, tid, num_threads: int):
    """A [128 x 128] fp32 matrix `src` (a 2-D (row, col) view in global memory) -> 16-bit `s_hi` = io(src) and
    `s_lo` = io(src - hi) (2-D (row, col) smem views), by `num_threads` threads in runs of 8 columns (two 16-byte
    loads, one 16-byte store into each)."""
    for i in cutlass.range_constexpr(128 * 128 // 8 // num_threads):
        f = tid + num_threads * i
        r = f // (128 // 8)
        c8 = f % (128 // 8)
        x = cute.make_rmem_tensor((8,), Float32)
        cute.autovec_copy(cute.local_tile(src[r, None], (8,), (c8,)), x)
        hi = cute.make_rmem_tensor((8,), io_dtype)
        lo = cute.make_rmem_tensor((8,), io_dtype)
        for e in cutlass.range_constexpr(8):
            hi[e] = io_dtype(x[e])
            lo[e] = io_dtype(x[e] - Float32(hi[e]))
        cute.autovec_copy(hi, cute.local_tile(s_hi[r, None], (8,), (c8,)))
        cute.autovec_copy(lo, cute.local_tile(s_lo[r, None], (8,), (c8,)))
