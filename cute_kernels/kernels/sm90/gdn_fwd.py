"""SM90 (Hopper) fused chunked forward of the gated delta rule: GDN (a scalar decay per head and token) and,
with `kda=True`, KDA (a decay per key channel).

The math is the chunked form of `shared/design/linear_attention.md`
(`cute_kernels.reference.chunk_gated_delta_rule_ref` is its float64 spec). Version 2 (issue 4): the per-element
work that made version 1 instruction-bound (~19 us per chunk) is folded into the products' operands and
epilogues; accumulators go to shared memory with `stmatrix`, the output leaves in 16-byte vectors.
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import cpasync, warp, warpgroup

from . import wgmma_tiles

from cute_kernels.reference.kda_intra import ANCHOR_LIMIT_LOG2
from schedulers.device import TileScheduler

C = 64        # chunk length (tokens)
HALF = 64     # V columns owned by one consumer warpgroup
NUM_STAGES = 2  # q/k/v ring depth for GDN (KDA: 1)
# Row stride (floats) of the fp32 Akk / X buffer: 16-byte rows, so the blocked solve reads 4 floats per load
# (272-byte rows also keep 8 consecutive rows' 16-byte loads on distinct banks).
AKK_STRIDE = C + 4
SOLVE_Y = 1024   # floats of the solve's product buffer (its level 32: a 32 x 32 tile)
Y_STRIDE = 40    # `solve_levels_mma`'s Y rows (padded: conflict-free fragment loads)
SOLVE_Y_MMA = 32 * Y_STRIDE
LOG2E = math.log2(math.e)
# KDA: the anchored diagonal-block products use right factors up to 2^KDA_ANCHOR_LIMIT (log2 units, per 16 rows).
# A chunk whose decay inside a 16-row block exceeds it takes the exact (slower) diagonal path instead.
KDA_ANCHOR_LIMIT = ANCHOR_LIMIT_LOG2


_smem_layout = wgmma_tiles.smem_layout
_one = wgmma_tiles.first_stage


def flat(t):
    """[B, T, ...] -> [B * T, ...]: the ops pass contiguous tensors, so B's stride is T times T's (flattening in the
    kernel keeps tensor views off the host's per-call path)."""
    return cute.make_tensor(
        t.iterator,
        cute.make_layout((t.shape[0] * t.shape[1],) + tuple(t.shape[2:]), stride=(t.stride[1],) + tuple(t.stride[2:])),
    )


def thd(t):
    """A [tokens, H, D] tensor as (tokens, D, H), the per-head 2-D tiles TMA loads."""
    return cute.make_tensor(
        t.iterator,
        cute.make_layout((t.shape[0], t.shape[2], t.shape[1]), stride=(t.stride[0], t.stride[2], t.stride[1])),
    )


class ChunkGatedDeltaRuleFwdSm90:
    """Fused GDN / KDA forward on Hopper: one CTA per work tile (sequence, head, chunk range), state on chip.

    Warp roles (384 threads, 3 warpgroups):
    - warpgroup 0, warp 0: producer. Issues TMA (`cp.async.bulk.tensor`) loads of the q, k, v chunk tiles
      [64 tokens x 128] of its head into a `NUM_STAGES`-deep shared-memory ring. Registers lowered to 40
      (`setmaxnreg.dec`). Warps 1-3 of warpgroup 0 idle.
    - warpgroups 1 and 2: consumers (registers raised to 232). Consumer j owns V columns [64 j, 64 j + 64) of
      the state S (K x V fp32, accumulator registers of a 128 x 64 wgmma tile) for the whole tile.
    Pipelines: `PipelineTmaAsync` q/k/v ring (NUM_STAGES stages, producer = 1 thread, consumers = 8 warps);
    named barriers between the consumer phases inside a chunk (id 1: both consumer warpgroups; ids 2, 3: one;
    id 4: the 64 threads that compute the GDN gates).

    Modes (compile time): `forward` (start from initial_state[seq], write o and final_state[seq]);
    `summary` (tiles carry block 0 / 1: run the segment from 0 with the real v / from I with zero v, write the
    end state to summary[block * slots + seg_slot] = (h_ext, M), no o); `segment_outputs` (start from
    start_states[seg_slot], write o). Together with `affine_merge` they make the segmented forward.

    Per chunk (rows r, i < L = tokens in the chunk; G = cumulative decay inside the chunk in log2 units):
      0. Gates: GDN: G by a warp-shuffle scan over the 64 rows (loaded one chunk ahead), 2^G, 2^(G_L - G), beta.
         KDA: G[r, d] per channel (one thread per channel), beta.
      1. Intra-chunk products. GDN: kk = k k^T (consumer 0) and qk = q k^T (consumer 1) on wgmma, scaled in
         registers by 2^(G_r - G_i) (<= 1), beta_r / scale, masked -> Akk fp32 smem, Aqk bf16 smem (stmatrix);
         meanwhile both issue q S_j, whose rows are then scaled by scale 2^G_r (o's inter-chunk part).
         KDA: anchored 64 x 16 x 128 products per 16-column block (`kda_intra`), then in-place gating of q, k
         and kb = k 2^G (per channel), then q S_j.
      2. X = (I + Akk)^-1 in fp32 (16 x 16 diagonal blocks by substitution, off-diagonal blocks by products),
         written as Xv = X diag(beta) and (GDN) Xk = X diag(beta 2^G) in bf16: the gating of v and k moves
         into X, so GDN never rewrites its q/k/v tiles.
      3. Consumer j: w[:, cols j] = Xk k (KDA: Xv kb) -> -w bf16 smem; u_j = Xv v_j (registers).
      4. v_new_j = u_j - w S_j (wgmma, S_j bf16 in smem) -> bf16 smem; GDN also 2^(G_L - G_r) v_new_j.
      5. o_j += Aqk v_new_j and S_j <- 2^G_L S_j + k^T (2^(G_L - G) v_new_j) (KDA: the gated k tile), issued
         together; o_j -> smem (stmatrix into the decayed-v_new half, KDA: the -w buffer) -> global in 16-byte
         vectors (rows < L).
    `skip` leaves stages out, for timing by subtraction only.
    """

    def __init__(self, io_dtype, beta_dtype, has_initial_state: bool, store_final_state: bool,
                 persistent: bool = False, k_dim: int = 128, v_dim: int = 128, kda: bool = False,
                 mode: str = "forward", skip: tuple = (), vec_elementwise: bool = False,
                 prefetch_gates: bool = False):
        if k_dim != 128 or v_dim != 128:
            raise ValueError(f"ChunkGatedDeltaRuleFwdSm90 supports K = V = 128, got K={k_dim}, V={v_dim}")
        self.io_dtype = io_dtype
        self.beta_dtype = beta_dtype
        self.has_initial_state = has_initial_state
        self.store_final_state = store_final_state
        self.persistent = persistent
        self.k_dim = k_dim
        self.v_dim = v_dim
        if mode not in ("forward", "summary", "segment_outputs"):
            raise ValueError(f"mode must be 'forward', 'summary' or 'segment_outputs', got {mode!r}")
        self.kda = kda
        self.mode = mode
        # Profiling by subtraction only: stages left out (results are wrong), see scripts/gdn_profile.py.
        unknown = set(skip) - {"gates", "intra", "gating", "solve", "wu", "vnew", "out", "state"}
        if unknown:
            raise ValueError(f"unknown stages to skip: {sorted(unknown)}")
        self.skip = tuple(sorted(skip))
        # KDA: the per-element passes (gating, the anchored factors of `kda_block`) in 16-byte vectors of 8
        # channels through a 256-thread tiled copy, instead of one 2-byte element per thread and step.
        self.vec_elementwise = vec_elementwise
        # The solve's doubling levels as tf32 tensor-core products (`solve_levels_mma`); the prep kernel's switch.
        self.solve_mma = False
        # KDA: the next chunk's raw g rows stream into the G buffer by cp.async once this chunk's step 1 is done
        # with it, and its beta into a register, so the gates stage reads shared memory instead of waiting on
        # global loads.
        self.prefetch_gates = prefetch_gates
        # KDA keeps the per-channel cumulative decay G [64 x 128] fp32 in smem (32 KB): one q/k/v stage then fits.
        self.num_stages = 1 if kda else NUM_STAGES
        self.num_threads = 384
        self.tma_bytes = 3 * C * 128 * io_dtype.width // 8
        self.load_v = True   # ChunkPrepSm90(fold=True) loads only q and k

    # ------------------------------------------------------------------ host side

    @cute.jit
    def __call__(
        self,
        q: cute.Tensor,            # [B, T, H, K] (B and T are flattened here; tiles carry token offsets)
        k: cute.Tensor,            # [B, T, H, K]
        v: cute.Tensor,            # [B, T, H, V]
        g: cute.Tensor,            # [B, T, H] fp32 (KDA: [B, T, H, K]), per-step log decay
        beta: cute.Tensor,         # [B, T, H]
        o: cute.Tensor,            # [B, T, H, V]
        initial_state: cute.Tensor,  # [N, H, K, V] fp32 (if has_initial_state); segment_outputs: [slots, H, K, V]
        final_state: cute.Tensor,    # [N, H, K, V] fp32 (if store_final_state); summary: [2 * slots, H, K, V]
        tiles: cute.Tensor,        # [num_tiles, NUM_TILE_FIELDS] int32 (a Schedule's table)
        num_tiles: Int32,
        grid_x: Int32,
        scale: Float32,
        stream,
    ):
        q, k, v, g, beta, o = flat(q), flat(k), flat(v), flat(g), flat(beta), flat(o)
        tma_q, tma_q_tensor, tma_k, tma_k_tensor, tma_v, tma_v_tensor = self.qkv_tma(q, k, v)
        self.set_shared_storage()
        self.kernel(
            tma_q, tma_q_tensor, tma_k, tma_k_tensor, tma_v, tma_v_tensor,
            g, beta, o, initial_state, final_state, tiles, num_tiles, scale,
        ).launch(
            grid=[grid_x, 1, 1],
            block=[self.num_threads, 1, 1],
            stream=stream,
            min_blocks_per_mp=1,
        )

    def qkv_tma(self, q, k, v):
        """TMA atoms and tensors of the q, k, v chunk tiles [64 x 128] (flattened [tokens, H, 128] inputs)."""
        tile_layout = _one(_smem_layout(C, 128, self.io_dtype))
        op = cpasync.CopyBulkTensorTileG2SOp()
        tma_q, tma_q_tensor = cpasync.make_tiled_tma_atom(op, thd(q), tile_layout, (C, 128))
        tma_k, tma_k_tensor = cpasync.make_tiled_tma_atom(op, thd(k), tile_layout, (C, 128))
        tma_v, tma_v_tensor = cpasync.make_tiled_tma_atom(op, thd(v), tile_layout, (C, 128))
        return tma_q, tma_q_tensor, tma_k, tma_k_tensor, tma_v, tma_v_tensor

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
            sScan: cute.struct.MemRange[Float32, 4]     # GDN gate scan: per-warp totals
            sFlag: cute.struct.MemRange[Int32, 4]       # KDA: 1 if a chunk needs the exact diagonal path
            sGk: cute.struct.Align[cute.struct.MemRange[Float32, C * 128 if kda else 4], 16]  # KDA: G[r, d]
            sGL: cute.struct.MemRange[Float32, 128 if kda else 4]   # KDA: G[L-1, d]

        self.shared_storage = SharedStorage
        self.smem_bytes = SharedStorage.size_in_bytes()
        assert self.smem_bytes <= 232448, f"shared storage {self.smem_bytes} B exceeds the 227 KB an SM90 CTA can have"

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
                self.producer(sched, load, tma_q, mQ, tma_k, mK, tma_v, mV,
                              self.view(st.sQ, C, 128, ns), self.view(st.sK, C, 128, ns),
                              self.view(st.sV, C, 128, ns))
        else:
            cute.arch.setmaxregister_increase(232)
            self.consumer(sched, load, wg - 1, tidx - 128, mG, mBeta, mO, mS0, mSN, scale, st)

    def view(self, field, rows, cols, stages=1, mn_view=False):
        """(row, col, stage) view of a swizzled 16-bit smem field (see `_smem_layout`)."""
        layout = _smem_layout(rows, cols, self.io_dtype, stages, mn_view)
        return field.get_tensor(layout.outer, swizzle=layout.inner)

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
                tiles = ((tma_q, mQ, sQ), (tma_k, mK, sK), (tma_v, mV, sV))
                if cutlass.const_expr(not self.load_v):
                    tiles = tiles[:2]
                for tma, m, s in tiles:
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
    def consumer(self, sched, load, j, ctid, mG, mBeta, mO, mS0, mSN, scale, st):
        kda = self.kda
        outputs = self.mode != "summary"
        wtid = ctid % 128                       # thread index inside this consumer warpgroup
        v0 = j * HALF                           # first V column of this warpgroup
        ns = self.num_stages
        sQ = self.view(st.sQ, C, 128, ns)                # (token, channel, stage)
        sK = self.view(st.sK, C, 128, ns)
        sK_mn = self.view(st.sK, C, 128, ns, True)       # (channel, token, stage)
        sV_mn = self.view(st.sV, C, 128, ns, True)
        sNegW = self.view(st.sNegW, C, 128)[None, None, 0]   # (token, channel); o staging later
        sXv = self.view(st.sXv, C, C)[None, None, 0]
        sAqk = self.view(st.sAqk, C, C)[None, None, 0]
        sVnew = self.view(st.sVnew, C, HALF, 2)          # (token, v, half)
        sVnew_mn = self.view(st.sVnew, C, HALF, 2, True)  # (v, token, half)
        sS = self.view(st.sS, 128, HALF, 2)              # (k, v, half)
        sS_mn = self.view(st.sS, 128, HALF, 2, True)     # (v, k, half)
        sAkk = st.sAkk.get_tensor(cute.make_layout((C, C), stride=(AKK_STRIDE, 1)))
        sY = st.sY.get_tensor(cute.make_layout(SOLVE_Y))
        sG = st.sG.get_tensor(cute.make_layout(C))
        sEG = st.sEG.get_tensor(cute.make_layout(C))
        sEGL = st.sEGL.get_tensor(cute.make_layout(C))
        sBeta = st.sBeta.get_tensor(cute.make_layout(C))
        sScan = st.sScan.get_tensor(cute.make_layout(4))
        sFlag = st.sFlag.get_tensor(cute.make_layout(4))
        sXk = sXv
        sVnewD = sVnew
        sVnewD_mn = sVnew_mn
        sKb_mn = sK_mn[None, None, 0]
        sGk = sG
        sGL = sG
        if cutlass.const_expr(kda):
            sKb_mn = self.view(st.sKb, C, 128, 1, True)[None, None, 0]   # (channel, token)
            sGk = st.sGk.get_tensor(cute.make_layout((C, 128), stride=(128, 1)))
            sGL = st.sGL.get_tensor(cute.make_layout(128))
        else:
            sXk = self.view(st.sXk, C, C)[None, None, 0]
            sVnewD = self.view(st.sVnewD, C, HALF, 2)
            sVnewD_mn = self.view(st.sVnewD, C, HALF, 2, True)

        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.num_stages)
        mma64 = self.make_mma(False, True)
        mma_s = self.make_mma(True, True)
        thr_kk = self.make_mma(False, False).get_slice(wtid)
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
            self.store_acc(wtid, mma_s, acc_s, sS[None, None, j])
            cute.arch.fence_proxy("async.shared", space="cta")
            cute.arch.barrier(barrier_id=2 + j, number_of_threads=128)

            # GDN: this chunk's g and beta are loaded one chunk ahead (64 threads, one row each).
            gv = Float32(0.0)
            bv = Float32(0.0)
            if cutlass.const_expr(not kda):
                if ctid < C:
                    if tok0 + ctid < tok_end:
                        gv = Float32(mG[tok0 + ctid, head])
                        bv = Float32(mBeta[tok0 + ctid, head])
            if cutlass.const_expr(kda and self.prefetch_gates):
                # KDA with prefetched gates: the first chunk's g (cp.async into sGk) and beta (register).
                if ctid < C:
                    if tok0 + ctid < tok_end:
                        bv = Float32(mBeta[tok0 + ctid, head])
                L0 = tok_end - tok0
                if L0 > C:
                    L0 = Int32(C)
                self.kda_g_prefetch(ctid, tok0, L0, head, mG, sGk)

            for c in cutlass.range(work.chunk_end - work.chunk_start, unroll=1):
                t0 = tok0 + c * C
                L = tok_end - t0
                if L > C:
                    L = Int32(C)
                # -- 0. gates of this chunk (fp32, log2 units), before waiting on the tile
                if cutlass.const_expr(kda):
                    if cutlass.const_expr("gates" not in self.skip):
                        self.kda_gates(ctid, t0, L, head, mG, mBeta, sGk, sGL, sBeta, sFlag, bv)
                    if cutlass.const_expr(self.prefetch_gates):
                        bv = Float32(0.0)
                        if ctid < C:
                            if t0 + C + ctid < tok_end:
                                bv = Float32(mBeta[t0 + C + ctid, head])
                else:
                    if cutlass.const_expr("gates" not in self.skip):
                        self.gdn_gates(ctid, L, gv, bv, sG, sEG, sEGL, sBeta, sScan)
                    gv = Float32(0.0)
                    bv = Float32(0.0)
                    if ctid < C:
                        if t0 + C + ctid < tok_end:
                            gv = Float32(mG[t0 + C + ctid, head])
                            bv = Float32(mBeta[t0 + C + ctid, head])

                load.consumer_wait(state)
                cute.arch.barrier(barrier_id=1, number_of_threads=256)
                stage = state.index

                # -- 1. intra-chunk products (and q S_j)
                if cutlass.const_expr(kda):
                    if cutlass.const_expr("intra" not in self.skip):
                        self.kda_intra(j, ctid, wtid, L, scale, stage, sQ, sK, sAkk, sAqk, sNegW, sGk, sBeta, sFlag,
                                       st)
                    if cutlass.const_expr("gating" not in self.skip):
                        if cutlass.const_expr(self.vec_elementwise):
                            self.kda_gating_vec(ctid, L, stage, sQ, sK, self.view(st.sKb, C, 128)[None, None, 0],
                                                sGk, sGL)
                        else:
                            self.kda_gating(ctid, L, stage, sQ, sK, sKb_mn, sGk, sGL)
                    cute.arch.fence_proxy("async.shared", space="cta")
                    cute.arch.barrier(barrier_id=1, number_of_threads=256)
                    if cutlass.const_expr(self.prefetch_gates):
                        # sGk is free until the next chunk's gates: stream that chunk's raw g into it.
                        if c + 1 < work.chunk_end - work.chunk_start:
                            L1 = tok_end - t0 - C
                            if L1 > C:
                                L1 = Int32(C)
                            self.kda_g_prefetch(ctid, t0 + C, L1, head, mG, sGk)
                    if cutlass.const_expr(outputs and "out" not in self.skip):
                        self.gemm(wtid, acc_o, sQ[None, None, stage], sS_mn[None, None, j], False, True, False)
                        for i in cutlass.range_constexpr(cute.size(acc_o)):
                            acc_o[i] = acc_o[i] * scale
                else:
                    acc_kk = cute.make_rmem_tensor(thr_kk.partition_shape_C((C, C)), Float32)
                    cc_kk = thr_kk.partition_C(cute.make_identity_tensor((C, C)))
                    if cutlass.const_expr("intra" not in self.skip):
                        self.gdn_intra_issue(j, wtid, acc_kk, stage, sQ, sK, outputs)
                    if cutlass.const_expr(outputs and "out" not in self.skip):
                        self.gemm(wtid, acc_o, sQ[None, None, stage], sS_mn[None, None, j], False, True, False,
                                  wait=False)
                    warpgroup.wait_group(0)
                    if cutlass.const_expr("intra" not in self.skip):
                        self.gdn_intra_finish(j, wtid, acc_kk, cc_kk, L, scale, sG, sBeta, tAkk, sAqk, outputs)
                    if cutlass.const_expr(outputs and "out" not in self.skip):
                        for i in cutlass.range_constexpr(cute.size(acc_o)):
                            r, col = cc_ab[i]
                            acc_o[i] = acc_o[i] * (sEG[r] * scale)
                    cute.arch.fence_proxy("async.shared", space="cta")
                    cute.arch.barrier(barrier_id=1, number_of_threads=256)

                # -- 2. X = (I + Akk)^-1 in fp32 -> Xv = X diag(beta), GDN: Xk = X diag(beta 2^G) (bf16)
                if cutlass.const_expr("solve" not in self.skip):
                    self.solve_blocked(ctid, sAkk, sY, sXv, sXk, sBeta, sEG)
                cute.arch.fence_proxy("async.shared", space="cta")
                cute.arch.barrier(barrier_id=1, number_of_threads=256)

                # -- 3. -w columns of this warpgroup (-> smem) and u_j (registers)
                if cutlass.const_expr("wu" not in self.skip):
                    if cutlass.const_expr(kda):
                        self.gemm(wtid, acc, sXv, cute.local_tile(sKb_mn, (HALF, C), (j, 0)), False, True, False)
                    else:
                        self.gemm(wtid, acc, sXk, cute.local_tile(sK_mn[None, None, stage], (HALF, C), (j, 0)),
                                  False, True, False)
                    for i in cutlass.range_constexpr(cute.size(acc)):
                        acc[i] = -acc[i]
                    self.store_acc(wtid, mma64, acc, cute.local_tile(sNegW, (C, HALF), (0, j)))
                    if cutlass.const_expr(self.mode == "summary"):
                        if blk == 1:   # M columns: the recurrence on the identity with zero values
                            acc.fill(0.0)
                        else:
                            self.gemm(wtid, acc, sXv, cute.local_tile(sV_mn[None, None, stage], (HALF, C), (j, 0)),
                                      False, True, False)
                    else:
                        self.gemm(wtid, acc, sXv, cute.local_tile(sV_mn[None, None, stage], (HALF, C), (j, 0)),
                                  False, True, False)
                cute.arch.fence_proxy("async.shared", space="cta")
                cute.arch.barrier(barrier_id=1, number_of_threads=256)

                # -- 4. v_new_j = u_j - w S_j (GDN: also 2^(G_L - G_r) v_new_j for the state update)
                if cutlass.const_expr("vnew" not in self.skip):
                    self.gemm(wtid, acc, sNegW, sS_mn[None, None, j], False, True, True)
                    self.store_acc(wtid, mma64, acc, sVnew[None, None, j])
                    if cutlass.const_expr(not kda):
                        for i in cutlass.range_constexpr(cute.size(acc)):
                            r, col = cc_ab[i]
                            acc[i] = acc[i] * sEGL[r]
                        self.store_acc(wtid, mma64, acc, sVnewD[None, None, j])
                cute.arch.fence_proxy("async.shared", space="cta")
                cute.arch.barrier(barrier_id=2 + j, number_of_threads=128)

                # -- 5. o_j += Aqk v_new_j; S_j <- 2^G_L S_j + k~^T v_new~_j (one commit, one wait)
                if cutlass.const_expr(outputs and "out" not in self.skip):
                    self.gemm(wtid, acc_o, sAqk, sVnew_mn[None, None, j], False, True, True, wait=False)
                if cutlass.const_expr("state" not in self.skip):
                    if cutlass.const_expr(kda):
                        for i in cutlass.range_constexpr(cute.size(acc_s)):
                            r, cidx = cc_s[i]
                            acc_s[i] = acc_s[i] * cute.math.exp2(sGL[r], fastmath=True)
                    else:
                        decay_last = sEG[L - 1]
                        for i in cutlass.range_constexpr(cute.size(acc_s)):
                            acc_s[i] = acc_s[i] * decay_last
                    self.gemm(wtid, acc_s, sK_mn[None, None, stage], sVnewD_mn[None, None, j], True, True, True,
                              wait=False)
                warpgroup.wait_group(0)
                load.consumer_release(state)   # this warp is done with the q/k/v stage
                state.advance()
                # The o tile is staged in this warpgroup's decayed-v_new half (GDN: only its own products read
                # it, so a warpgroup barrier suffices) or in its half of the -w buffer (KDA: both warpgroups
                # read all of -w in step 4, so both must be past it).
                sO = sVnewD[None, None, j]
                if cutlass.const_expr(kda):
                    sO = cute.local_tile(sNegW, (C, HALF), (0, j))
                    cute.arch.barrier(barrier_id=1, number_of_threads=256)
                else:
                    cute.arch.barrier(barrier_id=2 + j, number_of_threads=128)
                if cutlass.const_expr(outputs and "out" not in self.skip):
                    self.store_acc(wtid, mma64, acc_o, sO)
                if cutlass.const_expr("state" not in self.skip):
                    self.store_acc(wtid, mma_s, acc_s, sS[None, None, j])
                cute.arch.fence_proxy("async.shared", space="cta")
                cute.arch.barrier(barrier_id=2 + j, number_of_threads=128)
                if cutlass.const_expr(outputs and "out" not in self.skip):
                    self.store_rows(wtid, sO, mO, t0, head, v0, L)
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

    @cute.jit
    def gdn_gates(self, ctid, L, gv, bv, sG, sEG, sEGL, sBeta, sScan):
        """G_r (log2 units) by a two-warp shuffle scan; 2^G_r, 2^(G_last - G_r) (0 past the end), beta_r.

        Rows past the chunk end carry g = 0, so G_63 = G_last.
        """
        if ctid < C:
            lane = ctid % 32
            x = gv * LOG2E
            for off in cutlass.range_constexpr(5):
                y = cute.arch.shuffle_sync_up(x, 1 << off)
                if lane >= (1 << off):
                    x = x + y
            if lane == 31:
                sScan[ctid // 32] = x
            cute.arch.barrier(barrier_id=4, number_of_threads=64)
            s0 = sScan[0]
            glast = s0 + sScan[1]
            if ctid >= 32:
                x = x + s0
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
    def kda_gates(self, ctid, t0, L, head, mG, mBeta, sGk, sGL, sBeta, sFlag, beta_pre, sC=None,
                  g_vec: bool = False):
        """G[r, d] (log2 units), G[L-1, d], beta_r; sFlag[0] = 1 if some 16-row block decays by more than
        KDA_ANCHOR_LIMIT in some channel (then the exact diagonal path runs). With `sC` ([10, 128] fp32, the
        row-anchored Akk / Aqk of `ChunkPrepSm90`): rows 0-5 the channel factors 2^(G[16 p, d] - G[16 q, d]) of
        the block pairs (p, q) = (1, 0), (2, 1), (3, 2), (2, 0), (3, 1), (3, 0), in that order; rows 6-9 the
        anchors' 2^G[16 m, d], m = 0..3. `g_vec`: the raw g rows were prefetched by `ChunkPrepSm90.kda_g_prefetch_vec`
        (each thread copied other threads' values): wait, then a consumer barrier before reading them.

        All 256 consumer threads: thread ctid scans channel d = ctid % 128 over rows [32 h, 32 h + 32), h = ctid // 128
        (32 independent loads, then the running sum in registers); the second half adds the first half's total.
        """
        d = ctid % 128
        h = ctid // 128
        if ctid == 0:
            sFlag[0] = Int32(0)
        if ctid < C:
            bv = beta_pre    # prefetched (0 past the end)
            if cutlass.const_expr(not self.prefetch_gates):
                bv = Float32(0.0)
                if ctid < L:
                    bv = Float32(mBeta[t0 + ctid, head])
            sBeta[ctid] = bv
        gl = cute.make_rmem_tensor((32,), Float32)
        if cutlass.const_expr(self.prefetch_gates):
            cute.arch.cp_async_wait_group(0)   # this thread's raw g rows are in sGk (0 past the end)
            if cutlass.const_expr(g_vec):
                cute.arch.barrier(barrier_id=1, number_of_threads=256)   # and every other thread's
            for rr in cutlass.range_constexpr(32):
                gl[rr] = sGk[32 * h + rr, d] * LOG2E
        else:
            for rr in cutlass.range_constexpr(32):
                gv = Float32(0.0)
                if 32 * h + rr < L:
                    gv = Float32(mG[t0 + 32 * h + rr, head, d])
                gl[rr] = gv * LOG2E
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
    def kda_gating(self, ctid, L, stage, sQ, sK, sKb_mn, sGk, sGL):
        """In place per channel: q <- q 2^G, k <- k 2^(G_L - G) (0 past the end); kb = k 2^G (beta is in X)."""
        io = self.io_dtype
        for e in cutlass.range(ctid, C * 128, 256, unroll=4):
            r = e // 128
            col = e % 128
            gr = sGk[r, col]
            eg = cute.math.exp2(gr, fastmath=True)
            egl = Float32(0.0)
            if r < L:
                egl = cute.math.exp2(sGL[col] - gr, fastmath=True)
            kv = Float32(sK[r, col, stage])
            sKb_mn[col, r] = io(kv * eg)
            sK[r, col, stage] = io(kv * egl)
            sQ[r, col, stage] = io(Float32(sQ[r, col, stage]) * eg)

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
        """`kda_gating` in 16-byte vectors: q <- q 2^G, k <- k 2^(G_L - G) (0 past the end), kb = k 2^G (sKb is
        the K-major (token, channel) view of the kb buffer: the same bytes as its MN-major view)."""
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
        outputs = self.mode != "summary"
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
        """KDA Akk (fp32, beta on rows) and Aqk (bf16, scaled) without overflow.

        Fast path (every 16-row block decays by at most 2^KDA_ANCHOR_LIMIT): per 16-column block qb, anchored at
        its first row a: [x_r 2^(G_r - G_a)] @ [k_i 2^(G_a - G_i)]^T on wgmma (64 x 16 x 128; warpgroup 0 for
        k, 1 for q), rows r >= a. Exact path otherwise: blocks below the diagonal anchored at the block's last
        row (both factors <= 1), diagonal 16 x 16 blocks as exact channel sums. Spec and tests:
        cute_kernels/reference/kda_intra.py.
        """
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
        outputs = self.mode != "summary"
        thr16 = self.make_mma(False, False, 16).get_slice(wtid)
        cc16 = thr16.partition_C(cute.make_identity_tensor((C, 16)))
        acc16 = cute.make_rmem_tensor(thr16.partition_shape_C((C, 16)), Float32)
        if cutlass.const_expr(self.vec_elementwise):
            self.kda_factors_vec(ctid, stage, qb, anchor, lo, sQ, sK, sL, sLq, sR, sGk)
        else:
            for e in cutlass.range(ctid + 128 * lo, C * 128, 256, unroll=4):
                r = e // 128
                d = e % 128
                f = cute.math.exp2(sGk[r, d] - sGk[anchor, d], fastmath=True)
                sL[r, d] = io(Float32(sK[r, d, stage]) * f)
                if cutlass.const_expr(outputs):  # Aqk only feeds the outputs
                    sLq[r, d] = io(Float32(sQ[r, d, stage]) * f)
            for e in cutlass.range(ctid, 16 * 128, 256, unroll=4):
                i = e // 128
                d = e % 128
                f = cute.math.exp2(sGk[anchor, d] - sGk[16 * qb + i, d], fastmath=True)
                sR[i, d] = io(Float32(sK[16 * qb + i, d, stage]) * f)
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.barrier(barrier_id=1, number_of_threads=256)
        # Every element of the 64 x 16 column block is written (zeros outside the kept rows), so the fast path
        # needs no zero fill; the exact path overwrites the diagonal block afterwards.
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
    def solve_blocked(self, ctid, sAkk, sY, sXv, sXk, sBeta, sEG, prof=None, sRow=None):
        """X = (I + A)^-1 for strictly-lower A [64, 64] (fp32 smem), 256 threads, by recursive doubling.

        Level 0: each 16 x 16 diagonal block by right-looking substitution (64 threads, one column each).
        Levels h = 16, 32 (all 256 threads): the diagonal blocks of size 2 h, X_10 = -X_11 (A_10 X_00) in two
        phases (Y = A_10 X_00 into sY, then X_10 = -(Y + X_11^strict Y)); operands read as 16-byte vectors (with one
        scalar load per operand the solve was bound by shared-memory instructions). Five barriers (the level
        scheme before it, 16 x 16 off-diagonal blocks one level at a time, had seven, and its later levels left
        128-192 threads idle). With `solve_mma` the two levels are tf32 tensor-core products instead
        (`solve_levels_mma`). X's strictly-lower part is written transposed into the unused upper triangle of
        the A buffer, so A stays readable throughout. Ends with
        Xv = X diag(beta) and (GDN) Xk = X diag(beta 2^G) in bf16, 16-byte stores. Spec (same steps, CPU-tested):
        cute_kernels/reference/blocked_solve.py. `prof` (the prep kernel's profile build): cycles of level 0, level
        16, level 32 and the 16-bit stores are added to prof[10 .. 13] (prof[7]: the last stamp). `sRow` given
        (GDN, `ChunkPrepSm90(fold=True)`): the second output is diag(sRow) X diag(beta) instead of Xk.
        """
        io = self.io_dtype
        if ctid < C:
            # Right-looking substitution: once x_i is final, every later row takes its term (independent FMAs,
            # a 16-step critical path instead of a 120-step one). Rows above c stay 0 by construction.
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
        self.solve_stamp(prof, 10)
        if cutlass.const_expr(self.solve_mma):
            self.solve_levels_mma(ctid, sAkk, sY, prof)
        else:
            self.solve_levels(ctid, sAkk, sY, prof)
        # Xv = X diag(beta), Xk = X diag(beta 2^G) in 16-bit: thread (r, i-group) writes 8 consecutive columns
        # [i0, i0 + 8) of row r per pass (one 16-byte store each); X[r, i] (i < r) sits transposed at [i, r].
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
            elif cutlass.const_expr(not self.kda):
                cute.autovec_copy(cute.local_tile(sEG, (8,), (cute.assume(i0, divby=8) // 8,)), fb)
                for e in cutlass.range_constexpr(8):
                    yk[e] = io(xb[e] * fb[e])
                cute.autovec_copy(yk, cute.local_tile(sXk[r, None], (8,), (cute.assume(i0, divby=8) // 8,)))
        self.solve_stamp(prof, 13)

    @cute.jit
    def solve_levels(self, ctid, sAkk, sY, prof):
        """`solve_blocked`'s doubling levels h = 16, 32 on the CUDA cores (256 threads; prof stamps 11, 12)."""
        # Doubling levels h = 16, 32: the diagonal blocks of size 2h are [[X_00, 0], [X_10, X_11]] with
        # X_10 = -X_11 A_10 X_00, two phases each: Y = A_10 X_00 (-> sY), then X_10 = -(Y + X_11^strict Y), stored
        # transposed above the diagonal. Every sum keeps 4 partial sums by term index % 4 (shorter dependency
        # chains); operands along the reduction are read as 16-byte vectors where they are contiguous.
        sY16 = cute.make_tensor(sY.iterator, cute.make_layout((64, 16), stride=(16, 1)))   # h = 16: rows b0 + r
        sY32 = cute.make_tensor(sY.iterator, cute.make_layout((32, 32), stride=(32, 1)))
        part = cute.make_rmem_tensor((4, 4), Float32)   # (row j, s % 4)
        a4 = cute.make_rmem_tensor((4, 4), Float32)     # (row j, s0 .. s0 + 3): A rows
        x4 = cute.make_rmem_tensor((4,), Float32)
        # h = 16: the pairs (rows 16..31, cols 0..15) and (rows 48..63, cols 32..47), 128 threads each; thread
        # (rr, cc) owns rows 2 rr, 2 rr + 1 of column cc.
        b0 = 32 * (ctid // 128)
        b1 = b0 + 16
        rr = (ctid % 128) // 16
        cc = ctid % 16
        part.fill(0.0)
        for s0 in cutlass.range_constexpr(0, 16, 4):
            self.load4(sAkk, b0 + cc, b0 + s0, x4)   # X_00[s, cc] sits transposed at [b0 + cc, b0 + s]
            for e in cutlass.range_constexpr(4):
                x4[e] = cutlass.select_(s0 + e < cc, Float32(0.0), x4[e])
                x4[e] = cutlass.select_(s0 + e == cc, Float32(1.0), x4[e])
            for j in cutlass.range_constexpr(2):
                self.load4(sAkk, b1 + 2 * rr + j, b0 + s0, a4[j, None])
            for j in cutlass.range_constexpr(2):
                for e in cutlass.range_constexpr(4):
                    part[j, e] = part[j, e] + a4[j, e] * x4[e]
        for j in cutlass.range_constexpr(2):
            sY16[b0 + 2 * rr + j, cc] = (part[j, 0] + part[j, 1]) + (part[j, 2] + part[j, 3])
        cute.arch.barrier(barrier_id=1, number_of_threads=256)
        part.fill(0.0)
        for s in cutlass.range_constexpr(16):
            # X_11[2 rr + j, s] sits transposed at [b1 + s, b1 + 2 rr + j]
            cute.autovec_copy(cute.local_tile(sAkk[b1 + s, None], (2,), (cute.assume(b1 + 2 * rr, divby=2) // 2,)),
                              cute.local_tile(x4, (2,), (0,)))
            y = sY16[b0 + s, cc]
            for j in cutlass.range_constexpr(2):
                xv = cutlass.select_(s >= 2 * rr + j, Float32(0.0), x4[j])
                part[j, s % 4] = part[j, s % 4] + xv * y
        for j in cutlass.range_constexpr(2):
            x4[j] = -sY16[b0 + 2 * rr + j, cc] - ((part[j, 0] + part[j, 1]) + (part[j, 2] + part[j, 3]))
        cute.autovec_copy(cute.local_tile(x4, (2,), (0,)),
                          cute.local_tile(sAkk[b0 + cc, None], (2,), (cute.assume(b1 + 2 * rr, divby=2) // 2,)))
        cute.arch.barrier(barrier_id=1, number_of_threads=256)
        self.solve_stamp(prof, 11)
        # h = 32: rows 32..63 x cols 0..31, all 256 threads; thread (g, cc) owns rows 4 g .. 4 g + 3 of column cc.
        g = ctid // 32
        cc = ctid % 32
        part.fill(0.0)
        for s0 in cutlass.range_constexpr(0, 32, 4):
            self.load4(sAkk, cc, s0, x4)
            for e in cutlass.range_constexpr(4):
                x4[e] = cutlass.select_(s0 + e < cc, Float32(0.0), x4[e])
                x4[e] = cutlass.select_(s0 + e == cc, Float32(1.0), x4[e])
            for j in cutlass.range_constexpr(4):
                self.load4(sAkk, 32 + 4 * g + j, s0, a4[j, None])
            for j in cutlass.range_constexpr(4):
                for e in cutlass.range_constexpr(4):
                    part[j, e] = part[j, e] + a4[j, e] * x4[e]
        for j in cutlass.range_constexpr(4):
            sY32[4 * g + j, cc] = (part[j, 0] + part[j, 1]) + (part[j, 2] + part[j, 3])
        cute.arch.barrier(barrier_id=1, number_of_threads=256)
        part.fill(0.0)
        for s in cutlass.range_constexpr(32):
            self.load4(sAkk, 32 + s, 32 + 4 * g, x4)   # X_11[4 g + j, s] sits transposed at [32 + s, 32 + 4 g + j]
            y = sY32[s, cc]
            for j in cutlass.range_constexpr(4):
                xv = cutlass.select_(s >= 4 * g + j, Float32(0.0), x4[j])
                part[j, s % 4] = part[j, s % 4] + xv * y
        for j in cutlass.range_constexpr(4):
            x4[j] = -sY32[4 * g + j, cc] - ((part[j, 0] + part[j, 1]) + (part[j, 2] + part[j, 3]))
        cute.autovec_copy(x4, self.tile4(sAkk, cc, 32 + 4 * g))
        cute.arch.barrier(barrier_id=1, number_of_threads=256)
        self.solve_stamp(prof, 12)

    @cute.jit
    def solve_levels_mma(self, ctid, sAkk, sY, prof):
        """`solve_blocked`'s doubling levels h = 16, 32 as tf32 tensor-core products (warp-level mma.sync m16n8k8,
        operands rounded to nearest with cvt.rna.tf32.f32, fp32 accumulation; prof stamps 11, 12).

        Each level's blocks [[X_00, 0], [X_10, X_11]] (size 2 h): Y = A_10 X_00, then X_10 = -(Y + X_11^strict Y)
        -- the unit diagonal of X_11 applied in fp32, only the strict part through the tensor cores (spec:
        `reference/blocked_solve.py: blocked_unit_lower_inverse(operand="tf32")`). A warp owns one 16 x 8 tile of
        X_10 in both products (h = 32: 8 tiles, every warp; h = 16: 2 tiles per block pair, warps 0-3). Y goes
        through sY in fp32 (rows padded to Y_STRIDE floats: the second product's B operand, and the exact Y of the
        sum). Operands come straight from the fp32 buffer: A_10 row-major, X_00 and X_11 from the
        transposed strict lower part (masked to the unit triangle in registers). X_10 is written transposed above
        the diagonal, as the CUDA-core levels do.
        """
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
            self.solve_stamp(prof, 11 + lvl)

    @cute.jit
    def mma_tf32(self, mma, thr, gA, gB, mt, nt, h: int, a_mask: int, b_mask: int):
        """A B^T (fp32 accumulator, returned) on one warp's 16 x 8 tile (mt, nt) with tf32 mma.sync: gA (M, K) and gB (N, K) fp32 views
        [h, h], read per element, masked, converted by cvt.rna.tf32.f32. a_mask 1: keep A's (i, s) with i > s
        (a strict lower triangle). b_mask 2: B's (c, s) is 1 where s == c and 0 where s < c (a unit lower
        triangle's transpose)."""
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
    def solve_stamp(self, prof, idx: int):
        """`solve_blocked`'s profile stamps (no-ops without `prof`): cycles since prof[7] -> prof[idx]."""
        if cutlass.const_expr(prof is not None):
            now = cute.arch.clock64()
            prof[idx] = prof[idx] + (now - prof[7])
            prof[7] = now

    @cute.jit
    def tile4(self, sA, row, col):
        """sA[row, col : col + 4] of the fp32 Akk / X buffer (col a multiple of 4: one 16-byte vector)."""
        return cute.local_tile(sA[row, None], (4,), (cute.assume(col, divby=4) // 4,))

    @cute.jit
    def load4(self, sA, row, col, dst):
        cute.autovec_copy(self.tile4(sA, row, col), dst)

    @cute.jit
    def store_acc(self, wtid, tiled_mma, acc, dst):
        wgmma_tiles.store_acc(self.io_dtype, wtid, tiled_mma, acc, dst)

    @cute.jit
    def store_rows(self, wtid, sO, mO, t0, head, v0, L):
        wgmma_tiles.store_rows(self.io_dtype, wtid, sO, mO, t0, head, v0, L)

    def make_mma(self, a_mn_major: bool, b_mn_major: bool, n: int = 64):
        return wgmma_tiles.make_mma(self.io_dtype, a_mn_major, b_mn_major, n)

    @cute.jit
    def gemm(self, wtid, acc, sA, sB, a_mn_major: bool, b_mn_major: bool, accumulate: bool, n: int = 64,
             wait: bool = True):
        wgmma_tiles.gemm(self.io_dtype, wtid, acc, sA, sB, a_mn_major, b_mn_major, accumulate, n, wait)
