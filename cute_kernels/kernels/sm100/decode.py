"""SM100 (Blackwell) split-KV decode attention: `SplitKVDecodeSm90`'s contract and work tiles (`schedulers.splitkv`,
`kernels.decode_fixup`), with tcgen05 MMAs into tensor memory. Compiled and checked on the CPU; not yet run on
hardware. Spec: `reference.softmax_attention.decode_attention_ref`.
"""

from __future__ import annotations

import math
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils as utils
import cutlass.utils.blackwell_helpers as sm100_utils
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import cpasync, tcgen05

from ..configs import DecodeConfig
from ..decode_fixup import box_row, is_last_split, masked_score, merge_unit, split_range, tile_scheduler, unit_rows
from ..views import dth, flat, thd
from .budgets import check_smem, tmem_plan
from .tmem_copy import column_copies

CHUNK = 64        # the plan's token unit: a work tile covers chunks [chunk_start, chunk_end)
C = 32            # KV tokens per block: one ring stage (half the SM90 kernel's, twice the stages: Q, P and the ring
                  # of two CTAs per SM fit the SM's shared memory)
BOX = 16          # tokens per TMA box: pages are multiples of 16 tokens, so a box never straddles two
M = 128           # MMA rows: one TMEM lane per row; rows past group x q_len (at most DECODE_ROWS) are zero
O_CHUNK = 32      # TMEM columns of O per tcgen05.ld / st when rescaling and storing
SOFTMAX_WARPS = 4
MMA_WARP, LOAD_WARP = 4, 5
THREADS = 32 * 6
CTAS_PER_SM = 2
LOG2E = math.log2(math.e)
LN2 = math.log(2.0)


class SplitKVDecodeSm100:
    """Decode attention on Blackwell, one split of one unit per work tile (`DecodeConfig`, as the SM90 kernel).

    Warp roles (192 threads, 2 CTAs per SM). Before they split, with `longest_first`, all threads rank the batch
    rows by their true lengths to find the row of the CTA's tile (`decode_fixup.ranked_row`).
    - warps 0-3, softmax and epilogue (thread t owns row t: TMEM lane t): the unit's query rows into shared memory
      (row r = i * group + g; rows past group x q_len zero); per block: S from TMEM (tcgen05.ld), the masks, softcap,
      the online softmax (log2 units, the row wholly in the thread: no shuffles), P as bf16 / fp16 into shared
      memory (in the block holding the cache's last token, V's rows past it zeroed too: their P is 0, but a stale
      or never-written row may hold NaN), and O rescaled in TMEM (tcgen05.ld / st, 32 columns at a time) once the
      previous P V has finished. At the tile's end O from TMEM, normalized, to the output or the split's slot;
      the last split merges (`decode_fixup`).
    - warp 4, MMA (one elected lane issues): per block S = Q K^T (a 128 x 16 x D tcgen05 MMA per 16-token box, into
      TMEM), then O (+)= P V (a 128 x D x 16 MMA per box).
    - warp 5, load: per block (C = 32 tokens) K and V as 16-token TMA boxes (K-major K, MN-major V) into the next stage;
      a box's cache row as in the SM90 kernel (paged through the page table; boxes past the length re-read the
      last one, masked).
    Pipelines: `load` (TMA -> MMA, 2 x config.stages stages of K and V, released by the MMA's commit after P V),
    `q_full` (softmax -> MMA, 1 stage: the tile's Q written; released when the tile's S MMAs finish),
    `s_full` (MMA -> softmax, 1 stage: S in TMEM; released once read), `p_full` (softmax -> MMA, 1 stage: P written
    and O rescaled; released when that P V finishes), `o_full` (MMA -> softmax, 1 stage: the tile's O complete;
    released once read); every tile passes q_full and o_full, one with no block too. Named barriers: 1 the softmax
    warps (128), 2 TMEM allocation (softmax + MMA warps).
    TMEM (`budgets.tmem_plan`): S 32 columns, O head_dim columns, 256 allocated; shared memory 105 KB a CTA.
    """

    def __init__(self, config: DecodeConfig, io_dtype):
        self.config = config
        self.io_dtype = io_dtype
        self.group = config.group
        self.rows = config.group * config.q_len
        self.head_dim = config.head_dim
        self.num_stages = 2 * config.stages   # C-token stages: the SM90 kernel's bytes in flight
        self.tmem = tmem_plan({"s": C, "o": config.head_dim}, CTAS_PER_SM)   # S 32 + O 128 -> 256 allocated
        self.tma_bytes = 2 * C * config.head_dim * io_dtype.width // 8

    def _mma(self, n: int, b_mn_major: bool):
        """A 1-CTA tcgen05 MMA of M x n x 16 with both operands from shared memory, A K-major."""
        major = lambda mn: tcgen05.OperandMajorMode.MN if mn else tcgen05.OperandMajorMode.K   # noqa: E731
        op = tcgen05.MmaF16BF16Op(self.io_dtype, Float32, (M, n, 16), tcgen05.CtaGroup.ONE,
                                  tcgen05.OperandSource.SMEM, major(False), major(b_mn_major))
        return cute.make_tiled_mma(op)

    @cute.jit
    def __call__(
        self,
        q: cute.Tensor,              # [B, Sq, Hq, D]
        k_cache: cute.Tensor,        # [B, Tmax, Hkv, D] or paged [pages, page_size, Hkv, D]
        v_cache: cute.Tensor,
        cache_seqlens: cute.Tensor,  # [B] int32
        page_table: cute.Tensor,     # [B, max_pages] int32 (paged; else any int32 [1, 1])
        o: cute.Tensor,              # [B, Sq, Hq, D]
        lse: cute.Tensor,            # [B, Sq, Hq] fp32
        o_part: cute.Tensor,         # [slots, 64, D] io dtype (normalized)
        lse_part: cute.Tensor,       # [slots, 64] fp32
        counters: cute.Tensor,       # [units] int32, 0 between calls
        tiles: cute.Tensor,          # [num_tiles, NUM_TILE_FIELDS] int32
        num_tiles: Int32, splits: Int32, unit_blocks: Int32, grid_x: Int32, scale: Float32, softcap: Float32,
        stream,
    ):
        io, D, ns = self.io_dtype, self.head_dim, self.num_stages
        mma_s = self._mma(BOX, False)     # S box = Q K_box^T: N = 16 tokens, K = D
        mma_pv = self._mma(D, True)       # O += P_box V_box: N = D, K = 16 tokens (V MN-major)
        s_tiler, pv_tiler = (M, BOX, D), (M, D, BOX)
        q_layout = sm100_utils.make_smem_layout_a(mma_s, s_tiler, io, 1)
        k_layout = sm100_utils.make_smem_layout_b(mma_s, s_tiler, io, ns * (C // BOX))
        v_layout = sm100_utils.make_smem_layout_b(mma_pv, pv_tiler, io, ns * (C // BOX))
        p_layout = sm100_utils.make_smem_layout_a(mma_pv, (M, D, C), io, 1)

        op = cpasync.CopyBulkTensorTileG2SOp()
        # K rows as (row, D, Hkv) (N, K, L); V as (D, row, Hkv) (N = D contiguous, K = row); row = page x page_size
        # + slot over the flattened first two modes
        tma_k, tma_k_t = cute.nvgpu.make_tiled_tma_atom_B(op, thd(flat(k_cache)),
                                                          cute.slice_(k_layout, (None, None, None, 0)), s_tiler, mma_s)
        tma_v, tma_v_t = cute.nvgpu.make_tiled_tma_atom_B(op, dth(flat(v_cache)),
                                                          cute.slice_(v_layout, (None, None, None, 0)), pv_tiler,
                                                          mma_pv)

        @cute.struct
        class SharedStorage:
            load_mbar: cute.struct.MemRange[cutlass.Int64, ns * 2]
            q_mbar: cute.struct.MemRange[cutlass.Int64, 2]
            s_mbar: cute.struct.MemRange[cutlass.Int64, 2]
            p_mbar: cute.struct.MemRange[cutlass.Int64, 2]
            o_mbar: cute.struct.MemRange[cutlass.Int64, 2]
            tmem_holding: Int32
            sFlag: cute.struct.MemRange[Int32, 4]

        self.shared_storage = SharedStorage
        # barriers (under 1 KB, then 1 KB alignment) and the four tiles
        self.smem_bytes = 1024 + sum(cute.size_in_bytes(io, lay) for lay in (q_layout, k_layout, v_layout, p_layout))
        check_smem(self.smem_bytes, CTAS_PER_SM, "SplitKVDecodeSm100")
        self.kernel(mma_s, mma_pv, q_layout, k_layout, v_layout, p_layout, tma_k, tma_k_t, tma_v, tma_v_t, q,
                    cache_seqlens, page_table, k_cache.shape[1], unit_rows(o, self.group), unit_rows(lse, self.group),
                    o_part, lse_part, counters, tiles, num_tiles, splits, unit_blocks, scale, softcap).launch(
            grid=[grid_x, 1, 1], block=[THREADS, 1, 1], stream=stream, min_blocks_per_mp=CTAS_PER_SM,
            preferred_smem_carveout=100, use_pdl=True)   # a fixed carveout: no device query when compiling

    @cute.kernel
    def kernel(self, mma_s: cute.TiledMma, mma_pv: cute.TiledMma, q_layout: cute.ComposedLayout,
               k_layout: cute.ComposedLayout, v_layout: cute.ComposedLayout, p_layout: cute.ComposedLayout,
               tma_k: cute.CopyAtom, mK: cute.Tensor, tma_v: cute.CopyAtom, mV: cute.Tensor, mQ: cute.Tensor,
               mLens: cute.Tensor, mPages: cute.Tensor, page_size: Int32, mO: cute.Tensor, mLse: cute.Tensor,
               mOp: cute.Tensor, mLp: cute.Tensor, mCount: cute.Tensor, mTiles: cute.Tensor, num_tiles: Int32,
               splits: Int32, unit_blocks: Int32, scale: Float32, softcap: Float32):
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        io, ns = self.io_dtype, self.num_stages
        smem = utils.SmemAllocator()
        st = smem.allocate(self.shared_storage)
        tiles = []
        for layout in (q_layout, k_layout, v_layout, p_layout):
            tiles.append(smem.allocate_tensor(element_type=io, layout=layout.outer, byte_alignment=1024,
                                              swizzle=layout.inner))
        sQ, sK, sV, sP = tiles

        thread = lambda n: pipeline.CooperativeGroup(pipeline.Agent.Thread, n)   # noqa: E731
        softmax_threads = 32 * SOFTMAX_WARPS
        load = pipeline.PipelineTmaUmma.create(barrier_storage=st.load_mbar.data_ptr(), num_stages=ns,
                                               producer_group=thread(1), consumer_group=thread(1),
                                               tx_count=self.tma_bytes, defer_sync=True)
        # one-stage handoffs: softmax warps -> MMA warp (PipelineAsyncUmma) and back (PipelineUmmaAsync)
        to_mma = lambda mbar: pipeline.PipelineAsyncUmma.create(   # noqa: E731
            barrier_storage=mbar.data_ptr(), num_stages=1, producer_group=thread(softmax_threads),
            consumer_group=thread(1), defer_sync=True)
        from_mma = lambda mbar: pipeline.PipelineUmmaAsync.create(   # noqa: E731
            barrier_storage=mbar.data_ptr(), num_stages=1, producer_group=thread(1),
            consumer_group=thread(softmax_threads), defer_sync=True)
        q_full, s_full, p_full, o_full = to_mma(st.q_mbar), from_mma(st.s_mbar), to_mma(st.p_mbar), from_mma(st.o_mbar)
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        num_kv_heads = mQ.shape[2] // self.group
        sFlag = st.sFlag.get_tensor(cute.make_layout(4))
        if warp_idx == LOAD_WARP:
            cpasync.prefetch_descriptor(tma_k)
            cpasync.prefetch_descriptor(tma_v)
        # launched early (PDL): the setup above overlaps the previous kernel's tail; every thread waits for that
        # kernel before touching global memory, and the next launch may start its own setup
        cute.arch.griddepcontrol_wait()
        cute.arch.griddepcontrol_launch_dependents()
        sched = tile_scheduler(self.config, tidx, THREADS, mTiles, num_tiles, splits, unit_blocks, mLens,
                               num_kv_heads, sFlag)
        if warp_idx == LOAD_WARP:
            self.producer(sched, load, mma_s, mma_pv, tma_k, mK, tma_v, mV, sK, sV, mLens, mPages, page_size,
                          num_kv_heads)
        else:
            tmem = utils.TmemAllocator(st.tmem_holding, barrier_for_retrieve=pipeline.NamedBarrier(
                barrier_id=2, num_threads=softmax_threads + 32), allocator_warp_id=MMA_WARP)
            tmem.allocate(self.tmem.alloc)
            tmem.wait_for_alloc()
            base = tmem.retrieve_ptr(Float32)
            tS = [cute.make_tensor(base + (self.tmem.col("s") + k * BOX),
                                   mma_s.make_fragment_C(mma_s.partition_shape_C((M, BOX))).layout)
                  for k in range(C // BOX)]
            tO = cute.make_tensor(base + self.tmem.col("o"),
                                  mma_pv.make_fragment_C(mma_pv.partition_shape_C((M, self.head_dim))).layout)
            if warp_idx == MMA_WARP:
                self.mma(sched, load, q_full, s_full, p_full, o_full, mma_s, mma_pv, sQ, sK, sV, sP, tS, tO, mLens,
                         num_kv_heads)
            else:
                self.softmax(sched, q_full, s_full, p_full, o_full, tidx, sQ, sV, sP, tS, tO, sFlag, mQ, mLens, mO,
                             mLse, mOp, mLp, mCount, num_kv_heads, scale, softcap)
            # every TMEM read and MMA done (the softmax warps waited on the tile's last o_full) before the free
            tmem.relinquish_alloc_permit()
            pipeline.NamedBarrier(barrier_id=2, num_threads=softmax_threads + 32).arrive_and_wait()
            if warp_idx == MMA_WARP:
                tmem.free(base)

    @cute.jit
    def producer(self, sched, load, mma_s, mma_pv, tma_k, mK, tma_v, mV, sK, sV, mLens, mPages, page_size,
                 num_kv_heads):
        """The load warp: every block of every (non-padding) tile, K and V box by box."""
        D = self.head_dim
        thr_s = mma_s.get_slice(0)
        thr_pv = mma_pv.get_slice(0)
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.num_stages)
        work = sched.initial_work()
        while work.is_valid:
            if work.seg_slot >= 0:
                b, kv_head, kv0, kv_end, blocks, length = split_range(work, num_kv_heads, mLens, CHUNK, C)
                for j in cutlass.range(blocks, unroll=1):
                    load.producer_acquire(state)
                    bar = load.producer_get_barrier(state)
                    for k in cutlass.range_constexpr(C // BOX):
                        row = box_row(kv0 + j * C + k * BOX, b, length, mPages, page_size, self.config.paged, BOX)
                        stage_box = state.index * (C // BOX) + k
                        gK = cute.local_tile(cute.domain_offset((row, 0), mK[None, None, kv_head]), (BOX, D), (0, 0))
                        sk_part, gk_part = cpasync.tma_partition(tma_k, 0, cute.make_layout(1),
                                                                 cute.group_modes(sK, 0, 3),
                                                                 cute.group_modes(thr_s.partition_B(gK), 0, 3))
                        cute.copy(tma_k, gk_part, sk_part[(None, stage_box)], tma_bar_ptr=bar)
                        gV = cute.local_tile(cute.domain_offset((0, row), mV[None, None, kv_head]), (D, BOX), (0, 0))
                        sv_part, gv_part = cpasync.tma_partition(tma_v, 0, cute.make_layout(1),
                                                                 cute.group_modes(sV, 0, 3),
                                                                 cute.group_modes(thr_pv.partition_B(gV), 0, 3))
                        cute.copy(tma_v, gv_part, sv_part[(None, stage_box)], tma_bar_ptr=bar)
                    state.advance()
            work = sched.advance(work)
        load.producer_tail(state)

    @cute.jit
    def mma(self, sched, load, q_full, s_full, p_full, o_full, mma_s, mma_pv, sQ, sK, sV, sP, tS, tO, mLens,
            num_kv_heads):
        """The MMA warp: per block S into TMEM, then (once P is written) O (+)= P V; commits release the stages."""
        l_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.num_stages)
        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
        s_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
        p_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
        o_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
        rQ = mma_s.make_fragment_A(sQ)
        rK = mma_s.make_fragment_B(sK)
        rV = mma_pv.make_fragment_B(sV)
        rP = mma_pv.make_fragment_A(sP)
        work = sched.initial_work()
        while work.is_valid:
            if work.seg_slot >= 0:
                _, _, _, _, blocks, _ = split_range(work, num_kv_heads, mLens, CHUNK, C)
                q_full.consumer_wait(q_state)
                o_full.producer_acquire(o_state)   # the previous tile's O read out of TMEM
                for j in cutlass.range(blocks, unroll=1):
                    load.consumer_wait(l_state)
                    s_full.producer_acquire(s_state)   # the previous block's S read out of TMEM
                    for k in cutlass.range_constexpr(C // BOX):
                        box = l_state.index * (C // BOX) + k
                        for kb in cutlass.range_constexpr(cute.size(rQ, mode=[2])):
                            mma_s.set(tcgen05.Field.ACCUMULATE, kb != 0)
                            cute.gemm(mma_s, tS[k], rQ[None, None, kb, 0], rK[None, None, kb, box], tS[k])
                    s_full.producer_commit(s_state)
                    s_state.advance()
                    p_full.consumer_wait(p_state)
                    for k in cutlass.range_constexpr(C // BOX):
                        mma_pv.set(tcgen05.Field.ACCUMULATE, j != 0 or k != 0)
                        cute.gemm(mma_pv, tO, rP[None, None, k, 0], rV[None, None, 0, l_state.index * (C // BOX) + k],
                                  tO)
                    p_full.consumer_release(p_state)   # P and O free once this P V is done
                    p_state.advance()
                    load.consumer_release(l_state)
                    l_state.advance()
                # every tile commits both, MMAs or not: the softmax warps wait on them unconditionally
                q_full.consumer_release(q_state)   # sQ free once the tile's S MMAs are done
                q_state.advance()
                o_full.producer_commit(o_state)
                o_state.advance()
            work = sched.advance(work)

    @cute.jit
    def load_q(self, tidx, mQ, b, kv_head, sQ):
        """Row tidx of the unit's queries into sQ (zero past group x q_len): 16-byte global loads, element stores
        into the swizzled K-major tile."""
        D = self.head_dim
        r = tidx
        vec = cute.make_rmem_tensor((8,), self.io_dtype)
        i = r // self.group
        head = kv_head * self.group + r - i * self.group
        for d8 in cutlass.range_constexpr(D // 8):
            vec.fill(0.0)
            if r < self.rows:
                cute.autovec_copy(cute.local_tile(mQ[b, i, head, None], (8,), (d8,)), vec)
            for e in cutlass.range_constexpr(8):
                d = d8 * 8 + e
                sQ[(r, d % 16), 0, d // 16, 0] = vec[e]

    @cute.jit
    def softmax(self, sched, q_full, s_full, p_full, o_full, tidx, sQ, sV, sP, tS, tO, sFlag, mQ, mLens, mO, mLse, mOp,
                mLp, mCount, num_kv_heads, scale, softcap):
        """Warps 0-3: the tile's queries, every block's online softmax and O correction, and the epilogue."""
        D = self.head_dim
        ld_s = tcgen05.make_tmem_copy(cute.make_copy_atom(tcgen05.Ld32x32bOp(tcgen05.Repetition.x16), Float32),
                                      tS[0][(None, None), 0, 0])
        thr_ld_s = ld_s.get_slice(tidx)
        tO_chunks = cute.flat_divide(tO[(None, None), 0, 0], (M, O_CHUNK))   # (M, 32, 1, D / 32)
        ld_o, st_o, thr_ld_o, thr_st_o = column_copies(tO_chunks[None, None, 0, 0], tidx)
        s_vals = [cute.make_rmem_tensor(thr_ld_s.partition_D(tS[0][(None, None), 0, 0]).shape, Float32)
                  for _ in range(C // BOX)]
        o_vals = cute.make_rmem_tensor(thr_ld_o.partition_D(tO_chunks[None, None, 0, 0]).shape, Float32)
        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
        s_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
        p_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
        o_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
        l_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.num_stages)   # the ring's stage
        work = sched.initial_work()
        while work.is_valid:
            if work.seg_slot >= 0:
                b, kv_head, kv0, kv_end, blocks, length = split_range(work, num_kv_heads, mLens, CHUNK, C)
                row_max = -Float32.inf
                row_sum = Float32(0.0)
                q_full.producer_acquire(q_state)   # the previous tile's S MMAs are done with sQ
                self.load_q(tidx, mQ, b, kv_head, sQ)
                cute.arch.fence_proxy("async.shared", space="cta")
                q_full.producer_commit(q_state)
                q_state.advance()
                for j in cutlass.range(blocks, unroll=1):
                    s_full.consumer_wait(s_state)
                    for k in cutlass.range_constexpr(C // BOX):
                        cute.copy(ld_s, thr_ld_s.partition_S(tS[k][(None, None), 0, 0]), s_vals[k])
                    cute.arch.fence_view_async_tmem_load()
                    s_full.consumer_release(s_state)
                    s_state.advance()
                    # scores -> log2 units, masked; the row's max over the block
                    t0 = kv0 + j * C
                    block_max = -Float32.inf
                    for k in cutlass.range_constexpr(C // BOX):
                        for c in cutlass.range_constexpr(BOX):
                            x = masked_score(s_vals[k][c], t0 + k * BOX + c, kv_end, length, tidx, scale, softcap,
                                             self.config, LOG2E)
                            s_vals[k][c] = x
                            block_max = cute.arch.fmax(block_max, x)
                    new_max = cute.arch.fmax(row_max, block_max)
                    base = cutlass.select_(new_max == -Float32.inf, Float32(0.0), new_max)   # no visible key yet
                    corr = cute.math.exp2(row_max - base, fastmath=True)
                    row_max = new_max
                    row_sum = row_sum * corr
                    p_full.producer_acquire(p_state)   # the previous P V is done: sP free, O settled
                    for k in cutlass.range_constexpr(C // BOX):
                        for c in cutlass.range_constexpr(BOX):
                            p = cute.math.exp2(s_vals[k][c] - base, fastmath=True)
                            row_sum = row_sum + p
                            sP[(tidx, c), 0, k, 0] = self.io_dtype(p)
                    if t0 + C > length:   # the cache's last block: rows past its length may hold NaN
                        self.zero_rows_past(tidx, sV, l_state.index * (C // BOX), length - t0)
                    l_state.advance()
                    if j > 0:
                        for chunk in cutlass.range_constexpr(D // O_CHUNK):
                            cute.copy(ld_o, thr_ld_o.partition_S(tO_chunks[None, None, 0, chunk]), o_vals)
                            cute.arch.fence_view_async_tmem_load()
                            for e in cutlass.range_constexpr(cute.size(o_vals)):
                                o_vals[e] = o_vals[e] * corr
                            cute.copy(st_o, o_vals, thr_st_o.partition_D(tO_chunks[None, None, 0, chunk]))
                        cute.arch.fence_view_async_tmem_store()
                    cute.arch.fence_proxy("async.shared", space="cta")   # P's generic stores -> the MMA's reads
                    p_full.producer_commit(p_state)
                    p_state.advance()
                o_full.consumer_wait(o_state)
                self.store(work, tidx, blocks, ld_o, thr_ld_o, tO_chunks, o_vals, row_max, row_sum, sFlag, mO, mLse,
                           mOp, mLp, mCount, o_full, o_state)
                o_state.advance()
            work = sched.advance(work)

    @cute.jit
    def zero_rows_past(self, tidx, sV, box0, valid):
        """Zero the V rows at or past position `valid` of the stage whose boxes start at `box0` (thread tidx: column
        tidx): they lie past the cache length, their P is 0, but 0 x NaN would be NaN. Before p_full's fence."""
        for k in cutlass.range_constexpr(C // BOX):
            for t in cutlass.range_constexpr(BOX):
                if k * BOX + t >= valid:
                    for d0 in cutlass.range_constexpr(0, self.head_dim, 32 * SOFTMAX_WARPS):
                        if d0 + tidx < self.head_dim:
                            sV[((d0 + tidx), t), 0, 0, box0 + k] = self.io_dtype(0.0)

    @cute.jit
    def store(self, work, tidx, blocks, ld_o, thr_ld_o, tO_chunks, o_vals, row_max, row_sum, sFlag, mO, mLse, mOp,
              mLp, mCount, o_full, o_state):
        """Row tidx's o and lse: to the output if the unit has one split, else to the split's slot, and the last
        split merges the unit. A tile with no visible key (blocks = 0) stores o = 0, lse = -inf."""
        D = self.head_dim
        inv = cutlass.select_(row_sum > 0.0, Float32(1.0) / row_sum, Float32(0.0))
        lse = -Float32.inf
        if row_sum > 0.0:
            lse = (row_max + cute.math.log2(row_sum, fastmath=False)) * LN2
        unit = work.seq
        splits = work.num_segments
        slot = work.seg_slot
        r = tidx
        for chunk in cutlass.range_constexpr(D // O_CHUNK):
            if blocks > 0:
                cute.copy(ld_o, thr_ld_o.partition_S(tO_chunks[None, None, 0, chunk]), o_vals)
                cute.arch.fence_view_async_tmem_load()
            else:
                o_vals.fill(0.0)
            if r < self.rows:
                for e in cutlass.range_constexpr(O_CHUNK):
                    if splits == 1:
                        mO[unit, r, chunk * O_CHUNK + e] = self.io_dtype(o_vals[e] * inv)
                    else:
                        mOp[slot, r, chunk * O_CHUNK + e] = self.io_dtype(o_vals[e] * inv)
        o_full.consumer_release(o_state)   # O's TMEM free for the next tile's first P V
        if r < self.rows:
            if splits == 1:
                mLse[unit, r] = lse
            else:
                mLp[slot, r] = lse
        if splits > 1:
            if is_last_split(tidx, mCount, unit, splits, sFlag, 1):
                merge_unit(tidx, mOp, mLp, slot - work.segment, splits, self.rows, mO, mLse, unit, self.io_dtype,
                           self.config.merge_batch)
