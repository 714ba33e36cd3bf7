"""Split-KV decode plans (CPU): coverage of every unit's KV blocks, the occupancy rules, stream-K's equal ranges,
the uniform cases, `explain()`, and the errors."""

import pytest
from hypothesis import given, settings, strategies as st

from schedulers.splitkv import (SplitKVScheduler, StreamKScheduler, decode_problem, even_split_fields,
                                even_split_shape)


def unit_pieces(problem, schedule):
    """unit -> its real tiles, sorted by split index; every real tile checked against the problem."""
    C = problem.chunk_size
    out = {}
    for cta, tiles in enumerate(schedule.cta_work()):
        for t in tiles:
            if t.seg_slot == -1:   # stream-K padding: no work, no partial
                assert t.chunk_start == t.chunk_end == 0 and t.num_segments == 0
                continue
            assert t.head == 0 and t.block == 0
            assert t.tok_start == problem.seq_starts[t.seq] + min(t.chunk_start * C, problem.seq_lens[t.seq])
            assert t.tok_end == problem.seq_starts[t.seq] + min(t.chunk_end * C, problem.seq_lens[t.seq])
            assert t.seg_slot == schedule.seg_offsets[t.seq] + t.segment
            out.setdefault(t.seq, []).append((t, cta))
    return {u: sorted(v, key=lambda x: x[0].segment) for u, v in out.items()}


def check_coverage(problem, schedule):
    pieces = unit_pieces(problem, schedule)
    assert sorted(pieces) == list(range(problem.num_seqs))
    for u, tiles in pieces.items():
        ts = [t for t, _ in tiles]
        assert [t.segment for t in ts] == list(range(len(ts)))
        assert all(t.num_segments == len(ts) for t in ts)
        assert ts[0].chunk_start == 0 and ts[-1].chunk_end == problem.num_chunks(u)
        for a, z in zip(ts, ts[1:]):
            assert a.chunk_end == z.chunk_start and z.chunk_end > z.chunk_start
    return pieces


kv_lens = st.lists(st.sampled_from([0, 1, 255, 256, 257, 4096, 32768]) | st.integers(0, 20000), min_size=1,
                   max_size=8)


@settings(max_examples=60, deadline=None)
@given(kv_lens, st.sampled_from([1, 2, 4, 8]), st.sampled_from([16, 64, 128]), st.integers(1, 300))
def test_every_block_read_once(lens, hkv, block, ctas):
    problem = decode_problem(lens, hkv, block)
    for sched in (SplitKVScheduler(), SplitKVScheduler(num_splits=3), StreamKScheduler(),
                  StreamKScheduler(ctas=ctas)):
        schedule = sched.schedule(problem, sm_count=132, ctas_per_sm=2)
        check_coverage(problem, schedule)
        assert schedule.seg_offsets[-1] == schedule.segmentation.total_segments


@settings(max_examples=80, deadline=None)
@given(st.integers(1, 64), st.sampled_from([0, 1, 63, 64, 65, 255, 256, 4096, 4097, 131072]) | st.integers(0, 40000),
       st.sampled_from([1, 2, 4, 8, 32]), st.sampled_from([None, 1, 3, 7, 64]), st.sampled_from([16, 132]))
def test_even_split_formula_is_the_table(B, bound, hkv, forced, sms):
    """The decode op plans every row from one bound, so a split-KV table is `even_split_fields` of the row index:
    the device computes each CTA's tile from its index and reads no table."""
    schedule = SplitKVScheduler(num_splits=forced).schedule(decode_problem([bound] * B, hkv, 64), sms, 2)
    shape = even_split_shape(schedule)
    assert shape is not None
    splits, blocks = shape
    assert schedule.num_tiles == B * hkv * splits and blocks == -(-bound // 64)
    for i, t in enumerate(schedule.tiles):
        assert (t.seq, t.segment, t.chunk_start, t.chunk_end) == even_split_fields(i, splits, blocks)
        assert t.seg_slot == i and t.num_segments == splits


def test_even_split_shape_refuses_other_tables():
    assert even_split_shape(StreamKScheduler().schedule(decode_problem([4096] * 2, 8, 64), 132, 2)) is None
    # rows of two lengths split differently: no single (splits, blocks)
    assert even_split_shape(SplitKVScheduler().schedule(decode_problem([4096, 300], 8, 64), 132, 2)) is None


@settings(max_examples=60, deadline=None)
@given(kv_lens, st.sampled_from([1, 4, 8]), st.integers(1, 300))
def test_stream_k_ranges_are_equal_and_contiguous(lens, hkv, ctas):
    """Each CTA's blocks differ from any other's by at most one, and its pieces are consecutive in the
    flattened (unit, block) order."""
    problem = decode_problem(lens, hkv, 64)
    schedule = StreamKScheduler(ctas=ctas).schedule(problem)
    total = sum(problem.chunks)
    starts = [0]
    for c in problem.chunks:
        starts.append(starts[-1] + c)
    loads = []
    for tiles in schedule.cta_work():
        real = [t for t in tiles if t.seg_slot != -1 and t.chunk_end > t.chunk_start]
        loads.append(sum(t.chunk_end - t.chunk_start for t in real))
        flat = [(starts[t.seq] + t.chunk_start, starts[t.seq] + t.chunk_end) for t in real]
        for (_, e), (s, _) in zip(flat, flat[1:]):
            assert e == s
    assert sum(loads) == total
    if total >= schedule.grid[0]:
        assert max(loads) - min(loads) <= 1


def test_split_kv_fills_the_gpu_in_min_kv_slices():
    """B=1, Hkv=8, 4096 tokens, 64-token blocks on 132 SMs x 2, with the issue's rule (two CTAs per SM, 256-token
    splits): one wave of 264 CTAs would give 33 splits per unit, but a split keeps >= 4 blocks: 16 splits per
    unit, 128 CTAs, uniform."""
    problem = decode_problem([4096], 8, 64)
    schedule = SplitKVScheduler(min_kv=256, ctas_per_sm=None).schedule(problem, sm_count=132, ctas_per_sm=2)
    plan = schedule.plan
    assert plan.splits == [16] * 8 and schedule.num_tiles == 128 and plan.uniform
    assert all(t.chunk_end - t.chunk_start == 4 for t in schedule.tiles)
    text = plan.explain()
    assert "8 units" in text and "splits per unit 16 (uniform)" in text and "min_kv 256 tokens = 4 blocks" in text
    assert "2 CTA(s) per SM planned, of the kernel's 2" in text


@pytest.mark.parametrize("B, hkv, L, splits", [
    (1, 8, 512, 8), (1, 8, 1024, 16), (1, 8, 4096, 16), (1, 8, 16384, 16), (2, 8, 512, 8), (2, 8, 16384, 8),
    (4, 8, 4096, 4), (8, 8, 4096, 2), (1, 4, 1024, 16), (1, 4, 4096, 32), (16, 8, 4096, 1), (32, 8, 512, 1)])
def test_split_kv_default_is_one_wave_of_one_cta_per_sm(B, hkv, L, splits):
    """The default plan: units x splits <= 132 SMs, splits down to one 64-token block. On the H100 these counts
    timed best or within 0.1 us of the best among 2-64 splits at every cell up to B = 8 (docs/design.md)."""
    schedule = SplitKVScheduler().schedule(decode_problem([L] * B, hkv, 64), sm_count=132, ctas_per_sm=2)
    assert schedule.plan.splits == [splits] * (B * hkv) and schedule.plan.uniform
    assert schedule.num_tiles <= 132 or splits == 1
    assert "1 CTA(s) per SM planned, of the kernel's 2" in schedule.plan.explain()


@pytest.mark.parametrize("B, hkv, L, splits", [
    (16, 8, 32768, 2), (4, 8, 32768, 8), (8, 8, 16384, 4), (1, 8, 16384, 32), (2, 4, 32768, 32), (2, 8, 8192, 16),
    (1, 8, 4096, 16), (1, 8, 8192, 16), (1, 4, 4096, 32), (1, 4, 8192, 32), (32, 8, 8192, 1), (1, 8, 512, 8)])
def test_split_kv_long_splits_fill_two_ctas_per_sm(B, hkv, L, splits):
    """long_split_kv=512 (the H200's default): the kernel's two CTAs per SM wherever that gives more CTAs whose
    splits keep >= 8 blocks (B=16 32K: 2 splits of 16K tokens, 256 CTAs, not 1 split and 128), else the one-CTA
    plan unchanged (B=1 Hkv=8 4K and 8K: 16 splits, as without the option)."""
    problem = decode_problem([L] * B, hkv, 64)
    schedule = SplitKVScheduler(long_split_kv=512).schedule(problem, sm_count=132, ctas_per_sm=2)
    plan = schedule.plan
    assert plan.splits == [splits] * (B * hkv) and plan.uniform
    one = SplitKVScheduler().schedule(problem, sm_count=132, ctas_per_sm=2)
    if schedule.num_tiles > one.num_tiles:
        assert schedule.num_tiles <= 264 and all(t.chunk_end - t.chunk_start >= 8 for t in schedule.tiles)
        assert "long_split_kv 512 tokens" in plan.explain() and "2 CTA(s) per SM planned" in plan.explain()
    else:
        assert plan.splits == one.plan.splits and "1 CTA(s) per SM planned" in plan.explain()
    assert "long_split_kv=512" in repr(SplitKVScheduler(long_split_kv=512))   # the plan cache keys on the repr
    with pytest.raises(ValueError, match="long_split_kv"):
        SplitKVScheduler(long_split_kv=0)


def test_split_kv_waves_for_ragged_batches():
    """waves=k plans k waves of tiles (the hardware hands each SM that finishes the next), so a long row's splits
    spread where one wave gives each unit one CTA for its whole bound."""
    problem = decode_problem([32768] * 16, 8, 64)   # 128 units
    one = SplitKVScheduler().schedule(problem, sm_count=132, ctas_per_sm=2)
    assert one.plan.splits == [1] * 128
    four = SplitKVScheduler(waves=4).schedule(problem, sm_count=132, ctas_per_sm=2)
    assert four.plan.splits == [4] * 128 and four.plan.uniform and 3 * 132 < four.num_tiles <= 4 * 132
    assert "4 waves" in four.plan.explain()
    assert "waves=4" in repr(SplitKVScheduler(waves=4))   # the plan cache keys on the repr
    with pytest.raises(ValueError, match="waves"):
        SplitKVScheduler(waves=0)


def test_split_kv_leaves_full_batches_whole():
    problem = decode_problem([4096] * 64, 8, 64)   # 512 units >= 264 slots
    schedule = SplitKVScheduler(ctas_per_sm=None).schedule(problem, sm_count=132, ctas_per_sm=2)
    assert schedule.plan.splits == [1] * 512 and schedule.num_tiles == 512


def test_split_kv_prefers_counts_that_divide():
    """B=1, Hkv=4, two CTAs per SM and 256-token splits: one wave wants 66 splits per unit; min_kv caps it at blocks // 4. 128 blocks: 32, which divides.
    132 blocks: 33, which divides. 130 blocks: 32; within 5% below it (31, 32) none divides 130, so the splits
    differ by one block."""
    p = decode_problem([128 * 64], 4, 64)
    s = SplitKVScheduler(min_kv=256, ctas_per_sm=None).schedule(p, sm_count=132, ctas_per_sm=2)
    assert s.plan.splits == [32] * 4 and s.plan.uniform
    p = decode_problem([132 * 64], 4, 64)
    s = SplitKVScheduler(min_kv=256, ctas_per_sm=None).schedule(p, sm_count=132, ctas_per_sm=2)
    assert s.plan.splits == [33] * 4 and s.plan.uniform   # cap 33, and 33 divides 132
    p = decode_problem([130 * 64], 4, 64)
    s = SplitKVScheduler(min_kv=256, ctas_per_sm=None).schedule(p, sm_count=132, ctas_per_sm=2)
    assert s.plan.splits == [32] * 4 and not s.plan.uniform   # 31, 32 do not divide 130


def test_stream_k_uniform_when_the_ctas_divide():
    """B=1, Hkv=8, 4096 tokens: 512 blocks / 4 per CTA = 128 CTAs, a multiple of 8 units: each unit 16 splits of
    4 blocks, one piece per CTA, no padding."""
    problem = decode_problem([4096], 8, 64)
    schedule = StreamKScheduler().schedule(problem, sm_count=132, ctas_per_sm=2)
    assert schedule.grid == (128, 1, 1) and schedule.persistent
    assert schedule.plan.uniform and schedule.plan.splits == [16] * 8
    assert schedule.num_tiles == 128 and all(t.seg_slot != -1 for t in schedule.tiles)


def test_stream_k_rounds_down_to_a_multiple_of_the_units():
    """B=2, Hkv=5, 32768 tokens: 10 units x 512 blocks; 264 slots -> 260 CTAs (a multiple of 10, 1.5% fewer):
    26 splits in every unit (512 / 26 is not whole, so they differ by one block)."""
    problem = decode_problem([32768, 32768], 5, 64)
    schedule = StreamKScheduler().schedule(problem, sm_count=132, ctas_per_sm=2)
    assert schedule.grid[0] == 260 and schedule.plan.splits == [26] * 10 and not schedule.plan.uniform
    assert "a multiple of the 10 units" in schedule.plan.explain()


def test_stream_k_splits_mid_unit_and_pads():
    """3 units of 10, 3, 7 blocks on 4 CTAs (5 blocks each): CTA 0 takes unit 0's blocks 0-4, CTA 1 its 5-9,
    CTA 2 unit 1 and unit 2's first two blocks, CTA 3 unit 2's last five. CTA 2 has two pieces, the others one,
    so its second sits at row 4 + 2 behind two padding rows."""
    problem = decode_problem([640, 192, 448], 1, 64)
    schedule = StreamKScheduler(ctas=4).schedule(problem)
    work = schedule.cta_work()
    real = [[(t.seq, t.chunk_start, t.chunk_end) for t in tiles if t.seg_slot != -1] for tiles in work]
    assert real == [[(0, 0, 5)], [(0, 5, 10)], [(1, 0, 3), (2, 0, 2)], [(2, 2, 7)]]
    assert schedule.plan.splits == [2, 1, 2] and not schedule.plan.uniform
    assert "up to 2 pieces per CTA" in schedule.plan.explain()
    assert [t.seg_slot for t in schedule.tiles] == [0, 1, 2, 4, -1, -1, 3]


def test_empty_units_keep_one_empty_split():
    """A unit whose bound is 0 tokens gets one tile with no blocks: it writes o = 0, lse = -inf."""
    problem = decode_problem([0, 512], 2, 64)
    for sched in (SplitKVScheduler(), StreamKScheduler()):
        pieces = check_coverage(problem, sched.schedule(problem, sm_count=132, ctas_per_sm=2))
        for u in (0, 1):
            (t, _), = pieces[u]
            assert t.chunk_start == t.chunk_end == 0 and t.num_segments == 1


def test_errors_name_the_argument():
    with pytest.raises(ValueError, match="num_splits must be >= 1"):
        SplitKVScheduler(num_splits=0)
    with pytest.raises(ValueError, match="min_kv must be >= 1"):
        StreamKScheduler(min_kv=0)
    with pytest.raises(ValueError, match="ctas_per_sm must be >= 1 or None"):
        SplitKVScheduler(ctas_per_sm=0)
    with pytest.raises(ValueError, match="needs sm_count"):
        SplitKVScheduler().schedule(decode_problem([64], 1))
    with pytest.raises(ValueError, match="num_kv_heads must be >= 1"):
        decode_problem([64], 0)
    with pytest.raises(ValueError, match="kv_lens must be non-empty and >= 0"):
        decode_problem([-1], 1)
