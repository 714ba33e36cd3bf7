"""Executable spec of an inverse-first chunked GDN forward (docs/design.md, section 11, item 2): each chunk's
ungated inverse X0 = (I + strict(diag(beta) k k^T))^-1 is formed without the gates (a pass of its own, in
parallel over chunks, stored in 16 bits), and the pass that walks the chunks gates it element by element.

Why it is exact: with D = diag(exp(G)) (G the chunk's cumulative log decay), the gated Akk is D A0 D^-1 (the
row factors beta commute with D), so (I + Akk)^-1 = D X0 D^-1, i.e. X[r, i] = exp(G_r - G_i) X0[r, i] (i <= r,
every factor <= 1). Per chunk, with S the state at its start:

    v_new = X diag(beta) (v - exp(G) (k S));   o = scale (exp(G) q) S + Aqk v_new;
    S' = exp(G_last) S + (exp(G_last - G) k)^T v_new

which is `chunk_gated_delta_rule_ref`'s chunk with w = T exp(G) k and u = T v folded into one product. GDN only
(KDA's per-channel gates are no similarity of one matrix).
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch

from .linear_attention import _check_chunk_size, _prepare, _state0

__all__ = ["chunk_gated_delta_rule_inverse_first"]


def _chunk(qc, kc, vc, gc, bc, scale, S, x0_dtype):
    """One chunk (heads-major [n, H, L, ...] views): the output rows and the state after the chunk."""
    L = kc.shape[2]
    eye = torch.eye(L, dtype=kc.dtype, device=kc.device)
    A0 = (bc[..., :, None] * (kc @ kc.transpose(-1, -2))).tril(-1)
    X0 = torch.linalg.solve_triangular(eye + A0, eye.expand_as(A0), upper=False, unitriangular=True)
    if x0_dtype is not None:   # the stored ungated inverse
        X0 = X0.to(x0_dtype).to(kc.dtype)
    G = gc.cumsum(dim=-1)
    incl = torch.ones(L, L, dtype=torch.bool, device=kc.device).tril()
    gamma = (G[..., :, None] - G[..., None, :]).masked_fill(~incl, -math.inf).exp()   # exp(G_r - G_i), i <= r
    X = gamma * X0
    eG = G.exp()[..., None]
    v_new = X @ (bc[..., None] * (vc - eG * (kc @ S)))
    Aqk = scale * (qc @ kc.transpose(-1, -2)) * gamma
    o = scale * (eG * qc) @ S + Aqk @ v_new
    G_last = G[..., -1]
    kg = (G_last[..., None] - G).exp()[..., None] * kc
    S = G_last.exp()[..., None, None] * S + kg.transpose(-1, -2) @ v_new
    return o, S


def chunk_gated_delta_rule_inverse_first(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: Optional[float] = None,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    cu_seqlens: Optional[torch.Tensor] = None,
    chunk_size: int = 64,
    x0_dtype: Optional[torch.dtype] = None,
    compute_dtype: torch.dtype = torch.float64,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """GDN's chunked forward from the ungated inverse (module docstring); the arguments and results of
    `chunk_gated_delta_rule_ref`. `x0_dtype` (e.g. torch.bfloat16): X0 rounded to it before it is gated, as a
    kernel that stores it would."""
    _check_chunk_size(chunk_size)
    if g.ndim != 3:
        raise ValueError(f"g must be [B, T, H]: the inverse-first form is GDN's (got g.ndim = {g.ndim})")
    p = _prepare(q, k, v, g, beta, scale, initial_state, cu_seqlens, compute_dtype)
    o = p.v.new_zeros(p.B, p.T, p.H, p.V)
    final = p.k.new_empty(p.N, p.H, p.K, p.V)
    for b0, b1, t0, t1, n0 in p.groups:
        S = _state0(p, n0, n0 + (b1 - b0))
        for c0 in range(t0, t1, chunk_size):
            c1 = min(c0 + chunk_size, t1)
            view = lambda x: x[b0:b1, c0:c1].transpose(1, 2)   # noqa: E731  [n, H, L, ...]
            oc, S = _chunk(view(p.q), view(p.k), view(p.v), view(p.g), view(p.beta), p.scale, S, x0_dtype)
            o[b0:b1, c0:c1] = oc.transpose(1, 2)
        final[n0:n0 + (b1 - b0)] = S
    return o, (final if output_final_state else None)
