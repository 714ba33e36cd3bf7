"""Split-KV plans for decode attention: which CTA reads which KV range of which (batch row, KV head).

A decode problem (`decode_problem`) has one "sequence" per (batch row, KV head) -- unit u = b * Hkv + h -- whose
length is an upper bound on that row's cache length (the caller's `max_seqlen` or the cache capacity): a plan
never reads `cache_seqlens`, so it stays valid in a CUDA graph replayed with other lengths; the kernel clips each
tile to the true length on the device. A chunk is one KV block. A tile is one split of a unit: a contiguous KV
block range; its partial (o, lse) goes to slot `seg_slot`, and unit u's splits are slots seg_offsets[u] ..
seg_offsets[u + 1] - 1 (the layout `lse_merge` reads).

- `SplitKVScheduler`: even splits per unit, counts from `plan_segments`' rules: one wave of at most one CTA per SM
  (`ctas_per_sm`), splits of at least `min_kv` tokens (one 64-token block), and a split count that divides the
  block count where one is within `divide_slack` (5%). With `long_split_kv` set, a plan that fills every CTA slot
  of the kernel's occupancy is taken instead where it gives more CTAs and each split still keeps that many tokens
  (a card whose bandwidth needs more bytes in flight than one CTA per SM holds).
- `StreamKScheduler`: persistent CTAs, each an equal contiguous range of the flattened (unit, KV block) space, so
  a split may end anywhere inside a unit. CTA c's pieces are rows c, c + G, c + 2G, ... of the table (padded with
  `seg_slot = -1` tiles that do nothing), so the one device scheduler hands them out in persistent mode.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from .heuristics import plan_segments
from .host import Schedule, schedule_from_segmentation
from .problem import Problem, Segmentation, WorkTile, ceil_div

MIN_KV = 256            # stream-K: fewest KV tokens a CTA reads (its loads must hide their latency)
# split-KV's default plan: one wave of one CTA per SM, splits down to one block. Measured on the H100 against the
# occupancy's two CTAs per SM with 256-token splits (docs/design.md, "Units and the plan"): 1.0-1.3x at B <= 8.
SPLIT_MIN_KV = 64
SPLIT_CTAS_PER_SM = 1
DIVIDE_SLACK = 0.05     # give up this much of the planned split count for splits that divide evenly


def decode_problem(kv_lens: Sequence[int], num_kv_heads: int, block_kv: int = 64) -> Problem:
    """Units (batch row b, KV head h) -> u = b * num_kv_heads + h, each `kv_lens[b]` tokens (an upper bound) in
    blocks of `block_kv`; `seq_starts` are cache positions of a contiguous [B, Tmax] cache (row b at b * Tmax)."""
    lens = [int(n) for n in kv_lens]
    if num_kv_heads < 1:
        raise ValueError(f"num_kv_heads must be >= 1, got {num_kv_heads}")
    if not lens or min(lens) < 0:
        raise ValueError(f"kv_lens must be non-empty and >= 0, got {lens[:8]}")
    t_max = max(lens)
    return Problem(seq_lens=tuple(n for n in lens for _ in range(num_kv_heads)),
                   seq_starts=tuple(b * t_max for b, _ in enumerate(lens) for _ in range(num_kv_heads)),
                   num_heads=1, chunk_size=block_kv)


@dataclass
class DecodePlan:
    """How a decode problem's KV is split, and why (`explain()`)."""

    scheduler: str
    units: int
    blocks_per_unit: list[int]
    ctas: int
    splits: list[int]            # per unit
    uniform: bool                # every unit split the same number of ways, every split the same length
    reasons: list[str] = field(default_factory=list)

    def explain(self) -> str:
        total = sum(self.blocks_per_unit)
        lens = sorted(set(self.splits))
        split_txt = f"{lens[0]}" if len(lens) == 1 else f"{lens[0]}..{lens[-1]}"
        lines = [f"{self.scheduler}: {self.units} units (batch rows x KV heads), {total} KV blocks; {self.ctas} CTAs; "
                 f"splits per unit {split_txt}" + (" (uniform)" if self.uniform else "")]
        return "\n".join(lines + [f"- {r}" for r in self.reasons])

    def __str__(self) -> str:
        return self.explain()


class SplitKVScheduler:
    """Even splits per unit (one CTA per split). `num_splits` forces a count (capped by the unit's blocks);
    None plans it (`plan_segments`): `waves` waves of `ctas_per_sm` CTAs per SM (None: as many as the kernel's
    occupancy allows), never below `min_kv` tokens per split. `long_split_kv` (None: off): plan the kernel's
    whole occupancy instead wherever that gives more CTAs whose splits each keep at least that many tokens: more
    bytes in flight per SM, for long caches on a card whose bandwidth one CTA per SM does not cover.

    More than one wave is for ragged batches: the plan knows the rows only by their bound, so with one wave a
    long row's splits set the time while short rows' CTAs sit idle once done; with several, an SM that finishes
    (an empty or short split) takes the next tile, and the long rows' splits spread over the machine."""

    name = "split-kv"

    def __init__(self, num_splits: int | None = None, min_kv: int = SPLIT_MIN_KV,
                 ctas_per_sm: int | None = SPLIT_CTAS_PER_SM, divide_slack: float = DIVIDE_SLACK,
                 waves: int = 1, long_split_kv: int | None = None):
        if num_splits is not None and num_splits < 1:
            raise ValueError(f"num_splits must be >= 1, got {num_splits}")
        if long_split_kv is not None and long_split_kv < 1:
            raise ValueError(f"long_split_kv must be >= 1 or None, got {long_split_kv}")
        self.long_split_kv = long_split_kv
        if waves < 1:
            raise ValueError(f"waves must be >= 1, got {waves}")
        self.waves = waves
        if min_kv < 1:
            raise ValueError(f"min_kv must be >= 1, got {min_kv}")
        if ctas_per_sm is not None and ctas_per_sm < 1:
            raise ValueError(f"ctas_per_sm must be >= 1 or None, got {ctas_per_sm}")
        self.num_splits, self.min_kv, self.ctas_per_sm, self.divide_slack = num_splits, min_kv, ctas_per_sm, divide_slack

    def __repr__(self) -> str:
        return (f"SplitKVScheduler(num_splits={self.num_splits}, min_kv={self.min_kv}, ctas_per_sm={self.ctas_per_sm}, "
                f"divide_slack={self.divide_slack}, waves={self.waves}, long_split_kv={self.long_split_kv})")

    def schedule(self, problem: Problem, sm_count: int | None = None, ctas_per_sm: int = 2) -> Schedule:
        chunks = list(problem.chunks)
        if self.num_splits is not None:
            seg = Segmentation([_even(c, self.num_splits) for c in chunks])
            reasons = [f"num_splits={self.num_splits} forced (capped at each unit's block count)"]
        else:
            if sm_count is None:
                raise ValueError("SplitKVScheduler(num_splits=None) needs sm_count to plan the split")
            min_chunks = ceil_div(self.min_kv, problem.chunk_size)
            fill = min(self.ctas_per_sm, ctas_per_sm) if self.ctas_per_sm else ctas_per_sm
            p = plan_segments(problem, sm_count * self.waves, fill, min_chunks, divide_slack=self.divide_slack)
            reasons = p.reasons + [f"min_kv {self.min_kv} tokens = {min_chunks} blocks of {problem.chunk_size}"]
            if self.long_split_kv is not None and fill < ctas_per_sm:
                long_chunks = max(min_chunks, ceil_div(self.long_split_kv, problem.chunk_size))
                deep = plan_segments(problem, sm_count * self.waves, ctas_per_sm, long_chunks,
                                     divide_slack=self.divide_slack)
                if sum(deep.segments) > sum(p.segments):
                    p, fill = deep, ctas_per_sm
                    reasons = deep.reasons + [f"long_split_kv {self.long_split_kv} tokens: every split keeps >= "
                                              f"{long_chunks} blocks of {problem.chunk_size} at the full occupancy"]
            seg = Segmentation([_even(c, n) for c, n in zip(chunks, p.segments)])
            reasons.append(f"{fill} CTA(s) per SM planned, of the kernel's {ctas_per_sm}")
            if self.waves > 1:
                reasons.append(f"{self.waves} waves (the fill counts each SM {self.waves} times)")
        schedule = schedule_from_segmentation(problem, seg, self.name)
        splits = [len(b) - 1 for b in seg.bounds]
        lengths = {b[i + 1] - b[i] for b in seg.bounds for i in range(len(b) - 1)}
        schedule.plan = DecodePlan(self.name, problem.num_seqs, chunks, schedule.num_tiles, splits,
                                   len(set(splits)) == 1 and len(lengths) == 1, reasons)
        return schedule


class StreamKScheduler:
    """Persistent CTAs over the flattened (unit, KV block) space, each an equal contiguous range.

    CTAs: min(SMs x CTAs per SM, total blocks / min_kv blocks); rounded down to a multiple of the unit count
    where that gives up at most `divide_slack` of them and every unit has the same length -- then every unit is
    split the same number of ways at the same points and the fixup is uniform."""

    name = "stream-k"

    def __init__(self, min_kv: int = MIN_KV, divide_slack: float = DIVIDE_SLACK, ctas: int | None = None):
        if min_kv < 1:
            raise ValueError(f"min_kv must be >= 1, got {min_kv}")
        if ctas is not None and ctas < 1:
            raise ValueError(f"ctas must be >= 1, got {ctas}")
        self.min_kv, self.divide_slack, self.ctas = min_kv, divide_slack, ctas

    def __repr__(self) -> str:
        return f"StreamKScheduler(min_kv={self.min_kv}, divide_slack={self.divide_slack}, ctas={self.ctas})"

    def schedule(self, problem: Problem, sm_count: int | None = None, ctas_per_sm: int = 2) -> Schedule:
        chunks = list(problem.chunks)
        units = problem.num_seqs
        total = sum(chunks)
        min_chunks = ceil_div(self.min_kv, problem.chunk_size)
        reasons = []
        if self.ctas is not None:
            ctas = self.ctas
            reasons.append(f"ctas={ctas} forced")
        else:
            if sm_count is None:
                raise ValueError("StreamKScheduler(ctas=None) needs sm_count")
            slots = sm_count * ctas_per_sm
            ctas = max(1, min(slots, total // min_chunks))
            reasons.append(f"min({slots} CTA slots = {sm_count} SMs x {ctas_per_sm}, {total} blocks / min_kv "
                           f"{min_chunks} blocks) = {ctas} CTAs")
            multiple = (ctas // units) * units
            if problem.is_uniform and multiple >= units and multiple >= (1 - self.divide_slack) * ctas:
                if multiple != ctas:
                    reasons.append(f"{multiple} CTAs: a multiple of the {units} units, so the splits are uniform")
                ctas = multiple
        ctas = max(1, min(ctas, max(total, 1)))
        bounds, pieces = _stream_k_pieces(chunks, ctas)
        seg = Segmentation(bounds)
        per_cta = max((len(p) for p in pieces), default=1)
        C = problem.chunk_size
        table: list[WorkTile] = []
        for k in range(per_cta):
            for c in range(ctas):
                if k < len(pieces[c]):
                    u, s = pieces[c][k]
                    c0, c1 = bounds[u][s], bounds[u][s + 1]
                    start, length = problem.seq_starts[u], problem.seq_lens[u]
                    table.append(WorkTile(u, 0, 0, s, len(bounds[u]) - 1, seg.seg_offsets[u] + s, c0, c1,
                                          start + min(c0 * C, length), start + min(c1 * C, length)))
                else:
                    table.append(WorkTile(0, 0, 0, -1, 0, -1, 0, 0, 0, 0))   # padding: nothing to do
        while table and table[-1].seg_slot == -1:
            table.pop()
        splits = [len(b) - 1 for b in bounds]
        lengths = {b[i + 1] - b[i] for b in bounds for i in range(len(b) - 1)}
        if per_cta > 1:
            reasons.append(f"up to {per_cta} pieces per CTA (a range crossing unit boundaries)")
        plan = DecodePlan(self.name, units, chunks, ctas, splits, len(set(splits)) == 1 and len(lengths) == 1,
                          reasons)
        return Schedule(table, (ctas, 1, 1), True, seg, self.name, plan)


def even_split_fields(index, splits, blocks):
    """Tile `index` of an even split plan (every unit `blocks` KV blocks cut `splits` ways, tiles in (unit,
    split) order): (unit, split, first block, end block). Plain arithmetic, so the device scheduler runs the same
    function on Int32 values (`schedulers.device.EvenSplitScheduler`) and the host tests check it against the
    table `SplitKVScheduler` writes."""
    unit = index // splits
    split = index - unit * splits
    return unit, split, (split * blocks) // splits, ((split + 1) * blocks) // splits


def even_split_shape(schedule: Schedule) -> tuple[int, int] | None:
    """(splits, blocks per unit) when the schedule's table is `even_split_fields` of its row index (one CTA per
    tile, every unit the same block count and split count); else None (stream-K, or units of several lengths)."""
    plan = getattr(schedule, "plan", None)
    if schedule.persistent or not isinstance(plan, DecodePlan) or not plan.splits:
        return None
    if len(set(plan.splits)) != 1 or len(set(plan.blocks_per_unit)) != 1:
        return None
    splits, blocks = plan.splits[0], plan.blocks_per_unit[0]
    for i, t in enumerate(schedule.tiles):
        if (t.seq, t.segment, t.chunk_start, t.chunk_end) != even_split_fields(i, splits, blocks) or \
                t.seg_slot != i or t.num_segments != splits:
            return None
    return splits, blocks


def _even(num_chunks: int, num_splits: int) -> list[int]:
    """Bounds of near-equal splits (a unit with no blocks keeps one empty split: o = 0, lse = -inf)."""
    if num_chunks <= 0:
        return [0, 0]
    n = max(1, min(num_splits, num_chunks))
    return [(i * num_chunks) // n for i in range(n + 1)]


def _stream_k_pieces(chunks: list[int], ctas: int) -> tuple[list[list[int]], list[list[tuple[int, int]]]]:
    """Cut the flattened blocks into `ctas` equal contiguous ranges. Returns each unit's split bounds and each
    CTA's pieces as (unit, split index) in order. Units with no blocks get one empty split, taken by the CTA
    whose range reaches their position."""
    total = sum(chunks)
    cuts = [(c * total) // ctas for c in range(ctas + 1)]
    bounds: list[list[int]] = []
    pieces: list[list[tuple[int, int]]] = [[] for _ in range(ctas)]
    offset = 0
    cta = 0
    for u, n in enumerate(chunks):
        if n == 0:
            while cta < ctas - 1 and cuts[cta + 1] <= offset:
                cta += 1
            bounds.append([0, 0])
            pieces[cta].append((u, 0))
            continue
        b = [0]
        pos = offset
        while pos < offset + n:
            while cuts[cta + 1] <= pos:
                cta += 1
            end = min(cuts[cta + 1], offset + n)
            pieces[cta].append((u, len(b) - 1))
            b.append(end - offset)
            pos = end
        bounds.append(b)
        offset += n
    return bounds, pieces
