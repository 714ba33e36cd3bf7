"""Pure-torch float64 references for the (gated) delta rule: recurrent, chunked and segmented forms.

The math is in ``shared/design/linear_attention.md``. Layouts follow flash-linear-attention (FLA):

* ``q, k``: ``[B, T, H, K]``; ``v``: ``[B, T, H, V]``; ``beta``: ``[B, T, H]``
* ``g`` (per-step natural-log decay, expected <= 0): ``[B, T, H]`` (GDN, one scalar per head and token) or
  ``[B, T, H, K]`` (KDA, one value per key channel); the variant is picked by ``g.ndim``.
* states: ``[N, H, K, V]`` with ``N = B``, or ``N = len(cu_seqlens) - 1`` in varlen mode (then ``B == 1``).

Every function upcasts its inputs to ``compute_dtype`` (float64 by default), works on any device and returns
results in ``compute_dtype``. Slow by design (Python loops): specifications for the GPU kernels.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch

__all__ = [
    "recurrent_gated_delta_rule",
    "chunk_gated_delta_rule_ref",
    "chunk_summaries",
    "affine_merge",
    "split_chunks",
    "segment_summaries",
    "segmented_gated_delta_rule_ref",
]


# ------------------------------------------------------------------ Input validation


@dataclass
class _Problem:
    """Validated, upcast inputs plus the sequence layout."""

    q: Optional[torch.Tensor]  # [B, T, H, K] (None when only summaries are needed)
    k: torch.Tensor  # [B, T, H, K]
    v: torch.Tensor  # [B, T, H, V]
    g: torch.Tensor  # [B, T, H] or [B, T, H, K]
    beta: torch.Tensor  # [B, T, H]
    B: int
    T: int
    H: int
    K: int
    V: int
    N: int
    kda: bool
    scale: float
    initial_state: Optional[torch.Tensor]  # [N, H, K, V] in compute dtype
    # One entry per sequence n: (batch row, first token, end token).
    seqs: List[Tuple[int, int, int]]
    # Groups vectorized over batch rows: (rows b0:b1, tokens t0:t1, first state row n0); varlen: one per sequence.
    groups: List[Tuple[int, int, int, int, int]]


def _check_tensor(name: str, x, ndim: Sequence[int]) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {x.dtype}")
    if x.ndim not in ndim:
        want = " or ".join(f"{d}-D" for d in ndim)
        raise ValueError(f"{name} must be {want}, got shape {tuple(x.shape)}")


def _check_compute_dtype(compute_dtype) -> None:
    if not isinstance(compute_dtype, torch.dtype) or not compute_dtype.is_floating_point:
        raise TypeError(f"compute_dtype must be a floating-point torch.dtype, got {compute_dtype!r}")


def _check_chunk_size(chunk_size) -> None:
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size <= 0:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")


def _parse_cu_seqlens(cu_seqlens, B: int, T: int) -> List[int]:
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"cu_seqlens must be a 1-D integer torch.Tensor, got {type(cu_seqlens).__name__}")
    if cu_seqlens.is_floating_point() or cu_seqlens.is_complex() or cu_seqlens.dtype == torch.bool:
        raise TypeError(f"cu_seqlens must have an integer dtype, got {cu_seqlens.dtype}")
    if cu_seqlens.ndim != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens must be 1-D with at least 2 entries, got shape {tuple(cu_seqlens.shape)}")
    if B != 1:
        raise ValueError(f"cu_seqlens requires batch size B == 1 (sequences packed along T), got B = {B}")
    return _parse_offsets("cu_seqlens", cu_seqlens, T, total_label=f"T = {T}")


def _prepare(
    q,
    k,
    v,
    g,
    beta,
    scale,
    initial_state,
    cu_seqlens,
    compute_dtype,
    need_q: bool = True,
) -> _Problem:
    _check_compute_dtype(compute_dtype)
    if need_q:
        _check_tensor("q", q, (4,))
    _check_tensor("k", k, (4,))
    _check_tensor("v", v, (4,))
    _check_tensor("g", g, (3, 4))
    _check_tensor("beta", beta, (3,))
    B, T, H, K = k.shape
    if need_q and tuple(q.shape) != (B, T, H, K):
        raise ValueError(f"q must have the shape of k {tuple(k.shape)}, got {tuple(q.shape)}")
    if tuple(v.shape[:3]) != (B, T, H):
        raise ValueError(f"v must be [B, T, H, V] = [{B}, {T}, {H}, V], got {tuple(v.shape)}")
    V = v.shape[3]
    kda = g.ndim == 4
    g_shape = (B, T, H, K) if kda else (B, T, H)
    if tuple(g.shape) != g_shape:
        raise ValueError(
            f"g must be [B, T, H] (GDN) or [B, T, H, K] (KDA) = {g_shape}, got {tuple(g.shape)}"
        )
    if tuple(beta.shape) != (B, T, H):
        raise ValueError(f"beta must be [B, T, H] = {(B, T, H)}, got {tuple(beta.shape)}")

    if cu_seqlens is None:
        N = B
        seqs = [(b, 0, T) for b in range(B)]
        groups = [(0, B, 0, T, 0)] if B > 0 else []
    else:
        bounds = _parse_cu_seqlens(cu_seqlens, B, T)
        N = len(bounds) - 1
        seqs = [(0, bounds[n], bounds[n + 1]) for n in range(N)]
        groups = [(0, 1, bounds[n], bounds[n + 1], n) for n in range(N)]

    if scale is None:
        scale = K**-0.5
    elif isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be a float or None, got {type(scale).__name__}")
    scale = float(scale)

    if initial_state is not None:
        _check_tensor("initial_state", initial_state, (4,))
        if tuple(initial_state.shape) != (N, H, K, V):
            raise ValueError(
                f"initial_state must be [N, H, K, V] = {(N, H, K, V)}, got {tuple(initial_state.shape)}"
            )
        initial_state = initial_state.to(compute_dtype)

    dev = k.device
    return _Problem(
        q=q.to(dev, compute_dtype) if need_q else None,
        k=k.to(dev, compute_dtype),
        v=v.to(dev, compute_dtype),
        g=g.to(dev, compute_dtype),
        beta=beta.to(dev, compute_dtype),
        B=B,
        T=T,
        H=H,
        K=K,
        V=V,
        N=N,
        kda=kda,
        scale=scale,
        initial_state=None if initial_state is None else initial_state.to(dev),
        seqs=seqs,
        groups=groups,
    )


def _state0(p: _Problem, n0: int, n1: int) -> torch.Tensor:
    if p.initial_state is None:
        return p.k.new_zeros(n1 - n0, p.H, p.K, p.V)
    return p.initial_state[n0:n1].clone()


def _num_chunks(length: int, chunk_size: int) -> int:
    return -(-length // chunk_size)


# ------------------------------------------------------------------ 1. Recurrent form (the definition)


def _decay_state(S: torch.Tensor, g_t: torch.Tensor, kda: bool) -> torch.Tensor:
    """S: [n, H, K, V]; g_t: [n, H] (GDN) or [n, H, K] (KDA). Returns Diag(exp(g_t)) S."""
    if kda:
        return S * g_t.exp()[..., :, None]
    return S * g_t.exp()[..., None, None]


def _recurrent_group(q, k, v, g, beta, scale, S, kda):
    """Token loop for a group of equal-length rows. q, k: [n, L, H, K] ... S: [n, H, K, V]."""
    L = k.shape[1]
    o = v.new_empty(v.shape)
    for t in range(L):
        k_t = k[:, t]  # [n, H, K]
        S = _decay_state(S, g[:, t], kda)
        # (I - b k k^T) S + b k v^T = S + b k (v - S^T k)^T
        err = v[:, t] - torch.einsum("nhk,nhkv->nhv", k_t, S)  # [n, H, V]
        S = S + (beta[:, t, :, None, None] * k_t[..., :, None]) * err[..., None, :]
        o[:, t] = torch.einsum("nhkv,nhk->nhv", S, scale * q[:, t])
    return o, S


def recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: Optional[float] = None,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    cu_seqlens: Optional[torch.Tensor] = None,
    compute_dtype: torch.dtype = torch.float64,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Token-by-token gated delta rule (the definition), GDN or KDA.

    For every sequence and head::

        D_t = Diag(exp(g_t));  S_t = (I - b_t k_t k_t^T) D_t S_{t-1} + b_t k_t v_t^T;  o_t = S_t^T (scale q_t)

    with ``S_0 = initial_state`` (zeros if None). Vectorized over batch rows and heads; in varlen mode
    (``cu_seqlens`` given, ``B == 1``) each packed sequence restarts from its own initial state.

    Returns ``(o [B, T, H, V], final_state [N, H, K, V] or None)`` in ``compute_dtype``.
    """
    p = _prepare(q, k, v, g, beta, scale, initial_state, cu_seqlens, compute_dtype)
    o = p.v.new_zeros(p.B, p.T, p.H, p.V)
    final = p.k.new_empty(p.N, p.H, p.K, p.V)
    for b0, b1, t0, t1, n0 in p.groups:
        n1 = n0 + (b1 - b0)
        S = _state0(p, n0, n1)
        o_g, S = _recurrent_group(
            p.q[b0:b1, t0:t1], p.k[b0:b1, t0:t1], p.v[b0:b1, t0:t1],
            p.g[b0:b1, t0:t1], p.beta[b0:b1, t0:t1], p.scale, S, p.kda,
        )
        o[b0:b1, t0:t1] = o_g
        final[n0:n1] = S
    return o, (final if output_final_state else None)


# ------------------------------------------------------------------ 2. Chunked form


@dataclass
class _ChunkTerms:
    decay: torch.Tensor  # exp(G_r - G_i) for i <= r, else 0: [n, H, L, L] (GDN) or [n, H, L, L, K] (KDA)
    eG: torch.Tensor  # exp(G): [n, H, L, 1] (GDN) or [n, H, L, K] (KDA), broadcastable against k
    w: torch.Tensor  # [n, H, L, K]
    u: torch.Tensor  # [n, H, L, V]
    kg: torch.Tensor  # exp(G_last - G) * k: [n, H, L, K]
    decay_last: torch.Tensor  # exp(G_last): [n, H] (GDN) or [n, H, K] (KDA)
    T: torch.Tensor  # (I + Akk)^-1 Diag(b): [n, H, L, L]


def _chunk_terms(k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, kda: bool) -> _ChunkTerms:
    """Intra-chunk quantities of the design doc for one chunk of L tokens (heads-major layout).

    k: [n, H, L, K], v: [n, H, L, V], g: [n, H, L] or [n, H, L, K], beta: [n, H, L].

    G is the inclusive cumulative sum of g inside the chunk, from the chunk start. Every pairwise factor
    exp(G_r - G_i) is formed from the difference (masked to i <= r before the exp), so nothing here overflows.
    """
    L = k.shape[2]
    G = g.cumsum(dim=2)
    incl = torch.ones(L, L, dtype=torch.bool, device=k.device).tril()  # i <= r
    if kda:
        diff = G[:, :, :, None, :] - G[:, :, None, :, :]  # [n, H, L(r), L(i), K]
        decay = diff.masked_fill(~incl[:, :, None], -math.inf).exp()
        Akk = torch.einsum("nhrd,nhid,nhrid->nhri", k, k, decay)
        eG = G.exp()
        G_last = G[:, :, -1]  # [n, H, K]
        kg = (G_last[:, :, None, :] - G).exp() * k
    else:
        diff = G[..., :, None] - G[..., None, :]  # [n, H, L(r), L(i)]
        decay = diff.masked_fill(~incl, -math.inf).exp()
        Akk = (k @ k.transpose(-1, -2)) * decay
        eG = G.exp()[..., None]
        G_last = G[:, :, -1]  # [n, H]
        kg = (G_last[..., None] - G).exp()[..., None] * k
    Akk = beta[..., :, None] * Akk.tril(-1)  # Akk[r, i] = b_r (...) for i < r
    eye = torch.eye(L, dtype=k.dtype, device=k.device)
    # T = (I + Akk)^{-1} Diag(b): unit lower-triangular solve.
    Tm = torch.linalg.solve_triangular(eye + Akk, torch.diag_embed(beta), upper=False, unitriangular=True)
    w = Tm @ (eG * k)
    u = Tm @ v
    return _ChunkTerms(decay=decay, eG=eG, w=w, u=u, kg=kg, decay_last=G_last.exp(), T=Tm)


def _decay_by_last(S: torch.Tensor, decay_last: torch.Tensor, kda: bool) -> torch.Tensor:
    """Diag(exp(G_last)) S for S [n, H, K, X]."""
    if kda:
        return decay_last[..., :, None] * S
    return decay_last[..., None, None] * S


def _inverse_first_chunk(qc, kc, vc, gc, bc, scale, S, x0_dtype):
    """GDN's chunk from its ungated inverse X0 = (I + strict(diag(b) k k^T))^-1 (heads-major [n, H, L, ...]
    views): the gated Akk is D A0 D^-1 with D = diag(exp(G)), so (I + Akk)^-1 = X0 gated element by element,
    X[r, i] = exp(G_r - G_i) X0[r, i], and v_new = X diag(b) (v - exp(G) (k S)) (w and u in one product).
    `x0_dtype`: X0 rounded to it first, as a pass that stores it would (docs/design.md, section 11)."""
    L = kc.shape[2]
    eye = torch.eye(L, dtype=kc.dtype, device=kc.device)
    A0 = (bc[..., :, None] * (kc @ kc.transpose(-1, -2))).tril(-1)
    X0 = torch.linalg.solve_triangular(eye + A0, eye.expand_as(A0), upper=False, unitriangular=True)
    if x0_dtype is not None:
        X0 = X0.to(x0_dtype).to(kc.dtype)
    G = gc.cumsum(dim=-1)
    incl = torch.ones(L, L, dtype=torch.bool, device=kc.device).tril()
    gamma = (G[..., :, None] - G[..., None, :]).masked_fill(~incl, -math.inf).exp()   # exp(G_r - G_i), i <= r
    X = gamma * X0
    eG = G.exp()[..., None]
    v_new = X @ (bc[..., None] * (vc - eG * (kc @ S)))
    o = scale * (eG * qc) @ S + (scale * (qc @ kc.transpose(-1, -2)) * gamma) @ v_new
    G_last = G[..., -1]
    kg = (G_last[..., None] - G).exp()[..., None] * kc
    return o, G_last.exp()[..., None, None] * S + kg.transpose(-1, -2) @ v_new


def _chunk_forward_group(q, k, v, g, beta, scale, S, chunk_size, kda, x0_dtype=None, inverse_first=False):
    """Chunked forward for a group of equal-length rows, chunked from token 0 (last chunk partial).
    q, k: [n, L, H, K]; v: [n, L, H, V]; g: [n, L, H(, K)]; beta: [n, L, H]; S: [n, H, K, V].
    Returns o [n, L, H, V] and the state after the last token."""
    L = k.shape[1]
    o = v.new_empty(v.shape)
    for c0 in range(0, L, chunk_size):
        c1 = min(c0 + chunk_size, L)
        qc = q[:, c0:c1].transpose(1, 2)  # [n, H, Lc, K]
        kc = k[:, c0:c1].transpose(1, 2)
        vc = v[:, c0:c1].transpose(1, 2)
        gc = g[:, c0:c1].transpose(1, 2)
        bc = beta[:, c0:c1].transpose(1, 2)
        if inverse_first:
            oc, S = _inverse_first_chunk(qc, kc, vc, gc, bc, scale, S, x0_dtype)
            o[:, c0:c1] = oc.transpose(1, 2)
            continue
        t = _chunk_terms(kc, vc, gc, bc, kda)
        if kda:
            Aqk = scale * torch.einsum("nhrd,nhid,nhrid->nhri", qc, kc, t.decay)
        else:
            Aqk = scale * (qc @ kc.transpose(-1, -2)) * t.decay  # decay is already tril (i <= r)
        v_new = t.u - t.w @ S
        oc = scale * (t.eG * qc) @ S + Aqk @ v_new
        o[:, c0:c1] = oc.transpose(1, 2)
        S = _decay_by_last(S, t.decay_last, kda) + t.kg.transpose(-1, -2) @ v_new
    return o, S


def chunk_gated_delta_rule_ref(
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
    compute_dtype: torch.dtype = torch.float64,
    form: str = "solved",
    x0_dtype: Optional[torch.dtype] = None,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Chunked gated delta rule, exactly the chunked form of the design doc.

    Each sequence is cut into chunks of ``chunk_size`` tokens from its own start (the last chunk may be partial).
    Per chunk, with G the inclusive cumsum of g inside the chunk and S the state at the chunk start::

        Akk[r,i] = b_r sum_d k_rd k_id exp(G_rd - G_id)  (i < r);   Aqk[r,i] = scale sum_d q_rd k_id exp(G_rd - G_id)  (i <= r)
        T = (I + Akk)^{-1} Diag(b);  w = T (exp(G) k);  u = T v;  kg = exp(G_last - G) k
        v_new = u - w S;  o = scale (exp(G) q) S + Aqk v_new;  S' = Diag(exp(G_last)) S + kg^T v_new

    ``form="inverse_first"`` (GDN): each chunk from its ungated inverse, gated element by element
    (`_inverse_first_chunk`; ``x0_dtype`` rounds that inverse first), the spec of a pass not yet built.

    Returns ``(o [B, T, H, V], final_state [N, H, K, V] or None)`` in ``compute_dtype``.
    """
    _check_chunk_size(chunk_size)
    if form not in ("solved", "inverse_first"):
        raise ValueError(f"form must be 'solved' or 'inverse_first', got {form!r}")
    if form == "inverse_first" and g.ndim != 3:
        raise ValueError(f"g must be [B, T, H]: the inverse-first form is GDN's (got g.ndim = {g.ndim})")
    p = _prepare(q, k, v, g, beta, scale, initial_state, cu_seqlens, compute_dtype)
    o = p.v.new_zeros(p.B, p.T, p.H, p.V)
    final = p.k.new_empty(p.N, p.H, p.K, p.V)
    for b0, b1, t0, t1, n0 in p.groups:
        n1 = n0 + (b1 - b0)
        S = _state0(p, n0, n1)
        o_g, S = _chunk_forward_group(
            p.q[b0:b1, t0:t1], p.k[b0:b1, t0:t1], p.v[b0:b1, t0:t1],
            p.g[b0:b1, t0:t1], p.beta[b0:b1, t0:t1], p.scale, S, chunk_size, p.kda, x0_dtype,
            form == "inverse_first",
        )
        o[b0:b1, t0:t1] = o_g
        final[n0:n1] = S
    return o, (final if output_final_state else None)


# ------------------------------------------------------------------ 3. Per-chunk affine maps


def _chunk_maps_group(k, v, g, beta, chunk_size, kda):
    """Affine maps of all chunks of a group of equal-length rows.
    k: [n, L, H, K] ... Returns M [n, C, H, K, K], h [n, C, H, K, V] with C = ceil(L / chunk_size)."""
    n, L, H, K = k.shape
    V = v.shape[-1]
    C = _num_chunks(L, chunk_size)
    M = k.new_empty(n, C, H, K, K)
    h = k.new_empty(n, C, H, K, V)
    eye = torch.eye(K, dtype=k.dtype, device=k.device)
    for c in range(C):
        c0, c1 = c * chunk_size, min((c + 1) * chunk_size, L)
        t = _chunk_terms(
            k[:, c0:c1].transpose(1, 2), v[:, c0:c1].transpose(1, 2),
            g[:, c0:c1].transpose(1, 2), beta[:, c0:c1].transpose(1, 2), kda,
        )
        kgT = t.kg.transpose(-1, -2)  # [n, H, K, Lc]
        # M_c = Diag(exp(G_last)) - kg^T w;  h_c = kg^T u
        M[:, c] = _decay_by_last(eye.expand(n, H, K, K), t.decay_last, kda) - kgT @ t.w
        h[:, c] = kgT @ t.u
    return M, h


def chunk_summaries(
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    chunk_size: int = 64,
    cu_seqlens: Optional[torch.Tensor] = None,
    compute_dtype: torch.dtype = torch.float64,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Affine map ``S' = M_c S + h_c`` of every chunk, for all sequences.

    ``M_c = Diag(exp(G_last)) - kg^T w`` (``[H, K, K]``) and ``h_c = kg^T u`` (``[H, K, V]``), with the chunked-form
    quantities of :func:`chunk_gated_delta_rule_ref`. Chunks of all sequences are concatenated in sequence order.

    Returns ``(M [C_total, H, K, K], h [C_total, H, K, V], chunk_offsets [N + 1] int64)`` where ``chunk_offsets[n]``
    is the index of sequence n's first chunk (and ``chunk_offsets[N] == C_total``). M and h are in ``compute_dtype``.
    """
    _check_chunk_size(chunk_size)
    p = _prepare(None, k, v, g, beta, None, None, cu_seqlens, compute_dtype, need_q=False)
    Ms, hs = [], []
    for b0, b1, t0, t1, _ in p.groups:
        M_g, h_g = _chunk_maps_group(
            p.k[b0:b1, t0:t1], p.v[b0:b1, t0:t1], p.g[b0:b1, t0:t1], p.beta[b0:b1, t0:t1], chunk_size, p.kda
        )
        Ms.append(M_g.flatten(0, 1))  # sequence-major: all chunks of row b0, then b0 + 1, ...
        hs.append(h_g.flatten(0, 1))
    counts = [_num_chunks(t1 - t0, chunk_size) for _, t0, t1 in p.seqs]
    offsets = torch.tensor([0] + counts, dtype=torch.int64).cumsum(0)
    if Ms:
        M = torch.cat(Ms)
        h = torch.cat(hs)
    else:
        M = p.k.new_empty(0, p.H, p.K, p.K)
        h = p.k.new_empty(0, p.H, p.K, p.V)
    return M, h, offsets.to(p.k.device)


# ------------------------------------------------------------------ 4. Merge of affine segment summaries


def _parse_offsets(name: str, offsets, total: int, total_label: str | None = None) -> List[int]:
    if isinstance(offsets, torch.Tensor):
        if offsets.is_floating_point() or offsets.is_complex() or offsets.dtype == torch.bool:
            raise TypeError(f"{name} must hold integers, got dtype {offsets.dtype}")
        if offsets.ndim != 1:
            raise ValueError(f"{name} must be 1-D, got shape {tuple(offsets.shape)}")
        vals = [int(x) for x in offsets.tolist()]
    else:
        try:
            vals = list(offsets)
        except TypeError:
            raise TypeError(f"{name} must be a 1-D integer tensor or a sequence of ints") from None
        if not all(isinstance(x, int) and not isinstance(x, bool) for x in vals):
            raise TypeError(f"{name} must hold ints, got {vals!r}")
    if len(vals) < 1:
        raise ValueError(f"{name} must have at least one entry")
    if vals[0] != 0:
        raise ValueError(f"{name} must start at 0, got {vals[0]}")
    if any(b < a for a, b in zip(vals[:-1], vals[1:])):
        raise ValueError(f"{name} must be non-decreasing, got {vals}")
    if vals[-1] != total:
        raise ValueError(f"{name} must end at {total_label or total}, got {vals[-1]}")
    return vals


def affine_merge(
    M: torch.Tensor,
    h: torch.Tensor,
    seg_offsets,
    initial_state: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Sequential merge of segment summaries (the spec shared with the GPU merge kernel).

    ``M``: ``[S_total, H, K, K]``, ``h``: ``[S_total, H, K, V]``; ``seg_offsets``: ``[N + 1]`` ints (tensor or
    sequence), segments of sequence n are rows ``seg_offsets[n] .. seg_offsets[n+1] - 1``. For each sequence::

        start(first) = initial_state[n] (zeros if None);  start(s + 1) = M_s start(s) + h_s
        final[n] = M_last start(last) + h_last            (= initial_state[n] if the sequence has no segments)

    Computes in ``M.dtype`` (h and initial_state are cast to it). Returns
    ``(start_states [S_total, H, K, V], final_state [N, H, K, V])``.
    """
    _check_tensor("M", M, (4,))
    _check_tensor("h", h, (4,))
    S_total, H, K, K2 = M.shape
    if K2 != K:
        raise ValueError(f"M must be [S_total, H, K, K], got {tuple(M.shape)}")
    if tuple(h.shape[:3]) != (S_total, H, K):
        raise ValueError(f"h must be [S_total, H, K, V] = [{S_total}, {H}, {K}, V], got {tuple(h.shape)}")
    V = h.shape[3]
    offs = _parse_offsets("seg_offsets", seg_offsets, S_total)
    N = len(offs) - 1
    dtype, dev = M.dtype, M.device
    h = h.to(dev, dtype)
    if initial_state is None:
        init = M.new_zeros(N, H, K, V)
    else:
        _check_tensor("initial_state", initial_state, (4,))
        if tuple(initial_state.shape) != (N, H, K, V):
            raise ValueError(
                f"initial_state must be [N, H, K, V] = {(N, H, K, V)}, got {tuple(initial_state.shape)}"
            )
        init = initial_state.to(dev, dtype)
    start = M.new_empty(S_total, H, K, V)
    final = M.new_empty(N, H, K, V)
    for n in range(N):
        S = init[n]
        for s in range(offs[n], offs[n + 1]):
            start[s] = S
            S = M[s] @ S + h[s]
        final[n] = S
    return start, final


# ------------------------------------------------------------------ 5-7. Segments


def split_chunks(num_chunks: int, num_segments: int) -> List[int]:
    """Bounds ``[0, c1, ..., num_chunks]`` of near-equal (sizes differ by at most 1), contiguous, non-empty groups.
    Uses ``min(num_chunks, num_segments)`` groups; ``num_chunks == 0`` gives ``[0]`` (no segments)."""
    if isinstance(num_chunks, bool) or not isinstance(num_chunks, int) or num_chunks < 0:
        raise ValueError(f"num_chunks must be a non-negative int, got {num_chunks!r}")
    if isinstance(num_segments, bool) or not isinstance(num_segments, int) or num_segments < 1:
        raise ValueError(f"num_segments must be a positive int, got {num_segments!r}")
    s = min(num_chunks, num_segments)
    if s == 0:
        return [0]
    return [(i * num_chunks) // s for i in range(s + 1)]


def _parse_segment_bounds(segment_bounds, chunk_counts: List[int]) -> List[List[int]]:
    if isinstance(segment_bounds, (str, bytes, torch.Tensor)) or not isinstance(segment_bounds, Sequence):
        raise TypeError("segment_bounds must be a list (one per sequence) of lists of chunk-index bounds")
    if len(segment_bounds) != len(chunk_counts):
        raise ValueError(
            f"segment_bounds must have one entry per sequence ({len(chunk_counts)}), got {len(segment_bounds)}"
        )
    out = []
    for n, (bounds, nc) in enumerate(zip(segment_bounds, chunk_counts)):
        vals = _parse_offsets(f"segment_bounds[{n}]", bounds, nc)
        out.append(vals)
    return out


def _compose_segments(M_c: torch.Tensor, h_c: torch.Tensor, chunk_offsets: List[int], bounds: List[List[int]]):
    """Compose chunk maps into segment maps. Segment [c0, c1) of a sequence: start (I, 0), then per chunk
    (M, h) <- (M_c M, M_c h + h_c), i.e. run the chunks from a zero state while carrying M."""
    _, H, K, _ = M_c.shape
    V = h_c.shape[-1]
    eye = torch.eye(K, dtype=M_c.dtype, device=M_c.device).expand(H, K, K)
    Ms, hs = [], []
    for n, seg_b in enumerate(bounds):
        base = chunk_offsets[n]
        for c0, c1 in zip(seg_b[:-1], seg_b[1:]):
            M = eye.clone()
            hh = M_c.new_zeros(H, K, V)
            for c in range(base + c0, base + c1):
                M = M_c[c] @ M
                hh = M_c[c] @ hh + h_c[c]
            Ms.append(M)
            hs.append(hh)
    counts = [len(b) - 1 for b in bounds]
    seg_offsets = torch.tensor([0] + counts, dtype=torch.int64).cumsum(0).to(M_c.device)
    if Ms:
        return torch.stack(Ms), torch.stack(hs), seg_offsets
    return M_c.new_empty(0, H, K, K), M_c.new_empty(0, H, K, V), seg_offsets


def segment_summaries(
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    segment_bounds,
    chunk_size: int = 64,
    cu_seqlens: Optional[torch.Tensor] = None,
    compute_dtype: torch.dtype = torch.float64,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Affine summary ``(M_seg, h_ext)`` of every segment of every sequence.

    ``segment_bounds``: one list per sequence of chunk-index bounds ``[0, c1, ..., num_chunks_n]`` (as returned by
    :func:`split_chunks`; non-decreasing, an empty segment is the identity map). Each segment is summarized as if run
    from a zero state while carrying M: start from ``(I, 0)`` and compose ``(M, h) <- (M_c M, M_c h + h_c)`` over its
    chunks, so that ``S_end = M_seg S_start + h_ext``.

    Returns ``(M [S_total, H, K, K], h_ext [S_total, H, K, V], seg_offsets [N + 1] int64)`` in ``compute_dtype``.
    """
    _check_chunk_size(chunk_size)
    M_c, h_c, chunk_offsets = chunk_summaries(k, v, g, beta, chunk_size, cu_seqlens, compute_dtype)
    offs = [int(x) for x in chunk_offsets.tolist()]
    counts = [b - a for a, b in zip(offs[:-1], offs[1:])]
    bounds = _parse_segment_bounds(segment_bounds, counts)
    return _compose_segments(M_c, h_c, offs, bounds)


def segmented_gated_delta_rule_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: Optional[float] = None,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    cu_seqlens: Optional[torch.Tensor] = None,
    num_segments: Optional[int] = None,
    segment_bounds=None,
    chunk_size: int = 64,
    compute_dtype: torch.dtype = torch.float64,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Segmented (chunk-parallel) gated delta rule: the executable spec of the segmented kernels.

    1. Split each sequence's chunks into segments: ``num_segments`` (applied per sequence through
       :func:`split_chunks`) or explicit ``segment_bounds`` (one bound list per sequence); give exactly one.
    2. Summarize every segment as an affine map (:func:`segment_summaries`).
    3. :func:`affine_merge` the summaries from ``initial_state`` to get each segment's true start state and the
       final state.
    4. Recompute each segment's outputs with the chunked form from its start state.

    Returns ``(o [B, T, H, V], final_state [N, H, K, V] or None)`` in ``compute_dtype``.
    """
    _check_chunk_size(chunk_size)
    if (num_segments is None) == (segment_bounds is None):
        raise ValueError("give exactly one of num_segments and segment_bounds")
    p = _prepare(q, k, v, g, beta, scale, initial_state, cu_seqlens, compute_dtype)
    counts = [_num_chunks(t1 - t0, chunk_size) for _, t0, t1 in p.seqs]
    if num_segments is not None:
        if isinstance(num_segments, bool) or not isinstance(num_segments, int) or num_segments < 1:
            raise ValueError(f"num_segments must be a positive int, got {num_segments!r}")
        bounds = [split_chunks(nc, num_segments) for nc in counts]
    else:
        bounds = _parse_segment_bounds(segment_bounds, counts)

    M_seg, h_seg, seg_offsets = segment_summaries(
        p.k, p.v, p.g, p.beta, bounds, chunk_size, cu_seqlens, compute_dtype
    )
    start, final = affine_merge(M_seg, h_seg, seg_offsets, p.initial_state)

    o = p.v.new_zeros(p.B, p.T, p.H, p.V)
    offs = [int(x) for x in seg_offsets.tolist()]
    for n, (b, bos, eos) in enumerate(p.seqs):
        for j, (c0, c1) in enumerate(zip(bounds[n][:-1], bounds[n][1:])):
            t0, t1 = bos + c0 * chunk_size, min(bos + c1 * chunk_size, eos)
            if t1 <= t0:
                continue
            S = start[offs[n] + j][None]
            o_s, _ = _chunk_forward_group(
                p.q[b : b + 1, t0:t1], p.k[b : b + 1, t0:t1], p.v[b : b + 1, t0:t1],
                p.g[b : b + 1, t0:t1], p.beta[b : b + 1, t0:t1], p.scale, S, chunk_size, p.kda,
            )
            o[b, t0:t1] = o_s[0]
    return o, (final if output_final_state else None)
