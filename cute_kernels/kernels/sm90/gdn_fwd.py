"""SM90 (Hopper) fused chunked forward of the gated delta rule: GDN (a scalar decay per head and token) and,
with `kda=True`, KDA (a decay per key channel).

Status: GDN with the serial solve verified on the H200 (rel. err 3.3e-3 vs float64); the blocked solve and KDA
compile for sm_90a and await their first GPU run (issue 4). The math is the chunked form of
`shared/design/linear_attention.md` (`cute_kernels.reference.chunk_gated_delta_rule_ref` is its float64 spec).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import cpasync, warpgroup

from schedulers.device import TileScheduler

C = 64        # chunk length (tokens)
HALF = 64     # V columns owned by one consumer warpgroup
NUM_STAGES = 2  # q/k/v ring depth for GDN (KDA: 1)


def _smem_layout(rows: int, cols: int, dtype, stages: int = 1, mn_view: bool = False):
    """Swizzled smem layout of `stages` row-major [rows, cols] 16-bit tiles, indexed (row, col, stage).

    As built it is a K-major wgmma A (M=rows, K=cols). With `mn_view` the same bytes are indexed
    (col, row, stage): an MN-major A (M=cols, K=rows) or MN-major B (N=cols, K=rows). For 128-byte swizzled
    16-bit tiles both views map every element to the same address (tests/test_gdn_sm90.py checks it).
    """
    from cutlass.tensor_utils import LayoutEnum

    if mn_view:
        return sm90_utils.make_smem_layout_a(LayoutEnum.COL_MAJOR, (cols, 64, rows), dtype, stages)
    return sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, (rows, 64, cols), dtype, stages)


def _one(layout):
    return cute.slice_(layout, (None, None, 0))


class ChunkGatedDeltaRuleFwdSm90:
    """Fused GDN / KDA forward on Hopper: one CTA per work tile (sequence, head, chunk range), state on chip.

    Warp roles (384 threads, 3 warpgroups):
    - warpgroup 0, warp 0: producer. Issues TMA (`cp.async.bulk.tensor`) loads of the q, k, v chunk tiles
      [64 tokens x 128] of its head into a `NUM_STAGES`-deep shared-memory ring. Registers lowered to 40
      (`setmaxnreg.dec`). Warps 1-3 of warpgroup 0 idle.
    - warpgroups 1 and 2: consumers (registers raised to 232). Consumer j owns V columns [64 j, 64 j + 64) of
      the state S (K x V fp32, accumulator registers of a 128 x 64 wgmma tile) for the whole tile.
    Pipelines: `PipelineTmaAsync` q/k/v ring (NUM_STAGES stages, producer = 1 thread, consumers = 8 warps);
    named barriers between the consumer phases inside a chunk (id 1: both consumer warpgroups; ids 2, 3: one).

    Modes (compile time): `forward` (start from initial_state[seq], write o and final_state[seq]);
    `summary` (tiles carry block 0 / 1: run the segment from 0 with the real v / from I with zero v, write the
    end state to summary[block * slots + seg_slot] = (h_ext, M), no o); `segment_outputs` (start from
    start_states[seg_slot], write o). Together with `affine_merge` they make the segmented forward.

    KDA (`kda=True`): one q/k/v stage (the per-channel G [64 x 128] fp32 takes the second stage's room); step 1
    becomes `kda_intra` (anchored 64 x 16 x 128 wgmma products below the diagonal blocks, exact sums inside
    them), the gating of step 2 and the state decay of step 7 are per channel.

    Per chunk (rows r, i < L = tokens in the chunk; G = cumulative log decay inside the chunk):
      1. kk = k k^T (consumer 1) and qk = q k^T (consumer 2) on wgmma; scaled in registers by
         exp(G_r - G_i) (<= 1 for i <= r, no overflow), beta_r / scale, masked lower-triangular;
         Akk -> fp32 smem, Aqk -> bf16 smem.
      2. In place in the stage buffers: q <- scale exp(G) q, k <- exp(G_L - G) k, v <- beta v; kb = beta exp(G) k.
      3. X = (I + Akk)^-1 in fp32 -> bf16 smem: `solve="serial"` (64 threads, one column each) or
         `solve="blocked"` (16 x 16 diagonal blocks by substitution, off-diagonal blocks as small products).
      4. Consumer j: w[:, cols j] = X kb -> -w bf16 smem; u_j = X v_j (registers).
      5. v_new_j = u_j - w S_j (wgmma, S_j bf16 in smem) -> bf16 smem.
      6. o_j = q S_j + Aqk v_new_j -> global (rows < L).
      7. S_j <- exp(G_L) S_j + k^T v_new_j (wgmma accumulating into the state registers) -> bf16 smem copy.
    The gates (G, exp(G), beta) of a chunk are computed by the consumers from global memory before they wait for
    its tile. `skip` leaves stages out, for timing by subtraction only.
    """

    def __init__(self, io_dtype, beta_dtype, has_initial_state: bool, store_final_state: bool,
                 persistent: bool = False, k_dim: int = 128, v_dim: int = 128, solve: str = "serial",
                 kda: bool = False, mode: str = "forward", skip: tuple = ()):
        if k_dim != 128 or v_dim != 128:
            raise ValueError(f"ChunkGatedDeltaRuleFwdSm90 supports K = V = 128, got K={k_dim}, V={v_dim}")
        self.io_dtype = io_dtype
        self.beta_dtype = beta_dtype
        self.has_initial_state = has_initial_state
        self.store_final_state = store_final_state
        self.persistent = persistent
        self.k_dim = k_dim
        self.v_dim = v_dim
        if solve not in ("blocked", "serial"):
            raise ValueError(f"solve must be 'blocked' or 'serial', got {solve!r}")
        if mode not in ("forward", "summary", "segment_outputs"):
            raise ValueError(f"mode must be 'forward', 'summary' or 'segment_outputs', got {mode!r}")
        self.solve = solve
        self.kda = kda
        self.mode = mode
        # Profiling by subtraction only: stages left out (results are wrong), see scripts/gdn_profile.py.
        unknown = set(skip) - {"gates", "intra", "gating", "solve", "wu", "vnew", "out", "state"}
        if unknown:
            raise ValueError(f"unknown stages to skip: {sorted(unknown)}")
        self.skip = tuple(sorted(skip))
        # KDA keeps the per-channel cumulative decay G [64 x 128] fp32 in smem (32 KB): one q/k/v stage then fits.
        self.num_stages = 1 if kda else NUM_STAGES
        self.num_threads = 384
        self.tma_bytes = 3 * C * 128 * io_dtype.width // 8

    # ------------------------------------------------------------------ host side

    @cute.jit
    def __call__(
        self,
        q: cute.Tensor,            # [T, H, K]  (B and T flattened; tiles carry token offsets)
        k: cute.Tensor,            # [T, H, K]
        v: cute.Tensor,            # [T, H, V]
        g: cute.Tensor,            # [T, H] fp32, per-step log decay
        beta: cute.Tensor,         # [T, H]
        o: cute.Tensor,            # [T, H, V]
        initial_state: cute.Tensor,  # [N, H, K, V] fp32 (if has_initial_state); segment_outputs: [slots, H, K, V]
        final_state: cute.Tensor,    # [N, H, K, V] fp32 (if store_final_state); summary: [2 * slots, H, K, V]
        tiles: cute.Tensor,        # [num_tiles, NUM_TILE_FIELDS] int32 (a Schedule's table)
        num_tiles: Int32,
        grid_x: Int32,
        scale: Float32,
        stream,
    ):
        io = self.io_dtype
        # Per-head 2-D views [T, 128] of q, k, v as 3-D (T, D, H) tensors for TMA.
        def thd(t):
            return cute.make_tensor(
                t.iterator,
                cute.make_layout((t.shape[0], t.shape[2], t.shape[1]), stride=(t.stride[0], t.stride[2], t.stride[1])),
            )

        tile_layout = _one(_smem_layout(C, 128, io))
        op = cpasync.CopyBulkTensorTileG2SOp()
        tma_q, tma_q_tensor = cpasync.make_tiled_tma_atom(op, thd(q), tile_layout, (C, 128))
        tma_k, tma_k_tensor = cpasync.make_tiled_tma_atom(op, thd(k), tile_layout, (C, 128))
        tma_v, tma_v_tensor = cpasync.make_tiled_tma_atom(op, thd(v), tile_layout, (C, 128))

        stages, kda = self.num_stages, self.kda

        @cute.struct
        class SharedStorage:
            load_mbar: cute.struct.MemRange[cutlass.Int64, stages * 2]
            sQ: cute.struct.Align[cute.struct.MemRange[io, C * 128 * stages], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[io, C * 128 * stages], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[io, C * 128 * stages], 1024]
            sKb: cute.struct.Align[cute.struct.MemRange[io, C * 128], 1024]
            sNegW: cute.struct.Align[cute.struct.MemRange[io, C * 128], 1024]
            sX: cute.struct.Align[cute.struct.MemRange[io, C * C], 1024]
            sAqk: cute.struct.Align[cute.struct.MemRange[io, C * C], 1024]
            sVnew: cute.struct.Align[cute.struct.MemRange[io, 2 * C * HALF], 1024]
            sS: cute.struct.Align[cute.struct.MemRange[io, 2 * 128 * HALF], 1024]
            sAkk: cute.struct.Align[cute.struct.MemRange[Float32, C * (C + 1)], 16]   # A, then X^T above
            sY: cute.struct.Align[cute.struct.MemRange[Float32, 3 * 16 * 16], 16]   # blocked-solve products
            sG: cute.struct.MemRange[Float32, C]        # cumulative log decay G_r
            sEG: cute.struct.MemRange[Float32, C]       # exp(G_r)
            sEGL: cute.struct.MemRange[Float32, C]      # exp(G_last - G_r), 0 past the chunk end
            sBeta: cute.struct.MemRange[Float32, C]     # beta_r, 0 past the chunk end
            sGk: cute.struct.Align[cute.struct.MemRange[Float32, C * 128 if kda else 4], 16]  # KDA: G[r, d]
            sGL: cute.struct.MemRange[Float32, 128 if kda else 4]   # KDA: G[L-1, d]

        self.shared_storage = SharedStorage
        self.smem_bytes = SharedStorage.size_in_bytes()
        assert self.smem_bytes <= 232448, f"shared storage {self.smem_bytes} B exceeds the 227 KB an SM90 CTA can have"
        self.kernel(
            tma_q, tma_q_tensor, tma_k, tma_k_tensor, tma_v, tma_v_tensor,
            g, beta, o, initial_state, final_state, tiles, num_tiles, scale,
        ).launch(
            grid=[grid_x, 1, 1],
            block=[self.num_threads, 1, 1],
            stream=stream,
            min_blocks_per_mp=1,
        )

    # ------------------------------------------------------------------ device side

    @cute.kernel
    def kernel(
        self,
        tma_q: cute.CopyAtom, mQ: cute.Tensor,
        tma_k: cute.CopyAtom, mK: cute.Tensor,
        tma_v: cute.CopyAtom, mV: cute.Tensor,
        mG: cute.Tensor, mBeta: cute.Tensor, mO: cute.Tensor,
        mS0: cute.Tensor, mSN: cute.Tensor,
        mTiles: cute.Tensor, num_tiles: Int32, scale: Float32,
    ):
        io = self.io_dtype
        tidx, _, _ = cute.arch.thread_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        wg = cute.arch.make_warp_uniform(tidx // 128)

        smem = cutlass.memory.SmemAllocator()
        st = smem.allocate(self.shared_storage)

        def view(field, rows, cols, stages=1, mn_view=False, staged=False):
            layout = _smem_layout(rows, cols, io, stages, mn_view)
            t = field.get_tensor(layout.outer, swizzle=layout.inner)
            return t if stages > 1 or staged else t[None, None, 0]

        ns = self.num_stages
        sQ = view(st.sQ, C, 128, ns, staged=True)          # (token, channel, stage)
        sK = view(st.sK, C, 128, ns, staged=True)
        sV = view(st.sV, C, 128, ns, staged=True)
        sK_mn = view(st.sK, C, 128, ns, True, True)        # (channel, token, stage)
        sV_mn = view(st.sV, C, 128, ns, True, True)
        sKb_mn = view(st.sKb, C, 128, 1, True)           # (channel, token)
        sNegW = view(st.sNegW, C, 128)                   # (token, channel)
        sX = view(st.sX, C, C)
        sAqk = view(st.sAqk, C, C)
        sVnew = view(st.sVnew, C, HALF, 2)               # (token, v, half)
        sVnew_mn = view(st.sVnew, C, HALF, 2, True)      # (v, token, half)
        sS = view(st.sS, 128, HALF, 2)                   # (k, v, half)
        sS_mn = view(st.sS, 128, HALF, 2, True)          # (v, k, half)
        sAkk = st.sAkk.get_tensor(cute.make_layout((C, C), stride=(C + 1, 1)))
        sY = st.sY.get_tensor(cute.make_layout((3, 16, 16), stride=(256, 16, 1)))
        sG = st.sG.get_tensor(cute.make_layout(C))
        sEG = st.sEG.get_tensor(cute.make_layout(C))
        sEGL = st.sEGL.get_tensor(cute.make_layout(C))
        sBeta = st.sBeta.get_tensor(cute.make_layout(C))
        sGk = st.sGk.get_tensor(cute.make_layout((C, 128), stride=(128, 1)) if self.kda else cute.make_layout((1, 4)))
        sGL = st.sGL.get_tensor(cute.make_layout(128 if self.kda else 4))
        sLq = view(st.sKb, C, 128)                           # KDA: left factors of the q rows (K-major A)
        sR = view(st.sVnew, 16, 128)                         # KDA: right factor of one column block

        load = pipeline.PipelineTmaAsync.create(
            barrier_storage=st.load_mbar.data_ptr(),
            num_stages=self.num_stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 1),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 8),
            tx_count=self.tma_bytes,
        )
        sched = TileScheduler.create(mTiles, num_tiles, self.persistent)

        if warp == 0:
            cpasync.prefetch_descriptor(tma_q)
            cpasync.prefetch_descriptor(tma_k)
            cpasync.prefetch_descriptor(tma_v)

        if wg == 0:
            cute.arch.setmaxregister_decrease(40)
            if warp == 0:
                self.producer(sched, load, tma_q, mQ, tma_k, mK, tma_v, mV, sQ, sK, sV)
        else:
            cute.arch.setmaxregister_increase(232)
            self.consumer(
                sched, load, wg - 1, tidx - 128, mG, mBeta, mO, mS0, mSN, scale,
                sQ, sK, sV, sK_mn, sV_mn, sKb_mn, sNegW, sX, sAqk, sVnew, sVnew_mn, sS, sS_mn,
                sAkk, sY, sG, sEG, sEGL, sBeta, sGk, sGL, sLq, sR,
            )

    @cute.jit
    def producer(self, sched, load, tma_q, mQ, tma_k, mK, tma_v, mV, sQ, sK, sV):
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.num_stages)
        work = sched.initial_work()
        while work.is_valid:
            head = work.head
            tok0 = work.tok_start
            for c in cutlass.range(work.chunk_end - work.chunk_start, unroll=1):
                load.producer_acquire(state)
                bar = load.producer_get_barrier(state)
                for tma, m, s in ((tma_q, mQ, sQ), (tma_k, mK, sK), (tma_v, mV, sV)):
                    g_head = cute.domain_offset((tok0 + c * C, 0), m[None, None, head])
                    g_tile = cute.local_tile(g_head, (C, 128), (0, 0))
                    s_part, g_part = cpasync.tma_partition(
                        tma, 0, cute.make_layout(1),
                        cute.group_modes(s, 0, 2), cute.group_modes(g_tile, 0, 2),
                    )
                    cute.copy(tma, g_part, s_part[(None, state.index)], tma_bar_ptr=bar)
                state.advance()
            work = sched.advance(work)
        load.producer_tail(state)

    @cute.jit
    def consumer(
        self, sched, load, j, ctid, mG, mBeta, mO, mS0, mSN, scale,
        sQ, sK, sV, sK_mn, sV_mn, sKb_mn, sNegW, sX, sAqk, sVnew, sVnew_mn, sS, sS_mn,
        sAkk, sY, sG, sEG, sEGL, sBeta, sGk, sGL, sLq, sR,
    ):
        io = self.io_dtype
        wtid = ctid % 128                       # thread index inside this consumer warpgroup
        v0 = j * HALF                           # first V column of this warpgroup
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.num_stages)

        thr_kk = self.make_mma(False, False).get_slice(wtid)
        thr_ab = self.make_mma(False, True).get_slice(wtid)
        thr_s = self.make_mma(True, True).get_slice(wtid)
        c64 = cute.make_identity_tensor((C, HALF))
        c_s = cute.make_identity_tensor((128, HALF))
        cc_ab = thr_ab.partition_C(c64)        # coordinates of a (64 x 64) accumulator element
        cc_s = thr_s.partition_C(c_s)          # coordinates of a (128 x 64) accumulator element
        acc_s = cute.make_rmem_tensor(thr_s.partition_shape_C((128, HALF)), Float32)  # the state S_j
        acc = cute.make_rmem_tensor(thr_ab.partition_shape_C((C, HALF)), Float32)
        acc_o = cute.make_rmem_tensor(thr_ab.partition_shape_C((C, HALF)), Float32)

        work = sched.initial_work()
        while work.is_valid:
            seq = work.seq
            head = work.head
            tok0 = work.tok_start
            tok_end = work.tok_end

            # State S_j <- its start value; bf16 copy for the products.
            #   forward: initial_state[seq] (or 0); segment_outputs: start_states[seg_slot];
            #   summary: block 0 (h_ext columns) from 0, block 1 (M columns) from the identity.
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
            self.store_state_copy(acc_s, cc_s, sS, j)
            cute.arch.barrier(barrier_id=2 + j, number_of_threads=128)

            for c in cutlass.range(work.chunk_end - work.chunk_start, unroll=1):
                t0 = tok0 + c * C
                L = tok_end - t0
                if L > C:
                    L = Int32(C)
                # -- gates of this chunk (fp32), before waiting on the tile
                if cutlass.const_expr("gates" not in self.skip):
                    if cutlass.const_expr(self.kda):
                        self.kda_gates(ctid, t0, L, head, mG, mBeta, sGk, sGL, sBeta)
                    else:
                        self.gdn_gates(ctid, t0, L, head, mG, mBeta, sG, sEG, sEGL, sBeta)

                load.consumer_wait(state)
                cute.arch.barrier(barrier_id=1, number_of_threads=256)
                stage = state.index

                # -- 1. kk (warpgroup 0) / qk (warpgroup 1) -> Akk fp32 / Aqk bf16
                if cutlass.const_expr("intra" not in self.skip):
                    if cutlass.const_expr(self.kda):
                        self.kda_intra(j, ctid, wtid, L, scale, stage, sQ, sK, sAkk, sAqk, sNegW, sLq, sR, sGk, sBeta)
                    else:
                        cc_kk = thr_kk.partition_C(cute.make_identity_tensor((C, C)))
                        acc_kk = cute.make_rmem_tensor(thr_kk.partition_shape_C((C, C)), Float32)
                        if j == 0:
                            self.gemm(wtid, acc_kk, sK[None, None, stage], sK[None, None, stage], False, False, False)
                            for i in cutlass.range_constexpr(cute.size(acc_kk)):
                                r, col = cc_kk[i]
                                val = Float32(0.0)
                                if col < r and r < L:
                                    val = acc_kk[i] * cute.math.exp(sG[r] - sG[col], fastmath=False) * sBeta[r]
                                sAkk[r, col] = val
                        else:
                            if cutlass.const_expr(self.mode != "summary"):  # Aqk only feeds the outputs
                                self.gemm(wtid, acc_kk, sQ[None, None, stage], sK[None, None, stage], False, False, False)
                                for i in cutlass.range_constexpr(cute.size(acc_kk)):
                                    r, col = cc_kk[i]
                                    val = Float32(0.0)
                                    if col <= r:
                                        val = acc_kk[i] * cute.math.exp(sG[r] - sG[col], fastmath=False) * scale
                                    sAqk[r, col] = io(val)
                        cute.arch.barrier(barrier_id=1, number_of_threads=256)

                # -- 2. in-place gating of q, k, v and kb (all 256 consumer threads)
                if cutlass.const_expr("gating" not in self.skip):
                    for e in cutlass.range(ctid, C * 128, 256, unroll=4):
                        r = e // 128
                        col = e % 128
                        eg = Float32(0.0)
                        egl = Float32(0.0)
                        if cutlass.const_expr(self.kda):
                            gr = sGk[r, col]
                            eg = cute.math.exp(gr, fastmath=False)
                            if r < L:
                                egl = cute.math.exp(sGL[col] - gr, fastmath=False)
                        else:
                            eg = sEG[r]
                            egl = sEGL[r]
                        kv = Float32(sK[r, col, stage])
                        sKb_mn[col, r] = io(kv * sBeta[r] * eg)
                        sK[r, col, stage] = io(kv * egl)
                        sQ[r, col, stage] = io(Float32(sQ[r, col, stage]) * eg * scale)
                        vscale = sBeta[r]
                        if cutlass.const_expr(self.mode == "summary"):
                            if blk == 1:
                                vscale = Float32(0.0)  # M columns: the recurrence on the identity with zero values
                        sV[r, col, stage] = io(Float32(sV[r, col, stage]) * vscale)

                # -- 3. X = (I + Akk)^-1 in fp32 -> bf16 sX
                if cutlass.const_expr("solve" in self.skip):
                    pass
                elif cutlass.const_expr(self.solve == "blocked"):
                    self.solve_blocked(ctid, sAkk, sY, sX)
                else:
                    self.solve_serial(ctid, sAkk, sX)
                cute.arch.fence_proxy("async.shared", space="cta")
                cute.arch.barrier(barrier_id=1, number_of_threads=256)

                # -- 4. w columns of this warpgroup (-> smem, negated) and u_j (registers)
                if cutlass.const_expr("wu" not in self.skip):
                    self.gemm(wtid, acc, sX, cute.local_tile(sKb_mn, (HALF, C), (j, 0)), False, True, False)
                    for i in cutlass.range_constexpr(cute.size(acc)):
                        r, col = cc_ab[i]
                        sNegW[r, v0 + col] = io(-acc[i])
                    self.gemm(wtid, acc, sX, cute.local_tile(sV_mn[None, None, stage], (HALF, C), (j, 0)), False, True,
                              False)
                cute.arch.fence_proxy("async.shared", space="cta")
                cute.arch.barrier(barrier_id=1, number_of_threads=256)

                # -- 5. v_new_j = u_j - w S_j
                if cutlass.const_expr("vnew" not in self.skip):
                    self.gemm(wtid, acc, sNegW, sS_mn[None, None, j], False, True, True)
                    for i in cutlass.range_constexpr(cute.size(acc)):
                        r, col = cc_ab[i]
                        sVnew[r, col, j] = io(acc[i])
                cute.arch.fence_proxy("async.shared", space="cta")
                cute.arch.barrier(barrier_id=2 + j, number_of_threads=128)

                # -- 6. o_j = (scale exp(G) q) S_j + Aqk v_new_j (not in summary mode)
                if cutlass.const_expr(self.mode != "summary" and "out" not in self.skip):
                    self.gemm(wtid, acc_o, sQ[None, None, stage], sS_mn[None, None, j], False, True, False)
                    self.gemm(wtid, acc_o, sAqk, sVnew_mn[None, None, j], False, True, True)
                    for i in cutlass.range_constexpr(cute.size(acc_o)):
                        r, col = cc_ab[i]
                        if r < L:
                            mO[t0 + r, head, v0 + col] = io(acc_o[i])

                # -- 7. S_j <- exp(G_last) S_j + (exp(G_last - G) k)^T v_new_j
                if cutlass.const_expr("state" not in self.skip):
                    if cutlass.const_expr(self.kda):
                        for i in cutlass.range_constexpr(cute.size(acc_s)):
                            r, cidx = cc_s[i]
                            acc_s[i] = acc_s[i] * cute.math.exp(sGL[r], fastmath=False)
                    else:
                        decay_last = sEG[L - 1]
                        for i in cutlass.range_constexpr(cute.size(acc_s)):
                            acc_s[i] = acc_s[i] * decay_last
                    self.gemm(wtid, acc_s, sK_mn[None, None, stage], sVnew_mn[None, None, j], True, True, True)

                cute.arch.barrier(barrier_id=2 + j, number_of_threads=128)
                if cutlass.const_expr("state" not in self.skip):
                    self.store_state_copy(acc_s, cc_s, sS, j)
                cute.arch.fence_proxy("async.shared", space="cta")
                cute.arch.barrier(barrier_id=1, number_of_threads=256)
                load.consumer_release(state)
                state.advance()

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

    @cute.jit
    def gdn_gates(self, ctid, t0, L, head, mG, mBeta, sG, sEG, sEGL, sBeta):
        """G_r = cumulative log decay in the chunk, exp(G_r), exp(G_last - G_r) (0 past the end), beta_r."""
        if ctid < C:
            gv = Float32(0.0)
            bv = Float32(0.0)
            if ctid < L:
                gv = Float32(mG[t0 + ctid, head])
                bv = Float32(mBeta[t0 + ctid, head])
            sG[ctid] = gv
            sBeta[ctid] = bv
        cute.arch.barrier(barrier_id=1, number_of_threads=256)
        if ctid < C:
            acc_g = Float32(0.0)
            for i in cutlass.range(ctid + 1, unroll=4):
                acc_g = acc_g + sG[i]
            glast = Float32(0.0)
            for i in cutlass.range(L, unroll=4):
                glast = glast + sG[i]
            cute.arch.barrier(barrier_id=4, number_of_threads=64)
            sG[ctid] = acc_g
            sEG[ctid] = cute.math.exp(acc_g, fastmath=False)
            egl = Float32(0.0)
            if ctid < L:
                egl = cute.math.exp(glast - acc_g, fastmath=False)
            sEGL[ctid] = egl

    @cute.jit
    def kda_gates(self, ctid, t0, L, head, mG, mBeta, sGk, sGL, sBeta):
        """G[r, d] = cumulative log decay per channel (threads 0..127, one channel each); G[L-1, d]; beta_r."""
        if ctid < 128:
            acc_g = Float32(0.0)
            for r in cutlass.range(C, unroll=8):
                gv = Float32(0.0)
                if r < L:
                    gv = Float32(mG[t0 + r, head, ctid])
                acc_g = acc_g + gv
                sGk[r, ctid] = acc_g
            sGL[ctid] = acc_g
        else:
            r = ctid - 128
            if r < C:
                bv = Float32(0.0)
                if r < L:
                    bv = Float32(mBeta[t0 + r, head])
                sBeta[r] = bv

    @cute.jit
    def kda_intra(self, j, ctid, wtid, L, scale, stage, sQ, sK, sAkk, sAqk, sNegW, sLq, sR, sGk, sBeta):
        """KDA Akk (fp32, beta on rows) and Aqk (bf16, scaled) without exponentiating positive numbers.

        Below the diagonal blocks, per 16-row column block qb with anchor e = its last row:
        [x_r exp(G_r - G_e)] @ [k_i exp(G_e - G_i)]^T on wgmma (64 x 16 x 128; warpgroup 0 for k, 1 for q);
        the 16 x 16 diagonal blocks as exact pairwise channel sums (all 256 threads). See
        cute_kernels/reference/kda_intra.py (the spec, tested on the CPU).
        """
        io = self.io_dtype
        for e in cutlass.range(ctid, C * C, 256, unroll=4):
            sAkk[e // C, e % C] = Float32(0.0)
            sAqk[e // C, e % C] = io(0.0)
        cute.arch.barrier(barrier_id=1, number_of_threads=256)
        thr16 = self.make_mma(False, False, 16).get_slice(wtid)
        cc16 = thr16.partition_C(cute.make_identity_tensor((C, 16)))
        acc16 = cute.make_rmem_tensor(thr16.partition_shape_C((C, 16)), Float32)
        for qb in cutlass.range_constexpr(3):
            anchor = 16 * qb + 15
            for e in cutlass.range(ctid, C * 128, 256, unroll=4):
                r = e // 128
                d = e % 128
                lk = Float32(0.0)
                lq = Float32(0.0)
                if r > anchor:
                    f = cute.math.exp(sGk[r, d] - sGk[anchor, d], fastmath=False)
                    lk = Float32(sK[r, d, stage]) * f
                    lq = Float32(sQ[r, d, stage]) * f
                sNegW[r, d] = io(lk)
                if cutlass.const_expr(self.mode != "summary"):  # Aqk only feeds the outputs
                    sLq[r, d] = io(lq)
            for e in cutlass.range(ctid, 16 * 128, 256, unroll=4):
                i = e // 128
                d = e % 128
                f = cute.math.exp(sGk[anchor, d] - sGk[16 * qb + i, d], fastmath=False)
                sR[i, d] = io(Float32(sK[16 * qb + i, d, stage]) * f)
            cute.arch.fence_proxy("async.shared", space="cta")
            cute.arch.barrier(barrier_id=1, number_of_threads=256)
            if j == 0:
                self.gemm(wtid, acc16, sNegW, sR, False, False, False, 16)
                for i in cutlass.range_constexpr(cute.size(acc16)):
                    r, col = cc16[i]
                    if r > anchor:
                        sAkk[r, 16 * qb + col] = acc16[i] * sBeta[r]
            else:
                if cutlass.const_expr(self.mode != "summary"):
                    self.gemm(wtid, acc16, sLq, sR, False, False, False, 16)
                    for i in cutlass.range_constexpr(cute.size(acc16)):
                        r, col = cc16[i]
                        if r > anchor:
                            sAqk[r, 16 * qb + col] = io(acc16[i] * scale)
            cute.arch.barrier(barrier_id=1, number_of_threads=256)
        # Diagonal 16 x 16 blocks: exact sums over channels, exp(G_r - G_i) <= 1 for i <= r.
        for e in cutlass.range(ctid, 4 * 256, 256, unroll=1):
            base = (e // 256) * 16
            r = base + (e % 256) // 16
            i = base + e % 16
            if i <= r:
                skk = Float32(0.0)
                sqk = Float32(0.0)
                for d in cutlass.range(128, unroll=8):
                    kid = Float32(sK[i, d, stage]) * cute.math.exp(sGk[r, d] - sGk[i, d], fastmath=False)
                    skk = skk + Float32(sK[r, d, stage]) * kid
                    sqk = sqk + Float32(sQ[r, d, stage]) * kid
                if i < r:
                    sAkk[r, i] = skk * sBeta[r]
                sAqk[r, i] = io(sqk * scale)
        cute.arch.barrier(barrier_id=1, number_of_threads=256)

    @cute.jit
    def solve_serial(self, ctid, sAkk, sX):
        """X = (I + A)^-1 by forward substitution, one column per thread (64 threads, 2016-FMA chains)."""
        if ctid < C:
            x = cute.make_rmem_tensor((C,), Float32)
            for r in cutlass.range_constexpr(C):
                acc_x = Float32(0.0)
                if r == ctid:
                    acc_x = Float32(1.0)
                for i in cutlass.range_constexpr(r):
                    acc_x = acc_x - sAkk[r, i] * x[i]
                if r < ctid:
                    acc_x = Float32(0.0)
                x[r] = acc_x
            for r in cutlass.range_constexpr(C):
                sX[r, ctid] = self.io_dtype(x[r])

    @cute.jit
    def x_at(self, sAkk, row, col):
        """X[row, col] during the blocked solve: unit diagonal, strictly-lower part stored transposed above A."""
        val = Float32(0.0)
        if row == col:
            val = Float32(1.0)
        if row > col:
            val = sAkk[col, row]
        return val

    @cute.jit
    def solve_blocked(self, ctid, sAkk, sY, sX):
        """X = (I + A)^-1 for strictly-lower A [64, 64] (fp32 smem), in 16 x 16 blocks, 256 threads.

        Level 0: each diagonal block by forward substitution (64 threads, one column each, 120-FMA chains).
        Level d = 1..3: off-diagonal blocks p = q + d: Y = sum_{k=q}^{p-1} A_pk X_kq, then X_pq = -X_pp Y
        (one element per thread and block). X's strictly-lower part is written transposed into the unused
        upper triangle of the A buffer, so A stays readable throughout. Ends with X in bf16 in sX.
        """
        if ctid < C:
            base = (ctid // 16) * 16
            c = ctid % 16
            x = cute.make_rmem_tensor((16,), Float32)
            for r in cutlass.range_constexpr(16):
                acc = Float32(0.0)
                if r == c:
                    acc = Float32(1.0)
                for i in cutlass.range_constexpr(r):
                    acc = acc - sAkk[base + r, base + i] * x[i]
                if r < c:
                    acc = Float32(0.0)
                x[r] = acc
            for r in cutlass.range_constexpr(16):
                if r > c:
                    sAkk[base + c, base + r] = x[r]
        cute.arch.barrier(barrier_id=1, number_of_threads=256)
        rr = ctid // 16
        cc = ctid % 16
        for d in cutlass.range_constexpr(1, 4):
            for q in cutlass.range_constexpr(4 - d):
                p = q + d
                acc = Float32(0.0)
                for kb in cutlass.range_constexpr(q, p):
                    for s in cutlass.range_constexpr(16):
                        acc = acc + sAkk[16 * p + rr, 16 * kb + s] * self.x_at(sAkk, 16 * kb + s, 16 * q + cc)
                sY[q, rr, cc] = acc
            cute.arch.barrier(barrier_id=1, number_of_threads=256)
            for q in cutlass.range_constexpr(4 - d):
                p = q + d
                acc = Float32(0.0)
                for s in cutlass.range_constexpr(16):
                    acc = acc - self.x_at(sAkk, 16 * p + rr, 16 * p + s) * sY[q, s, cc]
                sAkk[16 * q + cc, 16 * p + rr] = acc
            cute.arch.barrier(barrier_id=1, number_of_threads=256)
        for e in cutlass.range(ctid, C * C, 256, unroll=4):
            sX[e // C, e % C] = self.io_dtype(self.x_at(sAkk, e // C, e % C))

    @cute.jit
    def store_state_copy(self, acc_s, cc_s, sS, j):
        for i in cutlass.range_constexpr(cute.size(acc_s)):
            r, cidx = cc_s[i]
            sS[r, cidx, j] = self.io_dtype(acc_s[i])
        cute.arch.fence_proxy("async.shared", space="cta")

    def make_mma(self, a_mn_major: bool, b_mn_major: bool, n: int = 64):
        """A one-warpgroup tiled MMA with (64 x n x 16) atoms, bf16/fp16 operands from smem, fp32 acc."""
        major = lambda mn: warpgroup.OperandMajorMode.MN if mn else warpgroup.OperandMajorMode.K
        op = warpgroup.MmaF16BF16Op(self.io_dtype, Float32, (64, n, 16), warpgroup.OperandSource.SMEM,
                                    major(a_mn_major), major(b_mn_major))
        return cute.make_tiled_mma(cute.make_mma_atom(op), (1, 1, 1))

    @cute.jit
    def gemm(self, wtid, acc, sA, sB, a_mn_major: bool, b_mn_major: bool, accumulate: bool, n: int = 64):
        """acc (+)= A B on one warpgroup (A: (M, K), B: (N, K) smem views), then wait for it.

        The tiled MMA is built here, not shared: its accumulate flag is IR state that must be defined in
        the control-flow region that uses it.
        """
        tiled_mma = self.make_mma(a_mn_major, b_mn_major, n)
        thr = tiled_mma.get_slice(wtid)
        tCrA = tiled_mma.make_fragment_A(thr.partition_A(sA))
        tCrB = tiled_mma.make_fragment_B(thr.partition_B(sB))
        warpgroup.fence()
        for kb in cutlass.range_constexpr(cute.size(tCrA, mode=[2])):
            tiled_mma.set(warpgroup.Field.ACCUMULATE, accumulate or kb != 0)
            cute.gemm(tiled_mma, acc, tCrA[None, None, kb], tCrB[None, None, kb], acc)
        warpgroup.commit_group()
        warpgroup.wait_group(0)
