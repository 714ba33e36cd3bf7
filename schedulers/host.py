"""Host half of the schedulers: turn a Problem into an ordered tile table and a grid.

Every scheduler produces a `Schedule`: the work tiles in the order CTAs take them (an int32 table,
one row per tile, columns `TILE_FIELDS`), the grid to launch, and whether CTAs loop (persistent).
The device half (`schedulers.device.TileScheduler`) reads that table, so one device object serves every
scheduler and a kernel never depends on which one made its table.

Order guarantee: within one (sequence, head, block), segments appear in increasing order. Kernels that
wait on a predecessor segment (look-back) rely on it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from .heuristics import SegmentCost, SegmentPlan, plan_segments, plan_segments_by_cost
from .problem import TILE_FIELDS, Problem, Segmentation, WorkTile, split_even


@dataclass
class Schedule:
    tiles: list[WorkTile]
    grid: tuple[int, int, int]
    persistent: bool
    segmentation: Segmentation
    scheduler: str
    plan: SegmentPlan | None = None
    _device_cache: dict = field(default_factory=dict, repr=False)

    @property
    def num_tiles(self) -> int:
        return len(self.tiles)

    @property
    def seg_offsets(self) -> list[int]:
        return self.segmentation.seg_offsets

    def table(self):
        """The tiles as a [num_tiles, len(TILE_FIELDS)] int32 torch tensor on the CPU."""
        import torch

        return torch.tensor([t.as_row() for t in self.tiles] or [[0] * len(TILE_FIELDS)], dtype=torch.int32)

    def table_on(self, device):
        """`table()` on `device`, built and copied once per Schedule."""
        key = str(device)
        if key not in self._device_cache:
            self._device_cache[key] = self.table().to(device)
        return self._device_cache[key]

    def cta_work(self) -> list[list[WorkTile]]:
        """Which tiles each CTA takes, in order: the host-side enumeration of the device loop."""
        ctas = self.grid[0] * self.grid[1] * self.grid[2]
        if not self.persistent:
            return [[t] for t in self.tiles]
        return [self.tiles[c :: ctas] for c in range(ctas)]

    def explain(self) -> str:
        head = f"{self.scheduler}: {self.num_tiles} tiles on grid {self.grid}" + (
            " (persistent)" if self.persistent else ""
        )
        return head + ("\n" + self.plan.explain() if self.plan else "")


def _tiles(problem: Problem, seg: Segmentation) -> list[WorkTile]:
    """Tiles ordered (sequence, segment, head, block): each segment's heads sit side by side."""
    C = problem.chunk_size
    out = []
    for n in range(problem.num_seqs):
        bounds = seg.bounds[n]
        start, length = problem.seq_starts[n], problem.seq_lens[n]
        ns = len(bounds) - 1
        for s in range(ns):
            c0, c1 = bounds[s], bounds[s + 1]
            t0, t1 = start + min(c0 * C, length), start + min(c1 * C, length)
            for h in range(problem.num_heads):
                for b in range(problem.num_blocks):
                    out.append(WorkTile(n, h, b, s, ns, seg.seg_offsets[n] + s, c0, c1, t0, t1))
    return out


class SequenceScheduler:
    """One tile per (sequence, head, block), whole sequence; grid = number of tiles."""

    name = "sequence"

    def schedule(self, problem: Problem, sm_count: int | None = None, ctas_per_sm: int = 1) -> Schedule:
        seg = Segmentation([split_even(c, 1) for c in problem.chunks])
        tiles = _tiles(problem, seg)
        return Schedule(tiles, (max(1, len(tiles)), 1, 1), False, seg, self.name)


class SegmentScheduler:
    """Each (sequence, head, block) cut along T into segments on chunk boundaries; one CTA per segment.

    `num_segments=None` lets `plan_segments` decide per call (needs `sm_count`), or `plan_segments_by_cost`
    when a `cost` (a kernel's measured `SegmentCost`) is given; an int forces that many per sequence (fewer for
    sequences with fewer chunks; never an empty segment).
    """

    name = "segment"

    def __init__(self, num_segments: int | None = None, min_chunks: int = 4, max_segments: int | None = None,
                 cost: SegmentCost | None = None):
        if num_segments is not None and num_segments < 1:
            raise ValueError(f"num_segments must be >= 1, got {num_segments}")
        self.num_segments = num_segments
        self.min_chunks = min_chunks
        self.max_segments = max_segments
        self.cost = cost

    def __repr__(self) -> str:
        return (f"SegmentScheduler(num_segments={self.num_segments}, min_chunks={self.min_chunks}, "
                f"max_segments={self.max_segments}, cost={self.cost})")

    def segmentation(self, problem: Problem, sm_count: int | None, ctas_per_sm: int):
        if self.num_segments is not None:
            return Segmentation([split_even(c, self.num_segments) for c in problem.chunks]), None
        if sm_count is None:
            raise ValueError("SegmentScheduler(num_segments=None) needs sm_count to plan the split")
        if self.cost is not None:
            plan = plan_segments_by_cost(problem, sm_count, self.cost, ctas_per_sm, self.min_chunks,
                                         self.max_segments)
        else:
            plan = plan_segments(problem, sm_count, ctas_per_sm, self.min_chunks, self.max_segments)
        return plan.segmentation, plan

    def schedule(self, problem: Problem, sm_count: int | None = None, ctas_per_sm: int = 2) -> Schedule:
        seg, plan = self.segmentation(problem, sm_count, ctas_per_sm)
        tiles = _tiles(problem, seg)
        return Schedule(tiles, (max(1, len(tiles)), 1, 1), False, seg, self.name, plan)


class PersistentScheduler:
    """Grid = min(tiles, SMs x CTAs per SM); CTA i takes tiles i, i + grid, i + 2 grid, ...

    Tiles come from `inner` (default: whole sequences) and are ordered longest first (LPT) by their
    (sequence, head, block) group's longest segment, keeping each group's segments together and in order.
    """

    name = "persistent"

    def __init__(self, inner=None, lpt: bool = True):
        self.inner = inner if inner is not None else SequenceScheduler()
        self.lpt = lpt

    def schedule(self, problem: Problem, sm_count: int | None = None, ctas_per_sm: int = 2) -> Schedule:
        if sm_count is None:
            raise ValueError("PersistentScheduler needs sm_count")
        base = self.inner.schedule(problem, sm_count, ctas_per_sm)
        tiles = list(base.tiles)
        if self.lpt:
            longest = {}
            for t in tiles:
                key = (t.seq, t.head, t.block)
                longest[key] = max(longest.get(key, 0), t.chunk_end - t.chunk_start)
            tiles.sort(key=lambda t: (-longest[(t.seq, t.head, t.block)], t.seq, t.segment, t.head, t.block))
        grid = max(1, min(len(tiles), sm_count * ctas_per_sm))
        return Schedule(tiles, (grid, 1, 1), True, base.segmentation, self.name, base.plan)


def schedule_from_segmentation(problem: Problem, segmentation: Segmentation, name: str = "segment") -> Schedule:
    """One CTA per tile of a given segmentation (e.g. another launch's, with a different `num_blocks`)."""
    if len(segmentation.bounds) != problem.num_seqs:
        raise ValueError(f"segmentation has {len(segmentation.bounds)} sequences, the problem {problem.num_seqs}")
    tiles = _tiles(problem, segmentation)
    return Schedule(tiles, (max(1, len(tiles)), 1, 1), False, segmentation, name)


def summary_schedule(problem: Problem, segmentation: Segmentation, first_m: bool, name: str = "segment-summary",
                     h_blocks: int = 1, last: bool = False) -> Schedule:
    """The summary launch of a segmented forward: one CTA per summary tile that some start state needs.

    `problem.num_blocks` is the number of summary blocks per segment: blocks < `h_blocks` compute h_ext's columns,
    the others M's (the fused kernel: block 0 = h_ext, block 1 = M; the two-phase state pass: 2 + 2 blocks of 64
    columns). A sequence's last segment gets no tile (the output launch computes its end state), and its first
    segment only the h_ext blocks unless `first_m` (an initial state is given; without one the start is zero and
    M is never used); see `summary_blocks_of`. The tiles keep `_tiles`' order and their `seg_slot`s, so summaries
    land in the same slots. `last`: the last segments get their tiles too (the one-pass forward: every segment's
    chain runs only in the summary launch).
    """
    if len(segmentation.bounds) != problem.num_seqs:
        raise ValueError(f"segmentation has {len(segmentation.bounds)} sequences, the problem {problem.num_seqs}")
    if not 1 <= h_blocks < problem.num_blocks:
        raise ValueError(f"h_blocks must be in [1, num_blocks), got {h_blocks} with {problem.num_blocks} blocks")
    tiles = [t for t in _tiles(problem, segmentation)
             if (last or not t.is_last_segment) and (t.block < h_blocks or first_m or t.segment != 0)]
    return Schedule(tiles, (max(1, len(tiles)), 1, 1), False, segmentation, name)


def correction_schedule(problem: Problem, segmentation: Segmentation, first_too: bool, chunks_per_tile: int,
                        name: str = "segment-correction") -> Schedule:
    """The one-pass forward's correction launch: o += qm S_0 over every segment whose start state S_0 is not
    zero -- all but each sequence's first, which joins only with an initial state (`first_too`). One tile per
    (sequence, segment, head, run of up to `chunks_per_tile` chunks), each keeping its segment's `seg_slot`
    (where the merge leaves S_0); `block` 0 (a tile covers all V columns). Ordered by segment index first (then
    sequence, head, chunk): the merge publishes start states in that order, and an early correction's CTAs
    (`SegmentCorrectionSm90(early)`) start roughly in block order, so the first to start are the first served."""
    if chunks_per_tile < 1:
        raise ValueError(f"chunks_per_tile must be >= 1, got {chunks_per_tile}")
    C = problem.chunk_size
    tiles = []
    for t in _tiles(replace(problem, num_blocks=1), segmentation):
        if t.segment == 0 and not first_too:
            continue
        start = problem.seq_starts[t.seq]
        end = start + problem.seq_lens[t.seq]
        for c0 in range(t.chunk_start, t.chunk_end, chunks_per_tile):
            c1 = min(c0 + chunks_per_tile, t.chunk_end)
            tiles.append(replace(t, chunk_start=c0, chunk_end=c1, tok_start=min(start + c0 * C, end),
                                 tok_end=min(start + c1 * C, end)))
    tiles.sort(key=lambda t: t.segment)   # stable: (sequence, head, chunk) order within a segment index
    return Schedule(tiles, (max(1, len(tiles)), 1, 1), False, segmentation, name)


def lookback_schedule(problem: Problem, segmentation: Segmentation, first_m: bool, m_blocks: int,
                      name: str = "lookback") -> Schedule:
    """The single-launch segmented state pass's tile table, in ticket order (`TicketScheduler`).

    `problem.num_blocks` is the number of output blocks per (sequence, segment, head) (64 V columns each). First
    the summary tiles `summary_schedule` would launch (h_ext's blocks, then `m_blocks` of M's, pruned the same
    way), their `block` shifted by `problem.num_blocks` so a kernel tells them from output tiles (block >=
    num_blocks: summary block `block - num_blocks`); then the output tiles ordered (segment, sequence, head,
    block). Every tile a tile waits on (`lookback_dependencies`) comes earlier in this order.
    """
    nb = problem.num_blocks
    summ = summary_schedule(replace(problem, num_blocks=nb + m_blocks), segmentation, first_m, h_blocks=nb)
    tiles = [replace(t, block=t.block + nb) for t in summ.tiles]
    tiles += sorted(_tiles(problem, segmentation), key=lambda t: (t.segment, t.seq, t.head, t.block))
    return Schedule(tiles, (max(1, len(tiles)), 1, 1), False, segmentation, name)


def lookback_dependencies(schedule: Schedule, num_blocks: int, first_m: bool) -> list[list[int]]:
    """For each tile of a `lookback_schedule`, the indices of the tiles it waits on: an output tile of segment s
    that is not its sequence's last needs its own segment's summary (h_ext's block of its columns, and every M
    block unless s is the first segment without an initial state) to publish its end state; an output tile of
    segment s > 0 needs its predecessor's end state (the output tile of segment s - 1, same head and block).
    Summary tiles wait on nothing."""
    index = {(t.seq, t.segment, t.head, t.block): i for i, t in enumerate(schedule.tiles)}
    deps = []
    for t in schedule.tiles:
        d = []
        if t.block < num_blocks:
            if not t.is_last_segment:
                d.append(index[(t.seq, t.segment, t.head, num_blocks + t.block)])
                if t.segment > 0 or first_m:
                    d += [i for (n, s, h, b), i in index.items()
                          if (n, s, h) == (t.seq, t.segment, t.head) and b >= 2 * num_blocks]
            if t.segment > 0:
                d.append(index[(t.seq, t.segment - 1, t.head, t.block)])
        deps.append(sorted(d))
    return deps
