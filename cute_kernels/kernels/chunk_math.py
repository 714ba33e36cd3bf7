"""The chunk-local math every arch's chunked forward shares (`ChunkMath`): FLA's gate forms applied as g and beta
are read, GDN's gate scan, KDA's gate prefetch and per-channel scan, and the solve X = (I + Akk)^-1 by recursive
doubling. CUDA cores, shared memory, cp.async and warp-level tf32 mma.sync only (no wgmma, no tcgen05): the
kernels of `sm90/` (and `sm100/`) hold one beside their own tensor-core products.

Per chunk (rows r, i < L = tokens in the chunk; G = cumulative decay inside the chunk, log2 units):
  0. Gates: GDN: G, 2^G, 2^(G_L - G), beta. KDA: G[r, d] per channel, beta.
  2. X = (I + Akk)^-1 in fp32 (Akk fp32 in shared memory), written as Xv = X diag(beta) and (GDN)
     Xk = X diag(beta 2^G) in 16-bit.
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
from cutlass import Float16, Float32, Int32
from cutlass.cute.nvgpu import cpasync, warp

from cute_kernels.reference.kda_intra import ANCHOR_LIMIT_LOG2

from .configs import GateForm

C = 64        # chunk length (tokens)
# fp32 Akk / X row stride (floats): 16-byte rows (4-float loads), 8 consecutive rows' loads on distinct banks.
AKK_STRIDE = C + 4
SOLVE_Y = 1024   # floats of the SM90 solve's scratch (the fp16 levels' four 32 x 8 fp16 warp slices take 512)
Y_STRIDE = 40    # `solve_levels_mma`'s Y rows (padded: conflict-free fragment loads)
SOLVE_Y_MMA = 32 * Y_STRIDE
LOG2E = math.log2(math.e)
# KDA: largest decay (log2) inside a 16-row block for the anchored products; beyond it the exact diagonal path runs.
KDA_ANCHOR_LIMIT = ANCHOR_LIMIT_LOG2


class ChunkMath:
    """Gates and the solve of one chunk, for a kernel's 256 consumer threads (`ctid`): `kda` (per-channel gates),
    `levels` (the operands of the solve's doubling levels on mma.sync: "fp16", m16n8k16 on four warps, or "tf32",
    m16n8k8 on eight), `gate` (`GateForm`: how g and beta are read). Spec: `cute_kernels.reference`
    (blocked_solve.py for the solve)."""

    def __init__(self, io_dtype, kda: bool, levels: str, gate: GateForm = GateForm()):
        if levels not in ("fp16", "tf32"):
            raise ValueError(f"levels must be 'fp16' or 'tf32', got {levels!r}")
        self.io_dtype = io_dtype
        self.kda = kda
        self.levels = levels
        self.gate = gate

    # compile-time state only: nothing to carry through the kernels' dynamic loops
    def __extract_mlir_values__(self):
        return []

    def __new_from_mlir_values__(self, values):
        return self

    @cute.jit
    def rows_in(self, n):
        """min(n, C): the rows of a chunk whose sequence has n tokens left."""
        if n > C:
            n = Int32(C)
        return n

    @cute.jit
    def gate_params(self, mALog, mDtBias, head, ctid):
        """This tile's gate parameters (`GateForm`): (A = exp(A_log[head]) or 1, dt_bias at (head) or, KDA, at
        (head, key ctid % 128), or 0)."""
        a = Float32(1.0)
        bias = Float32(0.0)
        if cutlass.const_expr(self.gate.a_log):
            a = cute.math.exp(Float32(mALog[head]), fastmath=False)
        if cutlass.const_expr(self.gate.dt_bias):
            if cutlass.const_expr(self.kda):
                bias = Float32(mDtBias[head * 128 + ctid % 128])
            else:
                bias = Float32(mDtBias[head])
        return a, bias

    @cute.jit
    def gate_value(self, x, gp, lower_bound):
        """The log decay of a raw g value `x` (`GateForm.g`; gp = `gate_params`)."""
        if cutlass.const_expr(self.gate.g != "log"):
            a, bias = gp
            x = x + bias
            if cutlass.const_expr(self.gate.g == "bounded"):
                x = lower_bound / (Float32(1.0) + cute.math.exp(-(a * x), fastmath=False))
            else:
                sp = cute.math.log(Float32(1.0) + cute.math.exp(x, fastmath=False), fastmath=False)
                x = -a * cutlass.select_(x > Float32(20.0), x, sp)   # softplus, x itself above 20 (FLA's)
        return x

    @cute.jit
    def beta_value(self, x):
        """beta from its raw value (`GateForm.beta`)."""
        if cutlass.const_expr(self.gate.beta != "value"):
            x = Float32(1.0) / (Float32(1.0) + cute.math.exp(-x, fastmath=False))
            if cutlass.const_expr(self.gate.beta == "sigmoid2"):
                x = x * Float32(2.0)
        return x

    @cute.jit
    def gate_rows(self, ctid, t, tok_end, head, mG, mBeta):
        """The raw gate rows of token t + ctid for the 64 threads that hold one, in their storage dtypes (0 past the
        sequence end): (g, g of the row 32 away (ctid ^ 32: the other warp's, for `gdn_gates`' scan), beta); KDA's
        g values are 0 here (they go through `kda_g_prefetch`). Loads only: `gate_values` converts them a chunk
        later, so no warp waits on these loads before the barriers in between."""
        gv = Float32(0.0)
        gw = Float32(0.0)
        if cutlass.const_expr(not self.kda):
            gv = mG.element_type(0.0)
            gw = mG.element_type(0.0)
        bv = mBeta.element_type(0.0)
        if ctid < C:
            if t + ctid < tok_end:
                if cutlass.const_expr(not self.kda):
                    gv = mG[t + ctid, head]
                bv = mBeta[t + ctid, head]
            if cutlass.const_expr(not self.kda):
                if t + (ctid ^ 32) < tok_end:
                    gw = mG[t + (ctid ^ 32), head]
        return gv, gw, bv

    @cute.jit
    def gate_values(self, ctid, t, tok_end, gv, gw, bv, gp, lower_bound):
        """`gate_rows`' raw values of the chunk at token t in fp32, FLA's gate arguments applied (`gate_value`,
        `beta_value`; gp = `gate_params`), 0 past the sequence end."""
        g_own = Float32(0.0)
        g_other = Float32(0.0)
        beta = Float32(0.0)
        if ctid < C:
            if t + ctid < tok_end:
                if cutlass.const_expr(not self.kda):
                    g_own = self.gate_value(Float32(gv), gp, lower_bound)
                beta = self.beta_value(Float32(bv))
            if cutlass.const_expr(not self.kda):
                if t + (ctid ^ 32) < tok_end:
                    g_other = self.gate_value(Float32(gw), gp, lower_bound)
        return g_own, g_other, beta

    @cute.jit
    def gdn_gates(self, ctid, L, gv, gw, bv, sG, sEG, sEGL, sBeta):
        """G_r (log2 units), 2^G_r, 2^(G_last - G_r) and beta_r (both 0 past the end; g = 0 there, so G_63 = G_last).
        Each of the two warps scans its own 32 rows and, with the same shuffles, the other warp's (`gw`), so both
        hold both halves' totals bit for bit and no barrier or shared memory joins them."""
        if ctid < C:
            lane = ctid % 32
            x = gv * LOG2E   # this warp's rows
            y = gw * LOG2E   # the other warp's rows
            for off in cutlass.range_constexpr(5):
                xs = cute.arch.shuffle_sync_up(x, 1 << off)
                ys = cute.arch.shuffle_sync_up(y, 1 << off)
                if lane >= (1 << off):
                    x = x + xs
                    y = y + ys
            own = cute.arch.shuffle_sync(x, 31)
            other = cute.arch.shuffle_sync(y, 31)
            s0 = own          # rows 0..31
            s1 = other        # rows 32..63
            if ctid >= 32:
                s0 = other
                s1 = own
                x = x + s0
            glast = s0 + s1
            sG[ctid] = x
            sEG[ctid] = cute.math.exp2(x, fastmath=True)
            egl = Float32(0.0)
            bl = Float32(0.0)
            if ctid < L:
                egl = cute.math.exp2(glast - x, fastmath=True)
                bl = bv
            sEGL[ctid] = egl
            sBeta[ctid] = bl

    @cute.jit
    def kda_g_prefetch(self, ctid, t0, L, head, mG, sGk):
        """cp.async of the raw g values that thread ctid scans in `kda_gates` (channel ctid % 128, rows
        32 (ctid // 128) .. + 31 of the chunk at token t0) into sGk; rows >= L get 0. One commit group."""
        d = ctid % 128
        h = ctid // 128
        atom = cute.make_copy_atom(cpasync.CopyG2SOp(), Float32, num_bits_per_copy=32)
        for rr in cutlass.range_constexpr(32):
            r = 32 * h + rr
            if r < L:
                cute.copy(atom, cute.local_tile(mG[t0 + r, head, None], (1,), (d,)),
                          cute.local_tile(sGk[r, None], (1,), (d,)))
            else:
                sGk[r, d] = Float32(0.0)
        cute.arch.cp_async_commit_group()

    @cute.jit
    def kda_g_prefetch_vec(self, ctid, t0, L, head, mG, sGk):
        """`kda_g_prefetch` in 16-byte cp.async (thread ctid: channels 4 (ctid % 32) + [0, 4) of rows ctid // 32 + 8 i);
        rows >= L get 0. One commit group; `kda_gates(g_vec=True)` waits for it and syncs the consumers."""
        c4 = ctid % 32
        atom = cute.make_copy_atom(cpasync.CopyG2SOp(), Float32, num_bits_per_copy=128)
        for i in cutlass.range_constexpr(8):
            r = ctid // 32 + 8 * i
            if r < L:
                cute.copy(atom, cute.local_tile(mG[t0 + r, head, None], (4,), (c4,)),
                          cute.local_tile(sGk[r, None], (4,), (c4,)))
            else:
                for e in cutlass.range_constexpr(4):
                    sGk[r, 4 * c4 + e] = Float32(0.0)
        cute.arch.cp_async_commit_group()

    @cute.jit
    def kda_gates(self, ctid, t0, L, head, mG, mBeta, sGk, sGL, sBeta, sFlag, beta_pre, gp, lower_bound, sC=None,
                  g_vec: bool = False):
        """G[r, d] (log2 units), G[L-1, d], beta_r; sFlag[0] = 1 if some 16-row block decays by more than
        KDA_ANCHOR_LIMIT in some channel (then the exact diagonal path runs). With `sC` ([10, 128] fp32, phase 1's
        row-anchored products): rows 0-5 the factors 2^(G[16 p, d] - G[16 q, d]) of block pairs (p, q) = (1, 0),
        (2, 1), (3, 2), (2, 0), (3, 1), (3, 0); rows 6-9 2^G[16 m, d], m = 0..3. g's raw values pass through
        `gate_value` (gp: `gate_params`, this thread's channel ctid % 128). Needs g and beta prefetched
        (`kda_g_prefetch`, or `kda_g_prefetch_vec` with `g_vec`: then a consumer barrier follows the wait).
        All 256 consumer threads: thread ctid scans channel ctid % 128 over rows [32 h, 32 h + 32), h = ctid // 128."""
        d = ctid % 128
        h = ctid // 128
        if ctid == 0:
            sFlag[0] = Int32(0)
        if ctid < C:
            sBeta[ctid] = beta_pre    # prefetched (0 past the end)
        gl = cute.make_rmem_tensor((32,), Float32)
        cute.arch.cp_async_wait_group(0)   # this thread's raw g rows are in sGk (0 past the end)
        if cutlass.const_expr(g_vec):
            cute.arch.barrier(barrier_id=1, number_of_threads=256)   # and every other thread's
        for rr in cutlass.range_constexpr(32):
            x = sGk[32 * h + rr, d]
            if cutlass.const_expr(self.gate.g != "log"):   # FLA's gate arguments; rows past the end stay 0
                x = cutlass.select_(32 * h + rr < L, self.gate_value(x, gp, lower_bound), Float32(0.0))
            gl[rr] = x * LOG2E
        for rr in cutlass.range_constexpr(1, 32):
            gl[rr] = gl[rr] + gl[rr - 1]
        # the largest right factor of a block is 2^(G[first row] - G[last row]); offsets cancel
        worst = cutlass.max(gl[0] - gl[15], gl[16] - gl[31])
        if h == 0:
            for rr in cutlass.range_constexpr(32):
                sGk[rr, d] = gl[rr]
            sGL[d] = gl[31]
        cute.arch.barrier(barrier_id=1, number_of_threads=256)
        if h == 1:
            off = sGL[d]
            for rr in cutlass.range_constexpr(32):
                sGk[32 + rr, d] = gl[rr] + off
            sGL[d] = gl[31] + off
            if cutlass.const_expr(sC is not None):
                g0 = sGk[0, d]
                g16 = sGk[16, d]
                g32 = gl[0] + off
                g48 = gl[16] + off
                sC[0, d] = cute.math.exp2(g16 - g0, fastmath=True)
                sC[1, d] = cute.math.exp2(g32 - g16, fastmath=True)
                sC[2, d] = cute.math.exp2(g48 - g32, fastmath=True)
                sC[3, d] = cute.math.exp2(g32 - g0, fastmath=True)
                sC[4, d] = cute.math.exp2(g48 - g16, fastmath=True)
                sC[5, d] = cute.math.exp2(g48 - g0, fastmath=True)
                sC[6, d] = cute.math.exp2(g0, fastmath=True)
                sC[7, d] = cute.math.exp2(g16, fastmath=True)
                sC[8, d] = cute.math.exp2(g32, fastmath=True)
                sC[9, d] = cute.math.exp2(g48, fastmath=True)
        if worst > KDA_ANCHOR_LIMIT:
            sFlag[0] = Int32(1)

    @cute.jit
    def solve_blocked(self, ctid, sAkk, sY, sXv, sXk, sBeta, sEG, sRow=None):
        """X = (I + A)^-1 for strictly-lower A [64, 64] (fp32 smem), 256 threads, by recursive doubling; X's strict
        lower part is written transposed into A's unused upper triangle. Writes Xv = X diag(beta) and (GDN, sXk given)
        Xk = X diag(beta 2^G), or with `sRow` diag(sRow) X diag(beta), in 16-bit.
        Spec (same steps, CPU-tested): cute_kernels/reference/blocked_solve.py."""
        io = self.io_dtype
        if ctid < C:
            # Right-looking substitution on each 16 x 16 diagonal block, one column per thread; rows above c stay 0.
            base = (ctid // 16) * 16
            c = ctid % 16
            x = cute.make_rmem_tensor((16,), Float32)
            for r in cutlass.range_constexpr(16):
                x[r] = cutlass.select_(c == r, Float32(1.0), Float32(0.0))
            for i in cutlass.range_constexpr(16):
                xi = x[i]
                for r in cutlass.range_constexpr(i + 1, 16):
                    x[r] = x[r] - sAkk[base + r, base + i] * xi
            for r in cutlass.range_constexpr(16):
                if r > c:
                    sAkk[base + c, base + r] = x[r]
        cute.arch.barrier(barrier_id=1, number_of_threads=256)
        if cutlass.const_expr(self.levels == "fp16"):
            self.solve_levels_f16(ctid, sAkk, sY)
        else:
            self.solve_levels_mma(ctid, sAkk, sY)
        # Xv, Xk in 16-bit: thread (r, i-group) writes columns [i0, i0 + 8) of row r; X[r, i] (i < r) is at [i, r].
        r = ctid % 64
        xb = cute.make_rmem_tensor((8,), Float32)
        fb = cute.make_rmem_tensor((8,), Float32)
        yv = cute.make_rmem_tensor((8,), io)
        yk = cute.make_rmem_tensor((8,), io)
        for pss in cutlass.range_constexpr(2):
            i0 = 8 * (ctid // 64) + 32 * pss
            cute.autovec_copy(cute.local_tile(sBeta, (8,), (cute.assume(i0, divby=8) // 8,)), fb)
            for e in cutlass.range_constexpr(8):
                xv = sAkk[i0 + e, r]
                xv = cutlass.select_(i0 + e > r, Float32(0.0), xv)
                xv = cutlass.select_(i0 + e == r, Float32(1.0), xv)
                xb[e] = xv * fb[e]
                yv[e] = io(xb[e])
            cute.autovec_copy(yv, cute.local_tile(sXv[r, None], (8,), (cute.assume(i0, divby=8) // 8,)))
            if cutlass.const_expr(sRow is not None):
                fr = sRow[r]
                for e in cutlass.range_constexpr(8):
                    yk[e] = io(xb[e] * fr)
                cute.autovec_copy(yk, cute.local_tile(sXk[r, None], (8,), (cute.assume(i0, divby=8) // 8,)))
            elif cutlass.const_expr(not self.kda and sXk is not None):
                cute.autovec_copy(cute.local_tile(sEG, (8,), (cute.assume(i0, divby=8) // 8,)), fb)
                for e in cutlass.range_constexpr(8):
                    yk[e] = io(xb[e] * fb[e])
                cute.autovec_copy(yk, cute.local_tile(sXk[r, None], (8,), (cute.assume(i0, divby=8) // 8,)))

    @cute.jit
    def solve_levels_mma(self, ctid, sAkk, sY):
        """`solve_blocked`'s doubling levels h = 16, 32 as tf32 mma.sync (m16n8k8, cvt.rna, fp32 accumulation):
        Y = A_10 X_00, then X_10 = -(Y + X_11^strict Y), X_11's unit diagonal applied in fp32. Spec:
        `reference/blocked_solve.py: blocked_unit_lower_inverse(operand="tf32")`."""
        warp_i = ctid // 32
        lane = ctid % 32
        mma = cute.make_tiled_mma(warp.MmaTF32Op((16, 8, 8)))
        thr = mma.get_slice(lane)
        cc = thr.partition_C(cute.make_identity_tensor((16, 8)))   # (row, column) of each accumulator element
        for lvl in cutlass.range_constexpr(2):
            h = 16 * (lvl + 1)
            # this warp's tile of X_10 (both products): h = 16: block pair warp_i / 2 (b0 = 0, 32), n-tile
            # warp_i % 2; h = 32: 2 m-tiles x 4 n-tiles
            pair = warp_i // 2 if lvl == 0 else 0
            mt = 0 if lvl == 0 else warp_i // 4
            nt = warp_i % 2 if lvl == 0 else warp_i % 4
            b0 = 2 * h * pair
            b1 = b0 + h
            y_off = pair * 16 * Y_STRIDE
            if warp_i < (4 if lvl == 0 else 8):
                # product 1: Y = A_10 X_00 (A: (i, s) = A[b1 + i, b0 + s]; B: (c, s) = X_00[s, c], stored at
                # [b0 + c, b0 + s] for s > c)
                gA = cute.make_tensor(sAkk.iterator + (b1 * AKK_STRIDE + b0),
                                      cute.make_layout((h, h), stride=(AKK_STRIDE, 1)))
                gB = cute.make_tensor(sAkk.iterator + (b0 * AKK_STRIDE + b0),
                                      cute.make_layout((h, h), stride=(AKK_STRIDE, 1)))
                y = self.mma_tf32(mma, thr, gA, gB, mt, nt, h, 0, 2)
                for e in cutlass.range_constexpr(cute.size(y)):
                    r, c = cc[e]
                    sY[y_off + (16 * mt + r) * Y_STRIDE + 8 * nt + c] = y[e]
            cute.arch.barrier(barrier_id=1, number_of_threads=256)
            if warp_i < (4 if lvl == 0 else 8):
                # product 2: Z = X_11^strict Y (A: (i, s) = X_11[i, s] at [b1 + s, b1 + i], i > s; B: (c, s) =
                # Y[s, c] from sY)
                gA = cute.make_tensor(sAkk.iterator + (b1 * AKK_STRIDE + b1),
                                      cute.make_layout((h, h), stride=(1, AKK_STRIDE)))
                gB = cute.make_tensor(sY.iterator + y_off, cute.make_layout((h, h), stride=(1, Y_STRIDE)))
                z = self.mma_tf32(mma, thr, gA, gB, mt, nt, h, 1, 0)
                for e in cutlass.range_constexpr(cute.size(z)):
                    r, c = cc[e]
                    i = 16 * mt + r
                    n = 8 * nt + c
                    sAkk[b0 + n, b1 + i] = -(sY[y_off + i * Y_STRIDE + n] + z[e])
            cute.arch.barrier(barrier_id=1, number_of_threads=256)

    @cute.jit
    def solve_levels_f16(self, ctid, sAkk, sY):
        """`solve_blocked`'s doubling levels h = 16, 32 as fp16 mma.sync (m16n8k16, fp32 accumulation) on warps 0-3,
        each warp an 8-column strip of X_10, whose two products need no other warp: Y = A_10 X_00 (kept in fp32;
        its fp16 copy goes through the warp's own 32 x 8 slice of sY as the second product's B operand), then
        X_10 = -(Y + X_11^strict Y), X_11's unit diagonal applied in fp32. One CTA barrier a level. Spec:
        `reference/blocked_solve.py: blocked_unit_lower_inverse(operand="fp16")`."""
        warp_i = ctid // 32
        lane = ctid % 32
        mma = cute.make_tiled_mma(warp.MmaF16BF16Op(Float16, Float32, (16, 8, 16)))
        thr = mma.get_slice(lane)
        cc = thr.partition_C(cute.make_identity_tensor((16, 8)))   # (row, column) of each accumulator element
        sYh = cute.make_tensor(cute.recast_ptr(sY.iterator + warp_i * 128, dtype=Float16),
                               cute.make_layout((32, 8), stride=(8, 1)))
        for lvl in cutlass.range_constexpr(2):
            h = 16 * (lvl + 1)
            if warp_i < 4:
                # level 16: block pair warp_i // 2 (b0 = 0, 32), strip warp_i % 2; level 32: strip warp_i
                b0 = (warp_i // 2) * 32 if lvl == 0 else 0
                nt = warp_i % 2 if lvl == 0 else warp_i
                b1 = b0 + h
                ys = []
                for mt in cutlass.range_constexpr(h // 16):
                    # Y rows 16 mt..: A (i, s) = A[b1 + 16 mt + i, b0 + s]; B (n, s) = X_00[s, 8 nt + n], stored at
                    # [b0 + 8 nt + n, b0 + s] for s > 8 nt + n
                    rA = cute.make_rmem_tensor(thr.partition_shape_A((16, h)), Float16)
                    cA = thr.partition_A(cute.make_identity_tensor((16, h)))
                    for e in cutlass.range_constexpr(cute.size(rA)):
                        i, k = cA[e]
                        rA[e] = Float16(sAkk[b1 + 16 * mt + i, b0 + k])
                    rB = cute.make_rmem_tensor(thr.partition_shape_B((8, h)), Float16)
                    cB = thr.partition_B(cute.make_identity_tensor((8, h)))
                    for e in cutlass.range_constexpr(cute.size(rB)):
                        n, k = cB[e]
                        c = 8 * nt + n
                        v = sAkk[b0 + c, b0 + k]
                        v = cutlass.select_(k < c, Float32(0.0), v)
                        v = cutlass.select_(k == c, Float32(1.0), v)
                        rB[e] = Float16(v)
                    y = cute.make_rmem_tensor(thr.partition_shape_C((16, 8)), Float32)
                    y.fill(0.0)
                    cute.gemm(mma, y, rA, rB, y)
                    for e in cutlass.range_constexpr(cute.size(y)):
                        r, c = cc[e]
                        sYh[16 * mt + r, c] = Float16(y[e])
                    ys.append(y)
                cute.arch.sync_warp()
                for mt in cutlass.range_constexpr(h // 16):
                    # Z rows 16 mt..: A (i, s) = X_11[16 mt + i, s] (i > s) at [b1 + s, b1 + 16 mt + i]; B (n, s) =
                    # Y[s, n]; X_11 is lower triangular, so only s < 16 (mt + 1) counts
                    kz = 16 * (mt + 1)
                    rA = cute.make_rmem_tensor(thr.partition_shape_A((16, kz)), Float16)
                    cA = thr.partition_A(cute.make_identity_tensor((16, kz)))
                    for e in cutlass.range_constexpr(cute.size(rA)):
                        i, k = cA[e]
                        v = sAkk[b1 + k, b1 + 16 * mt + i]
                        rA[e] = Float16(cutlass.select_(16 * mt + i > k, v, Float32(0.0)))
                    rB = cute.make_rmem_tensor(thr.partition_shape_B((8, kz)), Float16)
                    cB = thr.partition_B(cute.make_identity_tensor((8, kz)))
                    for e in cutlass.range_constexpr(cute.size(rB)):
                        n, k = cB[e]
                        rB[e] = sYh[k, n]
                    z = cute.make_rmem_tensor(thr.partition_shape_C((16, 8)), Float32)
                    z.fill(0.0)
                    cute.gemm(mma, z, rA, rB, z)
                    y = ys[mt]
                    for e in cutlass.range_constexpr(cute.size(z)):
                        r, c = cc[e]
                        sAkk[b0 + 8 * nt + c, b1 + 16 * mt + r] = -(y[e] + z[e])
                cute.arch.sync_warp()   # the staging slice is rewritten at the next level
            cute.arch.barrier(barrier_id=1, number_of_threads=256)

    @cute.jit
    def mma_tf32(self, mma, thr, gA, gB, mt, nt, h: int, a_mask: int, b_mask: int):
        """A B^T (fp32, returned) on one warp's 16 x 8 tile (mt, nt) in tf32: gA (M, K), gB (N, K) fp32 views [h, h].
        a_mask 1: keep A's strict lower triangle (i > s). b_mask 2: B is a unit lower triangle's transpose."""
        tA = thr.partition_A(cute.local_tile(gA, (16, h), (mt, 0)))
        tB = thr.partition_B(cute.local_tile(gB, (8, h), (nt, 0)))
        cA = thr.partition_A(cute.local_tile(cute.make_identity_tensor((h, h)), (16, h), (mt, 0)))
        cB = thr.partition_B(cute.local_tile(cute.make_identity_tensor((h, h)), (8, h), (nt, 0)))
        rA = mma.make_fragment_A(tA)
        rB = mma.make_fragment_B(tB)
        iA = cute.recast_tensor(rA, Int32)
        iB = cute.recast_tensor(rB, Int32)
        for e in cutlass.range_constexpr(cute.size(tA)):
            v = tA[e]
            if cutlass.const_expr(a_mask == 1):
                i, k = cA[e]
                v = cutlass.select_(i > k, v, Float32(0.0))
            iA[e] = Int32(cute.arch.cvt_f32_tf32(v))
        for e in cutlass.range_constexpr(cute.size(tB)):
            v = tB[e]
            if cutlass.const_expr(b_mask == 2):
                n, k = cB[e]
                v = cutlass.select_(k < n, Float32(0.0), v)
                v = cutlass.select_(k == n, Float32(1.0), v)
            iB[e] = Int32(cute.arch.cvt_f32_tf32(v))
        acc = cute.make_rmem_tensor(thr.partition_shape_C((16, 8)), Float32)
        acc.fill(0.0)
        cute.gemm(mma, acc, rA, rB, acc)
        return acc

    @cute.jit
    def tile4(self, sA, row, col):
        """sA[row, col : col + 4] of the fp32 Akk / X buffer (col a multiple of 4: one 16-byte vector)."""
        return cute.local_tile(sA[row, None], (4,), (cute.assume(col, divby=4) // 4,))

    @cute.jit
    def load4(self, sA, row, col, dst):
        cute.autovec_copy(self.tile4(sA, row, col), dst)
