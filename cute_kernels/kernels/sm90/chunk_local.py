"""The chunk-local products of the chunked forward on SM90, held by the fused kernel (`ChunkedForwardSm90`) and
phase 1 (`ChunkPrepSm90`): the q / k / v load warp, the intra-chunk products on wgmma (GDN; KDA's anchored and
row-anchored forms) and their shared-memory tiles. Gates and the solve are `ChunkMath` (`self.math`), shared by
every arch.

Per chunk (rows r, i < L = tokens in the chunk; G = cumulative decay inside the chunk, log2 units):
  0. Gates (`ChunkMath`).
  1. Akk = beta_r 2^(G_r - G_i) k_r k_i (i < r < L, fp32 smem), Aqk = scale 2^(G_r - G_i) q_r k_i (i <= r, 16-bit);
     KDA then gates q, k in place and forms kb = k 2^G.
  2. The solve (`ChunkMath.solve_blocked`).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import cpasync

from ..chunk_math import C, KDA_ANCHOR_LIMIT, ChunkMath
from ..configs import GateForm
from . import wgmma_tiles as wt

HALF = 64     # V columns owned by one consumer warpgroup


class ChunkLocalSm90:
    """A chunk's local work: `io_dtype` (16-bit operands), `kda` (per-channel gates), `outputs` (whether Aqk is
    formed: the fused summary mode needs none); `math` (`ChunkMath`) holds the gates and the solve, its doubling
    levels on fp16 mma.sync. Methods run on the 256 consumer threads (`ctid`) or one
    consumer warpgroup (`wtid`, consumer `j`)."""

    def __init__(self, io_dtype, kda: bool, outputs: bool = True, gate: GateForm = GateForm()):
        self.io_dtype = io_dtype
        self.kda = kda
        self.outputs = outputs
        self.math = ChunkMath(io_dtype, kda, "fp16", gate)

    # compile-time state only: nothing to carry through the kernels' dynamic loops
    def __extract_mlir_values__(self):
        return []

    def __new_from_mlir_values__(self, values):
        return self

    def qkv_tma(self, q, k, v):
        """TMA atoms and tensors of the q, k, v chunk tiles [64 x 128] (flattened [tokens, H, 128] inputs)."""
        tile_layout = wt.first_stage(wt.smem_layout(C, 128, self.io_dtype))
        op = cpasync.CopyBulkTensorTileG2SOp()
        tma_q, tma_q_tensor = cpasync.make_tiled_tma_atom(op, wt.thd(q), tile_layout, (C, 128))
        tma_k, tma_k_tensor = cpasync.make_tiled_tma_atom(op, wt.thd(k), tile_layout, (C, 128))
        tma_v, tma_v_tensor = cpasync.make_tiled_tma_atom(op, wt.thd(v), tile_layout, (C, 128))
        return tma_q, tma_q_tensor, tma_k, tma_k_tensor, tma_v, tma_v_tensor

    @cute.jit
    def producer(self, sched, load, tma_q, mQ, tma_k, mK, tma_v, mV, sQ, sK, sV, num_stages: int, load_v: bool = True,
                 qk_group: int = 1):
        """The load warp: per chunk of every work tile, its head's q, k (and v) tiles [64 x 128] by TMA into a
        `num_stages`-deep ring. GVA: the work tile's head is a value head; q and k are read at head // qk_group."""
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, num_stages)
        work = sched.initial_work()
        while work.is_valid:
            head = work.head
            tok0 = work.tok_start
            for c in cutlass.range(work.chunk_end - work.chunk_start, unroll=1):
                load.producer_acquire(state)
                bar = load.producer_get_barrier(state)
                tiles = ((tma_q, mQ, sQ, qk_group), (tma_k, mK, sK, qk_group), (tma_v, mV, sV, 1))
                if cutlass.const_expr(not load_v):
                    tiles = tiles[:2]
                for tma, m, s, group in tiles:
                    h = head if group == 1 else head // group
                    g_head = cute.domain_offset((tok0 + c * C, 0), m[None, None, h])
                    g_tile = cute.local_tile(g_head, (C, 128), (0, 0))
                    s_part, g_part = cpasync.tma_partition(
                        tma, 0, cute.make_layout(1),
                        cute.group_modes(s, 0, 2), cute.group_modes(g_tile, 0, 2),
                    )
                    cute.copy(tma, g_part, s_part[(None, state.index)], tma_bar_ptr=bar)
                state.advance()
            work = sched.advance(work)
        load.producer_tail(state)

    def view(self, field, rows, cols, stages=1, mn_view=False):
        """(row, col, stage) view of a swizzled 16-bit smem field (see `wgmma_tiles.smem_layout`)."""
        layout = wt.smem_layout(rows, cols, self.io_dtype, stages, mn_view)
        return field.get_tensor(layout.outer, swizzle=layout.inner)

    @cute.jit
    def gdn_intra_issue(self, j, wtid, acc_kk, stage, sQ, sK, with_aqk: bool):
        """GDN step 1, issued (not waited): consumer 0 kk = k k^T, consumer 1 qk = q k^T (if `with_aqk`)."""
        if j == 0:
            self.gemm(wtid, acc_kk, sK[None, None, stage], sK[None, None, stage], False, False, False, wait=False)
        else:
            if cutlass.const_expr(with_aqk):  # Aqk only feeds the outputs
                self.gemm(wtid, acc_kk, sQ[None, None, stage], sK[None, None, stage], False, False, False,
                          wait=False)

    @cute.jit
    def gdn_intra_finish(self, j, wtid, acc_kk, cc_kk, L, scale, sG, sBeta, tAkk, sAqk, with_aqk: bool):
        """GDN step 1 after the wait: consumer 0 Akk = beta_r 2^(G_r - G_i) kk (i < r < L) -> fp32 smem; consumer 1
        Aqk = scale 2^(G_r - G_i) qk (i <= r) -> 16-bit smem."""
        # 2^(G_r - G_i) may overflow above the diagonal: computed everywhere, then selected away.
        if j == 0:
            for i in cutlass.range_constexpr(cute.size(acc_kk)):
                r, col = cc_kk[i]
                val = acc_kk[i] * cute.math.exp2(sG[r] - sG[col], fastmath=True) * sBeta[r]
                acc_kk[i] = cutlass.select_(col < r and r < L, val, Float32(0.0))
            for i in cutlass.range_constexpr(cute.size(acc_kk)):   # stores after all loads
                tAkk[i] = acc_kk[i]
        else:
            if cutlass.const_expr(with_aqk):
                for i in cutlass.range_constexpr(cute.size(acc_kk)):
                    r, col = cc_kk[i]
                    val = acc_kk[i] * cute.math.exp2(sG[r] - sG[col], fastmath=True) * scale
                    acc_kk[i] = cutlass.select_(col <= r, val, Float32(0.0))
                self.store_acc(wtid, self.make_mma(False, False), acc_kk, sAqk)

    def vec_copy(self):
        """A 256-thread tiled copy of 16-bit [rows x 128] tiles in 16-byte vectors: thread t moves channels
        8 (t % 16) .. 8 (t % 16) + 7 of rows t // 16, t // 16 + 16, ... (one row per vector)."""
        atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.io_dtype, num_bits_per_copy=128)
        return cute.make_tiled_copy_tv(atom, cute.make_layout((16, 16), stride=(16, 1)), cute.make_layout((1, 8)))

    @cute.jit
    def load_g8(self, sGk, r, d0, dst):
        """dst[0:8] = sGk[r, d0 : d0 + 8] (fp32, one 32-byte run of a row-major [64 x 128] tile)."""
        cute.autovec_copy(cute.local_tile(sGk[r, None], (8,), (cute.assume(d0, divby=8) // 8,)), dst)

    @cute.jit
    def kda_gating_vec(self, ctid, L, stage, sQ, sK, sKb, sGk, sGL):
        """In place per channel, in 16-byte vectors: q <- q 2^G, k <- k 2^(G_L - G) (0 past the end), kb = k 2^G
        (beta is in X; sKb: the K-major (token, channel) view of the kb buffer)."""
        io = self.io_dtype
        tiled = self.vec_copy()
        thr = tiled.get_slice(ctid)
        tQ = thr.partition_S(sQ[None, None, stage])
        tK = thr.partition_S(sK[None, None, stage])
        tKb = thr.partition_D(sKb)
        crd = thr.partition_S(cute.make_identity_tensor((C, 128)))
        for m in cutlass.range(cute.size(tQ, mode=[1]), unroll=1):
            r, d0 = crd[0, m, 0]
            gl8 = cute.make_rmem_tensor((8,), Float32)
            cute.autovec_copy(cute.local_tile(sGL, (8,), (cute.assume(d0, divby=8) // 8,)), gl8)
            q8 = cute.make_rmem_tensor_like(tQ[None, m, None])
            k8 = cute.make_rmem_tensor_like(tK[None, m, None])
            cute.copy(tiled, tQ[None, m, None], q8)
            cute.copy(tiled, tK[None, m, None], k8)
            g8 = cute.make_rmem_tensor((8,), Float32)
            self.load_g8(sGk, r, d0, g8)
            kb8 = cute.make_rmem_tensor_like(k8)
            for e in cutlass.range_constexpr(8):
                eg = cute.math.exp2(g8[e], fastmath=True)
                egl = cutlass.select_(r < L, cute.math.exp2(gl8[e] - g8[e], fastmath=True), Float32(0.0))
                kv = Float32(k8[e])
                kb8[e] = io(kv * eg)
                k8[e] = io(kv * egl)
                q8[e] = io(Float32(q8[e]) * eg)
            cute.copy(tiled, kb8, tKb[None, m, None])
            cute.copy(tiled, k8, tK[None, m, None])
            cute.copy(tiled, q8, tQ[None, m, None])

    @cute.jit
    def kda_factors_vec(self, ctid, stage, qb: int, anchor, lo, sQ, sK, sL, sLq, sR, sGk):
        """The anchored factors of `kda_block` in 16-byte vectors: rows r >= lo of sL = k 2^(G_r - G_a) (and
        sLq = q 2^(G_r - G_a)); sR[i] = k[16 qb + i] 2^(G_a - G[16 qb + i])."""
        io = self.io_dtype
        outputs = self.outputs
        tiled = self.vec_copy()
        thr = tiled.get_slice(ctid)
        tQ = thr.partition_S(sQ[None, None, stage])
        tK = thr.partition_S(sK[None, None, stage])
        tL = thr.partition_D(sL)
        tLq = thr.partition_D(sLq)
        crd = thr.partition_S(cute.make_identity_tensor((C, 128)))
        for m in cutlass.range(cute.size(tK, mode=[1]), unroll=1):
            r, d0 = crd[0, m, 0]
            if r >= lo:
                g8 = cute.make_rmem_tensor((8,), Float32)
                ga8 = cute.make_rmem_tensor((8,), Float32)
                self.load_g8(sGk, r, d0, g8)
                self.load_g8(sGk, anchor, d0, ga8)
                f8 = cute.make_rmem_tensor((8,), Float32)
                for e in cutlass.range_constexpr(8):
                    f8[e] = cute.math.exp2(g8[e] - ga8[e], fastmath=True)
                k8 = cute.make_rmem_tensor_like(tK[None, m, None])
                cute.copy(tiled, tK[None, m, None], k8)
                for e in cutlass.range_constexpr(8):
                    k8[e] = io(Float32(k8[e]) * f8[e])
                cute.copy(tiled, k8, tL[None, m, None])
                if cutlass.const_expr(outputs):  # Aqk only feeds the outputs
                    q8 = cute.make_rmem_tensor_like(tQ[None, m, None])
                    cute.copy(tiled, tQ[None, m, None], q8)
                    for e in cutlass.range_constexpr(8):
                        q8[e] = io(Float32(q8[e]) * f8[e])
                    cute.copy(tiled, q8, tLq[None, m, None])
        # sR: the 16 rows of column block qb, one vector per thread.
        tKr = thr.partition_S(cute.local_tile(sK[None, None, stage], (16, 128), (qb, 0)))
        tR = thr.partition_D(sR)
        crd_r = thr.partition_S(cute.make_identity_tensor((16, 128)))
        i, d0 = crd_r[0, 0, 0]
        g8 = cute.make_rmem_tensor((8,), Float32)
        ga8 = cute.make_rmem_tensor((8,), Float32)
        self.load_g8(sGk, 16 * qb + i, d0, g8)
        self.load_g8(sGk, anchor, d0, ga8)
        k8 = cute.make_rmem_tensor_like(tKr[None, 0, None])
        cute.copy(tiled, tKr[None, 0, None], k8)
        for e in cutlass.range_constexpr(8):
            k8[e] = io(Float32(k8[e]) * cute.math.exp2(ga8[e] - g8[e], fastmath=True))
        cute.copy(tiled, k8, tR[None, 0, None])

    @cute.jit
    def kda_intra(self, j, ctid, wtid, L, scale, stage, sQ, sK, sAkk, sAqk, sL, sGk, sBeta, sFlag, st):
        """KDA Akk (fp32, beta on rows) and Aqk (bf16, scaled) without overflow: anchored per 16-column block on
        wgmma (warpgroup 0 for k, 1 for q), or, past KDA_ANCHOR_LIMIT, the exact path (diagonal blocks as exact
        channel sums). Spec and tests: cute_kernels/reference/kda_intra.py."""
        io = self.io_dtype
        sLq = self.view(st.sKb, C, 128)[None, None, 0]      # left factors of the q rows (K-major A)
        sR = self.view(st.sVnew, 16, 128)[None, None, 0]    # right factor of one column block
        exact = sFlag[0] != 0
        not_exact = sFlag[0] == 0
        if exact:   # column block 3 and the diagonal blocks' upper halves are not written by the blocks below
            for e in cutlass.range(ctid, C * C, 256, unroll=4):
                sAkk[e // C, e % C] = Float32(0.0)
                sAqk[e // C, e % C] = io(0.0)
        cute.arch.barrier(barrier_id=1, number_of_threads=256)
        for qb in cutlass.range_constexpr(4):
            # fast: anchor = first row of the block, rows >= it; exact: anchor = last row, rows below the block
            anchor = Int32(16 * qb)
            lo = Int32(16 * qb)
            if exact:
                anchor = Int32(16 * qb + 15)
                lo = Int32(16 * qb + 16)
            if cutlass.const_expr(qb < 3):
                self.kda_block(j, ctid, wtid, L, scale, stage, qb, anchor, lo, sQ, sK, sAkk, sAqk, sL, sLq, sR,
                               sGk, sBeta)
            else:
                if not_exact:
                    self.kda_block(j, ctid, wtid, L, scale, stage, qb, anchor, lo, sQ, sK, sAkk, sAqk, sL, sLq, sR,
                                   sGk, sBeta)
        if exact:
            # Diagonal 16 x 16 blocks: exact sums over channels, 2^(G_r - G_i) <= 1 for i <= r.
            for e in cutlass.range(ctid, 4 * 256, 256, unroll=1):
                base = (e // 256) * 16
                r = base + (e % 256) // 16
                i = base + e % 16
                if i <= r:
                    skk = Float32(0.0)
                    sqk = Float32(0.0)
                    for d in cutlass.range(128, unroll=8):
                        kid = Float32(sK[i, d, stage]) * cute.math.exp2(sGk[r, d] - sGk[i, d], fastmath=True)
                        skk = skk + Float32(sK[r, d, stage]) * kid
                        sqk = sqk + Float32(sQ[r, d, stage]) * kid
                    if i < r and r < L:
                        sAkk[r, i] = skk * sBeta[r]
                    sAqk[r, i] = io(sqk * scale)
            cute.arch.barrier(barrier_id=1, number_of_threads=256)

    @cute.jit
    def kda_block(self, j, ctid, wtid, L, scale, stage, qb: int, anchor, lo, sQ, sK, sAkk, sAqk, sL, sLq, sR, sGk,
                  sBeta):
        """Column block qb of Akk / Aqk from rows >= lo: [x_r 2^(G_r - G_anchor)] @ [k_i 2^(G_anchor - G_i)]^T."""
        io = self.io_dtype
        outputs = self.outputs
        thr16 = self.make_mma(False, False, 16).get_slice(wtid)
        cc16 = thr16.partition_C(cute.make_identity_tensor((C, 16)))
        acc16 = cute.make_rmem_tensor(thr16.partition_shape_C((C, 16)), Float32)
        self.kda_factors_vec(ctid, stage, qb, anchor, lo, sQ, sK, sL, sLq, sR, sGk)
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.barrier(barrier_id=1, number_of_threads=256)
        # Writes the whole 64 x 16 column block (no zero fill needed); the exact path then overwrites its diagonal.
        if j == 0:
            self.gemm(wtid, acc16, sL, sR, False, False, False, 16)
            for i in cutlass.range_constexpr(cute.size(acc16)):
                r, col = cc16[i]
                acc16[i] = cutlass.select_(r >= lo and r > 16 * qb + col and r < L, acc16[i] * sBeta[r], Float32(0.0))
            for i in cutlass.range_constexpr(cute.size(acc16)):
                r, col = cc16[i]
                sAkk[r, 16 * qb + col] = acc16[i]
        else:
            if cutlass.const_expr(outputs):
                self.gemm(wtid, acc16, sLq, sR, False, False, False, 16)
                for i in cutlass.range_constexpr(cute.size(acc16)):
                    r, col = cc16[i]
                    acc16[i] = cutlass.select_(r >= lo and r >= 16 * qb + col, acc16[i] * scale, Float32(0.0))
                for i in cutlass.range_constexpr(cute.size(acc16)):
                    r, col = cc16[i]
                    sAqk[r, 16 * qb + col] = io(acc16[i])
        cute.arch.barrier(barrier_id=1, number_of_threads=256)

    @cute.jit
    def kda_row_factors(self, ctid, L, stage, sQ, sK, sKb, sL, sLq, sR, sC, sGk, sGL, q_scale):
        """Factors of the row-anchored Akk / Aqk in 16-byte vectors (row r of block m, anchor a = 16 m,
        f = 2^(G_r - G_a) <= 1): sL[r] = k f, sLq[r] = q f, band 0 right factor R0 = k / f, band delta
        R0 c_(m + delta, m); then the gating in place: q <- q 2^G, k <- k 2^(G_L - G) (0 past the end), kb = k 2^G.
        `q_scale` (phase 1 with TMA stores: the attention scale) multiplies the gated q."""
        io = self.io_dtype
        tiled = self.vec_copy()
        thr = tiled.get_slice(ctid)
        tQ = thr.partition_S(sQ[None, None, stage])
        tK = thr.partition_S(sK[None, None, stage])
        tKb = thr.partition_D(sKb)
        tL = thr.partition_D(sL)
        tLq = thr.partition_D(sLq)
        tR = [thr.partition_D(sR[delta]) for delta in range(4)]
        crd = thr.partition_S(cute.make_identity_tensor((C, 128)))
        gl8 = cute.make_rmem_tensor((8,), Float32)   # G_L of this thread's channels (the same for its 4 rows)
        cute.autovec_copy(cute.local_tile(sGL, (8,), (cute.assume(crd[0, 0, 0][1], divby=8) // 8,)), gl8)
        for m in cutlass.range_constexpr(4):
            r, d0 = crd[0, m, 0]
            g8 = cute.make_rmem_tensor((8,), Float32)
            ga8 = cute.make_rmem_tensor((8,), Float32)
            self.load_g8(sGk, r, d0, g8)
            self.load_g8(sGk, 16 * m, d0, ga8)
            ega8 = cute.make_rmem_tensor((8,), Float32)
            cute.autovec_copy(cute.local_tile(sC[6 + m, None], (8,), (cute.assume(d0, divby=8) // 8,)), ega8)
            q8 = cute.make_rmem_tensor_like(tQ[None, m, None])
            k8 = cute.make_rmem_tensor_like(tK[None, m, None])
            cute.copy(tiled, tQ[None, m, None], q8)
            cute.copy(tiled, tK[None, m, None], k8)
            lk8 = cute.make_rmem_tensor_like(k8)
            lq8 = cute.make_rmem_tensor_like(k8)
            r08 = cute.make_rmem_tensor_like(k8)
            kb8 = cute.make_rmem_tensor_like(k8)
            r0 = cute.make_rmem_tensor((8,), Float32)
            for e in cutlass.range_constexpr(8):
                x = g8[e] - ga8[e]
                f = cute.math.exp2(x, fastmath=True)
                kv = Float32(k8[e])
                qv = Float32(q8[e])
                lk8[e] = io(kv * f)
                lq8[e] = io(qv * f)
                r0[e] = kv * cute.math.exp2(-x, fastmath=True)
                r08[e] = io(r0[e])
                eg = ega8[e] * f
                egl = cutlass.select_(r < L, cute.math.exp2(gl8[e] - g8[e], fastmath=True), Float32(0.0))
                kb8[e] = io(kv * eg)
                k8[e] = io(kv * egl)
                q8[e] = io(qv * (eg * q_scale))
            cute.copy(tiled, lk8, tL[None, m, None])
            cute.copy(tiled, lq8, tLq[None, m, None])
            cute.copy(tiled, r08, tR[0][None, m, None])
            cute.copy(tiled, kb8, tKb[None, m, None])
            cute.copy(tiled, k8, tK[None, m, None])
            cute.copy(tiled, q8, tQ[None, m, None])
            for delta in cutlass.range_constexpr(1, 4 - m):
                pair = m if delta == 1 else (3 + m if delta == 2 else 5)   # sC row of (m + delta, m)
                c8 = cute.make_rmem_tensor((8,), Float32)
                cute.autovec_copy(cute.local_tile(sC[pair, None], (8,), (cute.assume(d0, divby=8) // 8,)), c8)
                rd8 = cute.make_rmem_tensor_like(k8)
                for e in cutlass.range_constexpr(8):
                    rd8[e] = io(r0[e] * c8[e])
                cute.copy(tiled, rd8, tR[delta][None, m, None])

    def kda_row_accumulators(self, wtid):
        """This thread's slices and fp32 accumulators of the four band products (64 x {64, 48, 32, 16} tiles)."""
        thr = [self.make_mma(False, False, 64 - 16 * delta).get_slice(wtid) for delta in range(4)]
        acc = [cute.make_rmem_tensor(thr[delta].partition_shape_C((C, 64 - 16 * delta)), Float32)
               for delta in range(4)]
        return thr, acc

    @cute.jit
    def kda_row_issue(self, wtid, acc, sA, sR):
        """The row-anchored Akk / Aqk, one consumer warpgroup, issued (not waited): product delta = sA (L_k or L_q,
        64 x 128) times the band-delta right factors (64 - 16 delta rows)."""
        for delta in cutlass.range_constexpr(4):
            self.gemm(wtid, acc[delta], sA, sR[delta], False, False, False, 64 - 16 * delta, wait=False)

    @cute.jit
    def kda_row_finish(self, wtid, L, scale, thr, acc, tAkk, sAqk, sBeta, kk: bool):
        """The row-anchored Akk / Aqk, after the wait: element (r, i) of the chunk's matrix comes from product
        r // 16 - i // 16 (0 above the diagonal blocks): every product's accumulator holds the first 64 - 16 delta
        columns in the same per-thread order, so the bands merge in registers by selects. kk: Akk[r, i] = beta_r A
        (i < r < L) -> fp32 (tAkk: this thread's part of it), else Aqk[r, i] = scale A (i <= r) -> 16-bit, stmatrix."""
        cc = thr[0].partition_C(cute.make_identity_tensor((C, C)))
        a = acc[0]
        for i in cutlass.range_constexpr(cute.size(a)):
            r, col = cc[i]
            band = r // 16 - col // 16
            x = a[i]
            for delta in cutlass.range_constexpr(1, 4):
                if cutlass.const_expr(i < cute.size(acc[delta])):
                    x = cutlass.select_(band == delta, acc[delta][i], x)
            if cutlass.const_expr(kk):
                a[i] = cutlass.select_(col < r and r < L, x * sBeta[r], Float32(0.0))
            else:
                a[i] = cutlass.select_(col <= r, x * scale, Float32(0.0))
        if cutlass.const_expr(kk):
            for i in cutlass.range_constexpr(cute.size(a)):   # stores after all loads
                tAkk[i] = a[i]
        else:
            self.store_acc(wtid, self.make_mma(False, False), a, sAqk)

    @cute.jit
    def store_acc(self, wtid, tiled_mma, acc, dst):
        wt.store_acc(self.io_dtype, wtid, tiled_mma, acc, dst)

    @cute.jit
    def store_rows(self, wtid, sO, mO, t0, head, v0, L):
        wt.store_rows(self.io_dtype, wtid, sO, mO, t0, head, v0, L)

    def make_mma(self, a_mn_major: bool, b_mn_major: bool, n: int = 64):
        return wt.make_mma(self.io_dtype, a_mn_major, b_mn_major, n)

    @cute.jit
    def gemm(self, wtid, acc, sA, sB, a_mn_major: bool, b_mn_major: bool, accumulate: bool, n: int = 64,
             wait: bool = True):
        wt.gemm(self.io_dtype, wtid, acc, sA, sB, a_mn_major, b_mn_major, accumulate, n, wait)
