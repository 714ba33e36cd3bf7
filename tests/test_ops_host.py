"""The ops' host orchestration on the CPU: the kernel launches are replaced by a float64 emulator of the SM90
kernel's contract (tile table + mode), so argument order, views, the summary layout (h_ext, M) and the merge
wiring of the segmented path are checked without a GPU."""

import pytest
import torch
import torch.nn.functional as F
from inputs import GATE_REGIMES, initial_state, make_inputs

import cute_kernels.ops.linear_attention as la
import cute_kernels.ops.merge as merge_ops
import cute_kernels.runtime.arch as arch
from cute_kernels import reference as ref
from schedulers import SegmentScheduler, TILE_FIELDS


class KernelEmulator:
    """What one launch of ChunkGatedDeltaRuleFwdSm90 does, tile by tile, with the float64 chunked reference."""

    def __init__(self, has_initial_state, store_final_state, kda, mode):
        self.init, self.store_final, self.kda, self.mode = has_initial_state, store_final_state, kda, mode

    def fn(self, q, k, v, g, beta, o, s_in, s_out, tiles, num_tiles, grid, scale):
        # The kernel takes [B, T, ...] tensors and flattens B and T (they must be contiguous).
        assert all(t.is_contiguous() for t in (q, k, v, g, beta, o))
        q, k, v, g, beta, o = (t.flatten(0, 1) for t in (q, k, v, g, beta, o))
        col = {f: i for i, f in enumerate(TILE_FIELDS)}
        for row in tiles[:num_tiles].tolist():
            t = {f: row[i] for f, i in col.items()}
            h, a, b = t["head"], t["tok_start"], t["tok_end"]
            K = k.shape[-1]
            vv = v[a:b, h][None, :, None].double()
            if self.mode == "summary":
                s0 = torch.zeros(K, K, dtype=torch.float64) if t["block"] == 0 else torch.eye(K, dtype=torch.float64)
                if t["block"] == 1:
                    vv = torch.zeros_like(vv)
            elif self.mode == "segment_outputs":
                s0 = s_in[t["seg_slot"], h].double()
            else:
                s0 = s_in[t["seq"], h].double() if self.init else torch.zeros(K, vv.shape[-1], dtype=torch.float64)
            gg = g[a:b, h][None, :, None]
            out, s_end = ref.chunk_gated_delta_rule_ref(
                q[a:b, h][None, :, None], k[a:b, h][None, :, None], vv, gg, beta[a:b, h][None, :, None],
                scale=scale, initial_state=s0[None, None], output_final_state=True)
            if self.mode == "summary":
                s_out[t["block"] * (s_out.shape[0] // 2) + t["seg_slot"], h] = s_end[0, 0].float()
                continue
            o[a:b, h] = out[0, :, 0].to(o.dtype)
            if self.store_final and t["segment"] == t["num_segments"] - 1:
                s_out[t["seq"], h] = s_end[0, 0].float()


@pytest.fixture
def emulated(monkeypatch):
    calls = []

    def fake_compile(io_dtype, beta_dtype, has_initial_state, store_final_state, persistent=False, kda=False,
                     mode="forward", skip=None, dump_dir=None):
        calls.append(mode)
        return KernelEmulator(has_initial_state, store_final_state, kda, mode)

    def fake_merge(M, h_ext, seg_offsets, initial_state=None, *, out=None, starts_only=False):
        # The kernel's contract: without an initial state the first M of a sequence is never read; with
        # starts_only, neither is its last summary. Those slots may hold the poison (NaN): zero them here, so any
        # other unwritten slot still shows as NaN in the results.
        M, h_ext, offs = M.double().clone(), h_ext.double().clone(), list(seg_offsets)
        for n in range(len(offs) - 1):
            if offs[n + 1] > offs[n]:
                if initial_state is None:
                    M[offs[n]] = 0
                if starts_only:
                    M[offs[n + 1] - 1] = 0
                    h_ext[offs[n + 1] - 1] = 0
        starts, final = ref.affine_merge(M, h_ext, offs, None if initial_state is None else initial_state.double())
        if starts_only:
            assert out is None
            return starts.float(), None
        if out is not None:
            out[0].copy_(starts)
            out[1].copy_(final)
            return out
        return starts.float(), final.float()

    monkeypatch.setattr(la, "check_cuda", lambda **kw: torch.device("cpu"))
    monkeypatch.setattr(la, "_sm_count", lambda device: 132)
    monkeypatch.setattr(arch, "device_arch", lambda device=None: "sm_90a")
    monkeypatch.setattr(la, "compile_gdn_sm90", fake_compile)
    monkeypatch.setattr(merge_ops, "affine_merge", fake_merge)
    monkeypatch.setattr(la, "_POISON_SUMMARIES", True)
    monkeypatch.setattr(la, "TWO_PHASE", "0")   # the fused path; tests/test_two_phase.py covers the other
    la._schedule_cache.clear()
    return calls


def inputs(B, T, H, kda, gen, regime="strong", **kw):
    return make_inputs(B, T, H, gen, kda=kda, regime=regime, **kw)


def rel(a, b):
    return ((a.double() - b).norm() / b.norm()).item()


@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
@pytest.mark.parametrize("segments", [None, 3])
@pytest.mark.parametrize("varlen", [False, True])
@pytest.mark.parametrize("with_init", [True, False])
@pytest.mark.parametrize("regime", GATE_REGIMES)
def test_forward_orchestration(emulated, kda, segments, varlen, with_init, regime):
    gen = torch.Generator().manual_seed(7 + kda + 2 * varlen + 4 * GATE_REGIMES.index(regime))
    if varlen:
        cu = [0, 70, 70, 300]
        q, k, v, g, beta = inputs(1, 300, 2, kda, gen, regime)
        cut = torch.tensor(cu)
        N = 3
    else:
        q, k, v, g, beta = inputs(2, 200, 2, kda, gen, regime)
        cut, N = None, 2
    s0 = initial_state(N, 2, gen) if with_init else None
    sched = None if segments is None else SegmentScheduler(num_segments=segments, min_chunks=1)
    op = la.chunk_kda if kda else la.chunk_gated_delta_rule
    o, s = op(q, k, v, g, beta, initial_state=s0, output_final_state=True, cu_seqlens=cut, scheduler=sched)
    want_o, want_s = ref.chunk_gated_delta_rule_ref(q, k, v, g, beta, initial_state=s0, output_final_state=True,
                                                   cu_seqlens=cut)
    assert emulated == (["forward"] if segments is None else ["summary", "segment_outputs"])
    assert rel(o, want_o) < 5e-3  # bf16 output rounding
    assert rel(s, want_s) < 1e-5


@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
@pytest.mark.parametrize("regime", ["weak", "zero"])
@pytest.mark.parametrize("with_init", [True, False])
def test_long_segmented_orchestration(emulated, kda, regime, with_init):
    """A long sequence (T = 4100, not a multiple of 64) in 8 segments with weak or zero decay: the summaries, the
    merge and each segment's start state decide most of the output."""
    gen = torch.Generator().manual_seed(3 + kda + 2 * with_init + 4 * (regime == "zero"))
    q, k, v, g, beta = inputs(1, 4100, 2, kda, gen, regime)
    s0 = initial_state(1, 2, gen) if with_init else None
    op = la.chunk_kda if kda else la.chunk_gated_delta_rule
    o, s = op(q, k, v, g, beta, initial_state=s0, output_final_state=True,
              scheduler=SegmentScheduler(num_segments=8, min_chunks=1))
    want_o, want_s = ref.chunk_gated_delta_rule_ref(q, k, v, g, beta, initial_state=s0, output_final_state=True)
    assert emulated == ["summary", "segment_outputs"]
    assert rel(o, want_o) < 5e-3 and rel(s, want_s) < 1e-5


@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
@pytest.mark.parametrize("segments", [None, 3])
def test_call_options_orchestration(emulated, kda, segments):
    """The options every path must honour, with weak gates: a non-default scale, use_qk_l2norm_in_kernel on raw
    q and k, output_final_state=False (the final state neither returned nor stored in a given tensor), fp32 beta."""
    gen = torch.Generator().manual_seed(17 + kda)
    sched = None if segments is None else SegmentScheduler(num_segments=segments, min_chunks=1)
    op = la.chunk_kda if kda else la.chunk_gated_delta_rule
    q, k, v, g, beta = inputs(2, 200, 2, kda, gen, "weak")
    s0 = initial_state(2, 2, gen)
    o, s = op(q, k, v, g, beta, scale=0.3, initial_state=s0, output_final_state=True, scheduler=sched)
    want_o, want_s = ref.chunk_gated_delta_rule_ref(q, k, v, g, beta, scale=0.3, initial_state=s0,
                                                   output_final_state=True)
    assert rel(o, want_o) < 5e-3 and rel(s, want_s) < 1e-5
    qr, kr, v, g, beta = inputs(2, 200, 2, kda, gen, "weak", normalize=False)
    o, s = op(qr, kr, v, g, beta, initial_state=s0, output_final_state=True, use_qk_l2norm_in_kernel=True,
              scheduler=sched)
    qn, kn = (F.normalize(x.float(), dim=-1).to(x.dtype) for x in (qr, kr))
    want_o, want_s = ref.chunk_gated_delta_rule_ref(qn, kn, v, g, beta, initial_state=s0, output_final_state=True)
    assert rel(o, want_o) < 5e-3 and rel(s, want_s) < 1e-5
    o_out = torch.full_like(v, float("nan"))
    o, s = op(q, k, v, g, beta, initial_state=s0, scheduler=sched, out=(o_out, None))
    want_o, _ = ref.chunk_gated_delta_rule_ref(q, k, v, g, beta, initial_state=s0)
    assert s is None and o is o_out and rel(o, want_o) < 5e-3
    q, k, v, g, beta = inputs(2, 200, 2, kda, gen, "weak", beta_dtype=torch.float32)
    o, s = op(q, k, v, g, beta, initial_state=s0, output_final_state=True, scheduler=sched)
    want_o, want_s = ref.chunk_gated_delta_rule_ref(q, k, v, g, beta, initial_state=s0, output_final_state=True)
    assert rel(o, want_o) < 5e-3 and rel(s, want_s) < 1e-5


def test_auto_segments(emulated, monkeypatch):
    """scheduler=None with AUTO_SEGMENTS: the cost model's segment count (plan visible in last_plan()); a call
    whose split would not pay runs the single forward launch."""
    from schedulers import Problem, SegmentCost, plan_segments_by_cost

    monkeypatch.setattr(la, "AUTO_SEGMENTS", True)
    monkeypatch.setattr(merge_ops, "AFFINE_MERGE_IMPL", "staged")
    gen = torch.Generator().manual_seed(1)
    q, k, v, g, beta = inputs(1, 1024, 2, False, gen)
    o, s = la.chunk_gated_delta_rule(q, k, v, g, beta, output_final_state=True)
    want_o, want_s = ref.chunk_gated_delta_rule_ref(q, k, v, g, beta, output_final_state=True)
    plan = plan_segments_by_cost(Problem.fixed(1, 1024, 2), 132,
                                 SegmentCost(la.CHUNK_US[False], la.MERGE_LINK_US["staged"]), min_chunks=2)
    n = plan.segments[0]
    assert n > 1
    assert emulated == ["summary", "segment_outputs"]
    assert f"segments per sequence: {n} (all 1)" in la.last_plan()
    assert ((s.double() - want_s).norm() / want_s.norm()).item() < 1e-5
    assert ((o.double() - want_o).norm() / want_o.norm()).item() < 1e-2
    # 4 chunks: two 2-chunk segments cost a summary launch, a merge link and two launches more than they save.
    emulated.clear()
    q, k, v, g, beta = inputs(1, 256, 2, False, gen)
    la.chunk_gated_delta_rule(q, k, v, g, beta)
    assert emulated == ["forward"]


def test_no_final_state_and_out_checks(emulated):
    gen = torch.Generator().manual_seed(2)
    q, k, v, g, beta = inputs(1, 100, 2, False, gen)
    o, s = la.chunk_gated_delta_rule(q, k, v, g, beta)
    assert s is None and o.shape == v.shape
    with pytest.raises(ValueError, match=r"out\[o\] must have shape"):
        la.chunk_gated_delta_rule(q, k, v, g, beta, out=(torch.empty(1, 99, 2, 128, dtype=q.dtype), None))
    with pytest.raises(TypeError, match=r"out\[final_state\] must have dtype"):
        la.chunk_gated_delta_rule(q, k, v, g, beta, output_final_state=True,
                                  out=(torch.empty_like(v), torch.empty(1, 2, 128, 128, dtype=torch.float64)))


def test_empty_sequence_batch(emulated):
    """T = 0: no launch; the final state is the initial state (zeros without one)."""
    gen = torch.Generator().manual_seed(3)
    q, k, v, g, beta = inputs(2, 0, 2, True, gen)
    s0 = torch.randn(2, 2, 128, 128, generator=gen)
    o, s = la.chunk_kda(q, k, v, g, beta, initial_state=s0, output_final_state=True)
    assert o.shape == (2, 0, 2, 128) and torch.equal(s, s0) and emulated == []
    o, s = la.chunk_kda(q, k, v, g, beta, output_final_state=True)
    assert torch.equal(s, torch.zeros_like(s0))
