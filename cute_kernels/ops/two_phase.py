"""Two-phase chunked forward (experimental, issue 5; design in NOTES.md "a parallel chunk-prep phase").

Phase 1 (`ChunkPrepSm90`, parallel over chunk ranges) computes every chunk's local terms; phase 2
(`ChunkStatePassSm90`) runs only the state recurrence, one CTA per (sequence, head, 64 V columns).
`chunk_prep_torch` is phase 1 in plain torch (fp32, batched over chunks): the spec of the terms, and a way to test
and time phase 2 on its own.

    prep = chunk_prep(q, k, v, g, beta, scale, kda=...)   # PrepTerms (or chunk_prep_torch)
    o, final = state_pass(prep, initial_state, output_final_state)
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

import torch

from . import merge as _merge
from .checks import check_cuda, check_shape, check_tensor

C = 64


@dataclass
class PrepTerms:
    """Phase 1's output for a fixed-length batch, all [B, T, H, D] contiguous (16-bit unless noted).

    qg = scale exp(G) q; w = T (exp(G) k); u = T v; kg = exp(G_last - G) k; aqk[b, t, h, :] = row t - t0 of its
    chunk's Aqk (zero above the diagonal and past the chunk end); eg (fp32) = exp(G) per token ([B, T, H] GDN,
    [B, T, H, K] KDA). G: the cumulative log decay inside the chunk, T = (I + Akk)^-1 diag(beta): the chunked form
    of `cute_kernels.reference.chunk_gated_delta_rule_ref`.

    `raw` (GDN's phase 1 with GDN_RAW_QK): qg and kg are the caller's q and k themselves (no gated copies are
    written) and eg is [B, T, H, 4] fp32, every token holding (scale exp(G), exp(G_last - G), exp(G_last), 0) of
    its chunk; `gated()` gives the plain terms.

    `fold` (GDN_FOLD): T is folded into the two products that read v_new = T R, R = v - diag(exp(G)) k S: w is the
    caller's k, u the caller's v, kg holds W2 = T^T kg (kg = exp(G_last - G) k, the plain term) and aqk holds
    A1 = Aqk T (rows as Aqk's); with `raw` eg's fourth factor is exp(G), and `gated()` keeps the fold (qg gated,
    eg = exp(G) on every row). KDA's fold (KDA_FOLD): qg as plain, w holds exp(G) k (per channel), u the caller's
    v, kg W2, aqk A1, eg as plain; the plain state pass runs it unchanged, R = v - (exp(G) k) S standing in for
    v_new.
    """

    qg: torch.Tensor
    w: torch.Tensor
    u: torch.Tensor
    kg: torch.Tensor
    aqk: torch.Tensor
    eg: torch.Tensor
    kda: bool
    raw: bool = False
    fold: bool = False

    def gated(self) -> PrepTerms:
        """The plain terms (qg, kg gated and rounded to their dtype, eg = exp(G_last) on every row; `fold`: qg
        gated, eg = exp(G) on every row, the rest as they are): `self` unless `raw`."""
        if not self.raw:
            return self
        f = self.eg.float()
        qg = (self.qg.float() * f[..., 0:1]).to(self.qg.dtype)
        kg = (self.kg.float() * f[..., 1:2]).to(self.kg.dtype)
        if self.fold:
            return replace(self, qg=qg, eg=f[..., 3].contiguous(), raw=False)
        return replace(self, qg=qg, kg=kg, eg=f[..., 2].contiguous(), raw=False)


def chunk_prep_torch(q, k, v, g, beta, scale=None, *, kda: bool, chunks_per_step: int = 32,
                     fold: bool = False) -> PrepTerms:
    """Phase 1 in torch, fp32 (fixed-length [B, T, H, D] inputs, K = 128). Chunks are processed `chunks_per_step`
    (x B x H) at a time to bound the [64, 64, K] pairwise decays of KDA. `fold`: the terms of `PrepTerms.fold`
    (w = k -- KDA: exp(G) k --, u = v, kg = W2 = T^T kg, aqk = A1 = Aqk T)."""
    from ..reference.linear_attention import _chunk_terms

    B, T, H, K = k.shape
    if K != 128 or v.shape[-1] % 64 or q.shape != k.shape:
        raise ValueError(f"two-phase path: q, k [B, T, H, 128] and V a multiple of 64, got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    scale = K ** -0.5 if scale is None else float(scale)
    nc = -(-T // C)
    pad = nc * C - T

    def chunked(x, fill=0.0):   # [B, T, H, ...] fp32 -> [B, nc, H, C, ...]
        x = x.float()
        if pad:
            x = torch.nn.functional.pad(x, (0, 0) * (x.dim() - 2) + (0, pad), value=fill)
        x = x.reshape(B, nc, C, *x.shape[2:])
        return x.movedim(2, 3)

    qc, kc, vc, gc, bc = chunked(q), chunked(k), chunked(v), chunked(g), chunked(beta)
    out = {name: [] for name in ("qg", "w", "u", "kg", "aqk", "eg")}
    for c0 in range(0, nc, chunks_per_step):
        sl = slice(c0, min(c0 + chunks_per_step, nc))
        n = sl.stop - sl.start
        flat = lambda x: x[:, sl].reshape(B * n, *x.shape[2:])   # noqa: E731
        qs, ks, vs, gs, bs = flat(qc), flat(kc), flat(vc), flat(gc), flat(bc)
        t = _chunk_terms(ks, vs, gs, bs, kda)
        if kda:
            aqk = scale * torch.einsum("nhrd,nhid,nhrid->nhri", qs, ks, t.decay)
        else:
            aqk = scale * (qs @ ks.transpose(-1, -2)) * t.decay
        parts = {"qg": scale * t.eG * qs, "w": t.w, "u": t.u, "kg": t.kg, "aqk": aqk,
                 "eg": t.eG if kda else t.eG[..., 0]}
        if fold:   # KDA: w holds exp(G) k (per channel: no row factor can stand in for it)
            parts.update(w=t.eG * ks if kda else ks, u=vs, kg=t.T.transpose(-1, -2) @ t.kg, aqk=aqk @ t.T)
        for name, x in parts.items():
            out[name].append(x.reshape(B, n, *x.shape[1:]))

    def tokens(x, dtype):   # [B, nc, H, C, ...] -> [B, T, H, ...]
        x = torch.cat(x, dim=1).movedim(3, 2)
        x = x.reshape(B, nc * C, *x.shape[3:])[:, :T]
        return x.to(dtype).contiguous()

    io = q.dtype
    return PrepTerms(tokens(out["qg"], io), tokens(out["w"], io), tokens(out["u"], io), tokens(out["kg"], io),
                     tokens(out["aqk"], io), tokens(out["eg"], torch.float32), kda, fold=fold)


# GDN's phase 1 in its `slim` form: two CTAs per SM (one q/k/v stage, 288 threads, ~95 KB of shared memory).
PREP_SLIM = os.environ.get("CUTE_KERNELS_PREP_SLIM", "1") == "1"

# KDA's phase 1 forms Akk / Aqk in the row-anchored form (`ChunkPrepSm90(row_anchors=True)`: one factor-and-gating
# pass and four full-height wgmma products instead of four anchored rounds). CUTE_KERNELS_KDA_ROW_ANCHORS=0 turns
# it off (the column form).
KDA_ROW_ANCHORS = os.environ.get("CUTE_KERNELS_KDA_ROW_ANCHORS", "1") == "1"

# The row-anchored phase 1 stores a full fast-path chunk's terms by TMA (`ChunkPrepSm90(tma_out=True)`: qg, kg as
# one bulk group, w, u, Aqk as a second; 364.3 vs 379.1 us at KDA B=2 H=16 T=8192, session 15).
# CUTE_KERNELS_PREP_TMA_OUT=0: thread stores.
PREP_TMA_OUT = os.environ.get("CUTE_KERNELS_PREP_TMA_OUT", "1") == "1"

# GDN's slim phase 1 does not write qg and kg (32 of the ~120 KB per chunk and head it moves): the state pass reads
# q and k and applies the per-token factors (`ChunkPrepSm90(raw_qk=True)`, `ChunkStatePassSm90(raw_qk=True)`).
# CUTE_KERNELS_GDN_RAW_QK=0: the gated copies.
GDN_RAW_QK = os.environ.get("CUTE_KERNELS_GDN_RAW_QK", "1") == "1"


# GDN_RAW_QK's phase 1 with three CTAs per SM (`ChunkPrepSm90(trio=True)`: Akk over the dead q tile, the solve's
# scratch over Xk, 75.8 KB of shared memory, at most 72 registers per thread), for grids the two-per-SM build would
# run in more than one wave (`prep_occupancy`). H200, session 18 (`scripts/time_two_phase.py trio`): phase 1
# 151.6 -> 132.9 us at B=2 H=16 T=8192 and 151.9 -> 132.8 at B=8 H=8 T=4096 (the op 327.5 -> 309.1, 261.3 -> 244.9);
# in one wave it was no faster (B=1 H=4 T=4096: 13.7 vs 14.0 us). CUTE_KERNELS_PREP_TRIO=0 turns it off.
PREP_TRIO = os.environ.get("CUTE_KERNELS_PREP_TRIO", "1") == "1"

# GDN_RAW_QK's two phases with T = (I + Akk)^-1 diag(beta) folded into the products that read v_new = T R,
# R = v - diag(exp(G)) k S (`ChunkPrepSm90(fold=True)`, `ChunkStatePassSm90(fold=True)`): phase 1 writes W2 = T^T kg
# and A1 = Aqk T instead of w, u and Aqk, and loads no v; the state pass reads k (for k S), v, W2 and A1, and its
# chain keeps its shape. Per chunk and head 32 KB fewer through global memory (~168 -> ~136 KB).
# Measured (H200, session 22, `scripts/time_two_phase.py fold`): phase 1 130.3 -> 117.1 us at B=2 H=16 T=8192,
# 42.3 -> 39.2 at B=1 H=4 T=16384, but 1744 -> 1747 at B=16 H=64 T=4096 (predicted ~1250: at three CTAs per SM on a
# large grid phase 1 is bound by its instructions, not its bytes); the op 1-3% faster on all three (3487 -> 3459,
# 304 -> 296, 127 -> 125 us), the state pass a little faster too. The phase-1 cost constants stay (within ~2% at the
# large grids the path choice depends on). CUTE_KERNELS_GDN_FOLD=0 turns it off.
GDN_FOLD = os.environ.get("CUTE_KERNELS_GDN_FOLD", "1") == "1"


# KDA's fold (`ChunkPrepSm90(fold=True)` on the row-anchored build): phase 1 writes qg, kE = exp(G) k (per channel),
# W2 = T^T kg and A1 = Aqk T, loads no v and forms no u; the plain KDA state pass reads them with the call's v as u
# (R = v - kE S for v_new). Per chunk and head 32 KB fewer through global memory and half a 64 x 64 x 128 product.
# Written in session 24 without a GPU; run in session 25 on an H100 (GPU tests pass: phase 1 against the torch spec,
# the op against the reference with 1, 3 and 8 segments). Phase 1 -14% (B=16 H=64 T=4096 5617 -> 4828 us) and -16%
# (B=2 H=16 T=8192 379 -> 318 us); the op -10.5%, -8.4% and -7.4% (B=1 H=4 T=16384 203 -> 188 us), more than the
# -1..-3% predicted. On by default; CUTE_KERNELS_KDA_FOLD=0 keeps w and u.
KDA_FOLD = os.environ.get("CUTE_KERNELS_KDA_FOLD", "1") == "1"

# KDA_FOLD's phase 1 with a two-stage q / k ring (`ChunkPrepSm90(stages=2)`: the fold loads no v, so v's 16 KB and
# the solve's scratch laid over the band factors pay for a second q / k stage; the one-stage build waits ~1.9k of
# ~25k cycles per chunk for its next q / k tiles). Written in session 29; the terms are bitwise those of the
# one-stage build (`test_kda_prep_two_stages_equal_one`, 4 passed on the H200). The plain path's phase 1 only (not
# the overlapped one's). Measured (H200, `benchmarks/results/session29_kda_stages_h200_2026-12-05.txt`): phase 1
# -2% at B=16 H=64 T=4096, +0..2% at B*H <= 32, the op within +-2% (predicted -5..-8% for phase 1). Off;
# CUTE_KERNELS_KDA_PREP_STAGES=2 turns it on.
KDA_PREP_STAGES = int(os.environ.get("CUTE_KERNELS_KDA_PREP_STAGES", "1"))


def fold_path(kda: bool) -> bool:
    """Whether the two-phase path runs the fold's phase 1. GDN (GDN_FOLD, GDN_RAW_QK's kernels with T folded in):
    only with the state pass build the fold was run with on the H200 (two ring stages, o from registers, u by the
    swizzled reads); STATE_STAGES = 3, STATE_O_TMA or STATE_U_FAST keep w and u until their fold builds have run
    on a GPU. KDA (KDA_FOLD): the row-anchored phase 1 (its state pass is the plain one)."""
    if kda:
        from . import linear_attention as la

        return KDA_FOLD and KDA_ROW_ANCHORS and la.KDA_VEC
    return (GDN_FOLD and raw_qk_path(kda) and STATE_STAGES == 2 and not STATE_O_TMA and not STATE_U_FAST)

# Phase 1's solve with its doubling levels as tf32 tensor-core products (`ChunkPrepSm90(solve_mma=True)`: warp-level
# mma.sync, operands rounded to nearest; GDN's slim / trio and KDA's row-anchored builds). H200, session 19
# (`scripts/time_two_phase.py solve-mma`, 2 chunks per tile): GDN phase 1 134.9 -> 124.5 us at B=2 H=16 T=8192 and
# 136.2 -> 125.3 at B=8 H=8 T=4096 (the op 312.9 -> 301.0, 247.6 -> 234.5); KDA phase 1 366.3 -> 357.9; one wave
# (B=1 H=4 T=16384) 46.2 -> 45.5. CUTE_KERNELS_PREP_SOLVE_MMA=0: the CUDA-core levels.
PREP_SOLVE_MMA = os.environ.get("CUTE_KERNELS_PREP_SOLVE_MMA", "1") == "1"


def raw_qk_path(kda: bool) -> bool:
    """Whether the two-phase path runs GDN_RAW_QK's kernels (GDN, the slim phase 1, the rs state pass with its
    decays in the ring)."""
    return GDN_RAW_QK and not kda and PREP_SLIM and STATE_PASS_RS and STATE_RING_DECAY


def prep_ctas_per_sm(kda: bool) -> int:
    """Phase-1 CTAs that share an SM in the base build: 2 for GDN's slim kernel, else 1 (`prep_occupancy` may
    raise it to 3 for a large grid)."""
    return 2 if (PREP_SLIM and not kda) else 1


def prep_occupancy(kda: bool, num_tiles: int, sms: int) -> int:
    """Phase-1 CTAs per SM for a grid of `num_tiles`: 3 (PREP_TRIO's build) when GDN_RAW_QK's build is on and two
    per SM would take more than one wave, else `prep_ctas_per_sm`."""
    base = prep_ctas_per_sm(kda)
    return 3 if (PREP_TRIO and raw_qk_path(kda) and num_tiles > base * sms) else base


def prep_chunks_per_tile(problem, kda: bool, slots: int) -> int:
    """Chunks per phase-1 tile: 1 when every chunk of the call gets its own CTA in one wave (a small call then
    waits for one chunk, not two), else 2 (the tile's second chunk loads under the first one's math)."""
    return 1 if sum(problem.chunks) * problem.num_heads <= slots * prep_ctas_per_sm(kda) else 2


# Phase-1 tiles sized to fill one wave where two-chunk tiles would leave a partial last wave (`prep_tile_counts`).
# The case it is for: B=1 H=4 T=16384 (1024 chunk rows), whose 512 two-chunk tiles fill the 396 CTA slots (three
# per SM) once and 116 of them again; one wave of 396 tiles of 2-3 chunks instead. Session 20 predicted phase 1
# 45 -> ~36 us from the makespan (4 -> 3 chunk times per slot). Measured on the H200 (session 21, graph replay,
# `scripts/time_two_phase.py balance`), GDN phase 1 at four seed cells with 1024 chunk rows: 44.5 -> 42.1
# (B=1 H=4 T=16384), 44.3 -> 41.7 (B=2 H=16 T=2048), 43.8 -> 40.1 (B=1 H=16 T=4096), 44.4 -> 42.0 (B=8 H=16
# T=512); the op 129.4 -> 128.6, 91.8 -> 89.2, 74.6 -> 73.6 us. The tail wave's 116 tiles run alone on their SMs,
# faster per chunk than at three per SM, so the makespan overstates what balancing saves: `predicted_us` prices
# phase 1 on the two-chunk tiles either way (the path and segment choices stay those the model was fitted on).
PREP_BALANCE = os.environ.get("CUTE_KERNELS_PREP_BALANCE", "1") == "1"
# balanced tiles only where the model's phase-1 makespan (in chunk times per slot) drops by at least this factor
PREP_BALANCE_GAIN = 0.9


def prep_tile_counts(problem, kda: bool, slots: int, chunks_per_tile: int | None = None,
                     balance: bool | None = None) -> list[int]:
    """Phase-1 tiles per sequence (each (sequence, head) split into that many near-equal chunk ranges).

    `chunks_per_tile` given: that many chunks per tile. Otherwise `prep_chunks_per_tile`'s, or with `balance`
    (default PREP_BALANCE), where the makespan drops by PREP_BALANCE_GAIN: one wave of tiles (the slots at the
    occupancy that many tiles get) with each sequence's share in proportion to its chunks -- tiles of ~total /
    slots chunks, so the last wave is not a partial one."""
    from schedulers.heuristics import makespan

    H = problem.num_heads
    fixed = chunks_per_tile or prep_chunks_per_tile(problem, kda, slots)
    counts = [max(1, -(-c // fixed)) for c in problem.chunks]
    if balance is None:
        balance = PREP_BALANCE
    if chunks_per_tile is not None or not balance or fixed == 1:
        return counts
    total = sum(problem.chunks) * H
    wave = slots * prep_occupancy(kda, total, slots)   # total > one wave of tiles here: the largest occupancy
    share = [max(1, min(c, c * wave // total)) for c in problem.chunks]

    def span(ns):
        tiles = [n for c, k in zip(problem.chunks, ns) for n in _split_sizes(c, k) for _ in range(H)]
        return makespan(tiles, slots * prep_occupancy(kda, len(tiles), slots))

    return share if span(share) <= PREP_BALANCE_GAIN * span(counts) else counts


def _split_sizes(c: int, n: int) -> list[int]:
    """The chunk counts of `split_even(c, n)`'s pieces."""
    from schedulers import split_even

    b = split_even(c, n)
    return [b[i + 1] - b[i] for i in range(len(b) - 1)]


def compile_chunk_prep(io_dtype: torch.dtype, beta_dtype: torch.dtype, kda: bool, vec: bool | None = None,
                       prefetch: bool | None = None, slim: bool | None = None, dump_dir=None,
                       profile: bool = False, pdl: bool | None = None, publish: bool = False,
                       row_anchors: bool | None = None, tma_out: bool | None = None, raw_qk: bool | None = None,
                       trio: bool | None = None, solve_mma: bool | None = None, secondary: bool = False,
                       fold: bool = False, stages: int | None = None):
    """Compile phase 1 (`ChunkPrepSm90`) for one configuration (no GPU needed). KDA's `vec` / `prefetch` default
    to the fused kernel's switches (KDA_VEC, KDA_PREFETCH), its `row_anchors` to KDA_ROW_ANCHORS (with `vec`),
    `tma_out` to PREP_TMA_OUT (with `row_anchors`, not `publish`);
    GDN's `slim` to PREP_SLIM, `raw_qk` to `raw_qk_path` (with `slim`; not by default with `publish`), `trio` to
    PREP_TRIO (with `raw_qk`; not by default with `publish`), `solve_mma` to PREP_SOLVE_MMA (with `slim` or
    `row_anchors`). `publish`: the overlapped path's build (persistent grid, per-chunk flags; see `OverlapPlan`);
    `secondary`: launched as the state pass's programmatic dependent (GDN's raw overlapped path); `fold`: GDN_FOLD's
    terms (with `raw_qk`) or KDA_FOLD's (with `row_anchors`); `stages`: the q / k ring depth, 2 only for KDA's fold
    build (default KDA_PREP_STAGES there without `publish`, else 1)."""
    from ..runtime.compile import DYN, compile_kernel, cutlass_dtype, fake_stream, fake_tensor
    from . import linear_attention as la

    vec = kda and (la.KDA_VEC if vec is None else vec)
    prefetch = kda and (la.KDA_PREFETCH if prefetch is None else prefetch)
    slim = not kda and (PREP_SLIM if slim is None else slim)
    pdl = PDL if pdl is None else pdl
    row_anchors = vec and (KDA_ROW_ANCHORS if row_anchors is None else row_anchors)
    tma_out = row_anchors and not publish and (PREP_TMA_OUT if tma_out is None else tma_out)
    raw_qk = slim and ((raw_qk_path(kda) and not publish) if raw_qk is None else raw_qk)
    trio = raw_qk and ((PREP_TRIO and not publish) if trio is None else trio)
    solve_mma = (slim or row_anchors) and (PREP_SOLVE_MMA if solve_mma is None else solve_mma)
    if stages is None:
        stages = KDA_PREP_STAGES if (kda and fold and row_anchors and not publish) else 1
    key = ("chunk_prep_sm90", str(io_dtype), str(beta_dtype), kda, vec, prefetch, slim, profile, pdl, publish,
           row_anchors, tma_out, raw_qk, trio, solve_mma, secondary, fold, stages)

    def build():
        from schedulers.problem import NUM_TILE_FIELDS

        from ..runtime.arch import import_cutlass

        cutlass = import_cutlass()  # sets CUTE_DSL_ARCH before the kernel module imports cutlass
        from ..kernels.sm90.chunk_prep import ChunkPrepSm90

        io, bt, f32 = cutlass_dtype(io_dtype), cutlass_dtype(beta_dtype), cutlass.Float32
        kernel = ChunkPrepSm90(io, bt, kda=kda, vec_elementwise=vec, prefetch_gates=prefetch, slim=slim,
                               profile=profile, pdl=pdl, publish=publish, row_anchors=row_anchors,
                               tma_out=tma_out, raw_qk=raw_qk, trio=trio, solve_mma=solve_mma,
                               secondary=secondary, fold=fold, stages=stages)
        wide = lambda: fake_tensor(io, (DYN, DYN, DYN, 128))   # noqa: E731
        # KDA's g: 16-byte aligned (the ops check it; row_anchors prefetches it in 16-byte vectors)
        gate = lambda: fake_tensor(f32, (DYN, DYN, DYN, 128) if kda else (DYN, DYN, DYN),   # noqa: E731
                                   align=16 if kda else 4)
        args = (
            wide(), wide(), wide(), gate(), fake_tensor(bt, (DYN, DYN, DYN), align=2),   # q, k, v, g, beta
            wide(), wide(), wide(), wide(),                                              # qg, w, u, kg
            fake_tensor(io, (DYN, DYN, DYN, 64)),                                        # aqk
            fake_tensor(f32, (DYN, DYN, DYN, 4), align=16) if raw_qk else gate(),        # eg
            fake_tensor(cutlass.Int32, (DYN, NUM_TILE_FIELDS), align=4),
            cutlass.Int32(1),
            cutlass.Int32(1),
            f32(1.0),
            fake_tensor(cutlass.Int32, (DYN,), align=4),   # flags (publish)
            cutlass.Int32(1),                              # chunks per sequence
            cutlass.Int32(1),                              # consumers per flag
            fake_stream(),
        )
        return kernel, args

    return compile_kernel(key, build, dump_dir=dump_dir)


_no_flags: dict = {}
_no_lookback: dict = {}


def no_flags(device) -> tuple:
    """The (flags, chunks per sequence, consumers) arguments of a phase-1 / state-pass launch that neither
    publishes nor waits (the overlapped path's flags, unused): one int32 element per device, made once."""
    key = str(device)
    if key not in _no_flags:
        _no_flags[key] = (torch.zeros(1, dtype=torch.int32, device=device), 0, 0)
    return _no_flags[key]


def state_pass_tail(device, io_dtype) -> tuple:
    """The state pass's arguments after its tile table for a launch without `consume` or `lookback`: (flags,
    chunks per sequence, lb_m, lb_ws) -- unused stand-ins, made once per device and dtype."""
    key = (str(device), io_dtype)
    if key not in _no_lookback:
        _no_lookback[key] = (torch.zeros((1, 1, 128, 128), dtype=io_dtype, device=device),
                             torch.zeros(64, dtype=torch.float32, device=device))
    return no_flags(device)[:2] + _no_lookback[key]


_POISON_PREP = False   # tests set it: phase 1's outputs start as NaN


def _problem(B, T, H, cu, num_blocks: int = 1):
    """The schedulers' Problem of a [B, T, H, ..] batch, or of packed sequences (`cu`: a tuple of offsets, B = 1)."""
    from schedulers import Problem

    if cu is None:
        return Problem.fixed(B, T, H, num_blocks=num_blocks)
    return Problem.varlen(list(cu), H, num_blocks=num_blocks)


def _cu_tuple(cu_seqlens, B, T):
    """cu_seqlens (list or int tensor, read to the host once) as a tuple, checked against [B, T]."""
    if cu_seqlens is None:
        return None
    cu = tuple(int(x) for x in (cu_seqlens.tolist() if hasattr(cu_seqlens, "tolist") else cu_seqlens))
    if B != 1 or len(cu) < 2 or cu[0] != 0 or cu[-1] != T or any(b < a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"cu_seqlens must go from 0 to T={T} without decreasing, with B = 1, got B={B}, "
                         f"cu_seqlens={list(cu[:8])}")
    return cu


def chunk_prep(q, k, v, g, beta, scale=None, *, kda: bool, chunks_per_tile: int | None = None,
               cu_seqlens=None) -> PrepTerms:
    """Phase 1 on the GPU (`ChunkPrepSm90`): the same terms as `chunk_prep_torch` (eg written at each chunk's last
    row only), one CTA per `chunks_per_tile` chunks of one (sequence, head) (None: `prep_chunks_per_tile`).
    [B, T, H, D] inputs, or packed
    sequences ([1, T, ...] with `cu_seqlens`: chunks start at each sequence's start)."""
    B, T, H, K = k.shape
    V = v.shape[-1]
    if K != 128 or V != 128 or q.shape != k.shape:
        raise ValueError(f"chunk_prep: q, k, v [B, T, H, 128], got q {tuple(q.shape)}, k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)}")
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        check_tensor(name, x, ndim=x.dim())   # contiguous: both kernels flatten [B, T] themselves
    device = check_cuda(q=q, k=k, v=v, g=g, beta=beta)
    scale = K ** -0.5 if scale is None else float(scale)
    cu = _cu_tuple(cu_seqlens, B, T)
    g32 = g if g.dtype == torch.float32 else g.float()
    return prep_plan(B, T, H, cu, kda, q.dtype, beta.dtype, device, chunks_per_tile).run(q, k, v, g32, beta, scale)


_plans: dict = {}


def _cached_plan(cls, *key):
    """cls(*key), built once per key and the kernel switches it compiles with (PREP_SLIM, KDA_ROW_ANCHORS,
    PREP_TMA_OUT, GDN_RAW_QK, GDN_FOLD, KDA_FOLD, KDA_PREP_STAGES, PREP_TRIO, PREP_SOLVE_MMA, PREP_BALANCE, the
    STATE_* switches of the state pass, the affine-merge variant setting, OVERLAP_RAW, OVERLAP_FOLD, OVERLAP_SHARE)."""
    full = (cls, key, PREP_SLIM, KDA_ROW_ANCHORS, PREP_TMA_OUT, GDN_RAW_QK, GDN_FOLD, KDA_FOLD, KDA_PREP_STAGES,
            PREP_TRIO, PREP_SOLVE_MMA, PREP_BALANCE, OVERLAP_RAW, OVERLAP_FOLD, OVERLAP_SHARE,
            STATE_PASS_RS, STATE_STAGES, STATE_RING_DECAY, STATE_O_TMA, STATE_U_FAST, STATE_PAIR, PDL,
            _merge.AFFINE_MERGE_IMPL)
    plan = _plans.get(full)
    if plan is None:
        if len(_plans) > 512:
            _plans.clear()
        plan = _plans[full] = cls(*key)
    return plan


def allocate_terms(B, T, H, kda: bool, dtype, device, raw: bool = False, fold: bool = False) -> PrepTerms:
    """Fresh (uninitialized) phase-1 terms of a [B, T, H, 128] call (`raw`: no qg, kg -- None until the call's q, k
    take their places; `fold`: W2 in kg, A1 in aqk, no w, u -- the call's k and v; KDA's fold: qg, exp(G) k in w,
    W2 in kg, A1 in aqk, no u -- the call's v)."""
    aqk = torch.empty((B, T, H, C), dtype=dtype, device=device)
    if fold and kda:   # qg, kE (w), W2 (kg); u is the call's v
        qg, ke, w2 = torch.empty((3, B, T, H, 128), dtype=dtype, device=device).unbind(0)
        eg = torch.empty((B, T, H, 128), dtype=torch.float32, device=device)
        return PrepTerms(qg, ke, None, w2, aqk, eg, kda, fold=True)
    if fold:
        w2 = torch.empty((B, T, H, 128), dtype=dtype, device=device)
        eg = torch.empty((B, T, H, 4), dtype=torch.float32, device=device)
        return PrepTerms(None, None, None, w2, aqk, eg, kda, raw=True, fold=True)
    if raw:
        w, u = torch.empty((2, B, T, H, 128), dtype=dtype, device=device).unbind(0)
        eg = torch.empty((B, T, H, 4), dtype=torch.float32, device=device)
        return PrepTerms(None, w, u, None, aqk, eg, kda, raw=True)
    wide = torch.empty((4, B, T, H, 128), dtype=dtype, device=device)   # qg, w, u, kg: one allocation
    eg = torch.empty((B, T, H, 128) if kda else (B, T, H), dtype=torch.float32, device=device)
    return PrepTerms(*wide.unbind(0), aqk, eg, kda)


class PrepPlan:
    """Phase 1 of one configuration, built once: the compiled kernel, the tile table on the device. `run` then
    allocates the terms and launches (no checks: the caller has validated its inputs)."""

    def __init__(self, B, T, H, cu, kda, io, beta_dtype, device, chunks_per_tile):
        from schedulers import Segmentation, schedule_from_segmentation, split_even

        self.shape, self.kda, self.device = (B, T, H), kda, device
        problem = _problem(B, T, H, cu)
        from .linear_attention import _sm_count

        if chunks_per_tile is None:
            self.tile_counts = prep_tile_counts(problem, kda, _sm_count(device))
        else:
            self.tile_counts = [max(1, -(-c // chunks_per_tile)) for c in problem.chunks]
        seg = Segmentation([split_even(c, n) for c, n in zip(problem.chunks, self.tile_counts)])
        schedule = schedule_from_segmentation(problem, seg, "prep")
        self.raw = raw_qk_path(kda)
        self.fold = fold_path(kda)
        # (CPU plans, the tests' emulated kernels: no SM count to ask, the base build)
        self.occupancy = (prep_occupancy(kda, schedule.num_tiles, _sm_count(device)) if device.type == "cuda"
                          else prep_ctas_per_sm(kda))
        self.fn = (compile_chunk_prep(io, beta_dtype, kda, raw_qk=self.raw, trio=self.occupancy == 3,
                                      fold=self.fold).fn if T else None)
        self.launch = (schedule.table_on(device), schedule.num_tiles, schedule.grid[0])
        self.flag_args = no_flags(device)
        wide, eg_floats = (2, 4) if self.raw else (4, 128 if kda else 1)
        if self.fold:
            wide = 3 if kda else 1   # GDN's fold: W2 only; KDA's: qg, kE, W2
        self.term_bytes = B * T * H * (wide * 128 * io.itemsize + C * io.itemsize + eg_floats * 4)

    def allocate(self, dtype) -> PrepTerms:
        """Fresh (uninitialized) terms for one call."""
        return allocate_terms(*self.shape, self.kda, dtype, self.device, self.raw, self.fold)

    def terms(self, dtype) -> PrepTerms:
        """The call's terms: small ones (host-bound calls: three allocations and the views cost ~13 us of a ~49 us
        call on the H200 host) from a workspace kept per (plan, stream), which stream order makes safe to reuse;
        large ones, and any under CUDA-graph capture (the graph's own pool), allocated per call."""
        stream = _workspace_stream(self.device) if self.term_bytes <= WORKSPACE_TERM_BYTES else None
        if stream is None:
            return self.allocate(dtype)
        key = (self, dtype, stream)   # the plan object itself: a kept entry keeps its plan alive
        hit = _workspaces.get(key)
        if hit is None:
            global _workspace_bytes
            if _workspace_bytes + self.term_bytes > WORKSPACE_TOTAL_BYTES:
                _workspaces.clear()
                _workspace_bytes = 0
            hit = _workspaces[key] = self.allocate(dtype)
            _workspace_bytes += self.term_bytes
        return hit

    def run(self, q, k, v, g32, beta, scale: float, reuse: bool = False) -> PrepTerms:
        """Phase 1 into fresh terms, or (`reuse`: the op's own calls, whose terms die with the call) into
        `terms`'s workspace."""
        t = self.terms(q.dtype) if reuse else self.allocate(q.dtype)
        if self.fold and self.kda:   # the state pass reads v as u (the kernel's u argument: never written)
            t = PrepTerms(t.qg, t.w, v, t.kg, t.aqk, t.eg, True, False, True)
        elif self.fold:   # the state pass reads q, k and v (the kernel writes none of them; W2 leaves by its w output)
            t = PrepTerms(q, k, v, t.kg, t.aqk, t.eg, t.kda, True, True)
        elif self.raw:   # the state pass reads q and k (the kernel writes neither); a plain constructor call, not
            # dataclasses.replace: this runs on every call of the op
            t = PrepTerms(q, t.w, t.u, k, t.aqk, t.eg, t.kda, True)
        # the kernel's qg, w, u, kg arguments
        outs = (q, t.kg, v, k) if self.fold and not self.kda else (t.qg, t.w, t.u, t.kg)
        if _POISON_PREP:   # tests: every element the state pass reads must have been written
            written = ((t.kg, t.aqk, t.eg) if self.fold and not self.kda
                       else (t.qg, t.w, t.kg, t.aqk, t.eg) if self.fold
                       else (t.w, t.u, t.aqk, t.eg) + (() if self.raw else (t.qg, t.kg)))
            for x in written:
                x.fill_(float("nan"))
        if self.fn is not None:
            self.fn(q, k, v, g32, beta, *outs, t.aqk, t.eg, *self.launch, scale, *self.flag_args)
        return t


# Phase 1's terms of calls up to WORKSPACE_TERM_BYTES are kept between calls (per plan and stream), at most
# WORKSPACE_TOTAL_BYTES in all (then the workspaces are dropped and rebuilt).
WORKSPACE_TERM_BYTES = 16 << 20
WORKSPACE_TOTAL_BYTES = 256 << 20
_workspaces: dict = {}
_workspace_bytes = 0


def _workspace_stream(device):
    """The current stream's handle, where a kept workspace may serve the call (a CUDA device, no graph capture)."""
    if device.type != "cuda" or torch.cuda.is_current_stream_capturing():
        return None
    return torch.cuda.current_stream(device).cuda_stream


def prep_plan(B, T, H, cu, kda, io, beta_dtype, device, chunks_per_tile: int | None = None) -> PrepPlan:
    return _cached_plan(PrepPlan, B, T, H, cu, kda, io, beta_dtype, device, chunks_per_tile)


# Phase 2 with the state chain in registers (RS wgmma, `ChunkStatePassSm90(rs=True)`), on by default: correct on
# the H200 (every rs case of tests/test_two_phase.py) and, once its o^T stores overlap the state update, faster
# there (2026-12-03, scripts/time_two_phase.py state: GDN 1.62 vs 1.81 us per chunk, KDA 1.69 vs 1.71;
# benchmarks/results/state_pass_rs_time_h200_2026-12-03.txt has the earlier, slower rs: 2.30 / 2.57).
STATE_PASS_RS = os.environ.get("CUTE_KERNELS_STATE_PASS_RS", "1") == "1"
# rs only: the depth of the state pass's TMA ring (64 KB per stage; 3 fit once S, v_new and o leave shared memory,
# but measured no faster: 1.65 us per chunk either way, benchmarks/results/state_pass_variants_h200_2026-12-03.txt).
STATE_STAGES = int(os.environ.get("CUTE_KERNELS_STATE_STAGES", "2"))
# rs only: each chunk's exp(G_last) rides the ring (loaded by the producer warp; no global-load latency on the
# chain: the profile build showed KDA waiting ~750-1030 cycles per chunk on it) (`ChunkStatePassSm90(ring_decay=)`).
STATE_RING_DECAY = os.environ.get("CUTE_KERNELS_STATE_RING_DECAY", "1") == "1"
# rs only: full o tiles leave by one TMA store from smem instead of 32 scattered 2-byte stores per thread
# (`tma_o`): measured 3-5% slower at T=8192 (GDN 1.09 vs 1.06 us per chunk), 5% faster at T=1000; off.
STATE_O_TMA = os.environ.get("CUTE_KERNELS_STATE_O_TMA", "0") == "1"
# rs only: u read with constant per-element offsets (no swizzle arithmetic per load) and rows masked only in a
# partial chunk (`u_fast`); in the SASS of the default build ~80 of the ~245 instructions per thread of the v_new
# step (~380 cycles of the chain) are per-load swizzle arithmetic. Measured on the H200 (session 10): bitwise equal
# to the default build and no faster (GDN 1.06 / 1.19 us per chunk either way): those instructions are not on the
# critical path. Off.
STATE_U_FAST = os.environ.get("CUTE_KERNELS_STATE_U_FAST", "0") == "1"
# rs with ring_decay only: both 64-column V blocks of a (sequence, head) in one CTA, a consumer warpgroup each on
# one shared ring (`pair`): the qg, w, kg, Aqk tiles are loaded once per chunk instead of twice (72 instead of
# 128 KB per chunk and head) and a (sequence, head, segment) takes one SM instead of two. Measured on the H200
# (2026-12-03, `scripts/time_two_phase.py pair`): each chain 1.96-2.16 us per chunk against 1.28-1.35 alone, so
# faster only where the state pass has more tiles than SMs (B=8 H=16 T=4096: 186 vs 202 us). Since session 20 the
# planner sends such calls down the two-phase path (B*H >= 128, T >= 4096), where the state pass is also bound by
# its loads (GDN B=16 H=64 T=4096: ~1700 us for ~128 KB per chunk and head, 72 KB with `pair`).
# "auto": `pair` for a state pass whose one-block output tiles take more than one wave of SMs, the one-block tiles
# otherwise; "1": always; "0" (default until "auto" has been timed with GDN_RAW_QK / GDN_FOLD's terms: that
# build compiles -- 168 registers at launch, no spills -- and its GPU tests pass on an H100, session 25).
STATE_PAIR = os.environ.get("CUTE_KERNELS_STATE_PAIR", "0")
# Programmatic dependent launch between the two-phase kernels: phase 1 lets the state pass launch once its last
# wave has started (`griddepcontrol.launch_dependents`), and the state pass / merge launches wait inside
# (`griddepcontrol.wait`) after their prologue, so barrier setup, descriptor prefetch and launch latency overlap
# the previous kernel's tail instead of following it. Measured on the H200 (2026-12-03, `scripts/time_two_phase.py
# pdl`, GDN, graph replay): B=1 H=4 T=512 22.1 -> 21.4 us, T=1024 32.4 -> 31.8, T=16384 (N = 9) 148.7 -> 147.2,
# B=2 H=16 T=8192 346 either way; outputs bitwise equal to PDL off. On by default; CUTE_KERNELS_PDL=0 turns it off.
PDL = os.environ.get("CUTE_KERNELS_PDL", "1") == "1"
# The segmented state pass in one launch (`ChunkStatePassSm90` mode "lookback": ticketed tiles, summaries, the
# chain of start states on tensor cores, outputs) instead of summary launch + affine merge + output launch. Written
# in session 23 without a GPU (compiled, its protocol emulated on the CPU): off until its GPU test and timing have
# run (tests/test_two_phase.py -k lookback, scripts/time_two_phase.py lookback). Session 25, H100: its GPU tests pass
# (bitwise equal to the split launches); not yet timed. CUTE_KERNELS_STATE_LOOKBACK=1.
STATE_LOOKBACK = os.environ.get("CUTE_KERNELS_STATE_LOOKBACK", "0") == "1"
# The one-pass segmented state pass: the summary launch also stores each chain's outputs (`summary_o`: o from a
# zero start, qm from the identity), the merge gives the start states, and `SegmentCorrectionSm90` adds qm S_0 in
# parallel over the chunks -- each segment's chain runs once instead of twice. Written in session 23 without a
# GPU (compiled; its CPU emulation and a float64 emulation of its roundings match the reference as closely as the
# unsegmented chain: rel. err 2.42e-3 vs 2.38e-3 at T = 4096, N = 8): off until measured
# (tests/test_two_phase.py -k one_pass, scripts/time_two_phase.py one-pass). Session 25, H100: GPU tests pass, but
# slower than the split launches (GDN B=1 H=4 T=16384 N=8: state pass 111.6 vs 94.8 us); off.
# CUTE_KERNELS_STATE_ONE_PASS=1.
STATE_ONE_PASS = os.environ.get("CUTE_KERNELS_STATE_ONE_PASS", "0") == "1"
CORRECTION_CHUNKS_PER_TILE = 4   # the correction launch: chunks per CTA (S_0's split is made once per tile)
# With STATE_ONE_PASS: the merge (regs or tc) publishes each start state as it stores it, and the correction grid
# (launched programmatically as soon as every merge CTA runs) spins on those counts instead of waiting for the whole
# merge, so every correction but the last segments' runs under the merge's chain (`SegmentCorrectionSm90(early)`).
# Written in session 24 without a GPU (compiled; its counts' bookkeeping emulated on the CPU): off until measured
# (tests/test_two_phase.py -k one_pass, scripts/time_two_phase.py one-pass). Session 25, H100: bitwise equal to the
# waiting correction, counts back at 0, but no faster (114.4 us vs one-pass 111.6); off.
# CUTE_KERNELS_STATE_EARLY_CORRECTION=1.
STATE_EARLY_CORRECTION = os.environ.get("CUTE_KERNELS_STATE_EARLY_CORRECTION", "0") == "1"


def state_pair(output_tiles: int | None = None, slots: int | None = None) -> bool:
    """Whether the state pass runs `pair` tiles, where the other switches allow it: STATE_PAIR "1" always,
    "auto" where its one-block output tiles (`output_tiles`: one per sequence, segment, head and 64 V columns)
    are more than `slots` (one CTA per SM), "0" never."""
    if not (STATE_PASS_RS and STATE_RING_DECAY and not STATE_O_TMA and not STATE_U_FAST):
        return False
    if STATE_PAIR == "auto":
        return output_tiles is not None and slots is not None and output_tiles > slots
    if STATE_PAIR not in ("0", "1"):
        raise ValueError(f"CUTE_KERNELS_STATE_PAIR must be 0, 1 or auto, got {STATE_PAIR!r}")
    return STATE_PAIR == "1"


def compile_state_pass(io_dtype: torch.dtype, kda: bool, has_initial_state: bool, store_final_state: bool,
                       mode: str = "forward", dump_dir=None, rs: bool | None = None, num_stages: int | None = None,
                       profile: bool = False, ring_decay: bool | None = None, tma_o: bool | None = None,
                       u_fast: bool | None = None, pair: bool | None = None, pdl: bool | None = None,
                       consume: bool = False, raw_qk: bool = False, fold: bool = False, summary_o: bool = False,
                       share: bool = False):
    """Compile phase 2 (`ChunkStatePassSm90`) for one configuration (no GPU needed); `raw_qk`: it reads q, k and
    GDN_RAW_QK's [.., 4] eg (`PrepTerms.raw`); `fold`: and v, W2, A1 (`PrepTerms.fold`); `rs` defaults to
    STATE_PASS_RS, and with rs `num_stages` to STATE_STAGES (2 without rs). `profile`: the diagnostic build whose
    final_state argument receives per-CTA phase cycles (`ChunkStatePassSm90` docstring)."""
    from ..runtime.compile import DYN, compile_kernel, cutlass_dtype, fake_stream, fake_tensor

    rs = STATE_PASS_RS if rs is None else rs
    num_stages = (STATE_STAGES if rs else 2) if num_stages is None else num_stages
    ring_decay = (STATE_RING_DECAY and rs) if ring_decay is None else ring_decay
    u_fast = (STATE_U_FAST and rs) if u_fast is None else u_fast
    tma_o = (STATE_O_TMA and rs) if tma_o is None else tma_o
    pair = (state_pair() and rs and ring_decay and not tma_o and not u_fast) if pair is None else pair
    pdl = PDL if pdl is None else pdl
    key = ("state_pass_sm90", str(io_dtype), kda, has_initial_state, store_final_state, mode, rs, num_stages,
           profile, ring_decay, tma_o, u_fast, pair, pdl, consume, raw_qk, fold)
    key = key + (("summary_o",) if summary_o else ()) + (("share",) if share else ())

    def build():
        from schedulers.problem import NUM_TILE_FIELDS

        from ..runtime.arch import import_cutlass

        cutlass = import_cutlass()  # sets CUTE_DSL_ARCH before the kernel module imports cutlass
        from ..kernels.sm90.state_pass import ChunkStatePassSm90

        io, f32 = cutlass_dtype(io_dtype), cutlass.Float32
        kernel = ChunkStatePassSm90(io, kda, has_initial_state, store_final_state, mode, rs=rs,
                                    num_stages=num_stages, profile=profile, ring_decay=ring_decay, tma_o=tma_o,
                                    u_fast=u_fast, pair=pair, pdl=pdl, consume=consume, raw_qk=raw_qk,
                                    fold=fold, summary_o=summary_o, share=share)
        wide = lambda: fake_tensor(io, (DYN, DYN, DYN, 128))   # noqa: E731
        args = (
            wide(), wide(), wide(), wide(),                      # qg, w, u, kg
            fake_tensor(io, (DYN, DYN, DYN, 64)),                # aqk
            fake_tensor(f32, (DYN, DYN, DYN, 4), align=16) if raw_qk   # eg (16-byte aligned: checked)
            else fake_tensor(f32, (DYN, DYN, DYN, 128) if kda else (DYN, DYN, DYN)),
            wide(),                                              # o
            fake_tensor(f32, (DYN, DYN, 128, 128)),
            fake_tensor(f32, (DYN, DYN, 128, 128)),
            fake_tensor(cutlass.Int32, (DYN, NUM_TILE_FIELDS), align=4),
            cutlass.Int32(1),
            cutlass.Int32(1),
            fake_tensor(cutlass.Int32, (DYN,), align=4),   # flags (consume, lookback)
            cutlass.Int32(1),                              # chunks per sequence
            fake_tensor(io, (DYN, DYN, DYN, 128), align=16),   # lb_m (lookback), qm (summary_o)
            fake_tensor(f32, (DYN,), align=16),                 # lb_ws (lookback)
            fake_stream(),
        )
        return kernel, args

    return compile_kernel(key, build, dump_dir=dump_dir)


def compile_segment_correction(io_dtype: torch.dtype, dump_dir=None, pdl: bool | None = None, early: bool = False):
    """Compile the one-pass forward's correction (`SegmentCorrectionSm90`: o += qm S_0 per tile) (no GPU needed);
    `pdl` defaults to PDL. `early`: each tile spins on its start state's published count (STATE_EARLY_CORRECTION).
    The compiled function takes (qm, o, starts, tiles, num_tiles, flags, writers): flags (int32) and writers are
    read only by the early build."""
    from ..runtime.compile import DYN, compile_kernel, cutlass_dtype, fake_stream, fake_tensor

    def build():
        from schedulers.problem import NUM_TILE_FIELDS

        from ..runtime.arch import import_cutlass

        cutlass = import_cutlass()
        from ..kernels.sm90.segment_correction import SegmentCorrectionSm90

        io = cutlass_dtype(io_dtype)
        args = (
            fake_tensor(io, (DYN, DYN, DYN, 128)),                 # qm
            fake_tensor(io, (DYN, DYN, DYN, 128)),                 # o
            fake_tensor(cutlass.Float32, (DYN, DYN, 128, 128)),    # start states
            fake_tensor(cutlass.Int32, (DYN, NUM_TILE_FIELDS), align=4),
            cutlass.Int32(1),
            fake_tensor(cutlass.Int32, (DYN,), align=4),           # flags (early)
            cutlass.Int32(1),                                      # writers (early)
            fake_stream(),
        )
        return SegmentCorrectionSm90(io, pdl, early), args

    pdl = PDL if pdl is None else pdl
    key = ("segment_correction_sm90", str(io_dtype), pdl) + (("early",) if early else ())
    return compile_kernel(key, build, dump_dir=dump_dir)


_schedules: dict = {}
_POISON_SUMMARIES = False   # tests set it: the summary buffer starts as NaN, so an unwritten slot that is read shows


def _state_pass_schedules(B, T, H, V, num_segments, init: bool, cu, device, pair: bool = False):
    """(output schedule, summary schedule or None) of the state pass: tiles (sequence, segment, head, 64 V
    columns; `pair`: 128); the summary launch adds M's 128 columns per segment (2 blocks, `pair`: 1), pruned by
    `summary_schedule`. `num_segments`: one count for every sequence or a tuple per sequence (never more than
    its chunks)."""
    from schedulers import Segmentation, schedule_from_segmentation, split_even, summary_schedule

    key = (B, T, H, V, num_segments, init, cu, str(device), pair)
    hit = _schedules.get(key)
    if hit is None:
        cols = 128 if pair else 64
        problem = _problem(B, T, H, cu, num_blocks=V // cols)
        counts = num_segments if isinstance(num_segments, tuple) else (num_segments,) * problem.num_seqs
        if len(counts) != problem.num_seqs:
            raise ValueError(f"num_segments has {len(counts)} counts for {problem.num_seqs} sequences")
        seg = Segmentation([split_even(c, max(1, min(n, c))) for c, n in zip(problem.chunks, counts)])
        out = schedule_from_segmentation(problem, seg, "state-pass")
        summ = None
        if seg.total_segments > problem.num_seqs:
            blocks = _problem(B, T, H, cu, num_blocks=V // cols + 128 // cols)
            summ = summary_schedule(blocks, seg, first_m=init, h_blocks=V // cols)
        if len(_schedules) > 256:
            _schedules.clear()
        hit = _schedules[key] = (out, summ)
    return hit


def state_pass(prep: PrepTerms, initial_state=None, output_final_state: bool = False, *, num_segments=1,
               cu_seqlens=None, out=None):
    """Phase 2 on the GPU: o [B, T, H, V] (prep's dtype) and the final state [B, H, K, V] fp32 (or None), one CTA
    per (sequence, head, 64 V columns, segment). `num_segments` > 1 (V = 128 only) splits each sequence along T:
    a summary launch (the affine maps a start state needs), `affine_merge` into the true start states, then the
    segments' outputs (an int for every sequence, or a list per sequence). Packed sequences: `cu_seqlens` as in
    `chunk_prep`. `out=(o, final_state)` writes into given tensors."""
    B, T, H, K = prep.kg.shape
    V = prep.u.shape[-1]
    if K != 128 or V != 128:
        raise ValueError(f"state_pass supports K = V = 128 (compiled shapes), got K={K}, V={V}")
    for name in ("qg", "w", "u", "kg", "aqk", "eg"):
        check_tensor(name, getattr(prep, name), ndim=getattr(prep, name).dim())
    for name in ("qg", "w", "kg"):
        check_shape(name, getattr(prep, name), (B, T, H, K))
    check_shape("aqk", prep.aqk, (B, T, H, C))
    check_shape("eg", prep.eg, (B, T, H, 4) if prep.raw else (B, T, H, K) if prep.kda else (B, T, H))
    device = check_cuda(qg=prep.qg, w=prep.w, u=prep.u, kg=prep.kg, aqk=prep.aqk, eg=prep.eg)
    cu = _cu_tuple(cu_seqlens, B, T)
    N = B if cu is None else len(cu) - 1
    if initial_state is not None:
        check_tensor("initial_state", initial_state, dtypes=(torch.float32,), ndim=4)
        check_shape("initial_state", initial_state, (N, H, K, V))
    if out is not None:
        o, final = out
        check_tensor("out[o]", o, dtypes=(prep.u.dtype,), ndim=4)
        check_shape("out[o]", o, (B, T, H, V))
        if final is not None:
            check_tensor("out[final_state]", final, dtypes=(torch.float32,), ndim=4)
            check_shape("out[final_state]", final, (N, H, K, V))
    else:
        o = torch.empty_like(prep.u)
        final = torch.empty((N, H, K, V), dtype=torch.float32, device=device) if output_final_state else None
    num_segments = tuple(num_segments) if isinstance(num_segments, (list, tuple)) else int(num_segments)
    counts = num_segments if isinstance(num_segments, tuple) else (num_segments,)
    if min(counts, default=1) < 1:
        raise ValueError(f"num_segments must be >= 1, got {num_segments}")
    if max(counts, default=1) > 1 and V != 128:
        raise ValueError(f"the segmented state pass needs V = 128 (summaries are [128, 128]), got V={V}")
    plan = state_plan(B, T, H, cu, prep.kda, prep.u.dtype, initial_state is not None, final is not None,
                      num_segments, device, prep.raw, prep.fold)
    return plan.run(prep, initial_state, o, final)


class StatePlan:
    """Phase 2 of one configuration (segment counts, initial state or not, final state or not), built once: the
    compiled kernels (forward, or summary + segment outputs, or with STATE_LOOKBACK the one-launch segmented
    build), the tile tables on the device. `run` launches them (no checks: the caller has validated its tensors).
    The lookback build's flags and workspace, and the early correction's counts (STATE_EARLY_CORRECTION), belong
    to the plan: a plan must not run on two streams at once."""

    def __init__(self, B, T, H, cu, kda, io, init, final, num_segments, device, raw, fold=False, lookback=False,
                 one_pass=False, early=False):
        self.lookback = self.one_pass = False
        if lookback or one_pass:
            schedule, summ = _state_pass_schedules(B, T, H, 128, num_segments, init, cu, device)
            if summ is not None and one_pass:
                self._init_one_pass(B, T, H, cu, kda, io, init, final, schedule.segmentation, device, raw, fold,
                                    early)
                return
            if summ is not None:
                self._init_lookback(B, T, H, cu, kda, io, init, final, schedule.segmentation, device, raw, fold)
                return
        tiles = slots = None   # STATE_PAIR "auto": the one-block output tiles against the SM count
        if STATE_PAIR == "auto":
            from .linear_attention import _sm_count

            tiles = _state_pass_schedules(B, T, H, 128, num_segments, init, cu, device)[0].num_tiles
            slots = _sm_count(device)
        pair = state_pair(tiles, slots)
        schedule, summ = _state_pass_schedules(B, T, H, 128, num_segments, init, cu, device, pair)
        self.init, self.device, self.split, self.pair = init, device, summ is not None, pair
        self.launch = (schedule.table_on(device), schedule.num_tiles, schedule.grid[0]) + state_pass_tail(device, io)
        # an fp32 [1, 1, K, V] stand-in for a state the kernel neither reads nor writes (made here, not per call)
        self.dummy = None if final else torch.empty((1, 1, 128, 128), dtype=torch.float32, device=device)
        if not self.split:
            self.fn = compile_state_pass(io, kda, init, final, pair=pair, raw_qk=raw, fold=fold)
            return
        self.slots = schedule.segmentation.total_segments
        self.merge = _merge.affine_merge_starts_plan(len(schedule.seg_offsets) - 1, H, self.slots,
                                                     schedule.seg_offsets, init, device, pdl=PDL)
        self.summary_fn = (compile_state_pass(io, kda, False, False, mode="summary", pair=pair, raw_qk=raw,
                                              fold=fold)
                           if summ.num_tiles else None)
        self.summary_launch = ((summ.table_on(device), summ.num_tiles, summ.grid[0])
                               + state_pass_tail(device, io))
        self.fn = compile_state_pass(io, kda, True, final, mode="segment_outputs", pair=pair, raw_qk=raw,
                                     fold=fold)

    def _init_lookback(self, B, T, H, cu, kda, io, init, final, segmentation, device, raw, fold):
        """The one-launch segmented state pass: its ticket-ordered table (`lookback_schedule`: summary tiles,
        then output tiles by segment), flags (the ticket counter, a summary count and an end flag per (slot,
        head, V block); zero here, and back at zero after every launch) and workspace (M's hi / lo, h_ext's and
        the end states' fragments)."""
        from schedulers import lookback_schedule

        lb = lookback_schedule(_problem(B, T, H, cu, num_blocks=2), segmentation, init, m_blocks=2)
        slots = segmentation.total_segments
        # the kernel's assumptions: one CTA per ticket (the last draw resets the counter), a summary count of 1 +
        # 2 M blocks per V block, 32-bit workspace offsets (slots x H x 2^15 floats per part)
        assert lb.grid[0] == lb.num_tiles and slots * H < (1 << 15), (lb.grid, lb.num_tiles, slots, H)
        self.lookback, self.init, self.device, self.split, self.pair = True, init, device, True, False
        self.dummy = None if final else torch.empty((1, 1, 128, 128), dtype=torch.float32, device=device)
        self.fn = compile_state_pass(io, kda, init, final, mode="lookback", rs=True, num_stages=2, ring_decay=True,
                                     tma_o=False, u_fast=False, pair=False, raw_qk=raw, fold=fold)
        self.flags = torch.zeros(1 + 2 * slots * H * 2, dtype=torch.int32, device=device)
        workspace = (torch.empty((2 * slots, H, 128, 128), dtype=io, device=device),
                     torch.empty(2 * slots * H * 2 * 128 * 64, dtype=torch.float32, device=device))
        self.launch = (lb.table_on(device), lb.num_tiles, lb.grid[0], self.flags, 0) + workspace

    def _init_one_pass(self, B, T, H, cu, kda, io, init, final, segmentation, device, raw, fold, early):
        """The one-pass segmented state pass (STATE_ONE_PASS): a summary launch over every segment (the last ones
        too) that also stores the chains' outputs (o from zero, qm), the merge (start states and the final
        state), and the correction launch over every segment with a non-zero start. `early`
        (STATE_EARLY_CORRECTION, where the merge variant publishes): the merge publishes each start state and the
        correction tiles spin on it; `flags` (the plan's, int32 [slots + slots * H]) holds each slot's readers
        (its correction tiles) and then the published counts, zero between launches."""
        from schedulers import correction_schedule, summary_schedule

        problem = _problem(B, T, H, cu, num_blocks=4)   # 2 h_ext blocks, 2 M blocks
        summ = summary_schedule(problem, segmentation, init, h_blocks=2, last=True)
        corr = correction_schedule(_problem(B, T, H, cu), segmentation, init, CORRECTION_CHUNKS_PER_TILE)
        self.one_pass, self.init, self.device, self.split, self.pair = True, init, device, True, False
        self.slots = slots = segmentation.total_segments
        self.summary_fn = compile_state_pass(io, kda, False, False, mode="summary", rs=True, num_stages=2,
                                             ring_decay=True, tma_o=False, u_fast=False, pair=False, raw_qk=raw,
                                             fold=fold, summary_o=True)
        tail = state_pass_tail(device, io)   # (flags, chunks per sequence, lb_m, lb_ws): stand-ins but lb_m
        self.summary_launch = (summ.table_on(device), summ.num_tiles, summ.grid[0]) + tail[:2]
        self.unused_ws = tail[3]            # lb_ws: not read in summary mode
        self.flags = None
        if early and corr.num_tiles:
            readers = correction_readers(corr, slots)
            self.flags = torch.cat([readers, torch.zeros(slots * H, dtype=torch.int32)]).to(device)
        self.merge = _merge.affine_merge_starts_plan(len(segmentation.seg_offsets) - 1, H, self.slots,
                                                     segmentation.seg_offsets, init, device, pdl=PDL, final=True,
                                                     flags=self.flags)
        self.early = self.merge.writers is not None   # None: the merge variant does not publish
        self.correct_fn = compile_segment_correction(io, early=self.early) if corr.num_tiles else None
        table = corr.table_on(device)
        self.correct_launch = ((table, corr.num_tiles, self.flags, self.merge.writers) if self.early
                               else (table, corr.num_tiles, table.view(-1), 0))   # stand-ins: not read
        self.qm_shape, self.io = (B, T, H, 128), io

    def run_one_pass(self, prep: PrepTerms, initial_state, o, final):
        terms = (prep.qg, prep.w, prep.u, prep.kg, prep.aqk, prep.eg)
        H = prep.kg.shape[2]
        summary = torch.empty((2 * self.slots, H, 128, 128), dtype=torch.float32, device=self.device)
        if _POISON_SUMMARIES:
            summary.fill_(float("nan"))
        qm = torch.empty(self.qm_shape, dtype=self.io, device=self.device)
        self.summary_fn.fn(*terms, o, summary, summary, *self.summary_launch, qm, self.unused_ws)
        starts = self.merge(summary[self.slots:], summary[:self.slots], initial_state, final)
        if self.correct_fn is not None:
            self.correct_fn.fn(qm, o, starts, *self.correct_launch)
        return o, final

    def run(self, prep: PrepTerms, initial_state, o, final):
        if self.one_pass:
            return self.run_one_pass(prep, initial_state, o, final)
        dummy = final if final is not None else self.dummy
        terms = (prep.qg, prep.w, prep.u, prep.kg, prep.aqk, prep.eg)
        if self.lookback or not self.split:   # one launch
            self.fn.fn(*terms, o, initial_state if self.init else dummy, dummy, *self.launch)
            return o, final
        H = prep.kg.shape[2]
        summary = torch.empty((2 * self.slots, H, 128, 128), dtype=torch.float32, device=self.device)
        if _POISON_SUMMARIES:   # unwritten slots must stay unread
            summary.fill_(float("nan"))
        if self.summary_fn is not None:
            # o stands in for the summary build's o (never written there; the output launch writes all of it) --
            # not prep.u, which with a fold is the caller's v
            self.summary_fn.fn(*terms, o, summary, summary, *self.summary_launch)
        starts = self.merge(summary[self.slots:], summary[:self.slots], initial_state)
        self.fn.fn(*terms, o, starts, dummy, *self.launch)
        return o, final


def state_plan(B, T, H, cu, kda, io, init, final, num_segments, device, raw: bool | None = None,
               fold: bool | None = None) -> StatePlan:
    """The cached StatePlan; `raw` (None: `raw_qk_path(kda)`, as phase 1's plan) for GDN_RAW_QK's terms, `fold`
    (None: `fold_path(kda)`) for GDN_FOLD's."""
    raw = raw_qk_path(kda) if raw is None else raw
    fold = fold_path(kda) if fold is None else fold
    fold = fold and not kda   # KDA's fold terms (exp(G) k in w, v in u, W2, A1) run the plain state pass
    return _cached_plan(StatePlan, B, T, H, cu, kda, io, init, final, num_segments, device, raw, fold,
                        STATE_LOOKBACK, STATE_ONE_PASS, STATE_EARLY_CORRECTION)


def correction_readers(schedule, slots: int) -> torch.Tensor:
    """int32 [slots]: how many tiles of a correction schedule read each slot's start state (per head: every head
    has the same tiles), the count an early correction's last reader recognizes (`SegmentCorrectionSm90`)."""
    readers = torch.zeros(slots, dtype=torch.int32)
    for t in schedule.tiles:
        if t.head == 0:
            readers[t.seg_slot] += 1
    return readers


class OverlapPlan:
    """The overlapped two-phase forward (fixed-length batches, one segment per sequence), built once.

    Phase 1 (`ChunkPrepSm90` with `publish`: persistent, one chunk per tile (the persistent CTA's load ring runs
    ahead across tiles), tiles ordered chunk-major so every (sequence, head)'s earliest chunks come first) and the
    state pass (`consume`, one CTA per (sequence, head, 64 V columns)) run at the same time on different SMs, the
    state pass taking each chunk as soon as phase 1 has published it. The call then takes about max(phase 1 on
    fewer SMs, the state chain) instead of their sum. Phase 1 runs on a side stream (the gated build) or after the
    state pass on the caller's stream (the raw build, below); the side stream waits for the caller's work before
    either kernel, and the caller's stream for the side stream at the end, so the call is ordered like any other.
    Flags: int32 per (sequence, chunk, head), 0 between calls (each of the V / 64 state CTAs of a head takes one
    count back); one set per plan, so a plan must not run on two streams at once.

    Three builds (`overlap_build`):
    - gated (KDA; GDN with OVERLAP_RAW off): phase 1 with one CTA per SM on `sms - state CTAs` CTAs, launched
      first: the state CTAs then find the SMs it leaves free. KDA with OVERLAP_FOLD: phase 1 is KDA_FOLD's build
      (no v load, no u product; qg, exp(G) k, W2, A1), and the state pass reads the call's v as u.
    - raw (GDN with OVERLAP_RAW and GDN_RAW_QK): phase 1's raw build with three CTAs per SM (`raw_qk`, `trio`) on
      3 x (sms - state CTAs) CTAs, the state pass's raw build with three ring stages (its shared memory then
      leaves no room for a phase-1 CTA beside it). Phase 1's grid would spread over every SM if it came first
      (leaving the state CTAs no SM until it ends), so the state pass goes first, on the caller's stream, and
      phase 1 follows on the same stream as its programmatic dependent (`ChunkPrepSm90(secondary=True)`): it
      starts once every state CTA holds its SM, fills the others, and ends only after the state pass. The order
      is then the same eagerly and in a CUDA graph (two streams would leave a graph free to start either first).
    - share (GDN with OVERLAP_SHARE, `overlap_build`): the raw build, but the state pass is its `share` build (two
      ring stages, launched with 128 registers per thread): by the count one phase-1 CTA fits beside each state
      CTA, so phase 1 runs on 3 x (sms - state CTAs) + state CTAs (whether they co-reside on the GPU is open: the
      one measurement, session 28, was slower than the raw build).

    Deadlock freedom: phase 1 never waits on the state pass before its end, and the state grid stays at or
    below half the SMs (`overlap_fits`), so every state CTA becomes resident and phase 1 always has SMs to run
    on. One more condition for the raw order: phase 1 must be able to launch while the state grid spins. Under
    CUDA's lazy module loading a kernel's first launch may wait for the context to go idle -- which a spinning
    state grid never does -- so the raw build's first call (and any call captured into a graph before an eager
    one) runs the gated order (phase 1 first, on the side stream); only after an eager call has loaded both
    kernels does the state pass go first.
    """

    def __init__(self, B, T, H, kda, io, beta_dtype, init, final, device, sms):
        from schedulers import Schedule, Segmentation, schedule_from_segmentation, split_even

        if not overlap_fits(B, H, sms):
            raise ValueError(f"overlapped path: {2 * B * H} state CTAs need at most half of the {sms} SMs")
        self.shape, self.kda, self.device = (B, T, H), kda, device
        problem = _problem(B, T, H, None)
        self.build = overlap_build(problem, kda, sms)
        self.raw, self.share = self.build in ("raw", "share"), self.build == "share"
        self.fold = overlap_fold(kda)
        self.chunks_per_seq = problem.chunks[0]
        state = schedule_from_segmentation(_problem(B, T, H, None, num_blocks=2),
                                           Segmentation([split_even(c, 1) for c in problem.chunks]), "state-pass")
        prep_seg = Segmentation([split_even(c, c) for c in problem.chunks])   # one chunk per tile
        tiles = schedule_from_segmentation(problem, prep_seg, "prep").tiles
        tiles = sorted(tiles, key=lambda t: (t.chunk_start, t.seq, t.head))   # chunk-major
        ctas = max(1, min(len(tiles), overlap_prep_ctas(self.build, sms, state.num_tiles)))
        prep = Schedule(tiles, (ctas, 1, 1), True, prep_seg, "prep-overlap")
        self.flags = torch.zeros(B * self.chunks_per_seq * H, dtype=torch.int32, device=device)
        if self.raw:
            self.prep_fn = compile_chunk_prep(io, beta_dtype, kda, slim=True, publish=True, raw_qk=True,
                                              trio=True, secondary=True).fn
            # pdl: its CTAs signal launch_dependents, which is what lets phase 1 start at all
            self.state_fn = compile_state_pass(io, kda, init, final, consume=True, raw_qk=True, rs=True,
                                               ring_decay=True, num_stages=2 if self.share else 3, pair=False,
                                               pdl=True, share=self.share).fn
        else:
            self.prep_fn = compile_chunk_prep(io, beta_dtype, kda, slim=False, publish=True, fold=self.fold).fn
            self.state_fn = compile_state_pass(io, kda, init, final, consume=True, pair=False).fn
        self.prep_launch = (prep.table_on(device), prep.num_tiles, ctas)
        self.state_launch = ((state.table_on(device), state.num_tiles, state.grid[0], self.flags, self.chunks_per_seq)
                             + state_pass_tail(device, io)[2:])
        self.dummy = None if final else torch.empty((1, 1, 128, 128), dtype=torch.float32, device=device)
        self.init = init
        self.prep_ctas, self.state_ctas = ctas, state.num_tiles
        self.loaded = False   # raw: whether an eager call has launched both kernels (see the class docstring)

    def run(self, q, k, v, g32, beta, scale: float, initial_state, o, final):
        """The call: fresh terms (the caching allocator keeps them alive past the side stream's use: the caller's
        stream waits for it before anything can reuse them), phase 1 on the side stream, the state pass here."""
        dummy = final if final is not None else self.dummy
        t = allocate_terms(*self.shape, self.kda, q.dtype, self.device, self.raw, self.fold)
        if self.fold:   # KDA's fold: the state pass reads the call's v as u (phase 1's u argument: never written)
            t = PrepTerms(t.qg, t.w, v, t.kg, t.aqk, t.eg, True, False, True)
        elif self.raw:   # the state pass reads q and k themselves
            t = PrepTerms(q, t.w, t.u, k, t.aqk, t.eg, t.kda, True)
        if _POISON_PREP:   # tests: every element the state pass reads must have been written (and published)
            for x in (t.w, t.aqk, t.eg) + (() if self.fold else (t.u,)) + (() if self.raw else (t.qg, t.kg)):
                x.fill_(float("nan"))
        prep = lambda: self.prep_fn(q, k, v, g32, beta, t.qg, t.w, t.u, t.kg, t.aqk, t.eg,   # noqa: E731
                                    *self.prep_launch, scale, self.flags, self.chunks_per_seq, 2)
        state = lambda: self.state_fn(t.qg, t.w, t.u, t.kg, t.aqk, t.eg, o,   # noqa: E731
                                      initial_state if self.init else dummy, dummy, *self.state_launch)
        if self.raw and self.loaded:   # one stream: the state pass, then phase 1 as its programmatic dependent
            state()
            prep()
            return o, final
        main = torch.cuda.current_stream(self.device)
        side = _side_stream(self.device)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            prep()
        state()
        main.wait_stream(side)
        if self.raw and not torch.cuda.is_current_stream_capturing():
            self.loaded = True
        return o, final


_side_streams: dict = {}


def _side_stream(device):
    """The overlapped path's phase-1 stream of `device` (one, made once)."""
    key = str(device)
    if key not in _side_streams:
        _side_streams[key] = torch.cuda.Stream(device)
    return _side_streams[key]


# GDN's overlapped path with the raw kernels (phase 1 three CTAs per SM, see `OverlapPlan`), where GDN_RAW_QK is
# on. Correct on the H200 (tests/test_two_phase.py -k overlapped_path) but measured no faster than the gated build
# (OVERLAP_RAW_PREP_CHUNK_US), so off; CUTE_KERNELS_OVERLAP_RAW=1 turns it on.
OVERLAP_RAW = os.environ.get("CUTE_KERNELS_OVERLAP_RAW", "0") == "1"


# KDA's overlapped path with KDA_FOLD's phase 1 (`ChunkPrepSm90(publish=True, fold=True)`, row-anchored): the
# state pass is unchanged (the fold's terms run the plain KDA state pass). Why: with the fold's cheaper phase 1
# priced (KDA_FOLD_PREP_RATIO), the split plain path took KDA's B*H = 16, T >= 4096 cells from the overlapped one,
# whose phase 1 kept w and u: a wash on an H100 (session 26: 170.1 vs 161.9 us at B=1 H=16 T=4096, 562.2 vs 593.2
# at B=4 H=4 T=16384); there phase 1 on the SMs the state CTAs leave is what ends the call, so the fold's -14..-16%
# should carry over. Measured in session 27 (H100, graph replay, `scripts/time_two_phase.py overlap`): B=1 H=16
# T=4096 144.1 us against the split plain path's 173.9 (the overlapped build without the fold 163.2), T=8192 264.9 /
# 302.0 / 304.0, B=4 H=4 T=16384 525.1 / 564.8 / 599.0; GPU tests pass. CUTE_KERNELS_OVERLAP_FOLD=0 keeps w and u.
OVERLAP_FOLD = os.environ.get("CUTE_KERNELS_OVERLAP_FOLD", "1") == "1"


# The raw build with phase 1 on every SM (OVERLAP_SHARE, GDN with GDN_RAW_QK): the state pass's `share` build
# leaves room for one of phase 1's trio CTAs beside each state CTA (before, its three ring stages and 232 registers
# per thread held the whole SM -- 59 K of 64 K registers; the notes' "no gain without co-residency", session 10).
# At B*H = 32 phase 1 then has 268 CTAs instead of the raw build's 204 (the gated build's 68). "1": GDN's
# overlapped path always runs it; "auto": where its prediction beats the gated build's (phase-1-bound calls);
# "0" (default): never -- measured 16% slower than the raw build on an H100 (session 28; below).
OVERLAP_SHARE = os.environ.get("CUTE_KERNELS_OVERLAP_SHARE", "0")


def overlap_build(problem, kda: bool, sms: int) -> str:
    """Which build the overlapped path runs for `problem` (fixed length): "gated" (KDA always; phase 1 one CTA per
    SM the state pass leaves), "raw" (OVERLAP_RAW: three per SM there) or "share" (OVERLAP_SHARE: the raw build
    plus one phase-1 CTA beside each state CTA)."""
    if kda or not GDN_RAW_QK:
        return "gated"
    if OVERLAP_SHARE == "1":
        return "share"
    if OVERLAP_RAW:
        return "raw"
    if OVERLAP_SHARE == "auto":
        faster = predicted_overlap_us(problem, kda, sms, "share") < predicted_overlap_us(problem, kda, sms, "gated")
        return "share" if faster else "gated"
    return "gated"


def overlap_prep_ctas(build: str, sms: int, state_ctas: int) -> int:
    """Phase-1 CTAs of `build`'s overlapped path (before the cap at its tile count): one per SM the state pass
    leaves (gated), three (raw), and with `share` one more beside each state CTA."""
    free = max(1, sms - state_ctas)
    if build == "gated":
        return free
    return 3 * free + (state_ctas if build == "share" else 0)


def overlap_fold(kda: bool) -> bool:
    """Whether the overlapped path's phase 1 is KDA_FOLD's build (KDA, OVERLAP_FOLD and `fold_path`)."""
    return kda and OVERLAP_FOLD and fold_path(True)


def overlap_fits(B: int, H: int, sms: int) -> bool:
    """Whether the overlapped path may run: its state CTAs (two per (sequence, head)) leave at least half the SMs
    to phase 1 (below that phase 1 on the rest is slower than the two phases in turn anyway)."""
    return 0 < 2 * B * H <= sms // 2


def overlap_plan(B, T, H, kda, io, beta_dtype, init, final, device, sms) -> OverlapPlan:
    return _cached_plan(OverlapPlan, B, T, H, kda, io, beta_dtype, init, final, device, sms)


# The overlapped path measured against its first model (H200, session 13, `scripts/time_two_phase.py overlap`,
# graph replay): phase 1 on the free SMs runs ~11% over PREP_CHUNK_US (the state pass's traffic beside it), and
# the state chain slows from ~1.2-1.35 to ~1.75 (GDN) / ~1.85 (KDA) us per chunk while phase 1 runs beside it
# (B=1 H=8 T=8192, chain-bound: 231.7 / 248.3 us). With these the model is within ~4% of the 12 cells measured
# (e.g. KDA B=1 H=16 T=4096: 190.7 predicted, 190.8 measured; GDN T=2048: 70.4 vs 68.6).
# Session 19: with the state pass looking at up to 32 flags at once (`ChunkStatePassSm90(consume=True)`; one
# atomic round trip per chunk before), the chain beside phase 1 fell to ~1.45 us per chunk (KDA B=1 H=8 T=8192,
# chain-bound: 248.3 -> 196.2 us) and GDN's gated phase 1 beside it to ~8.9 us per chunk (B=1 H=16 T=4096 / 8192:
# 103.9 / 193.0 us, from 116.9 / 225.8 in the same run before the change).
OVERLAP_PREP_CHUNK_US = {False: 8.9, True: 16.8}
OVERLAP_CHAIN_CHUNK_US = {False: 1.45, True: 1.45}
# The raw build (OVERLAP_RAW): phase 1 per chunk per CTA with three CTAs per SM beside the state pass, and the
# raw state chain; estimates (PREP_TRIO_CHUNK_US and the gated chain). Measured (session 19) no faster than the
# gated build or the plain path: B=1 H=16 T=8192 204.7 us (gated 193.0, plain 188.3), B=2 H=16 T=8192 303.9
# (plain 300.1: phase 1 on the 68 SMs the 64 state CTAs leave is as long as the two phases in turn).
OVERLAP_RAW_PREP_CHUNK_US = 14.0
OVERLAP_RAW_CHAIN_CHUNK_US = 1.5
# OVERLAP_SHARE (estimates written before any run): phase 1 as the raw build's; the chain slower with a phase-1
# CTA on its own SM (two ring stages instead of three, and the SM's issue slots shared). Measured once (session
# 28, H100, GDN B=2 H=16 T=4096): 194.0 us against these estimates' 133 (the raw build 167.3), so "auto" would
# choose it wrongly today; OVERLAP_SHARE stays "0" until it is understood (NOTES, session 28).
OVERLAP_SHARE_PREP_CHUNK_US = 14.0
OVERLAP_SHARE_CHAIN_CHUNK_US = 1.8


def predicted_overlap_us(problem, kda: bool, slots: int, build: str | None = None) -> float:
    """Predicted GPU time of the overlapped path (fixed length, one segment): phase 1's one-chunk tiles on the
    SMs the state CTAs leave (one CTA per SM; the raw build three), and the state chain, which can start a chunk
    only once phase 1 has published it: max(phase 1 + the last chunk's chain step, first chunk + chain),
    per-chunk costs as measured with both running (`prep_chunk_us(overlapped=True)`, OVERLAP_CHAIN_CHUNK_US; the
    raw build's OVERLAP_RAW_*, the shared build's OVERLAP_SHARE_*). `build`: the one `overlap_build` picks."""
    from schedulers.heuristics import makespan

    H = problem.num_heads
    build = overlap_build(problem, kda, slots) if build is None else build
    free = overlap_prep_ctas(build, slots, 2 * problem.num_seqs * H)
    if build == "share":
        prep_us, chunk_us = OVERLAP_SHARE_PREP_CHUNK_US, OVERLAP_SHARE_CHAIN_CHUNK_US
    elif build == "raw":
        prep_us, chunk_us = OVERLAP_RAW_PREP_CHUNK_US, OVERLAP_RAW_CHAIN_CHUNK_US
    else:
        prep_us, chunk_us = prep_chunk_us(kda, overlapped=True), OVERLAP_CHAIN_CHUNK_US[kda]
    t_prep = makespan([1] * (sum(problem.chunks) * H), free) * prep_us
    t_chain = max(problem.chunks) * chunk_us
    return max(t_prep + chunk_us, prep_us + t_chain) + 2 * LAUNCH_US


def state_pass_torch(prep: PrepTerms, initial_state=None):
    """Phase 2's contract in torch (fp32, chunk by chunk), for CPU tests of phase 1 and of the kernel's math (also
    of GDN_FOLD's terms: eg = exp(G) on every row)."""
    prep = prep.gated()
    B, T, H, K = prep.w.shape
    V = prep.u.shape[-1]
    S = (initial_state.float().clone() if initial_state is not None
         else torch.zeros(B, H, K, V, dtype=torch.float32, device=prep.w.device))
    o = torch.empty(B, T, H, V, dtype=torch.float32, device=prep.w.device)
    f = lambda x, t0, t1: x[:, t0:t1].float().transpose(1, 2)   # noqa: E731  [B, H, L, D]
    for t0 in range(0, T, C):
        t1 = min(t0 + C, T)
        L = t1 - t0
        w, u, qg, kg = f(prep.w, t0, t1), f(prep.u, t0, t1), f(prep.qg, t0, t1), f(prep.kg, t0, t1)
        aqk = f(prep.aqk, t0, t1)[..., :L]
        if prep.fold and not prep.kda:   # w = k, u = v, kg = W2, aqk = A1: R = v - diag(exp(G)) k S for v_new
            v_new = u - prep.eg[:, t0:t1].float().transpose(1, 2)[..., None] * (w @ S)
        else:
            v_new = u - w @ S
        o[:, t0:t1] = (qg @ S + aqk @ v_new).transpose(1, 2)
        decay = prep.eg[:, t1 - 1].float()   # [B, H] or [B, H, K]
        S = (decay[..., None] if prep.kda else decay[..., None, None]) * S + kg.transpose(-1, -2) @ v_new
    return o, S


def chunk_gated_delta_rule_two_phase(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                                     *, kda: bool = False, num_segments: int = 1, torch_prep: bool = False):
    """GDN (or KDA with `kda=True`) forward through the two phases (experimental). Fixed-length [B, T, H, 128]
    inputs, SM90; `num_segments` splits the state pass along T; `torch_prep=True` runs phase 1 in torch instead
    of `ChunkPrepSm90`."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, x, dtypes=(torch.bfloat16, torch.float16), ndim=4)
    prep = (chunk_prep_torch if torch_prep else chunk_prep)(q, k, v, g, beta, scale, kda=kda)
    return state_pass(prep, initial_state, output_final_state, num_segments=num_segments)


# ------------------------------------------------------------------ choosing the segment count

# Measured on the H200 (scripts/time_two_phase.py, 2026-12-02; GPU time from CUDA-graph replay): phase 1's time
# per chunk per CTA (GDN 9.4, KDA 16.8 us: 299 / 534 us for 2048 two-chunk tiles at B=2 H=16 T=8192, 16 waves)
# and the state pass's per chunk per CTA (1.6-2.2 us, 1.8 fits the 32 unsplit and segmented timings within ~10%).
# KDA re-measured with the vectorized solve (2026-12-03, session 10): 481 us for the same tiles -> 15.1.
PREP_CHUNK_US = {False: 9.4, True: 15.1}
# KDA's row-anchored phase 1 (the default, KDA_ROW_ANCHORS; session 14, `prep-profile`, same tiles as above): 375.0
# us against 485.6 for the column form (0.77x; 388.1 before the next chunk's g prefetch moved under the band
# products) -> 15.1 x 0.77 = 11.7; beside the state pass (the overlapped path) the same ratio is assumed:
# 16.8 -> 13.0. Checked at large B x H (`time_two_phase.py paths`, KDA T=4096): B=4 H=16 two-phase 493 us vs
# fused 954, B=8 H=16 954 vs 952, B=16 H=64 7445 vs 7516 (the model: 7257 vs 7731).
# With the terms stored by TMA (PREP_TMA_OUT, session 15): 364.3 us for the same tiles -> 11.3 (11.7 without).
PREP_CHUNK_US_ROWS = 11.3 if PREP_TMA_OUT else 11.7
OVERLAP_PREP_CHUNK_US_ROWS = 13.0
# KDA_FOLD's phase 1 (no v load, no u product): 318.4 against 378.9 us for the same tiles (an H100, session 25, both
# in one run) -> x 0.84. The overlapped path's phase 1 (`publish`) keeps w and u unless OVERLAP_FOLD (then the
# same ratio is assumed beside the state pass).
KDA_FOLD_PREP_RATIO = 0.84


def prep_chunk_us(kda: bool, overlapped: bool = False) -> float:
    """Phase 1's time per chunk per CTA (one CTA per SM) for the cost models, by the build the switches select."""
    if kda and KDA_ROW_ANCHORS:
        if overlapped:
            return OVERLAP_PREP_CHUNK_US_ROWS * (KDA_FOLD_PREP_RATIO if overlap_fold(True) else 1.0)
        return PREP_CHUNK_US_ROWS * (KDA_FOLD_PREP_RATIO if fold_path(True) else 1.0)
    return (OVERLAP_PREP_CHUNK_US if overlapped else PREP_CHUNK_US)[kda]

# GDN's slim phase 1, per chunk per CTA with two CTAs on each SM: 13.96 us measured at B=2 H=16 T=8192 (225 us
# against 299 us with one CTA per SM, 2026-12-03; 1.33x per SM; the predicted 12.5 / 1.5x was optimistic).
# With the vectorized solve (session 10): 176.6 us for the same tiles -> 11.0 (the solve went from ~10.5k to ~5.4k
# of the ~21.8k cycles per chunk, `scripts/time_two_phase.py prep-profile`).
# CUTE_KERNELS_PREP_SLIM_CHUNK_US overrides it, e.g. with the fit `scripts/time_two_phase.py prep` writes.
PREP_SLIM_CHUNK_US = float(os.environ.get("CUTE_KERNELS_PREP_SLIM_CHUNK_US", "11.0"))
# Without the qg / kg stores (GDN_RAW_QK, session 17, `scripts/time_two_phase.py raw`): 154.2 us against 179.5 for the
# same tiles -> 11.0 x 154.2 / 176.6 = 9.6; the state pass then runs ~4% longer per chunk (its two column scalings:
# B=2 H=16 T=8192 179.8 vs 172.7 us) -> STATE_RAW_CHUNK_US.
PREP_SLIM_RAW_CHUNK_US = 9.6
STATE_RAW_CHUNK_US = 1.2
# PREP_TRIO's, per chunk per CTA with three CTAs on each SM: 12.85 measured at B=2 H=16 T=8192 and B=8 H=8 T=4096
# (session 18; the slim build 9.77 in the same run); the model took 14.0, which kept large grids on the fused path
# where the two measured within ~3%. With the tf32 solve (session 19, phase 1 -7.7%) and STATE_TILE_US, 12.9 puts
# the model within ~2% of the two-phase times measured at B*H = 128-2048, T = 1024-16384 (session 20, `paths`),
# and "auto" then takes two-phase where it measured 3.5-10% faster (B=16 H=64 T=4096 3434 vs fused 3698 us,
# B=4 H=64 T=16384 3416 vs 3808, B=32 H=32 T=4096 3407 vs 3551, B=8 H=32 T=4096 872 vs 904, B=8 H=16 T=16384
# 1703 vs 1772); cells within ~2% stay fused (B=8 H=16 T=4096 446 vs 463, T = 1024 rows).
PREP_TRIO_CHUNK_US = 12.9


def prep_slim_chunk_us(per_sm: int = 2) -> float:
    """GDN's slim phase 1 per chunk per CTA for the cost models, by GDN_RAW_QK's build (`per_sm` 3: PREP_TRIO's)
    or the gated one."""
    if per_sm == 3:
        return PREP_TRIO_CHUNK_US
    return PREP_SLIM_RAW_CHUNK_US if raw_qk_path(False) else PREP_SLIM_CHUNK_US
# The rs state pass per chunk per CTA with exp(G_last) in the ring (session 9, unsplit B=1 H=4 and B=2 H=16
# T=8192: GDN 1.06-1.19, KDA 1.13-1.22; before it GDN 1.36-1.47, KDA 1.68-1.74); the smem variant's were 1.8.
STATE_CHUNK_US = ({False: 1.15, True: 1.2} if STATE_RING_DECAY else {False: 1.45, True: 1.72}) if STATE_PASS_RS \
    else {False: 1.8, True: 1.8}
# `pair` (two chains per CTA sharing the ring), per chunk per chain: measured 1.96-2.04 (GDN), 2.03-2.16 (KDA)
# unsplit at B=1 H=4 .. B=4 H=16 (H200, 2026-12-03).
STATE_PAIR_CHUNK_US = {False: 2.0, True: 2.1}
LAUNCH_US = 2.0
# A state-pass tile's fixed cost (its first loads, the final state store) where the output tiles take more than one
# wave: fitted to `scripts/time_two_phase.py paths` (H200, session 20, GDN, fused and two-phase forced): without it
# the model ran 7% under the measured two-phase time at T = 1024 (B=16..32, H=32..64: 16 chunks per tile) and 20%
# at T = 256 (B=32 H=64), 1-3% at T >= 4096; 3.5 us per tile fits those thirteen cells within ~2%. Left out in
# one wave (the per-chunk costs were fitted there) and for sequences of fewer than 4 chunks: at T = 64 / 128 the
# two-phase path measured faster than fused (B=8 H=32 T=64 33 vs 36 us, B=8 H=16 T=128 28 vs 32), which the
# charge would have reversed; at T = 256 it holds (B=8 H=16: 45 vs 41, now fused). KDA: none (its model matched
# the same measurements without it, within 2%, and its short-T choices were measured as they are).
STATE_TILE_US = {False: 3.5, True: 0.0}
STATE_TILE_MIN_CHUNKS = 4
# KDA's split state pass measured above the model by ~1-1.5 us per extra segment (H200, session 12, seed rows
# B*H <= 8 with the regs merge: +3 us at N = 4, +11-15 us at N = 8-9; GDN within ~4 us at N = 8-9): with the
# cheaper merge link the model split KDA calls where fewer segments measured faster (B=1 H=8 T=1024: N = 4 45.9 us
# vs N = 1 41.2; B=1 H=4 T=2048: N = 8 54.1 vs N = 4 51.2 with the slower prefetch merge). Not explained yet (the
# summary tiles' per-channel decays?); charged per extra segment so the choice follows the measurements.
SEGMENT_US = {False: 0.0, True: 1.5}


def predicted_us(problem, counts, kda: bool, init: bool, slots: int, link_us: float,
                 chunks_per_tile: int | None = None):
    """Predicted GPU time of the two-phase forward with `counts` segments per sequence (`problem`: one block).

    Phase 1: tiles of `chunks_per_tile` chunks per (sequence, head) (None: as `prep_tile_counts` picks without
    PREP_BALANCE, whose measured gain is far below its makespan's; see there).
    Phase 2: output tiles per (sequence, segment, head, 64 V columns); if split, summary tiles (2 h_ext blocks per segment but the last, plus 2 M blocks except
    the first segment's without an initial state), N - 1 merge links (and SEGMENT_US each) and two more launches.
    """
    from schedulers.heuristics import makespan

    H = problem.num_heads
    tile_counts = prep_tile_counts(problem, kda, slots, chunks_per_tile, balance=False)
    prep = [n for c, k in zip(problem.chunks, tile_counts) for _ in range(H) for n in _split_sizes(c, k)]
    per_sm = prep_occupancy(kda, len(prep), slots)
    t = makespan(prep, slots * per_sm) * (prep_slim_chunk_us(per_sm) if per_sm > 1 else prep_chunk_us(kda)) + LAUNCH_US
    lens = [_split_sizes(c, max(1, min(n, c))) for c, n in zip(problem.chunks, counts)]
    pair = state_pair(sum(len(ls) for ls in lens) * 2 * H, slots)
    per = 1 if pair else 2   # tiles per (segment, head): V / 128 or V / 64 columns each
    chunk_us = (STATE_PAIR_CHUNK_US if per == 1 else STATE_CHUNK_US)[kda]
    if per == 2 and raw_qk_path(kda):
        chunk_us = STATE_RAW_CHUNK_US
    tile = STATE_TILE_US[kda] / chunk_us if sum(len(ls) for ls in lens) * per * H > slots else 0.0
    outputs = [n + (tile if c >= STATE_TILE_MIN_CHUNKS else 0.0)
               for c, ls in zip(problem.chunks, lens) for n in ls for _ in range(per * H)]
    t += makespan(outputs, slots) * chunk_us
    if all(len(ls) <= 1 for ls in lens):
        return t
    if STATE_ONE_PASS:
        return t - makespan(outputs, slots) * chunk_us + one_pass_state_us(problem, lens, kda, init, slots, link_us)
    summary = [n for ls in lens for s, n in enumerate(ls[:-1]) for _ in range(H * per * (2 if (s or init) else 1))]
    t += makespan(summary, slots) * chunk_us
    return t + (max(len(ls) for ls in lens) - 1) * (link_us + SEGMENT_US[kda]) + 2 * LAUNCH_US


# STATE_ONE_PASS's correction launch: its assumed rate through memory (qm and o read, o written: 768 bytes per token
# and head). An estimate (not measured yet): ~70% of the 4.2 TB/s copy rate.
CORRECTION_BYTES_PER_US = 3.0e6


def one_pass_state_us(problem, lens, kda: bool, init: bool, slots: int, link_us: float) -> float:
    """Predicted GPU time of the one-pass segmented state pass (`lens`: each sequence's segment lengths in
    chunks): the summary launch with outputs (2 h_ext + 2 M tiles per (segment, head), the first segment's M
    tiles only with an initial state; each chunk at the output chain's cost), the merge (every segment is a
    link: the final state too) and the correction (memory-bound over the corrected segments' tokens).
    STATE_EARLY_CORRECTION: the correction starts after the first link and runs under the chain, so it ends at
    the later of (the chain, then the last segments' share) and (one link, then all of it)."""
    from schedulers.heuristics import makespan

    H = problem.num_heads
    chunk_us = STATE_RAW_CHUNK_US if raw_qk_path(kda) else STATE_CHUNK_US[kda]
    summary = [n for ls in lens for s, n in enumerate(ls) for _ in range(H * (4 if (s or init) else 2))]
    t = makespan(summary, slots) * chunk_us + LAUNCH_US
    link = link_us + SEGMENT_US[kda]
    chain = max(len(ls) for ls in lens) * link
    us_per_chunk = problem.chunk_size * H * 768 / CORRECTION_BYTES_PER_US   # one chunk of every head
    corr = sum(n for ls in lens for s, n in enumerate(ls) if s or init) * us_per_chunk
    if STATE_EARLY_CORRECTION:
        last = sum(ls[-1] for ls in lens if len(ls) > 1 or init) * us_per_chunk
        return t + max(chain + last, link + corr) + LAUNCH_US
    return t + chain + LAUNCH_US + corr + LAUNCH_US


def plan_num_segments(problem, kda: bool, init: bool, slots: int, link_us: float, min_chunks: int = 2) -> int:
    """The segment count (the same for every sequence, capped by each one's chunks) that `predicted_us` likes
    best; ties go to fewer segments."""
    cap = max(1, max(problem.chunks, default=1) // min_chunks)
    best, best_t = 1, predicted_us(problem, [1] * problem.num_seqs, kda, init, slots, link_us)
    for n in range(2, cap + 1):
        t = predicted_us(problem, [n] * problem.num_seqs, kda, init, slots, link_us)
        if t < best_t * 0.999:
            best, best_t = n, t
    return best
