"""decode_attention: checks of bad input and the plan (CPU), and agreement with the float64 reference (GPU) over
contiguous and paged caches, ragged lengths (0 and 1 included), GQA groups, multi-token queries, both schedulers,
softcap, the fixup's counters and CUDA-graph replay with changed lengths."""

import math

import pytest
import torch
from conftest import poisoned, rel_err, requires_sm90

import cute_kernels as ck
from cute_kernels.kernels.configs import DecodeConfig
from cute_kernels.ops import decode as dec
from cute_kernels.reference import decode_attention_ref
from schedulers.splitkv import SplitKVScheduler, StreamKScheduler

D = 128


def cache_inputs(B, Hq, Hkv, lens, *, Sq=None, Tmax=None, page_size=None, dtype=torch.bfloat16, device="cpu",
                 seed=0):
    """(q, k_cache, v_cache, cache_seqlens, page_table): random q / K / V; a paged cache gets its pages in a
    shuffled order with spare pages between, so a wrong page index reads other data."""
    gen = torch.Generator().manual_seed(seed)
    q_shape = (B, Hq, D) if Sq is None else (B, Sq, Hq, D)
    q = torch.randn(q_shape, generator=gen).to(dtype)
    Tmax = Tmax or max(max(lens), 1)
    seqlens = torch.tensor(lens, dtype=torch.int32)
    if page_size is None:
        k = torch.randn(B, Tmax, Hkv, D, generator=gen).to(dtype)
        v = torch.randn(B, Tmax, Hkv, D, generator=gen).to(dtype)
        table = None
    else:
        max_pages = math.ceil(Tmax / page_size)
        num_pages = 2 * B * max_pages + 3
        order = torch.randperm(num_pages, generator=gen)[: B * max_pages]
        table = order.view(B, max_pages).to(torch.int32)
        k = torch.randn(num_pages, page_size, Hkv, D, generator=gen).to(dtype)
        v = torch.randn(num_pages, page_size, Hkv, D, generator=gen).to(dtype)
    moved = [x.to(device) if x is not None else None for x in (q, k, v, seqlens, table)]
    return tuple(moved)


# ---------------------------------------------------------------- CPU: bad input, the plan


def test_bad_input_names_the_argument():
    q, k, v, lens, _ = cache_inputs(2, 8, 2, [5, 9])
    cases = [
        ({"q": q.float()}, TypeError, "q must have dtype"),
        ({"q": q[..., :64].contiguous()}, ValueError, "head dim"),
        ({"q": torch.randn(2, 9, 8, D).bfloat16()}, ValueError, "at most 8"),
        ({"k_cache": k.half()}, TypeError, "k_cache must have dtype"),
        ({"v_cache": v[:, :3]}, ValueError, "v_cache"),
        ({"q": q[:, :7].contiguous()}, ValueError, "multiple of k_cache"),
        ({"cache_seqlens": lens.long()}, TypeError, "cache_seqlens must have dtype"),
        ({"cache_seqlens": lens[:1]}, ValueError, "cache_seqlens"),
        ({"k_cache": k[:1], "v_cache": v[:1]}, ValueError, r"k_cache must be \[B = 2"),
        ({"scale": "1"}, TypeError, "scale"),
        ({"softcap": -1.0}, ValueError, "softcap"),
        ({"max_seqlen": 10}, ValueError, "max_seqlen"),
        ({"page_table": torch.zeros(3, 1, dtype=torch.int32)}, ValueError, "page_table"),
        ({"page_table": torch.zeros(2, 1, dtype=torch.int32)}, ValueError, "page size"),
    ]
    base = {"q": q, "k_cache": k, "v_cache": v, "cache_seqlens": lens}
    for change, error, text in cases:
        args = {**base, **change}
        extra = {n: args.pop(n) for n in ("page_table", "scale", "softcap", "max_seqlen") if n in args}
        with pytest.raises(error, match=text):
            ck.decode_attention(args["q"], args["k_cache"], args["v_cache"], args["cache_seqlens"], **extra)


def test_cpu_tensors_are_refused():
    q, k, v, lens, _ = cache_inputs(2, 8, 2, [5, 9])
    with pytest.raises(ValueError, match="CUDA"):
        ck.decode_attention(q, k, v, lens)


def test_too_many_query_rows_per_kv_head():
    q, k, v, lens, _ = cache_inputs(1, 32, 1, [5], Sq=4)   # 32 x 4 rows > 64
    with pytest.raises(ValueError, match="query rows per KV head"):
        ck.decode_attention(q, k, v, lens)


def test_plan_is_cached_and_planned_from_the_bound():
    a = dec.plan_decode(4, 8, 4, 1, 4096, False, False, 132)
    b = dec.plan_decode(4, 8, 4, 1, 4096, False, False, 132)
    assert a is b
    schedule, config, even = a
    assert config.group == 4 and not config.persistent and not config.paged
    assert even == (schedule.plan.splits[0], 64), even   # the kernel's tiles from the CTA index
    # 32 units x 64 blocks on 132 SMs: one wave of one CTA per SM, 4 splits of 1024 tokens
    assert schedule.plan.splits == [4] * 32 and schedule.num_tiles == 128
    s, c, even = dec.plan_decode(4, 8, 4, 1, 4096, True, False, 132, StreamKScheduler())
    assert c.persistent and c.paged and s.grid[0] <= 264 and even == (0, 0)
    # every field of the scheduler is in the cache key
    loose = dec.plan_decode(4, 8, 4, 1, 4096, False, False, 132, SplitKVScheduler(divide_slack=0.5))
    assert loose is not dec.plan_decode(4, 8, 4, 1, 4096, False, False, 132, SplitKVScheduler(divide_slack=0.0))
    with pytest.raises(TypeError, match="scheduler must be"):
        dec.plan_decode(4, 8, 4, 1, 4096, False, False, 132, scheduler=object())


def test_default_plan_by_device_kind():
    """The op's default scheduler takes the device kind's `LONG_SPLIT_KV`: on an H200 a 32K-token B=16 Hkv=8 call
    runs 2 splits per unit (two CTAs per SM); on an H100, or an unknown kind, one."""
    from cute_kernels.ops import decode as dec

    h200, _, _ = dec.plan_decode(16, 8, 4, 1, 32768, False, False, 132, kind="H200")
    h100, _, _ = dec.plan_decode(16, 8, 4, 1, 32768, False, False, 132, kind="H100")
    unknown, _, _ = dec.plan_decode(16, 8, 4, 1, 32768, False, False, 132)
    assert h200.plan.splits == [2] * 128 and h200.num_tiles == 256
    assert h100.plan.splits == unknown.plan.splits == [1] * 128
    short, _, _ = dec.plan_decode(1, 8, 4, 1, 4096, False, False, 132, kind="H200")
    assert short.plan.splits == [16] * 8


def test_longest_first_where_tiles_outnumber_the_cta_slots():
    """Tiles longest batch row first only for an even plan of more tiles than CTA slots (132 SMs x 2), whose
    splits may be long (>= 2048 tokens), over 2 to 256 rows; `last_plan` says which order the tiles go in."""
    many, config, _ = dec.plan_decode(64, 8, 4, 1, 4096, False, False, 132)
    assert many.num_tiles == 512 and config.longest_first
    assert "longest batch row first" in dec.explain_plan(many, config)
    for B, L, sched in [(64, 1024, None), (16, 32768, None), (257, 4096, None), (64, 4096, StreamKScheduler())]:
        s, c, _ = dec.plan_decode(B, 8, 4, 1, L, False, False, 132, sched)
        assert not c.longest_first, (B, L, s.num_tiles)
        assert "(batch row, KV head, split) order" in dec.explain_plan(s, c) or c.persistent
    with pytest.raises(ValueError, match="longest_first"):
        DecodeConfig(persistent=True, longest_first=True)


def test_long_splits_stream_through_a_deeper_ring():
    """On the H100 / H200 a split of >= 1024 tokens gets a 3-stage K / V ring, a shorter one the 2-stage ring;
    an unmeasured kind (SM100's kernel, or no kind) keeps 2 stages."""
    for B, Hkv, L, stages in [(1, 8, 16384, 3), (16, 8, 32768, 3), (1, 8, 4096, 2), (16, 4, 512, 2), (64, 8, 1024, 3)]:
        schedule, config, _ = dec.plan_decode(B, Hkv, 4, 1, L, False, False, 132, kind="H100")
        assert config.stages == stages, (B, Hkv, L, schedule.plan.splits[0], config.stages)
    for kind in ("SM100", None):
        assert dec.plan_decode(16, 8, 4, 1, 32768, False, False, 148, kind=kind)[1].stages == 2


@pytest.mark.parametrize("B, Hkv, L, splits, batch", [(4, 8, 4096, 4, 4), (1, 8, 4096, 16, 16), (1, 4, 4096, 32, 16),
                                                      (16, 4, 512, 2, 2), (64, 8, 4096, 1, 1), (2, 8, 4096, 8, 8)])
def test_merge_batch_covers_the_planned_splits(B, Hkv, L, splits, batch):
    """The fixup reads the least power of two of splits covering the plan's (at most 16), so a few splits never
    wait on places past the last."""
    schedule, config, _ = dec.plan_decode(B, Hkv, 4, 1, L, False, False, 132)
    assert schedule.plan.splits[0] == splits and config.merge_batch == batch
    assert [dec.merge_batch(n) for n in (1, 2, 3, 5, 9, 16, 17, 64)] == [1, 2, 4, 8, 16, 16, 16, 16]
    with pytest.raises(ValueError, match="merge_batch"):
        DecodeConfig(merge_batch=3)


# ---------------------------------------------------------------- GPU: against the float64 reference


def check(q, k, v, lens, table=None, *, scale=None, softcap=None, scheduler=None, max_seqlen=None):
    """One call with poisoned outputs against the reference; a second call must match bitwise; every counter is
    back at zero."""
    o = poisoned(q.shape, q.dtype, q.device)
    lse = poisoned(q.shape[:-1], torch.float32, q.device)
    got_o, got_lse = ck.decode_attention(q, k, v, lens, page_table=table, scale=scale, softcap=softcap,
                                         scheduler=scheduler, max_seqlen=max_seqlen, return_lse=True,
                                         out=(o, lse))
    assert got_o is o and got_lse is lse
    ref_o, ref_lse = decode_attention_ref(q.cpu(), k.cpu(), v.cpu(), lens.cpu(),
                                          None if table is None else table.cpu(), scale, softcap)
    assert not o.isnan().any(), "unwritten or NaN output"
    assert rel_err(o, ref_o) < 5e-3, rel_err(o, ref_o)      # relative RMS
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse.cpu()), finite), "lse is -inf exactly where no key is visible"
    assert (lse.cpu()[~finite] == float("-inf")).all()
    if finite.any():
        assert (lse.cpu()[finite].double() - ref_lse[finite]).abs().max() < 1e-3
    assert (o.cpu()[~finite] == 0).all(), "rows with no visible key are zero"
    again = ck.decode_attention(q, k, v, lens, page_table=table, scale=scale, softcap=softcap, scheduler=scheduler,
                                max_seqlen=max_seqlen, return_lse=True)
    assert torch.equal(again[0], o) and torch.equal(again[1], lse), "two calls differ"
    for counts in dec._counters.values():
        assert int(counts.abs().sum()) == 0, "a fixup counter was left non-zero"
    return o, lse


LENS = [0, 1, 63, 64, 65, 257, 1000, 3001]        # ragged: empty, one token, block and split edges


@requires_sm90
@pytest.mark.parametrize("scheduler", ["split-kv", "stream-k", "one-split"])
@pytest.mark.parametrize("heads", [(32, 8), (32, 4), (64, 8), (32, 32)], ids=lambda h: f"{h[0]}-{h[1]}")
def test_contiguous_gqa(heads, scheduler):
    Hq, Hkv = heads
    sched = {"split-kv": None, "stream-k": StreamKScheduler(), "one-split": SplitKVScheduler(num_splits=1)}[scheduler]
    q, k, v, lens, _ = cache_inputs(len(LENS), Hq, Hkv, LENS, device="cuda", seed=Hq + Hkv)
    check(q, k, v, lens, scheduler=sched)


@requires_sm90
@pytest.mark.parametrize("page_size", [16, 64])
@pytest.mark.parametrize("scheduler", ["split-kv", "stream-k"])
def test_paged(page_size, scheduler):
    sched = None if scheduler == "split-kv" else StreamKScheduler(min_kv=64)
    q, k, v, lens, table = cache_inputs(len(LENS), 32, 8, LENS, page_size=page_size, device="cuda", seed=page_size)
    check(q, k, v, lens, table, scheduler=sched)


@requires_sm90
@pytest.mark.parametrize("Sq", [1, 4, 8])
@pytest.mark.parametrize("paged", [False, True])
def test_multi_token_queries(Sq, paged):
    lens = [Sq - 1, Sq, 100, 2049]                  # the first row: the first new token sees no key
    q, k, v, L, table = cache_inputs(4, 16, 2, lens, Sq=Sq, page_size=16 if paged else None, device="cuda",
                                     seed=Sq)
    check(q, k, v, L, table, scheduler=SplitKVScheduler(num_splits=3))
    check(q, k, v, L, table, scheduler=StreamKScheduler(ctas=5))


def poison_past_lengths(k, v, lens, table):
    """NaN in every cache row that no row's first `lens[b]` tokens use: the slots past each length, the rest of
    the last page, spare pages (a stale or never-written cache). The op must never let them into o."""
    used = torch.zeros(k.shape[:2], dtype=torch.bool, device=k.device)
    for b, L in enumerate(lens.tolist()):
        if table is None:
            used[b, :L] = True
        else:
            page_size = k.shape[1]
            for t0 in range(0, L, page_size):
                used[int(table[b, t0 // page_size]), : min(page_size, L - t0)] = True
    k[~used] = float("nan")
    v[~used] = float("nan")


@requires_sm90
@pytest.mark.parametrize("Sq", [1, 4])
@pytest.mark.parametrize("page_size", [None, 16, 64])
@pytest.mark.parametrize("scheduler", ["split-kv", "stream-k"])
def test_nan_past_the_lengths_never_reaches_o(scheduler, page_size, Sq):
    sched = None if scheduler == "split-kv" else StreamKScheduler(min_kv=64)
    lens = [4, 17, 100, 250, 1000, 0, 1999]    # boundaries inside a 16-token box, a 64-token block, a page
    q, k, v, L, table = cache_inputs(len(lens), 32, 8, lens, Sq=Sq, Tmax=2048, page_size=page_size,
                                     device="cuda", seed=17 + Sq)
    poison_past_lengths(k, v, L, table)
    check(q, k, v, L, table, scheduler=sched)
    check(q, k, v, L, table, scheduler=SplitKVScheduler(num_splits=5), max_seqlen=2048)


@requires_sm90
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_dtype_scale_softcap(dtype):
    q, k, v, lens, _ = cache_inputs(3, 16, 4, [700, 5000, 129], dtype=dtype, device="cuda", seed=7)
    check(q, k, v, lens, scale=0.3)
    check(q, k, v, lens, softcap=5.0, scheduler=StreamKScheduler(ctas=7))


@requires_sm90
def test_many_splits_long_cache():
    # one row, one KV head: the split count is large, and stream-K ranges end mid-unit
    q, k, v, lens, _ = cache_inputs(1, 8, 1, [65536 + 37], device="cuda", seed=3)
    check(q, k, v, lens)
    schedule, _, _ = dec.plan_decode(1, 1, 8, 1, 65536 + 37, False, False, torch.cuda.get_device_properties(0)
                                  .multi_processor_count)
    assert schedule.plan.splits[0] >= 64
    check(q, k, v, lens, scheduler=StreamKScheduler())
    assert "stream-k" in ck.last_plan()


@requires_sm90
def test_merge_batches_with_empty_splits():
    # 19 splits: one full batch of the fixup's merge and a partial one; the ragged rows leave empty splits
    # (lse = -inf) inside both, and the longest row's last split is in the partial batch
    q, k, v, lens, _ = cache_inputs(len(LENS), 16, 2, LENS, device="cuda", seed=21)
    check(q, k, v, lens, scheduler=SplitKVScheduler(num_splits=19))


@requires_sm90
def test_lengths_below_the_planned_bound():
    # planned for 4096 tokens per row, run with fewer: splits past a row's length are empty
    q, k, v, lens, _ = cache_inputs(4, 32, 8, [4096, 10, 0, 1500], device="cuda", seed=11)
    check(q, k, v, lens, max_seqlen=4096)
    check(q, k, v, lens, max_seqlen=4096, scheduler=StreamKScheduler())


@requires_sm90
def test_waves_for_a_ragged_batch():
    # two waves of tiles (the option for ragged batches): more splits per row, most of the short rows' empty
    q, k, v, lens, _ = cache_inputs(16, 32, 8, [4096, 17, 0, 700, 2048, 1, 3999, 64] * 2, device="cuda", seed=12)
    check(q, k, v, lens, max_seqlen=4096, scheduler=SplitKVScheduler(waves=2))
    assert "2 waves" in ck.last_plan()


@requires_sm90
def test_longest_first_over_ragged_rows_and_graph_replay():
    """More tiles than CTA slots: the tiles go out longest row first, ranked on the device from the true lengths.
    Ragged rows with ties, 0 and 1, the longest last; then a CUDA graph replayed with the lengths reordered."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    Hkv, L = 8, 2048
    B = (2 * sms) // Hkv + 6
    lens = ([0, 1, 63, 64, 65, 700, 700, 1999] * B)[: B - 3] + [2047, L, L]
    q, k, v, seqlens, _ = cache_inputs(B, 8, Hkv, lens, device="cuda", seed=31)
    schedule, config, _ = dec.plan_decode(B, Hkv, 1, 1, L, False, False, sms)
    assert config.longest_first and schedule.num_tiles > 2 * sms
    check(q, k, v, seqlens, max_seqlen=L)
    assert "longest batch row first" in ck.last_plan()
    o = torch.empty_like(q)
    ck.decode_attention(q, k, v, seqlens, max_seqlen=L, out=(o, None))
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ck.decode_attention(q, k, v, seqlens, max_seqlen=L, out=(o, None))
    for new in (lens[::-1], [L] * B, [(i * 37) % (L + 1) for i in range(B)]):
        seqlens.copy_(torch.tensor(new, dtype=torch.int32))
        o.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref_o, _ = decode_attention_ref(q.cpu(), k.cpu(), v.cpu(), seqlens.cpu())
        assert not o.isnan().any() and rel_err(o, ref_o) < 5e-3, rel_err(o, ref_o)


@requires_sm90
@pytest.mark.parametrize("graph", [False, True])
def test_back_to_back_calls_share_counters_safely(graph):
    """Calls launched early (PDL) overlap the previous call's tail: each must still wait for it before touching
    the counters, the partials or its inputs. Five calls in a row, each with its own q and output, one cache."""
    q, k, v, lens, _ = cache_inputs(2, 32, 8, [4096, 3000], device="cuda", seed=23)
    qs = [torch.randn_like(q) for _ in range(5)]
    outs = [torch.empty_like(q) for _ in range(5)]

    def calls():
        for qi, oi in zip(qs, outs):
            ck.decode_attention(qi, k, v, lens, max_seqlen=4096, out=(oi, None))

    calls()
    torch.cuda.synchronize()
    if graph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            calls()
        for o in outs:
            o.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
    for qi, oi in zip(qs, outs):
        ref_o, _ = decode_attention_ref(qi.cpu(), k.cpu(), v.cpu(), lens.cpu())
        assert not oi.isnan().any() and rel_err(oi, ref_o) < 5e-3, rel_err(oi, ref_o)
    for counts in dec._counters.values():
        assert int(counts.abs().sum()) == 0, "a fixup counter was left non-zero"


@requires_sm90
@pytest.mark.parametrize("scheduler", ["split-kv", "stream-k"])
def test_cuda_graph_replay_with_changed_lengths(scheduler):
    sched = None if scheduler == "split-kv" else StreamKScheduler()
    B, Hq, Hkv, Tmax = 4, 32, 8, 4096
    q, k, v, lens, table = cache_inputs(B, Hq, Hkv, [Tmax] * B, page_size=16, device="cuda", seed=5)
    o = torch.empty_like(q)
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        ck.decode_attention(q, k, v, lens, page_table=table, scheduler=sched, max_seqlen=Tmax, out=(o, None))
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ck.decode_attention(q, k, v, lens, page_table=table, scheduler=sched, max_seqlen=Tmax, out=(o, None))
    for new in ([Tmax] * B, [1, 0, 3000, 777], [4000, 4001, 64, 65]):
        lens.copy_(torch.tensor(new, dtype=torch.int32))
        o.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref_o, _ = decode_attention_ref(q.cpu(), k.cpu(), v.cpu(), lens.cpu(), table.cpu())
        assert not o.isnan().any() and rel_err(o, ref_o) < 5e-3, (new, rel_err(o, ref_o))
