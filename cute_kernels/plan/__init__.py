"""The planner: for one call of the chunked forward, which path runs, how its work is split, which merge joins the
segments, and why -- one cached `ForwardPlan` per (op, shape, options, device kind).

    plan = plan_forward(kda, B, T, H, cu, init, sms, device_kind, scheduler, options)
    plan.path(capturing)        # "fused", "two_phase" or "overlap"
    plan.explain(capturing)     # the decision and both predictions

Paths (docs/design.md): `fused` (one kernel walks each (sequence, head[, segment])'s chunks), `two_phase` (phase 1
over every chunk in parallel, then the state pass, segmented where that pays), `overlap` (both phases at once).
`auto` takes the cheaper of the cost model's predictions (`cost.py`): by max(host, GPU) time for an eager call, by
GPU time under CUDA-graph capture, so a plan holds both choices.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from schedulers import Problem, Schedule, SegmentScheduler, segmented_cost_us, summary_schedule

from ..kernels.configs import MERGE_IMPLS, merge_fits
from . import cost
from .cost import OVERLAP_MARGIN, TWO_PHASE_MARGIN, calibration

PATHS = ("auto", "fused", "two_phase")
OVERLAP_MODES = ("auto", "never", "always")


@dataclass(frozen=True)
class PlanOptions:
    """What a caller may pin. path: `auto` (the cost model), `fused` or `two_phase` (default: CUTE_KERNELS_PATH);
    overlap: `auto` (where the model prefers it, under path `auto` only), `never` or `always` (wherever it fits, also
    under path `two_phase`); merge: an affine-merge impl, else the planner's."""

    path: str = field(default_factory=lambda: os.environ.get("CUTE_KERNELS_PATH", "auto"))
    overlap: str = "auto"
    merge: str | None = None

    def __post_init__(self):
        if self.path not in PATHS:
            raise ValueError(f"path (CUTE_KERNELS_PATH) must be one of {PATHS}, got {self.path!r}")
        if self.overlap not in OVERLAP_MODES:
            raise ValueError(f"overlap must be one of {OVERLAP_MODES}, got {self.overlap!r}")


def merge_impl_for(num_seqs: int, num_heads: int, k_dim: int, v_dim: int, sms: int, forced: str | None = None) -> str:
    """The affine merge a call of these sizes runs: while the 8-column grid fits one CTA per SM, regs (K = 128)
    else prefetch; beyond it tc (K = 128) else staged; where that one does not handle V, the first that does.
    `forced` picks one (it must handle K and V)."""
    if forced is not None:
        fits = [forced] if merge_fits(forced, k_dim, v_dim) else []
    else:
        if (v_dim // 8) * num_heads * num_seqs <= sms:
            impl = "regs" if merge_fits("regs", k_dim, v_dim) else "prefetch"
        else:
            impl = "tc" if merge_fits("tc", k_dim, v_dim) else "staged"
        fits = [i for i in (impl,) + MERGE_IMPLS if merge_fits(i, k_dim, v_dim)]
    if k_dim > 128 or not fits:
        raise ValueError("affine_merge supports K in (32, 64, 96, 128) and V a multiple of 8"
                         + (f" (impl {forced!r}: see MergeConfig)" if forced else "") + f", got K={k_dim}, V={v_dim}")
    return fits[0]


@dataclass(eq=False)
class ForwardPlan:
    """One call shape's plan. `graph_path` is the GPU-time choice (what a CUDA-graph capture runs), `eager_path`
    the max(host, GPU) one; `segments` the state pass's segment count on the two-phase path (1 when overlapped);
    `fused_schedule` / `fused_summary` the fused path's tile tables (`fused_summary` None when unsplit)."""

    kda: bool
    shape: tuple        # (B, T, H)
    cu: tuple | None    # cu_seqlens (B = 1), or None
    problem: Problem
    init: bool
    graph_path: str
    eager_path: str
    segments: int
    merge_impl: str
    fused_schedule: Schedule | None
    fused_summary: Schedule | None
    prep_tile_counts: list[int]
    prep_ctas_per_sm: int
    two_phase_us: float | None
    fused_us: float | None
    device_kind: str

    def path(self, capturing: bool) -> str:
        return self.graph_path if capturing else self.eager_path

    def explain(self, capturing: bool = True) -> str:
        """Which path runs (a captured call's, or with `capturing=False` an eager one's) and why."""
        ran = self.path(capturing)
        pred = ""
        if self.two_phase_us is not None:
            pred = f"predicted GPU time: two-phase {self.two_phase_us:.0f} us (" + (
                "overlapped: phase 1 and the state pass at once" if self.graph_path == "overlap" or
                (ran == "overlap") else f"state pass in {self.segments} segments") + ")"
        if self.fused_us is not None:
            pred += f", fused {self.fused_us:.0f} us; two-phase needs < {TWO_PHASE_MARGIN:.0%} of fused"
        if self.eager_path != self.graph_path:
            pred += (f"; eager calls take the {_words(self.eager_path)} path (host-bound), graph capture the "
                     f"{_words(self.graph_path)} one")
        pred += f"; costs: {self.device_kind}"
        n = self.problem.num_seqs
        if ran == "fused":
            head = self.fused_schedule.explain()
            return head + (f"\n- path: fused ({pred})" if self.two_phase_us is not None else "")
        if ran == "overlap":
            return (f"two-phase forward, overlapped: chunk_prep publishes each chunk, the state pass takes it at once"
                    f"\nsegments per sequence: 1 (all {n} sequences)\n- path: two-phase ({pred})")
        state = ("the state pass (summary launch, affine merge with the " + self.merge_impl + " merge, output "
                 "launch)") if self.segments > 1 else "the state pass"
        return (f"two-phase forward: chunk_prep over every chunk, then {state}\n"
                f"segments per sequence: {self.segments} (all {n} sequences)\n- path: two-phase ({pred})")


def _words(path: str) -> str:
    return {"fused": "fused", "two_phase": "two-phase", "overlap": "overlapped two-phase"}[path]


def problem_of(B: int, T: int, H: int, cu: tuple | None) -> Problem:
    return Problem.varlen(list(cu), H) if cu is not None else Problem.fixed(B, T, H)


def fused_schedules(problem: Problem, kda: bool, init: bool, sms: int, link_us: float, scheduler,
                    device_kind: str) -> tuple[Schedule, Schedule | None]:
    """The fused path's output schedule and, if segmented, its summary launch's (not the last segment's; the first
    segment's M only with an initial state). `scheduler` None: a SegmentScheduler whose count minimizes the fused
    kernel's predicted time."""
    if scheduler is None:
        seg_cost = cost.fused_segment_cost(calibration(device_kind), kda, link_us, init)
        scheduler = SegmentScheduler(min_chunks=2, cost=seg_cost)
    schedule = scheduler.schedule(problem, sm_count=sms, ctas_per_sm=1)
    if schedule.segmentation.total_segments == problem.num_seqs:
        return schedule, None
    blocks2 = Problem(problem.seq_lens, problem.seq_starts, problem.num_heads, problem.chunk_size, num_blocks=2)
    return schedule, summary_schedule(blocks2, schedule.segmentation, first_m=init)


_plans: dict = {}


def plan_forward(kda: bool, B: int, T: int, H: int, cu: tuple | None, init: bool, sms: int, device_kind: str,
                 scheduler=None, options: PlanOptions | None = None) -> ForwardPlan:
    """The plan of one call shape (cached). `scheduler` (from `schedulers`): the fused path's decomposition --
    an explicit one keeps the fused kernel unless the path is pinned to two-phase, where a
    `SegmentScheduler(num_segments=n)` sets the state pass's segment count."""
    options = options or PlanOptions()
    key = (kda, B, T, H, cu, init, sms, device_kind, scheduler, options)
    hit = _plans.get(key)
    if hit is not None:
        return hit
    cal = calibration(device_kind)
    problem = problem_of(B, T, H, cu)
    merge = merge_impl_for(problem.num_seqs, H, 128, 128, sms, options.merge)
    link = cal.merge_link_us[merge]
    path = "fused" if options.path == "fused" or (options.path == "auto" and scheduler is not None) else options.path
    if device_kind == "SM100":   # SM100 builds the fused kernel only (docs/design.md, "SM100")
        if path == "two_phase":
            raise ValueError("path='two_phase' (CUTE_KERNELS_PATH): SM100 has the fused path only")
        path = "fused"
    fused, summary = (None, None)
    if path != "two_phase":
        fused, summary = fused_schedules(problem, kda, init, sms, link, scheduler, device_kind)
    two_us = fused_us = None
    n = 1
    graph = eager = "fused"
    if path != "fused":
        forced = scheduler.num_segments if isinstance(scheduler, SegmentScheduler) else None
        n = forced or cost.two_phase_segments(cal, problem, kda, init, sms, link)
        two_us = cost.two_phase_us(cal, problem, [n] * problem.num_seqs, kda, init, sms, link)
        two = "two_phase"
        # a pinned two-phase path (or segment count) is the plain one unless overlap is "always"
        may_overlap = cu is None and cost.overlap_fits(B, H, sms) and (
            options.overlap == "always" or (options.overlap == "auto" and path == "auto" and forced is None))
        if may_overlap:
            t_ov = cost.overlap_us(cal, problem, kda, sms)
            if options.overlap == "always" or t_ov < OVERLAP_MARGIN * two_us:
                two, n, two_us = "overlap", 1, t_ov
        graph = eager = two
        if path == "auto":
            split = fused.segmentation.total_segments > problem.num_seqs
            fused_us = (segmented_cost_us(problem, fused.segmentation, cost.fused_segment_cost(cal, kda, link, init),
                                          sms) + cal.fused_launch_us[cost.op_key(kda)])
            e_fused = max(fused_us, cost.host_us(cal, False, 3 if split else 1))
            e_two = max(two_us, cost.host_us(cal, True, 4 if n > 1 else 2))
            graph = two if two_us < TWO_PHASE_MARGIN * fused_us else "fused"
            eager = two if e_two < TWO_PHASE_MARGIN * e_fused else "fused"
    counts = cost.prep_tile_counts(problem, kda, sms)
    tiles = sum(c * H for c in counts)
    plan = ForwardPlan(kda, (B, T, H), cu, problem, init, graph, eager, n, merge, fused, summary, counts,
                       cost.prep_ctas_per_sm(kda, tiles, sms), two_us, fused_us, cal.name)
    if len(_plans) > 512:
        _plans.clear()
    _plans[key] = plan
    return plan


__all__ = ["ForwardPlan", "PlanOptions", "merge_impl_for", "plan_forward", "problem_of"]
