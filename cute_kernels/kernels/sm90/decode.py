"""SM90 split-KV decode attention: each work tile reads one split of one (batch row, KV head) unit's KV cache
(`schedulers.splitkv`) for the unit's group x q_len query rows, and writes the output or a partial that the last
split merges (`kernels.decode_fixup`). Spec: `reference.softmax_attention.decode_attention_ref`.
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import cpasync, warpgroup

from ..configs import DECODE_ROWS, DecodeConfig
from ..decode_fixup import box_row, is_last_split, masked_score, merge_unit, split_range, tile_scheduler, unit_rows
from . import wgmma_tiles as wt

C = 64        # KV tokens per block: one ring stage
PAGED_BOX = 16   # tokens per TMA box of a paged cache: pages are multiples of 16 tokens, so a box never straddles two
ROWS = DECODE_ROWS
LOG2E = math.log2(math.e)
LN2 = math.log(2.0)


class SplitKVDecodeSm90:
    """Decode attention on Hopper, one split of one unit per work tile (`DecodeConfig`).

    Warp roles (160 threads). Before they split, with `longest_first`, all threads rank the batch rows by their
    true lengths to find the row of the CTA's tile (`decode_fixup.ranked_row`; barrier 0 after).
    - warps 0-3, the consumer warpgroup: the unit's query rows (row r = i * group + g: query head kv_head * group
      + g of new token i; rows past group x q_len are zero) into shared memory; per KV block S = Q K^T (four
      64 x box x D wgmmas, one per box; in the block holding the cache's last token, V's rows past it
      zeroed first: their P is 0, but a stale or never-written row may hold NaN), the masks (the split's end,
      the cache length, causal new tokens), softcap, the online softmax in registers (log2 units; a row's values
      sit in the 4 lanes of a quad), O += P V (64 x D x box RS wgmmas, P from registers). At the tile's
      end: a unit with one split stores o and lse; otherwise o (normalized, in the io dtype) and lse (fp32) go
      to the split's slot and the last split to finish merges the unit (`decode_fixup.is_last_split`,
      `merge_unit`).
    - warp 4, the producer: per block, K and V as TMA boxes into the next stage: one 64-token box each for a
      contiguous cache, four 16-token boxes for a paged one. A box's
      cache row is page * page_size + t % page_size, page = page_table[b, t // page_size] (paged) or b (a
      contiguous [B, Tmax] cache: page_size = Tmax); boxes past the cache length re-read the last one (masked).
    Pipeline: `PipelineTmaAsync`, `stages` stages of K and V blocks (64 x D each, as swizzled boxes: the S products
    read one box each as their B operand, the P V products one box each as their K block).
    Named barrier 1: the consumer warpgroup.
    """

    def __init__(self, config: DecodeConfig, io_dtype):
        self.config = config
        self.io_dtype = io_dtype
        self.group = config.group
        self.q_len = config.q_len
        self.rows = config.group * config.q_len
        self.head_dim = config.head_dim
        self.num_stages = config.stages
        self.num_threads = 160
        self.tma_bytes = 2 * C * config.head_dim * io_dtype.width // 8
        # a contiguous cache's block is one box: one S product of N = 64 and a quarter of the TMA instructions
        self.box = PAGED_BOX if config.paged else C
        self.boxes = C // self.box
        # an even split of a contiguous cache loads its first blocks (a ring's worth) before it reads the length
        self.blocks_ahead = not config.persistent and not config.paged

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
        k_rows = wt.thd(wt.flat(k_cache))    # (row, D, Hkv): row = page * page_size + slot
        v_rows = wt.thd(wt.flat(v_cache))
        box = wt.first_stage(wt.smem_layout(self.box, D, io))
        op = cpasync.CopyBulkTensorTileG2SOp()
        tma_k, tma_k_t = cpasync.make_tiled_tma_atom(op, k_rows, box, (self.box, D))
        tma_v, tma_v_t = cpasync.make_tiled_tma_atom(op, v_rows, box, (self.box, D))

        @cute.struct
        class SharedStorage:
            load_mbar: cute.struct.MemRange[cutlass.Int64, ns * 2]
            sQ: cute.struct.Align[cute.struct.MemRange[io, ROWS * D], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[io, C * D * ns], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[io, C * D * ns], 1024]
            sFlag: cute.struct.MemRange[Int32, 4]

        self.shared_storage = SharedStorage
        self.kernel(tma_k, tma_k_t, tma_v, tma_v_t, q, cache_seqlens, page_table, k_cache.shape[1],
                    unit_rows(o, self.group), unit_rows(lse, self.group), o_part, lse_part, counters, tiles,
                    num_tiles, splits, unit_blocks, scale, softcap).launch(
            grid=[grid_x, 1, 1], block=[self.num_threads, 1, 1], stream=stream, min_blocks_per_mp=2,
            preferred_smem_carveout=100, use_pdl=True)   # a fixed carveout: no device query when compiling

    @cute.kernel
    def kernel(self, tma_k: cute.CopyAtom, mK: cute.Tensor, tma_v: cute.CopyAtom, mV: cute.Tensor, mQ: cute.Tensor,
               mLens: cute.Tensor, mPages: cute.Tensor, page_size: Int32, mO: cute.Tensor, mLse: cute.Tensor,
               mOp: cute.Tensor, mLp: cute.Tensor, mCount: cute.Tensor, mTiles: cute.Tensor, num_tiles: Int32,
               splits: Int32, unit_blocks: Int32, scale: Float32, softcap: Float32):
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        smem = cutlass.memory.SmemAllocator()
        st = smem.allocate(self.shared_storage)
        io, D, ns = self.io_dtype, self.head_dim, self.num_stages
        load = pipeline.PipelineTmaAsync.create(
            barrier_storage=st.load_mbar.data_ptr(),
            num_stages=ns,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 1),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 4),
            tx_count=self.tma_bytes,
        )
        num_kv_heads = mQ.shape[2] // self.group
        sFlag = st.sFlag.get_tensor(cute.make_layout(4))
        if warp_idx == 4:
            cpasync.prefetch_descriptor(tma_k)
            cpasync.prefetch_descriptor(tma_v)
        # launched early (PDL): the setup above overlaps the previous kernel's tail; every thread waits for that
        # kernel before touching global memory, and the next launch may start its own setup
        cute.arch.griddepcontrol_wait()
        cute.arch.griddepcontrol_launch_dependents()
        sched = tile_scheduler(self.config, tidx, self.num_threads, mTiles, num_tiles, splits, unit_blocks, mLens,
                               num_kv_heads, sFlag)
        sK = wt.smem_view(st.sK, io, self.box, D, ns * self.boxes)
        sV = wt.smem_view(st.sV, io, self.box, D, ns * self.boxes)
        if warp_idx == 4:
            self.producer(sched, load, tma_k, mK, tma_v, mV, sK, sV, mLens, mPages, page_size, num_kv_heads)
        else:
            self.consumer(sched, load, tidx, wt.smem_view(st.sQ, io, ROWS, D), sK, sV,
                          wt.smem_view(st.sV, io, self.box, D, ns * self.boxes, True), sFlag, mQ, mLens, mO, mLse, mOp,
                          mLp, mCount, num_kv_heads, scale, softcap)

    @cute.jit
    def producer(self, sched, load, tma_k, mK, tma_v, mV, sK, sV, mLens, mPages, page_size, num_kv_heads):
        """The load warp: every block of every (non-padding) tile, K and V box by box (see the class docstring).
        An even split of a contiguous cache (`blocks_ahead`) issues its first blocks, as many as the ring holds,
        before it reads the cache length: their rows stay in the batch row's cache (boxes clipped to the
        capacity), rows past the length are masked or zeroed as usual, and a block wholly past it is waited for and
        released unread."""
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.num_stages)
        work = sched.initial_work()
        while work.is_valid:
            if work.seg_slot >= 0:
                first = 0
                if cutlass.const_expr(self.blocks_ahead):
                    b0 = work.seq // num_kv_heads
                    first = self.ahead(work)
                    for j in cutlass.range(first, unroll=1):
                        self.load_block(load, state, tma_k, mK, tma_v, mV, sK, sV, (work.chunk_start + j) * C, b0,
                                        work.seq - b0 * num_kv_heads, page_size, mPages, page_size)
                        state.advance()
                b, kv_head, kv0, kv_end, blocks, length = split_range(work, num_kv_heads, mLens, C, C)
                for j in cutlass.range(first, blocks, unroll=1):
                    self.load_block(load, state, tma_k, mK, tma_v, mV, sK, sV, kv0 + j * C, b, kv_head, length,
                                    mPages, page_size)
                    state.advance()
            work = sched.advance(work)
        load.producer_tail(state)

    def ahead(self, work):
        """The blocks an even split loads before the cache length is known: its planned blocks, at most a ring."""
        return cutlass.min(work.chunk_end - work.chunk_start, self.num_stages)

    @cute.jit
    def load_block(self, load, state, tma_k, mK, tma_v, mV, sK, sV, t0, b, kv_head, length, mPages, page_size):
        """K and V of the 64-token block at token t0 of batch row b into the stage of `state`, box by box."""
        load.producer_acquire(state)
        bar = load.producer_get_barrier(state)
        for k in cutlass.range_constexpr(self.boxes):
            row = box_row(t0 + k * self.box, b, length, mPages, page_size, self.config.paged, self.box)
            for tma, m, s in ((tma_k, mK, sK), (tma_v, mV, sV)):
                g_box = cute.local_tile(cute.domain_offset((row, 0), m[None, None, kv_head]),
                                        (self.box, self.head_dim), (0, 0))
                s_part, g_part = cpasync.tma_partition(
                    tma, 0, cute.make_layout(1), cute.group_modes(s, 0, 2), cute.group_modes(g_box, 0, 2))
                cute.copy(tma, g_part, s_part[(None, state.index * self.boxes + k)], tma_bar_ptr=bar)

    def row_copy(self, wtid):
        """(tiled copy, thread wtid's slice) of 16-byte row pieces over the consumer warpgroup: the q rows' stores
        and the zeroed V rows."""
        vecs = self.head_dim // 8
        atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.io_dtype, num_bits_per_copy=128)
        tiled = cute.make_tiled_copy_tv(atom, cute.make_layout((128 // vecs, vecs), stride=(vecs, 1)),
                                        cute.make_layout((1, 8)))
        return tiled, tiled.get_slice(wtid)

    @cute.jit
    def load_q(self, wtid, mQ, b, kv_head, sQ):
        """The unit's query rows into sQ [64 x D] (16-byte vectors; rows past group x q_len zero)."""
        tiled, thr = self.row_copy(wtid)
        tQ = thr.partition_D(sQ[None, None, 0])
        crd = thr.partition_D(cute.make_identity_tensor((ROWS, self.head_dim)))
        for m in cutlass.range_constexpr(cute.size(tQ, mode=[1])):
            r, d0 = crd[0, m, 0]
            frag = cute.make_rmem_tensor_like(tQ[None, m, None])
            frag.fill(0.0)
            if r < self.rows:
                i = r // self.group
                head = kv_head * self.group + r - i * self.group
                src = cute.local_tile(mQ[b, i, head, None], (8,), (cute.assume(d0, divby=8) // 8,))
                cute.autovec_copy(src, cute.make_tensor(frag.iterator, cute.make_layout(8)))
            cute.copy(tiled, frag, tQ[None, m, None])

    @cute.jit
    def consumer(self, sched, load, wtid, sQ, sK, sV, sV_mn, sFlag, mQ, mLens, mO, mLse, mOp, mLp, mCount,
                 num_kv_heads, scale, softcap):
        """The attention of every tile (see the class docstring). Accumulator values: index i of a 64 x n wgmma
        fragment is row half (i // 2) % 2 of the thread's two rows (r, r + 8)."""
        io, D = self.io_dtype, self.head_dim
        thr_s = wt.make_mma(io, False, False, self.box).get_slice(wtid)
        thr_o = wt.make_mma_rs(io, True, D).get_slice(wtid)
        cc_s = thr_s.partition_C(cute.make_identity_tensor((ROWS, self.box)))
        cc_o = thr_o.partition_C(cute.make_identity_tensor((ROWS, D)))
        acc_o = cute.make_rmem_tensor(thr_o.partition_shape_C((ROWS, D)), Float32)
        row_max = cute.make_rmem_tensor((2,), Float32)
        row_sum = cute.make_rmem_tensor((2,), Float32)
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.num_stages)
        work = sched.initial_work()
        while work.is_valid:
            if work.seg_slot >= 0:
                # the cache length and q need only the unit: both loads in flight at once, neither after the
                # other's round trip
                b0 = work.seq // num_kv_heads
                row_length = mLens[b0]
                cute.arch.barrier(barrier_id=1, number_of_threads=128)   # the last tile's products read sQ
                self.load_q(wtid, mQ, b0, work.seq - b0 * num_kv_heads, sQ)
                cute.arch.fence_proxy("async.shared", space="cta")
                cute.arch.barrier(barrier_id=1, number_of_threads=128)
                b, kv_head, kv0, kv_end, blocks, length = split_range(work, num_kv_heads, mLens, C, C, row_length)
                row_max.fill(-Float32.inf)
                row_sum.fill(0.0)
                acc_o.fill(0.0)
                stages = blocks
                if cutlass.const_expr(self.blocks_ahead):   # the blocks loaded ahead, in any case
                    stages = cutlass.max(blocks, self.ahead(work))
                for j in cutlass.range(stages, unroll=1):
                    load.consumer_wait(state)
                    if j < blocks:
                        self.attend_block(wtid, state, sQ, sK, sV, sV_mn, thr_s, cc_s, acc_o, row_max, row_sum,
                                          kv0 + j * C, kv_end, length, scale, softcap)
                    load.consumer_release(state)
                    state.advance()
                self.store(work, wtid, acc_o, cc_o, row_max, row_sum, sFlag, mO, mLse, mOp, mLp, mCount)
            work = sched.advance(work)

    @cute.jit
    def attend_block(self, wtid, state, sQ, sK, sV, sV_mn, thr_s, cc_s, acc_o, row_max, row_sum, t0, kv_end,
                     length, scale, softcap):
        """One 64-token block at token t0 (the stage of `state`): S = Q K^T, the online softmax, O += P V."""
        io, D = self.io_dtype, self.head_dim
        box0 = state.index * self.boxes
        if t0 + C > length:   # the cache's last block: rows past its length may hold NaN
            self.zero_rows_past(wtid, sV, box0, length - t0)
        acc_s = [cute.make_rmem_tensor(thr_s.partition_shape_C((ROWS, self.box)), Float32)
                 for _ in range(self.boxes)]
        for k in cutlass.range_constexpr(self.boxes):
            wt.gemm(io, wtid, acc_s[k], sQ[None, None, 0], sK[None, None, box0 + k], False, False, False, self.box,
                    wait=False)
        warpgroup.wait_group(0)
        self.online_softmax(acc_s, cc_s, acc_o, row_max, row_sum, t0, kv_end, length, scale, softcap)
        for k in cutlass.range_constexpr(self.boxes):
            wt.gemm_rs(io, wtid, acc_o, wt.acc_to_a(io, acc_s[k]), sV_mn[None, None, box0 + k], True, True, D,
                       wait=False)
        warpgroup.wait_group(0)

    @cute.jit
    def zero_rows_past(self, wtid, sV, box0, valid):
        """Zero the V rows at or past position `valid` of the stage whose boxes start at `box0`: they lie past the
        cache length (a box re-read, a stale or never-written cache row), their P is 0, but 0 x NaN would be NaN."""
        tiled, thr = self.row_copy(wtid)
        crd = thr.partition_D(cute.make_identity_tensor((self.box, self.head_dim)))
        zeros = cute.make_rmem_tensor_like(thr.partition_D(sV[None, None, 0])[None, 0, None])
        zeros.fill(0.0)
        for k in cutlass.range_constexpr(self.boxes):
            tV = thr.partition_D(sV[None, None, box0 + k])
            for m in cutlass.range_constexpr(cute.size(tV, mode=[1])):
                r, _ = crd[0, m, 0]
                if k * self.box + r >= valid:
                    cute.copy(tiled, zeros, tV[None, m, None])
        cute.arch.fence_proxy("async.shared", space="cta")   # the zeros, before the wgmmas read sV
        cute.arch.barrier(barrier_id=1, number_of_threads=128)

    @cute.jit
    def online_softmax(self, acc_s, cc_s, acc_o, row_max, row_sum, t0, kv_end, length, scale, softcap):
        """Scores of the block at token t0 -> probabilities in place (log2 units, masked), the running max and the
        thread's partial row sums updated, O rescaled."""
        block_max = cute.make_rmem_tensor((2,), Float32)
        block_max.fill(-Float32.inf)
        for k in cutlass.range_constexpr(self.boxes):
            for i in cutlass.range_constexpr(cute.size(acc_s[k])):
                r, col = cc_s[i]
                x = masked_score(acc_s[k][i], t0 + k * self.box + col, kv_end, length, r, scale, softcap, self.config,
                                 LOG2E)
                acc_s[k][i] = x
                h = (i // 2) % 2
                block_max[h] = cute.arch.fmax(block_max[h], x)
        corr = cute.make_rmem_tensor((2,), Float32)
        base = cute.make_rmem_tensor((2,), Float32)
        for h in cutlass.range_constexpr(2):
            mx = block_max[h]
            mx = cute.arch.fmax(mx, cute.arch.shuffle_sync_bfly(mx, offset=1))
            mx = cute.arch.fmax(mx, cute.arch.shuffle_sync_bfly(mx, offset=2))
            new_max = cute.arch.fmax(row_max[h], mx)
            base[h] = cutlass.select_(new_max == -Float32.inf, Float32(0.0), new_max)   # no visible key yet
            corr[h] = cute.math.exp2(row_max[h] - base[h], fastmath=True)
            row_max[h] = new_max
            row_sum[h] = row_sum[h] * corr[h]
        for i in cutlass.range_constexpr(cute.size(acc_o)):
            acc_o[i] = acc_o[i] * corr[(i // 2) % 2]
        for k in cutlass.range_constexpr(self.boxes):
            for i in cutlass.range_constexpr(cute.size(acc_s[k])):
                h = (i // 2) % 2
                p = cute.math.exp2(acc_s[k][i] - base[h], fastmath=True)
                acc_s[k][i] = p
                row_sum[h] = row_sum[h] + p

    @cute.jit
    def store(self, work, wtid, acc_o, cc_o, row_max, row_sum, sFlag, mO, mLse, mOp, mLp, mCount):
        """The tile's o and lse: to the output if the unit has one split, else to the split's slot, and the last
        split merges the unit."""
        inv = cute.make_rmem_tensor((2,), Float32)
        lse = cute.make_rmem_tensor((2,), Float32)
        for h in cutlass.range_constexpr(2):
            total = row_sum[h]
            total = total + cute.arch.shuffle_sync_bfly(total, offset=1)
            total = total + cute.arch.shuffle_sync_bfly(total, offset=2)
            inv[h] = cutlass.select_(total > 0.0, Float32(1.0) / total, Float32(0.0))
            lse[h] = -Float32.inf
            if total > 0.0:
                lse[h] = (row_max[h] + cute.math.log2(total, fastmath=False)) * LN2
        unit = work.seq
        splits = work.num_segments
        slot = work.seg_slot
        lane = wtid % 32
        if splits == 1:
            for i in cutlass.range_constexpr(cute.size(acc_o)):
                r, col = cc_o[i]
                if r < self.rows:
                    mO[unit, r, col] = self.io_dtype(acc_o[i] * inv[(i // 2) % 2])
            if lane % 4 == 0:
                for h in cutlass.range_constexpr(2):
                    r, _ = cc_o[2 * h]
                    if r < self.rows:
                        mLse[unit, r] = lse[h]
        else:
            for i in cutlass.range_constexpr(cute.size(acc_o)):
                r, col = cc_o[i]
                if r < self.rows:
                    mOp[slot, r, col] = self.io_dtype(acc_o[i] * inv[(i // 2) % 2])
            if lane % 4 == 0:
                for h in cutlass.range_constexpr(2):
                    r, _ = cc_o[2 * h]
                    if r < self.rows:
                        mLp[slot, r] = lse[h]
            if is_last_split(wtid, mCount, unit, splits, sFlag, 1):
                merge_unit(wtid, mOp, mLp, slot - work.segment, splits, self.rows, mO, mLse, unit, self.io_dtype,
                           self.config.merge_batch)
