"""How many segments to cut each (sequence, head) into: `plan_segments`.

The rules, in order (see the README's table):
1. Tiles already fill the GPU (sequences x heads x blocks >= SMs x CTAs per SM): no split, N = 1.
2. Aim for `target = SMs x min(CTAs per SM, 2)` CTAs in one wave (2 CTAs per SM hide each other's latencies).
3. Never cut a segment below `min_chunks` chunks: a sequence shorter than 2 x min_chunks stays whole.
4. If occupancy allows more than 2 CTAs per SM, add segments up to that wave only while each keeps `min_chunks`.
5. Fixed-length batches: prefer a segment count within `divide_slack` (default 15%) below the first choice
   that divides the chunk count (uniform segments). Varlen batches: hand out segments one at a time to the
   sequence whose segments are currently the longest.
All decisions fit in a single wave, so the tile count never spills a near-empty extra wave.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

from .problem import Problem, Segmentation, ceil_div, split_even


@dataclass
class SegmentPlan:
    """The decision of `plan_segments`, with the numbers behind it (`explain()` prints them)."""

    segments: list[int]            # segments per sequence
    segmentation: Segmentation
    base_tiles: int                # sequences x heads x blocks
    sm_count: int
    ctas_per_sm: int
    target_ctas: int
    min_chunks: int
    reasons: list[str] = field(default_factory=list)

    @property
    def total_tiles(self) -> int:
        return self.segmentation.total_segments * (self.base_tiles // max(1, len(self.segments)))

    @property
    def uniform(self) -> bool:
        lengths = {b[i + 1] - b[i] for b in self.segmentation.bounds for i in range(len(b) - 1)}
        return len(lengths) <= 1

    @property
    def max_segments(self) -> int:
        return max(self.segments) if self.segments else 1

    def explain(self) -> str:
        chunks = [b[-1] for b in self.segmentation.bounds]
        seg_len = [
            (b[i + 1] - b[i]) for b in self.segmentation.bounds for i in range(len(b) - 1)
        ]
        capacity = self.sm_count * self.ctas_per_sm
        lines = [
            f"base tiles {self.base_tiles} (sequences x heads x blocks); GPU holds {capacity} CTAs "
            f"({self.sm_count} SMs x {self.ctas_per_sm}); target {self.target_ctas}",
            f"segments per sequence: {_summarize(self.segments)}; chunks per sequence: {_summarize(chunks)}",
            f"tiles {self.total_tiles} ({self.total_tiles / capacity:.2f} of one wave); chunks per segment "
            f"{min(seg_len) if seg_len else 0}..{max(seg_len) if seg_len else 0}"
            f"{' (uniform)' if self.uniform else ''}; min_chunks {self.min_chunks}",
        ]
        lines += [f"- {r}" for r in self.reasons]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.explain()


def _summarize(xs: list[int]) -> str:
    if not xs:
        return "-"
    if len(set(xs)) == 1:
        return f"{xs[0]} (all {len(xs)})"
    if len(xs) <= 8:
        return str(list(xs))
    return f"{min(xs)}..{max(xs)} over {len(xs)}"


def plan_segments(problem: Problem, sm_count: int, ctas_per_sm: int = 2, min_chunks: int = 4,
                  max_segments: int | None = None, divide_slack: float = 0.15) -> SegmentPlan:
    """Pick the segment count of every sequence of `problem` (rules: the module docstring). `sm_count` and
    `ctas_per_sm` are plain numbers, never read from a GPU here."""
    if sm_count < 1 or ctas_per_sm < 1:
        raise ValueError(f"sm_count and ctas_per_sm must be >= 1, got {sm_count}, {ctas_per_sm}")
    if min_chunks < 1:
        raise ValueError(f"min_chunks must be >= 1, got {min_chunks}")
    chunks = list(problem.chunks)
    per_seq_tiles = problem.num_heads * problem.num_blocks
    base_tiles = problem.num_seqs * per_seq_tiles
    capacity = sm_count * ctas_per_sm
    target = sm_count * min(ctas_per_sm, 2)
    reasons: list[str] = []

    def cap(c: int) -> int:  # most segments a sequence of c chunks may take
        n = max(1, c // min_chunks)
        return min(n, max_segments) if max_segments else n

    def done(segments: list[int]) -> SegmentPlan:
        seg = Segmentation([split_even(c, s) for c, s in zip(chunks, segments)])
        return SegmentPlan(segments, seg, base_tiles, sm_count, ctas_per_sm, target, min_chunks, reasons)

    ones = [1] * problem.num_seqs
    if base_tiles >= capacity:
        reasons.append(f"N = 1: {base_tiles} base tiles already fill the {capacity} CTA slots")
        return done(ones)
    if max(chunks, default=0) < 2 * min_chunks:
        reasons.append(f"N = 1: the longest sequence has {max(chunks, default=0)} chunks, under 2 x min_chunks")
        return done(ones)

    budget = target // per_seq_tiles  # segments summed over sequences, for one wave of `target` CTAs
    why = f"{target} CTAs = {sm_count} SMs x {min(ctas_per_sm, 2)}"
    if ctas_per_sm > 2:
        wider = capacity // per_seq_tiles
        if all(c // ceil_div(wider, problem.num_seqs) >= min_chunks for c in chunks if c):
            budget = wider
            why = f"{capacity} CTAs (occupancy {ctas_per_sm}/SM, segments keep >= {min_chunks} chunks)"
    budget = max(budget, problem.num_seqs)

    if problem.is_uniform:
        c = chunks[0]
        n = max(1, budget // problem.num_seqs)
        reasons.append(f"fill {why}: {n} segments per sequence")
        if n > cap(c):
            reasons.append(f"capped at {cap(c)}: {c} chunks / min_chunks {min_chunks}")
            n = cap(c)
        for m in range(n, max(1, int(n * (1 - divide_slack) + 0.999)) - 1, -1):
            if c % m == 0:
                if m != n:
                    reasons.append(f"{m} divides {c} chunks: uniform segments, {n - m} fewer")
                n = m
                break
        return done([n] * problem.num_seqs)

    # Varlen: longest-segment-first water filling.
    segments = list(ones)
    heap = [(-c, n) for n, c in enumerate(chunks) if cap(c) > 1]
    heapq.heapify(heap)
    left = budget - problem.num_seqs
    while left > 0 and heap:
        _, n = heapq.heappop(heap)
        segments[n] += 1
        left -= 1
        if segments[n] < cap(chunks[n]):
            heapq.heappush(heap, (-ceil_div(chunks[n], segments[n]), n))
    reasons.append(
        f"fill {why}: {sum(segments)} segments over {problem.num_seqs} sequences, each new one to the sequence "
        f"with the longest segments; sequences under {2 * min_chunks} chunks stay whole"
    )
    return done(segments)


@dataclass(frozen=True)
class SegmentCost:
    """A kernel's measured costs, for `plan_segments_by_cost` (numbers from a GPU, passed in; never read here).

    chunk_us: one CTA's time per chunk (its tile takes chunks x chunk_us, one tile per CTA slot at a time).
    link_us: the merge's time per segment along one sequence (the serial chain of the affine merge).
    summary_blocks: tiles per segment in the summary launch (2 for the linear-attention path: h_ext and M).
    launch_us: the fixed cost of each extra launch of the segmented path (summary, merge).
    first_m: whether the first segment of a sequence needs its whole summary (an initial state is given); else
      only h_ext (one tile). A sequence's last segment never needs a summary (see `summary_blocks_of`).
    """

    chunk_us: float
    link_us: float
    summary_blocks: int = 2
    launch_us: float = 4.0
    first_m: bool = False


def summary_blocks_of(segment: int, num_segments: int, summary_blocks: int, first_m: bool) -> int:
    """Summary tiles a segment needs: none for a sequence's last segment (the output launch computes its end),
    `summary_blocks` for the others, one fewer (h_ext only) for the first when its start is zero (`first_m=False`)."""
    if segment == num_segments - 1:
        return 0
    if segment == 0 and not first_m:
        return summary_blocks - 1
    return summary_blocks


def makespan(lengths: list[int], slots: int) -> int:
    """Chunks until the last of `lengths` (chunk counts, in launch order) ends on `slots` CTA slots (greedy)."""
    if len(lengths) <= slots:
        return max(lengths, default=0)
    loads = [0] * slots
    for n in lengths:
        heapq.heapreplace(loads, loads[0] + n)
    return max(loads)


def segmented_cost_us(problem: Problem, segmentation: Segmentation, cost: SegmentCost, slots: int) -> float:
    """Predicted GPU time of the forward with `segmentation` (one launch if unsplit, else summary + merge +
    outputs), in microseconds, from `cost` and `slots` CTA slots."""
    per_seq = problem.num_heads * problem.num_blocks
    seg_lens = [[b[i + 1] - b[i] for i in range(len(b) - 1)] for b in segmentation.bounds]
    outputs = [n for lens in seg_lens for n in lens for _ in range(per_seq)]
    t = makespan(outputs, slots) * cost.chunk_us
    if all(len(lens) <= 1 for lens in seg_lens):
        return t
    summary = [n for lens in seg_lens for s, n in enumerate(lens)
               for _ in range(per_seq * summary_blocks_of(s, len(lens), cost.summary_blocks, cost.first_m))]
    t += makespan(summary, slots) * cost.chunk_us
    t += (max(len(lens) for lens in seg_lens) - 1) * cost.link_us + 2 * cost.launch_us   # N - 1 links
    return t


def segmented_cost_lower_bound(problem: Problem, n: int, cost: SegmentCost, slots: int) -> float:
    """A lower bound of `segmented_cost_us` with `n` segments per (fixed-length) sequence: all tiles' chunks spread
    evenly over the slots, the N - 1 links and two launches. It never decreases as n grows, so a search may stop
    once it passes the best time."""
    c = problem.chunks[0]
    b = split_even(c, n)
    lens = [b[i + 1] - b[i] for i in range(len(b) - 1)]
    per_seq = problem.num_heads * problem.num_blocks
    summary = sum(x * summary_blocks_of(s, len(lens), cost.summary_blocks, cost.first_m) for s, x in enumerate(lens))
    work = (c + summary) * per_seq * problem.num_seqs
    return work * cost.chunk_us / slots + (len(lens) - 1) * cost.link_us + 2 * cost.launch_us


def plan_segments_by_cost(problem: Problem, sm_count: int, cost: SegmentCost, ctas_per_sm: int = 1, min_chunks: int = 2,
                          max_segments: int | None = None) -> SegmentPlan:
    """Pick segment counts that minimize `segmented_cost_us` (the unsplit launch included as a candidate).
    Fixed-length batches try every N from 1 to the cap (chunks / min_chunks); varlen batches add segments one at a
    time to the sequence with the longest segments and keep the cheapest point on that path."""
    if sm_count < 1 or ctas_per_sm < 1 or min_chunks < 1:
        raise ValueError("sm_count, ctas_per_sm and min_chunks must be >= 1")
    chunks = list(problem.chunks)
    slots = sm_count * ctas_per_sm
    base_tiles = problem.num_seqs * problem.num_heads * problem.num_blocks

    def cap(c: int) -> int:
        n = max(1, c // min_chunks)
        return min(n, max_segments) if max_segments else n

    def seg_of(segments: list[int]) -> Segmentation:
        return Segmentation([split_even(c, s) for c, s in zip(chunks, segments)])

    ones = [1] * problem.num_seqs
    best = ones
    best_t = base_t = segmented_cost_us(problem, seg_of(ones), cost, slots)
    if problem.is_uniform and chunks:
        for n in range(2, cap(chunks[0]) + 1):
            # a lower bound of this N's time that never shrinks as N grows: stop once it passes the best
            if segmented_cost_lower_bound(problem, n, cost, slots) >= best_t * 0.999:
                break
            t = segmented_cost_us(problem, seg_of([n] * problem.num_seqs), cost, slots)
            if t < best_t * 0.999:  # ties go to fewer segments
                best, best_t = [n] * problem.num_seqs, t
    else:
        segments = list(ones)
        heap = [(-c, n) for n, c in enumerate(chunks) if cap(c) > 1]
        heapq.heapify(heap)
        while heap:
            _, n = heapq.heappop(heap)
            segments[n] += 1
            t = segmented_cost_us(problem, seg_of(segments), cost, slots)
            if t < best_t * 0.999:
                best, best_t = list(segments), t
            if segments[n] < cap(chunks[n]):
                heapq.heappush(heap, (-ceil_div(chunks[n], segments[n]), n))
    reasons = [
        f"cost model: {cost.chunk_us:g} us per chunk per CTA, {cost.link_us:g} us per merge link, "
        f"{slots} CTA slots",
        f"predicted: unsplit {base_t:.0f} us; chosen (max {max(best)} segments) {best_t:.0f} us",
    ]
    return SegmentPlan(best, seg_of(best), base_tiles, sm_count, ctas_per_sm, slots, min_chunks, reasons)
