"""The split-KV fixup (every arch): a unit's partials (o normalized within its split, lse) merged into its output.

`tile_scheduler` is both decode kernels' work-tile source (the stream-K table, or an even split computed from the
CTA index, optionally longest batch row first: `ranked_row`). `split_range`, `box_row` and `masked_score` are the
work tile's tokens, a box's cache row and a score's mask (both decode kernels). `merge_unit` is the merge (the
math of `reference.softmax_attention.lse_merge`). Inside the decode kernel, `is_last_split` picks the CTA that
runs it: every split's CTA, once its partial is stored, passes a CTA barrier, and one thread adds 1 to its unit's
counter with a gpu-scope acq_rel atomic; the one that sees num_splits - 1 is last, puts the counter back to 0 for
the next call and, after a second barrier, the CTA merges. No CTA waits on another.
`SplitKVFixup` runs the same merge as a launch of its own (one CTA per unit): on archs whose decode mainloop is
not built, and to time against.

Outputs are viewed per unit (`unit_rows`): unit u = b * Hkv + kv_head, row r = i * group + g for query head
kv_head * group + g of new token i -- the rows of one work tile.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from schedulers.device import EvenSplitScheduler, TileScheduler

from .configs import DECODE_MERGE_BATCHES

THREADS = 128   # the threads that merge
COLS = 8        # output columns per thread and row (a partial's row piece: one 16-byte load in bf16 / fp16)


def unit_rows(t: cute.Tensor, group: int) -> cute.Tensor:
    """[B, Sq, Hq, D] (or [B, Sq, Hq]) as ((Hkv, B), (group, Sq)[, D]): mode 0 the unit, mode 1 its rows."""
    s = t.stride
    hkv = t.shape[2] // group
    shape = ((hkv, t.shape[0]), (group, t.shape[1])) + tuple(t.shape[3:])
    stride = ((group * s[2], s[0]), (s[2], s[1])) + tuple(s[3:])
    return cute.make_tensor(t.iterator, cute.make_layout(shape, stride=stride))


@cute.jit
def ranked_row(tidx, num_threads: int, mLens, rank, sFlag):
    """The batch row at place `rank` when rows are ordered by their true length, longest first (ties: lower row
    first, so a uniform batch keeps index order). All `num_threads` threads of the CTA call it: thread t ranks rows
    t, t + num_threads, ... against every row by the key length x rows + (rows - 1 - row), unique per row; the
    one ranked `rank` goes through sFlag[1], read after a CTA barrier."""
    rows = mLens.shape[0]
    for r in cutlass.range(tidx, rows, num_threads, unroll=1):
        key = cutlass.Int64(mLens[r]) * rows + (rows - 1 - r)
        above = Int32(0)
        for j in cutlass.range(rows, unroll=4):
            if cutlass.Int64(mLens[j]) * rows + (rows - 1 - j) > key:
                above += 1
        if above == rank:
            sFlag[1] = r
    cute.arch.sync_threads()
    return sFlag[1]


def tile_scheduler(config, tidx, num_threads: int, mTiles, num_tiles, splits, unit_blocks, mLens, num_kv_heads,
                   sFlag):
    """A decode kernel's scheduler, after the PDL wait: stream-K's table (`config.persistent`), or an even split
    whose tile comes from the CTA index, with `config.longest_first` for the batch row ranked at the CTA's row
    place (every thread calls it then)."""
    if cutlass.const_expr(config.persistent):
        return TileScheduler.create(mTiles, num_tiles, True)
    if cutlass.const_expr(config.longest_first):
        bid, _, _ = cute.arch.block_idx()
        row = ranked_row(tidx, num_threads, mLens, (bid // splits) // num_kv_heads, sFlag)
        return EvenSplitScheduler.create(splits, unit_blocks, num_tiles,
                                         lambda u: row * num_kv_heads + u % num_kv_heads)
    return EvenSplitScheduler.create(splits, unit_blocks, num_tiles)


@cute.jit
def split_range(work, num_kv_heads, mLens, chunk: int, block: int, length=None):
    """(unit's batch row, KV head, first token, end token, blocks, length) of a decode work tile: its chunks
    [chunk_start, chunk_end) of `chunk` tokens clipped to the cache length read on the device (the plan only knew
    an upper bound), in blocks of `block` tokens. `length`: the row's cache length when the caller loaded it
    earlier, else it is read here."""
    unit = work.seq
    b = unit // num_kv_heads
    kv_head = unit - b * num_kv_heads
    kv0 = work.chunk_start * chunk
    kv_end = work.chunk_end * chunk
    if cutlass.const_expr(length is None):
        length = mLens[b]
    if kv_end > length:
        kv_end = length
    blocks = Int32(0)
    if kv_end > kv0:
        blocks = (kv_end - kv0 + block - 1) // block
    return b, kv_head, kv0, kv_end, blocks, length


@cute.jit
def box_row(t, b, length, mPages, page_size, paged: bool, box: int):
    """The cache row of the `box`-token TMA box at token t of batch row b: page * page_size + t % page_size, page =
    page_table[b, t // page_size] (`paged`) or b (a contiguous [B, Tmax] cache: page_size = Tmax). A box past the
    cache length re-reads the last one (its scores are masked)."""
    last_box = ((length - 1) // box) * box
    if t > last_box:
        t = last_box
    page = b
    if cutlass.const_expr(paged):
        page = mPages[b, t // page_size]
    return page * page_size + t % page_size


@cute.jit
def masked_score(x, t, kv_end, length, row, scale, softcap, config, log2e):
    """A raw score q.k of key t for query row `row` (= i * group + g) in log2 units: scaled, or through softcap
    tanh; -inf past the split's end and, with several new tokens, past new token i's own position (it sits at
    length - q_len + i and sees the keys up to it)."""
    if cutlass.const_expr(config.softcap):
        x = softcap * cute.math.tanh(x * scale / softcap, fastmath=True) * log2e
    else:
        x = x * (scale * log2e)
    visible = t < kv_end
    if cutlass.const_expr(config.q_len > 1):
        visible = visible and t <= length - config.q_len + row // config.group
    return cutlass.select_(visible, x, -Float32.inf)


@cute.jit
def merge_unit(tid, o_part, lse_part, slot0, nsplit, rows, mO, mLse, unit, out_dtype, batch: cutlass.Constexpr):
    """Rows [0, rows) of unit `unit`: o = sum_s w_s o_s / sum_s w_s, w_s = exp(lse_s - max lse), lse = max lse +
    log sum w; a row whose splits are all empty (lse = -inf) gives o = 0, lse = -inf. o_part [slots, R, D] (fp32 or
    the io dtype: each split's o is normalized, so it fits wherever v does),
    lse_part [slots, R]; slots slot0 .. slot0 + nsplit - 1. `tid` in [0, THREADS).

    Each thread owns (row, COLS columns) pieces and reads the splits `batch` at a time (one of DECODE_MERGE_BATCHES,
    the planner's `DecodeConfig.merge_batch`): a batch's loads are all issued before its math (one L2 round trip a
    batch), and the running max rescales the sums once a batch."""
    pieces = o_part.shape[2] // COLS
    for item in cutlass.range(tid, rows * pieces, THREADS, unroll=1):
        r = item // pieces
        piece = item % pieces
        m = -Float32.inf
        wsum = Float32(0.0)
        acc = cute.make_rmem_tensor((COLS,), Float32)
        acc.fill(0.0)
        for s0 in cutlass.range(0, nsplit, batch, unroll=1):
            parts = [cute.make_rmem_tensor((COLS,), o_part.element_type) for _ in range(batch)]
            lses = []
            for u in cutlass.range_constexpr(batch):
                # a place past the last split reads the last split again and weighs it 0 (straight-line loads)
                s = cutlass.min(s0 + u, nsplit - 1)
                cute.autovec_copy(cute.local_tile(o_part[slot0 + s, r, None], (COLS,), (piece,)), parts[u])
                lses.append(cutlass.select_(s0 + u < nsplit, lse_part[slot0 + s, r], -Float32.inf))
            m_new = m
            for u in cutlass.range_constexpr(batch):
                m_new = cute.arch.fmax(m_new, lses[u])
            # both -inf (no key yet): keep the sums (c = 1) and add nothing (w = 0); never exp(-inf + inf)
            c = cutlass.select_(m == m_new, Float32(1.0), cute.math.exp(m - m_new, fastmath=False))
            wsum = wsum * c
            for j in cutlass.range_constexpr(COLS):
                acc[j] = acc[j] * c
            for u in cutlass.range_constexpr(batch):
                w = cutlass.select_(lses[u] == -Float32.inf, Float32(0.0),
                                    cute.math.exp(lses[u] - m_new, fastmath=False))
                wsum = wsum + w
                part = cute.make_rmem_tensor((COLS,), Float32)
                part.store(parts[u].load().to(Float32))
                for j in cutlass.range_constexpr(COLS):
                    acc[j] = acc[j] + w * part[j]
            m = m_new
        lse = m
        if m > -Float32.inf:
            inv = Float32(1.0) / wsum
            for j in cutlass.range_constexpr(COLS):
                acc[j] = acc[j] * inv
            lse = m + cute.math.log(wsum, fastmath=False)
        out = cute.make_rmem_tensor((COLS,), out_dtype)
        out.store(acc.load().to(out_dtype))
        cute.autovec_copy(out, cute.local_tile(mO[unit, r, None], (COLS,), (piece,)))
        if piece == 0:
            mLse[unit, r] = lse


@cute.jit
def is_last_split(tid, mCounters, unit, nsplit, sFlag, barrier_id: int):
    """Whether this CTA finished the unit's last split (see the module docstring). All THREADS threads call it
    after storing their part of the partial; named barrier `barrier_id` spans them. One thread's acq_rel atomic
    at gpu scope releases the CTA's partial before its count and acquires the other splits' partials after the
    count that saw them; the CTA barriers order every other thread's stores before it and its reads after (the
    split-K semaphore pattern: a barrier, then one thread's ordered atomic)."""
    cute.arch.barrier(barrier_id=barrier_id, number_of_threads=THREADS)   # every thread's partial stored
    if tid == 0:
        old = cute.arch.atomic_add(mCounters.iterator + unit, Int32(1), sem="acq_rel", scope="gpu")
        last = Int32(0)
        if old == nsplit - 1:
            last = Int32(1)
            mCounters[unit] = Int32(0)   # every split of this call has counted: ready for the next call
        sFlag[0] = last
    cute.arch.barrier(barrier_id=barrier_id, number_of_threads=THREADS)
    return sFlag[0] != 0


class SplitKVFixup:
    """The fixup as its own launch: CTA u merges unit u's splits when it has more than one.

    Warp roles: 4 warps, each thread a (row, 8 columns) piece at a time (`merge_unit`). No pipelines, no shared
    memory.
    Tensors: o_part [slots, R, D] fp32, lse_part [slots, R], seg_offsets [units + 1] int32 (the schedule's),
    o [B, Sq, Hq, D] (`out_dtype`), lse [B, Sq, Hq] fp32; R = group x Sq rows per unit."""

    def __init__(self, group: int, out_dtype):
        self.group = group
        self.out_dtype = out_dtype

    @cute.jit
    def __call__(self, o_part: cute.Tensor, lse_part: cute.Tensor, seg_offsets: cute.Tensor, o: cute.Tensor,
                 lse: cute.Tensor, stream):
        units = (o.shape[2] // self.group) * o.shape[0]
        self.kernel(o_part, lse_part, seg_offsets, unit_rows(o, self.group), unit_rows(lse, self.group),
                    self.group * o.shape[1]).launch(grid=[units, 1, 1], block=[THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, o_part: cute.Tensor, lse_part: cute.Tensor, seg_offsets: cute.Tensor, mO: cute.Tensor,
               mLse: cute.Tensor, rows: Int32):
        tid, _, _ = cute.arch.thread_idx()
        unit, _, _ = cute.arch.block_idx()
        slot0 = seg_offsets[unit]
        nsplit = seg_offsets[unit + 1] - slot0
        if nsplit > 1:
            merge_unit(tid, o_part, lse_part, slot0, nsplit, rows, mO, mLse, unit, self.out_dtype,
                       DECODE_MERGE_BATCHES[-1])   # any split count
