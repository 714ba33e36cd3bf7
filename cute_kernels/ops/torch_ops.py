"""The public ops as torch custom ops (`torch.ops.cute_kernels.*`), so that `torch.compile(fullgraph=True)` traces
a model that calls them: each has a fake (meta) implementation that gives the outputs' shapes and dtypes without
running anything. The public functions route through these only while torch.compile traces; an eager call takes
the direct path (no dispatcher on the per-call path).

A custom op takes tensors and plain values only: `scheduler=` is an eager-only argument. Optional outputs come
back as empty tensors and become None again in the public function.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import decode as _decode
from . import linear_attention as _la


def _no_state(q: Tensor) -> Tensor:
    return q.new_empty((0,), dtype=torch.float32)


def _linear_attention_fake(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                           use_qk_l2norm_in_kernel):
    B, _, H, K = q.shape
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    final = q.new_empty((N, H, K, v.shape[-1]), dtype=torch.float32) if output_final_state else _no_state(q)
    return torch.empty_like(v), final


@torch.library.custom_op("cute_kernels::chunk_gated_delta_rule", mutates_args=())
def chunk_gated_delta_rule_op(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: Optional[float],
                              initial_state: Optional[Tensor], output_final_state: bool, cu_seqlens: Optional[Tensor],
                              use_qk_l2norm_in_kernel: bool) -> tuple[Tensor, Tensor]:
    o, final = _la.forward(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                           use_qk_l2norm_in_kernel, None, None, kda=False)
    return o, final if final is not None else _no_state(q)


@torch.library.custom_op("cute_kernels::chunk_kda", mutates_args=())
def chunk_kda_op(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: Optional[float],
                 initial_state: Optional[Tensor], output_final_state: bool, cu_seqlens: Optional[Tensor],
                 use_qk_l2norm_in_kernel: bool) -> tuple[Tensor, Tensor]:
    o, final = _la.forward(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                           use_qk_l2norm_in_kernel, None, None, kda=True)
    return o, final if final is not None else _no_state(q)


@torch.library.custom_op("cute_kernels::decode_attention", mutates_args=())
def decode_attention_op(q: Tensor, k_cache: Tensor, v_cache: Tensor, cache_seqlens: Tensor,
                        page_table: Optional[Tensor], scale: Optional[float], softcap: Optional[float],
                        max_seqlen: Optional[int]) -> tuple[Tensor, Tensor]:
    return _decode.decode_attention(q, k_cache, v_cache, cache_seqlens, page_table=page_table, scale=scale,
                                    softcap=softcap, max_seqlen=max_seqlen, return_lse=True)


chunk_gated_delta_rule_op.register_fake(_linear_attention_fake)
chunk_kda_op.register_fake(_linear_attention_fake)


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
