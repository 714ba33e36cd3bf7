"""Segmented fused forward: summaries (h_ext, M) + affine merge + outputs from true start states.

GPU tests: the segmented result is within 2x the error of the unsegmented kernel against float64, for N in
{2, 3, 8, 32}, fixed and varlen, with and without an initial state, in every gate regime and with each merge
variant the planner picks for K = V = 128 (regs, tc); and bitwise deterministic.
"""

import pytest
import torch
from conftest import poisoned, rel_err, requires_sm90
from inputs import GATE_REGIMES, LONG_REGIMES, initial_state, make_inputs

import cute_kernels as ck
import cute_kernels.ops.linear_attention as la
from cute_kernels import reference as ref
from cute_kernels.paths.fused import FusedRun
from cute_kernels.plan import PlanOptions
from schedulers import SegmentScheduler, SequenceScheduler

# the affine-merge variants `auto` picks for K = V = 128 (few (sequence, head) pairs: regs; many: tc)
PLANNED_MERGES = ("regs", "tc")


@pytest.fixture(autouse=True)
def poison_summaries(monkeypatch):
    """Summary slots the summary launch leaves unwritten (each sequence's last segment; the first M without an
    initial state) hold NaN: reading one would show in the results."""
    monkeypatch.setattr(FusedRun, "poison", True)


def errors(B, T, H, N, with_init, kda, cu=None, seed=0, final=True, regime="strong", merge=None):
    """(segmented o error, unsegmented o error), (the same for the final state) against float64: the fused path
    split into N segments (joined by `merge`, else the planner's), and unsplit."""
    options = PlanOptions("fused", merge=merge)

    def op(q, k, v, g, beta, initial_state=None, output_final_state=False, cu_seqlens=None, scheduler=None,
           out=None):
        return la.forward(q, k, v, g, beta, None, initial_state, output_final_state, cu_seqlens, False, scheduler,
                          out, kda=kda, options=options)

    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(seed)
    q, k, v, g, beta = make_inputs(B, T, H, gen, dev, kda=kda, regime=regime)
    n_seqs = B if cu is None else len(cu) - 1
    init = initial_state(n_seqs, H, gen, dev) if with_init else None
    cut = None if cu is None else torch.tensor(cu, dtype=torch.int32, device=dev)
    want_o, want_s = ref.chunk_gated_delta_rule_ref(q, k, v, g, beta, initial_state=init, output_final_state=True,
                                                   cu_seqlens=cut)
    plain_o, plain_s = op(q, k, v, g, beta, initial_state=init, output_final_state=True, cu_seqlens=cut,
                          scheduler=SequenceScheduler())
    sched = SegmentScheduler(num_segments=N, min_chunks=1)
    runs = []
    for _ in range(2):
        out = (poisoned((B, T, H, 128), q.dtype, dev), poisoned((n_seqs, H, 128, 128), torch.float32, dev))
        if not final:   # o only: the final state is neither stored nor returned
            o, s = op(q, k, v, g, beta, initial_state=init, cu_seqlens=cut, scheduler=sched, out=(out[0], None))
            assert s is None
            s = plain_s
        else:
            o, s = op(q, k, v, g, beta, initial_state=init, output_final_state=True, cu_seqlens=cut,
                      scheduler=sched, out=out)
        assert not o.isnan().any() and not s.isnan().any()
        runs.append((o, s))
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1]), "run-to-run difference"
    o, s = runs[0]
    return (rel_err(o, want_o), rel_err(plain_o, want_o)), (rel_err(s, want_s), rel_err(plain_s, want_s))


# (N, regime): every regime, the weak and zero ones with several N >= 4 (long cases: T = 4096)
SEGMENTED_CASES = ([(n, "strong") for n in (2, 3, 8, 32)] + [(n, r) for r in LONG_REGIMES for n in (4, 8, 32)]
                   + [(8, "mixed")])


@requires_sm90
@pytest.mark.parametrize("N,regime", SEGMENTED_CASES)
@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
@pytest.mark.parametrize("with_init", [False, True])
@pytest.mark.parametrize("merge", PLANNED_MERGES)
def test_segmented_matches(N, regime, kda, with_init, merge):
    seed = N + 64 * GATE_REGIMES.index(regime) + 7 * kda + 3 * with_init
    (eo, po), (es, ps) = errors(1, 4096, 4, N, with_init, kda, seed=seed, regime=regime, merge=merge)
    assert eo <= max(2 * po, 1e-3) and es <= max(2 * ps, 1e-3), (eo, po, es, ps)
    assert eo <= 5e-3 and es <= 5e-3


@requires_sm90
@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
@pytest.mark.parametrize("regime", ["strong", "weak"])
def test_segmented_without_final_state(kda, regime):
    (eo, po), _ = errors(2, 1000, 2, 3, False, kda, seed=5, final=False, regime=regime)
    assert eo <= max(2 * po, 1e-3), (eo, po)


@requires_sm90
@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
@pytest.mark.parametrize("regime", GATE_REGIMES)
@pytest.mark.parametrize("merge", PLANNED_MERGES)
def test_segmented_varlen(kda, regime, merge):
    cu = [0, 1, 65, 65, 1000, 1063, 6000]
    (eo, po), (es, ps) = errors(1, cu[-1], 2, 8, True, kda, cu=cu, seed=3 + GATE_REGIMES.index(regime),
                                regime=regime, merge=merge)
    assert eo <= max(2 * po, 1e-3) and es <= max(2 * ps, 1e-3), (eo, po, es, ps)
    assert eo <= 5e-3 and es <= 5e-3


@requires_sm90
@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
@pytest.mark.parametrize("regime", ["strong", "zero"])
def test_auto_segments_default_path(kda, regime):
    """The fused path with scheduler=None (the cost model picks N): B=1 H=4 T=4096 splits, stays within 5e-3 of
    float64, and reruns bitwise identical."""
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(11)
    q, k, v, g, beta = make_inputs(1, 4096, 4, gen, dev, kda=kda, regime=regime)
    want_o, want_s = ref.chunk_gated_delta_rule_ref(q, k, v, g, beta, output_final_state=True)
    runs = []
    for _ in range(2):
        out = (poisoned((1, 4096, 4, 128), q.dtype, dev), poisoned((1, 4, 128, 128), torch.float32, dev))
        runs.append(la.forward(q, k, v, g, beta, None, None, True, None, False, None, out, kda=kda,
                               options=PlanOptions("fused")))
    assert "segments per sequence: 1 " not in ck.last_plan() and "segments per sequence" in ck.last_plan()
    (o, s), (o2, s2) = runs
    assert torch.equal(o, o2) and torch.equal(s, s2)
    assert rel_err(o, want_o) <= 5e-3 and rel_err(s, want_s) <= 5e-3
