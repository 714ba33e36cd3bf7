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
