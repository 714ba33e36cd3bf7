"""Host half of the schedulers: turn a Problem into an ordered tile table and a grid.

Every scheduler produces a `Schedule`: the work tiles in the order CTAs take them (an int32 table, one row per tile,
columns `TILE_FIELDS`), the grid, and whether CTAs loop (persistent). The device half
(`schedulers.device.TileScheduler`) reads that table, whichever scheduler made it.
Order guarantee: within one (sequence, head, block), segments appear in increasing order.
"""

from __future__ import annotations

from dataclasses import dataclass, field

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


def sequence_table_on_device(cu_seqlens, num_heads: int, chunk_size: int = 64):
    """`SequenceScheduler`'s tile table (one tile per (sequence, head), whole sequence, block 0) built on the device
    from `cu_seqlens` ([N + 1] int32 / int64 tensor) with torch ops of static sizes: nothing is read on the host, so
    a CUDA graph that captured it replays with new lengths. [N x num_heads, NUM_TILE_FIELDS] int32."""
    import torch

    cu = cu_seqlens.to(torch.int32)
    n_seqs = cu.shape[0] - 1
    seq = torch.arange(n_seqs, dtype=torch.int32, device=cu.device).repeat_interleave(num_heads)
    head = torch.arange(num_heads, dtype=torch.int32, device=cu.device).repeat(n_seqs)
    start, end = cu[:-1].repeat_interleave(num_heads), cu[1:].repeat_interleave(num_heads)
    chunks = torch.div(end - start + chunk_size - 1, chunk_size, rounding_mode="floor")
    zero, one = torch.zeros_like(seq), torch.ones_like(seq)
    fields = {"seq": seq, "head": head, "block": zero, "segment": zero, "num_segments": one, "seg_slot": seq,
              "chunk_start": zero, "chunk_end": chunks, "tok_start": start, "tok_end": end}
    return torch.stack([fields[f] for f in TILE_FIELDS], dim=1).contiguous()


class SegmentScheduler:
    """Each (sequence, head, block) cut along T into segments on chunk boundaries; one CTA per segment.
    `num_segments=None` lets `plan_segments` decide per call (needs `sm_count`), or `plan_segments_by_cost` when a
    `cost` (a kernel's measured `SegmentCost`) is given; an int forces that many per sequence (fewer for sequences
    with fewer chunks; never an empty segment)."""

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
    """Grid = min(tiles, SMs x CTAs per SM); CTA i takes tiles i, i + grid, i + 2 grid, ... Tiles come from `inner`
    (default: whole sequences), ordered longest first (LPT) by their (sequence, head, block) group's longest
    segment, each group's segments together and in order."""

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
                     h_blocks: int = 1) -> Schedule:
    """The summary launch of a segmented forward: one CTA per summary tile that some start state needs.
    `problem.num_blocks` summary blocks per segment: blocks < `h_blocks` compute h_ext's columns, the others M's.
    A sequence's last segment gets no tile, its first only the h_ext blocks unless `first_m` (see
    `summary_blocks_of`). The tiles keep `_tiles`' order and their `seg_slot`s, so summaries land in the same slots."""
    if len(segmentation.bounds) != problem.num_seqs:
        raise ValueError(f"segmentation has {len(segmentation.bounds)} sequences, the problem {problem.num_seqs}")
    if not 1 <= h_blocks < problem.num_blocks:
        raise ValueError(f"h_blocks must be in [1, num_blocks), got {h_blocks} with {problem.num_blocks} blocks")
    tiles = [t for t in _tiles(problem, segmentation)
             if not t.is_last_segment and (t.block < h_blocks or first_m or t.segment != 0)]
    return Schedule(tiles, (max(1, len(tiles)), 1, 1), False, segmentation, name)
