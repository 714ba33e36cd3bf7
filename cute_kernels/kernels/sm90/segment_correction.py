"""SM90 output correction of the one-pass segmented forward (`ChunkStatePassSm90(summary_o=True)`).

The chunked forward is affine in a segment's start state S_0: o_t = o0_t + qm_t S_0, with o0 the outputs of the
segment's chain from zero and qm_t (a row of 128) those of its chain from the identity with no values. The
summary launch stores o0 into o and qm into its own tensor; once the merge has every segment's S_0, this kernel
adds qm S_0 -- in parallel over all chunks, where the two-pass path re-runs each segment's chain.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import cpasync

from schedulers.device import TileScheduler

from ..spin import wait_at_least
from . import wgmma_tiles as wt
from .gdn_fwd import flat, thd

C = 64          # chunk length (tokens)
K_DIM = 128
V_DIM = 128
NUM_STAGES = 2


class SegmentCorrectionSm90:
    """o[t] = o[t] + qm[t] S_0 for the tokens of one work tile (sequence, segment = a chunk range, head), S_0 =
    starts[seg_slot, head] (fp32 [128 x 128], the merge's start state of the tile's segment).

    One warpgroup (128 threads), up to two CTAs per SM (98 KB of shared memory each):
    - S_0 is split once per tile as S_0 = hi + lo (16-bit, lo = S_0 - hi: ~2^-16 relative) into shared memory,
      the B operand of the products (N = V columns, K = channels: MN-major).
    - qm's [64 x 128] chunk tiles arrive by TMA in a `NUM_STAGES`-deep ring (thread 0 issues a stage once every
      thread has passed the barrier after the products that read it; full barriers: TMA transaction bytes).
    - Per chunk: acc = qm hi + qm lo (two 64 x 128 x 128 SS wgmma products, one wait), then rows < L of o are
      read, added in fp32 and written back in 16-bit, two adjacent columns (4 bytes) per access.
    `pdl`: launched with programmatic dependent launch right after the merge: barrier setup and the descriptor
    prefetch run under the merge's tail; every thread waits (`griddepcontrol.wait`) before reading anything.
    `early` (with a merge built with `publish`): no `griddepcontrol.wait`. The merge lets this grid launch as soon as
    all its CTAs have passed their own wait on the summary launch (`pdl_start`), so qm and o are complete when any
    CTA here starts, and the first qm tiles are loaded at once; each tile then waits only for its own segment's
    start state. Thread 0 spins (gpu-scope acquire loads, `spin.wait_at_least`: bounded, it traps) until
    flags[slots + slot * H + head] reaches `writers` (every merge CTA of the head has published), and after the
    split takes one count back: the last of the slot's flags[slot] readers sets it to 0 for the next launch. No deadlock: every merge CTA holds an SM before any CTA
    of this grid starts (programmatic launch, or stream order without it), and the merge waits on nothing here.
    So all corrections but the last segments' run under the merge's chain. The CTA of the table's last tile (a
    last segment's: the tiles are ordered by segment) waits for the merge grid (`griddepcontrol.wait`) before it
    exits, so this grid never completes before the merge: a kernel that waits on this one (its final states) sees
    the merge's writes too.
    """

    def __init__(self, io_dtype, pdl: bool = False, early: bool = False):
        self.io_dtype = io_dtype
        self.pdl = pdl
        self.early = early
        self.num_threads = 128
        self.tma_bytes = C * K_DIM * io_dtype.width // 8

    @cute.jit
    def __call__(self, qm: cute.Tensor, o: cute.Tensor, starts: cute.Tensor, tiles: cute.Tensor, num_tiles: Int32,
                 flags: cute.Tensor, writers: Int32, stream):
        io = self.io_dtype
        qm, o = flat(qm), flat(o)
        wide = wt.first_stage(wt.smem_layout(C, K_DIM, io))
        tma_qm, tma_qm_t = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), thd(qm), wide, (C, K_DIM))

        @cute.struct
        class SharedStorage:
            full: cute.struct.MemRange[cutlass.Int64, NUM_STAGES]
            sQm: cute.struct.Align[cute.struct.MemRange[io, C * K_DIM * NUM_STAGES], 1024]
            sShi: cute.struct.Align[cute.struct.MemRange[io, K_DIM * V_DIM], 1024]
            sSlo: cute.struct.Align[cute.struct.MemRange[io, K_DIM * V_DIM], 1024]

        self.shared_storage = SharedStorage
        self.kernel(tma_qm, tma_qm_t, o, starts, tiles, num_tiles, flags, writers).launch(
            grid=[num_tiles, 1, 1], block=[self.num_threads, 1, 1], stream=stream, min_blocks_per_mp=2,
            preferred_smem_carveout=100,   # fixed (all of the SM for shared memory): no device query when compiling
            use_pdl=self.pdl,
        )

    @cute.kernel
    def kernel(self, tma_qm: cute.CopyAtom, mQm: cute.Tensor, mO: cute.Tensor, mStarts: cute.Tensor,
               mTiles: cute.Tensor, num_tiles: Int32, mFlags: cute.Tensor, writers: Int32):
        io = self.io_dtype
        tidx, _, _ = cute.arch.thread_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        smem = cutlass.memory.SmemAllocator()
        st = smem.allocate(self.shared_storage)
        sQm = wt.smem_view(st.sQm, io, C, K_DIM, NUM_STAGES)               # (token, channel, stage): A
        sShi = wt.smem_view(st.sShi, io, K_DIM, V_DIM)[None, None, 0]      # (channel, v): written row by row
        sSlo = wt.smem_view(st.sSlo, io, K_DIM, V_DIM)[None, None, 0]
        sBhi = wt.smem_view(st.sShi, io, K_DIM, V_DIM, 1, True)[None, None, 0]   # (v, channel): B, MN-major
        sBlo = wt.smem_view(st.sSlo, io, K_DIM, V_DIM, 1, True)[None, None, 0]
        if tidx == 0:
            cpasync.prefetch_descriptor(tma_qm)
            for s in cutlass.range_constexpr(NUM_STAGES):
                cute.arch.mbarrier_init(st.full.data_ptr() + s, 1)
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()
        if cutlass.const_expr(self.pdl):
            if cutlass.const_expr(not self.early):
                cute.arch.griddepcontrol_wait()   # the merge (and before it the summary launch) complete and visible
            cute.arch.griddepcontrol_launch_dependents()

        work = TileScheduler.create(mTiles, num_tiles, False).initial_work()
        head = work.head
        slot = work.seg_slot
        tok0 = work.tok_start
        tok_end = work.tok_end
        n_chunks = work.chunk_end - work.chunk_start
        for c in cutlass.range_constexpr(NUM_STAGES):   # the first chunks' loads under the split of S_0
            if c < n_chunks:
                self.load_chunk(tma_qm, mQm, sQm, st, head, tok0, c, tidx, warp)
        count = mFlags.iterator + (mStarts.shape[0] + slot * mStarts.shape[1] + head)
        if cutlass.const_expr(self.early):
            if tidx == 0:   # S_0 published by every merge CTA of this head
                wait_at_least(count, writers)
            cute.arch.sync_threads()   # orders every thread's reads of S_0 after thread 0's acquire
        wt.split_hi_lo(io, mStarts[slot, head, None, None], sShi, sSlo, tidx, self.num_threads)
        cute.arch.fence_proxy("async.shared", space="cta")   # generic writes -> the wgmma's async reads
        cute.arch.sync_threads()
        if cutlass.const_expr(self.early):
            if tidx == 0:   # one reader done; the last one resets the count for the next launch
                if cute.arch.atomic_add(count, Int32(1), sem="relaxed", scope="gpu") == writers + mFlags[slot] - 1:
                    cute.arch.store(count, Int32(0), sem="relaxed", scope="gpu")

        thr = wt.make_mma(io, False, True, V_DIM).get_slice(tidx)
        cc = thr.partition_C(cute.make_identity_tensor((C, V_DIM)))   # (token, v)
        acc = cute.make_rmem_tensor(thr.partition_shape_C((C, V_DIM)), Float32)
        for c in cutlass.range(n_chunks, unroll=1):
            stage = c % NUM_STAGES
            cute.arch.mbarrier_wait(st.full.data_ptr() + stage, (c // NUM_STAGES) % 2)
            wt.gemm(io, tidx, acc, sQm[None, None, stage], sBhi, False, True, False, V_DIM, wait=False)
            wt.gemm(io, tidx, acc, sQm[None, None, stage], sBlo, False, True, True, V_DIM, wait=True)
            cute.arch.sync_threads()   # every thread's products have read the stage
            if c + NUM_STAGES < n_chunks:
                self.load_chunk(tma_qm, mQm, sQm, st, head, tok0, c + NUM_STAGES, tidx, warp)
            t0 = tok0 + c * C
            L = tok_end - t0
            gO = cute.domain_offset((t0, 0), mO[None, head, None])
            pair = cute.make_rmem_tensor((2,), io)
            # the accumulator's values come in column pairs (v, v + 1) of one row: one 4-byte load and store each
            for i in cutlass.range_constexpr(0, cute.size(acc), 2):
                t, vv = cc[i]
                if t < L:
                    g2 = cute.local_tile(gO[t, None], (2,), (cute.assume(vv, divby=2) // 2,))
                    cute.autovec_copy(g2, pair)
                    pair[0] = io(Float32(pair[0]) + acc[i])
                    pair[1] = io(Float32(pair[1]) + acc[i + 1])
                    cute.autovec_copy(pair, g2)
        if cutlass.const_expr(self.early and self.pdl):
            bid, _, _ = cute.arch.block_idx()
            if bid == num_tiles - 1:
                cute.arch.griddepcontrol_wait()   # the merge complete (its final states) before this grid is

    @cute.jit
    def load_chunk(self, tma_qm, mQm, sQm, st, head, tok0, c, tidx, warp):
        """Warp 0 (the copy elects one lane; lane 0 arms the barrier): chunk c's qm tile [64 x 128] into ring
        stage c % NUM_STAGES, its full barrier expecting the bytes. Rows past a sequence's end read the next
        sequence's (or TMA's zero fill): they only feed output rows that are never stored."""
        if warp == 0:
            stage = c % NUM_STAGES
            bar = st.full.data_ptr() + stage
            if tidx == 0:
                cute.arch.mbarrier_arrive_and_expect_tx(bar, self.tma_bytes)
            g_tile = cute.local_tile(cute.domain_offset((tok0 + c * C, 0), mQm[None, None, head]), (C, K_DIM), (0, 0))
            s_part, g_part = cpasync.tma_partition(
                tma_qm, 0, cute.make_layout(1), cute.group_modes(sQm, 0, 2), cute.group_modes(g_tile, 0, 2),
            )
            cute.copy(tma_qm, g_part, s_part[(None, stage)], tma_bar_ptr=bar)
