"""The decode step's spec (float64): FLA's fused_recurrent GDN / KDA with every argument the op takes -- GVA, the
gate-in-kernel forms, beta as a logit, l2norm, a state pool read and written through index arrays, and
speculative decoding's per-token states."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

L2NORM_EPS = 1e-6


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + L2NORM_EPS)


def gate_values(g: torch.Tensor, kda: bool, A_log=None, dt_bias=None, lower_bound=None) -> torch.Tensor:
    """FLA's gate-in-kernel forms, from the raw gate g [.., HV] (GDN) or [.., HV, K] (KDA): the log decay
    -exp(A_log) softplus(g + dt_bias), or (KDA, lower_bound given) lower_bound sigmoid(exp(A_log) (g + dt_bias))
    with exp(A_log) = 1 when A_log is None. dt_bias: [HV] (GDN), [HV, K] or [HV * K] (KDA)."""
    HV = g.shape[-2] if kda else g.shape[-1]
    if dt_bias is not None:
        g = g + (dt_bias.to(g.dtype).reshape(HV, -1) if kda else dt_bias.to(g.dtype))
    a = torch.exp(A_log.to(g.dtype)) if A_log is not None else torch.ones(HV, dtype=g.dtype, device=g.device)
    if kda:
        a = a[:, None]
    if lower_bound is not None:
        return lower_bound * torch.sigmoid(a * g)
    return -a * F.softplus(g)


def fused_recurrent_ref(q, k, v, g, beta, *, kda: bool, scale: Optional[float] = None, initial_state=None,
                        output_final_state: bool = False, cu_seqlens=None, use_qk_l2norm_in_kernel: bool = False,
                        use_gate_in_kernel: bool = False, A_log=None, dt_bias=None, lower_bound=None,
                        use_beta_sigmoid_in_kernel: bool = False, allow_neg_eigval: bool = False,
                        initial_state_indices=None, final_state_indices=None, num_accepted_tokens=None,
                        compute_dtype=torch.float64):
    """Token by token, FLA semantics: o_t = S_t^T (scale q_t), S_t = (I - b_t k_t k_t^T) diag(exp g_t) S_{t-1} +
    b_t k_t v_t^T. q, k [B, T, H, K]; v [B, T, HV, V] (HV a multiple of H: GVA); g [B, T, HV] or [B, T, HV, K];
    beta [B, T, HV]. Sequences: B rows, or cu_seqlens (B = 1).

    States: without indices, initial_state [N, HV, K, V] and the final states [N, HV, K, V]. With indices,
    initial_state is a pool [P, HV, K, V]: sequence n starts from pool[initial_state_indices[n]] (-1: zeros) and
    its final state goes to pool[final_state_indices[n]] (-1: not written); the returned final is the pool after
    the writes (a copy). num_accepted_tokens [N] (speculative decoding): indices are [N, S], the start state is at
    [n, num_accepted_tokens[n] - 1] and the state after token t goes to final_state_indices[n, t].
    Returns (o [B, T, HV, V], final or None) in compute_dtype."""
    cd = compute_dtype
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    q, k, v, g, beta = (x.to(cd) for x in (q, k, v, g, beta))
    if use_qk_l2norm_in_kernel:
        q, k = _l2norm(q), _l2norm(k)
    q = q * (scale if scale is not None else K ** -0.5)
    if use_gate_in_kernel:
        g = gate_values(g, kda, A_log, dt_bias, lower_bound)
    if use_beta_sigmoid_in_kernel:
        beta = torch.sigmoid(beta) * (2.0 if allow_neg_eigval else 1.0)
    group = HV // H
    q, k = q.repeat_interleave(group, dim=2), k.repeat_interleave(group, dim=2)
    if cu_seqlens is not None:
        cu = [int(x) for x in cu_seqlens.tolist()]
        spans = [(0, cu[n], cu[n + 1]) for n in range(len(cu) - 1)]
    else:
        spans = [(b, 0, T) for b in range(B)]
    pool = initial_state_indices is not None or final_state_indices is not None
    spec = num_accepted_tokens is not None
    if pool:
        final = initial_state.to(cd).clone() if initial_state is not None else None
    else:
        final = v.new_zeros(len(spans), HV, K, V)
    o = v.new_zeros(B, T, HV, V)
    for n, (b, t0, t1) in enumerate(spans):
        S = v.new_zeros(HV, K, V)
        if initial_state is not None:
            if not pool:
                S = initial_state[n].to(cd).clone()
            elif initial_state_indices is not None:
                j = int(num_accepted_tokens[n]) - 1 if spec else 0
                idx = int(initial_state_indices[n, j] if initial_state_indices.dim() == 2 else initial_state_indices[n])
                if idx >= 0:
                    S = initial_state[idx].to(cd).clone()
        for t in range(t0, t1):
            decay = torch.exp(g[b, t])
            S = S * (decay[:, :, None] if kda else decay[:, None, None])
            u = beta[b, t][:, None] * (v[b, t] - torch.einsum("hk,hkv->hv", k[b, t], S))
            S = S + k[b, t][:, :, None] * u[:, None, :]
            o[b, t] = torch.einsum("hk,hkv->hv", q[b, t], S)
            if spec and final_state_indices is not None:
                idx = int(final_state_indices[n, t - t0])
                if idx >= 0:
                    final[idx] = S
        if pool:
            if final_state_indices is not None and not spec:
                idx = int(final_state_indices[n, 0] if final_state_indices.dim() == 2 else final_state_indices[n])
                if idx >= 0:
                    final[idx] = S
        else:
            final[n] = S
    return o, (final if output_final_state else None)
