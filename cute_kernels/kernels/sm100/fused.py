"""SM100 (Blackwell) fused chunked forward of the gated delta rule (GDN): `ChunkedForwardSm90`'s contract, modes and
work tiles, with tcgen05 MMAs into tensor memory and the state S in TMEM for the whole tile. Compiled and checked on
the CPU; not yet run on hardware. Float64 spec: `cute_kernels.reference.chunk_gated_delta_rule_ref`.

Every product has M = 128 rows, one TMEM lane per row, so thread t of a compute warpgroup owns lane t of every
accumulator. The chunk's 64-row products become 128-row ones two ways: the intra-chunk products stack k over q
([k; q] k^T gives k k^T in lanes 0-63 and q k^T in lanes 64-127), and the rest are computed transposed (lanes are
value or key channels, columns are tokens).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils as utils
import cutlass.utils.blackwell_helpers as sm100_utils
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import cpasync, tcgen05

from schedulers.device import TileScheduler

from ..chunk_math import AKK_STRIDE, SOLVE_Y_MMA, C, ChunkMath
from ..configs import FusedConfig
from ..views import flat, thd
from .budgets import check_smem, fused_tmem_plan
from .tmem_copy import column_copies

D = 128                    # key and value head dimension
HALF_D = 64                # one 128-byte swizzle atom of a 16-bit row
NUM_STAGES = 2             # q/k/v ring depth
COMPUTE_THREADS = 256      # two warpgroups (`ChunkMath` runs on 256 threads); both cover all 128 lanes
MMA_WARP, LOAD_WARP = 8, 9
THREADS = 32 * 10
COLS = 32                  # TMEM columns per tcgen05.ld / st
TMEM = fused_tmem_plan()   # S, A, KQS, VN, O: 448 columns of 512


class ChunkedForwardSm100:
    """Fused GDN forward on Blackwell: one CTA per work tile (sequence, head, chunk range), S in TMEM.

    Warp roles (320 threads, 1 CTA per SM):
    - warps 0-7, compute (two warpgroups, `ChunkMath`'s 256 threads; thread t owns TMEM lane t % 128, warpgroup j
      columns [32 j, 32 j + 32) of a 64-column region, [64 j, 64 j + 64) of S): the gates, Akk and Aqk from the
      intra products, the solve, U = v - 2^G (k S) (transposed, to smem), v_new^T out of TMEM (to smem, and decayed
      by 2^(G_L - G_r) for the update), S's decay 2^G_L in TMEM, o^T = O + scale 2^G (q S)^T to global, S to bf16
      smem for the next chunk's products (and the tile's start / final state).
    - warp 8, MMA (one elected lane issues, `tcgen05.mma` cta_group 1, M = 128): per chunk A = [k; q] k^T and
      KQS = S^T [k; q]^T; VN = U^T Xv^T; then O = VN^T Aqk^T and S += k^T (2^(G_L - G) v_new).
    - warp 9, load: TMA of k and q (two 64-column boxes each, into the stacked [k; q] tile) and v (one plain box).
    Pipelines: `load` (TMA -> MMA, NUM_STAGES stages, released by the MMA's commit after the state update; the
    compute warps wait on it too, to read v), and one-stage handoffs: `kqs` (MMA -> compute: A and KQS in TMEM;
    released once q S is read, at the chunk's end), `u_ready` (compute -> MMA: U and Xv written), `vn_full`
    (MMA -> compute: VN in TMEM), `vn_written` (compute -> MMA: v_new written, S decayed), `upd_full` (MMA ->
    compute: O and the new S in TMEM), `state_ready` (compute -> MMA: S in bf16 smem; released when the KQS MMA
    has read it). Named barrier 1: the compute threads (also `ChunkMath`'s); 2: TMEM allocation.
    TMEM (`TMEM`): 448 columns used, 512 allocated; shared memory ~200 KB.

    Per chunk (rows r < L; lanes d are value channels unless said):
      0. gates (`ChunkMath.gdn_gates`): G_r (log2), 2^G_r, 2^(G_L - G_r), beta_r.
      1. Akk[r, c] = beta_r 2^(G_r - G_c) k_r.k_c (c < r < L) -> fp32 smem; Aqk[r, c] = scale 2^(G_r - G_c)
         q_r.k_c (c <= r) -> bf16; U^T[d, c] = v[c, d] - 2^G_c (k S)[c, d] -> bf16 (summary block 1: v = 0).
      2. X = (I + Akk)^-1 (`ChunkMath.solve_blocked`) -> Xv = X diag(beta); MMA: v_new^T = U^T Xv^T.
      3. v_new^T -> bf16, and 2^(G_L - G_r) v_new^T; S *= 2^G_L in TMEM. MMA: O = v_new^T Aqk^T, S += k^T v_new~.
      4. o[r, d] = O[d, r] + scale 2^G_r (q S)[r, d] (rows < L); S -> bf16 smem (or, at the tile's end, out).
    Modes as `ChunkedForwardSm90` (`FusedConfig.mode`): forward, summary (block 0 h_ext from 0, block 1 M from I
    with zero v), segment_outputs.
    """

    def __init__(self, config: FusedConfig, io_dtype, beta_dtype):
        if config.kda:
            raise NotImplementedError("ChunkedForwardSm100 is the GDN forward; KDA has no SM100 build yet")
        self.config = config
        self.io_dtype = io_dtype
        self.beta_dtype = beta_dtype
        self.mode = config.mode
        self.outputs = config.mode != "summary"
        self.has_initial_state = config.initial_state
        self.store_final_state = config.final_state
        self.math = ChunkMath(io_dtype, False, solve_mma=True, gate=config.gate)
        self.tma_bytes = 3 * C * D * io_dtype.width // 8

    # ------------------------------------------------------------------ host side

    def _mma(self, n: int, a_mn_major: bool):
        """A 1-CTA tcgen05 MMA of 128 x n x 16, both operands from shared memory, B K-major."""
        major = lambda mn: tcgen05.OperandMajorMode.MN if mn else tcgen05.OperandMajorMode.K   # noqa: E731
        op = tcgen05.MmaF16BF16Op(self.io_dtype, Float32, (128, n, 16), tcgen05.CtaGroup.ONE,
                                  tcgen05.OperandSource.SMEM, major(a_mn_major), major(False))
        return cute.make_tiled_mma(op)

    def _mmas(self):
        """(intra: [k; q] k^T, kqs: S^T [k; q]^T, tok: 128 x 64 x 64 products over tokens (VN, O), update: k^T
        v_new~)."""
        return self._mma(C, False), self._mma(2 * C, True), self._mma(C, False), self._mma(D, True)

    @cute.jit
    def __call__(
        self,
        q: cute.Tensor,            # [B, T, H, 128] (flattened here; tiles carry token offsets)
        k: cute.Tensor,
        v: cute.Tensor,            # [B, T, HV, 128]
        g: cute.Tensor,            # [B, T, HV] fp32
        beta: cute.Tensor,         # [B, T, HV]
        a_log: cute.Tensor,        # [HV] fp32 (config.gate.a_log; else any fp32 tensor)
        dt_bias: cute.Tensor,      # [HV] fp32 (config.gate.dt_bias; else any fp32 tensor)
        lower_bound: Float32,
        o: cute.Tensor,            # [B, T, HV, 128]
        initial_state: cute.Tensor,  # [N, HV, 128, 128] fp32; segment_outputs: [slots, HV, 128, 128]
        final_state: cute.Tensor,    # [N, HV, 128, 128] fp32; summary: [2 * slots, HV, 128, 128]
        tiles: cute.Tensor,        # [num_tiles, NUM_TILE_FIELDS] int32
        num_tiles: Int32, grid_x: Int32, scale: Float32, stream,
    ):
        io = self.io_dtype
        q, k, v, g, beta, o = flat(q), flat(k), flat(v), flat(g), flat(beta), flat(o)
        # a 64 x 64 box of q or k (one swizzle atom wide) and a plain 64 x 128 box of v
        box_layout = self.swizzled(None, (C, HALF_D), (HALF_D, 1))
        op = cpasync.CopyBulkTensorTileG2SOp()
        tma_q, tma_q_t = cpasync.make_tiled_tma_atom(op, thd(q), box_layout, (C, HALF_D))
        tma_k, tma_k_t = cpasync.make_tiled_tma_atom(op, thd(k), box_layout, (C, HALF_D))
        tma_v, tma_v_t = cpasync.make_tiled_tma_atom(op, thd(v), cute.make_layout((C, D), stride=(D, 1)), (C, D))

        @cute.struct
        class SharedStorage:
            load_mbar: cute.struct.MemRange[cutlass.Int64, NUM_STAGES * 2]
            handoff_mbar: cute.struct.MemRange[cutlass.Int64, 12]   # six one-stage pipelines
            tmem_holding: Int32
            sKQ: cute.struct.Align[cute.struct.MemRange[io, 2 * C * D * NUM_STAGES], 1024]   # [k; q] per stage
            sV: cute.struct.Align[cute.struct.MemRange[io, C * D * NUM_STAGES], 1024]
            sS: cute.struct.Align[cute.struct.MemRange[io, D * D], 1024]          # S [dk, dv], bf16
            sU: cute.struct.Align[cute.struct.MemRange[io, D * C], 1024]          # U^T, then v_new^T [dv, token]
            sVnD: cute.struct.Align[cute.struct.MemRange[io, D * C], 1024]        # (2^(G_L - G) v_new)^T
            sXv: cute.struct.Align[cute.struct.MemRange[io, C * C], 1024]
            sAqk: cute.struct.Align[cute.struct.MemRange[io, C * C], 1024]
            sAkk: cute.struct.Align[cute.struct.MemRange[Float32, C * AKK_STRIDE], 16]   # A, then X^T above
            sY: cute.struct.Align[cute.struct.MemRange[Float32, SOLVE_Y_MMA], 16]
            sG: cute.struct.MemRange[Float32, C]
            sEG: cute.struct.MemRange[Float32, C]
            sEGL: cute.struct.MemRange[Float32, C]
            sBeta: cute.struct.MemRange[Float32, C]

        self.shared_storage = SharedStorage
        self.smem_bytes = SharedStorage.size_in_bytes()
        check_smem(self.smem_bytes, 1, "ChunkedForwardSm100")
        self.kernel(self._mmas(), tma_q, tma_q_t, tma_k, tma_k_t, tma_v, tma_v_t, g, beta, a_log, dt_bias,
                    lower_bound, o, initial_state, final_state, tiles, num_tiles, scale).launch(
            grid=[grid_x, 1, 1], block=[THREADS, 1, 1], stream=stream, min_blocks_per_mp=1)

    def swizzled(self, field, shape, stride, offset: int = 0):
        """A 128-byte-swizzled 16-bit tile of (shape, stride) in elements, `offset` elements into a struct field (or,
        field None, the composed layout). Every tile here is built from whole 8-row x 64-column swizzle atoms at
        1 KB-aligned offsets, so one swizzle serves any arrangement of the atoms (what the MMA descriptors and the
        TMA boxes read)."""
        swizzle = sm100_utils.make_smem_layout_a(self._mma(C, False), (128, C, HALF_D), self.io_dtype, 1).inner
        layout = cute.make_layout(shape, stride=stride)
        if field is None:
            return cute.make_composed_layout(swizzle, 0, layout)
        ptr = field.get_tensor(cute.make_layout(1)).iterator + offset
        return cute.make_tensor(cute.recast_ptr(ptr, swizzle, self.io_dtype), layout)

    # Stacked [k; q] stage tile: rows 0-63 k, 64-127 q, two 64-column halves 128 rows apart, so that every 8-row
    # group of all 128 rows is 1 KB from the next (one MMA descriptor over both) and each 64 x 64 box is one TMA.
    KQ_HALF = 2 * C * HALF_D       # elements between the column halves
    KQ_STAGE = 2 * C * D           # elements between stages

    def kq_rows(self, field, rows: int, first_row: int):
        """(row, channel, stage) view of `rows` rows of the stacked tile from `first_row` (k: 0, q: 64)."""
        return self.swizzled(field, (rows, (HALF_D, 2), NUM_STAGES), (HALF_D, (1, self.KQ_HALF), self.KQ_STAGE),
                             first_row * HALF_D)

    # ------------------------------------------------------------------ device side

    @cute.kernel
    def kernel(self, mmas, tma_q: cute.CopyAtom, mQ: cute.Tensor, tma_k: cute.CopyAtom, mK: cute.Tensor,
               tma_v: cute.CopyAtom, mV: cute.Tensor, mG: cute.Tensor, mBeta: cute.Tensor, mALog: cute.Tensor,
               mDtBias: cute.Tensor, lower_bound: Float32, mO: cute.Tensor, mS0: cute.Tensor, mSN: cute.Tensor,
               mTiles: cute.Tensor, num_tiles: Int32, scale: Float32):
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        smem = utils.SmemAllocator()
        st = smem.allocate(self.shared_storage)

        thread = lambda n: pipeline.CooperativeGroup(pipeline.Agent.Thread, n)   # noqa: E731
        load = pipeline.PipelineTmaUmma.create(barrier_storage=st.load_mbar.data_ptr(), num_stages=NUM_STAGES,
                                               producer_group=thread(1), consumer_group=thread(1),
                                               tx_count=self.tma_bytes, defer_sync=True)
        mbar = st.handoff_mbar.data_ptr()
        to_mma = lambda i: pipeline.PipelineAsyncUmma.create(   # noqa: E731
            barrier_storage=mbar + 2 * i, num_stages=1, producer_group=thread(COMPUTE_THREADS),
            consumer_group=thread(1), defer_sync=True)
        from_mma = lambda i: pipeline.PipelineUmmaAsync.create(   # noqa: E731
            barrier_storage=mbar + 2 * i, num_stages=1, producer_group=thread(1),
            consumer_group=thread(COMPUTE_THREADS), defer_sync=True)
        pipes = (from_mma(0), to_mma(1), from_mma(2), to_mma(3), from_mma(4), to_mma(5))
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        sched = TileScheduler.create(mTiles, num_tiles, self.config.persistent)
        if warp_idx == LOAD_WARP:
            cpasync.prefetch_descriptor(tma_q)
            cpasync.prefetch_descriptor(tma_k)
            cpasync.prefetch_descriptor(tma_v)
            self.producer(sched, load, tma_q, mQ, tma_k, mK, tma_v, mV, st)
        else:
            alloc_bar = pipeline.NamedBarrier(barrier_id=2, num_threads=COMPUTE_THREADS + 32)
            tmem = utils.TmemAllocator(st.tmem_holding, barrier_for_retrieve=alloc_bar, allocator_warp_id=MMA_WARP)
            tmem.allocate(TMEM.alloc)
            tmem.wait_for_alloc()
            base = tmem.retrieve_ptr(Float32)
            intra, kqs, tok, update = mmas
            acc = lambda mma, name, n: cute.make_tensor(   # noqa: E731
                base + TMEM.col(name), mma.make_fragment_C(mma.partition_shape_C((128, n))).layout)
            tmem_regions = (acc(intra, "a", C), acc(kqs, "kqs", 2 * C), acc(tok, "vn", C), acc(tok, "o", C),
                            acc(update, "s", D))
            if warp_idx == MMA_WARP:
                self.mma(sched, load, pipes, mmas, tmem_regions, st)
            else:
                self.compute(sched, load, pipes, tmem_regions, tidx, mG, mBeta, (mALog, mDtBias, lower_bound), mO,
                             mS0, mSN, scale, st)
            # every MMA and TMEM read done (the compute warps read the tile's last state) before the free
            tmem.relinquish_alloc_permit()
            alloc_bar.arrive_and_wait()
            if warp_idx == MMA_WARP:
                tmem.free(base)

    @cute.jit
    def producer(self, sched, load, tma_q, mQ, tma_k, mK, tma_v, mV, st):
        """The load warp: per chunk its k, q (two 64 x 64 boxes each, at the head the tile's value head reads:
        hv // group) and v tiles."""
        group = self.config.group
        sK = self.kq_rows(st.sKQ, C, 0)
        sQ = self.kq_rows(st.sKQ, C, C)
        sV = st.sV.get_tensor(cute.make_layout((C, D, NUM_STAGES), stride=(D, 1, C * D)))
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, NUM_STAGES)
        work = sched.initial_work()
        while work.is_valid:
            head = work.head
            for c in cutlass.range(work.chunk_end - work.chunk_start, unroll=1):
                t0 = work.tok_start + c * C
                load.producer_acquire(state)
                bar = load.producer_get_barrier(state)
                for tma, m, s in ((tma_k, mK, sK), (tma_q, mQ, sQ)):
                    for half in cutlass.range_constexpr(2):
                        g_tile = cute.local_tile(cute.domain_offset((t0, 0), m[None, None, head // group]),
                                                 (C, HALF_D), (0, half))
                        s_tile = s[None, (None, half), state.index]
                        s_part, g_part = cpasync.tma_partition(tma, 0, cute.make_layout(1),
                                                               cute.group_modes(s_tile, 0, 2),
                                                               cute.group_modes(g_tile, 0, 2))
                        cute.copy(tma, g_part, s_part, tma_bar_ptr=bar)
                g_tile = cute.local_tile(cute.domain_offset((t0, 0), mV[None, None, head]), (C, D), (0, 0))
                s_part, g_part = cpasync.tma_partition(tma_v, 0, cute.make_layout(1),
                                                       cute.group_modes(sV[None, None, state.index], 0, 2),
                                                       cute.group_modes(g_tile, 0, 2))
                cute.copy(tma_v, g_part, s_part, tma_bar_ptr=bar)
                state.advance()
            work = sched.advance(work)
        load.producer_tail(state)

    @cute.jit
    def operands(self, st):
        """The MMA operand views, as (M or N, K, ...) smem tensors: the stacked [k; q] tile (K-major, 128 rows),
        k alone as a B (K-major) and as k^T (MN-major A: key channels by tokens), S [dk, dv] as S^T (MN-major A),
        U^T / v_new^T and (2^(G_L - G) v_new)^T (K-major, [dv, token]), Xv and Aqk (K-major B, [row, token])."""
        kq = self.kq_rows(st.sKQ, 2 * C, 0)
        k_only = self.kq_rows(st.sKQ, C, 0)
        kT = self.swizzled(st.sKQ, ((HALF_D, 2), C, NUM_STAGES), ((1, self.KQ_HALF), HALF_D, self.KQ_STAGE))
        sT = self.swizzled(st.sS, ((HALF_D, 2), D), ((1, D * HALF_D), HALF_D))
        tok_tile = lambda f, rows: self.swizzled(f, (rows, C), (HALF_D, 1))   # noqa: E731
        return kq, k_only, kT, sT, tok_tile(st.sU, D), tok_tile(st.sVnD, D), tok_tile(st.sXv, C), tok_tile(
            st.sAqk, C)

    @cute.jit
    def mma(self, sched, load, pipes, mmas, tmem_regions, st):
        """The MMA warp: per chunk the intra and KQS products, then VN, then O and the state update."""
        kqs_pipe, u_ready, vn_full, vn_written, upd_full, state_ready = pipes
        intra, kqs, tok, update = mmas
        tA, tKQS, tVN, tO, tS = tmem_regions
        kq, k_only, kT, sT, sU, sVnD, sXv, sAqk = self.operands(st)
        frag = lambda mma, s, a: (mma.make_fragment_A if a else mma.make_fragment_B)(   # noqa: E731
            (mma.get_slice(0).partition_A if a else mma.get_slice(0).partition_B)(s))
        rKQ_a, rK_b = frag(intra, kq, True), frag(intra, k_only, False)
        rS_a, rKQ_b = frag(kqs, sT, True), frag(kqs, kq, False)
        rU_a, rXv_b, rAqk_b = frag(tok, sU, True), frag(tok, sXv, False), frag(tok, sAqk, False)
        rKT_a, rVnD_b = frag(update, kT, True), frag(update, sVnD, False)

        l_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, NUM_STAGES)
        producer = lambda: pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)   # noqa: E731
        consumer = lambda: pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)   # noqa: E731
        kqs_s, u_s, vn_s, vw_s, upd_s, sr_s = producer(), consumer(), producer(), consumer(), producer(), consumer()
        work = sched.initial_work()
        while work.is_valid:
            for c in cutlass.range(work.chunk_end - work.chunk_start, unroll=1):
                stage = l_state.index
                load.consumer_wait(l_state)
                kqs_pipe.producer_acquire(kqs_s)     # the previous chunk's A and KQS read
                state_ready.consumer_wait(sr_s)      # S (bf16) holds this chunk's start state
                self.gemm(intra, tA, rKQ_a[None, None, None, stage], rK_b[None, None, None, stage], False)
                self.gemm(kqs, tKQS, rS_a, rKQ_b[None, None, None, stage], False)
                kqs_pipe.producer_commit(kqs_s)
                kqs_s.advance()
                state_ready.consumer_release(sr_s)   # sS free once the KQS product has read it
                sr_s.advance()

                u_ready.consumer_wait(u_s)
                vn_full.producer_acquire(vn_s)
                self.gemm(tok, tVN, rU_a, rXv_b, False)
                vn_full.producer_commit(vn_s)
                vn_s.advance()
                u_ready.consumer_release(u_s)
                u_s.advance()

                vn_written.consumer_wait(vw_s)
                upd_full.producer_acquire(upd_s)
                self.gemm(tok, tO, rU_a, rAqk_b, False)                                # sU holds v_new^T now
                self.gemm(update, tS, rKT_a[None, None, None, stage], rVnD_b, True)
                load.consumer_release(l_state)       # the stage's last reader was the update
                l_state.advance()
                upd_full.producer_commit(upd_s)
                upd_s.advance()
                vn_written.consumer_release(vw_s)
                vw_s.advance()
            work = sched.advance(work)

    @cute.jit
    def gemm(self, mma, acc, rA, rB, accumulate: bool):
        """acc (+)= A B^T over every 16-wide K block (fragments (mode, 1, k_blocks))."""
        for kb in cutlass.range_constexpr(cute.size(rA, mode=[2])):
            mma.set(tcgen05.Field.ACCUMULATE, accumulate or kb != 0)
            cute.gemm(mma, acc, rA[None, None, kb], rB[None, None, kb], acc)

    @cute.jit
    def put(self, src, dst):
        """32 fp32 values -> 16-bit `dst` (a 32-element smem row segment) in 16-byte vectors (a swizzle moves whole
        16-byte chunks, so each run of 8 stays contiguous)."""
        half = cute.make_rmem_tensor((COLS,), self.io_dtype)
        half.store(src.load().to(self.io_dtype))
        for v in cutlass.range_constexpr(COLS // 8):
            cute.autovec_copy(cute.local_tile(half, (8,), (v,)), cute.local_tile(dst, (8,), (v,)))

    @cute.jit
    def compute(self, sched, load, pipes, tmem_regions, tidx, mG, mBeta, gate_args, mO, mS0, mSN, scale, st):
        """Warps 0-7: the gates, the elementwise work between the products, the solve, o and the state."""
        kqs_pipe, u_ready, vn_full, vn_written, upd_full, state_ready = pipes
        tA, tKQS, tVN, tO, tS = tmem_regions
        math = self.math
        io = self.io_dtype
        lane = tidx % 128          # the TMEM lane (accumulator row) this thread owns
        j = tidx // 128            # this warpgroup's column block
        _, _, _, sT, sU, sVnD, sXv, sAqk = self.operands(st)
        sV = st.sV.get_tensor(cute.make_layout((C, D, NUM_STAGES), stride=(D, 1, C * D)))
        sAkk = st.sAkk.get_tensor(cute.make_layout((C, C), stride=(AKK_STRIDE, 1)))
        sY = st.sY.get_tensor(cute.make_layout(SOLVE_Y_MMA))
        sG = st.sG.get_tensor(cute.make_layout(C))
        sEG = st.sEG.get_tensor(cute.make_layout(C))
        sEGL = st.sEGL.get_tensor(cute.make_layout(C))
        sBeta = st.sBeta.get_tensor(cute.make_layout(C))

        # tcgen05.ld / st of 32 columns: this thread's lane, columns [32 b, 32 b + 32) of a region
        cols = lambda t: cute.flat_divide(t[(None, None), 0, 0], (128, COLS))   # noqa: E731   (128, 32, 1, n / 32)
        rA, rKQS, rVN, rO, rS = cols(tA), cols(tKQS), cols(tVN), cols(tO), cols(tS)
        ld, st_op, thr_ld, thr_st = column_copies(rS[None, None, 0, 0], lane)
        vals = cute.make_rmem_tensor(thr_ld.partition_D(rS[None, None, 0, 0]).shape, Float32)
        vals2 = cute.make_rmem_tensor(thr_ld.partition_D(rS[None, None, 0, 0]).shape, Float32)
        load_cols = lambda region, b, dst: cute.copy(ld, thr_ld.partition_S(region[None, None, 0, b]), dst)  # noqa
        store_cols = lambda src, region, b: cute.copy(st_op, src, thr_st.partition_D(region[None, None, 0, b]))  # noqa

        # row `lane` of S, columns [64 j + 32 b, + 32), in the bf16 S^T operand (contiguous along dv)
        s_row = lambda j, b: cute.local_tile(sT[(None, j), lane], (COLS,), (b,))   # noqa: E731
        l_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, NUM_STAGES)
        producer = lambda: pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)   # noqa: E731
        consumer = lambda: pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)   # noqa: E731
        kqs_s, u_s, vn_s, vw_s, upd_s, sr_s = consumer(), producer(), consumer(), producer(), consumer(), producer()
        bar = lambda: cute.arch.barrier(barrier_id=1, number_of_threads=COMPUTE_THREADS)   # noqa: E731
        to_smem = lambda: cute.arch.fence_proxy("async.shared", space="cta")   # noqa: E731  (generic -> MMA reads)

        work = sched.initial_work()
        while work.is_valid:
            seq, head, tok0, tok_end = work.seq, work.head, work.tok_start, work.tok_end
            blk, slot = work.block, work.seg_slot
            n_chunks = work.chunk_end - work.chunk_start

            # S <- its start value: row `lane`, columns [64 j, 64 j + 64), into TMEM and (bf16) sS
            if n_chunks > 0:
                state_ready.producer_acquire(sr_s)
            for b in cutlass.range_constexpr(2):
                col0 = 64 * j + COLS * b
                for e in cutlass.range_constexpr(COLS):
                    x = Float32(0.0)
                    if cutlass.const_expr(self.mode == "summary"):
                        if blk == 1 and lane == col0 + e:
                            x = Float32(1.0)
                    elif cutlass.const_expr(self.mode == "segment_outputs"):
                        x = Float32(mS0[slot, head, lane, col0 + e])
                    elif cutlass.const_expr(self.has_initial_state):
                        x = Float32(mS0[seq, head, lane, col0 + e])
                    vals[e] = x
                self.put(vals, s_row(j, b))
                store_cols(vals, rS, 2 * j + b)
            cute.arch.fence_view_async_tmem_store()
            to_smem()
            if n_chunks > 0:
                state_ready.producer_commit(sr_s)
                sr_s.advance()

            mALog, mDtBias, lower_bound = gate_args
            gp = math.gate_params(mALog, mDtBias, head, tidx)
            gv, gw, bv = math.gate_rows(tidx, tok0, tok_end, head, mG, mBeta, gp, lower_bound)
            for c in cutlass.range(n_chunks, unroll=1):
                t0 = tok0 + c * C
                L = math.rows_in(tok_end - t0)
                math.gdn_gates(tidx, L, gv, gw, bv, sG, sEG, sEGL, sBeta)
                gv, gw, bv = math.gate_rows(tidx, t0 + C, tok_end, head, mG, mBeta, gp, lower_bound)
                bar()                                       # the gates visible to every compute thread
                load.consumer_wait(l_state)                 # v in smem (the MMA warp releases the stage)
                kqs_pipe.consumer_wait(kqs_s)

                # -- 1. Akk (lanes 0-63) or Aqk (lanes 64-127) from A; U^T from K S
                load_cols(rA, j, vals)
                load_cols(rKQS, j, vals2)
                cute.arch.fence_view_async_tmem_load()
                u_ready.producer_acquire(u_s)
                r = lane % C
                g_r = sG[r]
                is_kk = lane < C
                row_factor = cutlass.select_(is_kk, sBeta[r], scale)
                for e in cutlass.range_constexpr(COLS):
                    col = COLS * j + e
                    keep = cutlass.select_(is_kk, col < r and r < L, col <= r)
                    # 2^(G_r - G_c) may overflow above the diagonal: selected away
                    gated = vals[e] * cute.math.exp2(g_r - sG[col], fastmath=True) * row_factor
                    vals[e] = cutlass.select_(keep, gated, Float32(0.0))
                    vc = Float32(0.0)
                    if cutlass.const_expr(self.mode != "summary"):
                        vc = Float32(sV[col, lane, l_state.index])
                    else:
                        if blk == 0:
                            vc = Float32(sV[col, lane, l_state.index])
                    vals2[e] = vc - sEG[col] * vals2[e]
                if is_kk:
                    cute.autovec_copy(vals, cute.local_tile(sAkk[r, None], (COLS,), (j,)))
                else:
                    self.put(vals, cute.local_tile(sAqk[r, None], (COLS,), (j,)))
                self.put(vals2, cute.local_tile(sU[lane, None], (COLS,), (j,)))
                bar()                                       # Akk whole before the solve
                math.solve_blocked(tidx, sAkk, sY, sXv, None, sBeta, sEG)
                to_smem()
                u_ready.producer_commit(u_s)
                u_s.advance()

                # -- 3. v_new^T to smem (plain and decayed); S *= 2^G_L in TMEM
                vn_full.consumer_wait(vn_s)
                vn_written.producer_acquire(vw_s)
                load_cols(rVN, j, vals)
                cute.arch.fence_view_async_tmem_load()
                self.put(vals, cute.local_tile(sU[lane, None], (COLS,), (j,)))
                for e in cutlass.range_constexpr(COLS):
                    vals[e] = vals[e] * sEGL[COLS * j + e]
                self.put(vals, cute.local_tile(sVnD[lane, None], (COLS,), (j,)))
                decay_last = sEG[L - 1]
                for b in cutlass.range_constexpr(2):
                    load_cols(rS, 2 * j + b, vals)
                    cute.arch.fence_view_async_tmem_load()
                    for e in cutlass.range_constexpr(COLS):
                        vals[e] = vals[e] * decay_last
                    store_cols(vals, rS, 2 * j + b)
                cute.arch.fence_view_async_tmem_store()
                to_smem()
                vn_full.consumer_release(vn_s)
                vn_s.advance()
                vn_written.producer_commit(vw_s)
                vw_s.advance()

                # -- 4. o = O^T + scale 2^G (q S); the new S to bf16 smem for the next chunk
                upd_full.consumer_wait(upd_s)
                if cutlass.const_expr(self.outputs):
                    load_cols(rO, j, vals)
                    load_cols(rKQS, 2 + j, vals2)
                    cute.arch.fence_view_async_tmem_load()
                    for e in cutlass.range_constexpr(COLS):
                        row = COLS * j + e
                        if row < L:
                            mO[t0 + row, head, lane] = io(vals[e] + vals2[e] * (sEG[row] * scale))
                l_state.advance()
                if c + 1 < n_chunks:
                    state_ready.producer_acquire(sr_s)
                    for b in cutlass.range_constexpr(2):
                        load_cols(rS, 2 * j + b, vals)
                        cute.arch.fence_view_async_tmem_load()
                        self.put(vals, s_row(j, b))
                    to_smem()
                    state_ready.producer_commit(sr_s)
                    sr_s.advance()
                kqs_pipe.consumer_release(kqs_s)
                kqs_s.advance()
                upd_full.consumer_release(upd_s)
                upd_s.advance()
                bar()                                       # the gates and Aqk free for the next chunk's writers

            # the tile's end state: summary[block * slots + seg_slot] (h_ext, M), or the sequence's final state
            for b in cutlass.range_constexpr(2):
                load_cols(rS, 2 * j + b, vals)
                cute.arch.fence_view_async_tmem_load()
                col0 = 64 * j + COLS * b
                if cutlass.const_expr(self.mode == "summary"):
                    nslots = mSN.shape[0] // 2
                    for e in cutlass.range_constexpr(COLS):
                        mSN[blk * nslots + slot, head, lane, col0 + e] = vals[e]
                elif cutlass.const_expr(self.store_final_state):
                    if work.is_last_segment:
                        for e in cutlass.range_constexpr(COLS):
                            mSN[seq, head, lane, col0 + e] = vals[e]
            work = sched.advance(work)
