"""The planner (CPU): the path, segment and merge choices, the cost model's arithmetic, and `explain()`."""

import json
from pathlib import Path

import pytest

from cute_kernels.plan import PlanOptions, cost, merge_impl_for, plan_forward
from schedulers import Problem, SegmentScheduler

AUTO = PlanOptions(path="auto")


def test_choices_match_the_recorded_plans():
    """Every seed-grid cell (GDN and KDA, with and without an initial state on B*H = 4, 32, 256) and three varlen
    batches: the path a captured and an eager call take, the segments, and both predictions, as recorded from the
    planner the seed tables were measured with (`tests/data/planner_choices.json`, 132 SMs, H200 costs)."""
    rows = json.loads((Path(__file__).parent / "data" / "planner_choices.json").read_text())
    assert len(rows) == 398
    for r in rows:
        cu = tuple(r["cu"]) if r["cu"] is not None else None
        plan = plan_forward(r["kda"], r["B"], r["T"], r["H"], cu, r["init"], 132, "H200", None, AUTO)
        for capturing, key in ((True, "graph"), (False, "eager")):
            path, segments, two_us, fused_us = r[key]
            got = plan.path(capturing)
            assert got == path, (r, got)
            if got == "fused":
                assert [len(b) - 1 for b in plan.fused_schedule.segmentation.bounds] == segments, r
            else:
                assert plan.segments == segments, r
            assert plan.two_phase_us == pytest.approx(two_us, abs=1e-3), r
            assert plan.fused_us == pytest.approx(fused_us, abs=1e-3), r


def test_forced_paths_and_segments():
    """A pinned path; an explicit scheduler keeps the fused kernel under `auto`, and sets the state pass's
    segments when the path is pinned to two-phase; `overlap` modes."""
    assert plan_forward(False, 1, 8192, 4, None, False, 132, "H200", None, PlanOptions("fused")).path(True) == "fused"
    p = plan_forward(False, 16, 4096, 64, None, False, 132, "H200", None, PlanOptions("two_phase"))
    assert p.path(True) == p.path(False) == "two_phase" and p.fused_us is None
    # KDA B=1 H=16 T=8192: auto overlaps; a pinned two-phase path is the plain one unless overlap is "always"
    assert plan_forward(True, 1, 8192, 16, None, False, 132, "H200", None, AUTO).path(True) == "overlap"
    p = plan_forward(True, 1, 8192, 16, None, False, 132, "H200", None, PlanOptions("two_phase"))
    assert p.path(True) == p.path(False) == "two_phase"
    sched = SegmentScheduler(num_segments=4)
    p = plan_forward(False, 1, 8192, 4, None, False, 132, "H200", sched, AUTO)
    assert p.path(True) == "fused" and p.fused_schedule.segmentation.total_segments == 4
    p = plan_forward(False, 1, 8192, 4, None, False, 132, "H200", sched, PlanOptions("two_phase"))
    assert p.path(True) == "two_phase" and p.segments == 4
    p = plan_forward(True, 1, 8192, 16, None, False, 132, "H200", None, PlanOptions("two_phase", overlap="never"))
    assert p.path(True) == "two_phase" and p.segments > 1
    p = plan_forward(True, 1, 1024, 4, None, False, 132, "H200", None, PlanOptions("two_phase", overlap="always"))
    assert p.path(True) == "overlap" and p.segments == 1
    # varlen and grids past half the SMs never overlap
    p = plan_forward(True, 1, 4096, 4, (0, 1000, 4096), False, 132, "H200", None, PlanOptions(overlap="always"))
    assert p.path(True) != "overlap"
    p = plan_forward(True, 8, 4096, 8, None, False, 132, "H200", None, PlanOptions("two_phase", overlap="always"))
    assert p.path(True) == "two_phase"
    with pytest.raises(ValueError, match="CUTE_KERNELS_PATH"):
        PlanOptions(path="yes")
    with pytest.raises(ValueError, match="overlap"):
        PlanOptions(overlap="sometimes")


def test_h100_calibration_keeps_large_gdn_grids_fused():
    # H100 (calibration.json): GDN's phase 1 costs more per chunk than on the H200, so the large grids where the
    # two measured within 8% of each other go to the fused kernel there and stay two-phase on the H200
    for B, H, T in [(8, 32, 4096), (16, 64, 4096), (4, 64, 8192)]:
        assert plan_forward(False, B, T, H, None, False, 132, "H100", None, AUTO).path(True) == "fused"
        assert plan_forward(False, B, T, H, None, False, 132, "H200", None, AUTO).path(True) == "two_phase"
    # small grids keep their segmented paths on both
    assert plan_forward(False, 2, 8192, 16, None, False, 132, "H100", None, AUTO).path(True) == "two_phase"
    assert plan_forward(False, 1, 4096, 16, None, False, 132, "H100", None, AUTO).path(True) == "overlap"


def test_path_from_the_environment(monkeypatch):
    monkeypatch.setenv("CUTE_KERNELS_PATH", "fused")
    assert PlanOptions().path == "fused"
    monkeypatch.setenv("CUTE_KERNELS_PATH", "nope")
    with pytest.raises(ValueError, match=r"path \(CUTE_KERNELS_PATH\) must be one of"):
        PlanOptions()


def test_merge_choice():
    """While the 8-column grid fits one CTA per SM: regs (K = 128) else prefetch; beyond it: tc else staged; a
    forced impl must fit K and V."""
    assert merge_impl_for(1, 4, 128, 128, 132) == "regs"
    assert merge_impl_for(1, 4, 64, 64, 132) == "prefetch"
    assert merge_impl_for(4, 16, 128, 128, 132) == "tc"
    assert merge_impl_for(4, 16, 64, 64, 132) == "staged"
    assert merge_impl_for(4, 16, 128, 128, 132, "prefetch") == "prefetch"
    with pytest.raises(ValueError, match="affine_merge supports"):
        merge_impl_for(1, 1, 64, 64, 132, "tc")
    with pytest.raises(ValueError, match="affine_merge supports"):
        merge_impl_for(1, 1, 256, 128, 132)


def test_explain_says_what_ran_and_why():
    p = plan_forward(False, 1, 8192, 4, None, False, 132, "H200", None, AUTO)
    text = p.explain(True)
    assert "path: two-phase" in text and f"segments per sequence: {p.segments} (all 1 sequences)" in text
    assert "fused" in text and "costs: H200" in text
    p = plan_forward(False, 1, 128, 4, None, False, 132, "H200", None, AUTO)   # host-bound when eager
    assert p.path(False) == "fused" and p.path(True) == "two_phase"
    assert "path: fused" in p.explain(False) and "eager calls take the fused path" in p.explain(False)
    p = plan_forward(True, 1, 8192, 16, None, False, 132, "H200", None, AUTO)
    assert p.path(True) == "overlap" and "overlapped" in p.explain(True)


def test_calibration_table():
    """Per device: the H100 and SM100 entries name their source; SM100's is labeled unmeasured."""
    h200, h100, sm100 = cost.calibration("H200"), cost.calibration("H100"), cost.calibration("SM100")
    assert h200.fused_chunk_us == {"gdn": 7.2, "kda": 15.1} and not h200.unmeasured
    assert h100.merge_link_us == h200.merge_link_us and "H200" in h100.source
    assert sm100.unmeasured and "unmeasured" in sm100.source
    assert cost.calibration("some other GPU").name == "H200"


def test_two_phase_cost_by_hand():
    """`two_phase_us` for B=1 H=4 T=4096 (64 chunks), 4 segments, GDN, no initial state, 132 SMs, by hand:
    phase 1 in one wave of 256 one-chunk tiles at two per SM (264 slots)."""
    cal = cost.calibration("H200")
    p = Problem.fixed(1, 4096, 4)
    tiles = cost.prep_tile_counts(p, False, 132, balance=False)
    assert tiles == [64] and cost.prep_ctas_per_sm(False, 64 * 4, 132) == 2
    phase1 = 1 * cal.prep_chunk_us["gdn_2_per_sm"] + cal.launch_us
    # state pass: 4 segments x 4 heads x 2 V blocks = 32 output tiles of 16 chunks (one wave: no tile cost)
    outputs = 16 * cal.state_chunk_us["gdn"]
    # summaries: segments 0-2 (not the last): segment 0 h_ext only (2 blocks), 1-2 h_ext and M (4 blocks)
    summaries = 16 * cal.state_chunk_us["gdn"]
    links = 3 * (cal.merge_link_us["regs"] + cal.segment_us["gdn"]) + 2 * cal.launch_us
    want = phase1 + outputs + summaries + links
    assert cost.two_phase_us(cal, p, [4], False, False, 132, cal.merge_link_us["regs"]) == pytest.approx(want)


def test_sm100_plans_the_fused_path_only():
    """SM100 builds the fused kernel only: `auto` plans it (segmented where the SM90 costs say so), a pinned
    two-phase path is refused by name."""
    for kda, B, T, H in [(False, 1, 8192, 4), (False, 16, 4096, 64), (True, 1, 8192, 16)]:
        p = plan_forward(kda, B, T, H, None, False, 148, "SM100", None, AUTO)
        assert p.path(True) == p.path(False) == "fused" and p.two_phase_us is None
    assert plan_forward(False, 1, 8192, 4, None, False, 148, "SM100", None,
                        AUTO).fused_schedule.segmentation.total_segments > 1
    with pytest.raises(ValueError, match="SM100 has the fused path only"):
        plan_forward(False, 1, 8192, 4, None, False, 148, "SM100", None, PlanOptions("two_phase"))
