"""Tests of the pure-torch float64 references (cute_kernels.reference). CPU only, no CuTe DSL."""

from __future__ import annotations

import math
import zlib

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from inputs import gates

from cute_kernels.reference import (
    affine_merge,
    attention_ref,
    chunk_gated_delta_rule_ref,
    chunk_summaries,
    decode_attention_ref,
    lse_merge,
    recurrent_gated_delta_rule,
    segment_summaries,
    segmented_gated_delta_rule_ref,
    split_chunks,
    split_kv_partials,
)

F64 = torch.float64
TOL = 1e-10
HYP = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ----------------------------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------------------------


def _gen(*key) -> torch.Generator:
    """A generator seeded from the test's own parameters, so every test (and case) gets a different stream."""
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    assert a.dtype == b.dtype, (a.dtype, b.dtype)
    assert torch.isfinite(a).all() and torch.isfinite(b).all()
    nb = b.norm().item()
    d = (a - b).norm().item()
    return d / nb if nb > 0 else d


def _assert_close(a, b, what="", tol=TOL):
    r = _rel(a, b)
    assert r <= tol, f"{what}: relative error {r:.3e} > {tol:.0e}"


def _inputs(gen, B, T, H, K, V, kda, init, N=None, dtype=F64, regime="strong"):
    """Realistic inputs: L2-normalized keys, g in a gate regime of tests/inputs.py (default: logsigmoid(randn)),
    beta = sigmoid(randn)."""
    N = B if N is None else N
    q = torch.randn(B, T, H, K, generator=gen, dtype=dtype)
    k = F.normalize(torch.randn(B, T, H, K, generator=gen, dtype=dtype), dim=-1)
    v = torch.randn(B, T, H, V, generator=gen, dtype=dtype)
    g_shape = (B, T, H, K) if kda else (B, T, H)
    if regime == "strong":   # (unclamped: the references take any decay)
        g = F.logsigmoid(torch.randn(*g_shape, generator=gen, dtype=dtype))
    else:
        g = gates(g_shape, regime, gen).to(dtype)
    beta = torch.sigmoid(torch.randn(B, T, H, generator=gen, dtype=dtype))
    s0 = torch.randn(N, H, K, V, generator=gen, dtype=dtype) if init else None
    return q, k, v, g, beta, s0


def _check_all_forms(q, k, v, g, beta, s0, cu, chunk_sizes=(64, 16), segs=(1, 2, 3, 7), scale=None):
    o_ref, f_ref = recurrent_gated_delta_rule(q, k, v, g, beta, scale=scale, initial_state=s0,
                                              output_final_state=True, cu_seqlens=cu)
    for C in chunk_sizes:
        o, f = chunk_gated_delta_rule_ref(q, k, v, g, beta, scale=scale, initial_state=s0, output_final_state=True,
                                          cu_seqlens=cu, chunk_size=C)
        _assert_close(o, o_ref, f"chunked o (C={C})")
        _assert_close(f, f_ref, f"chunked final (C={C})")
        for n in segs:
            o, f = segmented_gated_delta_rule_ref(q, k, v, g, beta, scale=scale, initial_state=s0,
                                                  output_final_state=True, cu_seqlens=cu, num_segments=n,
                                                  chunk_size=C)
            _assert_close(o, o_ref, f"segmented o (C={C}, N={n})")
            _assert_close(f, f_ref, f"segmented final (C={C}, N={n})")
    return o_ref, f_ref


# ----------------------------------------------------------------------------------------------------------------
# recurrent vs chunked vs segmented
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("init", [False, True], ids=["S0=0", "S0"])
@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
@pytest.mark.parametrize("H", [1, 3])
@pytest.mark.parametrize("T", [1, 63, 64, 65, 300])
@pytest.mark.parametrize("regime", ["strong", "weak", "zero", "mixed"])
def test_forms_agree(T, H, kda, init, regime):
    gen = _gen("forms", T, H, kda, init, regime)
    q, k, v, g, beta, s0 = _inputs(gen, 2, T, H, 16, 8, kda, init, regime=regime)
    o, f = _check_all_forms(q, k, v, g, beta, s0, None, scale=None if H == 1 else 0.7)
    assert o.dtype == F64 and o.shape == (2, T, H, 8) and f.shape == (2, H, 16, 8)


@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
def test_scale_multiplies_q(kda):
    """`scale` only multiplies q, in every form: o(q, scale=s) = o(s q, scale=1); the default is K^-0.5."""
    gen = _gen("scale", kda)
    q, k, v, g, beta, s0 = _inputs(gen, 2, 70, 2, 16, 8, kda, True, regime="weak")
    for fn, kw in [(recurrent_gated_delta_rule, {}), (chunk_gated_delta_rule_ref, {"chunk_size": 16}),
                   (segmented_gated_delta_rule_ref, {"chunk_size": 16, "num_segments": 3})]:
        o, f = fn(q, k, v, g, beta, scale=0.7, initial_state=s0, output_final_state=True, **kw)
        o1, f1 = fn(0.7 * q, k, v, g, beta, scale=1.0, initial_state=s0, output_final_state=True, **kw)
        _assert_close(o, o1, f"{fn.__name__} o")
        _assert_close(f, f1, f"{fn.__name__} final")
        o_default, _ = fn(q, k, v, g, beta, initial_state=s0, **kw)
        o_explicit, _ = fn(16**-0.5 * q, k, v, g, beta, scale=1.0, initial_state=s0, **kw)
        _assert_close(o_default, o_explicit, f"{fn.__name__} default scale")


@pytest.mark.parametrize("init", [False, True], ids=["S0=0", "S0"])
@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
@pytest.mark.parametrize(
    "bounds", [[0, 1, 2, 200, 265, 266], [0, 0, 5, 5, 70, 70]], ids=["unequal", "with-empty"]
)
@pytest.mark.parametrize("regime", ["strong", "weak"])
def test_forms_agree_varlen(bounds, kda, init, regime):
    gen = _gen("varlen", bounds, kda, init, regime)
    N, T = len(bounds) - 1, bounds[-1]
    q, k, v, g, beta, s0 = _inputs(gen, 1, T, 2, 16, 8, kda, init, N=N, regime=regime)
    cu = torch.tensor(bounds, dtype=torch.int32)
    o, f = _check_all_forms(q, k, v, g, beta, s0, cu)
    # Each packed sequence equals the same sequence run on its own.
    for n in range(N):
        a, b = bounds[n], bounds[n + 1]
        sl = slice(a, b)
        o_n, f_n = recurrent_gated_delta_rule(q[:, sl], k[:, sl], v[:, sl], g[:, sl], beta[:, sl],
                                              initial_state=None if s0 is None else s0[n : n + 1],
                                              output_final_state=True)
        if b > a:
            _assert_close(o[:, sl], o_n, f"varlen seq {n} o")
        _assert_close(f[n : n + 1], f_n, f"varlen seq {n} final")
        if b == a:  # empty sequence: final state is the initial state
            expected = torch.zeros_like(f[n]) if s0 is None else s0[n]
            assert torch.equal(f[n], expected)


@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
def test_forms_agree_head_dim_128(kda):
    gen = _gen("hd128", kda)
    q, k, v, g, beta, s0 = _inputs(gen, 1, 70, 2, 128, 128, kda, True)
    _check_all_forms(q, k, v, g, beta, s0, None, chunk_sizes=(64,), segs=(2,))


def test_recurrent_matches_literal_definition():
    """The vectorized recurrence against the formula written with explicit K x K matrices, one head at a time."""
    gen = _gen("literal")
    B, T, H, K, V = 2, 9, 2, 5, 3
    for kda in (False, True):
        q, k, v, g, beta, s0 = _inputs(gen, B, T, H, K, V, kda, True)
        scale = 0.7
        o, f = recurrent_gated_delta_rule(q, k, v, g, beta, scale=scale, initial_state=s0, output_final_state=True)
        eye = torch.eye(K, dtype=F64)
        for b in range(B):
            for h in range(H):
                S = s0[b, h].clone()
                for t in range(T):
                    gt = g[b, t, h] if kda else g[b, t, h].expand(K)
                    kt = k[b, t, h][:, None]
                    S = (eye - beta[b, t, h] * kt @ kt.T) @ torch.diag(gt.exp()) @ S + beta[b, t, h] * kt @ v[
                        b, t, h
                    ][None, :]
                    _assert_close(o[b, t, h], S.T @ (scale * q[b, t, h]), "literal o")
                _assert_close(f[b, h], S, "literal final")


# ----------------------------------------------------------------------------------------------------------------
# summaries and the affine merge
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
@pytest.mark.parametrize("varlen", [False, True], ids=["batch", "varlen"])
def test_chunk_summaries_compose_to_final_state(kda, varlen):
    gen = _gen("summaries", kda, varlen)
    C = 16
    if varlen:
        bounds = [0, 3, 3, 50, 99]
        cu = torch.tensor(bounds, dtype=torch.int64)
        B, T, N = 1, bounds[-1], len(bounds) - 1
        lens = [b - a for a, b in zip(bounds[:-1], bounds[1:])]
    else:
        cu, B, T = None, 3, 65
        N, lens = B, [T] * B
    q, k, v, g, beta, s0 = _inputs(gen, B, T, 2, 16, 8, kda, True, N=N)
    _, f_ref = recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=s0, output_final_state=True, cu_seqlens=cu)
    M, h, offs = chunk_summaries(k, v, g, beta, chunk_size=C, cu_seqlens=cu)
    counts = [math.ceil(n / C) for n in lens]
    assert offs.dtype == torch.int64
    assert offs.tolist() == [sum(counts[:i]) for i in range(N + 1)]
    assert M.shape == (offs[-1], 2, 16, 16) and h.shape == (offs[-1], 2, 16, 8)
    for n in range(N):
        S = s0[n]
        for c in range(offs[n], offs[n + 1]):
            S = M[c] @ S + h[c]
        _assert_close(S, f_ref[n], f"composed chunk maps, seq {n}")


def _hand_merge(M, h, offs, init):
    starts, finals = [], []
    for n in range(len(offs) - 1):
        S = init[n]
        for s in range(offs[n], offs[n + 1]):
            starts.append(S)
            S = torch.einsum("hij,hjv->hiv", M[s], S) + h[s]
        finals.append(S)
    return starts, finals


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("with_init", [False, True])
def test_affine_merge_hand_loop(dtype, with_init):
    gen = _gen("merge", dtype, with_init)
    offs = [0, 3, 3, 4, 7]  # sequence 1 has no segments
    S_total, H, K, V, N = 7, 2, 6, 4, 4
    M = (0.5 * torch.randn(S_total, H, K, K, generator=gen, dtype=F64)).to(dtype)
    h = torch.randn(S_total, H, K, V, generator=gen, dtype=F64).to(dtype)
    init = torch.randn(N, H, K, V, generator=gen, dtype=F64).to(dtype) if with_init else None
    start, final = affine_merge(M, h, torch.tensor(offs), init)
    assert start.dtype == dtype and final.dtype == dtype
    assert start.shape == (S_total, H, K, V) and final.shape == (N, H, K, V)
    init_ = init if with_init else torch.zeros(N, H, K, V, dtype=dtype)
    starts, finals = _hand_merge(M.double(), h.double(), offs, init_.double())
    tol = TOL if dtype == F64 else 1e-5
    for s in range(S_total):
        _assert_close(start[s].double(), starts[s], f"start {s}", tol)
    for n in range(N):
        if offs[n + 1] > offs[n] or with_init:
            _assert_close(final[n].double(), finals[n], f"final {n}", tol)
    # zero-segment sequence: final = initial state, exactly; first start of each sequence = initial state
    assert torch.equal(final[1], init_[1])
    assert torch.equal(start[0], init_[0]) and torch.equal(start[3], init_[2]) and torch.equal(start[4], init_[3])
    # list offsets are accepted too
    start2, final2 = affine_merge(M, h, offs, init)
    assert torch.equal(start2, start) and torch.equal(final2, final)


def test_affine_merge_no_segments_at_all():
    M = torch.zeros(0, 1, 3, 3, dtype=F64)
    h = torch.zeros(0, 1, 3, 2, dtype=F64)
    init = torch.randn(2, 1, 3, 2, generator=_gen("merge0"), dtype=F64)
    start, final = affine_merge(M, h, [0, 0, 0], init)
    assert start.shape == (0, 1, 3, 2) and torch.equal(final, init)


def test_segment_summaries_match_chunk_composition():
    gen = _gen("segsum")
    q, k, v, g, beta, _ = _inputs(gen, 2, 100, 2, 8, 4, True, False)
    C = 16  # 7 chunks per sequence
    bounds = [[0, 2, 7], [0, 1, 1, 4, 7]]
    M, h, offs = segment_summaries(k, v, g, beta, bounds, chunk_size=C)
    Mc, hc, coffs = chunk_summaries(k, v, g, beta, chunk_size=C)
    assert offs.tolist() == [0, 2, 6]
    eye = torch.eye(8, dtype=F64).expand(2, 8, 8)
    for n, bl in enumerate(bounds):
        for j, (c0, c1) in enumerate(zip(bl[:-1], bl[1:])):
            S = torch.randn(2, 8, 4, generator=gen, dtype=F64)
            T_ = S
            for c in range(coffs[n] + c0, coffs[n] + c1):
                T_ = Mc[c] @ T_ + hc[c]
            _assert_close(M[offs[n] + j] @ S + h[offs[n] + j], T_, "segment map")
            if c0 == c1:
                assert torch.equal(M[offs[n] + j], eye) and not h[offs[n] + j].any()


@given(num_chunks=st.integers(0, 200), num_segments=st.integers(1, 40))
@HYP
def test_split_chunks_properties(num_chunks, num_segments):
    b = split_chunks(num_chunks, num_segments)
    assert b[0] == 0 and b[-1] == num_chunks
    sizes = [y - x for x, y in zip(b[:-1], b[1:])]
    assert len(sizes) == min(num_chunks, num_segments)
    assert all(s >= 1 for s in sizes)
    if sizes:
        assert max(sizes) - min(sizes) <= 1


# ----------------------------------------------------------------------------------------------------------------
# property tests: any segmentation, any KV split
# ----------------------------------------------------------------------------------------------------------------


@st.composite
def _segmented_case(draw):
    varlen = draw(st.booleans())
    C = draw(st.sampled_from([8, 16]))
    if varlen:
        lens = draw(st.lists(st.integers(0, 70), min_size=1, max_size=4))
    else:
        lens = [draw(st.integers(0, 70))] * draw(st.integers(1, 2))
    seg_bounds = []
    for L in lens:
        nc = -(-L // C)
        inner = draw(st.lists(st.integers(0, nc), max_size=5))  # duplicates allowed: empty segments
        seg_bounds.append([0] + sorted(inner) + [nc] if nc > 0 or inner else [0])
    return dict(
        varlen=varlen, C=C, lens=lens, seg_bounds=seg_bounds, kda=draw(st.booleans()), init=draw(st.booleans()),
        H=draw(st.integers(1, 2)), seed=draw(st.integers(0, 2**31 - 1)),
    )


@given(case=_segmented_case())
@settings(HYP, max_examples=50)
def test_any_segmentation_matches_recurrent(case):
    gen = torch.Generator().manual_seed(case["seed"])
    lens, H, kda = case["lens"], case["H"], case["kda"]
    if case["varlen"]:
        B, T, N = 1, sum(lens), len(lens)
        cu = torch.tensor([0] + lens).cumsum(0)
    else:
        B, T, N, cu = len(lens), lens[0], len(lens), None
    q, k, v, g, beta, s0 = _inputs(gen, B, T, H, 8, 4, kda, case["init"], N=N)
    o_ref, f_ref = recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=s0, output_final_state=True,
                                              cu_seqlens=cu)
    o, f = segmented_gated_delta_rule_ref(q, k, v, g, beta, initial_state=s0, output_final_state=True,
                                          cu_seqlens=cu, segment_bounds=case["seg_bounds"], chunk_size=case["C"])
    if T > 0:
        _assert_close(o, o_ref, "segmented o")
    if f_ref.norm() > 0:
        _assert_close(f, f_ref, "segmented final")
    else:
        assert not f.any()


@st.composite
def _split_kv_case(draw):
    B = draw(st.integers(1, 3))
    Tkv = draw(st.integers(0, 40))
    inner = draw(st.lists(st.integers(0, Tkv), max_size=6))  # duplicates -> empty splits
    kv_lens = draw(st.one_of(st.none(), st.lists(st.integers(0, Tkv), min_size=B, max_size=B)))
    return dict(
        B=B, Tq=draw(st.integers(1, 3)), Hkv=draw(st.integers(1, 2)), group=draw(st.integers(1, 3)),
        D=draw(st.sampled_from([4, 8])), Dv=draw(st.sampled_from([3, 8])), Tkv=Tkv,
        bounds=[0] + sorted(inner) + [Tkv], kv_lens=kv_lens, seed=draw(st.integers(0, 2**31 - 1)),
    )


@given(case=_split_kv_case())
@settings(HYP, max_examples=60)
def test_any_kv_split_merges_to_attention(case):
    gen = torch.Generator().manual_seed(case["seed"])
    B, Tq, Hkv, Tkv = case["B"], case["Tq"], case["Hkv"], case["Tkv"]
    Hq = Hkv * case["group"]
    q = 2 * torch.randn(B, Tq, Hq, case["D"], generator=gen, dtype=F64)
    k = torch.randn(B, Tkv, Hkv, case["D"], generator=gen, dtype=F64)
    v = torch.randn(B, Tkv, Hkv, case["Dv"], generator=gen, dtype=F64)
    kv_lens = None if case["kv_lens"] is None else torch.tensor(case["kv_lens"], dtype=torch.int32)
    o_ref, lse_ref = attention_ref(q, k, v, kv_lens=kv_lens)
    o_p, lse_p = split_kv_partials(q, k, v, split_bounds=case["bounds"], kv_lens=kv_lens)
    S = len(case["bounds"]) - 1
    assert o_p.shape == (S, B, Tq, Hq, case["Dv"]) and lse_p.shape == (S, B, Tq, Hq)
    assert not torch.isnan(o_p).any() and not torch.isnan(lse_p).any()
    o, lse = lse_merge(o_p, lse_p)
    assert not torch.isnan(o).any() and not torch.isnan(lse).any()
    torch.testing.assert_close(lse, lse_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(o, o_ref, rtol=1e-11, atol=1e-12)
    # rows without valid keys: o = 0, lse = -inf
    n_valid = torch.full((B,), Tkv) if kv_lens is None else kv_lens
    for b in range(B):
        if n_valid[b] == 0:
            assert torch.isneginf(lse_ref[b]).all() and not o_ref[b].any()
    # num_splits form: near-equal splits, same result
    o2, lse2 = lse_merge(*split_kv_partials(q, k, v, num_splits=S, kv_lens=kv_lens))
    torch.testing.assert_close(lse2, lse_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(o2, o_ref, rtol=1e-11, atol=1e-12)


# ----------------------------------------------------------------------------------------------------------------
# attention sanity
# ----------------------------------------------------------------------------------------------------------------


def test_attention_ref_matches_sdpa():
    gen = _gen("sdpa")
    B, Tq, Hq, Hkv, Tkv, D, Dv = 3, 2, 6, 2, 37, 16, 8
    q = torch.randn(B, Tq, Hq, D, generator=gen, dtype=F64)
    k = torch.randn(B, Tkv, Hkv, D, generator=gen, dtype=F64)
    v = torch.randn(B, Tkv, Hkv, Dv, generator=gen, dtype=F64)
    lens = torch.tensor([37, 5, 0])
    o, lse = attention_ref(q, k, v, kv_lens=lens, scale=0.3)
    rep = Hq // Hkv
    kk = k.repeat_interleave(rep, 2).transpose(1, 2)
    vv = v.repeat_interleave(rep, 2).transpose(1, 2)
    qq = q.transpose(1, 2)
    s = 0.3 * qq @ kk.transpose(-1, -2)
    for b in range(2):  # rows with keys
        n = int(lens[b])
        o_b = F.scaled_dot_product_attention(qq[b : b + 1], kk[b : b + 1, :, :n], vv[b : b + 1, :, :n], scale=0.3)
        torch.testing.assert_close(o[b], o_b[0].transpose(0, 1), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(lse[b], torch.logsumexp(s[b, :, :, :n], -1).T, rtol=1e-12, atol=1e-12)
    assert not o[2].any() and torch.isneginf(lse[2]).all()


def test_decode_ref_single_token_is_attention_over_the_cache():
    """Sq = 1, contiguous cache: attention_ref with kv_lens = cache_seqlens (lengths 0 and 1 included)."""
    gen = _gen("decode-1")
    B, Tmax, Hq, Hkv, D = 4, 50, 8, 2, 16
    q = torch.randn(B, Hq, D, generator=gen, dtype=F64)
    k = torch.randn(B, Tmax, Hkv, D, generator=gen, dtype=F64)
    v = torch.randn(B, Tmax, Hkv, D, generator=gen, dtype=F64)
    lens = torch.tensor([50, 17, 1, 0], dtype=torch.int32)
    o, lse = decode_attention_ref(q, k, v, lens, scale=0.4)
    want_o, want_lse = attention_ref(q[:, None], k, v, scale=0.4, kv_lens=lens)
    torch.testing.assert_close(o, want_o[:, 0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, want_lse[:, 0], rtol=1e-12, atol=1e-12)
    assert not o[3].any() and torch.isneginf(lse[3]).all()


def test_decode_ref_paged_equals_contiguous():
    """The same cache scattered into shuffled pages of 16 tokens, read through the page table."""
    gen = _gen("decode-paged")
    B, Tmax, Hq, Hkv, D, page = 3, 64, 4, 4, 8, 16
    q = torch.randn(B, 2, Hq, D, generator=gen, dtype=F64)
    k = torch.randn(B, Tmax, Hkv, D, generator=gen, dtype=F64)
    v = torch.randn(B, Tmax, Hkv, D, generator=gen, dtype=F64)
    lens = torch.tensor([64, 33, 5], dtype=torch.int32)
    per_row = Tmax // page
    order = torch.randperm(B * per_row, generator=gen)
    table = order.view(B, per_row).to(torch.int32)
    kp = torch.empty(B * per_row, page, Hkv, D, dtype=F64)
    vp = torch.empty_like(kp)
    kp[table.flatten().long()] = k.view(B * per_row, page, Hkv, D)
    vp[table.flatten().long()] = v.view(B * per_row, page, Hkv, D)
    o1, lse1 = decode_attention_ref(q, k, v, lens)
    o2, lse2 = decode_attention_ref(q, kp, vp, lens, page_table=table)
    torch.testing.assert_close(o2, o1, rtol=0, atol=0)
    torch.testing.assert_close(lse2, lse1, rtol=0, atol=0)


def test_decode_ref_new_tokens_are_causal_and_softcap():
    """Sq = 3: token i sees the keys up to position L - 3 + i; softcap maps scores through c tanh(s / c)."""
    gen = _gen("decode-causal")
    B, Tmax, Hq, Hkv, D, Sq = 2, 20, 2, 1, 8, 3
    q = torch.randn(B, Sq, Hq, D, generator=gen, dtype=F64)
    k = torch.randn(B, Tmax, Hkv, D, generator=gen, dtype=F64)
    v = torch.randn(B, Tmax, Hkv, D, generator=gen, dtype=F64)
    lens = torch.tensor([20, 2], dtype=torch.int32)
    o, lse = decode_attention_ref(q, k, v, lens, scale=0.5, softcap=2.0)
    for b in range(B):
        for i in range(Sq):
            n = int(lens[b]) - Sq + i + 1
            if n <= 0:
                assert not o[b, i].any() and torch.isneginf(lse[b, i]).all()
                continue
            s = 0.5 * torch.einsum("hd,jd->hj", q[b, i], k[b, :n, 0])
            s = 2.0 * torch.tanh(s / 2.0)
            p = torch.softmax(s, -1)
            torch.testing.assert_close(o[b, i], p @ v[b, :n, 0], rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(lse[b, i], torch.logsumexp(s, -1), rtol=1e-12, atol=1e-12)


def test_lse_merge_edge_cases():
    o_p = torch.full((3, 2, 4), float("nan"), dtype=torch.float32)  # garbage in empty splits must be ignored
    lse_p = torch.full((3, 2), float("-inf"), dtype=torch.float32)
    o_p[1, 0] = torch.arange(4.0)
    lse_p[1, 0] = 1.5
    o, lse = lse_merge(o_p, lse_p, out_dtype=torch.bfloat16)
    assert o.dtype == torch.bfloat16 and lse.dtype == torch.float32
    assert torch.equal(o[0].float(), torch.arange(4.0)) and lse[0] == 1.5
    assert not o[1].any() and torch.isneginf(lse[1])
    o, lse = lse_merge(torch.zeros(0, 2, 4), torch.zeros(0, 2))
    assert not o.any() and torch.isneginf(lse).all() and o.shape == (2, 4)
    # two equal splits: o is the mean, lse gains log 2
    o, lse = lse_merge(torch.tensor([[1.0, 2.0], [3.0, 4.0]], dtype=F64), torch.tensor([0.25, 0.25], dtype=F64))
    torch.testing.assert_close(o, torch.tensor([2.0, 3.0], dtype=F64))
    torch.testing.assert_close(lse, torch.tensor(0.25 + math.log(2), dtype=F64))


# ----------------------------------------------------------------------------------------------------------------
# edge / sanity cases for the delta rule
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
def test_no_update_no_decay_reads_initial_state(kda):
    gen = _gen("frozen", kda)
    B, T, H, K, V = 2, 70, 2, 16, 8
    q, k, v, g, beta, s0 = _inputs(gen, B, T, H, K, V, kda, True)
    g, beta = torch.zeros_like(g), torch.zeros_like(beta)
    expected = torch.einsum("nhkv,nthk->nthv", s0, K**-0.5 * q)
    for name, fn, kw in [
        ("recurrent", recurrent_gated_delta_rule, {}),
        ("chunked", chunk_gated_delta_rule_ref, {"chunk_size": 16}),
        ("segmented", segmented_gated_delta_rule_ref, {"chunk_size": 16, "num_segments": 3}),
    ]:
        o, f = fn(q, k, v, g, beta, initial_state=s0, output_final_state=True, **kw)
        _assert_close(o, expected, f"{name} o")
        _assert_close(f, s0, f"{name} final")


def test_kda_with_equal_channels_equals_gdn():
    gen = _gen("kda=gdn")
    B, T, H, K, V = 2, 80, 3, 16, 8
    q, k, v, g, beta, s0 = _inputs(gen, B, T, H, K, V, False, True)
    g_kda = g[..., None].expand(B, T, H, K).contiguous()
    for fn, kw in [
        (recurrent_gated_delta_rule, {}),
        (chunk_gated_delta_rule_ref, {"chunk_size": 32}),
        (segmented_gated_delta_rule_ref, {"chunk_size": 16, "num_segments": 2}),
    ]:
        o1, f1 = fn(q, k, v, g, beta, initial_state=s0, output_final_state=True, **kw)
        o2, f2 = fn(q, k, v, g_kda, beta, initial_state=s0, output_final_state=True, **kw)
        _assert_close(o2, o1, f"{fn.__name__} o")
        _assert_close(f2, f1, f"{fn.__name__} final")


def test_strong_decay_stays_finite():
    """Cumulated decay far past fp32's exp range inside one chunk: the reference must stay finite and exact."""
    gen = _gen("strong-decay")
    q, k, v, g, beta, s0 = _inputs(gen, 1, 64, 2, 8, 4, True, True)
    g = g * 20  # per-step decay down to about -60, cumulated over the chunk to thousands
    o_ref, f_ref = recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=s0, output_final_state=True)
    o, f = chunk_gated_delta_rule_ref(q, k, v, g, beta, initial_state=s0, output_final_state=True)
    _assert_close(o, o_ref, "o")
    _assert_close(f, f_ref, "final")


def test_dtypes_and_defaults():
    gen = _gen("dtypes")
    q, k, v, g, beta, s0 = _inputs(gen, 1, 20, 1, 8, 4, False, True, dtype=torch.float32)
    o, f = chunk_gated_delta_rule_ref(q.bfloat16(), k, v, g, beta, initial_state=s0)
    assert o.dtype == F64 and f is None
    o32, f32 = chunk_gated_delta_rule_ref(q, k, v, g, beta, initial_state=s0, output_final_state=True,
                                          compute_dtype=torch.float32)
    assert o32.dtype == torch.float32 and f32.dtype == torch.float32
    # default scale is K ** -0.5
    o_a, _ = recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=s0)
    o_b, _ = recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=s0, scale=8**-0.5)
    assert torch.equal(o_a, o_b)


# ----------------------------------------------------------------------------------------------------------------
# input validation
# ----------------------------------------------------------------------------------------------------------------


def _small():
    return _inputs(_gen("validation"), 1, 10, 2, 4, 3, False, True)


@pytest.mark.parametrize(
    "fn", [recurrent_gated_delta_rule, chunk_gated_delta_rule_ref, segmented_gated_delta_rule_ref]
)
def test_validation_delta_rule(fn):
    q, k, v, g, beta, s0 = _small()
    kw = {"num_segments": 2} if fn is segmented_gated_delta_rule_ref else {}
    with pytest.raises(ValueError, match="q"):
        fn(q[..., :3], k, v, g, beta, **kw)
    with pytest.raises(ValueError, match="v"):
        fn(q, k, v[:, :5], g, beta, **kw)
    with pytest.raises(ValueError, match="g"):
        fn(q, k, v, g[:, :, :1], beta, **kw)
    with pytest.raises(ValueError, match="g"):
        fn(q, k, v, g[..., None].expand(1, 10, 2, 3), beta, **kw)
    with pytest.raises(ValueError, match="beta"):
        fn(q, k, v, g, beta[..., None], **kw)
    with pytest.raises(ValueError, match="initial_state"):
        fn(q, k, v, g, beta, initial_state=s0[:, :1], **kw)
    with pytest.raises(TypeError, match="k"):
        fn(q, k.tolist(), v, g, beta, **kw)
    # cu_seqlens
    cu = torch.tensor([0, 4, 10])
    two = lambda x: torch.cat([x, x])  # noqa: E731
    with pytest.raises(ValueError, match="cu_seqlens.*B"):
        fn(two(q), two(k), two(v), two(g), two(beta), cu_seqlens=cu, **kw)
    with pytest.raises(ValueError, match="cu_seqlens.*start at 0"):
        fn(q, k, v, g, beta, cu_seqlens=torch.tensor([1, 4, 10]), **kw)
    with pytest.raises(ValueError, match="cu_seqlens.*non-decreasing"):
        fn(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 6, 4, 10]), **kw)
    with pytest.raises(ValueError, match="cu_seqlens.*end at T"):
        fn(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 4, 9]), **kw)
    with pytest.raises(ValueError, match="cu_seqlens"):
        fn(q, k, v, g, beta, cu_seqlens=torch.tensor([[0, 10]]), **kw)
    with pytest.raises(TypeError, match="cu_seqlens"):
        fn(q, k, v, g, beta, cu_seqlens=torch.tensor([0.0, 10.0]), **kw)
    with pytest.raises(ValueError, match="initial_state"):  # varlen: N = 2 sequences, state has N = 1
        fn(q, k, v, g, beta, cu_seqlens=cu, initial_state=s0, **kw)
    if fn is not recurrent_gated_delta_rule:
        with pytest.raises(ValueError, match="chunk_size"):
            fn(q, k, v, g, beta, chunk_size=0, **kw)


def test_validation_segments_and_merge():
    q, k, v, g, beta, s0 = _small()
    fn = segmented_gated_delta_rule_ref
    with pytest.raises(ValueError, match="num_segments"):
        fn(q, k, v, g, beta)
    with pytest.raises(ValueError, match="num_segments"):
        fn(q, k, v, g, beta, num_segments=2, segment_bounds=[[0, 1]])
    with pytest.raises(ValueError, match="num_segments"):
        fn(q, k, v, g, beta, num_segments=0)
    with pytest.raises(ValueError, match="segment_bounds"):  # one chunk (T = 10 < 64): must end at 1
        fn(q, k, v, g, beta, segment_bounds=[[0, 2]])
    with pytest.raises(ValueError, match="segment_bounds"):  # one list per sequence
        fn(q, k, v, g, beta, segment_bounds=[[0, 1], [0, 1]])
    with pytest.raises(ValueError, match="segment_bounds"):
        segment_summaries(k, v, g, beta, [[0, 3, 2]], chunk_size=4)
    with pytest.raises(ValueError, match="num_segments"):
        split_chunks(5, 0)
    with pytest.raises(ValueError, match="num_chunks"):
        split_chunks(-1, 2)
    M = torch.zeros(3, 2, 4, 4, dtype=F64)
    h = torch.zeros(3, 2, 4, 3, dtype=F64)
    with pytest.raises(ValueError, match="seg_offsets"):
        affine_merge(M, h, [0, 2])
    with pytest.raises(ValueError, match="seg_offsets"):
        affine_merge(M, h, [0, 2, 1, 3])
    with pytest.raises(TypeError, match="seg_offsets"):
        affine_merge(M, h, torch.tensor([0.0, 3.0]))
    with pytest.raises(ValueError, match="h"):
        affine_merge(M, h[:, :, :3], [0, 3])
    with pytest.raises(ValueError, match="initial_state"):
        affine_merge(M, h, [0, 3], torch.zeros(2, 2, 4, 3, dtype=F64))


def test_validation_attention():
    gen = _gen("validation-attn")
    q = torch.randn(2, 1, 4, 8, generator=gen, dtype=F64)
    k = torch.randn(2, 5, 2, 8, generator=gen, dtype=F64)
    v = torch.randn(2, 5, 2, 3, generator=gen, dtype=F64)
    with pytest.raises(ValueError, match="heads"):
        attention_ref(q[:, :, :3], k, v)
    with pytest.raises(ValueError, match="k"):
        attention_ref(q, k[..., :4], v)
    with pytest.raises(ValueError, match="v"):
        attention_ref(q, k, v[:, :4])
    with pytest.raises(ValueError, match="kv_lens"):
        attention_ref(q, k, v, kv_lens=torch.tensor([1, 6]))
    with pytest.raises(ValueError, match="kv_lens"):
        attention_ref(q, k, v, kv_lens=torch.tensor([1]))
    with pytest.raises(TypeError, match="kv_lens"):
        attention_ref(q, k, v, kv_lens=torch.tensor([1.0, 2.0]))
    with pytest.raises(ValueError, match="num_splits"):
        split_kv_partials(q, k, v)
    with pytest.raises(ValueError, match="split_bounds"):
        split_kv_partials(q, k, v, split_bounds=[0, 3])
    with pytest.raises(ValueError, match="split_bounds"):
        split_kv_partials(q, k, v, split_bounds=[0, 4, 2, 5])
    with pytest.raises(ValueError, match="lse_partial"):
        lse_merge(torch.zeros(2, 3, 4), torch.zeros(2, 4))


@pytest.mark.parametrize("kda", [False, True])
def test_segment_summary_is_the_recurrence_on_an_augmented_state(kda):
    """The plan for the summary mode of the kernels (issue 5): a segment's (M, h_ext) is the same recurrence
    run on the augmented state [S | M] from [0 | I] with values [v | 0] -- so the forward mainloop computes
    summaries unchanged, with the M columns treated as extra value columns whose values are zero."""
    gen = _gen("augmented", kda)
    B, T, H, K, V = 1, 150, 2, 8, 4
    q, k, v, g, beta, _ = _inputs(gen, B, T, H, K, V, kda, init=False)
    M, h, _ = segment_summaries(k, v, g, beta, [[0, 3]], chunk_size=64)
    v_aug = torch.cat([v, torch.zeros(B, T, H, K, dtype=F64)], dim=-1)
    s0 = torch.cat([torch.zeros(1, H, K, V, dtype=F64), torch.eye(K, dtype=F64).expand(1, H, K, K)], dim=-1)
    _, s_end = chunk_gated_delta_rule_ref(q, k, v_aug, g, beta, initial_state=s0, output_final_state=True)
    _assert_close(s_end[..., :V], h[0:1], "h_ext")
    _assert_close(s_end[..., V:], M[0:1], "M")


def _assert_intra_matches(q, k, g, beta):
    """The blocked KDA intra-chunk matrices equal the definition: fp32 operands to 1e-5, finite, and bf16 operands
    with fp32 accumulation (the tensor-core path) within bf16 rounding."""
    from cute_kernels.reference.kda_intra import intra_chunk_blocked, intra_chunk_exact

    scale = k.shape[-1] ** -0.5
    want_kk, want_qk = intra_chunk_exact(q, k, g, beta, scale=scale)
    for form in ("columns", "rows"):
        Akk, Aqk = intra_chunk_blocked(q, k, g, beta, scale=scale, operand_dtype=torch.float32, form=form)
        assert torch.isfinite(Akk).all() and torch.isfinite(Aqk).all()
        assert (Akk.double() - want_kk).abs().max() <= 1e-5, form
        assert (Aqk.double() - want_qk).abs().max() <= 1e-5, form
        Akk16, Aqk16 = intra_chunk_blocked(q, k, g, beta, scale=scale, form=form)
        assert (Akk16.double() - want_kk).abs().max() <= 2e-2, form
        assert (Aqk16.double() - want_qk).abs().max() <= 2e-2, form


@pytest.mark.parametrize("decay", [0.1, 1.0, 20.0])
@pytest.mark.parametrize("C", [64, 40])
def test_kda_intra_chunk_blocks_never_overflow(decay, C):
    """The blocked, anchored form of the KDA intra-chunk matrices (what the kernels compute) matches the
    definition and stays finite even for decays far past any lower-bound contract (g = -20 per step)."""

    gen = _gen("kda-intra", decay, C)
    K = 32
    q = F.normalize(torch.randn(C, K, generator=gen), dim=-1)
    k = F.normalize(torch.randn(C, K, generator=gen), dim=-1)
    g = -decay * torch.rand(C, K, generator=gen)
    beta = torch.sigmoid(torch.randn(C, generator=gen))
    _assert_intra_matches(q, k, g, beta)


@pytest.mark.parametrize("g_fill,fast", [(-0.5, True), (-5.0, True), (-5.3, False), (-20.0, False)])
def test_kda_intra_chunk_paths(g_fill, fast):
    """The fast path (first-row anchors, right factors up to 2^112) is taken up to FLA's lower bound (-5 per step)
    and is as accurate as the exact path; past the limit the exact path is taken."""
    from cute_kernels.reference.kda_intra import uses_fast_path

    gen = _gen("kda-paths", g_fill)
    C, K = 64, 32
    q = F.normalize(torch.randn(C, K, generator=gen), dim=-1)
    k = F.normalize(torch.randn(C, K, generator=gen), dim=-1)
    g = g_fill * (0.9 + 0.1 * torch.rand(C, K, generator=gen))
    g[:, 0] = g_fill   # one channel at the full decay decides the path
    beta = torch.sigmoid(torch.randn(C, generator=gen))
    assert uses_fast_path(g) == fast
    _assert_intra_matches(q, k, g, beta)


@pytest.mark.parametrize("scale", [0.05, 0.3])
def test_blocked_solve_spec(scale):
    """The SM90 kernels' blocked (I + A)^-1 scheme (right-looking level 0, doubling levels, 4-way partial sums) is the
    inverse."""
    from cute_kernels.reference.blocked_solve import blocked_unit_lower_inverse

    gen = _gen("blocked-solve", scale)
    A = torch.tril(torch.randn(64, 64, generator=gen, dtype=torch.float64) * scale, -1)
    X = blocked_unit_lower_inverse(A)
    want = torch.linalg.inv(torch.eye(64, dtype=torch.float64) + A)
    assert (X - want).abs().max() <= 1e-12 * max(1.0, want.abs().max().item())


def _chunk_akk(gen, correlated: bool):
    """A GDN chunk's strictly lower Akk [64, 64] and its w right factor diag(beta 2^G) k (float64): random unit keys,
    or one key repeated 64 times (`correlated`: the worst conditioning of I + Akk)."""
    L = 64
    if correlated:
        k = F.normalize(torch.randn(1, 128, generator=gen, dtype=torch.float64), dim=-1).expand(L, 128)
    else:
        k = F.normalize(torch.randn(L, 128, generator=gen, dtype=torch.float64), dim=-1)
    beta = torch.sigmoid(torch.randn(L, generator=gen, dtype=torch.float64) + 2)
    G = F.logsigmoid(torch.randn(L, generator=gen, dtype=torch.float64) + 4).cumsum(0)
    decay = (G[:, None] - G[None, :]).masked_fill(~torch.ones(L, L, dtype=torch.bool).tril(), -math.inf).exp()
    return beta[:, None] * ((k @ k.T) * decay).tril(-1), beta[:, None] * G.exp()[:, None] * k


def test_product_solve_operand_precision():
    """The tensor-core form of the solve's doubling levels (`product_unit_lower_inverse`): fp32 operands match the
    inverse; tf32 operands rounded to nearest keep w = X diag(beta 2^G) k within 2.5e-3 of float64 on the worst
    chunks (one repeated key) and 5e-4 on random keys; truncated tf32 and bf16 operands are measurably worse (why
    a kernel would convert with cvt.rna.tf32.f32 and not use bf16). The form `solve_levels_mma` runs
    (`blocked_unit_lower_inverse(operand="tf32")`: X_10 = -(Y + X_11^strict Y), the unit diagonal in fp32) is at
    least as accurate, and so is its fp16 form (`solve_levels_f16`: fp16 operands, also 10 mantissa bits)."""
    from cute_kernels.reference.blocked_solve import (blocked_unit_lower_inverse, product_unit_lower_inverse,
                                                      round_operand)

    x = torch.tensor([1.0 + 2.0 ** -11, -(1.0 + 2.0 ** -11), 1.0 + 2.0 ** -12])
    assert round_operand(x, "tf32").tolist() == [1.0 + 2.0 ** -10, -(1.0 + 2.0 ** -10), 1.0]   # ties away
    assert round_operand(x, "tf32-trunc").tolist() == [1.0, -1.0, 1.0]
    gen = _gen("product-solve", 0)
    worst = {}
    for correlated in (False, True):
        errs = {op: [] for op in ("fp32", "tf32", "tf32-trunc", "bf16", "kernel-tf32", "kernel-fp16")}
        for _ in range(20):
            A, kb = _chunk_akk(gen, correlated)
            w_want = torch.linalg.inv(torch.eye(64, dtype=torch.float64) + A) @ kb
            for op in errs:
                X = (blocked_unit_lower_inverse(A.float(), operand=op[7:]) if op.startswith("kernel-")
                     else product_unit_lower_inverse(A, op))
                w = X.double() @ kb
                errs[op].append(((w - w_want).norm() / w_want.norm()).item())
        worst[correlated] = {op: max(e) for op, e in errs.items()}
        mean = {op: sum(e) / len(e) for op, e in errs.items()}
        assert worst[correlated]["fp32"] <= 1e-6
        assert worst[correlated]["tf32"] <= (2.5e-3 if correlated else 5e-4), worst
        assert worst[correlated]["kernel-tf32"] <= 1.05 * worst[correlated]["tf32"], worst
        assert worst[correlated]["kernel-fp16"] <= 1.05 * worst[correlated]["tf32"], worst
        assert mean["tf32-trunc"] > 1.5 * mean["tf32"] and mean["bf16"] > 4 * mean["tf32"], mean
    assert worst[True]["bf16"] > 5e-3, worst   # too coarse where the chunk's keys repeat


def test_level0_tensor_core_forms():
    """Level 0 of the solve on the tensor cores, two forms: the series (I - a)(I + a^2)(I + a^4)(I + a^8) per
    16 x 16 block holds in fp32 (within 1e-4) but blows up in tf32 when the keys repeat (|a^8| ~ 1e3), while 8 x 8
    blocks by substitution with a third tf32 level (h = 8) stay as accurate as the 16-row build."""
    from cute_kernels.reference.blocked_solve import blocked_unit_lower_inverse, series_block_inverse

    gen = _gen("level0-forms", 0)
    worst = {}
    for correlated in (False, True):
        errs = {"series-fp32": [], "series-tf32": [], "block8-tf32": [], "block16-tf32": []}
        for _ in range(10):
            A, kb = _chunk_akk(gen, correlated)
            want = torch.linalg.inv(torch.eye(64, dtype=torch.float64) + A)
            for b in range(0, 64, 16):   # the series: the diagonal blocks against the exact ones
                for op in ("fp32", "tf32"):
                    got = series_block_inverse(A, op)[b:b + 16, b:b + 16].double()
                    blk = want[b:b + 16, b:b + 16]
                    errs[f"series-{op}"].append(((got - blk).norm() / blk.norm()).item())
            w_want = want @ kb
            for name, block in (("block8-tf32", 8), ("block16-tf32", 16)):
                X = blocked_unit_lower_inverse(A.float(), block=block, operand="tf32").double()
                errs[name].append(((X @ kb - w_want).norm() / w_want.norm()).item())
        worst[correlated] = {k: max(v) for k, v in errs.items()}
        assert worst[correlated]["series-fp32"] <= 1e-4, worst   # fp32: the large a^8 costs digits already
        assert worst[correlated]["block8-tf32"] <= max(1.5e-3, 1.5 * worst[correlated]["block16-tf32"]), worst
    assert worst[False]["series-tf32"] <= 1e-3, worst
    assert worst[True]["series-tf32"] > 0.1, worst   # repeated keys: unusable


# ----------------------------------------------------------------------------------------------------------------
# the inverse-first form (chunk_gated_delta_rule_ref(form="inverse_first")): the ungated inverse, gated
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("regime", ["strong", "weak", "zero", "mixed"])
@pytest.mark.parametrize("T,cu", [(1, None), (63, None), (130, None), (200, (0, 37, 64, 200))],
                         ids=["T1", "T63", "T130", "varlen"])
@pytest.mark.parametrize("init", [False, True], ids=["S0=0", "S0"])
def test_inverse_first_matches_chunked(regime, T, cu, init):
    B = 1 if cu else 2
    N = len(cu) - 1 if cu else B
    q, k, v, g, beta, s0 = _inputs(_gen("inverse-first", regime, T, init), B, T, 3, 16, 8, False, init, N=N,
                                   regime=regime)
    cu_t = torch.tensor(cu, dtype=torch.int32) if cu else None
    o_ref, f_ref = chunk_gated_delta_rule_ref(q, k, v, g, beta, initial_state=s0, output_final_state=True,
                                              cu_seqlens=cu_t)
    o, f = chunk_gated_delta_rule_ref(q, k, v, g, beta, initial_state=s0, output_final_state=True, cu_seqlens=cu_t,
                                      form="inverse_first")
    _assert_close(o, o_ref, "inverse-first o")
    _assert_close(f, f_ref, "inverse-first final")
    # X0 stored in bf16 (as a pass that writes it would): the error of a 16-bit operand, not of the gating
    o16, f16 = chunk_gated_delta_rule_ref(q, k, v, g, beta, initial_state=s0, output_final_state=True,
                                          cu_seqlens=cu_t, form="inverse_first", x0_dtype=torch.bfloat16)
    assert _rel(o16, o_ref) <= 5e-3 and _rel(f16, f_ref) <= 5e-3


def test_inverse_first_is_gdn_only():
    q, k, v, g, beta, _ = _inputs(_gen("inverse-first-kda"), 1, 8, 1, 4, 4, True, False)
    with pytest.raises(ValueError, match="GDN"):
        chunk_gated_delta_rule_ref(q, k, v, g, beta, form="inverse_first")
    with pytest.raises(ValueError, match="form must be"):
        chunk_gated_delta_rule_ref(q, k, v, g[..., 0], beta, form="ungated")
