"""Context parallel forward: one sequence split along T across the ranks of a process group.

Rank r holds the r-th contiguous slice of the tokens of q, k, v, g, beta `[B, T_local, H, ...]`; the slices are
chained by the affine algebra of the recurrence:
1. every rank summarizes its slice from a zero state, `S_end = M_r S_start + h_r` (fp32 on the GPU, the compute
   dtype with the reference backend); rank 0 publishes the constant map (0, M_0 S_0 + h_0) instead;
2. the summaries travel: method "allgather" (all_gather of every (M_r, h_r), each rank composes its predecessors'
   maps) or "p2p" (rank r receives its start state from r - 1, sends its end state to r + 1); "auto" picks by size;
3. every rank computes its outputs from its true start state; the last rank's end state is the final state.

Backends: "reference" (the float64 torch references of `cute_kernels.reference`, any device, e.g. CPU + gloo)
and "cute" (the SM90 kernels, CUDA + NCCL; keep `NCCL_NVLS_ENABLE=0`: this module calls no multicast API).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from . import reference as ref

# Below this many gathered bytes one all-gather (world x H x (K*K + K*V) values) beats p2p's world - 1 serial hops.
ALLGATHER_MAX_BYTES = 256 << 20


def chunk_gated_delta_rule_cp(q, k, v, g, beta, group=None, scale=None, initial_state=None,
                              output_final_state=False, method="auto", backend="reference"):
    """GDN forward over a context-parallel group. Returns (o_local, final_state on the last rank else None).
    `initial_state` `[B, H, K, V]` is read on rank 0 only. Varlen (`cu_seqlens`) is not supported here."""
    return _cp_forward(q, k, v, g, beta, group, scale, initial_state, output_final_state, method, backend, kda=False)


def chunk_kda_cp(q, k, v, g, beta, group=None, scale=None, initial_state=None, output_final_state=False,
                 method="auto", backend="reference"):
    """KDA forward over a context-parallel group (g `[B, T_local, H, K]`); see `chunk_gated_delta_rule_cp`."""
    return _cp_forward(q, k, v, g, beta, group, scale, initial_state, output_final_state, method, backend, kda=True)


def pick_method(world: int, batch: int, heads: int, k_dim: int, v_dim: int, itemsize: int) -> str:
    """'allgather' while the gathered summaries stay under ALLGATHER_MAX_BYTES, else 'p2p'."""
    gathered = world * batch * heads * (k_dim * k_dim + k_dim * v_dim) * itemsize
    return "allgather" if gathered <= ALLGATHER_MAX_BYTES else "p2p"


def _summary(k, v, g, beta, backend, kda):
    """(M [B, H, K, K], h [B, H, K, V]) of this rank's slice from a zero state."""
    B, T = k.shape[:2]
    if backend == "reference":
        chunks = -(-T // 64)
        M, h, _ = ref.segment_summaries(k, v, g, beta, [[0, chunks]] * B, chunk_size=64)
        return M, h
    if backend == "cute":
        from schedulers import Problem, schedule_from_segmentation
        from schedulers.problem import Segmentation, split_even

        from .kernels.build import build_fused
        from .kernels.configs import FusedConfig

        H, K, V = k.shape[2], k.shape[3], v.shape[3]
        k, v, beta = k.contiguous(), v.contiguous(), beta.contiguous()   # the kernel flattens [B, T, ...] itself
        problem = Problem(tuple([T] * B), tuple(b * T for b in range(B)), H, 64, num_blocks=2)
        sched = schedule_from_segmentation(problem, Segmentation([split_even(-(-T // 64), 1)] * B))
        summary = torch.empty((2 * B, H, K, V), dtype=torch.float32, device=k.device)
        o_scratch = torch.empty_like(v)
        compiled = build_fused(FusedConfig(kda, "summary"), k.dtype, beta.dtype)
        g32 = g.float().contiguous()
        # q is not read for summaries (no outputs): k stands in for it.
        compiled.fn(k, k, v, g32, beta, o_scratch, summary, summary,
                    sched.table_on(k.device), sched.num_tiles, sched.grid[0], 1.0)
        return summary[B:], summary[:B]
    raise ValueError(f"backend must be 'reference' or 'cute', got {backend!r}")


def _outputs(q, k, v, g, beta, scale, start, backend, kda):
    if backend == "reference":
        return ref.chunk_gated_delta_rule_ref(q, k, v, g, beta, scale=scale, initial_state=start,
                                              output_final_state=True)
    from . import chunk_gated_delta_rule, chunk_kda

    op = chunk_kda if kda else chunk_gated_delta_rule
    return op(q, k, v, g, beta, scale=scale, initial_state=start.float().contiguous(), output_final_state=True)


def _apply(M, h, S):
    """M @ S + h over [B, H] batches."""
    return torch.matmul(M, S) + h


def _cp_forward(q, k, v, g, beta, group, scale, initial_state, output_final_state, method, backend, kda):
    if not dist.is_initialized():
        raise RuntimeError("context parallel needs an initialized torch.distributed process group")
    if method not in ("auto", "allgather", "p2p"):
        raise ValueError(f"method must be 'auto', 'allgather' or 'p2p', got {method!r}")
    rank = dist.get_rank(group)
    world = dist.get_world_size(group)
    B, _, H, K = k.shape
    V = v.shape[-1]
    M, h = _summary(k, v, g, beta, backend, kda)
    dtype = M.dtype
    if rank == 0:
        S0 = torch.zeros(B, H, K, V, dtype=dtype, device=M.device) if initial_state is None else initial_state.to(dtype)
        h = _apply(M, h, S0)
        M = torch.zeros_like(M)
    if method == "auto":
        method = pick_method(world, B, H, K, V, M.element_size())

    if method == "allgather":
        Ms = [torch.empty_like(M) for _ in range(world)]
        hs = [torch.empty_like(h) for _ in range(world)]
        dist.all_gather(Ms, M.contiguous(), group=group)
        dist.all_gather(hs, h.contiguous(), group=group)
        start = torch.zeros(B, H, K, V, dtype=dtype, device=M.device)
        for r in range(rank):
            start = _apply(Ms[r], hs[r], start)
        end = _apply(M, h, start)
    else:
        start = torch.zeros(B, H, K, V, dtype=dtype, device=M.device)
        if rank > 0:
            dist.recv(start, src=dist.get_global_rank(group, rank - 1) if group is not None else rank - 1, group=group)
        end = _apply(M, h, start)
        if rank < world - 1:
            dist.send(end.contiguous(), dst=dist.get_global_rank(group, rank + 1) if group is not None else rank + 1,
                      group=group)

    if rank == 0 and initial_state is not None:
        start = initial_state.to(dtype)
    o, _ = _outputs(q, k, v, g, beta, scale, start, backend, kda)
    final = end if (output_final_state and rank == world - 1) else None
    return o, final
