"""SM90 (Hopper) fused chunked forward of the gated delta rule: GDN (a scalar decay per head and token) and, with
`kda`, KDA (a decay per key channel). Each chunk's local work (`chunk_local.ChunkLocalSm90`) and the state update in
one kernel; float64 spec: `cute_kernels.reference.chunk_gated_delta_rule_ref`.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import cpasync, warpgroup

from schedulers.device import TileScheduler

from ..configs import FusedConfig
from . import wgmma_tiles as wt
from ..chunk_math import AKK_STRIDE, SOLVE_Y, C
from .chunk_local import HALF, ChunkLocalSm90

NUM_STAGES = 2  # q/k/v ring depth for GDN (KDA: 1)


class ChunkedForwardSm90:
    """Fused GDN / KDA forward on Hopper: one CTA per work tile (sequence, head, chunk range), state on chip.

    Warp roles (384 threads, 3 warpgroups):
    - warpgroup 0, warp 0: producer (registers lowered): TMA of the q, k, v chunk tiles [64 x 128] into a
      `NUM_STAGES`-deep ring. Warps 1-3 idle.
    - warpgroups 1 and 2: consumers (registers raised). Consumer j owns V columns [64 j, 64 j + 64) of the state
      S (K x V fp32, wgmma accumulators) for the whole tile.
    Pipelines: `PipelineTmaAsync` q/k/v ring (NUM_STAGES stages, producer = 1 thread, consumers = 8 warps);
    named barriers (id 1: both consumer warpgroups; ids 2, 3: one; id 4: the 64 GDN gate threads).

    Modes (`FusedConfig.mode`): `forward` (start from initial_state[seq], write o and final_state[seq]); `summary`
    (block 0 / 1: the segment from 0 with the real v / from I with zero v, end state to summary[block * slots +
    seg_slot] = (h_ext, M), no o); `segment_outputs` (start from start_states[seg_slot], write o).

    Per chunk (rows r < L):
      0-2. `ChunkLocalSm90`: gates, intra-chunk products (and q S_j, rows scaled by scale 2^G_r), the solve.
      3. Consumer j: w[:, cols j] = Xk k (KDA: Xv kb) -> -w bf16 smem; u_j = Xv v_j (registers).
      4. v_new_j = u_j - w S_j (S_j bf16 in smem) -> bf16 smem; GDN also 2^(G_L - G_r) v_new_j.
      5. o_j += Aqk v_new_j and S_j <- 2^G_L S_j + k^T (2^(G_L - G) v_new_j) (KDA: the gated k tile), issued
         together; o_j -> smem (the decayed-v_new half, KDA: the -w buffer) -> global (rows < L).
    """

    def __init__(self, config: FusedConfig, io_dtype, beta_dtype):
        self.config = config
        self.io_dtype = io_dtype
        self.beta_dtype = beta_dtype
        self.kda = config.kda
        self.mode = config.mode
        self.has_initial_state = config.initial_state
        self.store_final_state = config.final_state
        self.persistent = config.persistent
        self.local = ChunkLocalSm90(io_dtype, config.kda, outputs=config.mode != "summary", gate=config.gate)
        # KDA keeps G [64 x 128] fp32 in smem: only one q/k/v stage then fits.
        self.num_stages = 1 if config.kda else NUM_STAGES
        self.num_threads = 384
        self.tma_bytes = 3 * C * 128 * io_dtype.width // 8

    # ------------------------------------------------------------------ host side

    @cute.jit
    def __call__(
        self,
        q: cute.Tensor,            # [B, T, H, K] (B and T are flattened here; tiles carry token offsets)
        k: cute.Tensor,            # [B, T, H, K]
        v: cute.Tensor,            # [B, T, H, V]
        g: cute.Tensor,            # [B, T, H] fp32 (KDA: [B, T, H, K]), per-step log decay
        beta: cute.Tensor,         # [B, T, H]
        a_log: cute.Tensor,        # [H] fp32 (config.gate.a_log; else any fp32 tensor)
        dt_bias: cute.Tensor,      # [H] fp32, KDA [H * 128] (config.gate.dt_bias; else any fp32 tensor)
        lower_bound: Float32,      # the bounded gate's (else unused)
        o: cute.Tensor,            # [B, T, H, V]
        initial_state: cute.Tensor,  # [N, H, K, V] fp32 (if initial_state); segment_outputs: [slots, H, K, V]
        final_state: cute.Tensor,    # [N, H, K, V] fp32 (if final_state); summary: [2 * slots, H, K, V]
        tiles: cute.Tensor,        # [num_tiles, NUM_TILE_FIELDS] int32 (a Schedule's table)
        num_tiles: Int32, grid_x: Int32, scale: Float32, stream,
    ):
        flat = wt.flat
        q, k, v, g, beta, o = flat(q), flat(k), flat(v), flat(g), flat(beta), flat(o)
        tma_q, tma_q_tensor, tma_k, tma_k_tensor, tma_v, tma_v_tensor = self.local.qkv_tma(q, k, v)
        self.set_shared_storage()
        self.kernel(
            tma_q, tma_q_tensor, tma_k, tma_k_tensor, tma_v, tma_v_tensor,
            g, beta, a_log, dt_bias, lower_bound, o, initial_state, final_state, tiles, num_tiles, scale,
        ).launch(
            grid=[grid_x, 1, 1],
            block=[self.num_threads, 1, 1],
            stream=stream,
            min_blocks_per_mp=1,
        )

    @cute.jit
    def set_shared_storage(self):
        """The kernel's shared-memory struct (self.shared_storage) and its size."""
        io, stages, kda = self.io_dtype, self.num_stages, self.kda

        @cute.struct
        class SharedStorage:
            load_mbar: cute.struct.MemRange[cutlass.Int64, stages * 2]
            sQ: cute.struct.Align[cute.struct.MemRange[io, C * 128 * stages], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[io, C * 128 * stages], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[io, C * 128 * stages], 1024]
            sKb: cute.struct.Align[cute.struct.MemRange[io, C * 128 if kda else 64], 1024]   # KDA: k 2^G
            sNegW: cute.struct.Align[cute.struct.MemRange[io, C * 128], 1024]   # -w, then the o tile
            sXk: cute.struct.Align[cute.struct.MemRange[io, 64 if kda else C * C], 1024]   # GDN: X diag(beta 2^G)
            sXv: cute.struct.Align[cute.struct.MemRange[io, C * C], 1024]       # X diag(beta)
            sAqk: cute.struct.Align[cute.struct.MemRange[io, C * C], 1024]
            sVnew: cute.struct.Align[cute.struct.MemRange[io, 2 * C * HALF], 1024]
            sVnewD: cute.struct.Align[cute.struct.MemRange[io, 64 if kda else 2 * C * HALF], 1024]  # GDN: decayed
            sS: cute.struct.Align[cute.struct.MemRange[io, 2 * 128 * HALF], 1024]
            sAkk: cute.struct.Align[cute.struct.MemRange[Float32, C * AKK_STRIDE], 16]   # A, then X^T above
            sY: cute.struct.Align[cute.struct.MemRange[Float32, SOLVE_Y], 16]   # blocked-solve products
            sG: cute.struct.MemRange[Float32, C]        # cumulative decay G_r (log2 units)
            sEG: cute.struct.MemRange[Float32, C]       # 2^G_r
            sEGL: cute.struct.MemRange[Float32, C]      # 2^(G_last - G_r), 0 past the chunk end
            sBeta: cute.struct.MemRange[Float32, C]     # beta_r, 0 past the chunk end
            sFlag: cute.struct.MemRange[Int32, 4]       # KDA: 1 if a chunk needs the exact diagonal path
            sGk: cute.struct.Align[cute.struct.MemRange[Float32, C * 128 if kda else 4], 16]  # KDA: G[r, d]
            sGL: cute.struct.MemRange[Float32, 128 if kda else 4]   # KDA: G[L-1, d]

        self.shared_storage = SharedStorage
        self.smem_bytes = SharedStorage.size_in_bytes()
        assert self.smem_bytes <= 232448, f"shared storage {self.smem_bytes} B exceeds the 227 KB an SM90 CTA can have"

    # ------------------------------------------------------------------ device side

    @cute.kernel
    def kernel(
        self, tma_q: cute.CopyAtom, mQ: cute.Tensor, tma_k: cute.CopyAtom, mK: cute.Tensor, tma_v: cute.CopyAtom,
        mV: cute.Tensor, mG: cute.Tensor, mBeta: cute.Tensor, mALog: cute.Tensor, mDtBias: cute.Tensor,
        lower_bound: Float32, mO: cute.Tensor, mS0: cute.Tensor, mSN: cute.Tensor, mTiles: cute.Tensor,
        num_tiles: Int32, scale: Float32,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        wg = cute.arch.make_warp_uniform(tidx // 128)

        smem = cutlass.memory.SmemAllocator()
        st = smem.allocate(self.shared_storage)

        load = pipeline.PipelineTmaAsync.create(
            barrier_storage=st.load_mbar.data_ptr(),
            num_stages=self.num_stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 1),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 8),
            tx_count=self.tma_bytes,
        )
        sched = TileScheduler.create(mTiles, num_tiles, self.persistent)

        if warp_idx == 0:
            cpasync.prefetch_descriptor(tma_q)
            cpasync.prefetch_descriptor(tma_k)
            cpasync.prefetch_descriptor(tma_v)

        if wg == 0:
            cute.arch.setmaxregister_decrease(40)
            if warp_idx == 0:
                ns = self.num_stages
                self.local.producer(sched, load, tma_q, mQ, tma_k, mK, tma_v, mV, self.local.view(st.sQ, C, 128, ns),
                                    self.local.view(st.sK, C, 128, ns), self.local.view(st.sV, C, 128, ns), ns,
                                    qk_group=self.config.group)
        else:
            cute.arch.setmaxregister_increase(232)
            self.consumer(sched, load, wg - 1, tidx - 128, mG, mBeta, (mALog, mDtBias, lower_bound), mO, mS0, mSN,
                          scale, st)

    @cute.jit
    def consumer(self, sched, load, j, ctid, mG, mBeta, gate_args, mO, mS0, mSN, scale, st):
        kda = self.kda
        local = self.local
        outputs = self.mode != "summary"
        wtid = ctid % 128                       # thread index inside this consumer warpgroup
        v0 = j * HALF                           # first V column of this warpgroup
        ns = self.num_stages
        sQ = local.view(st.sQ, C, 128, ns)                # (token, channel, stage)
        sK = local.view(st.sK, C, 128, ns)
        sK_mn = local.view(st.sK, C, 128, ns, True)       # (channel, token, stage)
        sV_mn = local.view(st.sV, C, 128, ns, True)
        sNegW = local.view(st.sNegW, C, 128)[None, None, 0]   # (token, channel); o staging later
        sXv = local.view(st.sXv, C, C)[None, None, 0]
        sAqk = local.view(st.sAqk, C, C)[None, None, 0]
        sVnew = local.view(st.sVnew, C, HALF, 2)          # (token, v, half)
        sVnew_mn = local.view(st.sVnew, C, HALF, 2, True)  # (v, token, half)
        sS = local.view(st.sS, 128, HALF, 2)              # (k, v, half)
        sS_mn = local.view(st.sS, 128, HALF, 2, True)     # (v, k, half)
        sAkk = st.sAkk.get_tensor(cute.make_layout((C, C), stride=(AKK_STRIDE, 1)))
        sY = st.sY.get_tensor(cute.make_layout(SOLVE_Y))
        sG = st.sG.get_tensor(cute.make_layout(C))
        sEG = st.sEG.get_tensor(cute.make_layout(C))
        sEGL = st.sEGL.get_tensor(cute.make_layout(C))
        sBeta = st.sBeta.get_tensor(cute.make_layout(C))
        sFlag = st.sFlag.get_tensor(cute.make_layout(4))
        sXk = sXv
        sVnewD = sVnew
        sVnewD_mn = sVnew_mn
        sKb_mn = sK_mn[None, None, 0]
        sGk = sG
        sGL = sG
        if cutlass.const_expr(kda):
            sKb_mn = local.view(st.sKb, C, 128, 1, True)[None, None, 0]   # (channel, token)
            sGk = st.sGk.get_tensor(cute.make_layout((C, 128), stride=(128, 1)))
            sGL = st.sGL.get_tensor(cute.make_layout(128))
        else:
            sXk = local.view(st.sXk, C, C)[None, None, 0]
            sVnewD = local.view(st.sVnewD, C, HALF, 2)
            sVnewD_mn = local.view(st.sVnewD, C, HALF, 2, True)

        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.num_stages)
        mma64 = local.make_mma(False, True)
        mma_s = local.make_mma(True, True)
        thr_kk = local.make_mma(False, False).get_slice(wtid)
        thr_ab = mma64.get_slice(wtid)
        thr_s = mma_s.get_slice(wtid)
        cc_ab = thr_ab.partition_C(cute.make_identity_tensor((C, HALF)))   # (row, col) of a 64 x 64 acc element
        cc_s = thr_s.partition_C(cute.make_identity_tensor((128, HALF)))
        acc_s = cute.make_rmem_tensor(thr_s.partition_shape_C((128, HALF)), Float32)  # the state S_j
        acc = cute.make_rmem_tensor(thr_ab.partition_shape_C((C, HALF)), Float32)
        acc_o = cute.make_rmem_tensor(thr_ab.partition_shape_C((C, HALF)), Float32)
        tAkk = thr_kk.partition_C(sAkk)                                    # this thread's Akk elements

        work = sched.initial_work()
        while work.is_valid:
            seq = work.seq
            head = work.head
            tok0 = work.tok_start
            tok_end = work.tok_end

            # S_j <- its start value (summary: block 0 (h_ext) from 0, block 1 (M) from I); bf16 copy for products.
            blk = work.block
            slot = work.seg_slot
            for i in cutlass.range_constexpr(cute.size(acc_s)):
                r, cidx = cc_s[i]
                if cutlass.const_expr(self.mode == "summary"):
                    acc_s[i] = Float32(0.0)
                    if blk == 1 and r == v0 + cidx:
                        acc_s[i] = Float32(1.0)
                elif cutlass.const_expr(self.mode == "segment_outputs"):
                    acc_s[i] = mS0[slot, head, r, v0 + cidx]
                elif cutlass.const_expr(self.has_initial_state):
                    acc_s[i] = mS0[seq, head, r, v0 + cidx]
                else:
                    acc_s[i] = Float32(0.0)
            local.store_acc(wtid, mma_s, acc_s, sS[None, None, j])
            cute.arch.fence_proxy("async.shared", space="cta")
            cute.arch.barrier(barrier_id=2 + j, number_of_threads=128)

            # The gates are loaded one chunk ahead: GDN's g and beta rows into registers, KDA's beta (its g by
            # cp.async into sGk). FLA's gate arguments apply as they are read (gp: this tile's parameters).
            mALog, mDtBias, lower_bound = gate_args
            gp = local.math.gate_params(mALog, mDtBias, head, ctid)
            gv, gw, bv = local.math.gate_rows(ctid, tok0, tok_end, head, mG, mBeta)   # raw: converted at use
            if cutlass.const_expr(kda):
                local.math.kda_g_prefetch(ctid, tok0, local.math.rows_in(tok_end - tok0), head, mG, sGk)

            for c in cutlass.range(work.chunk_end - work.chunk_start, unroll=1):
                t0 = tok0 + c * C
                L = local.math.rows_in(tok_end - t0)
                # -- 0. gates of this chunk (fp32, log2 units), before waiting on the tile
                g_own, g_other, beta = local.math.gate_values(ctid, t0, tok_end, gv, gw, bv, gp, lower_bound)
                if cutlass.const_expr(kda):
                    local.math.kda_gates(ctid, t0, L, head, mG, mBeta, sGk, sGL, sBeta, sFlag, beta, gp, lower_bound)
                else:
                    local.math.gdn_gates(ctid, L, g_own, g_other, beta, sG, sEG, sEGL, sBeta)
                gv, gw, bv = local.math.gate_rows(ctid, t0 + C, tok_end, head, mG, mBeta)

                load.consumer_wait(state)
                cute.arch.barrier(barrier_id=1, number_of_threads=256)
                stage = state.index

                # -- 1. intra-chunk products (and q S_j)
                if cutlass.const_expr(kda):
                    local.kda_intra(j, ctid, wtid, L, scale, stage, sQ, sK, sAkk, sAqk, sNegW, sGk, sBeta, sFlag,
                                    st)
                    local.kda_gating_vec(ctid, L, stage, sQ, sK, local.view(st.sKb, C, 128)[None, None, 0],
                                         sGk, sGL)
                    cute.arch.fence_proxy("async.shared", space="cta")
                    cute.arch.barrier(barrier_id=1, number_of_threads=256)
                    # sGk is free until the next chunk's gates: stream that chunk's raw g into it.
                    if c + 1 < work.chunk_end - work.chunk_start:
                        local.math.kda_g_prefetch(ctid, t0 + C, local.math.rows_in(tok_end - t0 - C), head, mG, sGk)
                    if cutlass.const_expr(outputs):
                        local.gemm(wtid, acc_o, sQ[None, None, stage], sS_mn[None, None, j], False, True, False)
                        for i in cutlass.range_constexpr(cute.size(acc_o)):
                            acc_o[i] = acc_o[i] * scale
                else:
                    acc_kk = cute.make_rmem_tensor(thr_kk.partition_shape_C((C, C)), Float32)
                    cc_kk = thr_kk.partition_C(cute.make_identity_tensor((C, C)))
                    local.gdn_intra_issue(j, wtid, acc_kk, stage, sQ, sK, outputs)
                    if cutlass.const_expr(outputs):
                        local.gemm(wtid, acc_o, sQ[None, None, stage], sS_mn[None, None, j], False, True, False,
                                   wait=False)
                    warpgroup.wait_group(0)
                    local.gdn_intra_finish(j, wtid, acc_kk, cc_kk, L, scale, sG, sBeta, tAkk, sAqk, outputs)
                    if cutlass.const_expr(outputs):
                        for i in cutlass.range_constexpr(cute.size(acc_o)):
                            r, col = cc_ab[i]
                            acc_o[i] = acc_o[i] * (sEG[r] * scale)
                    cute.arch.fence_proxy("async.shared", space="cta")
                    cute.arch.barrier(barrier_id=1, number_of_threads=256)

                # -- 2. X = (I + Akk)^-1 in fp32 -> Xv = X diag(beta), GDN: Xk = X diag(beta 2^G) (bf16)
                local.math.solve_blocked(ctid, sAkk, sY, sXv, sXk, sBeta, sEG)
                cute.arch.fence_proxy("async.shared", space="cta")
                cute.arch.barrier(barrier_id=1, number_of_threads=256)

                # -- 3. -w columns of this warpgroup (-> smem) and u_j (registers)
                if cutlass.const_expr(kda):
                    local.gemm(wtid, acc, sXv, cute.local_tile(sKb_mn, (HALF, C), (j, 0)), False, True, False)
                else:
                    local.gemm(wtid, acc, sXk, cute.local_tile(sK_mn[None, None, stage], (HALF, C), (j, 0)),
                               False, True, False)
                for i in cutlass.range_constexpr(cute.size(acc)):
                    acc[i] = -acc[i]
                local.store_acc(wtid, mma64, acc, cute.local_tile(sNegW, (C, HALF), (0, j)))
                if cutlass.const_expr(self.mode == "summary"):
                    if blk == 1:   # M columns: the recurrence on the identity with zero values
                        acc.fill(0.0)
                    else:
                        local.gemm(wtid, acc, sXv, cute.local_tile(sV_mn[None, None, stage], (HALF, C), (j, 0)),
                                   False, True, False)
                else:
                    local.gemm(wtid, acc, sXv, cute.local_tile(sV_mn[None, None, stage], (HALF, C), (j, 0)),
                               False, True, False)
                cute.arch.fence_proxy("async.shared", space="cta")
                cute.arch.barrier(barrier_id=1, number_of_threads=256)

                # -- 4. v_new_j = u_j - w S_j (GDN: also 2^(G_L - G_r) v_new_j for the state update)
                local.gemm(wtid, acc, sNegW, sS_mn[None, None, j], False, True, True)
                local.store_acc(wtid, mma64, acc, sVnew[None, None, j])
                if cutlass.const_expr(not kda):
                    for i in cutlass.range_constexpr(cute.size(acc)):
                        r, col = cc_ab[i]
                        acc[i] = acc[i] * sEGL[r]
                    local.store_acc(wtid, mma64, acc, sVnewD[None, None, j])
                cute.arch.fence_proxy("async.shared", space="cta")
                cute.arch.barrier(barrier_id=2 + j, number_of_threads=128)

                # -- 5. o_j += Aqk v_new_j; S_j <- 2^G_L S_j + k~^T v_new~_j (one commit, one wait)
                if cutlass.const_expr(outputs):
                    local.gemm(wtid, acc_o, sAqk, sVnew_mn[None, None, j], False, True, True, wait=False)
                if cutlass.const_expr(kda):
                    for i in cutlass.range_constexpr(cute.size(acc_s)):
                        r, cidx = cc_s[i]
                        acc_s[i] = acc_s[i] * cute.math.exp2(sGL[r], fastmath=True)
                else:
                    decay_last = sEG[L - 1]
                    for i in cutlass.range_constexpr(cute.size(acc_s)):
                        acc_s[i] = acc_s[i] * decay_last
                local.gemm(wtid, acc_s, sK_mn[None, None, stage], sVnewD_mn[None, None, j], True, True, True,
                           wait=False)
                warpgroup.wait_group(0)
                load.consumer_release(state)   # this warp is done with the q/k/v stage
                state.advance()
                # o staging: GDN the decayed-v_new half (only this warpgroup reads it: its barrier suffices); KDA
                # its half of -w (both warpgroups read all of -w in step 4: both must be past it).
                sO = sVnewD[None, None, j]
                if cutlass.const_expr(kda):
                    sO = cute.local_tile(sNegW, (C, HALF), (0, j))
                    cute.arch.barrier(barrier_id=1, number_of_threads=256)
                else:
                    cute.arch.barrier(barrier_id=2 + j, number_of_threads=128)
                if cutlass.const_expr(outputs):
                    local.store_acc(wtid, mma64, acc_o, sO)
                local.store_acc(wtid, mma_s, acc_s, sS[None, None, j])
                cute.arch.fence_proxy("async.shared", space="cta")
                cute.arch.barrier(barrier_id=2 + j, number_of_threads=128)
                if cutlass.const_expr(outputs):
                    local.store_rows(wtid, sO, mO, t0, head, v0, L)
                # Protects Aqk, the gates and the o tile from the next chunk's writers.
                cute.arch.barrier(barrier_id=1, number_of_threads=256)

            if cutlass.const_expr(self.mode == "summary"):
                # summary[block * slots + seg_slot]: block 0 holds h_ext, block 1 holds M.
                nslots = mSN.shape[0] // 2
                for i in cutlass.range_constexpr(cute.size(acc_s)):
                    r, cidx = cc_s[i]
                    mSN[blk * nslots + slot, head, r, v0 + cidx] = acc_s[i]
            elif cutlass.const_expr(self.store_final_state):
                if work.is_last_segment:
                    for i in cutlass.range_constexpr(cute.size(acc_s)):
                        r, cidx = cc_s[i]
                        mSN[seq, head, r, v0 + cidx] = acc_s[i]
            work = sched.advance(work)
