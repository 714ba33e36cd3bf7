"""The ops' host orchestration on the CPU: the kernel launches are replaced by a float64 emulator of the SM90
kernel's contract (tile table + mode), so argument order, views, the summary layout (h_ext, M) and the merge
wiring of the segmented path are checked without a GPU."""

import pytest
import torch
import torch.nn.functional as F

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


def inputs(B, T, H, kda, gen):
    q = F.normalize(torch.randn(B, T, H, 128, generator=gen), dim=-1).bfloat16()
    k = F.normalize(torch.randn(B, T, H, 128, generator=gen), dim=-1).bfloat16()
    v = torch.randn(B, T, H, 128, generator=gen).bfloat16()
    g = F.logsigmoid(torch.randn((B, T, H, 128) if kda else (B, T, H), generator=gen))
    beta = torch.sigmoid(torch.randn(B, T, H, generator=gen)).bfloat16()
    return q, k, v, g, beta


@pytest.mark.parametrize("kda", [False, True])
@pytest.mark.parametrize("segments", [None, 3])
@pytest.mark.parametrize("varlen", [False, True])
@pytest.mark.parametrize("with_init", [True, False])
def test_forward_orchestration(emulated, kda, segments, varlen, with_init):
    gen = torch.Generator().manual_seed(7 + kda + 2 * varlen)
    if varlen:
        cu = [0, 70, 70, 300]
        q, k, v, g, beta = inputs(1, 300, 2, kda, gen)
        cut = torch.tensor(cu)
        N = 3
    else:
        q, k, v, g, beta = inputs(2, 200, 2, kda, gen)
        cut, N = None, 2
    s0 = torch.randn(N, 2, 128, 128, generator=gen) * 0.1 if with_init else None
    sched = None if segments is None else SegmentScheduler(num_segments=segments, min_chunks=1)
    op = la.chunk_kda if kda else la.chunk_gated_delta_rule
    o, s = op(q, k, v, g, beta, initial_state=s0, output_final_state=True, cu_seqlens=cut, scheduler=sched)
    want_o, want_s = ref.chunk_gated_delta_rule_ref(q, k, v, g, beta, initial_state=s0, output_final_state=True,
                                                   cu_seqlens=cut)
    assert emulated == (["forward"] if segments is None else ["summary", "segment_outputs"])
    assert ((o.double() - want_o).norm() / want_o.norm()).item() < 1e-2  # bf16 output rounding
    assert ((s.double() - want_s).norm() / want_s.norm()).item() < 1e-5


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
