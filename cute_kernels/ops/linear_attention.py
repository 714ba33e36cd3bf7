"""FLA-compatible ops: `chunk_gated_delta_rule` (GDN, scalar decay) and `chunk_kda` (per-channel decay).

Layouts follow flash-linear-attention 0.6: q, k `[B, T, H, K]`, v `[B, T, H, V]`, beta `[B, T, H]`,
g `[B, T, H]` (GDN) or `[B, T, H, K]` (KDA) per-step natural-log decay, states `[N, H, K, V]` fp32 where
N = B, or N = len(cu_seqlens) - 1 with B == 1 (varlen). Returns (o `[B, T, H, V]` in q's dtype,
final_state or None).
"""

from __future__ import annotations

import os

import torch

from ..runtime import arch as _arch
from . import merge as _merge
from .checks import check_cuda, check_shape, check_tensor

IO_DTYPES = (torch.bfloat16, torch.float16)
SUPPORTED_HEAD_DIMS = (128,)


def validate_inputs(q, k, v, g, beta, initial_state, cu_seqlens, kda: bool, scale):
    """Check everything on the host; returns (B, T, H, K, V, N, cu) with cu the cu_seqlens values as a tuple
    (or None). Every error names the argument."""
    check_tensor("q", q, dtypes=IO_DTYPES, ndim=4)
    B, T, H, K = q.shape
    check_tensor("k", k, dtypes=(q.dtype,), ndim=4)
    check_shape("k", k, (B, T, H, K))
    check_tensor("v", v, dtypes=(q.dtype,), ndim=4)
    V = v.shape[-1]
    check_shape("v", v, (B, T, H, V))
    if K not in SUPPORTED_HEAD_DIMS or V not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head dims K={K}, V={V} are not supported: supported are {SUPPORTED_HEAD_DIMS}")
    check_tensor("g", g, dtypes=(torch.float32, q.dtype), ndim=4 if kda else 3)
    check_shape("g", g, (B, T, H, K) if kda else (B, T, H))
    check_tensor("beta", beta, dtypes=(torch.float32, q.dtype), ndim=3, align=4)
    check_shape("beta", beta, (B, T, H))
    if scale is not None and not (isinstance(scale, (int, float)) and scale > 0):
        raise ValueError(f"scale must be a positive number or None, got {scale!r}")
    if cu_seqlens is not None:
        if not isinstance(cu_seqlens, torch.Tensor):
            raise TypeError(f"cu_seqlens must be a torch.Tensor, got {type(cu_seqlens).__name__}")
        if cu_seqlens.dtype not in (torch.int32, torch.int64) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
            raise TypeError(f"cu_seqlens must be a 1-D int32/int64 tensor with >= 2 entries, got "
                            f"{cu_seqlens.dtype} {tuple(cu_seqlens.shape)}")
        if B != 1:
            raise ValueError(f"cu_seqlens needs B == 1 (packed sequences), got B={B}")
        vals = cu_seqlens.tolist()  # one host read: the schedule is built from the lengths anyway
        if vals[0] != 0 or any(b < a for a, b in zip(vals, vals[1:])) or vals[-1] != T:
            raise ValueError(f"cu_seqlens must start at 0, be non-decreasing and end at T={T}, got "
                             f"{vals[:6]}{'...' if len(vals) > 6 else ''}")
        N = len(vals) - 1
        cu = tuple(vals)
    else:
        N = B
        cu = None
    if initial_state is not None:
        check_tensor("initial_state", initial_state, dtypes=(torch.float32,), ndim=4)
        check_shape("initial_state", initial_state, (N, H, K, V))
    check_cuda(q=q, k=k, v=v, g=g, beta=beta, initial_state=initial_state,
               cu_seqlens=cu_seqlens if cu_seqlens is not None and cu_seqlens.is_cuda else None)
    return B, T, H, K, V, N, cu


_CHECK_GATES = os.environ.get("CUTE_KERNELS_CHECK_GATES", "0") == "1"


def _sm_count(device) -> int:
    return _merge.sm_count(device)


# scheduler=None: with AUTO_SEGMENTS, a SegmentScheduler whose segment count per call minimizes the predicted
# time of the segmented path (`plan_segments_by_cost` with the costs below; N = 1 whenever splitting does not pay,
# which is every call whose tiles fill the GPU); without, SequenceScheduler(). Env CUTE_KERNELS_AUTO_SEGMENTS=0/1.
# On by default since the whole GPU suite (tests/test_gdn_sm90.py, tests/test_segmented.py) passed with it on
# (H200, 2026-12-02, 69 passed).
AUTO_SEGMENTS = os.environ.get("CUTE_KERNELS_AUTO_SEGMENTS", "1") == "1"
# Measured on the H200 (NOTES.md, 2026-12-02): one CTA's time per chunk of the SM90 kernel (GDN, KDA; K = V = 128)
# and the affine merge's time per segment along a sequence, per merge variant. With these the model predicted the
# segmented GDN at B=1 H=4 within 5% (T=1024/4096/8192: 77/146/247 us predicted, 81/146/249 us measured).
# KDA: 16.4 us with KDA_VEC and KDA_PREFETCH on (scripts/gdn_profile.py kda, B=16 H=64 T=4096; 26.0 without).
# GDN re-measured with the vectorized solve (2026-12-03, session 10, `scripts/time_two_phase.py paths`): 3552 us at
# B=16 H=64 T=4096 (8 waves x 64 chunks: 6.9 us), 470 us at B=4 H=32 T=4096 (one wave: 7.3 us) -> 7.2. KDA
# (session 11, `scripts/time_two_phase.py pair`, the op at B=8 H=16 T=4096 on the fused path: 962 and 975 us for
# one wave of 64 chunks) -> 15.1 (was 16.4 before the vectorized solve; no "auto" choice on the seed grid changes).
CHUNK_US = {False: 7.2, True: 15.1}
# The fused launch's fixed cost on top of its chunks (prologue, first loads, launch), GDN on the H200 (session 12,
# graph replay, B=1 H=4): T=64 12.5 us for one chunk, T=128 19.1 us for two -> ~5 us. Without it "auto" took the
# fused path at T = 128 (predicted 14 us, measured 19.1) where the two-phase one takes 13.3 (session 10's table,
# measured while CHUNK_US was still 9.5; the same choices as then on the seed grid). KDA: none -- its fused times at
# small T are not linear in chunks (T=64 20.8 us, T=128 20.3) and its choices there were measured as they are.
FUSED_LAUNCH_US = {False: 5.0, True: 0.0}
# "auto" takes the two-phase path only where its predicted time is under this fraction of the fused kernel's: the
# models fit measured times within ~5-10%, and inside that band the fused kernel (one launch, no phase-1 terms in
# memory) is the safer choice (GDN at B*H = 128: two-phase predicted 0.97-1.03x of fused, measured never).
TWO_PHASE_MARGIN = 0.95
# ring measured slower than prefetch (scripts/time_merges.py: 139.7 vs 125.3 us for 32 segments x 4 heads).
# tc: staged's 7.6 times their measured ratio with many chains (50.4 / 100.0 us, 4 x 8 segments x 16 heads).
# regs: 1.71-2.1 us per segment (scripts/time_merges.py, 32 x 4 heads and 8 x 8 heads).
MERGE_LINK_US = {"simt": 23.8, "staged": 7.6, "prefetch": 3.9, "ring": 4.4, "regs": 1.8, "tc": 3.8}
_auto_schedulers: dict = {}


def auto_scheduler(kda: bool, num_seqs: int = 1, num_heads: int = 1, sms: int = 132, initial_state: bool = False):
    """The scheduler `scheduler=None` stands for (see AUTO_SEGMENTS); the merge variant, and so the link cost,
    depends on the number of (sequence, head) pairs; an initial state adds the first segment's M summary."""
    from schedulers import SegmentCost, SegmentScheduler, SequenceScheduler

    if not AUTO_SEGMENTS:
        return SequenceScheduler()
    impl = _merge.merge_impl_for(num_seqs, num_heads, 128, 128, sms)
    key = (kda, impl, initial_state)
    sched = _auto_schedulers.get(key)
    if sched is None:
        cost = SegmentCost(chunk_us=CHUNK_US[kda], link_us=MERGE_LINK_US[impl], first_m=initial_state)
        sched = _auto_schedulers[key] = SegmentScheduler(min_chunks=2, cost=cost)
    return sched


def _schedule(scheduler, B, T, H, cu_seqlens, device, kda: bool = False, init: bool = False):
    """The work tiles of this call (host side; cached per (scheduler, shape) by the Schedule's table): the output
    launch's schedule and, if segmented, the summary launch's (None otherwise)."""
    from schedulers import Problem

    problem = Problem.varlen(cu_seqlens, H) if cu_seqlens is not None else Problem.fixed(B, T, H)
    sms = _sm_count(device)
    if scheduler is None:
        scheduler = auto_scheduler(kda, problem.num_seqs, H, sms, init)
    schedule = scheduler.schedule(problem, sm_count=sms, ctas_per_sm=1)
    if schedule.segmentation.total_segments == problem.num_seqs:
        return schedule, None
    # Segmented: a summary launch with two column blocks per tile (h_ext, M) over the same segmentation, for the
    # summaries some start state needs (not the last segment's; the first segment's M only with an initial state).
    from schedulers import summary_schedule

    blocks2 = Problem(problem.seq_lens, problem.seq_starts, H, problem.chunk_size, num_blocks=2)
    return schedule, summary_schedule(blocks2, schedule.segmentation, first_m=init)


_schedule_cache: dict = {}
_POISON_SUMMARIES = False   # tests set it: fill the segmented path's summary buffer with NaN before each call
_last_schedule = None
_last_choice = None   # (PathChoice, took the two-phase path) of the last call under CUTE_KERNELS_TWO_PHASE auto/1
_dummies: dict = {}


def _dummy_state(device) -> torch.Tensor:
    """A [1, 1, 128, 128] fp32 placeholder for a state argument the compiled variant never touches."""
    t = _dummies.get(device)
    if t is None:
        t = _dummies[device] = torch.empty((1, 1, 128, 128), dtype=torch.float32, device=device)
    return t


def last_plan() -> str | None:
    """How the last chunk_gated_delta_rule / chunk_kda call split its work (the schedule's `explain()`)."""
    if _last_choice is not None:
        choice, ran_two_phase = _last_choice
        return choice.explain(ran_two_phase)
    return None if _last_schedule is None else _last_schedule.explain()


class PathChoice:
    """`last_plan()` of a call under CUTE_KERNELS_TWO_PHASE=auto / 1: which path ran, its segment count and both
    predictions. `fused` is the fused path's Schedule (None when the path was forced)."""

    def __init__(self, two_phase: bool, num_segments: int, num_seqs: int, two_phase_us: float,
                 fused_us: float | None = None, fused=None, eager_two_phase: bool | None = None,
                 overlap: str = ""):
        self.two_phase, self.num_segments, self.num_seqs = two_phase, num_segments, num_seqs
        self.overlap = overlap   # the two-phase path runs overlapped (OVERLAP; one segment): its build, else ""
        self.two_phase_us, self.fused_us, self.fused = two_phase_us, fused_us, fused
        # the path of a call outside CUDA-graph capture, where the host's time per call may be the longer one
        self.eager_two_phase = two_phase if eager_two_phase is None else eager_two_phase

    def explain(self, ran_two_phase: bool | None = None) -> str:
        """Which path ran (`ran_two_phase`; default: the GPU-time choice) and why."""
        ran = self.two_phase if ran_two_phase is None else ran_two_phase
        pred = f"predicted GPU time: two-phase {self.two_phase_us:.0f} us (" + (
            f"overlapped, {self.overlap} build: phase 1 and the state pass at once" if self.overlap
            else f"state pass in {self.num_segments} segments") + ")"
        if self.fused_us is not None:
            pred += f", fused {self.fused_us:.0f} us; two-phase needs < {TWO_PHASE_MARGIN:.0%} of fused"
        if self.eager_two_phase != self.two_phase:
            pred += (f"; eager calls take the {'two-phase' if self.eager_two_phase else 'fused'} path (host-bound, "
                     f"see HOST_US), graph capture the {'two-phase' if self.two_phase else 'fused'} one")
        if not ran:
            return self.fused.explain() + "\n- path: fused (" + pred + ")"
        if self.overlap:
            return (f"two-phase forward, overlapped: chunk_prep publishes each chunk, the state pass takes it at once"
                    f"\nsegments per sequence: 1 (all {self.num_seqs} sequences)\n- path: two-phase ({pred})")
        state = "the state pass"
        if self.num_segments > 1:
            tp = _two_phase_module()
            state = ("the state pass in one pass (summaries with outputs, affine merge, correction; STATE_ONE_PASS"
                     + (", early correction on the regs / tc merge's published start states: STATE_EARLY_CORRECTION)"
                        if tp.STATE_EARLY_CORRECTION else ")")
                     if tp.STATE_ONE_PASS else
                     "the state pass in one launch (summaries, look-back chain, outputs; STATE_LOOKBACK)"
                     if tp.STATE_LOOKBACK else "the state pass (summary launch, affine merge, output launch)")
        return (f"two-phase forward: chunk_prep over every chunk, then {state}\n"
                f"segments per sequence: {self.num_segments} (all {self.num_seqs} sequences)\n- path: two-phase ({pred})")


def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                           cu_seqlens=None, use_qk_l2norm_in_kernel=False, scheduler=None, *, out=None):
    """Gated delta rule forward (GDN: one log-decay per head and token), FLA 0.6 semantics.

    `scheduler` (from `schedulers`) decides the work decomposition (default: one CTA per sequence and head).
    `out=(o, final_state)` writes into given tensors (final_state may be None). SM90 only for now.
    """
    return _forward(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                    use_qk_l2norm_in_kernel, scheduler, out, kda=False)


def chunk_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
              cu_seqlens=None, use_qk_l2norm_in_kernel=False, scheduler=None, *, out=None):
    """Kimi Delta Attention forward (one log-decay per key channel, g [B, T, H, K]), FLA 0.6 semantics.

    Any g <= 0 is accepted: the intra-chunk products never exponentiate a positive number (see
    cute_kernels/reference/kda_intra.py), so no lower bound is needed. g > 0 (growth, not decay) is outside the
    contract of both ops; it is not checked by default because the check is a pass over g: set
    CUTE_KERNELS_CHECK_GATES=1 to assert g <= 0 on the device (asynchronously, no host sync).
    Same extra arguments as `chunk_gated_delta_rule`. SM90 only for now.
    """
    return _forward(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                    use_qk_l2norm_in_kernel, scheduler, out, kda=True)


def _forward(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, use_qk_l2norm_in_kernel,
             scheduler, out, kda: bool):
    name = "chunk_kda" if kda else "chunk_gated_delta_rule"
    B, T, H, K, V, N, cu = validate_inputs(q, k, v, g, beta, initial_state, cu_seqlens, kda=kda, scale=scale)
    device = q.device
    if _arch.device_arch(device) != "sm_90a":
        raise NotImplementedError(f"{name} runs on SM90 (Hopper) only for now")
    if use_qk_l2norm_in_kernel:
        q = torch.nn.functional.normalize(q.float(), dim=-1).to(q.dtype)
        k = torch.nn.functional.normalize(k.float(), dim=-1).to(k.dtype)
    scale = float(scale) if scale is not None else K ** -0.5
    init = initial_state is not None
    if out is not None:
        o, final = out
        check_tensor("out[o]", o, dtypes=(q.dtype,), ndim=4)
        check_shape("out[o]", o, (B, T, H, V))
        if final is not None:
            check_tensor("out[final_state]", final, dtypes=(torch.float32,), ndim=4)
            check_shape("out[final_state]", final, (N, H, K, V))
    else:
        o = torch.empty_like(v)
        final = torch.empty((N, H, K, V), dtype=torch.float32, device=device) if output_final_state else None
    if T > 0 and N > 0:
        n = _two_phase_segments(scheduler, B, T, H, cu, device, kda, init)
        if n is not None:
            _two_phase_forward(q, k, v, g, beta, scale, initial_state, o, final, cu, n, kda, device,
                               _last_choice[0].overlap)
            return o, final if output_final_state else None
        if _last_choice is not None and _last_choice[0].two_phase:
            # An eager call that went fused where a CUDA-graph capture of it goes two-phase: build the two-phase
            # plans now (compiled kernels, tile tables copied to the GPU), since a capture cannot copy them.
            _two_phase_plans_ready(q, beta, B, T, H, cu, kda, init, final is not None, _last_choice[0].num_segments,
                                   device, _last_choice[0].overlap)
    key = (scheduler, B, T, H, cu, device, kda, init, AUTO_SEGMENTS, _merge.AFFINE_MERGE_IMPL)
    cached = _schedule_cache.get(key)
    if cached is None:
        cached = _schedule(scheduler, B, T, H, cu, device, kda, init)
        if len(_schedule_cache) > 256:
            _schedule_cache.clear()
        _schedule_cache[key] = cached
    schedule, summary_schedule = cached
    global _last_schedule
    _last_schedule = schedule
    store_final = final is not None
    if T == 0 or N == 0:
        if store_final:
            final.copy_(initial_state if initial_state is not None else torch.zeros_like(final))
        return o, final
    if _CHECK_GATES:
        torch._assert_async((g <= 0).all(), "g must be <= 0 (a log decay)")
    g32 = g if g.dtype == torch.float32 else g.float()
    dummy = final if store_final else _dummy_state(device)
    args = (q, k, v, g32, beta, o)   # 4-D / 3-D as given: the kernel flattens B and T itself
    # A sequence of zero tokens still has a tile (zero chunks): it copies its start state to its final state.
    if summary_schedule is None:
        compiled = compile_gdn_sm90(q.dtype, beta.dtype, init, store_final, schedule.persistent, kda)
        compiled.fn(*args, initial_state if init else dummy, dummy,
                    schedule.table_on(device), schedule.num_tiles, schedule.grid[0], scale)
        return o, final if output_final_state else None
    # Segmented forward: the summaries (h_ext, M) a start state needs, each from 0 / I (every segment but the last;
    # the first one's M only with an initial state); the affine merge into true start states; then every segment's
    # outputs from its start state, the last segment also storing the final state.
    from .merge import affine_merge

    slots = schedule.segmentation.total_segments
    summary = torch.empty((2 * slots, H, K, V), dtype=torch.float32, device=device)   # slots never written: unread
    if _POISON_SUMMARIES:   # tests: NaN in every slot the summary launch does not write must not reach a result
        summary.fill_(float("nan"))
    if summary_schedule.num_tiles:
        compiled = compile_gdn_sm90(q.dtype, beta.dtype, False, False, False, kda, mode="summary")
        compiled.fn(*args, summary, summary, summary_schedule.table_on(device), summary_schedule.num_tiles,
                    summary_schedule.grid[0], scale)
    starts, _ = affine_merge(summary[slots:], summary[:slots], schedule.seg_offsets, initial_state, starts_only=True)
    compiled = compile_gdn_sm90(q.dtype, beta.dtype, True, store_final, False, kda, mode="segment_outputs")
    compiled.fn(*args, starts, dummy, schedule.table_on(device), schedule.num_tiles, schedule.num_tiles, scale)
    return o, final if output_final_state else None


# The two-phase forward (ops/two_phase.py: a parallel chunk-prep kernel, then a state pass with segments chosen by
# its own cost model). Verified on the H200 (tests/test_two_phase.py, 2026-12-02) and faster than the fused path
# where B x H leaves SMs idle (scripts/time_two_phase.py: KDA B=1 H=4 T=8192 167 us vs fused 340, FLA 330).
# CUTE_KERNELS_TWO_PHASE: "auto" (default) takes the path the cost models predict faster when scheduler=None
# (an explicit scheduler keeps the fused kernel); "1" always two-phase (a SegmentScheduler(num_segments=n) then
# sets the state pass's segment count); "0" never.
TWO_PHASE = os.environ.get("CUTE_KERNELS_TWO_PHASE", "auto")
# The overlapped two-phase path (two_phase.OverlapPlan: phase 1 on a side stream publishing each chunk, the state
# pass consuming it on SMs phase 1 leaves free; fixed-length batches whose 2 B H state CTAs fit in half the SMs).
# CUTE_KERNELS_OVERLAP: "auto" (default) takes it where `predicted_overlap_us` beats the planned two-phase time,
# "1" wherever it fits (the state pass then in one segment), "0" never. Measured (H200, session 19, graph replay,
# `scripts/time_two_phase.py overlap`, once the state pass looked at 32 flags at a time): KDA B=1 H=16 T=4096 172.1
# -> 150.9 us, T=8192 306.2 -> 281.0; GDN B=1 H=16 T=4096 110.5 -> 103.9, T=8192 188.3 -> 193.0 (slower); B=1 H=8
# T=8192 slower for both (a 5-segment plan wins there); the GPU tests (reference, run-to-run and plain-path
# bitwise equality, flags back at 0) passed.
OVERLAP = os.environ.get("CUTE_KERNELS_OVERLAP", "auto")
# "auto" takes the overlapped path only where its prediction is at least 5% below the plain path's: the plain
# model runs 7-15% high for GDN since the tf32 solve (session 19: B=1 H=16 T=8192 predicted 201, measured 188.3;
# the overlapped path 198 / 193.0), so a bare comparison would move cells where the two measure within ~3%.
OVERLAP_MARGIN = 0.95
# An eager call (no CUDA-graph capture) takes max(host time, GPU time); "auto" then weighs each path by that.
# Host time per call on the H200 machine (scripts/host_overhead.py paths, 2026-12-03): the fused kernel alone
# 23 us (B=1 H=4 T=64, 9.8 us of GPU time), the two-phase path's two launches 38 us (T=64..256: 33.6-38.9 us
# eager, once its phase-1 terms stay in a kept workspace; 49 us before); each further launch (summary, merge)
# counted at the ~7 us the state pass's launch takes.
HOST_US = {False: 23.0, True: 38.0}
HOST_LAUNCH_US = 7.0


def _capturing(device) -> bool:
    """Whether this call is being captured into a CUDA graph (its host time then does not recur)."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def host_us(two_phase: bool, launches: int) -> float:
    """The host's time per eager call of one path with `launches` kernel launches (HOST_US)."""
    return HOST_US[two_phase] + HOST_LAUNCH_US * (launches - (2 if two_phase else 1))
_two_phase_plans: dict = {}


def _two_phase_mode() -> str:
    mode = {True: "1", False: "0"}.get(TWO_PHASE, TWO_PHASE)   # tests may set a bool
    if mode not in ("auto", "0", "1"):
        raise ValueError(f"CUTE_KERNELS_TWO_PHASE must be auto, 0 or 1, got {TWO_PHASE!r}")
    return mode


def _two_phase_segments(scheduler, B, T, H, cu, device, kda: bool, init: bool) -> int | None:
    """The state pass's segment count if this call takes the two-phase path, else None (host side, cached)."""
    global _last_choice
    _last_choice = None
    mode = _two_phase_mode()
    if mode == "0" or (mode == "auto" and scheduler is not None):
        return None
    key = (mode, scheduler if mode == "1" else None, B, T, H, cu, kda, init, AUTO_SEGMENTS, device,
           _two_phase_module().STATE_PAIR, _two_phase_module().state_pair(), _merge.AFFINE_MERGE_IMPL, OVERLAP,
           _two_phase_module().KDA_ROW_ANCHORS,
           _two_phase_module().GDN_RAW_QK, _two_phase_module().PREP_TRIO, _two_phase_module().OVERLAP_RAW,
           _two_phase_module().OVERLAP_FOLD, _two_phase_module().OVERLAP_SHARE,
           _two_phase_module().GDN_FOLD, _two_phase_module().KDA_FOLD, _two_phase_module().PREP_BALANCE,
           _two_phase_module().STATE_ONE_PASS,
           _two_phase_module().STATE_EARLY_CORRECTION)
    choice = _two_phase_plans.get(key)
    if choice is None:
        from schedulers import Problem, SegmentScheduler, segmented_cost_us

        from . import two_phase

        problem = Problem.varlen(list(cu), H) if cu is not None else Problem.fixed(B, T, H)
        sms = _sm_count(device)
        link = MERGE_LINK_US[_merge.merge_impl_for(problem.num_seqs, H, 128, 128, sms)]
        forced = getattr(scheduler, "num_segments", None) if isinstance(scheduler, SegmentScheduler) else None
        n = forced or two_phase.plan_num_segments(problem, kda, init, sms, link)
        t2 = two_phase.predicted_us(problem, [n] * problem.num_seqs, kda, init, sms, link)
        overlap = ""   # or the overlapped path's build (`two_phase.overlap_build`)
        # "auto" never overrides a segment count the caller forced (SegmentScheduler(num_segments=n))
        if OVERLAP != "0" and cu is None and two_phase.overlap_fits(B, H, sms) and (forced is None or OVERLAP == "1"):
            t_ov = two_phase.predicted_overlap_us(problem, kda, sms)
            if OVERLAP == "1" or t_ov < OVERLAP_MARGIN * t2:
                overlap, n, t2 = two_phase.overlap_build(problem, kda, sms), 1, t_ov
        if mode == "1":
            choice = PathChoice(True, n, problem.num_seqs, t2, overlap=overlap)
        else:
            from schedulers import SegmentCost

            fused, _ = _schedule(None, B, T, H, cu, device, kda, init)
            cost = SegmentCost(chunk_us=CHUNK_US[kda], link_us=link, first_m=init)
            t1 = segmented_cost_us(problem, fused.segmentation, cost, sms) + FUSED_LAUNCH_US[kda]
            split1 = fused.segmentation.total_segments > problem.num_seqs
            e1 = max(t1, host_us(False, 3 if split1 else 1))
            e2 = max(t2, host_us(True, 4 if n > 1 else 2))
            choice = PathChoice(t2 < TWO_PHASE_MARGIN * t1, n, problem.num_seqs, t2, t1, fused,
                                eager_two_phase=e2 < TWO_PHASE_MARGIN * e1, overlap=overlap)
        if len(_two_phase_plans) > 256:
            _two_phase_plans.clear()
        _two_phase_plans[key] = choice
    two = choice.two_phase if _capturing(device) else choice.eager_two_phase
    _last_choice = (choice, two)
    return choice.num_segments if two else None


def _two_phase_module():
    """ops/two_phase.py (imported on first use: it imports this module back when it compiles)."""
    global _two_phase_mod
    if _two_phase_mod is None:
        from . import two_phase

        _two_phase_mod = two_phase
    return _two_phase_mod


_two_phase_mod = None


def _two_phase_forward(q, k, v, g, beta, scale, initial_state, o, final, cu, n, kda, device, overlap=False):
    """`_forward` through ops/two_phase.py with `n` segments of the state pass, into o (and final, if not None);
    `overlap`: the overlapped path (`two_phase.OverlapPlan`, one segment). The inputs are validated: the two
    phases' cached plans launch without checking them again."""
    two_phase = _two_phase_module()
    B, T, H, _ = k.shape
    g32 = g if g.dtype == torch.float32 else g.float()
    if overlap:
        plan = two_phase.overlap_plan(B, T, H, kda, q.dtype, beta.dtype, initial_state is not None,
                                      final is not None, device, _sm_count(device))
        plan.run(q, k, v, g32, beta, scale, initial_state, o, final)
        return
    prep = two_phase.prep_plan(B, T, H, cu, kda, q.dtype, beta.dtype, device).run(q, k, v, g32, beta, scale,
                                                                                   reuse=True)
    plan = two_phase.state_plan(B, T, H, cu, kda, q.dtype, initial_state is not None, final is not None, n, device,
                                prep.raw, prep.fold)
    plan.run(prep, initial_state, o, final)


def _two_phase_plans_ready(q, beta, B, T, H, cu, kda, init, store_final, n, device, overlap=False):
    """Build (once; cached) the two-phase plans `_two_phase_forward` would use for this call, without running."""
    two_phase = _two_phase_module()
    if overlap:
        two_phase.overlap_plan(B, T, H, kda, q.dtype, beta.dtype, init, store_final, device, _sm_count(device))
        return
    two_phase.prep_plan(B, T, H, cu, kda, q.dtype, beta.dtype, device)
    two_phase.state_plan(B, T, H, cu, kda, q.dtype, init, store_final, n, device)


# KDA's per-element passes in 16-byte vectors (`vec_elementwise`) and its gates prefetched one chunk ahead (g by
# cp.async into shared memory, beta in a register). Both on by default: the GPU suite passed with them (H200,
# 2026-12-02) and together they take KDA from 26.0 to 16.4 us per chunk per CTA (B=16 H=64 T=4096: 13.3 -> 8.4 ms).
# Env CUTE_KERNELS_KDA_VEC=0 / CUTE_KERNELS_KDA_PREFETCH=0 turn them off.
KDA_VEC = os.environ.get("CUTE_KERNELS_KDA_VEC", "1") == "1"
KDA_PREFETCH = os.environ.get("CUTE_KERNELS_KDA_PREFETCH", "1") == "1"

# Stages left out of the kernel, for timing by subtraction only (scripts/gdn_profile.py); results are wrong.
GDN_SKIP: tuple = ()


def compile_gdn_sm90(io_dtype: torch.dtype, beta_dtype: torch.dtype, has_initial_state: bool,
                     store_final_state: bool, persistent: bool = False, kda: bool = False, mode: str = "forward",
                     skip: tuple | None = None, dump_dir=None, vec: bool | None = None,
                     prefetch: bool | None = None):
    """Compile the SM90 gated-delta-rule forward (GDN, or KDA with `kda`) for one configuration (no GPU needed).
    KDA only: `vec` (default KDA_VEC) runs the per-element passes in 16-byte vectors; `prefetch` (default
    KDA_PREFETCH) loads the gates one chunk ahead."""
    from ..runtime.compile import DYN, compile_kernel, cutlass_dtype, fake_stream, fake_tensor

    skip = tuple(sorted(GDN_SKIP if skip is None else skip))
    vec = kda and (KDA_VEC if vec is None else vec)
    prefetch = kda and (KDA_PREFETCH if prefetch is None else prefetch)
    key = ("gdn_fwd_sm90", str(io_dtype), str(beta_dtype), has_initial_state, store_final_state, persistent, kda,
           mode, skip, vec, prefetch)

    def build():
        from schedulers.problem import NUM_TILE_FIELDS

        from ..runtime.arch import import_cutlass

        cutlass = import_cutlass()  # sets CUTE_DSL_ARCH before the kernel module imports cutlass
        from ..kernels.sm90.gdn_fwd import ChunkGatedDeltaRuleFwdSm90

        io, bt, f32 = cutlass_dtype(io_dtype), cutlass_dtype(beta_dtype), cutlass.Float32
        kernel = ChunkGatedDeltaRuleFwdSm90(io, bt, has_initial_state, store_final_state, persistent,
                                            kda=kda, mode=mode, skip=skip, vec_elementwise=vec,
                                            prefetch_gates=prefetch)
        args = (
            fake_tensor(io, (DYN, DYN, DYN, 128)),
            fake_tensor(io, (DYN, DYN, DYN, 128)),
            fake_tensor(io, (DYN, DYN, DYN, 128)),
            fake_tensor(f32, (DYN, DYN, DYN, 128) if kda else (DYN, DYN, DYN), align=4),
            fake_tensor(bt, (DYN, DYN, DYN), align=2),
            fake_tensor(io, (DYN, DYN, DYN, 128)),
            fake_tensor(f32, (DYN, DYN, 128, 128)),
            fake_tensor(f32, (DYN, DYN, 128, 128)),
            fake_tensor(cutlass.Int32, (DYN, NUM_TILE_FIELDS), align=4),
            cutlass.Int32(1),
            cutlass.Int32(1),
            f32(1.0),
            fake_stream(),
        )
        return kernel, args

    return compile_kernel(key, build, dump_dir=dump_dir)
