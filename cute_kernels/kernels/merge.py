"""Merge kernels shared by every arch (plain SIMT code, no tensor cores).

`AffineMerge`: compose per-segment affine summaries S_end = M S_start + h_ext along each sequence.
`LseMerge`: combine split-KV partial softmax outputs by log-sum-exp.

Both read the schedulers' segment layout directly: segment (or split) slots of all sequences are
concatenated along the first axis, and `seg_offsets[n] .. seg_offsets[n+1]` are sequence n's slots
(the `seg_slot` column of a work tile). A fixed-length problem is the case seg_offsets = [0, S, 2S, ...].
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import cpasync
from cutlass import Float32, Int32

from .merge_config import AFFINE_MERGE_CONFIG, affine_merge_fits

REGS_TILE = 32 * 36   # `regs`: floats per state tile (K = 128, 8 columns, 4 floats of padding per 4 rows)


class AffineMerge:
    """Start state of every segment and the final state, from per-segment summaries.

    Per (sequence n, head h, V tile of `block_v` columns): S = S0[n, h]; for each segment slot s of n in
    order: start[s] = S; S = M[s, h] @ S + h_ext[s, h]. Then final[n, h] = S.
    Without an initial state S0 = 0, so the first segment's M is never read (S = h_ext[first]).
    `starts_only`: the start states only -- each sequence's last summary is never read and final_state is not
    written (the segmented forward's output launch computes the end of the last segment itself).

    Tensors (fp32, row-major, dynamic leading sizes): M [slots, H, K, K], h_ext [slots, H, K, V],
    seg_offsets [N + 1] int32, initial_state [N, H, K, V] (read only if `has_initial_state`),
    start_states [slots, H, K, V], final_state [N, H, K, V].

    One CTA per (V tile, head, sequence), no warp specialization. The running state tile (K x block_v) lives in
    shared memory; each thread owns `K * block_v / threads` outputs (one column, a run of rows) and accumulates
    them in registers, in the same order in every variant (k ascending, four at a time).
    - `impl="simt"` (128 threads, 16 columns): M rows are read straight from global memory with 16-byte loads.
      ~23 us per segment on the H200 (every thread re-reads its M rows from L2; load latency per k-step).
    - `impl="staged"` (256 threads, 32 columns): each segment's M is first copied into shared memory with
      coalesced 16-byte loads, then read from there (a warp's threads share rows: broadcast). 7.6 us per segment.
    - `impl="prefetch"` (256 threads, 8 columns): as staged, but M[s + 1] and h_ext[s + 1] are loaded into
      registers while segment s is computed (the chain depends only on the running state, not on M), so the
      serial critical path per segment is an smem store, two barriers and K * 8 * K / 256 FMA per thread;
      four times as many CTAs per (sequence, head) as staged.
    - `impl="ring"` (256 threads, 8 columns, `ring_kernel`): M[s] and h_ext[s] stream into a 3-stage shared-memory
      ring by cp.async, issued two segments ahead (commit/wait groups, no mbarriers), so the load latency is
      off the serial chain: per segment one group wait, three CTA barriers and the K x 8 x K products.
    - `impl="regs"` (K = 128 only; 256 threads, 8 columns, `regs_kernel`): M never goes through shared memory.
      Thread (row group rg, k group kg) keeps M[4 rg .. 4 rg + 3, its 16 k's] in registers (the next segment's
      block prefetched into a second set while this one is computed), multiplies it by the 16 x 8 slice of the
      running state it needs (read from a padded, swizzled smem tile: 2 pair-shared LDS.128 per k), and the 8
      k groups of a warp sum their partial 4 x 8 blocks by a 3-step butterfly that leaves each lane 4 finished
      outputs (one row, 4 columns). Per segment: 32 LDS.128, 512 FMA, 28 shuffles per thread and one CTA
      barrier (the state tile is double-buffered); the other variants' mac is bound by ~5k shared-memory
      wavefronts per segment (each thread re-reads M rows from smem for every 4 FMA).
    `profile` (regs, diagnostics only): thread 0 of each CTA sums clock64 cycles per phase of every link -- (0) the
    copy of the prefetched M / h_ext registers (waits for their loads), (1) the next segment's loads issued and the
    start state stored, (2) the products, (3) the butterfly and the state tile store, (4) the CTA barrier -- and
    writes them and the link count to final_state[seq, head, 0..5, 8 vt] (final_state then holds nothing else).
    `pdl` (any impl): launched with programmatic dependent launch after the summary launch; `pdl_start` waits for it
    before the first read.
    `publish` (regs, not `starts_only`): each start state is published as soon as it is stored, for the one-pass
    forward's early correction (`SegmentCorrectionSm90(early=True)`), through `flags` (int32): flags[slot] is how
    many correction tiles read slot's start (its readers; 0: not published), flags[slots + slot * H + head] the
    count. At the end of the link that stores start[slot] (after its CTA barrier) thread 0 fences at gpu scope and
    adds 1 (release) to the count, so the count reaches `affine_merge_writers` (V / 8) once every CTA of the
    (sequence, head) has stored its columns; the readers put it back to 0. Other builds ignore `flags`.
    """

    def __init__(self, k_dim: int, v_dim: int, has_initial_state: bool, impl: str = "simt", starts_only: bool = False,
                 pdl: bool = False, profile: bool = False, publish: bool = False):
        if impl not in AFFINE_MERGE_CONFIG:
            raise ValueError(f"AffineMerge impl must be one of {sorted(AFFINE_MERGE_CONFIG)}, got {impl!r}")
        if profile and (impl != "regs" or starts_only):
            raise ValueError("profile is a diagnostics build of impl='regs' without starts_only")
        if publish and (impl != "regs" or starts_only or profile):
            raise ValueError("publish is built for impl='regs' without starts_only (and not with profile)")
        self.profile = profile
        self.publish = publish
        self.impl = impl
        self.pdl = pdl
        self.staged = impl != "simt"
        self.num_threads, block_v = AFFINE_MERGE_CONFIG[impl]
        if not affine_merge_fits(impl, k_dim, v_dim):
            raise ValueError(f"AffineMerge[{impl}] needs K % 4 == 0, V % {block_v} == 0 and K * K / 4 a multiple of "
                             f"{self.num_threads}, got K={k_dim}, V={v_dim}")
        self.k_dim = k_dim
        self.v_dim = v_dim
        self.block_v = block_v
        self.has_initial_state = has_initial_state
        self.starts_only = starts_only
        self.rows_per_thread = k_dim * block_v // self.num_threads
        self.ring_stages = 3
        self.m_vecs = k_dim * k_dim // 4 // self.num_threads  # 16-byte pieces of M per thread (staged copy)

    @cute.jit
    def __call__(
        self,
        m: cute.Tensor,
        h_ext: cute.Tensor,
        seg_offsets: cute.Tensor,
        initial_state: cute.Tensor,
        start_states: cute.Tensor,
        final_state: cute.Tensor,
        flags: cute.Tensor,
        stream,
    ):
        num_seqs = final_state.shape[0]
        num_heads = final_state.shape[1]
        if cutlass.const_expr(self.impl == "regs"):
            launch = self.regs_kernel(m, h_ext, seg_offsets, initial_state, start_states, final_state, flags)
        elif cutlass.const_expr(self.impl == "ring"):
            launch = self.ring_kernel(m, h_ext, seg_offsets, initial_state, start_states, final_state)
        else:
            launch = self.kernel(m, h_ext, seg_offsets, initial_state, start_states, final_state)
        launch.launch(
            grid=[self.v_dim // self.block_v, num_heads, num_seqs],
            block=[self.num_threads, 1, 1],
            stream=stream,
            use_pdl=self.pdl,
        )

    @cute.kernel
    def kernel(
        self,
        m: cute.Tensor,
        h_ext: cute.Tensor,
        seg_offsets: cute.Tensor,
        initial_state: cute.Tensor,
        start_states: cute.Tensor,
        final_state: cute.Tensor,
    ):
        K, RPT = self.k_dim, self.rows_per_thread
        prefetch = self.impl == "prefetch"
        self.pdl_start()
        tid, head, seq, col, row0, v = self.coords()

        smem = cutlass.memory.SmemAllocator()
        s_tile = smem.allocate_tensor(Float32, cute.make_layout((K, self.block_v), stride=(self.block_v, 1)), 16)
        s_m = smem.allocate_tensor(Float32, cute.make_layout((K, K) if self.staged else (1, 4), stride=(K, 1)), 16)
        acc = cute.make_rmem_tensor((RPT,), Float32)
        # prefetch: the next segment's M pieces and h_ext values, in registers.
        m_next = cute.make_rmem_tensor((4 * self.m_vecs if prefetch else 4,), Float32)
        h_next = cute.make_rmem_tensor((RPT,), Float32)

        self.init_state(s_tile, initial_state, seq, head, row0, col, v)
        first = seg_offsets[seq]
        last = seg_offsets[seq + 1]
        end = last - 1 if self.starts_only else last   # segments whose summary is applied
        if cutlass.const_expr(prefetch):
            if first < last:
                self.load_m_h(m, h_ext, first, head, tid, row0, v, m_next, h_next)
        cute.arch.sync_threads()

        for slot in cutlass.range(first, end):
            if cutlass.const_expr(prefetch):
                # Registers -> smem for this segment, then start the loads of the next one (the last segment
                # reloads itself: harmless, and no branch).
                for i in cutlass.range_constexpr(self.m_vecs):
                    f = tid + self.num_threads * i
                    cute.autovec_copy(cute.local_tile(m_next, (4,), (i,)),
                                      cute.local_tile(s_m[f // (K // 4), None], (4,), (f % (K // 4),)))
                for i in cutlass.range_constexpr(RPT):
                    acc[i] = h_next[i]
                nxt = slot + 1
                if nxt >= last:
                    nxt = slot
                self.load_m_h(m, h_ext, nxt, head, tid, row0, v, m_next, h_next)
            elif cutlass.const_expr(self.staged):
                for i in cutlass.range_constexpr(self.m_vecs):
                    f = tid + self.num_threads * i
                    r = f // (K // 4)
                    c4 = f % (K // 4)
                    cute.autovec_copy(cute.local_tile(m[slot, head, r, None], (4,), (c4,)),
                                      cute.local_tile(s_m[r, None], (4,), (c4,)))
            for i in cutlass.range_constexpr(RPT):
                start_states[slot, head, row0 + i, v] = s_tile[row0 + i, col]
                if cutlass.const_expr(not prefetch):
                    acc[i] = h_ext[slot, head, row0 + i, v]
            if cutlass.const_expr(self.staged):
                cute.arch.sync_threads()
            m_mat = s_m if self.staged else m[slot, head, None, None]
            if cutlass.const_expr(self.has_initial_state):
                self.mac(acc, m_mat, s_tile, row0, col)
            else:
                if slot != first:   # the first start is zero: M[first] is not read
                    self.mac(acc, m_mat, s_tile, row0, col)
            cute.arch.sync_threads()
            for i in cutlass.range_constexpr(RPT):
                s_tile[row0 + i, col] = acc[i]
            cute.arch.sync_threads()

        self.store_end(s_tile, start_states, final_state, first, last, seq, head, row0, col, v)

    @cute.kernel
    def ring_kernel(
        self,
        m: cute.Tensor,
        h_ext: cute.Tensor,
        seg_offsets: cute.Tensor,
        initial_state: cute.Tensor,
        start_states: cute.Tensor,
        final_state: cute.Tensor,
    ):
        K, BV, RPT, STAGES = self.k_dim, self.block_v, self.rows_per_thread, self.ring_stages
        self.pdl_start()
        tid, head, seq, col, row0, v = self.coords()

        smem = cutlass.memory.SmemAllocator()
        s_tile = smem.allocate_tensor(Float32, cute.make_layout((K, BV), stride=(BV, 1)), 16)
        s_m = smem.allocate_tensor(Float32, cute.make_layout((STAGES, K, K), stride=(K * K, K, 1)), 128)
        s_h = smem.allocate_tensor(Float32, cute.make_layout((STAGES, K, BV), stride=(K * BV, BV, 1)), 16)
        copy16 = cute.make_copy_atom(cpasync.CopyG2SOp(), Float32, num_bits_per_copy=128)
        copy4 = cute.make_copy_atom(cpasync.CopyG2SOp(), Float32, num_bits_per_copy=32)
        acc = cute.make_rmem_tensor((RPT,), Float32)

        self.init_state(s_tile, initial_state, seq, head, row0, col, v)
        first = seg_offsets[seq]
        last = seg_offsets[seq + 1]
        end = last - 1 if self.starts_only else last   # segments whose summary is applied
        # Prologue: segments first .. first + STAGES - 2 into stages 0 .. STAGES - 2, one commit group each (past the
        # sequence's last segment a group reloads the last one: every iteration then waits on the same count).
        if first < last:
            for p in cutlass.range_constexpr(STAGES - 1):
                src = first + p
                if src >= last:
                    src = last - 1
                self.ring_issue(copy16, copy4, m, h_ext, s_m, s_h, src, p, head, tid, row0, col, v)
                cute.arch.cp_async_commit_group()
        cute.arch.sync_threads()

        for slot in cutlass.range(first, end):
            i = slot - first
            stage = i % STAGES
            cute.arch.cp_async_wait_group(STAGES - 2)  # this segment's group has landed (this thread's pieces)
            cute.arch.sync_threads()                    # ... and everyone's
            # Refill the stage consumed last iteration with segment slot + STAGES - 1.
            src = slot + STAGES - 1
            if src >= last:
                src = last - 1
            self.ring_issue(copy16, copy4, m, h_ext, s_m, s_h, src, (i + STAGES - 1) % STAGES, head, tid, row0,
                            col, v)
            cute.arch.cp_async_commit_group()
            for r in cutlass.range_constexpr(RPT):
                start_states[slot, head, row0 + r, v] = s_tile[row0 + r, col]
                acc[r] = s_h[stage, row0 + r, col]
            if cutlass.const_expr(self.has_initial_state):
                self.mac(acc, s_m[stage, None, None], s_tile, row0, col)
            else:
                if slot != first:   # the first start is zero: M[first] is not read
                    self.mac(acc, s_m[stage, None, None], s_tile, row0, col)
            cute.arch.sync_threads()
            for r in cutlass.range_constexpr(RPT):
                s_tile[row0 + r, col] = acc[r]
        cute.arch.cp_async_wait_group(0)
        cute.arch.sync_threads()
        self.store_end(s_tile, start_states, final_state, first, last, seq, head, row0, col, v)

    # ---------------------------------------------------------------- impl="regs"
    # Thread roles: lane = 4 kg + r (kg: k group 0..7, r: row group within the warp 0..3), rg = 4 warp + r.
    # The thread's k's: 32 q + 4 kg + e (q, e in 0..3: 16-byte pieces of M rows, coalesced across kg).
    # Its 4 x 8 partial block is held in a lane-dependent order (local row i = global row i ^ (2 b4 + b3), local
    # column c = global column c ^ 4 b2, with b4 b3 b2 = kg's bits) so that every butterfly step keeps the first
    # half of its values and sends the second: after the steps over lane bits 4, 3, 2 the lane holds global row
    # 4 rg + 2 b4 + b3, columns 4 b2 .. 4 b2 + 3 -- its "own" outputs, kept in registers (`cur`) between segments.
    # State tile in smem (fp32, two buffers of REGS_TILE floats): S[k, c] at 36 (k // 4) + 8 (k % 4) + 4 p + c % 4
    # with p = (c // 4) ^ ((k // 4) & 1): the 8 k groups' reads of one instruction hit 8 different 4-bank groups,
    # and each lane finds its local column piece at the physical piece it asks for.

    @cute.kernel
    def regs_kernel(self, m: cute.Tensor, h_ext: cute.Tensor, seg_offsets: cute.Tensor, initial_state: cute.Tensor,
                    start_states: cute.Tensor, final_state: cute.Tensor, flags: cute.Tensor):
        """`impl="regs"` (see the class docstring and the notes above)."""
        self.pdl_start()
        tid, _, _ = cute.arch.thread_idx()
        vt, head, seq = cute.arch.block_idx()
        warp = tid // 32
        lane = tid % 32
        kg = lane // 4
        rg = 4 * warp + lane % 4
        b4 = (kg >> 2) & 1
        b3 = (kg >> 1) & 1
        b2 = kg & 1
        row_x = 2 * b4 + b3          # local row i <-> global row 4 rg + (i ^ row_x)
        own_row = 4 * rg + row_x     # the row of this lane's finished outputs
        v0 = vt * 8 + 4 * b2         # ... and their first global column

        smem = cutlass.memory.SmemAllocator()
        s_flat = smem.allocate_tensor(Float32, cute.make_layout((2 * REGS_TILE,)), 16)
        # M's block and h_ext's values of this segment (`m_cur`, `h_cur`) and of the next one (loaded while this one
        # is computed). An unrolled-by-two loop with the two sets alternating (no copies) took 244 registers and was
        # slower (1.91 vs 1.71 us per segment, H200).
        m_cur = cute.make_rmem_tensor((64,), Float32)     # [i][q][e]: M[4 rg + (i ^ row_x), 32 q + 4 kg + e]
        m_next = cute.make_rmem_tensor((64,), Float32)
        h_cur = cute.make_rmem_tensor((4,), Float32)
        h_next = cute.make_rmem_tensor((4,), Float32)
        cur = cute.make_rmem_tensor((4,), Float32)        # this lane's outputs of the running state
        part = cute.make_rmem_tensor((32,), Float32)      # [i][c] partial sums over this thread's k's
        s_row = cute.make_rmem_tensor((8,), Float32)

        if cutlass.const_expr(self.has_initial_state):
            cute.autovec_copy(cute.local_tile(initial_state[seq, head, own_row, None], (4,), (v0 // 4,)), cur)
        else:
            for j in cutlass.range_constexpr(4):
                cur[j] = Float32(0.0)
        own_piece = 9 * rg + 2 * row_x + (b2 ^ (rg & 1))   # 16-byte index of this lane's outputs in a tile
        cute.autovec_copy(cur, cute.local_tile(s_flat, (4,), (own_piece,)))

        first = seg_offsets[seq]
        last = seg_offsets[seq + 1]
        end = last - 1 if self.starts_only else last   # segments whose summary is applied
        if first < last:
            self.regs_load(m, h_ext, first, head, rg, kg, row_x, own_row, v0, m_next, h_next)
        cute.arch.sync_threads()

        thread = (head, rg, kg, row_x, own_row, v0, own_piece)
        stamps = cute.make_rmem_tensor((5,), cutlass.Int64)   # profile: clock64 at each phase boundary of a link
        sums = cute.make_rmem_tensor((5,), cutlass.Int64)     # profile: cycles per phase, summed over links
        for p in cutlass.range_constexpr(5):
            sums[p] = cutlass.Int64(0)
        for slot in cutlass.range(first, end):
            if cutlass.const_expr(self.profile):
                stamps[0] = cute.arch.clock64()
            for f in cutlass.range_constexpr(64):
                m_cur[f] = m_next[f]
            for j in cutlass.range_constexpr(4):
                h_cur[j] = h_next[j]
            self.regs_link(m, h_ext, start_states, slot, first, last, (slot - first) % 2, thread, m_cur, h_cur, m_next,
                           h_next, cur, part, s_row, s_flat, stamps, flags)
            if cutlass.const_expr(self.profile):
                t_end = cute.arch.clock64()
                for p in cutlass.range_constexpr(4):
                    sums[p] = sums[p] + (stamps[p + 1] - stamps[p])
                sums[4] = sums[4] + (t_end - stamps[4])

        if cutlass.const_expr(self.profile):
            if tid == 0:
                for p in cutlass.range_constexpr(5):
                    final_state[seq, head, p, vt * 8] = Float32(sums[p])
                final_state[seq, head, 5, vt * 8] = Float32(end - first)
        elif cutlass.const_expr(self.starts_only):
            if first < last:
                cute.autovec_copy(cur, cute.local_tile(start_states[last - 1, head, own_row, None], (4,),
                                                       (v0 // 4,)))
        else:
            cute.autovec_copy(cur, cute.local_tile(final_state[seq, head, own_row, None], (4,), (v0 // 4,)))

    @cute.jit
    def regs_link(self, m: cute.Tensor, h_ext: cute.Tensor, start_states: cute.Tensor, slot, first, last, buf, thread,
                  m_cur: cute.Tensor, h_cur: cute.Tensor, m_next: cute.Tensor, h_next: cute.Tensor, cur: cute.Tensor,
                  part: cute.Tensor, s_row: cute.Tensor, s_flat: cute.Tensor, stamps: cute.Tensor, flags: cute.Tensor):
        """`regs`: one link of the chain, S <- M[slot] S + h_ext[slot] (M's block and h_ext's values in m_cur, h_cur;
        state tile `buf` read, the other written) while segment slot + 1 loads into m_next, h_next. `publish`: after
        the link's CTA barrier (every thread's start[slot] stored), thread 0 publishes start[slot]."""
        head, rg, kg, row_x, own_row, v0, own_piece = thread
        readers = Int32(0)
        if cutlass.const_expr(self.publish):
            readers = flags[slot]   # loaded here, used after the barrier: its latency hides under the products
        if cutlass.const_expr(self.profile):
            stamps[1] = cute.arch.clock64()
        nxt = slot + 1
        if nxt >= last:
            nxt = slot      # the last segment reloads itself: harmless, and no branch
        self.regs_load(m, h_ext, nxt, head, rg, kg, row_x, own_row, v0, m_next, h_next)
        cute.autovec_copy(cur, cute.local_tile(start_states[slot, head, own_row, None], (4,), (v0 // 4,)))
        for f in cutlass.range_constexpr(32):
            part[f] = Float32(0.0)
        if cutlass.const_expr(self.profile):
            stamps[2] = cute.arch.clock64()
        if cutlass.const_expr(self.has_initial_state):
            self.regs_mac(part, m_cur, s_flat, s_row, buf, kg)
        else:
            if slot != first:   # the first start is zero: M[first] is not read
                self.regs_mac(part, m_cur, s_flat, s_row, buf, kg)
        if cutlass.const_expr(self.profile):
            stamps[3] = cute.arch.clock64()
        # Butterfly over lane bits 4, 3, 2: keep the first half, add the partner's copy of it.
        for step in cutlass.range_constexpr(3):
            n = 16 >> step
            for j in cutlass.range_constexpr(n):
                part[j] = part[j] + cute.arch.shuffle_sync_bfly(part[n + j], offset=16 >> step)
        for j in cutlass.range_constexpr(4):
            cur[j] = part[j] + h_cur[j]
        cute.autovec_copy(cur, cute.local_tile(s_flat, (4,), ((1 - buf) * (REGS_TILE // 4) + own_piece,)))
        if cutlass.const_expr(self.profile):
            stamps[4] = cute.arch.clock64()
        cute.arch.sync_threads()
        if cutlass.const_expr(self.publish):
            tid, _, _ = cute.arch.thread_idx()
            if tid == 0 and readers > 0:
                publish_start(flags, slot, head, start_states.shape[0], start_states.shape[1])

    @cute.jit
    def regs_mac(self, part: cute.Tensor, m_cur: cute.Tensor, s_flat: cute.Tensor, s_row: cute.Tensor, buf, kg):
        """`regs`: part[i, c] += sum over this thread's k's (ascending q, e) of M[row i, k] S[k, column c]."""
        for q in cutlass.range_constexpr(4):
            for e in cutlass.range_constexpr(4):
                piece = buf * (REGS_TILE // 4) + 9 * (8 * q + kg) + 2 * e
                cute.autovec_copy(cute.local_tile(s_flat, (4,), (piece,)), cute.local_tile(s_row, (4,), (0,)))
                cute.autovec_copy(cute.local_tile(s_flat, (4,), (piece + 1,)), cute.local_tile(s_row, (4,), (1,)))
                for i in cutlass.range_constexpr(4):
                    mv = m_cur[16 * i + 4 * q + e]
                    for c in cutlass.range_constexpr(8):
                        part[8 * i + c] = part[8 * i + c] + mv * s_row[c]

    @cute.jit
    def regs_load(self, m: cute.Tensor, h_ext: cute.Tensor, slot, head, rg, kg, row_x, own_row, v0,
                  m_next: cute.Tensor, h_next: cute.Tensor):
        """`regs`: segment `slot`'s M block of this thread (16 x 16-byte loads) and h_ext of its own outputs."""
        for i in cutlass.range_constexpr(4):
            for q in cutlass.range_constexpr(4):
                cute.autovec_copy(cute.local_tile(m[slot, head, 4 * rg + (row_x ^ i), None], (4,), (8 * q + kg,)),
                                  cute.local_tile(m_next, (4,), (4 * i + q,)))
        cute.autovec_copy(cute.local_tile(h_ext[slot, head, own_row, None], (4,), (v0 // 4,)), h_next)

    @cute.jit
    def pdl_start(self):
        """`pdl` (launched early after the summary launch): wait for it to finish before reading any summary, and
        let the next launch (the segments' outputs) start its prologue."""
        if cutlass.const_expr(self.pdl):
            cute.arch.griddepcontrol_wait()
            cute.arch.griddepcontrol_launch_dependents()

    @cute.jit
    def coords(self):
        """(tid, head, seq, col, row0, v): this thread's column `col` of the CTA's V tile (global column v) and its
        first row row0 of the `rows_per_thread` it owns."""
        tid, _, _ = cute.arch.thread_idx()
        vt, head, seq = cute.arch.block_idx()
        col = tid % self.block_v
        row0 = (tid // self.block_v) * self.rows_per_thread
        return tid, head, seq, col, row0, vt * self.block_v + col

    @cute.jit
    def init_state(self, s_tile: cute.Tensor, initial_state: cute.Tensor, seq, head, row0, col, v):
        """This thread's running-state entries <- the initial state (or zero)."""
        for i in cutlass.range_constexpr(self.rows_per_thread):
            if cutlass.const_expr(self.has_initial_state):
                s_tile[row0 + i, col] = initial_state[seq, head, row0 + i, v]
            else:
                s_tile[row0 + i, col] = Float32(0.0)

    @cute.jit
    def store_end(self, s_tile: cute.Tensor, start_states: cute.Tensor, final_state: cute.Tensor, first, last, seq,
                  head, row0, col, v):
        """The running state after the chain: the last segment's start (`starts_only`) or the final state."""
        if cutlass.const_expr(self.starts_only):
            if first < last:
                for i in cutlass.range_constexpr(self.rows_per_thread):
                    start_states[last - 1, head, row0 + i, v] = s_tile[row0 + i, col]
        else:
            for i in cutlass.range_constexpr(self.rows_per_thread):
                final_state[seq, head, row0 + i, v] = s_tile[row0 + i, col]

    @cute.jit
    def mac(self, acc: cute.Tensor, m_mat: cute.Tensor, s_tile: cute.Tensor, row0, col):
        """acc[i] += sum_k m_mat[row0 + i, k] s_tile[k, col]: k ascending, four at a time, M rows in 16-byte loads
        (m_mat: a K x K row-major view in global or shared memory)."""
        for k4 in cutlass.range(self.k_dim // 4, unroll=2):
            s0 = s_tile[4 * k4 + 0, col]
            s1 = s_tile[4 * k4 + 1, col]
            s2 = s_tile[4 * k4 + 2, col]
            s3 = s_tile[4 * k4 + 3, col]
            for i in cutlass.range_constexpr(self.rows_per_thread):
                m4 = cute.make_rmem_tensor((4,), Float32)
                cute.autovec_copy(cute.local_tile(m_mat[row0 + i, None], (4,), (k4,)), m4)
                acc[i] = acc[i] + m4[0] * s0 + m4[1] * s1 + m4[2] * s2 + m4[3] * s3

    @cute.jit
    def ring_issue(self, copy16, copy4, m: cute.Tensor, h_ext: cute.Tensor, s_m: cute.Tensor, s_h: cute.Tensor,
                   slot, stage, head, tid, row0, col, v):
        """cp.async of segment `slot`'s M (coalesced 16-byte pieces) and this thread's h_ext values into `stage`."""
        K = self.k_dim
        for i in cutlass.range_constexpr(self.m_vecs):
            f = tid + self.num_threads * i
            r = f // (K // 4)
            c4 = f % (K // 4)
            cute.copy(copy16, cute.local_tile(m[slot, head, r, None], (4,), (c4,)),
                      cute.local_tile(s_m[stage, r, None], (4,), (c4,)))
        for r in cutlass.range_constexpr(self.rows_per_thread):
            cute.copy(copy4, cute.local_tile(h_ext[slot, head, row0 + r, None], (1,), (v,)),
                      cute.local_tile(s_h[stage, row0 + r, None], (1,), (col,)))

    @cute.jit
    def load_m_h(self, m: cute.Tensor, h_ext: cute.Tensor, slot, head, tid, row0, v,
                 m_next: cute.Tensor, h_next: cute.Tensor):
        """Segment `slot`'s M (coalesced 16-byte pieces, the staged-copy layout) and this thread's h_ext values."""
        K = self.k_dim
        for i in cutlass.range_constexpr(self.m_vecs):
            f = tid + self.num_threads * i
            cute.autovec_copy(cute.local_tile(m[slot, head, f // (K // 4), None], (4,), (f % (K // 4),)),
                              cute.local_tile(m_next, (4,), (i,)))
        for i in cutlass.range_constexpr(self.rows_per_thread):
            h_next[i] = h_ext[slot, head, row0 + i, v]


@cute.jit
def publish_start(flags: cute.Tensor, slot, head, slots, num_heads):
    """One thread, after a barrier that follows its CTA's stores of start[slot, head]: a gpu-scope fence (the
    barrier makes the CTA's stores part of what it orders), then 1 added with release to the slot's count
    (`AffineMerge`'s `publish`: flags[slots + slot * num_heads + head])."""
    cute.arch.fence_acq_rel_gpu()
    cute.arch.atomic_add(flags.iterator + (slots + slot * num_heads + head), Int32(1), sem="release", scope="gpu")


class LseMerge:
    """Merge split partials (o_s normalized within split s, lse_s) into o and lse.

    o = sum_s exp(lse_s - m) o_s / sum_s exp(lse_s - m), lse = m + log(sum_s exp(lse_s - m)), m = max_s lse_s;
    a row whose splits are all empty (lse = -inf) gives o = 0, lse = -inf.

    Tensors: o_partial [slots, R, D] fp32, lse_partial [slots, R] fp32, seg_offsets [N + 1] int32,
    o [N, R, D] (`out_dtype`), lse [N, R] fp32. Row r of sequence n merges slots seg_offsets[n]..[n+1].

    One group of `lanes` threads (D / 4 rounded up to a power of two) per row, 4 contiguous elements per
    lane loaded with one 16-byte load; 128 threads per CTA. Two passes over the splits: max, then the
    weighted sum. No shared memory, no pipelines.
    """

    num_threads = 128

    def __init__(self, head_dim: int, out_dtype):
        if head_dim % 4 or head_dim > 4 * self.num_threads:
            raise ValueError(f"LseMerge supports head dims that are multiples of 4 up to 512, got {head_dim}")
        self.head_dim = head_dim
        self.out_dtype = out_dtype
        self.lanes = 1 << max(0, math.ceil(math.log2(head_dim // 4)))
        self.rows_per_cta = self.num_threads // self.lanes

    @cute.jit
    def __call__(self, o_partial: cute.Tensor, lse_partial: cute.Tensor, seg_offsets: cute.Tensor,
                 o: cute.Tensor, lse: cute.Tensor, stream):
        rows = o.shape[1]
        self.kernel(o_partial, lse_partial, seg_offsets, o, lse).launch(
            grid=[(rows + self.rows_per_cta - 1) // self.rows_per_cta, o.shape[0], 1],
            block=[self.num_threads, 1, 1],
            stream=stream,
        )

    @cute.kernel
    def kernel(self, o_partial: cute.Tensor, lse_partial: cute.Tensor, seg_offsets: cute.Tensor,
               o: cute.Tensor, lse: cute.Tensor):
        tid, _, _ = cute.arch.thread_idx()
        rb, seq, _ = cute.arch.block_idx()
        lane = tid % self.lanes
        row = rb * self.rows_per_cta + tid // self.lanes
        if row < o.shape[1]:
            first = seg_offsets[seq]
            last = seg_offsets[seq + 1]
            m = -Float32.inf
            for s in cutlass.range(first, last):
                m = cute.arch.fmax(m, lse_partial[s, row])
            acc = cute.make_rmem_tensor((4,), Float32)
            acc.fill(0.0)
            wsum = Float32(0.0)
            active = lane * 4 < self.head_dim
            if m > -Float32.inf:
                for s in cutlass.range(first, last):
                    w = cute.math.exp(lse_partial[s, row] - m, fastmath=False)
                    wsum = wsum + w
                    if active:
                        part = cute.make_rmem_tensor((4,), Float32)
                        cute.autovec_copy(cute.local_tile(o_partial[s, row, None], (4,), (lane,)), part)
                        for j in cutlass.range_constexpr(4):
                            acc[j] = acc[j] + w * part[j]
                inv = Float32(1.0) / wsum
                for j in cutlass.range_constexpr(4):
                    acc[j] = acc[j] * inv
            if active:
                out = cute.make_rmem_tensor((4,), self.out_dtype)
                out.store(acc.load().to(self.out_dtype))
                cute.autovec_copy(out, cute.local_tile(o[seq, row, None], (4,), (lane,)))
            if lane == 0:
                if m > -Float32.inf:
                    lse[seq, row] = m + cute.math.log(wsum, fastmath=False)
                else:
                    lse[seq, row] = m
