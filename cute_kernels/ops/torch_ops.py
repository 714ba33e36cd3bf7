"""The public ops as torch custom ops (`torch.ops.cute_kernels.*`), so that `torch.compile(fullgraph=True)` traces
a model that calls them: each has a fake (meta) implementation that gives the outputs' shapes and dtypes without
running anything. The public functions (defined here, exported by `cute_kernels`) route through the custom ops
only while torch.compile traces; an eager call takes the direct path (no dispatcher on the per-call path).

A custom op takes tensors and plain values only: `scheduler=` is an eager-only argument. Optional outputs come
back as empty tensors and become None again in the public function.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
from torch import Tensor

from ..checks import check_no_grad
from . import decode as _decode
from . import linear_attention as _la
from . import recurrent as _rec
from . import state_pool as _pool


def _no_state(q: Tensor) -> Tensor:
    return q.new_empty((0,), dtype=torch.float32)


def _linear_attention_fake(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                           use_qk_l2norm_in_kernel, use_graph=False):
    B, _, _, K = q.shape
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    final = q.new_empty((N, v.shape[2], K, v.shape[3]), dtype=torch.float32) if output_final_state else _no_state(q)
    return torch.empty_like(v), final


def _linear_attention_op(kda: bool):
    """`cute_kernels::chunk_kda` or `cute_kernels::chunk_gated_delta_rule`: the forward with the planner's choices."""

    def impl(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: Optional[float],
             initial_state: Optional[Tensor], output_final_state: bool, cu_seqlens: Optional[Tensor],
             use_qk_l2norm_in_kernel: bool, use_graph: bool = False) -> tuple[Tensor, Tensor]:
        o, final = _la.forward(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                               use_qk_l2norm_in_kernel, None, None, kda=kda, use_graph=use_graph)
        return o, final if final is not None else _no_state(q)

    name = "chunk_kda" if kda else "chunk_gated_delta_rule"
    op = torch.library.custom_op(f"cute_kernels::{name}", impl, mutates_args=())
    op.register_fake(_linear_attention_fake)
    return op


chunk_gated_delta_rule_op = _linear_attention_op(False)
chunk_kda_op = _linear_attention_op(True)


@torch.library.custom_op("cute_kernels::decode_attention", mutates_args=())
def decode_attention_op(q: Tensor, k_cache: Tensor, v_cache: Tensor, cache_seqlens: Tensor,
                        page_table: Optional[Tensor], scale: Optional[float], softcap: Optional[float],
                        max_seqlen: Optional[int]) -> tuple[Tensor, Tensor]:
    return _decode.decode_attention(q, k_cache, v_cache, cache_seqlens, page_table=page_table, scale=scale,
                                    softcap=softcap, max_seqlen=max_seqlen, return_lse=True)


@decode_attention_op.register_fake
def _decode_attention_fake(q, k_cache, v_cache, cache_seqlens, page_table, scale, softcap, max_seqlen):
    return torch.empty_like(q), q.new_empty(q.shape[:-1], dtype=torch.float32)


def compiled_call(op, name: str, tensors_and_values: tuple, scheduler, out):
    """The custom op's outputs while torch.compile traces: `scheduler` cannot cross a custom op; `out` tensors are
    filled by an in-graph copy."""
    if scheduler is not None:
        raise NotImplementedError(f"{name}: scheduler= is an eager-only argument (it cannot cross torch.compile's "
                                  "custom op); leave it None inside a compiled region (the planner picks)")
    results = op(*tensors_and_values)
    if out is None:
        return results
    for dst, src in zip(out, results):
        if dst is not None:
            dst.copy_(src)
    return tuple(dst if dst is not None else src for dst, src in zip(out, results))


@torch.library.custom_op("cute_kernels::state_pool_gather", mutates_args=())
def state_pool_gather_op(pool: Tensor, idx: Tensor) -> Tensor:
    return _pool.gather_states(pool, idx)


@state_pool_gather_op.register_fake
def _state_pool_gather_fake(pool, idx):
    return pool.new_empty((idx.shape[0],) + tuple(pool.shape[1:]))


@torch.library.custom_op("cute_kernels::state_pool_scatter", mutates_args=("pool",))
def state_pool_scatter_op(dense: Tensor, pool: Tensor, idx: Tensor) -> None:
    _pool.scatter_states(dense, pool, idx)


def _linear_attention_call(kda: bool, q, k, v, g, beta, scale, initial_state, output_final_state,
                           use_qk_l2norm_in_kernel, cu_seqlens, scheduler, out, initial_state_indices=None,
                           final_state_indices=None, use_graph=False):
    """The custom ops' outputs while torch.compile traces (gate arguments already applied); a state pool through
    the gather and scatter ops around the forward."""
    direct = _la.chunk_kda if kda else _la.chunk_gated_delta_rule
    check_no_grad(direct.__name__, q=q, k=k, v=v, g=g, beta=beta, initial_state=initial_state)
    pool = None
    if initial_state_indices is not None or final_state_indices is not None:
        N = q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
        _pool.check_pool(initial_state, N, v.shape[2], initial_state_indices, final_state_indices)
        pool, output_pool = initial_state, output_final_state
        initial_state = (state_pool_gather_op(pool, initial_state_indices) if initial_state_indices is not None
                         else None)
        output_final_state = final_state_indices is not None
        out = None if out is None else (out[0], None)
    o, final = compiled_call(chunk_kda_op if kda else chunk_gated_delta_rule_op, direct.__name__,
                             (q, k, v, g, beta, None if scale is None else float(scale), initial_state,
                              bool(output_final_state), cu_seqlens, bool(use_qk_l2norm_in_kernel), bool(use_graph)),
                             scheduler, out)
    if pool is not None:
        if final_state_indices is not None:
            state_pool_scatter_op(final, pool, final_state_indices)
        return o, pool if output_pool else None
    return o, final if output_final_state else None


@functools.wraps(_la.chunk_gated_delta_rule)
def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                           use_qk_l2norm_in_kernel=False, use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False,
                           state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None, chunk_indices=None,
                           cp_context=None, *, use_gate_in_kernel=False, A_log=None, dt_bias=None, scheduler=None,
                           out=None, initial_state_indices=None, final_state_indices=None, use_graph=False,
                           max_num_seqs=None):
    if not torch.compiler.is_compiling():
        return _la.chunk_gated_delta_rule(
            q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
            use_beta_sigmoid_in_kernel, allow_neg_eigval, state_v_first, cu_seqlens, cu_seqlens_cpu, chunk_indices,
            cp_context, use_gate_in_kernel=use_gate_in_kernel, A_log=A_log, dt_bias=dt_bias, scheduler=scheduler,
            out=out, initial_state_indices=initial_state_indices, final_state_indices=final_state_indices,
            use_graph=use_graph, max_num_seqs=max_num_seqs)
    _la.unsupported_arguments("chunk_gated_delta_rule", state_v_first=state_v_first, cp_context=cp_context)
    g, beta = _la.gate_inputs(g, beta, False, use_gate_in_kernel, A_log, dt_bias, None, use_beta_sigmoid_in_kernel,
                              allow_neg_eigval)
    return _linear_attention_call(False, q, k, v, g, beta, scale, initial_state, output_final_state,
                                  use_qk_l2norm_in_kernel, cu_seqlens, scheduler, out, initial_state_indices,
                                  final_state_indices, use_graph)


@functools.wraps(_la.chunk_kda)
def chunk_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
              use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False,
              allow_neg_eigval=False, safe_gate=False, lower_bound=None, disable_recompute=False,
              return_intermediate_states=False, state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None,
              cp_context=None, use_graph=False, max_num_seqs=None, *, A_log=None, dt_bias=None, scheduler=None,
              out=None, initial_state_indices=None, final_state_indices=None):
    if not torch.compiler.is_compiling():
        return _la.chunk_kda(
            q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, use_gate_in_kernel,
            use_beta_sigmoid_in_kernel, allow_neg_eigval, safe_gate, lower_bound, disable_recompute,
            return_intermediate_states, state_v_first, cu_seqlens, cu_seqlens_cpu, cp_context, use_graph,
            max_num_seqs, A_log=A_log, dt_bias=dt_bias, scheduler=scheduler, out=out,
            initial_state_indices=initial_state_indices, final_state_indices=final_state_indices)
    _la.unsupported_arguments("chunk_kda", state_v_first=state_v_first, cp_context=cp_context,
                              return_intermediate_states=return_intermediate_states)
    g, beta = _la.gate_inputs(g, beta, True, use_gate_in_kernel, A_log, dt_bias, lower_bound,
                              use_beta_sigmoid_in_kernel, allow_neg_eigval)
    return _linear_attention_call(True, q, k, v, g, beta, scale, initial_state, output_final_state,
                                  use_qk_l2norm_in_kernel, cu_seqlens, scheduler, out, initial_state_indices,
                                  final_state_indices, use_graph)


@functools.wraps(_decode.decode_attention)
def decode_attention(q, k_cache, v_cache, cache_seqlens, *, page_table=None, scale=None, softcap=None, scheduler=None,
                     max_seqlen=None, return_lse=False, out=None):
    if not torch.compiler.is_compiling():
        return _decode.decode_attention(q, k_cache, v_cache, cache_seqlens, page_table=page_table, scale=scale,
                                        softcap=softcap, scheduler=scheduler, max_seqlen=max_seqlen,
                                        return_lse=return_lse, out=out)
    check_no_grad("decode_attention", q=q, k_cache=k_cache, v_cache=v_cache)
    o, lse = compiled_call(decode_attention_op, "decode_attention",
                           (q, k_cache, v_cache, cache_seqlens, page_table, None if scale is None else float(scale),
                            None if softcap is None else float(softcap),
                            None if max_seqlen is None else int(max_seqlen)), scheduler, out)
    return (o, lse) if return_lse else o


@torch.library.custom_op("cute_kernels::fused_recurrent", mutates_args=("state_pool",))
def fused_recurrent_op(q: Tensor, k: Tensor, v: Tensor, g: Optional[Tensor], beta: Optional[Tensor], kda: bool,
                       scale: Optional[float], initial_state: Optional[Tensor], state_pool: Optional[Tensor],
                       output_final_state: bool, use_qk_l2norm_in_kernel: bool, use_gate_in_kernel: bool,
                       A_log: Optional[Tensor], dt_bias: Optional[Tensor], lower_bound: Optional[float],
                       use_beta_sigmoid_in_kernel: bool, allow_neg_eigval: bool, cu_seqlens: Optional[Tensor],
                       initial_state_indices: Optional[Tensor], final_state_indices: Optional[Tensor],
                       num_accepted_tokens: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    """The decode step; a state pool (`state_pool`, written in place) comes back as an empty tensor."""
    o, final = _rec.fused_recurrent(
        q, k, v, g, beta, kda=kda, scale=scale, initial_state=state_pool if state_pool is not None else initial_state,
        output_final_state=output_final_state and state_pool is None, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        use_gate_in_kernel=use_gate_in_kernel, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound,
        use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
        cu_seqlens=cu_seqlens, initial_state_indices=initial_state_indices, final_state_indices=final_state_indices,
        num_accepted_tokens=num_accepted_tokens)
    return o, final if final is not None else _no_state(q)


@fused_recurrent_op.register_fake
def _fused_recurrent_fake(q, k, v, g, beta, kda, scale, initial_state, state_pool, output_final_state,
                          use_qk_l2norm_in_kernel, use_gate_in_kernel, A_log, dt_bias, lower_bound,
                          use_beta_sigmoid_in_kernel, allow_neg_eigval, cu_seqlens, initial_state_indices,
                          final_state_indices, num_accepted_tokens):
    N = q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
    dense = output_final_state and state_pool is None
    final = q.new_empty((N, v.shape[2], q.shape[3], v.shape[3]), dtype=torch.float32) if dense else _no_state(q)
    return torch.empty_like(v), final


def _recurrent(kda: bool):
    """The public decode step: direct in eager mode; under torch.compile the custom op (the pool, if indices name
    one, as its mutated argument)."""

    def call(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, use_gate_in_kernel,
             A_log, dt_bias, lower_bound, use_beta_sigmoid_in_kernel, allow_neg_eigval, cu_seqlens,
             initial_state_indices, final_state_indices, num_accepted_tokens, out):
        kw = dict(scale=scale, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
                  A_log=A_log, dt_bias=dt_bias, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
                  allow_neg_eigval=allow_neg_eigval, cu_seqlens=cu_seqlens)
        if not torch.compiler.is_compiling():
            return _rec.fused_recurrent(q, k, v, g, beta, kda=kda, initial_state=initial_state,
                                        output_final_state=output_final_state, lower_bound=lower_bound,
                                        initial_state_indices=initial_state_indices,
                                        final_state_indices=final_state_indices,
                                        num_accepted_tokens=num_accepted_tokens, out=out, **kw)
        name = "fused_recurrent_kda" if kda else "fused_recurrent_gated_delta_rule"
        check_no_grad(name, q=q, k=k, v=v, g=g, beta=beta, initial_state=initial_state)
        pooled = initial_state_indices is not None or final_state_indices is not None or num_accepted_tokens is not None
        o, final = fused_recurrent_op(
            q, k, v, g, beta, kda, None if scale is None else float(scale), None if pooled else initial_state,
            initial_state if pooled else None, bool(output_final_state), bool(use_qk_l2norm_in_kernel),
            bool(use_gate_in_kernel), A_log, dt_bias, None if lower_bound is None else float(lower_bound),
            bool(use_beta_sigmoid_in_kernel), bool(allow_neg_eigval), cu_seqlens, initial_state_indices,
            final_state_indices, num_accepted_tokens)
        if out is not None:
            out.copy_(o)
            o = out
        if not output_final_state:
            return o, None
        return o, (initial_state if pooled else final)

    return call


_gdn_step, _kda_step = _recurrent(False), _recurrent(True)


@functools.wraps(_rec.fused_recurrent_gated_delta_rule)
def fused_recurrent_gated_delta_rule(q, k, v, g=None, gk=None, gv=None, beta=None, scale=None, initial_state=None,
                                     output_final_state=False, use_qk_l2norm_in_kernel=False,
                                     use_gate_in_kernel=False, A_log=None, dt_bias=None,
                                     use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, state_v_first=False,
                                     cu_seqlens=None, *, initial_state_indices=None, final_state_indices=None,
                                     num_accepted_tokens=None, out=None):
    _rec.unsupported_gdn_arguments(gk, gv, state_v_first)
    return _gdn_step(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                     use_gate_in_kernel, A_log, dt_bias, None, use_beta_sigmoid_in_kernel, allow_neg_eigval,
                     cu_seqlens, initial_state_indices, final_state_indices, num_accepted_tokens, out)


@functools.wraps(_rec.fused_recurrent_kda)
def fused_recurrent_kda(q, k, v, g, beta, A_log=None, dt_bias=None, scale=None, initial_state=None,
                        output_final_state=False, use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False,
                        use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, lower_bound=None,
                        state_v_first=False, cu_seqlens=None, *, initial_state_indices=None,
                        final_state_indices=None, num_accepted_tokens=None, out=None):
    _rec.unsupported_gdn_arguments(None, None, state_v_first)
    return _kda_step(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                     use_gate_in_kernel, A_log, dt_bias, lower_bound, use_beta_sigmoid_in_kernel, allow_neg_eigval,
                     cu_seqlens, initial_state_indices, final_state_indices, num_accepted_tokens, out)
