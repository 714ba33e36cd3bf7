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

from .configs import STEP_GROUP, RecurrentConfig
from .views import flat

THREADS = 128   # 4 warps: warp w holds state rows [32 w, 32 w + 32)
COLS = 32       # state columns per CTA: lane l holds column 32 vb + l
WARPS = THREADS // 32
EPS = 1e-6      # l2norm: x / sqrt(sum x^2 + EPS), as FLA
MIN_CTAS_PER_SM = 4   # the register budget ptxas gets (128 a thread): at 80 (6 a SM) or its own choice it spilled
GROUP = STEP_GROUP    # tokens staged in shared memory at once (their loads issued together: one memory latency)
SMEM_CARVEOUT = 50    # percent of the SM's memory as shared (up to 16 KB a CTA; the rest stays L1), fixed


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

    Thread (warp w, lane l) holds S[32 w + r, 32 vb + l] for r < 32 in registers. Tokens come GROUP at a time:
    every input of the group (q and k at key `tid`, KDA's decay, v of the CTA's columns, beta, GDN's decay) is loaded
    at once and staged in shared memory with the warp sums of q.q, k.k and q.k, so a group waits on global memory
    once. Per token each thread decays its 32 rows and sums k_r S_r and q_r S_r over them; the four warps' partial
    sums meet in shared memory (one barrier a token; two partial-sum buffers keep every reader ahead of the next
    writer); every thread then has k^T S and q^T S of its column, updates its rows, and warp 0 writes o.
    With `config.tokens` (no varlen, at most GROUP tokens) the count is static: one group, the token loop unrolled.
    Launched early (PDL): every thread waits on the previous kernel before its first global access.

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
                                               min_blocks_per_mp=MIN_CTAS_PER_SM, use_pdl=True,
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
        # a group's q, k (KDA: the decay per key), warp sums of q.q, k.k, q.k, v of the CTA's columns and (GDN) the
        # decay and beta per token
        s_q = smem.allocate_tensor(Float32, cute.make_layout((GROUP, K), stride=(K, 1)), 16)
        s_k = smem.allocate_tensor(Float32, cute.make_layout((GROUP, K), stride=(K, 1)), 16)
        s_a = s_k
        if cutlass.const_expr(cfg.kda):
            s_a = smem.allocate_tensor(Float32, cute.make_layout((GROUP, K), stride=(K, 1)), 16)
        s_stat = smem.allocate_tensor(Float32, cute.make_layout((GROUP, WARPS, 4), stride=(4 * WARPS, 4, 1)), 16)
        s_v = smem.allocate_tensor(Float32, cute.make_layout((GROUP, COLS), stride=(COLS, 1)), 16)
        s_tok = smem.allocate_tensor(Float32, cute.make_layout((GROUP, 2), stride=(2, 1)), 16)
        staging = (s_q, s_k, s_a, s_stat, s_v, s_tok)
        s_part = smem.allocate_tensor(Float32, cute.make_layout((2, 2, WARPS, COLS),
                                                                stride=(2 * WARPS * COLS, WARPS * COLS, COLS, 1)), 16)

        # launched early (PDL): the setup above overlaps the previous kernel's tail; every thread waits for it
        # before its first global access (the previous step may write the pool slots this one reads)
        cute.arch.griddepcontrol_wait()
        cute.arch.griddepcontrol_launch_dependents()
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

        # Tokens GROUP at a time (with `tokens`, all of them, a compile-time count): every input of the group
        # loaded at once and staged, then one barrier per token (the four warps' partial sums).
        work = (staging, s_part, state, q, k, v, g, beta, dt_bias, o, ht, final_idx, bos, length, n, h, hv, vb, tid,
                warp, lane, row0, col, scale, a_head, lower_bound)
        if cutlass.const_expr(cfg.tokens > 0):
            self.group(work, 0, cfg.tokens)
        else:
            for t0 in cutlass.range(0, length, GROUP, unroll=1):
                count = length - t0
                if count > GROUP:
                    count = GROUP
                self.group(work, t0, count)

        if cutlass.const_expr(cfg.final != "none" and not cfg.spec):
            slot = n
            if cutlass.const_expr(cfg.final == "pool"):
                slot = final_idx[n]
            if slot >= 0:
                for r in cutlass.range_constexpr(ROWS):
                    ht[slot, hv, row0 + r, col] = state[r]

    @cute.jit
    def group(self, work, t0, count):
        """Tokens t0 .. t0 + count - 1 of the sequence: staged, then one by one (`count` an int: unrolled)."""
        (staging, s_part, state, q, k, v, g, beta, dt_bias, o, ht, final_idx, bos, length, n, h, hv, vb, tid, warp,
         lane, row0, col, scale, a_head, lower_bound) = work
        cute.arch.sync_threads()   # the last group's tokens are done with the buffers
        self.stage(staging, q, k, v, g, beta, dt_bias, bos + t0, bos + length - 1, count, h, hv, vb, tid, warp, lane,
                   a_head, lower_bound)
        cute.arch.sync_threads()
        if cutlass.const_expr(isinstance(count, int)):
            for t in cutlass.range_constexpr(count):
                self.token(work, t0, t)
        else:
            for t in cutlass.range(count, unroll=1):
                self.token(work, t0, t)

    @cute.jit
    def token(self, work, t0, t):
        """Token t of the group at t0 (staged at t): decay, the partial sums, their exchange, u, o, the update."""
        cfg = self.config
        (staging, s_part, state, q, k, v, g, beta, dt_bias, o, ht, final_idx, bos, length, n, h, hv, vb, tid, warp,
         lane, row0, col, scale, a_head, lower_bound) = work
        s_q, s_k, s_a, s_stat, s_v, s_tok = staging
        ROWS = cfg.head_dim // WARPS
        pbuf = t % 2
        tok = bos + t0 + t
        nqq = Float32(0.0)
        nkk = Float32(0.0)
        qk = Float32(0.0)
        for w in cutlass.range_constexpr(WARPS):
            if cutlass.const_expr(cfg.l2norm):
                nqq = nqq + s_stat[t, w, 0]
                nkk = nkk + s_stat[t, w, 1]
            qk = qk + s_stat[t, w, 2]
        rq = scale
        rk = Float32(1.0)
        if cutlass.const_expr(cfg.l2norm):
            rq = scale * cute.math.rsqrt(nqq + Float32(EPS))
            rk = cute.math.rsqrt(nkk + Float32(EPS))
        decay = Float32(1.0)
        if cutlass.const_expr(not cfg.kda):
            decay = s_tok[t, 0]
        pk = Float32(0.0)
        pq = Float32(0.0)
        for r in cutlass.range_constexpr(ROWS):
            if cutlass.const_expr(cfg.kda):
                state[r] = state[r] * s_a[t, row0 + r]
            else:
                state[r] = state[r] * decay
            pk = pk + s_k[t, row0 + r] * state[r]
            pq = pq + s_q[t, row0 + r] * state[r]
        s_part[pbuf, 0, warp, lane] = pk
        s_part[pbuf, 1, warp, lane] = pq
        # (token t + 2 writes this buffer again after token t + 1's barrier, past every read of it below)
        cute.arch.sync_threads()

        ks = Float32(0.0)
        qs = Float32(0.0)
        for w in cutlass.range_constexpr(WARPS):
            ks = ks + s_part[pbuf, 0, w, lane]
            qs = qs + s_part[pbuf, 1, w, lane]
        u = s_tok[t, 1] * (s_v[t, lane] - ks * rk)
        if warp == 0:
            o[tok, hv, col] = (qs * rq + qk * rq * rk * u).to(self.io_dtype)
        uk = u * rk
        for r in cutlass.range_constexpr(ROWS):
            state[r] = state[r] + s_k[t, row0 + r] * uk
        if cutlass.const_expr(cfg.spec):
            slot = final_idx[n, t0 + t]
            if slot >= 0:
                for r in cutlass.range_constexpr(ROWS):
                    ht[slot, hv, row0 + r, col] = state[r]

    @cute.jit
    def stage(self, staging, q, k, v, g, beta, dt_bias, tok0, last, count, h, hv, vb, tid, warp, lane, a_head,
              lower_bound):
        """Tokens tok0 .. tok0 + count - 1 into shared memory: q and k at key `tid` (KDA: the decay exp(g) at key
        `tid`) with this warp's sums of q.q, k.k and q.k, v of the CTA's columns, and (thread t) token t's decay
        (GDN) and beta. Every load of the group is issued before the first is used (tokens past the sequence load
        its last one, never staged)."""
        cfg = self.config
        s_q, s_k, s_a, s_stat, s_v, s_tok = staging
        loads = count if isinstance(count, int) else GROUP
        toks = [self.clamp(tok0 + t, last) for t in range(loads)]
        qx = [q[toks[t], h, tid].to(Float32) for t in range(loads)]
        kx = [k[toks[t], h, tid].to(Float32) for t in range(loads)]
        gx = []
        if cutlass.const_expr(cfg.kda):
            gx = [g[toks[t], hv, tid].to(Float32) for t in range(loads)]
        vx = [v[self.clamp(tok0 + (tid + THREADS * m) // COLS, last), hv, vb * COLS + tid % COLS].to(Float32)
              for m in range(GROUP * COLS // THREADS)]
        mine = self.clamp(tok0 + tid % GROUP, last)   # thread t < GROUP: token t's scalars
        bx = beta[mine, hv].to(Float32)
        gh = Float32(0.0)
        if cutlass.const_expr(not cfg.kda):
            gh = g[mine, hv].to(Float32)
        for t in cutlass.range_constexpr(loads):
            if cutlass.const_expr(isinstance(count, int)):
                self.stage_token(staging, t, qx[t], kx[t], gx[t] if cfg.kda else None, dt_bias, hv, tid, warp, lane,
                                 a_head, lower_bound)
            else:
                if t < count:
                    self.stage_token(staging, t, qx[t], kx[t], gx[t] if cfg.kda else None, dt_bias, hv, tid, warp,
                                     lane, a_head, lower_bound)
        for m in cutlass.range_constexpr(GROUP * COLS // THREADS):
            s_v[(tid + THREADS * m) // COLS, tid % COLS] = vx[m]
        if tid < GROUP:
            if cutlass.const_expr(cfg.beta_sigmoid):
                bx = sigmoid(bx)
                if cutlass.const_expr(cfg.neg_eigval):
                    bx = bx * Float32(2.0)
            s_tok[tid, 1] = bx
            if cutlass.const_expr(not cfg.kda):
                s_tok[tid, 0] = cute.math.exp(self.gate(gh, dt_bias, hv, a_head, lower_bound), fastmath=False)

    @cute.jit
    def stage_token(self, staging, t, qx, kx, gx, dt_bias, hv, tid, warp, lane, a_head, lower_bound):
        """Token t's q and k at key `tid` (KDA: its decay) and this warp's sums of q.q, k.k and q.k."""
        s_q, s_k, s_a, s_stat, s_v, s_tok = staging
        s_q[t, tid] = qx
        s_k[t, tid] = kx
        if cutlass.const_expr(self.config.kda):
            s_a[t, tid] = cute.math.exp(self.gate(gx, dt_bias, hv * self.config.head_dim + tid, a_head, lower_bound),
                                        fastmath=False)
        sqk = warp_sum(qx * kx)
        if cutlass.const_expr(self.config.l2norm):   # the norms only for l2norm (q.k always: o needs it)
            sqq = warp_sum(qx * qx)
            skk = warp_sum(kx * kx)
            if lane == 0:
                s_stat[t, warp, 0] = sqq
                s_stat[t, warp, 1] = skk
        if lane == 0:
            s_stat[t, warp, 2] = sqk

    @cute.jit
    def clamp(self, tok, last):
        out = tok
        if tok > last:
            out = last
        return out

    @cute.jit
    def gate(self, x, dt_bias: cute.Tensor, bias_index, a_head, lower_bound):
        return log_decay(self.config, x, dt_bias, bias_index, a_head, lower_bound)


@cute.jit
def log_decay(cfg: RecurrentConfig, x, dt_bias: cute.Tensor, bias_index, a_head, lower_bound):
    """The log decay from g's value `x`: as given, or FLA's gate-in-kernel forms (both decode steps)."""
    if cutlass.const_expr(cfg.gate_in_kernel):
        if cutlass.const_expr(cfg.dt_bias):
            x = x + dt_bias[bias_index]
        if cutlass.const_expr(cfg.lower_bound):
            x = lower_bound * sigmoid(a_head * x)
        else:
            x = -a_head * softplus(x)
    return x
