"""The ops' host orchestration on the CPU, fused path: the kernel launches are float64 emulators of the kernels'
contracts (tests/emulation.py), so argument order, views, the summary layout (h_ext, M) and the merge wiring of
the segmented fused path are checked without a GPU. (tests/test_two_phase.py covers the two-phase path.)"""

import pytest
import torch
import torch.nn.functional as F
from emulation import emulate
from inputs import GATE_REGIMES, initial_state, make_inputs

import cute_kernels.ops.linear_attention as la
from cute_kernels import reference as ref
from cute_kernels.kernels.configs import FusedConfig, MergeConfig
from cute_kernels.paths.fused import FusedRun
from cute_kernels.plan import PlanOptions
from schedulers import SegmentScheduler

FUSED = PlanOptions(path="fused")


@pytest.fixture
def builds(monkeypatch):
    monkeypatch.setattr(FusedRun, "poison", True)   # summary slots never written must never be read
    return emulate(monkeypatch)


def call(kda, q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None,
         l2norm=False, scheduler=None, out=None, options=FUSED):
    return la.forward(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, l2norm, scheduler,
                      out, kda=kda, options=options)


def rel(a, b):
    return ((a.double() - b).norm() / b.norm()).item()


def fused_modes(builds):
    return [b.mode for b in builds if isinstance(b, FusedConfig)]


@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
@pytest.mark.parametrize("segments", [None, 3])
@pytest.mark.parametrize("varlen", [False, True])
@pytest.mark.parametrize("with_init", [True, False])
@pytest.mark.parametrize("regime", GATE_REGIMES)
def test_forward_orchestration(builds, kda, segments, varlen, with_init, regime):
    gen = torch.Generator().manual_seed(7 + kda + 2 * varlen + 4 * GATE_REGIMES.index(regime))
    if varlen:
        cu = [0, 70, 70, 300]
        q, k, v, g, beta = make_inputs(1, 300, 2, gen, kda=kda, regime=regime)
        cut = torch.tensor(cu)
        N = 3
    else:
        q, k, v, g, beta = make_inputs(2, 200, 2, gen, kda=kda, regime=regime)
        cut, N = None, 2
    s0 = initial_state(N, 2, gen) if with_init else None
    sched = None if segments is None else SegmentScheduler(num_segments=segments, min_chunks=1)
    o, s = call(kda, q, k, v, g, beta, initial_state=s0, output_final_state=True, cu_seqlens=cut, scheduler=sched)
    want_o, want_s = ref.chunk_gated_delta_rule_ref(q, k, v, g, beta, initial_state=s0, output_final_state=True,
                                                   cu_seqlens=cut)
    assert fused_modes(builds) == (["forward"] if segments is None else ["summary", "segment_outputs"])
    assert rel(o, want_o) < 5e-3  # bf16 output rounding
    assert rel(s, want_s) < 1e-5


@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
@pytest.mark.parametrize("regime", ["weak", "zero"])
@pytest.mark.parametrize("with_init", [True, False])
@pytest.mark.parametrize("merge", ["regs", "tc"])
def test_long_segmented_orchestration(builds, kda, regime, with_init, merge):
    """A long sequence (T = 4100, not a multiple of 64) in 8 segments with weak or zero decay: the summaries, the
    merge (each impl the planner picks) and each segment's start state decide most of the output."""
    gen = torch.Generator().manual_seed(3 + kda + 2 * with_init + 4 * (regime == "zero"))
    q, k, v, g, beta = make_inputs(1, 4100, 2, gen, kda=kda, regime=regime)
    s0 = initial_state(1, 2, gen) if with_init else None
    o, s = call(kda, q, k, v, g, beta, initial_state=s0, output_final_state=True,
                scheduler=SegmentScheduler(num_segments=8, min_chunks=1), options=PlanOptions("fused", merge=merge))
    want_o, want_s = ref.chunk_gated_delta_rule_ref(q, k, v, g, beta, initial_state=s0, output_final_state=True)
    assert fused_modes(builds) == ["summary", "segment_outputs"]
    assert [b.impl for b in builds if isinstance(b, MergeConfig)] == [merge]
    assert rel(o, want_o) < 5e-3 and rel(s, want_s) < 1e-5


@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
@pytest.mark.parametrize("segments", [None, 3])
def test_call_options_orchestration(builds, kda, segments):
    """The options every path must honour, with weak gates: a non-default scale, use_qk_l2norm_in_kernel on raw
    q and k, output_final_state=False (the final state neither returned nor stored in a given tensor), fp32 beta."""
    gen = torch.Generator().manual_seed(17 + kda)
    sched = None if segments is None else SegmentScheduler(num_segments=segments, min_chunks=1)
    q, k, v, g, beta = make_inputs(2, 200, 2, gen, kda=kda, regime="weak")
    s0 = initial_state(2, 2, gen)
    o, s = call(kda, q, k, v, g, beta, scale=0.3, initial_state=s0, output_final_state=True, scheduler=sched)
    want_o, want_s = ref.chunk_gated_delta_rule_ref(q, k, v, g, beta, scale=0.3, initial_state=s0,
                                                   output_final_state=True)
    assert rel(o, want_o) < 5e-3 and rel(s, want_s) < 1e-5
    qr, kr, v, g, beta = make_inputs(2, 200, 2, gen, kda=kda, regime="weak", normalize=False)
    o, s = call(kda, qr, kr, v, g, beta, initial_state=s0, output_final_state=True, l2norm=True, scheduler=sched)
    qn, kn = (F.normalize(x.float(), dim=-1).to(x.dtype) for x in (qr, kr))
    want_o, want_s = ref.chunk_gated_delta_rule_ref(qn, kn, v, g, beta, initial_state=s0, output_final_state=True)
    assert rel(o, want_o) < 5e-3 and rel(s, want_s) < 1e-5
    o_out = torch.full_like(v, float("nan"))
    o, s = call(kda, q, k, v, g, beta, initial_state=s0, scheduler=sched, out=(o_out, None))
    want_o, _ = ref.chunk_gated_delta_rule_ref(q, k, v, g, beta, initial_state=s0)
    assert s is None and o is o_out and rel(o, want_o) < 5e-3
    q, k, v, g, beta = make_inputs(2, 200, 2, gen, kda=kda, regime="weak", beta_dtype=torch.float32)
    o, s = call(kda, q, k, v, g, beta, initial_state=s0, output_final_state=True, scheduler=sched)
    want_o, want_s = ref.chunk_gated_delta_rule_ref(q, k, v, g, beta, initial_state=s0, output_final_state=True)
    assert rel(o, want_o) < 5e-3 and rel(s, want_s) < 1e-5


def test_auto_segments(builds):
    """scheduler=None on the fused path: the cost model's segment count (plan visible in last_plan()); a call
    whose split would not pay runs the single forward launch."""
    from cute_kernels.plan import cost
    from schedulers import Problem, plan_segments_by_cost

    gen = torch.Generator().manual_seed(1)
    q, k, v, g, beta = make_inputs(1, 1024, 2, gen)
    o, s = call(False, q, k, v, g, beta, output_final_state=True)
    want_o, want_s = ref.chunk_gated_delta_rule_ref(q, k, v, g, beta, output_final_state=True)
    cal = cost.calibration("H200")
    plan = plan_segments_by_cost(Problem.fixed(1, 1024, 2), 132,
                                 cost.fused_segment_cost(cal, False, cal.merge_link_us["regs"], False), min_chunks=2)
    n = plan.segments[0]
    assert n > 1
    assert fused_modes(builds) == ["summary", "segment_outputs"]
    assert f"segments per sequence: {n} (all 1)" in la.explain_last()
    assert rel(s, want_s) < 1e-5 and rel(o, want_o) < 5e-3
    # 4 chunks: two 2-chunk segments cost a summary launch, a merge link and two launches more than they save.
    builds.clear()
    q, k, v, g, beta = make_inputs(1, 256, 2, gen)
    call(False, q, k, v, g, beta)
    assert fused_modes(builds) == ["forward"]


def test_no_final_state_and_out_checks(builds):
    gen = torch.Generator().manual_seed(2)
    q, k, v, g, beta = make_inputs(1, 100, 2, gen)
    o, s = call(False, q, k, v, g, beta)
    assert s is None and o.shape == v.shape
    with pytest.raises(ValueError, match=r"out\[o\] must have shape"):
        call(False, q, k, v, g, beta, out=(torch.empty(1, 99, 2, 128, dtype=q.dtype), None))
    with pytest.raises(TypeError, match=r"out\[final_state\] must have dtype"):
        call(False, q, k, v, g, beta, output_final_state=True,
             out=(torch.empty_like(v), torch.empty(1, 2, 128, 128, dtype=torch.float64)))


def test_empty_sequence_batch(builds):
    """T = 0: no launch; the final state is the initial state (zeros without one)."""
    gen = torch.Generator().manual_seed(3)
    q, k, v, g, beta = make_inputs(2, 0, 2, gen, kda=True)
    s0 = torch.randn(2, 2, 128, 128, generator=gen)
    o, s = call(True, q, k, v, g, beta, initial_state=s0, output_final_state=True)
    assert o.shape == (2, 0, 2, 128) and torch.equal(s, s0) and builds == []
    o, s = call(True, q, k, v, g, beta, output_final_state=True)
    assert torch.equal(s, torch.zeros_like(s0))


@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
@pytest.mark.parametrize("path", ["fused", "fused_segments", "two_phase"])
def test_gate_arguments_reach_the_kernels(monkeypatch, kda, path):
    """FLA's gate arguments applied in the kernels' loads (`gate_arguments` -> each build's `GateForm` and the
    launch's (A_log, dt_bias, lower_bound)): every path's emulated kernels give the float64 reference on the gates
    the spec computes, and the builds carry the form."""
    from emulation import emulate

    builds = emulate(monkeypatch)
    gen = torch.Generator().manual_seed(41 + kda)
    q, k, v, _, beta_raw = make_inputs(2, 200, 2, gen, kda=kda)
    g_raw = torch.randn((2, 200, 2, 128) if kda else (2, 200, 2), generator=gen)
    beta_raw = torch.randn(2, 200, 2, generator=gen).to(q.dtype)
    A_log, dt_bias = torch.rand(2, generator=gen) - 2, 0.5 * torch.randn((2, 128) if kda else (2,), generator=gen)
    lb = -4.0 if kda else None
    gate = la.gate_arguments(g_raw, beta_raw, kda, True, A_log, dt_bias, lb, True, True)
    g_log, beta = la.gate_inputs(g_raw, beta_raw, kda, True, A_log, dt_bias, lb, True, True)
    s0 = initial_state(2, 2, gen)
    options = {"fused": FUSED, "fused_segments": FUSED, "two_phase": PlanOptions(path="two_phase")}[path]
    sched = SegmentScheduler(num_segments=3, min_chunks=1) if path == "fused_segments" else None
    o, s = la.forward(q, k, v, g_raw, beta_raw, None, s0, True, None, False, sched, None, kda=kda, options=options,
                      gate=gate)
    want_o, want_s = ref.chunk_gated_delta_rule_ref(q, k, v, g_log, beta, initial_state=s0, output_final_state=True)
    # (two-phase: phase 1's terms are bf16 in the emulation too)
    assert rel(o, want_o) < 1e-2 and rel(s, want_s) < (5e-3 if path == "two_phase" else 1e-4)
    forms = {b.gate for b in builds if hasattr(b, "gate")}
    assert forms == {gate[0]} and gate[0].beta == "sigmoid2" and gate[0].g == ("bounded" if kda else "softplus")
