"""Torch-callable merges: `affine_merge` (segment summaries) and `lse_merge` (split-KV partials)."""

from __future__ import annotations

import os

import torch

from ..runtime.compile import DYN, compile_kernel, cutlass_dtype, fake_stream, fake_tensor
from ..kernels.merge_config import PUBLISHING_IMPLS, affine_merge_fits, affine_merge_writers
from .checks import check_cuda, check_shape, check_tensor, offsets_tensor

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


# Variants (cute_kernels/kernels/merge.py), measured on the H200 2026-12-02 (scripts/time_merges.py), us per
# segment along the serial chain: simt 23.8, staged 7.6, prefetch 3.9 (32 segments x 4 heads x 1 sequence).
# prefetch runs 4x the CTAs of staged and each reads all of M: with many (sequence, head) pairs it loses
# (4 x 8 segments x 16 heads: 254 us vs 111 staged). "ring" (a 3-stage cp.async ring, loads two segments ahead)
# passes the tests but measured slower than prefetch (139.7 vs 125.3 us, 32 segments x 4 heads). "tc" (SM90,
# K = 128: the chain on tensor cores with hi/lo bf16 splits, kernels/sm90/affine_merge_tc.py), H200 2026-12-03:
# every merge test passes; 50.4 us for 4 x 8 segments x 16 heads (staged 100.0, prefetch 232.7), but 144.6 for
# 32 segments x 4 heads (prefetch 121.9): one CTA per (sequence, head) loads all of each link's M, 64 KB.
# "regs" (K = 128: M's blocks in registers, partial sums combined by warp shuffles), H200 2026-12-03, graph replay:
# 1.71 us per segment for 32 segments x 4 heads (prefetch 3.63), 2.10 for 8 x 8 heads (prefetch 3.74), 16.4 for
# 4 x 8 segments x 16 heads (tc 5.7): like prefetch, 16 CTAs per (sequence, head) each load all of every M.
# "auto" (the default): while the 8-column grid fits one CTA per SM, regs where K = 128, else prefetch; beyond it
# tc where K = 128, else staged.
# Env CUTE_KERNELS_AFFINE_MERGE forces one.
AFFINE_MERGE_IMPL = os.environ.get("CUTE_KERNELS_AFFINE_MERGE", "auto")
AFFINE_MERGE_IMPLS = ("simt", "staged", "prefetch", "ring", "regs", "tc")
_sm_counts: dict = {}


def sm_count(device) -> int:
    """The device's SM count (queried once per device)."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _sm_counts:
        _sm_counts[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _sm_counts[idx]


def merge_impl_for(num_seqs: int, num_heads: int, k_dim: int, v_dim: int, sms: int) -> str:
    """The affine-merge variant a call of these sizes runs on a GPU of `sms` SMs (AFFINE_MERGE_IMPL, resolved)."""
    impl = AFFINE_MERGE_IMPL
    if impl == "auto":
        if (v_dim // 8) * num_heads * num_seqs <= sms:
            impl = "regs" if affine_merge_fits("regs", k_dim, v_dim) else "prefetch"
        else:
            impl = "tc" if affine_merge_fits("tc", k_dim, v_dim) else "staged"
    elif impl not in AFFINE_MERGE_IMPLS:
        raise ValueError(f"CUTE_KERNELS_AFFINE_MERGE must be 'auto' or one of {AFFINE_MERGE_IMPLS}, got {impl!r}")
    fits = [i for i in (impl,) + AFFINE_MERGE_IMPLS if affine_merge_fits(i, k_dim, v_dim)]
    if k_dim > 128 or not fits:
        raise ValueError(f"affine_merge supports K in (32, 64, 96, 128) and V a multiple of 8, got K={k_dim}, "
                         f"V={v_dim}")
    return fits[0]


def compile_affine_merge(k_dim: int, v_dim: int, has_initial_state: bool, impl: str | None = None, dump_dir=None,
                         starts_only: bool = False, pdl: bool = False, profile: bool = False, publish: bool = False):
    """Compile one affine-merge variant (no GPU needed). The compiled function takes (M, h_ext, seg_offsets,
    initial_state, start_states, final_state, flags): `flags` (int32) is read only by `publish` builds (regs, tc:
    each start state published for the one-pass forward's early correction, see `AffineMerge`); others take any
    int32 tensor there (the callers pass seg_offsets)."""
    impl = merge_impl_for(1, 1, k_dim, v_dim, 1) if impl is None else impl
    if impl not in AFFINE_MERGE_IMPLS:
        raise ValueError(f"affine merge impl must be one of {AFFINE_MERGE_IMPLS}, got {impl!r}")
    if publish and impl not in PUBLISHING_IMPLS:
        raise ValueError(f"publish is built for the {PUBLISHING_IMPLS} merges, got {impl!r}")

    def build():
        from ..runtime.arch import import_cutlass

        cutlass = import_cutlass()  # sets CUTE_DSL_ARCH before the kernel module imports cutlass
        from ..kernels.merge import AffineMerge
        from ..kernels.sm90.affine_merge_tc import AffineMergeTcSm90

        f32, i32 = cutlass.Float32, cutlass.Int32
        args = (
            fake_tensor(f32, (DYN, DYN, k_dim, k_dim)),
            fake_tensor(f32, (DYN, DYN, k_dim, v_dim)),
            fake_tensor(i32, (DYN,), align=4),
            fake_tensor(f32, (DYN, DYN, k_dim, v_dim)),
            fake_tensor(f32, (DYN, DYN, k_dim, v_dim)),
            fake_tensor(f32, (DYN, DYN, k_dim, v_dim)),
            fake_tensor(i32, (DYN,), align=4),   # flags (publish)
            fake_stream(),
        )
        if impl == "tc":
            return AffineMergeTcSm90(cutlass.BFloat16, has_initial_state, starts_only, pdl=pdl, publish=publish), args
        return AffineMerge(k_dim, v_dim, has_initial_state, impl, starts_only, pdl=pdl, profile=profile,
                           publish=publish), args

    key = (("affine_merge", k_dim, v_dim, has_initial_state, impl) + (("starts_only",) if starts_only else ())
           + (("pdl",) if pdl else ()) + (("profile",) if profile else ()) + (("publish",) if publish else ()))
    return compile_kernel(key, build, dump_dir=dump_dir)


def affine_merge(M, h_ext, seg_offsets, initial_state=None, *, out=None, starts_only=False):
    """Start state of every segment and each sequence's final state from segment summaries.

    M `[slots, H, K, K]` and h_ext `[slots, H, K, V]` (fp32): segment s maps its start state to its end state,
    S_end = M[s] @ S_start + h_ext[s]. `seg_offsets` `[N + 1]`: sequence n owns slots seg_offsets[n] ..
    seg_offsets[n+1] - 1, in order (a schedule's `seg_offsets`). initial_state `[N, H, K, V]` fp32 or None (zeros).
    Returns (start_states `[slots, H, K, V]`, final_state `[N, H, K, V]`), fp32; `out=(start_states,
    final_state)` writes into given tensors instead. Without an initial state the first segment's M is never read.
    `starts_only=True`: only the start states (each sequence's last summary is never read, so it may be left
    unwritten); returns (start_states, None) and `out` is `(start_states,)`.
    """
    check_tensor("M", M, dtypes=(torch.float32,), ndim=4)
    check_tensor("h_ext", h_ext, dtypes=(torch.float32,), ndim=4)
    slots, H, K, K2 = M.shape
    if K != K2:
        raise ValueError(f"M must be [slots, H, K, K], got shape {tuple(M.shape)}")
    V = h_ext.shape[-1]
    check_shape("h_ext", h_ext, (slots, H, K, V))
    device = check_cuda(M=M, h_ext=h_ext, initial_state=initial_state)
    offsets, N = offsets_tensor("seg_offsets", seg_offsets, slots, device)
    impl = merge_impl_for(N, H, K, V, sm_count(device))
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
    compiled = compile_affine_merge(K, V, initial_state is not None, impl, starts_only=starts_only)
    # Stands in for the tensors the compiled variant never touches; shaped [N, H, K, V] like final_state, whose
    # leading sizes set the grid.
    unused = start_states[:N] if slots >= N else torch.empty((N, H, K, V), dtype=torch.float32, device=device)
    init = initial_state if initial_state is not None else unused
    compiled.fn(M, h_ext, offsets, init, start_states, final_state if final_state is not None else unused, offsets)
    return start_states, final_state


def affine_merge_starts_plan(num_seqs: int, num_heads: int, slots: int, seg_offsets, has_initial_state: bool,
                             device, pdl: bool = False, final: bool = False, flags: torch.Tensor | None = None):
    """`affine_merge(..., starts_only=True)` for one fixed configuration (K = V = 128), checked and compiled once:
    the returned `run(M, h_ext, initial_state) -> start_states` launches without checking its tensors again (the
    two-phase state pass calls it once per forward with buffers it made itself). `pdl`: launched with programmatic
    dependent launch (it waits for the previous kernel inside, see `AffineMerge`). `final`: the final states too
    (every summary is applied): `run(M, h_ext, initial_state, final_state)` writes them into `final_state`
    ([num_seqs, H, 128, 128] fp32, or None: not kept).
    `flags` (with `final`; int32 [slots + slots * num_heads], the caller's: readers per slot, then zeroed counts):
    the merge publishes every start state that has readers as it stores it (`AffineMerge`'s `publish`); `run.writers`
    is what each published count reaches. Only the regs and tc variants publish: for the others (a forced
    CUTE_KERNELS_AFFINE_MERGE) `run.writers` is None and nothing is published."""
    offsets, n = offsets_tensor("seg_offsets", seg_offsets, slots, device)
    if n != num_seqs:
        raise ValueError(f"seg_offsets has {n} sequences, expected {num_seqs}")
    impl = merge_impl_for(num_seqs, num_heads, 128, 128, sm_count(device))
    publish = flags is not None and impl in PUBLISHING_IMPLS
    if flags is not None and not final:
        raise ValueError("a publishing merge plan needs final=True")
    if publish and (flags.dtype != torch.int32 or flags.numel() != slots * (1 + num_heads)):
        raise ValueError(f"flags must be int32 [{slots * (1 + num_heads)}], got {flags.dtype} {tuple(flags.shape)}")
    fn = compile_affine_merge(128, 128, has_initial_state, impl, starts_only=not final, pdl=pdl, publish=publish).fn
    flag_arg = flags if publish else offsets

    def run(M, h_ext, initial_state, final_state=None):
        starts = torch.empty((slots, num_heads, 128, 128), dtype=torch.float32, device=device)
        unused = starts[:num_seqs]   # stands in for the final state (and the initial state when there is none)
        if final and final_state is None:
            final_state = torch.empty((num_seqs, num_heads, 128, 128), dtype=torch.float32, device=device)
        fn(M, h_ext, offsets, initial_state if has_initial_state else unused, starts,
           final_state if final else unused, flag_arg)
        return starts

    run.writers = affine_merge_writers(impl, 128) if publish else None
    return run


def compile_lse_merge(head_dim: int, out_dtype: torch.dtype, dump_dir=None):
    def build():
        from ..runtime.arch import import_cutlass

        cutlass = import_cutlass()  # sets CUTE_DSL_ARCH before the kernel module imports cutlass
        from ..kernels.merge import LseMerge

        f32, i32 = cutlass.Float32, cutlass.Int32
        out = cutlass_dtype(out_dtype)
        args = (
            fake_tensor(f32, (DYN, DYN, head_dim)),
            fake_tensor(f32, (DYN, DYN), align=4),
            fake_tensor(i32, (DYN,), align=4),
            fake_tensor(out, (DYN, DYN, head_dim), align=8 if out_dtype != torch.float32 else 16),
            fake_tensor(f32, (DYN, DYN), align=4),
            fake_stream(),
        )
        return LseMerge(head_dim, out), args

    return compile_kernel(("lse_merge", head_dim, str(out_dtype)), build, dump_dir=dump_dir)


def lse_merge(o_partial, lse_partial, seg_offsets=None, out_dtype=torch.bfloat16, *, out=None):
    """Merge split-KV partial outputs by log-sum-exp.

    o_partial `[slots, *rows, D]` fp32 (each split's normalized output), lse_partial `[slots, *rows]` fp32
    (natural log; -inf for an empty split). Without `seg_offsets` all slots are splits of every row:
    returns (o `[*rows, D]` in `out_dtype`, lse `[*rows]` fp32). With `seg_offsets` `[N + 1]` (a schedule's
    layout: sequence n owns slots seg_offsets[n] .. seg_offsets[n+1] - 1): returns o `[N, *rows, D]` and
    lse `[N, *rows]`. A row with only empty splits gives o = 0 and lse = -inf. `out=(o, lse)` writes into
    given tensors instead.
    """
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
    compiled = compile_lse_merge(D, out_dtype)
    compiled.fn(o_partial.view(slots, R, D), lse_partial.view(slots, R), offsets, o.view(N, R, D), lse.view(N, R))
    return o, lse
