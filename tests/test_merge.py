"""Merge kernels: checks of bad input (CPU) and agreement with the float64 references (GPU)."""

import math

import pytest
import torch
from conftest import poisoned, rel_err, requires_gpu

import cute_kernels as ck
from cute_kernels.kernels.configs import merge_fits
from cute_kernels import reference as ref
from schedulers import Problem, SegmentScheduler


def summaries(slots, H, K, V, device, gen):
    # Contractive maps like real segments (decay < 1): keep long chains bounded.
    M = torch.randn(slots, H, K, K, generator=gen, dtype=torch.float64) / (1.5 * math.sqrt(K))
    h = torch.randn(slots, H, K, V, generator=gen, dtype=torch.float64)
    return M.float().to(device), h.float().to(device)


def varlen_case(H, num_segments, with_init, gen, device):
    """A varlen batch (sequences of 64, 4096, 700 and 0 tokens) cut into up to `num_segments` segments each: its
    seg_offsets, slot count, sequence count, K = V = 128 summaries and initial state (or None)."""
    problem = Problem.varlen([0, 64, 64 + 4096, 64 + 4096 + 700, 64 + 4096 + 700], num_heads=H)
    sched = SegmentScheduler(num_segments=num_segments, min_chunks=1).schedule(problem)
    slots, N = sched.segmentation.total_segments, problem.num_seqs
    M, h = summaries(slots, H, 128, 128, device, gen)
    init = torch.randn(N, H, 128, 128, generator=gen).to(device) if with_init else None
    return sched.seg_offsets, slots, N, M, h, init


# ---------------------------------------------------------------- CPU: bad input


def test_affine_merge_bad_input():
    M = torch.zeros(4, 2, 8, 8)
    h = torch.zeros(4, 2, 8, 16)
    with pytest.raises(TypeError, match="M must have dtype"):
        ck.affine_merge(M.double(), h, [0, 4])
    with pytest.raises(ValueError, match="h_ext must have shape"):
        ck.affine_merge(M, torch.zeros(4, 3, 8, 16), [0, 4])
    with pytest.raises(ValueError, match="M must have 4 dimensions"):
        ck.affine_merge(M[0], h, [0, 4])
    with pytest.raises(ValueError, match="h_ext must be contiguous"):
        ck.affine_merge(M, torch.zeros(4, 2, 16, 8).transpose(2, 3), [0, 4])
    with pytest.raises(ValueError, match="must be on a CUDA device"):
        ck.affine_merge(M, h, [0, 4])
    with pytest.raises(TypeError, match="h_ext must be a torch.Tensor"):
        ck.affine_merge(M, h.numpy(), [0, 4])


def test_lse_merge_bad_input():
    o = torch.zeros(3, 5, 64)
    lse = torch.zeros(3, 5)
    with pytest.raises(TypeError, match="o_partial must have dtype"):
        ck.lse_merge(o.half(), lse)
    with pytest.raises(ValueError, match="lse_partial must have shape"):
        ck.lse_merge(o, torch.zeros(3, 4))
    with pytest.raises(TypeError, match="out_dtype"):
        ck.lse_merge(o, lse, out_dtype=torch.int32)
    with pytest.raises(ValueError, match="head dims"):
        ck.lse_merge(torch.zeros(3, 5, 6), lse)
    with pytest.raises(ValueError, match="must be on a CUDA device"):
        ck.lse_merge(o, lse)


# ---------------------------------------------------------------- GPU: against the references


IMPLS = ("staged", "prefetch", "regs", "tc")
# every impl on every (K, V) it handles (regs and tc: K = 128; tc: V a multiple of 64)
SIZES = [(impl, K, V) for impl in IMPLS for K, V in [(128, 128), (64, 64), (128, 64)] if merge_fits(impl, K, V)]


@requires_gpu
@pytest.mark.parametrize("impl,K,V", SIZES)
@pytest.mark.parametrize("with_init", [True, False])
def test_affine_merge_matches_reference(impl, K, V, with_init):
    gen = torch.Generator().manual_seed(1000 * K + V + with_init)
    dev = torch.device("cuda")
    # Varlen layout straight from a scheduler: very unequal lengths, one sequence with 0 tokens.
    problem = Problem.varlen([0, 1, 64, 64 + 4096, 64 + 4096 + 700, 64 + 4096 + 700], num_heads=3)
    sched = SegmentScheduler(num_segments=9, min_chunks=1).schedule(problem)
    slots, N, H = sched.segmentation.total_segments, problem.num_seqs, 3
    M, h = summaries(slots, H, K, V, dev, gen)
    init = torch.randn(N, H, K, V, generator=gen).to(dev) if with_init else None
    out = (poisoned((slots, H, K, V), torch.float32, dev), poisoned((N, H, K, V), torch.float32, dev))
    starts, final = ck.affine_merge(M, h, sched.seg_offsets, init, out=out, impl=impl)
    want_starts, want_final = ref.affine_merge(M.double(), h.double(), sched.seg_offsets,
                                               None if init is None else init.double())
    assert not starts.isnan().any() and not final.isnan().any()
    assert rel_err(starts, want_starts) <= 1e-5
    assert rel_err(final, want_final) <= 1e-5
    # Bitwise identical on a second run.
    again = ck.affine_merge(M, h, torch.tensor(sched.seg_offsets, device=dev), init, impl=impl)
    assert torch.equal(again[0], starts) and torch.equal(again[1], final)


@requires_gpu
@pytest.mark.parametrize("with_init", [True, False])
@pytest.mark.parametrize("impl", IMPLS)
def test_affine_merge_starts_only_never_reads_unneeded_summaries(with_init, impl):
    """The segmented forward leaves each sequence's last summary (and, without an initial state, the first M)
    unwritten: NaN there must not reach any start state."""
    gen = torch.Generator().manual_seed(31 + with_init)
    dev, H = torch.device("cuda"), 2
    offs, slots, N, M, h, init = varlen_case(H, 7, with_init, gen, dev)
    want_starts, _ = ref.affine_merge(M.double(), h.double(), offs, None if init is None else init.double())
    for n in range(N):
        if offs[n + 1] > offs[n]:
            M[offs[n + 1] - 1] = float("nan")
            h[offs[n + 1] - 1] = float("nan")
            if not with_init:
                M[offs[n]] = float("nan")
    out = (poisoned((slots, H, 128, 128), torch.float32, dev),)
    starts, final = ck.affine_merge(M, h, offs, init, out=out, starts_only=True, impl=impl)
    assert final is None and starts is out[0]
    assert not starts.isnan().any()
    assert rel_err(starts, want_starts) <= 1e-5
    again, _ = ck.affine_merge(M, h, offs, init, starts_only=True, impl=impl)
    assert torch.equal(again, starts)


@requires_gpu
@pytest.mark.parametrize("impl", IMPLS)
def test_affine_merge_long_chain(impl):
    gen = torch.Generator().manual_seed(7)
    dev = torch.device("cuda")
    M, h = summaries(64, 2, 128, 128, dev, gen)
    starts, final = ck.affine_merge(M, h, [0, 64], impl=impl)
    want_starts, want_final = ref.affine_merge(M.double(), h.double(), [0, 64])
    assert rel_err(final, want_final) <= 1e-5 and rel_err(starts, want_starts) <= 1e-5


@requires_gpu
@pytest.mark.parametrize("D", [128, 64, 96])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_lse_merge_uniform_matches_reference(D, out_dtype):
    gen = torch.Generator().manual_seed(D)
    dev = torch.device("cuda")
    q = torch.randn(3, 1, 16, D, generator=gen)
    k = torch.randn(3, 1000, 2, D, generator=gen)
    v = torch.randn(3, 1000, 2, D, generator=gen)
    kv_lens = torch.tensor([1000, 300, 0])  # the last row has no keys at all
    o_p, lse_p = ref.split_kv_partials(q, k, v, num_splits=5, kv_lens=kv_lens)
    want_o, want_lse = ref.attention_ref(q, k, v, kv_lens=kv_lens)
    o_p, lse_p = o_p.float().to(dev), lse_p.float().to(dev)
    out = (poisoned(want_o.shape, out_dtype, dev), poisoned(want_lse.shape, torch.float32, dev))
    o, lse = ck.lse_merge(o_p, lse_p, out_dtype=out_dtype, out=out)
    assert o.dtype == out_dtype and not o.isnan().any() and not lse.isnan().any()
    tol = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}[out_dtype]
    assert rel_err(o, want_o) <= tol
    finite = torch.isfinite(want_lse)
    assert torch.equal(torch.isfinite(lse).cpu(), finite)
    assert rel_err(lse.cpu()[finite], want_lse[finite]) <= 1e-5
    assert (o[2] == 0).all()
    o2, lse2 = ck.lse_merge(o_p, lse_p, out_dtype=out_dtype)
    assert torch.equal(o2, o) and torch.equal(lse2, lse)


@requires_gpu
def test_lse_merge_schedule_layout():
    """Splits laid out by a SegmentScheduler over KV blocks: uneven split counts per batch row."""
    gen = torch.Generator().manual_seed(3)
    dev = torch.device("cuda")
    kv_lens = [3000, 100, 1024]
    Hkv, Hq, D = 2, 8, 128
    problem = Problem.varlen([0] + list(torch.tensor(kv_lens).cumsum(0).tolist()), Hkv, chunk_size=64)
    sched = SegmentScheduler().schedule(problem, sm_count=132, ctas_per_sm=2)
    o_slots, lse_slots, want_o, want_lse = [], [], [], []
    for b, L in enumerate(kv_lens):
        q = torch.randn(1, 1, Hq, D, generator=gen)
        k = torch.randn(1, L, Hkv, D, generator=gen)
        v = torch.randn(1, L, Hkv, D, generator=gen)
        bounds = [min(c * 64, L) for c in sched.segmentation.bounds[b]]
        o_p, lse_p = ref.split_kv_partials(q, k, v, split_bounds=bounds)
        o_slots.append(o_p[:, 0, 0])
        lse_slots.append(lse_p[:, 0, 0])
        o_ref, lse_ref = ref.attention_ref(q, k, v)
        want_o.append(o_ref[0, 0])
        want_lse.append(lse_ref[0, 0])
    o_p = torch.cat(o_slots).float().to(dev)
    lse_p = torch.cat(lse_slots).float().to(dev)
    assert o_p.shape[0] == sched.segmentation.total_segments
    o, lse = ck.lse_merge(o_p, lse_p, sched.seg_offsets, out_dtype=torch.float32)
    assert rel_err(o, torch.stack(want_o)) <= 1e-5
    assert rel_err(lse, torch.stack(want_lse)) <= 1e-5


def test_merge_variant_choice():
    """The planner's merge: regs (K = 128) or prefetch while their grid (V/8 x heads x sequences) fits one CTA per
    SM, else tc at K = 128, else staged; where that one does not handle V, the first that does; a forced impl must
    handle K and V; unsupported sizes name K and V."""
    from cute_kernels.plan import merge_impl_for

    assert merge_impl_for(1, 4, 128, 128, 132) == "regs"          # 64 CTAs
    assert merge_impl_for(1, 4, 64, 64, 132) == "prefetch"        # 32 CTAs, K = 64: no regs
    assert merge_impl_for(4, 16, 128, 128, 132) == "tc"           # 1024 prefetch CTAs, K = 128
    assert merge_impl_for(4, 16, 64, 128, 132) == "staged"        # K = 64: no tc
    assert merge_impl_for(8, 16, 128, 16, 132) == "prefetch"      # V = 16: no 64- or 32-column tile
    with pytest.raises(ValueError, match="K=48"):
        merge_impl_for(1, 1, 48, 128, 132)
    assert merge_impl_for(1, 4, 64, 64, 132, "staged") == "staged"
    with pytest.raises(ValueError, match="impl 'tc'"):
        merge_impl_for(1, 4, 64, 64, 132, "tc")                    # tensor cores: K = 128 only
