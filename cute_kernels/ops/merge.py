"""Torch-callable merges: `affine_merge` (segment summaries) and `lse_merge` (split-KV partials)."""

from __future__ import annotations

import torch

from ..checks import check_cuda, check_no_grad, check_shape, check_tensor, offsets_tensor
from ..kernels.build import build_affine_merge, build_lse_merge
from ..kernels.configs import MergeConfig
from ..plan import merge_impl_for
from ..runtime.arch import SM100_ARCHS, device_arch, sm_count

OUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _outputs(out, *specs):
    """New tensors for `specs` (name, shape, dtype), or the user's `out` tuple after checking it."""
    *specs, device = specs
    if out is None:
        return tuple(torch.empty(shape, dtype=dtype, device=device) for _, shape, dtype in specs)
    if not isinstance(out, (tuple, list)) or len(out) != len(specs):
        raise TypeError(f"out must be a tuple of {len(specs)} tensors ({', '.join(n for n, _, _ in specs)})")
    for t, (name, shape, dtype) in zip(out, specs):
        check_tensor(f"out[{name}]", t, dtypes=(dtype,), align=4)
        check_shape(f"out[{name}]", t, shape)
        if t.device != device:
            raise ValueError(f"out[{name}] is on {t.device} but the inputs are on {device}")
    return tuple(out)


def affine_merge(M, h_ext, seg_offsets, initial_state=None, *, out=None, starts_only=False, impl=None):
    """Start state of every segment and each sequence's final state from segment summaries.

    M `[slots, H, K, K]` and h_ext `[slots, H, K, V]` (fp32): segment s maps its start state to its end state,
    S_end = M[s] @ S_start + h_ext[s]. `seg_offsets` `[N + 1]`: sequence n owns slots seg_offsets[n] ..
    seg_offsets[n+1] - 1, in order (a schedule's `seg_offsets`). initial_state `[N, H, K, V]` fp32 or None (zeros).
    Returns (start_states `[slots, H, K, V]`, final_state `[N, H, K, V]`), fp32; `out=(start_states,
    final_state)` writes into given tensors instead. Without an initial state the first segment's M is never read.
    `starts_only=True`: only the start states (each sequence's last summary is never read, so it may be left
    unwritten); returns (start_states, None) and `out` is `(start_states,)`. `impl` picks the variant
    (staged, prefetch, regs, tc; default: by the number of chains, `cute_kernels.plan.merge_impl_for`).
    """
    check_no_grad("affine_merge", M=M, h_ext=h_ext, initial_state=initial_state)
    check_tensor("M", M, dtypes=(torch.float32,), ndim=4)
    check_tensor("h_ext", h_ext, dtypes=(torch.float32,), ndim=4)
    slots, H, K, K2 = M.shape
    if K != K2:
        raise ValueError(f"M must be [slots, H, K, K], got shape {tuple(M.shape)}")
    V = h_ext.shape[-1]
    check_shape("h_ext", h_ext, (slots, H, K, V))
    device = check_cuda(M=M, h_ext=h_ext, initial_state=initial_state)
    offsets, N = offsets_tensor("seg_offsets", seg_offsets, slots, device)
    forced = impl
    impl = merge_impl_for(N, H, K, V, sm_count(device), impl)
    if impl == "tc" and forced is None and device_arch(device) in SM100_ARCHS:
        impl = "staged"   # the SM100 tensor-core build has not run on hardware yet: only when asked for by name
    if initial_state is not None:
        check_tensor("initial_state", initial_state, dtypes=(torch.float32,), ndim=4)
        check_shape("initial_state", initial_state, (N, H, K, V))
    specs = [("start_states", (slots, H, K, V), torch.float32)]
    if not starts_only:
        specs.append(("final_state", (N, H, K, V), torch.float32))
    outs = _outputs(out, *specs, device)
    start_states = outs[0]
    final_state = None if starts_only else outs[1]
    if N == 0 or H == 0:
        return start_states, final_state
    fn = build_affine_merge(MergeConfig(impl, K, V, initial_state is not None, starts_only)).fn
    # Stands in for tensors the variant never touches; [N, H, K, V] like final_state (its leading sizes set the grid)
    unused = start_states[:N] if slots >= N else torch.empty((N, H, K, V), dtype=torch.float32, device=device)
    init = initial_state if initial_state is not None else unused
    fn(M, h_ext, offsets, init, start_states, final_state if final_state is not None else unused)
    return start_states, final_state


def lse_merge(o_partial, lse_partial, seg_offsets=None, out_dtype=torch.bfloat16, *, out=None):
    """Merge split-KV partial outputs by log-sum-exp.

    o_partial `[slots, *rows, D]` fp32 (each split's normalized output), lse_partial `[slots, *rows]` fp32
    (natural log; -inf for an empty split). Without `seg_offsets` all slots are splits of every row:
    returns (o `[*rows, D]` in `out_dtype`, lse `[*rows]` fp32). With `seg_offsets` `[N + 1]` (a schedule's
    layout: sequence n owns slots seg_offsets[n] .. seg_offsets[n+1] - 1): returns o `[N, *rows, D]` and
    lse `[N, *rows]`. A row with only empty splits gives o = 0 and lse = -inf. `out=(o, lse)` writes into
    given tensors instead.
    """
    check_no_grad("lse_merge", o_partial=o_partial, lse_partial=lse_partial)
    check_tensor("o_partial", o_partial, dtypes=(torch.float32,), min_ndim=2)
    check_tensor("lse_partial", lse_partial, dtypes=(torch.float32,), min_ndim=1, align=4)
    if out_dtype not in OUT_DTYPES:
        raise TypeError(f"out_dtype must be one of {OUT_DTYPES}, got {out_dtype}")
    check_shape("lse_partial", lse_partial, o_partial.shape[:-1])
    slots, rows_shape, D = o_partial.shape[0], tuple(o_partial.shape[1:-1]), o_partial.shape[-1]
    if D % 4 or D > 512:
        raise ValueError(f"lse_merge supports head dims that are multiples of 4 up to 512, got D={D}")
    device = check_cuda(o_partial=o_partial, lse_partial=lse_partial)
    if seg_offsets is None:
        offsets, N = offsets_tensor("seg_offsets", [0, slots], slots, device)
        out_shape = rows_shape
    else:
        offsets, N = offsets_tensor("seg_offsets", seg_offsets, slots, device)
        out_shape = (N,) + rows_shape
    R = 1
    for r in rows_shape:
        R *= r
    o, lse = _outputs(out, ("o", out_shape + (D,), out_dtype), ("lse", out_shape, torch.float32), device)
    if R == 0 or N == 0:
        return o, lse
    fn = build_lse_merge(D, out_dtype).fn
    fn(o_partial.view(slots, R, D), lse_partial.view(slots, R), offsets, o.view(N, R, D), lse.view(N, R))
    return o, lse
