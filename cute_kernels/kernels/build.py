"""Compile a kernel for its config (no GPU needed): fake tensors in, a cached TVM-FFI function out. One function per
kernel role, compiled once per (config, dtypes, arch), picking the arch's kernel class (sm90/ for sm_90a; the SIMT
merges serve every arch). CuTe DSL is imported only by the build functions, on first use.
"""

from __future__ import annotations

import torch

from ..runtime.arch import SM100_ARCHS, import_cutlass, target_arch
from ..runtime.compile import DYN, Compiled, compile_kernel, cutlass_dtype, fake_stream, fake_tensor
from .configs import DecodeConfig, FusedConfig, MergeConfig, PrepConfig, RecurrentConfig, StateConfig

SM90_ONLY = ("sm_90a",)


def _sm90(what: str) -> None:
    arch = target_arch()
    if arch not in SM90_ONLY:
        raise NotImplementedError(f"{what} has an SM90 (wgmma) build only; the target arch is {arch}")


def _name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def build_fused(config: FusedConfig, io_dtype: torch.dtype, beta_dtype: torch.dtype, dump_dir=None) -> Compiled:
    """The fused forward. Its function takes (q, k, v, g fp32, beta, a_log, dt_bias, lower_bound, o, initial_state,
    final_state, tiles, num_tiles, grid, scale): 4-D / 3-D [B, T, ...] tensors as the op has them, states
    [N, H, 128, 128] fp32; a_log / dt_bias flat fp32 (1-element stand-ins unless config.gate reads them)."""

    def build():
        cutlass = import_cutlass()
        if target_arch() in SM100_ARCHS:
            from .sm100.fused import ChunkedForwardSm100 as kernel_class
        else:
            _sm90("the fused forward")
            from .sm90.fused import ChunkedForwardSm90 as kernel_class
        from schedulers.problem import NUM_TILE_FIELDS

        io, bt, f32 = cutlass_dtype(io_dtype), cutlass_dtype(beta_dtype), cutlass.Float32
        wide = lambda: fake_tensor(io, (DYN, DYN, DYN, 128))   # noqa: E731
        args = (
            wide(), wide(), wide(),
            fake_tensor(f32, (DYN, DYN, DYN, 128) if config.kda else (DYN, DYN, DYN), align=4),
            fake_tensor(bt, (DYN, DYN, DYN), align=2),
            fake_tensor(f32, (DYN,), align=4), fake_tensor(f32, (DYN,), align=4), f32(0.0),   # a_log, dt_bias, lb
            wide(),
            fake_tensor(f32, (DYN, DYN, 128, 128)),
            fake_tensor(f32, (DYN, DYN, 128, 128)),
            fake_tensor(cutlass.Int32, (DYN, NUM_TILE_FIELDS), align=4),
            cutlass.Int32(1),
            cutlass.Int32(1),
            f32(1.0),
            fake_stream(),
        )
        return kernel_class(config, io, bt), args

    return compile_kernel(("fused", config, _name(io_dtype), _name(beta_dtype)), build, dump_dir=dump_dir)


def build_prep(config: PrepConfig, io_dtype: torch.dtype, beta_dtype: torch.dtype, dump_dir=None) -> Compiled:
    """Phase 1. Its function takes (q, k, v, g fp32, beta, a_log, dt_bias, lower_bound (as `build_fused`), query,
    key, value, update_key, intra, decay, tiles,
    num_tiles, grid, scale, flags, chunks_per_seq, consumers): the outputs in `ChunkTerms`' slots (those the
    build does not write may be any tensor of their shape: the call's q, k, v)."""

    def build():
        _sm90("phase 1")
        cutlass = import_cutlass()
        from .sm90.chunk_prep import ChunkPrepSm90
        from schedulers.problem import NUM_TILE_FIELDS

        io, bt, f32 = cutlass_dtype(io_dtype), cutlass_dtype(beta_dtype), cutlass.Float32
        wide = lambda: fake_tensor(io, (DYN, DYN, DYN, 128))   # noqa: E731
        # KDA's g: 16-byte aligned (the ops check it; the row-anchored factors prefetch it in 16-byte vectors)
        gate = lambda: fake_tensor(f32, (DYN, DYN, DYN, 128) if config.kda else (DYN, DYN, DYN),   # noqa: E731
                                   align=16 if config.kda else 4)
        token_factors = not config.kda and config.terms == "folded"
        args = (
            wide(), wide(), wide(), gate(), fake_tensor(bt, (DYN, DYN, DYN), align=2),   # q, k, v, g, beta
            fake_tensor(f32, (DYN,), align=4), fake_tensor(f32, (DYN,), align=4), f32(0.0),   # a_log, dt_bias, lb
            wide(), wide(), wide(), wide(),                                              # query .. update_key
            fake_tensor(io, (DYN, DYN, DYN, 64)),                                        # intra
            fake_tensor(f32, (DYN, DYN, DYN, 4), align=16) if token_factors else gate(),   # decay
            fake_tensor(cutlass.Int32, (DYN, NUM_TILE_FIELDS), align=4),
            cutlass.Int32(1),
            cutlass.Int32(1),
            f32(1.0),
            fake_tensor(cutlass.Int32, (DYN,), align=4),   # flags (publish)
            cutlass.Int32(1),                              # chunks per sequence
            cutlass.Int32(1),                              # consumers per flag
            fake_stream(),
        )
        return ChunkPrepSm90(config, io, bt), args

    return compile_kernel(("prep", config, _name(io_dtype), _name(beta_dtype)), build, dump_dir=dump_dir)


def build_state_pass(config: StateConfig, io_dtype: torch.dtype, dump_dir=None) -> Compiled:
    """Phase 2. Its function takes (query, key, value, update_key, intra, decay, o, initial_state, final_state,
    tiles, num_tiles, grid, flags, chunks_per_seq)."""

    def build():
        _sm90("the state pass")
        cutlass = import_cutlass()
        from .sm90.state_pass import ChunkStatePassSm90
        from schedulers.problem import NUM_TILE_FIELDS

        io, f32 = cutlass_dtype(io_dtype), cutlass.Float32
        wide = lambda: fake_tensor(io, (DYN, DYN, DYN, 128))   # noqa: E731
        decay = (fake_tensor(f32, (DYN, DYN, DYN, 4), align=16) if config.token_factors
                 else fake_tensor(f32, (DYN, DYN, DYN, 128) if config.kda else (DYN, DYN, DYN)))
        args = (
            wide(), wide(), wide(), wide(),                      # query, key, value, update_key
            fake_tensor(io, (DYN, DYN, DYN, 64)),                # intra
            decay,
            wide(),                                              # o
            fake_tensor(f32, (DYN, DYN, 128, 128)),
            fake_tensor(f32, (DYN, DYN, 128, 128)),
            fake_tensor(cutlass.Int32, (DYN, NUM_TILE_FIELDS), align=4),
            cutlass.Int32(1),
            cutlass.Int32(1),
            fake_tensor(cutlass.Int32, (DYN,), align=4),   # flags (consume)
            cutlass.Int32(1),                              # chunks per sequence
            fake_stream(),
        )
        return ChunkStatePassSm90(config, io), args

    return compile_kernel(("state_pass", config, _name(io_dtype)), build, dump_dir=dump_dir)


def build_affine_merge(config: MergeConfig, dump_dir=None) -> Compiled:
    """The affine merge. Its function takes (M, h_ext, seg_offsets, initial_state, start_states, final_state),
    fp32 [.., H, K, K] / [.., H, K, V], seg_offsets int32 [N + 1]; the grid comes from final_state's [N, H]."""
    def build():
        cutlass = import_cutlass()
        f32, i32 = cutlass.Float32, cutlass.Int32
        k, v = config.k_dim, config.v_dim
        args = (
            fake_tensor(f32, (DYN, DYN, k, k)),
            fake_tensor(f32, (DYN, DYN, k, v)),
            fake_tensor(i32, (DYN,), align=4),
            fake_tensor(f32, (DYN, DYN, k, v)),
            fake_tensor(f32, (DYN, DYN, k, v)),
            fake_tensor(f32, (DYN, DYN, k, v)),
            fake_stream(),
        )
        if config.impl == "tc" and target_arch() in SM100_ARCHS:
            from .sm100.affine_merge_tc import AffineMergeTcSm100

            return AffineMergeTcSm100(config, cutlass.BFloat16), args
        if config.impl == "tc":
            _sm90("the 'tc' affine merge")
            from .sm90.affine_merge_tc import AffineMergeTcSm90

            return AffineMergeTcSm90(config, cutlass.BFloat16), args
        from .merge import AffineMerge

        return AffineMerge(config), args

    return compile_kernel(("affine_merge", config), build, dump_dir=dump_dir)


def build_lse_merge(head_dim: int, out_dtype: torch.dtype, dump_dir=None) -> Compiled:
    """The log-sum-exp merge of split-KV partials: (o_partial, lse_partial, seg_offsets, o, lse)."""

    def build():
        cutlass = import_cutlass()
        from .merge import LseMerge

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

    return compile_kernel(("lse_merge", head_dim, _name(out_dtype)), build, dump_dir=dump_dir)


def build_decode(config: DecodeConfig, io_dtype: torch.dtype, dump_dir=None) -> Compiled:
    """Split-KV decode attention (wgmma on sm_90a, tcgen05 on sm_100a / sm_103a). Its function takes (q, k_cache, v_cache,
    cache_seqlens, page_table, o, lse, o_part, lse_part, counters, tiles, num_tiles, splits, unit_blocks, grid,
    scale, softcap): q / o [B, Sq, Hq, D], caches 4-D, lse [B, Sq, Hq] fp32, partials [slots, 64, D] (io dtype) /
    [slots, 64] fp32, counters [units] int32; `tiles` is read by stream-K (persistent) builds, (splits, unit_blocks) by the
    others (`schedulers.splitkv.even_split_shape`)."""

    def build():
        cutlass = import_cutlass()
        from schedulers.problem import NUM_TILE_FIELDS

        if target_arch() in SM100_ARCHS:
            from .sm100.decode import SplitKVDecodeSm100 as kernel_class
        else:
            from .sm90.decode import SplitKVDecodeSm90 as kernel_class

        io, f32, i32, D = cutlass_dtype(io_dtype), cutlass.Float32, cutlass.Int32, config.head_dim
        four = lambda: fake_tensor(io, (DYN, DYN, DYN, D))   # noqa: E731
        args = (
            four(), four(), four(),                                        # q, k_cache, v_cache
            fake_tensor(i32, (DYN,), align=4),                             # cache_seqlens
            fake_tensor(i32, (DYN, DYN), align=4),                         # page_table
            four(),                                                        # o
            fake_tensor(f32, (DYN, DYN, DYN), align=4),                    # lse
            fake_tensor(io, (DYN, 64, D)),                                 # o_part (normalized, io dtype)
            fake_tensor(f32, (DYN, 64), align=4),                          # lse_part
            fake_tensor(i32, (DYN,), align=4),                             # counters
            fake_tensor(i32, (DYN, NUM_TILE_FIELDS), align=4),
            i32(1), i32(1), i32(1), i32(1), f32(1.0), f32(1.0),           # num_tiles, splits, unit_blocks, grid
            fake_stream(),
        )
        return kernel_class(config, io), args

    return compile_kernel(("decode", config, _name(io_dtype)), build, dump_dir=dump_dir)


def build_decode_fixup(group: int, out_dtype: torch.dtype, head_dim: int = 128, dump_dir=None) -> Compiled:
    """The split-KV fixup as its own launch (every arch): (o_part, lse_part, seg_offsets, o, lse)."""

    def build():
        cutlass = import_cutlass()
        from .decode_fixup import SplitKVFixup

        f32, i32 = cutlass.Float32, cutlass.Int32
        args = (
            fake_tensor(f32, (DYN, 64, head_dim)),
            fake_tensor(f32, (DYN, 64), align=4),
            fake_tensor(i32, (DYN,), align=4),
            fake_tensor(cutlass_dtype(out_dtype), (DYN, DYN, DYN, head_dim)),
            fake_tensor(f32, (DYN, DYN, DYN), align=4),
            fake_stream(),
        )
        return SplitKVFixup(group, cutlass_dtype(out_dtype)), args

    return compile_kernel(("decode_fixup", group, head_dim, _name(out_dtype)), build, dump_dir=dump_dir)


def build_recurrent_step(config: RecurrentConfig, io_dtype: torch.dtype, g_dtype: torch.dtype,
                         beta_dtype: torch.dtype, dump_dir=None) -> Compiled:
    """The recurrent step (every arch). Its function takes (q, k, v, g, beta, a_log, dt_bias, h0, ht, cu_seqlens,
    init_idx, final_idx, accepted, o, T, N, scale, lower_bound), q / k / v / g / beta / o as the op has them ([B, T,
    ...]): see `RecurrentStep`."""

    def build():
        cutlass = import_cutlass()
        from .recurrent_step import RecurrentStep
        from .tensor_core_step import TensorCoreStep

        io, f32, i32, K = cutlass_dtype(io_dtype), cutlass.Float32, cutlass.Int32, config.head_dim
        gd, bd = cutlass_dtype(g_dtype), cutlass_dtype(beta_dtype)
        g_shape = (DYN, DYN, DYN, K) if config.kda else (DYN, DYN, DYN)
        idx_shape = (DYN, DYN) if config.spec else (DYN,)
        four = lambda: fake_tensor(io, (DYN, DYN, DYN, K))   # noqa: E731
        args = (
            four(), four(), four(),                                                                       # q k v
            fake_tensor(gd, g_shape, align=4), fake_tensor(bd, (DYN, DYN, DYN), align=2),                 # g, beta
            fake_tensor(f32, (DYN,), align=4), fake_tensor(f32, (DYN,), align=4),                         # a_log, dt_bias
            fake_tensor(f32, (DYN, DYN, K, K)), fake_tensor(f32, (DYN, DYN, K, K)),                       # h0, ht
            fake_tensor(i32, (DYN,), align=4),                                                            # cu_seqlens
            fake_tensor(i32, idx_shape, align=4), fake_tensor(i32, idx_shape, align=4),                   # indices
            fake_tensor(i32, (DYN,), align=4),                                                            # accepted
            four(),                                                                                       # o
            i32(1), i32(1), f32(1.0), f32(1.0),
            fake_stream(),
        )
        step = TensorCoreStep if config.tensor_cores else RecurrentStep
        return step(config, io, gd, bd), args

    return compile_kernel(("recurrent_step", config, _name(io_dtype), _name(g_dtype), _name(beta_dtype)), build,
                          dump_dir=dump_dir)


def build_qk_l2norm(io_dtype: torch.dtype, dump_dir=None) -> Compiled:
    """q and k l2-normalized in one launch (every arch): (q, k, qn, kn), each [B, T, H, 128] 16-bit."""

    def build():
        import_cutlass()
        from .l2norm import QKL2Norm

        io = cutlass_dtype(io_dtype)
        four = lambda: fake_tensor(io, (DYN, DYN, DYN, 128))   # noqa: E731
        return QKL2Norm(io), (four(), four(), four(), four(), fake_stream())

    return compile_kernel(("qk_l2norm", _name(io_dtype)), build, dump_dir=dump_dir)


def build_state_pool_copy(gather: bool, dump_dir=None) -> Compiled:
    """Pool gather / scatter of [.., 128, 128] fp32 states (every arch): (dense, pool, idx)."""

    def build():
        cutlass = import_cutlass()
        from .state_pool import StatePoolCopy

        f32, i32 = cutlass.Float32, cutlass.Int32
        args = (fake_tensor(f32, (DYN, DYN, 128, 128)), fake_tensor(f32, (DYN, DYN, 128, 128)),
                fake_tensor(i32, (DYN,), align=4), fake_stream())
        return StatePoolCopy(gather), args

    return compile_kernel(("state_pool_copy", gather), build, dump_dir=dump_dir)
