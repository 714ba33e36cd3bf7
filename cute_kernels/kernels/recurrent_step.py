"""The recurrent step (every arch, no tensor cores): GDN / KDA token by token over a state kept in registers, for
decoding a few new tokens per sequence. Memory-bound on the state: per (sequence, value head) it reads the
K x V fp32 state once and writes it once, whatever the number of tokens.

Per token, with q, k (l2-normalized if asked) and the decay a (exp of g, per head or per key)::

    S <- diag(a) S;  u = beta (v - k^T S);  S <- S + k u^T;  o = scale q^T S = scale (q^T S_dec + (q.k) u)

the last form needs one reduction over k per token for both k^T S and q^T S (q.k is a scalar).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from .configs import RecurrentConfig
from .views import flat

THREADS = 128   # 4 warps: warp w holds state rows [32 w, 32 w + 32)
COLS = 32       # state columns per CTA: lane l holds column 32 vb + l
WARPS = THREADS // 32
EPS = 1e-6      # l2norm: x / sqrt(sum x^2 + EPS), as FLA
MIN_CTAS_PER_SM = 4   # the register budget ptxas gets (128 a thread): at 80 (6 a SM) or its own choice it spilled
STAGED = 3            # token buffers of q, k, decay and warp sums in shared memory
SMEM_CARVEOUT = 25    # percent of the SM's memory as shared (3 KB a CTA; the rest stays L1), fixed: no device query


@cute.jit
def warp_sum(x):
    for i in cutlass.range_constexpr(5):
        x = x + cute.arch.shuffle_sync_bfly(x, offset=16 >> i)
    return x


@cute.jit
def softplus(x):
    """log(1 + exp(x)), x itself above 20 (FLA's threshold)."""
    return cutlass.select_(x > Float32(20.0), x, cute.math.log(Float32(1.0) + cute.math.exp(x, fastmath=False),
                                                              fastmath=False))


@cute.jit
def sigmoid(x):
    return Float32(1.0) / (Float32(1.0) + cute.math.exp(-x, fastmath=False))


class RecurrentStep:
    """One CTA per (32 state columns, value head, sequence); 128 threads, no warp specialization, no pipelines.

    Thread (warp w, lane l) holds S[32 w + r, 32 vb + l] for r < 32 in registers. Per token: every thread stages
    one of the 128 entries of q, k (and KDA's decay) in shared memory, with warp sums of q.q, k.k, q.k; each
    thread decays its 32 rows and sums k_r S_r and q_r S_r over them; the four warps' partial sums meet in shared
    memory; every thread then has k^T S and q^T S of its column, updates its rows, and warp 0 writes o. Token
    t + 1 is staged (and token t + 2 loaded) between token t's partial sums and its one barrier: three q / k
    buffers and two partial-sum buffers keep every reader ahead of the next writer with one barrier per token.

    Tensors as the op has them ([B, T, ...]; varlen B = 1; flattened here to [B * T, ...]): q, k [B, T, H, K];
    v, o [B, T, HV, V]; g [B, T, HV] or [B, T, HV, K]; beta [B, T, HV]; a_log [HV] fp32; dt_bias [HV] or [HV * K]
    fp32; h0, ht [rows, HV, K, V] fp32; cu_seqlens [N + 1], init_idx, final_idx [N] ([N, S] with `spec`),
    accepted [N] int32 (each a 1-element dummy when unused).
    Scalars: T (tokens per sequence when not varlen), N, scale, lower_bound.
    """

    def __init__(self, config: RecurrentConfig, io_dtype, g_dtype, beta_dtype):
        self.config = config
        self.io_dtype = io_dtype
        self.g_dtype = g_dtype
        self.beta_dtype = beta_dtype

    @cute.jit
    def __call__(self, q: cute.Tensor, k: cute.Tensor, v: cute.Tensor, g: cute.Tensor, beta: cute.Tensor,
                 a_log: cute.Tensor, dt_bias: cute.Tensor, h0: cute.Tensor, ht: cute.Tensor, cu_seqlens: cute.Tensor,
                 init_idx: cute.Tensor, final_idx: cute.Tensor, accepted: cute.Tensor, o: cute.Tensor, T: Int32,
                 N: Int32, scale: Float32, lower_bound: Float32, stream):
        self.kernel(flat(q), flat(k), flat(v), flat(g), flat(beta), a_log, dt_bias, h0, ht, cu_seqlens, init_idx,
                    final_idx, accepted, flat(o), T, scale, lower_bound).launch(
                                               grid=[self.config.head_dim // COLS, v.shape[2], N],
                                               block=[THREADS, 1, 1], stream=stream,
                                               min_blocks_per_mp=MIN_CTAS_PER_SM,
                                               preferred_smem_carveout=SMEM_CARVEOUT)

    @cute.kernel
    def kernel(self, q: cute.Tensor, k: cute.Tensor, v: cute.Tensor, g: cute.Tensor, beta: cute.Tensor,
               a_log: cute.Tensor, dt_bias: cute.Tensor, h0: cute.Tensor, ht: cute.Tensor, cu_seqlens: cute.Tensor,
               init_idx: cute.Tensor, final_idx: cute.Tensor, accepted: cute.Tensor, o: cute.Tensor, T: Int32,
               scale: Float32, lower_bound: Float32):
        cfg = self.config
        K = cfg.head_dim
        ROWS = K // WARPS
        tid, _, _ = cute.arch.thread_idx()
        vb, hv, n = cute.arch.block_idx()
        warp = tid // 32
        lane = tid % 32
        col = vb * COLS + lane
        row0 = warp * ROWS
        h = hv // cfg.group

        smem = cutlass.memory.SmemAllocator()
        # q, k, the per-key decay and the warp sums of a token: three buffers (token t's are read up to its state
        # update, after the barrier, while token t + 1's are being staged)
        s_q = smem.allocate_tensor(Float32, cute.make_layout((STAGED, K), stride=(K, 1)), 16)
        s_k = smem.allocate_tensor(Float32, cute.make_layout((STAGED, K), stride=(K, 1)), 16)
        s_a = smem.allocate_tensor(Float32, cute.make_layout((STAGED, K), stride=(K, 1)), 16)
        s_stat = smem.allocate_tensor(Float32, cute.make_layout((STAGED, WARPS, 4), stride=(4 * WARPS, 4, 1)), 16)
        staging = (s_q, s_k, s_a, s_stat)
        s_part = smem.allocate_tensor(Float32, cute.make_layout((2, 2, WARPS, COLS),
                                                                stride=(2 * WARPS * COLS, WARPS * COLS, COLS, 1)), 16)

        bos = n * T
        length = T
        if cutlass.const_expr(cfg.varlen):
            bos = cu_seqlens[n]
            length = cu_seqlens[n + 1] - bos

        state = cute.make_rmem_tensor((ROWS,), Float32)
        state.fill(0.0)
        if cutlass.const_expr(cfg.initial != "none"):
            slot = n
            if cutlass.const_expr(cfg.initial == "pool"):
                if cutlass.const_expr(cfg.spec):
                    slot = init_idx[n, accepted[n] - 1]
                else:
                    slot = init_idx[n]
            if slot >= 0:
                for r in cutlass.range_constexpr(ROWS):
                    state[r] = h0[slot, hv, row0 + r, col]

        a_head = Float32(1.0)   # exp(A_log) of the gate-in-kernel forms
        if cutlass.const_expr(cfg.a_log):
            a_head = cute.math.exp(a_log[hv], fastmath=False)

        # One barrier per token: token t + 1's q, k (and decay) are staged while token t's partial sums are
        # formed, and each token's inputs are loaded a token ahead, so Sq tokens wait on global memory once.
        last = bos + length - 1
        zero = Float32(0.0)
        cq, ck, cv, cb, cg = zero, zero, zero, zero, zero
        nq, nk, nv, nb, ng = zero, zero, zero, zero, zero
        if length > 0:   # (an empty sequence reads nothing)
            cq, ck, cv, cb, cg = self.load_token(q, k, v, g, beta, bos, h, hv, tid, col)
            self.stage(staging, 0, cq, ck, cg, dt_bias, hv, tid, warp, lane, a_head, lower_bound)
            nxt = bos + 1
            if nxt > last:
                nxt = last
            nq, nk, nv, nb, ng = self.load_token(q, k, v, g, beta, nxt, h, hv, tid, col)
        cute.arch.sync_threads()
        for t in cutlass.range(length, unroll=1):
            buf = t % STAGED
            pbuf = t % 2
            tok = bos + t
            nqq = Float32(0.0)
            nkk = Float32(0.0)
            qk = Float32(0.0)
            for w in cutlass.range_constexpr(WARPS):
                nqq = nqq + s_stat[buf, w, 0]
                nkk = nkk + s_stat[buf, w, 1]
                qk = qk + s_stat[buf, w, 2]
            rq = scale
            rk = Float32(1.0)
            if cutlass.const_expr(cfg.l2norm):
                rq = scale * cute.math.rsqrt(nqq + Float32(EPS))
                rk = cute.math.rsqrt(nkk + Float32(EPS))
            decay = Float32(1.0)
            if cutlass.const_expr(not cfg.kda):
                decay = cute.math.exp(self.gate(cg, dt_bias, hv, a_head, lower_bound), fastmath=False)
            pk = Float32(0.0)
            pq = Float32(0.0)
            for r in cutlass.range_constexpr(ROWS):
                if cutlass.const_expr(cfg.kda):
                    state[r] = state[r] * s_a[buf, row0 + r]
                else:
                    state[r] = state[r] * decay
                pk = pk + s_k[buf, row0 + r] * state[r]
                pq = pq + s_q[buf, row0 + r] * state[r]
            s_part[pbuf, 0, warp, lane] = pk
            s_part[pbuf, 1, warp, lane] = pq
            # token t + 1 into the next buffer (its last reader, token t - 2, finished before the last barrier);
            # token t + 2's loads issued
            self.stage(staging, (t + 1) % STAGED, nq, nk, ng, dt_bias, hv, tid, warp, lane, a_head, lower_bound)
            vx = cv
            bx = cb
            cv, cb, cg = nv, nb, ng
            nxt = tok + 2
            if nxt > last:
                nxt = last
            nq, nk, nv, nb, ng = self.load_token(q, k, v, g, beta, nxt, h, hv, tid, col)
            cute.arch.sync_threads()

            if cutlass.const_expr(cfg.beta_sigmoid):
                bx = sigmoid(bx)
                if cutlass.const_expr(cfg.neg_eigval):
                    bx = bx * Float32(2.0)
            ks = Float32(0.0)
            qs = Float32(0.0)
            for w in cutlass.range_constexpr(WARPS):
                ks = ks + s_part[pbuf, 0, w, lane]
                qs = qs + s_part[pbuf, 1, w, lane]
            u = bx * (vx - ks * rk)
            if warp == 0:
                o[tok, hv, col] = (qs * rq + qk * rq * rk * u).to(self.io_dtype)
            uk = u * rk
            for r in cutlass.range_constexpr(ROWS):
                state[r] = state[r] + s_k[buf, row0 + r] * uk
            if cutlass.const_expr(cfg.spec):
                slot = final_idx[n, t]
                if slot >= 0:
                    for r in cutlass.range_constexpr(ROWS):
                        ht[slot, hv, row0 + r, col] = state[r]

        if cutlass.const_expr(cfg.final != "none" and not cfg.spec):
            slot = n
            if cutlass.const_expr(cfg.final == "pool"):
                slot = final_idx[n]
            if slot >= 0:
                for r in cutlass.range_constexpr(ROWS):
                    ht[slot, hv, row0 + r, col] = state[r]

    @cute.jit
    def stage(self, staging, buf, qx, kx, graw, dt_bias, hv, tid, warp, lane, a_head, lower_bound):
        """A token's q and k entry `tid` (and KDA's decay exp(g) at key `tid`) into buffer `buf`, with this warp's
        sums of q.q, k.k and q.k."""
        s_q, s_k, s_a, s_stat = staging
        s_q[buf, tid] = qx
        s_k[buf, tid] = kx
        if cutlass.const_expr(self.config.kda):
            s_a[buf, tid] = cute.math.exp(self.gate(graw, dt_bias, hv * self.config.head_dim + tid, a_head,
                                                    lower_bound), fastmath=False)
        sqq = warp_sum(qx * qx)
        skk = warp_sum(kx * kx)
        sqk = warp_sum(qx * kx)
        if lane == 0:
            s_stat[buf, warp, 0] = sqq
            s_stat[buf, warp, 1] = skk
            s_stat[buf, warp, 2] = sqk

    @cute.jit
    def load_token(self, q, k, v, g, beta, tok, h, hv, tid, col):
        """Token `tok`'s inputs for this thread, as fp32: q and k at key `tid`, v at column `col`, beta, and g (KDA:
        at key `tid`)."""
        gx = Float32(0.0)
        if cutlass.const_expr(self.config.kda):
            gx = g[tok, hv, tid].to(Float32)
        else:
            gx = g[tok, hv].to(Float32)
        return (q[tok, h, tid].to(Float32), k[tok, h, tid].to(Float32), v[tok, hv, col].to(Float32),
                beta[tok, hv].to(Float32), gx)

    @cute.jit
    def gate(self, x, dt_bias: cute.Tensor, bias_index, a_head, lower_bound):
        """The log decay from g's value `x`: as given, or FLA's gate-in-kernel forms."""
        cfg = self.config
        if cutlass.const_expr(cfg.gate_in_kernel):
            if cutlass.const_expr(cfg.dt_bias):
                x = x + dt_bias[bias_index]
            if cutlass.const_expr(cfg.lower_bound):
                x = lower_bound * sigmoid(a_head * x)
            else:
                x = -a_head * softplus(x)
        return x
