"""How many segments to cut each (sequence, head) into: `plan_segments`.

The rules, in order (see the README's table):
1. Tiles already fill the GPU (sequences x heads x blocks >= SMs x CTAs per SM): no split, N = 1.
2. Aim for `target = SMs x min(CTAs per SM, 2)` CTAs in one wave: at least 2 CTAs per SM where the
   kernel's occupancy allows (they hide each other's barriers and latencies), 1 where only one fits.
3. Never cut a segment below `min_chunks` chunks (default 4 chunks = 256 tokens): a sequence shorter
   than 2 x min_chunks stays whole.
4. If occupancy allows more than 2 CTAs per SM, add segments up to that wave only while each segment
   keeps `min_chunks`.
5. Fixed-length batches: prefer a segment count within 15% below the first choice that divides the chunk
   count (every segment the same length, so the merge is uniform).
   Varlen batches: hand out segments one at a time to the sequence whose segments are currently the
   longest (balanced, longest-first), so every segment has about the same number of chunks.
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


def plan_segments(
    problem: Problem,
    sm_count: int,
    ctas_per_sm: int = 2,
    min_chunks: int = 4,
    max_segments: int | None = None,
) -> SegmentPlan:
    """Pick the segment count of every sequence of `problem` (see the module docstring for the rules).

    `sm_count` and `ctas_per_sm` are plain numbers (from the device at run time, and from the kernel's
    occupancy), never read from a GPU here.
    """
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
        for m in range(n, max(1, int(n * 0.85 + 0.999)) - 1, -1):
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
