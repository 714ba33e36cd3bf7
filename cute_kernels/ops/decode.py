"""Decode attention over a KV cache: `decode_attention` (GQA, contiguous or paged cache, split-KV on SM90).

validate -> plan (cached per shape: the scheduler's split from an upper bound on the lengths, the kernel config)
-> run (the decode kernel; the last split of each unit merges it in the same launch).
"""

from __future__ import annotations

import torch

from schedulers.splitkv import SplitKVScheduler, StreamKScheduler, decode_problem, even_split_shape

from ..checks import check_cuda, check_no_grad, check_shape, check_tensor
from ..kernels.build import build_decode
from ..kernels.configs import DECODE_HEAD_DIMS, DECODE_MERGE_BATCHES, DECODE_ROWS, DecodeConfig
from ..runtime.arch import device_arch, device_kind, sm_count
from . import last

IO_DTYPES = (torch.bfloat16, torch.float16)
MAX_Q_LEN = 8
BLOCK_KV = 64       # KV tokens per block (the kernel's ring stage)
CTAS_PER_SM = 2     # the kernel's 2-stage ring leaves room for two CTAs per SM
# the default plan's `long_split_kv` per device kind: on the H200 two CTAs per SM beat one wherever each split
# keeps >= 512 tokens (docs/design.md, "Units and the plan"); on the H100 one CTA per SM's ring already covers
# its bandwidth (two measured slower there), and SM100 is not measured
LONG_SPLIT_KV = {"H200": 512}
PAGE_MULTIPLE = 16  # the kernel reads pages in 16-token boxes
# an even split of more than one wave of CTAs hands its tiles out longest batch row first (ranked on the device,
# every thread scanning the lengths once per row it ranks) where each split may be long enough for a late start
# to show, and the rows few enough for the ranking to be cheap (docs/design.md, "Units and the plan")
LONGEST_FIRST_MIN_KV = 2048
LONGEST_FIRST_MAX_ROWS = 256
# per device kind: a split of at least this many tokens streams through a 3-stage ring (96 KB in flight, still two
# CTAs per SM on SM90): a long split's time is its bytes over one CTA's bandwidth, which the bytes in flight set.
# SM100's kernel keeps its ring (a deeper one leaves room for one CTA per SM).
DEEP_RING_MIN_KV = {"H100": 1024, "H200": 1024}


def validate(q, k_cache, v_cache, cache_seqlens, page_table, scale, softcap, max_seqlen):
    """Shapes and dtypes, each error naming the argument. Returns (B, Sq, Hq, Hkv, D, paged, bound)."""
    check_tensor("q", q, dtypes=IO_DTYPES)
    if q.dim() not in (3, 4):
        raise ValueError(f"q must be [B, Hq, D] or [B, Sq, Hq, D], got shape {tuple(q.shape)}")
    B, Sq, Hq, D = (q.shape[0], 1, q.shape[1], q.shape[2]) if q.dim() == 3 else tuple(q.shape)
    if Sq > MAX_Q_LEN:
        raise ValueError(f"q has Sq = {Sq} new tokens per row; decode_attention takes at most {MAX_Q_LEN}")
    if D not in DECODE_HEAD_DIMS:
        raise ValueError(f"q's head dim must be one of {DECODE_HEAD_DIMS}, got D = {D}")
    check_tensor("k_cache", k_cache, dtypes=(q.dtype,), ndim=4)
    check_tensor("v_cache", v_cache, dtypes=(q.dtype,), ndim=4)
    check_shape("v_cache", v_cache, tuple(k_cache.shape))
    slots, page_size, Hkv, Dk = k_cache.shape
    if Dk != D:
        raise ValueError(f"k_cache's head dim must be q's ({D}), got {Dk}")
    if Hkv < 1 or Hq % Hkv:
        raise ValueError(f"q's heads (Hq = {Hq}) must be a multiple of k_cache's (Hkv = {Hkv})")
    if (Hq // Hkv) * Sq > DECODE_ROWS:
        raise ValueError(f"q: Hq / Hkv x Sq = {Hq // Hkv} x {Sq} query rows per KV head, at most {DECODE_ROWS}")
    check_tensor("cache_seqlens", cache_seqlens, dtypes=(torch.int32,), ndim=1, align=4)
    check_shape("cache_seqlens", cache_seqlens, (B,))
    paged = page_table is not None
    if paged:
        check_tensor("page_table", page_table, dtypes=(torch.int32,), ndim=2, align=4)
        if page_table.shape[0] != B:
            raise ValueError(f"page_table must be [B = {B}, max_pages], got shape {tuple(page_table.shape)}")
        if page_size % PAGE_MULTIPLE:
            raise ValueError(f"k_cache's page size (dim 1) must be a multiple of {PAGE_MULTIPLE}, got {page_size}")
        capacity = page_table.shape[1] * page_size
    else:
        if slots != B:
            raise ValueError(f"k_cache must be [B = {B}, Tmax, Hkv, D] (or paged with a page_table), got shape "
                             f"{tuple(k_cache.shape)}")
        capacity = page_size
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))):
        raise TypeError(f"scale must be a float or None, got {type(scale).__name__}")
    if softcap is not None and (isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or softcap <= 0):
        raise ValueError(f"softcap must be a positive float or None, got {softcap!r}")
    bound = capacity
    if max_seqlen is not None:
        if isinstance(max_seqlen, bool) or not isinstance(max_seqlen, int) or not 0 <= max_seqlen <= capacity:
            raise ValueError(f"max_seqlen must be an int in [0, {capacity}] (the cache's capacity), got "
                             f"{max_seqlen!r}")
        bound = max_seqlen
    return B, Sq, Hq, Hkv, D, paged, bound


_plans: dict = {}


def merge_batch(splits: int) -> int:
    """The fixup's batch (`DecodeConfig.merge_batch`): the least power of two covering a unit's splits, at most
    16, so a merge of few splits reads no places past its last and one of many issues 16 loads at a time."""
    return next(b for b in DECODE_MERGE_BATCHES if b >= splits or b == DECODE_MERGE_BATCHES[-1])


def plan_decode(B: int, Hkv: int, group: int, Sq: int, bound: int, paged: bool, softcap: bool, sms: int,
                scheduler=None, kind: str | None = None):
    """(schedule, config, (splits, unit_blocks)) of one call shape, cached. `scheduler`: a `SplitKVScheduler`
    (default: device kind `kind`'s `LONG_SPLIT_KV`) or a `StreamKScheduler`; it plans from `bound` tokens per
    row, never from the true lengths. A split-KV plan is even (every unit split alike), so its kernel computes
    each tile from the CTA index and the pair; stream-K's kernel reads the table (the pair is (0, 0))."""
    if scheduler is None:
        scheduler = SplitKVScheduler(long_split_kv=LONG_SPLIT_KV.get(kind))
    if not isinstance(scheduler, (SplitKVScheduler, StreamKScheduler)):
        raise TypeError(f"scheduler must be a SplitKVScheduler or a StreamKScheduler, got {type(scheduler).__name__}")
    key = (B, Hkv, group, Sq, bound, paged, softcap, sms, repr(scheduler), kind)
    hit = _plans.get(key)
    if hit is None:
        schedule = scheduler.schedule(decode_problem([bound] * B, Hkv, BLOCK_KV), sms, CTAS_PER_SM)
        even = (0, 0) if schedule.persistent else even_split_shape(schedule)
        if even is None:   # every unit has the bound's length, so an even split's table is always the formula
            raise RuntimeError(f"internal: the split-KV plan of {B} rows x {Hkv} KV heads is not even: {schedule.plan}")
        config = DecodeConfig(group=group, q_len=Sq, paged=paged, softcap=softcap, persistent=schedule.persistent,
                              merge_batch=merge_batch(max(schedule.plan.splits)),
                              longest_first=longest_first(schedule, B, bound, sms),
                              stages=ring_stages(kind, bound, max(schedule.plan.splits)))
        if len(_plans) > 256:
            _plans.clear()
        hit = _plans[key] = (schedule, config, even)
    return hit


def longest_first(schedule, B: int, bound: int, sms: int) -> bool:
    """Whether an even plan's tiles go out longest batch row first (`DecodeConfig.longest_first`): with more
    tiles than the kernel's CTA slots, the last to start would otherwise be the highest rows, long or not, and a
    long row started last finishes alone. Only where a split may hold `LONGEST_FIRST_MIN_KV` tokens and the
    batch has at most `LONGEST_FIRST_MAX_ROWS` rows."""
    if schedule.persistent or not 1 < B <= LONGEST_FIRST_MAX_ROWS:
        return False
    splits = max(schedule.plan.splits)
    return schedule.num_tiles > sms * CTAS_PER_SM and bound >= LONGEST_FIRST_MIN_KV * splits


def ring_stages(kind: str | None, bound: int, splits: int) -> int:
    """The K / V ring's depth (`DecodeConfig.stages`): 3 where device kind `kind` has a `DEEP_RING_MIN_KV` and a
    split may hold that many tokens, else 2."""
    deep = DEEP_RING_MIN_KV.get(kind)
    return 3 if deep is not None and bound >= deep * splits else 2


def explain_plan(schedule, config) -> str:
    """The scheduler's explanation, plus the order the kernel hands its tiles out in."""
    order = ("tiles longest batch row first (ranked on the device from the true lengths): more tiles than CTA "
             "slots" if config.longest_first else "tiles in (batch row, KV head, split) order")
    return f"{schedule.explain()}\n- {order}"


_counters: dict = {}


def counters(units: int, device) -> torch.Tensor:
    """The fixup's per-unit counters: zero between calls (the last split of each unit resets its own). One set per
    stream, so calls on two streams never share one; under CUDA-graph capture a zeroed set owned by the graph."""
    if torch.cuda.is_current_stream_capturing():
        return torch.zeros(units, dtype=torch.int32, device=device)
    key = (str(device), torch.cuda.current_stream(device).cuda_stream)
    hit = _counters.get(key)
    if hit is None or hit.numel() < units:
        hit = _counters[key] = torch.zeros(max(units, 1), dtype=torch.int32, device=device)
    return hit


def decode_attention(q, k_cache, v_cache, cache_seqlens, *, page_table=None, scale=None, softcap=None,
                     scheduler=None, max_seqlen=None, return_lse=False, out=None):
    """Attention of new tokens over a KV cache (the FlashAttention / vLLM kv-cache layouts).

    q: [B, Hq, D], or [B, Sq, Hq, D] with Sq <= 8 new tokens per row, causal among themselves, the last at
    position cache_seqlens[b] - 1. k_cache, v_cache: [B, Tmax, Hkv, D], or paged [num_pages, page_size, Hkv, D]
    with page_table [B, max_pages] int32 (page_size a multiple of 16). cache_seqlens: [B] int32 on the device,
    each row's length (0 allowed: o = 0, lse = -inf). GQA: Hq a multiple of Hkv. D = 128; bf16 or fp16.
    scale: default D^-0.5; softcap: scores s -> softcap tanh(s / softcap). max_seqlen: an upper bound on
    cache_seqlens the split is planned for (default the cache's capacity), so a CUDA graph stays valid while the
    lengths change below it. scheduler: `SplitKVScheduler()` (default) or `StreamKScheduler()`.
    Returns o (q's shape and dtype), and with return_lse also lse (fp32, natural log, q's shape without D).
    `out=(o, lse)` writes into given tensors (lse may be None). `ck.last_plan()` explains the split.
    """
    check_no_grad("decode_attention", q=q, k_cache=k_cache, v_cache=v_cache)
    B, Sq, Hq, Hkv, D, paged, bound = validate(q, k_cache, v_cache, cache_seqlens, page_table, scale, softcap,
                                               max_seqlen)
    device = check_cuda(q=q, k_cache=k_cache, v_cache=v_cache, cache_seqlens=cache_seqlens, page_table=page_table)
    device_arch(device)   # sm_90a (wgmma) or sm_100a (tcgen05); any other arch raises, naming the supported ones
    q4 = q if q.dim() == 4 else q[:, None]
    o4, lse3 = _outputs(out, q, q4, return_lse)
    group = Hq // Hkv
    schedule, config, (splits, unit_blocks) = plan_decode(B, Hkv, group, Sq, bound, paged, softcap is not None,
                                                          sm_count(device), scheduler, device_kind(device))
    last.record(lambda: explain_plan(schedule, config))
    if B == 0:
        return _result(o4, lse3, q, return_lse, out)
    slots = schedule.segmentation.total_segments
    o_part = torch.empty((slots, DECODE_ROWS, D), dtype=q.dtype, device=device)   # normalized: |o| <= max |v|
    lse_part = torch.empty((slots, DECODE_ROWS), dtype=torch.float32, device=device)
    no_pages = page_table if paged else cache_seqlens.view(1, B)[:, :1]
    fn = build_decode(config, q.dtype).fn
    fn(q4, k_cache, v_cache, cache_seqlens, no_pages, o4, lse3, o_part, lse_part,
       counters(B * Hkv, device), schedule.table_on(device), schedule.num_tiles, splits, unit_blocks,
       schedule.grid[0],
       float(scale) if scale is not None else D ** -0.5, float(softcap) if softcap is not None else 1.0)
    return _result(o4, lse3, q, return_lse, out)


def _outputs(out, q, q4, return_lse):
    """(o [B, Sq, Hq, D], lse [B, Sq, Hq] fp32): new, or the user's `out=(o, lse)` checked (lse None: scratch)."""
    lse_shape = tuple(q4.shape[:3])
    if out is None:
        return torch.empty_like(q4), torch.empty(lse_shape, dtype=torch.float32, device=q.device)
    if not isinstance(out, (tuple, list)) or len(out) != 2:
        raise TypeError("out must be a tuple (o, lse) (lse may be None)")
    o, lse = out
    check_tensor("out[o]", o, dtypes=(q.dtype,))
    check_shape("out[o]", o, tuple(q.shape))
    if lse is None:
        lse = torch.empty(lse_shape, dtype=torch.float32, device=q.device)
    else:
        check_tensor("out[lse]", lse, dtypes=(torch.float32,), align=4)
        check_shape("out[lse]", lse, tuple(q.shape[:-1]))
    return (o if o.dim() == 4 else o[:, None]), (lse if lse.dim() == 3 else lse[:, None])


def _result(o4, lse3, q, return_lse, out):
    """o (and lse) in q's layout: the user's own tensors when `out` gave them."""
    o = out[0] if out is not None else (o4 if q.dim() == 4 else o4[:, 0])
    if not return_lse:
        return o
    if out is not None and out[1] is not None:
        return o, out[1]
    return o, (lse3 if q.dim() == 4 else lse3[:, 0])


__all__ = ["decode_attention", "plan_decode", "validate"]
