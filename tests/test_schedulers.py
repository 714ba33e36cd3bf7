"""Host-side scheduler tests (CPU): coverage, order, heuristic rules."""

import pytest
from hypothesis import given, settings, strategies as st

from schedulers import (
    PersistentScheduler,
    Problem,
    SegmentScheduler,
    Segmentation,
    SequenceScheduler,
    plan_segments,
    split_even,
)

SCHEDULERS = [
    lambda: SequenceScheduler(),
    lambda: SegmentScheduler(),
    lambda: SegmentScheduler(num_segments=3),
    lambda: SegmentScheduler(num_segments=7, min_chunks=1),
    lambda: PersistentScheduler(),
    lambda: PersistentScheduler(SegmentScheduler()),
    lambda: PersistentScheduler(SegmentScheduler(num_segments=5)),
]


def check_coverage(problem, schedule):
    """Every chunk of every (sequence, head, block) covered exactly once, segments in order, tokens right."""
    C = problem.chunk_size
    seen = {}
    for cta_tiles in schedule.cta_work():
        for t in cta_tiles:
            seen.setdefault((t.seq, t.head, t.block), []).append(t)
    # The concatenation of all CTAs' lists is the whole table, once.
    assert sum(len(x) for x in schedule.cta_work()) == schedule.num_tiles
    for n in range(problem.num_seqs):
        nc = problem.num_chunks(n)
        for h in range(problem.num_heads):
            for b in range(problem.num_blocks):
                tiles = sorted(seen.pop((n, h, b)), key=lambda t: t.segment)
                assert [t.segment for t in tiles] == list(range(len(tiles)))
                assert all(t.num_segments == len(tiles) for t in tiles)
                assert tiles[0].chunk_start == 0 and tiles[-1].chunk_end == nc
                for a, z in zip(tiles, tiles[1:]):
                    assert a.chunk_end == z.chunk_start
                for t in tiles:
                    assert t.chunk_end > t.chunk_start or nc == 0
                    assert t.tok_start == problem.seq_starts[n] + t.chunk_start * C
                    assert t.tok_end == problem.seq_starts[n] + min(t.chunk_end * C, problem.seq_lens[n])
                    assert t.seg_slot == schedule.seg_offsets[n] + t.segment
    assert not seen, f"tiles for unknown work: {list(seen)[:3]}"
    # Within each (seq, head, block), table order keeps segments increasing (look-back relies on it).
    last = {}
    for t in schedule.tiles:
        key = (t.seq, t.head, t.block)
        assert last.get(key, -1) == t.segment - 1
        last[key] = t.segment


lengths = st.lists(st.sampled_from([0, 1, 63, 64, 65, 200, 1000, 5000]) | st.integers(0, 3000), min_size=1, max_size=6)


@settings(max_examples=60, deadline=None)
@given(lengths, st.integers(1, 5), st.integers(1, 2), st.sampled_from(range(len(SCHEDULERS))), st.sampled_from([16, 64]))
def test_varlen_coverage(lens, heads, blocks, which, chunk):
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    problem = Problem.varlen(cu, heads, chunk_size=chunk, num_blocks=blocks)
    check_coverage(problem, SCHEDULERS[which]().schedule(problem, sm_count=132, ctas_per_sm=2))


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 8), st.sampled_from([1, 63, 64, 65, 300, 4096, 16384]), st.integers(1, 16),
       st.sampled_from(range(len(SCHEDULERS))))
def test_fixed_coverage(B, T, H, which):
    problem = Problem.fixed(B, T, H)
    check_coverage(problem, SCHEDULERS[which]().schedule(problem, sm_count=132, ctas_per_sm=2))


def test_one_long_among_short():
    cu = [0, 1, 64, 129, 129 + 65, 129 + 65 + 100000]
    problem = Problem.varlen(cu, 4)
    sched = SegmentScheduler().schedule(problem, sm_count=132, ctas_per_sm=2)
    check_coverage(problem, sched)
    # The long sequence takes (almost) all segments; the short ones stay whole.
    assert sched.plan.segments[:4] == [1, 1, 1, 1]
    assert sched.plan.segments[4] > 30


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 20000), min_size=1, max_size=8), st.integers(1, 64), st.integers(1, 200),
       st.integers(1, 4), st.integers(1, 8), st.booleans())
def test_heuristic_rules(lens, heads, sms, occ, min_chunks, fixed):
    if fixed:
        problem = Problem.fixed(len(lens), lens[0], heads)
    else:
        cu = [0]
        for n in lens:
            cu.append(cu[-1] + n)
        problem = Problem.varlen(cu, heads)
    plan = plan_segments(problem, sm_count=sms, ctas_per_sm=occ, min_chunks=min_chunks)
    chunks = problem.chunks
    # Never a segment below min_chunks unless the sequence is whole.
    for b, n in zip(plan.segmentation.bounds, plan.segments):
        if n > 1:
            assert min(y - x for x, y in zip(b, b[1:])) >= min_chunks
    # No split when base tiles already fill the GPU.
    if problem.num_seqs * heads >= sms * occ:
        assert plan.segments == [1] * problem.num_seqs
    # Never more CTAs than one wave (unless the base tiles alone exceed it).
    assert plan.total_tiles <= max(sms * occ, problem.num_seqs * heads)
    assert len(plan.segments) == len(chunks)
    assert plan.explain()


def test_heuristic_seed_cases():
    p = plan_segments(Problem.fixed(1, 8192, 4), 132, 2)
    assert p.segments == [32] and p.uniform  # 128 chunks / min 4 chunks caps it
    p = plan_segments(Problem.fixed(8, 1024, 16), 132, 2)
    assert p.segments == [2] * 8 and p.uniform
    p = plan_segments(Problem.fixed(32, 4096, 64), 132, 2)
    assert p.segments == [1] * 32 and "fill" in p.explain()
    # One CTA per SM: target is the SM count.
    p = plan_segments(Problem.fixed(1, 16384, 4), 132, 1)
    assert p.segments == [32] and p.total_tiles <= 132
    # Uniform preference: 3 x 5 heads at 128 chunks picks 16 (divides 128) instead of 17.
    p = plan_segments(Problem.fixed(3, 8192, 5), 132, 2)
    assert p.segments == [16] * 3 and p.uniform
    # min_chunks is a parameter.
    p = plan_segments(Problem.fixed(1, 8192, 4), 132, 2, min_chunks=2)
    assert p.segments == [64]


def test_persistent_grid_and_lpt():
    problem = Problem.varlen([0, 100, 5000, 5100, 20000], 8)
    sched = PersistentScheduler().schedule(problem, sm_count=4, ctas_per_sm=2)
    assert sched.grid == (8, 1, 1) and sched.persistent
    lens = [t.tok_end - t.tok_start for t in sched.tiles]
    assert lens == sorted(lens, reverse=True)
    check_coverage(problem, sched)


def test_split_even():
    assert split_even(10, 3) == [0, 4, 7, 10]
    assert split_even(2, 5) == [0, 1, 2]
    assert split_even(0, 4) == [0, 0]
    assert split_even(128, 32) == list(range(0, 129, 4))


def test_bad_input():
    with pytest.raises(ValueError, match="cu_seqlens"):
        Problem.varlen([1, 5], 2)
    with pytest.raises(ValueError, match="cu_seqlens"):
        Problem.varlen([0, 5, 3], 2)
    with pytest.raises(ValueError, match="num_heads"):
        Problem.fixed(1, 10, 0)
    with pytest.raises(ValueError, match="sm_count"):
        SegmentScheduler().schedule(Problem.fixed(1, 10, 1))
    with pytest.raises(ValueError, match="num_segments"):
        SegmentScheduler(num_segments=0)


def test_table_layout():
    problem = Problem.fixed(2, 300, 3)
    sched = SegmentScheduler(num_segments=2).schedule(problem)
    table = sched.table()
    assert table.shape == (sched.num_tiles, 10) and str(table.dtype) == "torch.int32"
    assert table[0].tolist() == list(sched.tiles[0].as_row())


# ----------------------------------------------------------------------------- cost-model planning

def test_segmented_cost_by_hand():
    from schedulers import SegmentCost, segmented_cost_us

    cost = SegmentCost(chunk_us=9.5, link_us=2.0, summary_blocks=2, launch_us=4.0)
    p = Problem.fixed(1, 16 * 64, 4)
    # Unsplit: 4 tiles of 16 chunks.
    assert segmented_cost_us(p, Segmentation([split_even(16, 1)]), cost, 132) == 16 * 9.5
    # 4 segments: outputs 16 tiles x 4 chunks, summaries (h of segment 0, h and M of segments 1 and 2, none of
    # segment 3) 4 x 5 tiles x 4 chunks (one wave each), 3 links, 2 launches.
    assert segmented_cost_us(p, Segmentation([split_even(16, 4)]), cost, 132) == 4 * 9.5 * 2 + 3 * 2.0 + 8.0
    # On 16 slots the 20 summary tiles take two waves; with an initial state (first_m) 24 tiles, still two.
    assert segmented_cost_us(p, Segmentation([split_even(16, 4)]), cost, 16) == 4 * 9.5 * 3 + 3 * 2.0 + 8.0
    cost_m = SegmentCost(chunk_us=9.5, link_us=2.0, summary_blocks=2, launch_us=4.0, first_m=True)
    assert segmented_cost_us(p, Segmentation([split_even(16, 4)]), cost_m, 20) == 4 * 9.5 * 3 + 3 * 2.0 + 8.0
    assert segmented_cost_us(p, Segmentation([split_even(16, 4)]), cost, 20) == 4 * 9.5 * 2 + 3 * 2.0 + 8.0
    # More tiles than slots: 3 tiles of 5 chunks on 2 slots take 10 chunks.
    assert segmented_cost_us(Problem.fixed(3, 5 * 64, 1), Segmentation([split_even(5, 1)] * 3), cost, 2) == 10 * 9.5


@pytest.mark.parametrize("first_m", [False, True])
def test_summary_schedule_has_the_tiles_start_states_need(first_m):
    from schedulers import summary_schedule

    # Sequence 0: 3 segments, sequence 1: 1 segment (needs no summary), sequence 2: 2 segments.
    p = Problem.varlen([0, 6 * 64, 6 * 64 + 100, 6 * 64 + 100 + 4 * 64], 2, num_blocks=2)
    seg = Segmentation([split_even(6, 3), split_even(1, 1), split_even(4, 2)])
    sched = summary_schedule(p, seg, first_m=first_m)
    got = sorted((t.seq, t.segment, t.head, t.block) for t in sched.tiles)
    want = sorted([(0, 0, h, 0) for h in range(2)] + [(0, 1, h, b) for h in range(2) for b in range(2)]
                  + [(2, 0, h, 0) for h in range(2)]
                  + ([(0, 0, h, 1) for h in range(2)] + [(2, 0, h, 1) for h in range(2)] if first_m else []))
    assert got == want
    assert sched.grid == (len(want), 1, 1) and not sched.persistent
    # Slots are those of the full segmentation (summaries land where the merge reads them).
    assert {t.seg_slot for t in sched.tiles} == {0, 1, 4}


@pytest.mark.parametrize("B,H,T", [(1, 4, 8192), (2, 8, 4096), (1, 16, 16384), (4, 16, 1024), (16, 64, 4096)])
def test_plan_by_cost_is_the_cheapest_candidate(B, H, T):
    from schedulers import SegmentCost, plan_segments_by_cost, segmented_cost_us

    cost = SegmentCost(chunk_us=25.5, link_us=7.6)
    p = Problem.fixed(B, T, H)
    plan = plan_segments_by_cost(p, 132, cost, min_chunks=2)
    n = plan.segments[0]
    assert plan.segments == [n] * B
    costs = {m: segmented_cost_us(p, Segmentation([split_even(T // 64, m)] * B), cost, 132)
             for m in range(1, T // 64 // 2 + 1)}
    assert costs[n] <= min(costs.values()) / 0.999
    if B * H >= 132:  # the tiles fill the GPU: a split only adds work
        assert n == 1
    if B * H <= 8 and T >= 4096:
        assert n >= 8
    assert "predicted: unsplit" in plan.explain()


def test_plan_by_cost_varlen():
    from schedulers import SegmentCost, plan_segments_by_cost, segmented_cost_us

    cost = SegmentCost(chunk_us=9.5, link_us=2.0)
    p = Problem.varlen([0, 100, 5000, 5100, 20000], 4)
    plan = plan_segments_by_cost(p, 132, cost, min_chunks=2)
    chunks = list(p.chunks)
    assert all(1 <= s <= max(1, c // 2) for s, c in zip(plan.segments, chunks))
    assert plan.segments[3] > plan.segments[1] > 1  # the longest sequence gets the most segments
    assert plan.segments[0] == plan.segments[2] == 1  # 2-chunk sequences stay whole
    unsplit = segmented_cost_us(p, Segmentation([split_even(c, 1) for c in chunks]), cost, 132)
    assert segmented_cost_us(p, plan.segmentation, cost, 132) < unsplit / 3
