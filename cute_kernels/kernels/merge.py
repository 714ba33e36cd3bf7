"""Merge kernels shared by every arch (plain SIMT code, no tensor cores).

`AffineMerge`: compose per-segment affine summaries S_end = M S_start + h_ext along each sequence.
`LseMerge`: combine split-KV partial softmax outputs by log-sum-exp.
Both read the schedulers' segment layout: slots of all sequences concatenated along the first axis,
`seg_offsets[n] .. seg_offsets[n+1]` are sequence n's (fixed length: seg_offsets = [0, S, 2S, ...]).
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32

from .configs import MERGE_SHAPES, MergeConfig

REGS_TILE = 32 * 36   # `regs`: floats per state tile (K = 128, 8 columns, 4 floats of padding per 4 rows)


class AffineMerge:
    """Start state of every segment and the final state, from per-segment summaries.

    Per (sequence n, head h, V tile of `block_v` columns): S = S0[n, h]; for each segment slot s of n in
    order: start[s] = S; S = M[s, h] @ S + h_ext[s, h]. Then final[n, h] = S.
    Without an initial state S0 = 0, so the first segment's M is never read (S = h_ext[first]).
    `starts_only`: the start states only -- each sequence's last summary is never read, final_state not written.
    Tensors (fp32, row-major, dynamic leading sizes): M [slots, H, K, K], h_ext [slots, H, K, V],
    seg_offsets [N + 1] int32, initial_state [N, H, K, V] (read only if `has_initial_state`),
    start_states [slots, H, K, V], final_state [N, H, K, V].

    One CTA per (V tile, head, sequence), no warp specialization; the running state tile (K x block_v) lives in
    shared memory. Every variant sums in the same order (k ascending, four at a time).
    - `staged` (256 threads, 32 columns): each segment's M is copied into shared memory, then read from there.
    - `prefetch` (256 threads, 8 columns): as staged, with M[s + 1] and h_ext[s + 1] loaded into registers
      while segment s is computed.
    - `regs` (K = 128 only; 256 threads, 8 columns, `regs_kernel`): M stays in registers; a warp's 8 k groups
      sum their partial blocks by a butterfly; the state tile is double-buffered (one CTA barrier per segment).
    `pdl`: launched with PDL after the summary launch; `pdl_start` waits for it before the first read.
    """

    def __init__(self, config: MergeConfig):
        if config.impl == "tc":
            raise ValueError("AffineMerge is the SIMT merge; impl 'tc' is AffineMergeTcSm90")
        self.config = config
        self.impl = config.impl
        self.pdl = config.pdl
        self.num_threads, block_v = MERGE_SHAPES[config.impl]
        self.k_dim = config.k_dim
        self.v_dim = config.v_dim
        self.block_v = block_v
        self.has_initial_state = config.initial_state
        self.starts_only = config.starts_only
        self.rows_per_thread = self.k_dim * block_v // self.num_threads
        self.m_vecs = self.k_dim * self.k_dim // 4 // self.num_threads  # 16-byte pieces of M per thread

    @cute.jit
    def __call__(self, m: cute.Tensor, h_ext: cute.Tensor, seg_offsets: cute.Tensor, initial_state: cute.Tensor,
                 start_states: cute.Tensor, final_state: cute.Tensor, stream):
        num_seqs = final_state.shape[0]
        num_heads = final_state.shape[1]
        if cutlass.const_expr(self.impl == "regs"):
            launch = self.regs_kernel(m, h_ext, seg_offsets, initial_state, start_states, final_state)
        else:
            launch = self.kernel(m, h_ext, seg_offsets, initial_state, start_states, final_state)
        launch.launch(
            grid=[self.v_dim // self.block_v, num_heads, num_seqs],
            block=[self.num_threads, 1, 1],
            stream=stream,
            use_pdl=self.pdl,
        )

    @cute.kernel
    def kernel(self, m: cute.Tensor, h_ext: cute.Tensor, seg_offsets: cute.Tensor, initial_state: cute.Tensor,
               start_states: cute.Tensor, final_state: cute.Tensor):
        K, RPT = self.k_dim, self.rows_per_thread
        prefetch = self.impl == "prefetch"
        self.pdl_start()
        tid, head, seq, col, row0, v = self.coords()

        smem = cutlass.memory.SmemAllocator()
        s_tile = smem.allocate_tensor(Float32, cute.make_layout((K, self.block_v), stride=(self.block_v, 1)), 16)
        s_m = smem.allocate_tensor(Float32, cute.make_layout((K, K), stride=(K, 1)), 16)
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
                # Registers -> smem, then load the next segment (the last reloads itself: harmless, no branch).
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
            else:
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
            cute.arch.sync_threads()
            if cutlass.const_expr(self.has_initial_state):
                self.mac(acc, s_m, s_tile, row0, col)
            else:
                if slot != first:   # the first start is zero: M[first] is not read
                    self.mac(acc, s_m, s_tile, row0, col)
            cute.arch.sync_threads()
            for i in cutlass.range_constexpr(RPT):
                s_tile[row0 + i, col] = acc[i]
            cute.arch.sync_threads()

        self.store_end(s_tile, start_states, final_state, first, last, seq, head, row0, col, v)

    # ---------------------------------------------------------------- regs
    # lane = 4 kg + r (kg: k group, r: row group in the warp), rg = 4 warp + r; the thread's k's: 32 q + 4 kg + e.
    # Partial blocks are held in lane-permuted order (row i ^ (2 b4 + b3), column c ^ 4 b2; b4 b3 b2 = kg's bits).
    # State tile (two buffers of REGS_TILE floats): S[k, c] at 36 (k // 4) + 8 (k % 4) + 4 p + c % 4,
    # p = (c // 4) ^ ((k // 4) & 1) (swizzled: conflict-free reads).

    @cute.kernel
    def regs_kernel(self, m: cute.Tensor, h_ext: cute.Tensor, seg_offsets: cute.Tensor, initial_state: cute.Tensor,
                    start_states: cute.Tensor, final_state: cute.Tensor):
        """`regs` (see the class docstring and the notes above)."""
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
        # M's block and h_ext's values of this segment (`m_cur`, `h_cur`) and of the next one (loaded meanwhile).
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
        for slot in cutlass.range(first, end):
            for f in cutlass.range_constexpr(64):
                m_cur[f] = m_next[f]
            for j in cutlass.range_constexpr(4):
                h_cur[j] = h_next[j]
            self.regs_link(m, h_ext, start_states, slot, first, last, (slot - first) % 2, thread, m_cur, h_cur, m_next,
                           h_next, cur, part, s_row, s_flat)

        if cutlass.const_expr(self.starts_only):
            if first < last:
                cute.autovec_copy(cur, cute.local_tile(start_states[last - 1, head, own_row, None], (4,),
                                                       (v0 // 4,)))
        else:
            cute.autovec_copy(cur, cute.local_tile(final_state[seq, head, own_row, None], (4,), (v0 // 4,)))

    @cute.jit
    def regs_link(self, m: cute.Tensor, h_ext: cute.Tensor, start_states: cute.Tensor, slot, first, last, buf, thread,
                  m_cur: cute.Tensor, h_cur: cute.Tensor, m_next: cute.Tensor, h_next: cute.Tensor, cur: cute.Tensor,
                  part: cute.Tensor, s_row: cute.Tensor, s_flat: cute.Tensor):
        """`regs`: one link of the chain, S <- M[slot] S + h_ext[slot] (M's block and h_ext's values in m_cur, h_cur;
        state tile `buf` read, the other written) while segment slot + 1 loads into m_next, h_next."""
        head, rg, kg, row_x, own_row, v0, own_piece = thread
        nxt = slot + 1
        if nxt >= last:
            nxt = slot      # the last segment reloads itself: harmless, and no branch
        self.regs_load(m, h_ext, nxt, head, rg, kg, row_x, own_row, v0, m_next, h_next)
        cute.autovec_copy(cur, cute.local_tile(start_states[slot, head, own_row, None], (4,), (v0 // 4,)))
        for f in cutlass.range_constexpr(32):
            part[f] = Float32(0.0)
        if cutlass.const_expr(self.has_initial_state):
            self.regs_mac(part, m_cur, s_flat, s_row, buf, kg)
        else:
            if slot != first:   # the first start is zero: M[first] is not read
                self.regs_mac(part, m_cur, s_flat, s_row, buf, kg)
        # Butterfly over lane bits 4, 3, 2: keep the first half, add the partner's copy of it.
        for step in cutlass.range_constexpr(3):
            n = 16 >> step
            for j in cutlass.range_constexpr(n):
                part[j] = part[j] + cute.arch.shuffle_sync_bfly(part[n + j], offset=16 >> step)
        for j in cutlass.range_constexpr(4):
            cur[j] = part[j] + h_cur[j]
        cute.autovec_copy(cur, cute.local_tile(s_flat, (4,), ((1 - buf) * (REGS_TILE // 4) + own_piece,)))
        cute.arch.sync_threads()

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


class LseMerge:
    """Merge split partials (o_s normalized within split s, lse_s) into o and lse:
    o = sum_s exp(lse_s - m) o_s / sum_s exp(lse_s - m), lse = m + log(sum_s exp(lse_s - m)), m = max_s lse_s;
    a row whose splits are all empty (lse = -inf) gives o = 0, lse = -inf.

    Tensors: o_partial [slots, R, D] fp32, lse_partial [slots, R] fp32, seg_offsets [N + 1] int32,
    o [N, R, D] (`out_dtype`), lse [N, R] fp32. Row r of sequence n merges slots seg_offsets[n]..[n+1].

    One group of `lanes` threads (D / 4 rounded up to a power of two) per row, 4 elements per lane; 128 threads
    per CTA. Two passes over the splits: max, then the weighted sum.
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
