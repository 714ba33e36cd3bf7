"""The decode step on tensor cores (every arch with warp-level tf32 MMA: SM90, SM100): GDN over a block of up to 8
new tokens per sequence in the chunk form, the state kept in registers as the MMA's accumulators.

`RecurrentStep` does four fp32 operations per state element and token on the CUDA cores; at 8 tokens and a large
batch that, not the state's bytes, bounds it. Here the tokens are one block of the chunk form (the math of
`reference.linear_attention`, chunk size 8; G_t the cumulative log decay, gamma_t = exp(G_t))::

    W = diag(gamma) K S0                   U = (I + A)^-1 diag(beta) (V - W),  A[t, s] = beta_t k_t.k_s e^(G_t - G_s), s < t
    O = diag(gamma) Q S0 + M U,            M[t, s] = q_t.k_s e^(G_t - G_s), s <= t   (q scaled)
    S_T = gamma_T S0 + K_d^T U,            K_d[s] = k_s e^(G_T - G_s)

so per state element the work is three MMA products, whatever the token count. Each product runs as 3xTF32 (hi hi
+ hi lo + lo hi of the operands split into two tf32 parts): fp32 accuracy (checked in float64 on the CPU: 1e-7
against the recurrence, where plain tf32 gives 3e-4 and bf16 3e-3). The tensor cores stay far from busy.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from .configs import STEP_GROUP, RecurrentConfig
from .recurrent_step import EPS, log_decay, sigmoid, warp_sum
from .views import flat

THREADS = 128          # 4 warps; warp w: 16 value columns of the CTA's 64 (the MMA's rows)
WARPS = THREADS // 32
COLS = 64              # value columns per CTA: two CTAs per (sequence, value head)
TOK = STEP_GROUP       # 8: the MMA's token dimension (n8, k8); tokens past the count are zero
PAD = 4                # floats of padding per staged q / k row: conflict-free dot products, 16-byte rows
KEY_STEPS = 16         # 128 keys in steps of 8 (the MMA's k8 / n8)
MIN_CTAS_PER_SM = 4
SMEM_CARVEOUT = 50   # percent of the SM's memory as shared (about 9 KB a CTA), fixed: no device query


@dsl_user_op
def split_tf32(x, *, loc=None, ip=None):
    """(hi, lo): x as two tf32 bit patterns, hi = x rounded to tf32, lo = (x - hi) rounded (3xTF32)."""
    i32 = T.i32()
    res = llvm.inline_asm(llvm.StructType.get_literal([i32, i32]), [Float32(x).ir_value(loc=loc, ip=ip)],
                          "{\n.reg .b32 h;\n.reg .f32 hf, r;\ncvt.rna.tf32.f32 h, $2;\nmov.b32 hf, h;\n"
                          "sub.f32 r, $2, hf;\nmov.b32 $0, h;\ncvt.rna.tf32.f32 $1, r;\n}",
                          "=r,=r,f", has_side_effects=False, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)
    return (Int32(llvm.extractvalue(i32, res, [0], loc=loc, ip=ip)),
            Int32(llvm.extractvalue(i32, res, [1], loc=loc, ip=ip)))


@dsl_user_op
def mma_tf32(a, b, c, *, loc=None, ip=None):
    """D = A B + C, m16n8k8, A and B as tf32 bit patterns (4 and 2 a thread), C and D fp32 (4 a thread), the PTX
    fragment layouts: a (row, col) = (gid, tig), (gid + 8, tig), (gid, tig + 4), (gid + 8, tig + 4); b (row, col)
    = (tig, gid), (tig + 4, gid); c = (gid, 2 tig), (gid, 2 tig + 1), (gid + 8, 2 tig), (gid + 8, 2 tig + 1)
    (gid = lane / 4, tig = lane % 4)."""
    f32 = T.f32()
    operands = ([Int32(x).ir_value(loc=loc, ip=ip) for x in a] + [Int32(x).ir_value(loc=loc, ip=ip) for x in b]
                + [Float32(x).ir_value(loc=loc, ip=ip) for x in c])
    res = llvm.inline_asm(llvm.StructType.get_literal([f32] * 4), operands,
                          "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {$0, $1, $2, $3}, {$4, $5, $6, $7}, "
                          "{$8, $9}, {$10, $11, $12, $13};",
                          "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f", has_side_effects=False,
                          asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)
    return [Float32(llvm.extractvalue(f32, res, [i], loc=loc, ip=ip)) for i in range(4)]


def state_element(j: int, c: int, tig, v0):
    """(key, value column) of accumulator c of key tile j: rows v0, v0 + 8, columns 8 j + 2 tig, 8 j + 2 tig + 1."""
    return 8 * j + 2 * tig + c % 2, v0 + 8 * (c // 2)


def split_all(values):
    """([hi], [lo]) of fp32 values."""
    parts = [split_tf32(x) for x in values]
    return [p[0] for p in parts], [p[1] for p in parts]


def as_a_operand(c):
    """A 16 x 8 tile held as accumulators (c0..c3: columns 2 tig, 2 tig + 1 of rows gid, gid + 8) as an A operand,
    split: its column 2 tig is fed as the MMA's k index tig and 2 tig + 1 as tig + 4. The B operand it meets must
    put its k rows in the same order (row 2 tig in b0, 2 tig + 1 in b1): the sum over k is the same."""
    return split_all((c[0], c[2], c[1], c[3]))


def mma3(a, b, c):
    """C + A B as 3xTF32: a = (hi, lo) of 4, b = (hi, lo) of 2; the small terms first."""
    c = mma_tf32(a[1], b[0], c)
    c = mma_tf32(a[0], b[1], c)
    return mma_tf32(a[0], b[0], c)


class TensorCoreStep:
    """GDN's decode step for `config.tokens` (1..8) new tokens per sequence in the chunk form on tf32 tensor cores.

    One CTA per (64 value columns, value head, sequence), 128 threads, no warp specialization, no pipelines.
    Warp w holds the state's transpose for value columns [64 vb + 16 w, + 16) and all 128 keys as 16 m16n8
    accumulator tiles (64 fp32 a thread): S^T[v, key] for v = v0, v0 + 8 (v0 = 64 vb + 16 w + gid) and key =
    8 j + 2 tig, 8 j + 2 tig + 1. As A operands the tiles feed W^T = S^T K^T and O^T = S^T Q^T with no data
    movement (`as_a_operand`); the update S^T <- gamma_T S^T + U^T K_d lands in the same tiles.
    Steps: the state's loads and v's are issued first; q and k (key = thread) are staged in shared memory,
    l2-normalized and scaled, with each token's beta and log decay (the gate-in-kernel and beta-sigmoid forms as
    `RecurrentStep`); the 8 x 8 matrices A, M and (I + A)^-1 are formed by 128 threads (a dot product each, then
    one column of the inverse each for 8 threads); then each warp runs its MMAs, writes o and the state.
    Launched early (PDL): every thread waits on the previous kernel before its first global access.
    Arguments as `RecurrentStep`'s (the spec ones unused).
    """

    def __init__(self, config: RecurrentConfig, io_dtype, g_dtype, beta_dtype):
        assert config.tensor_cores and not config.kda and not config.spec and 1 <= config.tokens <= TOK
        self.config = config
        self.io_dtype = io_dtype
        self.g_dtype = g_dtype
        self.beta_dtype = beta_dtype

    @cute.jit
    def __call__(self, q: cute.Tensor, k: cute.Tensor, v: cute.Tensor, g: cute.Tensor, beta: cute.Tensor,
                 a_log: cute.Tensor, dt_bias: cute.Tensor, h0: cute.Tensor, ht: cute.Tensor, cu_seqlens: cute.Tensor,
                 init_idx: cute.Tensor, final_idx: cute.Tensor, accepted: cute.Tensor, o: cute.Tensor, T: Int32,
                 N: Int32, scale: Float32, lower_bound: Float32, stream):
        self.kernel(flat(q), flat(k), flat(v), flat(g), flat(beta), a_log, dt_bias, h0, ht, init_idx, final_idx,
                    flat(o), T, scale, lower_bound).launch(grid=[self.config.head_dim // COLS, v.shape[2], N],
                                                           block=[THREADS, 1, 1], stream=stream,
                                                           min_blocks_per_mp=MIN_CTAS_PER_SM, use_pdl=True,
                                                           preferred_smem_carveout=SMEM_CARVEOUT)

    @cute.kernel
    def kernel(self, q: cute.Tensor, k: cute.Tensor, v: cute.Tensor, g: cute.Tensor, beta: cute.Tensor,
               a_log: cute.Tensor, dt_bias: cute.Tensor, h0: cute.Tensor, ht: cute.Tensor, init_idx: cute.Tensor,
               final_idx: cute.Tensor, o: cute.Tensor, T: Int32, scale: Float32, lower_bound: Float32):
        cfg = self.config
        K = cfg.head_dim
        NT = cfg.tokens
        tid, _, _ = cute.arch.thread_idx()
        vb, hv, n = cute.arch.block_idx()
        warp = tid // 32
        lane = tid % 32
        gid = lane // 4
        tig = lane % 4
        v0 = vb * COLS + warp * 16 + gid
        h = hv // cfg.group
        bos = n * T

        smem = cutlass.memory.SmemAllocator()
        # staged k (0) and q (1), normalized, q scaled; rows past the token count zero
        sQK = smem.allocate_tensor(Float32, cute.make_layout((2, TOK, K), stride=(TOK * (K + PAD), K + PAD, 1)), 16)
        sStat = smem.allocate_tensor(Float32, cute.make_layout((TOK, WARPS, 2), stride=(2 * WARPS, 2, 1)), 16)
        sTok = smem.allocate_tensor(Float32, cute.make_layout((TOK, 4), stride=(4, 1)), 16)  # beta, log decay, G
        sA = smem.allocate_tensor(Float32, cute.make_layout((TOK, TOK), stride=(TOK, 1)), 16)
        sM = smem.allocate_tensor(Float32, cute.make_layout((TOK, TOK), stride=(TOK, 1)), 16)
        sInv = smem.allocate_tensor(Float32, cute.make_layout((TOK, TOK), stride=(TOK, 1)), 16)

        # launched early (PDL): the setup above overlaps the previous kernel's tail; every thread waits for it
        # before its first global access (the previous step may write the pool slots this one reads)
        cute.arch.griddepcontrol_wait()
        cute.arch.griddepcontrol_launch_dependents()
        # the state's loads (64 a thread) and v's, all issued before any of them is waited on
        state = cute.make_rmem_tensor((4 * KEY_STEPS,), Float32)
        state.fill(0.0)
        if cutlass.const_expr(cfg.initial != "none"):
            slot = n
            if cutlass.const_expr(cfg.initial == "pool"):
                slot = init_idx[n]
            if slot >= 0:
                for j in cutlass.range_constexpr(KEY_STEPS):
                    for c in cutlass.range_constexpr(4):
                        key, col = state_element(j, c, tig, v0)
                        state[4 * j + c] = h0[slot, hv, key, col]
        vv = cute.make_rmem_tensor((4,), Float32)
        for c in cutlass.range_constexpr(4):
            t = 2 * tig + c % 2
            if t > NT - 1:
                t = NT - 1   # past the count: beta is 0, so the value is never used
            vv[c] = v[bos + t, hv, v0 + 8 * (c // 2)].to(Float32)

        self.stage(sQK, sStat, sTok, q, k, g, beta, a_log, dt_bias, bos, h, hv, tid, warp, lane, scale, lower_bound)
        self.small_matrices(sQK, sTok, sA, sM, sInv, tid)

        # W^T = S^T K^T and O0^T = S^T Q^T (rows: the warp's value columns; columns: tokens)
        w = [Float32(0.0)] * 4
        o0 = [Float32(0.0)] * 4
        for j in cutlass.range_constexpr(KEY_STEPS):
            a = as_a_operand([state[4 * j + c] for c in range(4)])
            kb = split_all((sQK[0, gid, 8 * j + 2 * tig], sQK[0, gid, 8 * j + 2 * tig + 1]))
            qb = split_all((sQK[1, gid, 8 * j + 2 * tig], sQK[1, gid, 8 * j + 2 * tig + 1]))
            w = mma3(a, kb, w)
            o0 = mma3(a, qb, o0)
        gam = [cute.math.exp(sTok[2 * tig + e, 2], fastmath=False) for e in range(2)]
        # R^T = beta (V - W)^T; U^T = R^T ((I + A)^-1)^T; O^T = gamma O0^T + U^T M^T
        r = [sTok[2 * tig + c % 2, 0] * (vv[c] - gam[c % 2] * w[c]) for c in range(4)]
        u = mma3(as_a_operand(r), split_all((sInv[gid, 2 * tig], sInv[gid, 2 * tig + 1])), [Float32(0.0)] * 4)
        ua = as_a_operand(u)
        out = mma3(ua, split_all((sM[gid, 2 * tig], sM[gid, 2 * tig + 1])), [gam[c % 2] * o0[c] for c in range(4)])
        for c in cutlass.range_constexpr(4):
            t = 2 * tig + c % 2
            if t < NT:
                o[bos + t, hv, v0 + 8 * (c // 2)] = self.io_dtype(out[c])

        # S_T^T = gamma_T S0^T + U^T K_d, K_d[s] = k_s e^(G_T - G_s)
        if cutlass.const_expr(cfg.final != "none"):
            g_last = sTok[NT - 1, 2]
            gamma_last = cute.math.exp(g_last, fastmath=False)
            kd = [cute.math.exp(g_last - sTok[2 * tig + e, 2], fastmath=False) for e in range(2)]
            for j in cutlass.range_constexpr(KEY_STEPS):
                b = split_all((sQK[0, 2 * tig, 8 * j + gid] * kd[0], sQK[0, 2 * tig + 1, 8 * j + gid] * kd[1]))
                tile = mma3(ua, b, [state[4 * j + c] * gamma_last for c in range(4)])
                for c in cutlass.range_constexpr(4):
                    state[4 * j + c] = tile[c]
            slot = n
            if cutlass.const_expr(cfg.final == "pool"):
                slot = final_idx[n]
            if slot >= 0:
                for j in cutlass.range_constexpr(KEY_STEPS):
                    for c in cutlass.range_constexpr(4):
                        key, col = state_element(j, c, tig, v0)
                        ht[slot, hv, key, col] = state[4 * j + c]

    @cute.jit
    def stage(self, sQK, sStat, sTok, q, k, g, beta, a_log, dt_bias, bos, h, hv, tid, warp, lane, scale,
              lower_bound):
        """q and k of every token at key `tid` into shared memory, normalized (l2norm) and q scaled; each token's
        beta (row 0 of sTok), log decay (1) and cumulative log decay G (2); tokens past the count: zero q, k and
        beta, G of the last token."""
        cfg = self.config
        NT = cfg.tokens
        qx = [q[bos + t, h, tid].to(Float32) for t in range(NT)]
        kx = [k[bos + t, h, tid].to(Float32) for t in range(NT)]
        if cutlass.const_expr(cfg.l2norm):
            for t in cutlass.range_constexpr(NT):
                sqq = warp_sum(qx[t] * qx[t])
                skk = warp_sum(kx[t] * kx[t])
                if lane == 0:
                    sStat[t, warp, 0] = sqq
                    sStat[t, warp, 1] = skk
        if tid < NT:
            bx = beta[bos + tid, hv].to(Float32)
            if cutlass.const_expr(cfg.beta_sigmoid):
                bx = sigmoid(bx)
                if cutlass.const_expr(cfg.neg_eigval):
                    bx = bx * Float32(2.0)
            a_head = Float32(1.0)
            if cutlass.const_expr(cfg.a_log):
                a_head = cute.math.exp(a_log[hv], fastmath=False)
            sTok[tid, 0] = bx
            sTok[tid, 1] = log_decay(cfg, g[bos + tid, hv].to(Float32), dt_bias, hv, a_head, lower_bound)
        cute.arch.sync_threads()
        for t in cutlass.range_constexpr(TOK):
            if cutlass.const_expr(t < NT):
                rq = scale
                rk = Float32(1.0)
                if cutlass.const_expr(cfg.l2norm):
                    nqq = Float32(0.0)
                    nkk = Float32(0.0)
                    for w in cutlass.range_constexpr(WARPS):
                        nqq = nqq + sStat[t, w, 0]
                        nkk = nkk + sStat[t, w, 1]
                    rq = scale * cute.math.rsqrt(nqq + Float32(EPS))
                    rk = cute.math.rsqrt(nkk + Float32(EPS))
                sQK[0, t, tid] = kx[t] * rk
                sQK[1, t, tid] = qx[t] * rq
            else:
                sQK[0, t, tid] = Float32(0.0)
                sQK[1, t, tid] = Float32(0.0)
        if tid < TOK:
            G = Float32(0.0)
            for s in cutlass.range_constexpr(NT):
                if s <= tid:
                    G = G + sTok[s, 1]
            sTok[tid, 2] = G
            if tid >= NT:
                sTok[tid, 0] = Float32(0.0)
        cute.arch.sync_threads()

    @cute.jit
    def small_matrices(self, sQK, sTok, sA, sM, sInv, tid):
        """A[t, s] = beta_t k_t.k_s e^(G_t - G_s) (s < t) and M[t, s] = q_t.k_s e^(G_t - G_s) (s <= t): threads 0-63
        and 64-127, one entry each; then (I + A)^-1 by forward substitution, one column each for threads 0-7."""
        K = self.config.head_dim
        i = tid % (TOK * TOK)
        t = i // TOK
        s = i % TOK
        which = tid // (TOK * TOK)   # 0: k_t . k_s; 1: q_t . k_s
        dot = Float32(0.0)
        for key in cutlass.range_constexpr(K):
            dot = dot + sQK[which, t, key] * sQK[0, s, key]
        seen = cutlass.select_(which == 1, s <= t, s < t)
        decay = cute.math.exp(cutlass.select_(seen, sTok[t, 2] - sTok[s, 2], Float32(0.0)), fastmath=False)
        value = cutlass.select_(seen, dot * decay, Float32(0.0))
        if which == 0:
            sA[t, s] = sTok[t, 0] * value
        else:
            sM[t, s] = value
        cute.arch.sync_threads()
        col = tid % TOK   # every thread solves (28 FMAs); threads 0-7 store their column
        x = []
        for r in cutlass.range_constexpr(TOK):
            acc = cutlass.select_(col == r, Float32(1.0), Float32(0.0))
            for c in cutlass.range_constexpr(r):
                acc = acc - sA[r, c] * x[c]
            x.append(acc)
        if tid < TOK:
            for r in cutlass.range_constexpr(TOK):
                sInv[r, col] = x[r]
        cute.arch.sync_threads()
