"""The SM100 fused GDN kernel's algebra (`kernels/sm100/fused.py`), step by step in float64 on the CPU, against the
chunked spec: the stacked [k; q] intra product, the transposed products (lanes = channels, columns = tokens), the
fold U = v - 2^G (k S) with v_new = X diag(beta) U, and the tail rows past a chunk's end filled with garbage (what
the kernel's TMA reads there: the next sequence's tokens)."""

import pytest
import torch

from cute_kernels.reference import chunk_gated_delta_rule_ref

C = 64


def sm100_chunk_steps(q, k, v, g, beta, scale, S, round16=None):
    """One sequence and head through the kernel's per-chunk steps: q, k, v [T, 128], g, beta [T], S [128, 128].
    `round16` (a dtype) rounds what the kernel stores in 16 bits: S's copy, U, Xv, Aqk, v_new."""
    r16 = (lambda x: x.to(round16).double()) if round16 else (lambda x: x)
    T = q.shape[0]
    o = torch.zeros(T, v.shape[1], dtype=torch.float64)
    gen = torch.Generator().manual_seed(7)
    for t0 in range(0, T, C):
        L = min(C, T - t0)
        pad = lambda x: torch.cat([x[t0:t0 + L], torch.randn((C - L,) + x.shape[1:], generator=gen,   # noqa: E731
                                                                dtype=x.dtype)])
        qc, kc, vc = pad(q), pad(k), pad(v)
        gc = torch.zeros(C, dtype=torch.float64)
        gc[:L] = g[t0:t0 + L]
        G = torch.cumsum(gc, 0)                       # rows past L repeat G_{L-1}
        EG = torch.exp(G)
        live = torch.arange(C) < L
        EGL = torch.where(live, torch.exp(G[L - 1] - G), torch.zeros(C, dtype=torch.float64))
        b = torch.where(live, torch.cat([beta[t0:t0 + L], torch.zeros(C - L, dtype=torch.float64)]),
                        torch.zeros(C, dtype=torch.float64))

        kq = torch.cat([kc, qc])                      # the stacked [k; q] tile, 128 rows
        A = kq @ kc.T                                  # [128, 64]: k k^T in rows 0-63, q k^T in rows 64-127
        KQS = r16(S).T @ kq.T                          # [dv, 128 tokens]: (k S)^T then (q S)^T
        r = torch.arange(C)[:, None]
        c = torch.arange(C)[None, :]
        gate = torch.exp(G[:, None] - G[None, :])
        Akk = torch.where((c < r) & (r < L), A[:C] * gate * b[:, None], torch.zeros(()))
        Aqk = r16(torch.where(c <= r, A[C:] * gate * scale, torch.zeros(())))
        UT = r16(vc.T - EG[None, :] * KQS[:, :C])      # [dv, token]
        X = torch.linalg.inv(torch.eye(C, dtype=torch.float64) + Akk)
        Xv = r16(X * b[None, :])
        VN = r16(UT @ Xv.T)                            # v_new^T
        S = S * EG[L - 1]
        O = VN @ Aqk.T                                 # [dv, rows]
        S = S + kc.T @ r16(VN * EGL[None, :]).T
        o[t0:t0 + L] = (O + scale * EG[None, :] * KQS[:, C:]).T[:L]
    return o, S


@pytest.mark.parametrize("T, regime", [(200, "weak"), (64, "strong"), (130, "zero"), (37, "weak")])
def test_sm100_steps_match_the_chunked_spec(T, regime):
    gen = torch.Generator().manual_seed(T)
    rand = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)   # noqa: E731
    q = torch.nn.functional.normalize(rand(T, 128), dim=-1)
    k = torch.nn.functional.normalize(rand(T, 128), dim=-1)
    v = rand(T, 128)
    g = {"weak": -0.02 * torch.rand(T, generator=gen, dtype=torch.float64),
         "strong": -2.0 * torch.rand(T, generator=gen, dtype=torch.float64),
         "zero": torch.zeros(T, dtype=torch.float64)}[regime]
    beta = torch.rand(T, generator=gen, dtype=torch.float64)
    S0 = rand(128, 128)
    scale = 128 ** -0.5
    o_ref, s_ref = chunk_gated_delta_rule_ref(q[None, :, None], k[None, :, None], v[None, :, None], g[None, :, None],
                                              beta[None, :, None], scale, S0[None, None], True)
    o, S = sm100_chunk_steps(q, k, v, g, beta, scale, S0.clone())
    torch.testing.assert_close(o, o_ref[0, :, 0], rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(S, s_ref[0, 0], rtol=1e-9, atol=1e-9)
    # with the kernel's 16-bit copies: bf16's error, far from the garbage rows' or a wrong factor's
    o16, S16 = sm100_chunk_steps(q, k, v, g, beta, scale, S0.clone(), torch.bfloat16)
    err = (o16 - o_ref[0, :, 0]).abs().max() / o_ref.abs().max()
    assert err < 3e-2, err
    assert ((S16 - s_ref[0, 0]).abs().max() / s_ref.abs().max()) < 3e-2


# ---------------------------------------------------------------- KDA: the planned SM100 steps (docs/design.md)

LIMIT_LOG2 = 112.0   # the fast path's bound on a diagonal band's right factor (reference/kda_intra.py)


def sm100_kda_chunk_steps(q, k, v, g, beta, scale, S):
    """One sequence and head through the SM100 KDA plan: g [T, 128] per key channel. Intra products as four
    bands, A_delta = [kl; ql] right_delta^T with left factors anchored at each row's own 16-row block
    (x_r 2^(G_r - G_a(r)) <= 1) and right_delta[i] = k_i 2^(G_(a(i) + 16 delta) - G_i) (<= 1 below the
    diagonal blocks; band 0's <= 2^112 only where every block decays by at most 112 in log2, else the diagonal
    blocks are summed exactly); gated tiles [kg; qg] = [k; q] 2^G for (k S, q S) and kb = k 2^(G_L - G) for
    the update; v_new = X diag(beta) (v - kg S); o = scale qg S + Aqk v_new; S = 2^(G_L) S + kb^T v_new."""
    T = q.shape[0]
    o = torch.zeros(T, v.shape[1], dtype=torch.float64)
    gen = torch.Generator().manual_seed(11)
    ln2 = torch.log(torch.tensor(2.0, dtype=torch.float64))
    exact_chunks = 0
    for t0 in range(0, T, C):
        L = min(C, T - t0)
        pad = lambda x: torch.cat([x[t0:t0 + L], torch.randn((C - L,) + x.shape[1:], generator=gen,   # noqa: E731
                                                                dtype=x.dtype)])
        qc, kc, vc = pad(q), pad(k), pad(v)
        gc = torch.zeros(C, 128, dtype=torch.float64)
        gc[:L] = g[t0:t0 + L]
        G = torch.cumsum(gc, 0) / ln2                                  # log2 units; rows past L repeat G_{L-1}
        E = lambda x: torch.pow(2.0, x)   # noqa: E731
        a = (torch.arange(C) // 16) * 16                              # each row's block anchor
        fast = all((G[b] - G[b + 15]).max() <= LIMIT_LOG2 for b in range(0, C, 16))
        exact_chunks += not fast
        left = torch.cat([kc, qc]) * E(torch.cat([G - G[a], G - G[a]]))   # <= 1
        A = torch.zeros(2 * C, C, dtype=torch.float64)
        for delta in range(4):
            cols = slice(0, C - 16 * delta)
            right = kc[cols] * E(G[a[cols] + 16 * delta] - G[cols])
            band = left @ right.T                                     # [128, 64 - 16 delta]
            for qb in range(4 - delta):
                pb = qb + delta
                for half in (0, C):                                   # k rows, then q rows
                    A[half + 16 * pb: half + 16 * pb + 16, 16 * qb: 16 * qb + 16] = \
                        band[half + 16 * pb: half + 16 * pb + 16, 16 * qb: 16 * qb + 16]
        if not fast:   # the diagonal blocks straight from the definition (every factor <= 1)
            for r in range(C):
                for i in range(16 * (r // 16), r + 1):
                    f = E(G[r] - G[i])
                    A[r, i] = (kc[r] * kc[i] * f).sum()
                    A[C + r, i] = (qc[r] * kc[i] * f).sum()
        live = torch.arange(C) < L
        b = torch.where(live, torch.cat([beta[t0:t0 + L], torch.zeros(C - L, dtype=torch.float64)]),
                        torch.zeros(C, dtype=torch.float64))
        r_ = torch.arange(C)[:, None]
        c_ = torch.arange(C)[None, :]
        Akk = torch.where(c_ < r_, A[:C] * b[:, None], torch.zeros(()))
        Aqk = torch.where(c_ <= r_, A[C:] * scale, torch.zeros(()))
        kg, qg = kc * E(G), qc * E(G)
        kb = kc * E(G[L - 1] - G)
        KQS = S.T @ torch.cat([kg, qg]).T                            # [dv, 128]
        UT = vc.T - KQS[:, :C]
        X = torch.linalg.inv(torch.eye(C, dtype=torch.float64) + Akk)
        VN = UT @ (X * b[None, :]).T                                  # v_new^T
        O = VN @ Aqk.T
        S = E(G[L - 1])[:, None] * S + kb.T @ VN.T
        o[t0:t0 + L] = (O + scale * KQS[:, C:]).T[:L]
    return o, S, exact_chunks


@pytest.mark.parametrize("T, regime", [(200, "weak"), (100, "strong"), (130, "zero"), (80, "extreme")])
def test_sm100_kda_steps_match_the_chunked_spec(T, regime):
    """Both intra-product paths: "extreme" decays some channel past 112 (log2) inside a 16-row block, so its
    chunks take the exact diagonal blocks; the others stay on the banded products."""
    gen = torch.Generator().manual_seed(T + 1)
    rand = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)   # noqa: E731
    q = torch.nn.functional.normalize(rand(T, 128), dim=-1)
    k = torch.nn.functional.normalize(rand(T, 128), dim=-1)
    v = rand(T, 128)
    u = torch.rand(T, 128, generator=gen, dtype=torch.float64)
    g = {"weak": -0.02 * u, "strong": -5.0 * u, "zero": 0.0 * u, "extreme": -12.0 * u}[regime]
    beta = torch.rand(T, generator=gen, dtype=torch.float64)
    S0 = rand(128, 128)
    scale = 128 ** -0.5
    o_ref, s_ref = chunk_gated_delta_rule_ref(q[None, :, None], k[None, :, None], v[None, :, None], g[None, :, None],
                                              beta[None, :, None], scale, S0[None, None], True)
    o, S, exact = sm100_kda_chunk_steps(q, k, v, g, beta, scale, S0.clone())
    assert (exact > 0) == (regime == "extreme"), exact
    torch.testing.assert_close(o, o_ref[0, :, 0], rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(S, s_ref[0, 0], rtol=1e-9, atol=1e-9)


def test_sm100_kda_thread_mappings_rebuild_the_intra_products():
    """The KDA kernel's index work, thread by thread, in float64: `kda_tiles` (thread (channel d, warpgroup j) writes
    rows [32 j, 32 j + 32) of its channel; band delta only for rows whose block + delta <= 3, its anchor picked as
    anchor[m0] (j = 0) or anchor[m0 + 2] (j = 1)), the band products into TMEM columns `KDA_BAND_COLS`, and
    `kda_band_cols` (lane l, warpgroup j: column block qb = 2 j + b reads every band delta with qb + delta <= 3 and
    keeps pb == qb + delta). Every block on or below the diagonal must come out as x_r k_i 2^(G_r - G_i)."""
    from cute_kernels.kernels.sm100.budgets import KDA_BAND_COLS, KDA_BAND_ROWS, KDA_BANDS, fused_kda_tmem_plan

    gen = torch.Generator().manual_seed(3)
    k = torch.randn(C, 128, generator=gen, dtype=torch.float64)
    q = torch.randn(C, 128, generator=gen, dtype=torch.float64)
    G = torch.cumsum(-0.3 * torch.rand(C, 128, generator=gen, dtype=torch.float64), 0)
    raw = torch.cat([k, q])
    left = torch.zeros(2 * C, 128, dtype=torch.float64)
    bands = torch.full((sum(KDA_BANDS), 128), float("nan"), dtype=torch.float64)   # unwritten rows stay NaN
    for d in range(128):
        anchor = [G[16 * m, d] for m in range(4)]
        for j in range(2):
            for rr in range(32):
                r = 32 * j + rr
                e = 2.0 ** (G[r, d] - G[32 * j + 16 * (rr // 16), d])
                left[r, d], left[C + r, d] = k[r, d] * e, q[r, d] * e
                for delta in range(4):
                    m0 = rr // 16 + delta
                    if (j == 0 and m0 <= 3) or (j == 1 and m0 + 2 <= 3):
                        a_m = anchor[m0] if j == 0 else anchor[m0 + 2]
                        bands[KDA_BAND_ROWS[delta] + r, d] = k[r, d] * 2.0 ** (a_m - G[r, d])
    assert not bands.isnan().any(), "a band row left unwritten"
    width = dict((n, w) for n, _, w in fused_kda_tmem_plan().regions)["a"]
    tmem = torch.full((128, width), float("nan"), dtype=torch.float64)
    for delta, n in enumerate(KDA_BANDS):
        rows = bands[KDA_BAND_ROWS[delta]:KDA_BAND_ROWS[delta] + n]
        tmem[:, KDA_BAND_COLS[delta]:KDA_BAND_COLS[delta] + n] = left @ rows.T
    A = torch.zeros(2 * C, C, dtype=torch.float64)
    for lane in range(128):
        pb = (lane % C) // 16
        for j in range(2):
            for b in range(2):
                qb = 2 * j + b
                for delta in range(4):
                    if qb + delta <= 3 and pb == qb + delta:
                        cols = KDA_BAND_COLS[delta] + 16 * qb
                        A[lane, 16 * qb:16 * qb + 16] = tmem[lane, cols:cols + 16]
    r_ = torch.arange(C)[:, None]
    c_ = torch.arange(C)[None, :]
    lower = (c_ // 16) <= (r_ // 16)
    decay = 2.0 ** (G[:, None, :] - G[None, :, :])                        # [r, i, d]
    want = torch.cat([(raw[:C, None, :] * k[None] * decay).sum(-1), (raw[C:, None, :] * k[None] * decay).sum(-1)])
    torch.testing.assert_close(torch.where(lower.repeat(2, 1), A, 0.0), torch.where(lower.repeat(2, 1), want, 0.0),
                               rtol=1e-12, atol=1e-12)
