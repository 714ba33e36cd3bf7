"""The decode step: `fused_recurrent_gated_delta_rule` and `fused_recurrent_kda`, FLA 0.6's signatures plus a
state pool and speculative decoding. One launch (`RecurrentStep`), no host read of any device tensor, so a call
can be captured in a CUDA graph and replayed with new lengths, indices and accepted counts.

State pool: `initial_state` is a pool [P, HV, K, V] fp32 when `initial_state_indices` or `final_state_indices`
(int32 [N]) is given: sequence n starts from pool[initial_state_indices[n]] (-1: a zero state) and its final
state is written in place to pool[final_state_indices[n]] (-1: not written). Several sequences may start from one
slot; a slot written by one sequence must not be read or written by another in the same call (the CTAs run in
any order). `num_accepted_tokens` [N] (speculative decoding): the indices are [N, S] (S >= the longest
sequence); the start state is read at [n, num_accepted_tokens[n] - 1] and the state after token t is written at
[n, t] (`final_state_indices` defaults to `initial_state_indices`).
"""

from __future__ import annotations

import torch

from ..checks import check_cuda, check_no_grad, check_qkv, check_shape, check_tensor
from ..kernels.build import build_recurrent_step
from ..kernels.configs import STEP_GROUP, RecurrentConfig

IO_DTYPES = (torch.bfloat16, torch.float16)
HEAD_DIM = 128
MAX_SEQS = 65535   # the grid's z extent
# Up to this many tokens per sequence (not varlen) the count is compiled in (`RecurrentConfig.tokens`); beyond, the
# token loop reads T (at 8 tokens the unrolled loop measured slower: docs/design.md, section 12).
STATIC_TOKENS = 4
# the tensor-core step where it measured faster than token by token (docs/perf-history.md): from 5 tokens a sequence
# (the token loop runs at run time there) on at least 256 (sequence, value head) items
TC_MIN_TOKENS = 5
TC_MIN_ITEMS = 256


def _dummies(device) -> tuple:
    """The 1-element stand-ins for unused arguments on `device`: (fp32 [1], fp32 state [1, 1, K, V], int32 [1],
    int32 [1, 1]); made once per device."""
    hit = _dummy_sets.get(device)
    if hit is None:
        f32, i32 = torch.float32, torch.int32
        hit = _dummy_sets[device] = (torch.zeros(1, dtype=f32, device=device),
                                     torch.zeros((1, 1, HEAD_DIM, HEAD_DIM), dtype=f32, device=device),
                                     torch.zeros(1, dtype=i32, device=device),
                                     torch.zeros((1, 1), dtype=i32, device=device))
    return hit


_dummy_sets: dict = {}


def _param(name: str, t, shape: tuple) -> torch.Tensor:
    """A small fp32 parameter (A_log, dt_bias) of the given element count, flattened."""
    check_tensor(name, t, dtypes=(torch.float32, torch.bfloat16, torch.float16), align=4)
    if t.numel() != int(torch.Size(shape).numel()):
        raise ValueError(f"{name} must have shape {shape}, got {tuple(t.shape)}")
    return t.reshape(-1).float()


def _indices(name: str, t, N: int, spec: bool) -> torch.Tensor:
    check_tensor(name, t, dtypes=(torch.int32,), align=4)
    if spec:
        if t.dim() != 2 or t.shape[0] != N:
            raise ValueError(f"{name} must be [N = {N}, S] with num_accepted_tokens, got shape {tuple(t.shape)}")
        return t
    if t.dim() != 1 or t.shape[0] != N:
        raise ValueError(f"{name} must be [N = {N}] int32, got shape {tuple(t.shape)}")
    return t


def fused_recurrent(q, k, v, g, beta, *, kda: bool, scale=None, initial_state=None, output_final_state=False,
                    use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, A_log=None, dt_bias=None,
                    lower_bound=None, use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, cu_seqlens=None,
                    initial_state_indices=None, final_state_indices=None, num_accepted_tokens=None, out=None):
    """The common decode step (see the module docstring); returns (o, final state or pool or None)."""
    name = "fused_recurrent_kda" if kda else "fused_recurrent_gated_delta_rule"
    check_no_grad(name, q=q, k=k, v=v, g=g, beta=beta, initial_state=initial_state, A_log=A_log, dt_bias=dt_bias)
    B, T, H, K, HV, V = check_qkv(q, k, v, IO_DTYPES, (HEAD_DIM,))
    if g is None:
        g = torch.zeros((B, T, HV, K) if kda else (B, T, HV), dtype=torch.float32, device=q.device)
    check_tensor("g", g, dtypes=(torch.float32, q.dtype), ndim=4 if kda else 3, align=4)
    check_shape("g", g, (B, T, HV, K) if kda else (B, T, HV))
    if beta is None:
        beta = torch.ones((B, T, HV), dtype=q.dtype, device=q.device)
    check_tensor("beta", beta, dtypes=(torch.float32, q.dtype), ndim=3, align=4)
    check_shape("beta", beta, (B, T, HV))
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float)) or scale <= 0):
        raise ValueError(f"scale must be a positive number or None, got {scale!r}")
    if allow_neg_eigval and not use_beta_sigmoid_in_kernel:
        raise ValueError("allow_neg_eigval=True requires use_beta_sigmoid_in_kernel=True (as FLA)")
    if lower_bound is not None and not kda:
        raise ValueError("lower_bound is fused_recurrent_kda's argument")
    if use_gate_in_kernel:
        if A_log is None and lower_bound is None:
            raise ValueError("A_log must be given when use_gate_in_kernel=True" +
                             (" (or lower_bound)" if kda else ""))
        if lower_bound is not None and (isinstance(lower_bound, bool) or not isinstance(lower_bound, (int, float))
                                        or lower_bound >= 0):
            raise ValueError(f"lower_bound must be a negative number, got {lower_bound!r}")
    else:
        A_log = dt_bias = lower_bound = None   # ignored without use_gate_in_kernel, as FLA

    varlen = cu_seqlens is not None
    if varlen:
        check_tensor("cu_seqlens", cu_seqlens, dtypes=(torch.int32, torch.int64), ndim=1, align=4)
        if B != 1:
            raise ValueError(f"cu_seqlens needs B == 1 (packed sequences), got B={B}")
        if cu_seqlens.numel() < 2:
            raise ValueError("cu_seqlens must have at least 2 entries")
        N = cu_seqlens.numel() - 1
    else:
        N = B
    if N > MAX_SEQS:
        raise ValueError(f"at most {MAX_SEQS} sequences per call, got N = {N}")
    spec = num_accepted_tokens is not None
    pool = initial_state_indices is not None or final_state_indices is not None or spec
    if spec:
        check_tensor("num_accepted_tokens", num_accepted_tokens, dtypes=(torch.int32,), ndim=1, align=4)
        check_shape("num_accepted_tokens", num_accepted_tokens, (N,))
        if initial_state_indices is None:
            raise ValueError("num_accepted_tokens needs initial_state_indices [N, S] (speculative decoding reads "
                             "the state at [n, num_accepted_tokens[n] - 1])")
        if final_state_indices is None:
            final_state_indices = initial_state_indices
    if pool:
        if initial_state is None:
            raise ValueError("initial_state must be the state pool [P, HV, K, V] when state indices are given")
        check_tensor("initial_state", initial_state, dtypes=(torch.float32,), ndim=4)
        if tuple(initial_state.shape[1:]) != (HV, K, V):
            raise ValueError(f"initial_state (the pool) must be [P, HV = {HV}, K = {K}, V = {V}], got "
                             f"{tuple(initial_state.shape)}")
        init_idx = (_indices("initial_state_indices", initial_state_indices, N, spec)
                    if initial_state_indices is not None else None)
        final_idx = (_indices("final_state_indices", final_state_indices, N, spec)
                     if final_state_indices is not None else None)
        if spec and not varlen and final_idx.shape[1] < T:
            raise ValueError(f"final_state_indices must have a column per token: [N, S >= T = {T}], got "
                             f"{tuple(final_idx.shape)}")
    elif initial_state is not None:
        check_tensor("initial_state", initial_state, dtypes=(torch.float32,), ndim=4)
        check_shape("initial_state", initial_state, (N, HV, K, V))
    device = check_cuda(q=q, k=k, v=v, g=g, beta=beta, initial_state=initial_state, cu_seqlens=cu_seqlens,
                        initial_state_indices=initial_state_indices, final_state_indices=final_state_indices,
                        num_accepted_tokens=num_accepted_tokens, A_log=A_log, dt_bias=dt_bias)
    a_log = _param("A_log", A_log, (HV,)) if A_log is not None else None
    bias = _param("dt_bias", dt_bias, (HV, K) if kda else (HV,)) if dt_bias is not None else None

    if pool:
        initial = "pool" if init_idx is not None else "none"
        final = "pool" if final_idx is not None else "none"
        h0 = ht = initial_state
    else:
        initial = "dense" if initial_state is not None else "none"
        final = "dense" if output_final_state else "none"
        h0 = initial_state
        ht = torch.empty((N, HV, K, V), dtype=torch.float32, device=device) if output_final_state else None
    if out is not None:
        check_tensor("out", out, dtypes=(q.dtype,), ndim=4)
        check_shape("out", out, (B, T, HV, V))
        o = out
    else:
        o = torch.empty_like(v)
    if N > 0:
        cu = (cu_seqlens if cu_seqlens.dtype == torch.int32 else cu_seqlens.int()) if varlen else None
        d_f32, d_state, d_i32, d_idx = _dummies(device)
        d_idx = d_idx if spec else d_i32
        tensor_cores = use_tensor_cores(kda, varlen, spec, T, N * HV)
        fn = step_function(kda, HV // H, varlen, initial, final, spec, bool(use_qk_l2norm_in_kernel),
                           bool(use_gate_in_kernel), a_log is not None, bias is not None, lower_bound is not None,
                           bool(use_beta_sigmoid_in_kernel), bool(allow_neg_eigval),
                           T if not varlen and (T <= STATIC_TOKENS or tensor_cores) else 0, tensor_cores, q.dtype,
                           g.dtype, beta.dtype)
        # the kernel flattens [B, T, ...] itself: no view on this path
        fn(q, k, v, g, beta, a_log if a_log is not None else d_f32, bias if bias is not None else d_f32,
           h0 if h0 is not None else d_state, ht if ht is not None else d_state, cu if cu is not None else d_i32,
           init_idx if pool and init_idx is not None else d_idx, final_idx if pool and final_idx is not None else d_idx,
           num_accepted_tokens if spec else d_i32, o, T, N,
           float(scale) if scale is not None else K ** -0.5, float(lower_bound) if lower_bound is not None else 0.0)
    if not output_final_state:
        return o, None
    return o, (initial_state if pool else ht)


_functions: dict = {}


def use_tensor_cores(kda: bool, varlen: bool, spec: bool, T: int, items: int) -> bool:
    """GDN with TC_MIN_TOKENS..8 tokens per sequence (a compile-time count) over at least TC_MIN_ITEMS (sequence,
    value head) items, no speculative writes: the tokens as one block on tensor cores (`TensorCoreStep`); else
    token by token (`RecurrentStep`)."""
    return not kda and not varlen and not spec and TC_MIN_TOKENS <= T <= STEP_GROUP and items >= TC_MIN_ITEMS


def step_function(*key):
    """The compiled step for (kda, group, varlen, initial, final, spec, l2norm, gate_in_kernel, a_log, dt_bias,
    lower_bound, beta_sigmoid, neg_eigval, tokens, tensor_cores, io, g and beta dtypes): one dict lookup per call
    once built."""
    fn = _functions.get(key)
    if fn is None:
        flags, (io, g_dtype, beta_dtype) = key[:-3], key[-3:]
        names = ("kda", "group", "varlen", "initial", "final", "spec", "l2norm", "gate_in_kernel", "a_log", "dt_bias",
                 "lower_bound", "beta_sigmoid", "neg_eigval", "tokens", "tensor_cores")
        fn = _functions[key] = build_recurrent_step(RecurrentConfig(**dict(zip(names, flags))), io, g_dtype,
                                                    beta_dtype).fn
    return fn


def unsupported_gdn_arguments(gk, gv, state_v_first) -> None:
    """FLA arguments the decode step does not take: each raises, naming it."""
    if gk is not None or gv is not None:
        raise NotImplementedError("gk / gv (per-key / per-value decay) are not supported here: use "
                                  "fused_recurrent_kda for a per-key decay")
    if state_v_first:
        raise NotImplementedError("state_v_first=True is not supported: states are [.., K, V]")


def fused_recurrent_gated_delta_rule(q, k, v, g=None, gk=None, gv=None, beta=None, scale=None, initial_state=None,
                                     output_final_state=False, use_qk_l2norm_in_kernel=False,
                                     use_gate_in_kernel=False, A_log=None, dt_bias=None,
                                     use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, state_v_first=False,
                                     cu_seqlens=None, *, initial_state_indices=None, final_state_indices=None,
                                     num_accepted_tokens=None, out=None):
    """GDN decode step, FLA 0.6's `fused_recurrent_gated_delta_rule` (q, k [B, T, H, K]; v [B, T, HV, V] with HV a
    multiple of H; g, beta [B, T, HV]; states [N, HV, K, V] fp32), plus the state pool and speculative decoding
    of the module docstring. K = V = 128. Forward-only. `gk` / `gv` and `state_v_first` are not supported."""
    unsupported_gdn_arguments(gk, gv, state_v_first)
    return fused_recurrent(q, k, v, g, beta, kda=False, scale=scale, initial_state=initial_state,
                           output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                           use_gate_in_kernel=use_gate_in_kernel, A_log=A_log, dt_bias=dt_bias,
                           use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
                           cu_seqlens=cu_seqlens, initial_state_indices=initial_state_indices,
                           final_state_indices=final_state_indices, num_accepted_tokens=num_accepted_tokens, out=out)


def fused_recurrent_kda(q, k, v, g, beta, A_log=None, dt_bias=None, scale=None, initial_state=None,
                        output_final_state=False, use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False,
                        use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, lower_bound=None,
                        state_v_first=False, cu_seqlens=None, *, initial_state_indices=None,
                        final_state_indices=None, num_accepted_tokens=None, out=None):
    """KDA decode step, FLA 0.6's `fused_recurrent_kda` (g [B, T, HV, K]; dt_bias [HV, K] or [HV * K]), plus the
    state pool and speculative decoding of the module docstring. K = V = 128. Forward-only."""
    unsupported_gdn_arguments(None, None, state_v_first)
    return fused_recurrent(q, k, v, g, beta, kda=True, scale=scale, initial_state=initial_state,
                           output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                           use_gate_in_kernel=use_gate_in_kernel, A_log=A_log, dt_bias=dt_bias,
                           lower_bound=lower_bound, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
                           allow_neg_eigval=allow_neg_eigval, cu_seqlens=cu_seqlens,
                           initial_state_indices=initial_state_indices, final_state_indices=final_state_indices,
                           num_accepted_tokens=num_accepted_tokens, out=out)


__all__ = ["fused_recurrent_gated_delta_rule", "fused_recurrent_kda"]
