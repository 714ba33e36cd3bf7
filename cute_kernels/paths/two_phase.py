"""The two-phase forward: phase 1 (`ChunkPrepSm90`, every chunk's local terms in parallel) and phase 2
(`ChunkStatePassSm90`, the state recurrence, one CTA per (sequence, head, 64 V columns, segment)), plus the overlapped
path running both at once (docs/design.md, "The paths"). Runners are built once per configuration, then only allocate
and launch. `chunk_prep_torch` and `state_pass_torch`: the two phases in torch, the terms' spec (CPU tests).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from schedulers import Problem, Schedule, Segmentation, schedule_from_segmentation, split_even, summary_schedule

from ..checks import check_cuda, check_shape, check_tensor, offsets_tensor
from ..kernels.build import build_prep, build_state_pass
from ..kernels.configs import GateForm, PrepConfig, StateConfig
from ..plan.cost import overlap_fits, overlap_prep_ctas
from . import plain_gate
from .merge import MergeStarts

C = 64


@dataclass
class ChunkTerms:
    """Phase 1's output as the state pass reads it ([B, T, H, D], 16-bit unless noted). Per chunk, with S the
    state at its start and L its last row:

        v_new = value - key S                 o = query S + intra v_new       S' = diag(decay_L) S + update_key^T v_new

    Solved terms: query = qg = scale exp(G) q, key = w = T exp(G) k, value = u = T v, update_key = kg =
    exp(G_L - G) k, intra = Aqk, decay = exp(G) (fp32: [B, T, H] GDN, [B, T, H, K] KDA), with G the cumulative
    log decay inside the chunk and T = (I + Akk)^-1 diag(beta).
    Folded terms (`folded`: T folded into the products that read v_new = T R, R = v - exp(G) k S): update_key =
    W2 = T^T kg, intra = A1 = Aqk T, value = the call's v, and key = exp(G) k -- per channel for KDA (its state
    pass then runs unchanged, R standing in for v_new); for GDN key = k with v_new = value - diag(exp(G)) key S.
    `token_factors` (GDN's folded terms as phase 1 writes them): query, key, value are the call's q, k, v and
    decay is [B, T, H, 4] fp32 per-token factors (scale 2^G, 2^(G_L - G), 2^G_L, 2^G); `gated()` gives the
    folded terms with query = scale exp(G) q and decay = exp(G), for comparisons with the torch spec.
    """

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    update_key: torch.Tensor
    intra: torch.Tensor
    decay: torch.Tensor
    kda: bool
    folded: bool = False
    token_factors: bool = False

    def gated(self) -> ChunkTerms:
        """These terms with query gated and rounded to its dtype and decay = exp(G) per row: `self` unless
        `token_factors`."""
        if not self.token_factors:
            return self
        f = self.decay.float()
        query = (self.query.float() * f[..., 0:1]).to(self.query.dtype)
        return replace(self, query=query, decay=f[..., 3].contiguous(), token_factors=False)

    @property
    def tensors(self) -> tuple:
        return self.query, self.key, self.value, self.update_key, self.intra, self.decay


def chunk_prep_torch(q, k, v, g, beta, scale=None, *, kda: bool, folded: bool = False,
                     chunks_per_step: int = 32) -> ChunkTerms:
    """Phase 1 in torch, fp32 (fixed-length [B, T, H, D] inputs, K = 128): the solved terms, or with `folded`
    the folded ones (gated: GDN's query = scale exp(G) q, decay = exp(G)). Chunks are processed
    `chunks_per_step` (x B x H) at a time to bound the [64, 64, K] pairwise decays of KDA."""
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
    names = ("query", "key", "value", "update_key", "intra", "decay")
    out = {name: [] for name in names}
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
        parts = {"query": scale * t.eG * qs, "key": t.w, "value": t.u, "update_key": t.kg, "intra": aqk,
                 "decay": t.eG if kda else t.eG[..., 0]}
        if folded:   # KDA: exp(G) k (per channel: no row factor can stand in for it)
            parts.update(key=t.eG * ks if kda else ks, value=vs, update_key=t.T.transpose(-1, -2) @ t.kg,
                         intra=aqk @ t.T)
        for name, x in parts.items():
            out[name].append(x.reshape(B, n, *x.shape[1:]))

    def tokens(x, dtype):   # [B, nc, H, C, ...] -> [B, T, H, ...]
        x = torch.cat(x, dim=1).movedim(3, 2)
        x = x.reshape(B, nc * C, *x.shape[3:])[:, :T]
        return x.to(dtype).contiguous()

    io = q.dtype
    return ChunkTerms(*(tokens(out[name], io) for name in names[:5]), tokens(out["decay"], torch.float32), kda,
                      folded=folded)


def state_pass_torch(terms: ChunkTerms, initial_state=None):
    """Phase 2's contract in torch (fp32, chunk by chunk): (o [B, T, H, V] fp32, final state)."""
    terms = terms.gated()
    B, T, H, K = terms.key.shape
    V = terms.value.shape[-1]
    S = (initial_state.float().clone() if initial_state is not None
         else torch.zeros(B, H, K, V, dtype=torch.float32, device=terms.key.device))
    o = torch.empty(B, T, H, V, dtype=torch.float32, device=terms.key.device)
    f = lambda x, t0, t1: x[:, t0:t1].float().transpose(1, 2)   # noqa: E731  [B, H, L, D]
    for t0 in range(0, T, C):
        t1 = min(t0 + C, T)
        L = t1 - t0
        key, value, query, update_key = (f(x, t0, t1) for x in (terms.key, terms.value, terms.query,
                                                                  terms.update_key))
        intra = f(terms.intra, t0, t1)[..., :L]
        if terms.folded and not terms.kda:   # GDN: R = v - diag(exp(G)) k S stands in for v_new
            v_new = value - terms.decay[:, t0:t1].float().transpose(1, 2)[..., None] * (key @ S)
        else:
            v_new = value - key @ S
        o[:, t0:t1] = (query @ S + intra @ v_new).transpose(1, 2)
        decay = terms.decay[:, t1 - 1].float()   # [B, H] or [B, H, K]
        S = (decay[..., None] if terms.kda else decay[..., None, None]) * S + update_key.transpose(-1, -2) @ v_new
    return o, S


def problem_of(B, T, H, cu, num_blocks: int = 1) -> Problem:
    """The schedulers' Problem of a [B, T, H, ..] batch, or of packed sequences (`cu`: a tuple of offsets, B = 1)."""
    if cu is None:
        return Problem.fixed(B, T, H, num_blocks=num_blocks)
    return Problem.varlen(list(cu), H, num_blocks=num_blocks)


def prep_config(kda: bool, ctas_per_sm: int, group: int = 1, gate: GateForm = GateForm()) -> PrepConfig:
    """The plain path's phase 1: KDA's folded build, GDN's folded build at 2 or 3 CTAs per SM."""
    return PrepConfig(kda=kda, terms="folded", ctas_per_sm=1 if kda else ctas_per_sm, group=group, gate=gate)


def allocate_terms(B, T, H, kda: bool, dtype, device, folded: bool = True, q=None, k=None, v=None) -> ChunkTerms:
    """Fresh (uninitialized) phase-1 outputs of a [B, T, H, 128] call; the slots phase 1 does not write hold the
    call's tensors (folded KDA: v; folded GDN: q, k, v), or None until the call supplies them."""
    intra = torch.empty((B, T, H, C), dtype=dtype, device=device)
    if folded and kda:   # query, key (exp(G) k), update_key (W2); value is the call's v
        query, key, w2 = torch.empty((3, B, T, H, 128), dtype=dtype, device=device).unbind(0)
        decay = torch.empty((B, T, H, 128), dtype=torch.float32, device=device)
        return ChunkTerms(query, key, v, w2, intra, decay, kda, folded=True)
    if folded:           # update_key (W2) and the per-token factors; query, key, value are the call's
        w2 = torch.empty((B, T, H, 128), dtype=dtype, device=device)
        decay = torch.empty((B, T, H, 4), dtype=torch.float32, device=device)
        return ChunkTerms(q, k, v, w2, intra, decay, kda, folded=True, token_factors=True)
    wide = torch.empty((4, B, T, H, 128), dtype=dtype, device=device)   # query, key, value, update_key
    decay = torch.empty((B, T, H, 128) if kda else (B, T, H), dtype=torch.float32, device=device)
    return ChunkTerms(*wide.unbind(0), intra, decay, kda)


# Phase 1's outputs of calls up to WORKSPACE_TERM_BYTES are kept between calls (per runner and stream; a stream's
# calls run in order, so its next call may reuse them), at most WORKSPACE_TOTAL_BYTES in all.
WORKSPACE_TERM_BYTES = 16 << 20
WORKSPACE_TOTAL_BYTES = 256 << 20
_workspaces: dict = {}
_workspace_bytes = 0


def workspace_stream(device):
    """The current stream's handle where a kept workspace may serve the call (a CUDA device, no graph capture;
    a capture allocates from the graph's own pool)."""
    if device.type != "cuda" or torch.cuda.is_current_stream_capturing():
        return None
    return torch.cuda.current_stream(device).cuda_stream


class PrepRun:
    """Phase 1 of one configuration: the compiled kernel and its tile table (`tile_counts` near-equal chunk ranges
    per sequence and head). `run` fills terms and launches, unchecked: the caller has validated its inputs."""

    poison = False   # tests: outputs start as NaN (every element the state pass reads must be written)

    def __init__(self, config: PrepConfig, B, T, H, cu, io, beta_dtype, device, tile_counts):
        problem = problem_of(B, T, H, cu)
        seg = Segmentation([split_even(c, n) for c, n in zip(problem.chunks, tile_counts)])
        schedule = schedule_from_segmentation(problem, seg, "prep")
        self.config, self.shape, self.device, self.tile_counts = config, (B, T, H), device, list(tile_counts)
        self.fn = build_prep(config, io, beta_dtype).fn if T else None
        self.launch = (schedule.table_on(device), schedule.num_tiles, schedule.grid[0])
        self.no_flags = (torch.zeros(1, dtype=torch.int32, device=device), 0, 0)
        wide, decay_floats = (3, 128) if config.kda else (1, 4)
        self.term_bytes = B * T * H * (wide * 128 * io.itemsize + C * io.itemsize + decay_floats * 4)

    def allocate(self, dtype, q, k, v) -> ChunkTerms:
        return allocate_terms(*self.shape, self.config.kda, dtype, self.device, True, q, k, v)

    def terms(self, dtype, q, k, v) -> ChunkTerms:
        """The call's outputs: small ones (host-bound calls) from a workspace kept per (runner, stream), large
        ones and any under CUDA-graph capture allocated per call."""
        stream = workspace_stream(self.device) if self.term_bytes <= WORKSPACE_TERM_BYTES else None
        if stream is None:
            return self.allocate(dtype, q, k, v)
        key = (self, dtype, stream)   # the runner itself: a kept entry keeps its runner alive
        hit = _workspaces.get(key)
        if hit is None:
            global _workspace_bytes
            if _workspace_bytes + self.term_bytes > WORKSPACE_TOTAL_BYTES:
                _workspaces.clear()
                _workspace_bytes = 0
            hit = _workspaces[key] = self.allocate(dtype, None, None, None)
            _workspace_bytes += self.term_bytes
        # the slots phase 1 does not write are the call's tensors (a plain constructor: this runs every call)
        if self.config.kda:
            return ChunkTerms(hit.query, hit.key, v, hit.update_key, hit.intra, hit.decay, True, True)
        return ChunkTerms(q, k, v, hit.update_key, hit.intra, hit.decay, False, True, True)

    def run(self, q, k, v, g32, beta, scale: float, gate, reuse: bool = False) -> ChunkTerms:
        t = self.terms(q.dtype, q, k, v) if reuse else self.allocate(q.dtype, q, k, v)
        if self.poison:
            for x in ((t.intra, t.decay, t.update_key) + ((t.query, t.key) if self.config.kda else ())):
                x.fill_(float("nan"))
        if self.fn is not None:
            self.fn(q, k, v, g32, beta, *gate, *t.tensors, *self.launch, scale, *self.no_flags)
        return t


class StateRun:
    """Phase 2 of one configuration (segment counts, initial / final state or not): the compiled kernels (forward,
    or summary + merge + segment outputs) and their tile tables. `run` launches them, unchecked."""

    poison = False   # tests: the summary buffer starts as NaN (an unwritten slot that is read shows)

    def __init__(self, kda: bool, token_factors: bool, B, T, H, cu, io, init: bool, final: bool, num_segments,
                 merge_impl: str, device, pdl: bool = True, group: int = 1):
        problem = problem_of(B, T, H, cu, num_blocks=2)
        counts = num_segments if isinstance(num_segments, tuple) else (num_segments,) * problem.num_seqs
        if len(counts) != problem.num_seqs:
            raise ValueError(f"num_segments has {len(counts)} counts for {problem.num_seqs} sequences")
        seg = Segmentation([split_even(c, max(1, min(n, c))) for c, n in zip(problem.chunks, counts)])
        schedule = schedule_from_segmentation(problem, seg, "state-pass")
        self.split = seg.total_segments > problem.num_seqs
        self.init, self.device, self.num_heads = init, device, H
        no_flags = torch.zeros(1, dtype=torch.int32, device=device)
        self.launch = (schedule.table_on(device), schedule.num_tiles, schedule.grid[0], no_flags, 0)
        # an fp32 [1, 1, K, V] stand-in for a state the kernel neither reads nor writes (made here, not per call)
        self.dummy = None if final else torch.empty((1, 1, 128, 128), dtype=torch.float32, device=device)
        cfg = StateConfig(kda, "forward", init, final, token_factors, pdl=pdl, group=group)
        if not self.split:
            self.fn = build_state_pass(cfg, io).fn
            return
        self.slots = seg.total_segments
        offsets, n = offsets_tensor("seg_offsets", seg.seg_offsets, self.slots, device)
        self.merge = MergeStarts(merge_impl, n, H, self.slots, offsets, init, device, pdl)
        summ = summary_schedule(problem_of(B, T, H, cu, num_blocks=4), seg, first_m=init, h_blocks=2)
        self.summary_fn = (build_state_pass(replace(cfg, mode="summary", initial_state=False, final_state=False),
                                            io).fn if summ.num_tiles else None)
        self.summary_launch = (summ.table_on(device), summ.num_tiles, summ.grid[0], no_flags, 0)
        self.fn = build_state_pass(replace(cfg, mode="segment_outputs", initial_state=True), io).fn

    def run(self, terms: ChunkTerms, initial_state, o, final):
        dummy = final if final is not None else self.dummy
        if not self.split:
            self.fn(*terms.tensors, o, initial_state if self.init else dummy, dummy, *self.launch)
            return o, final
        summary = torch.empty((2 * self.slots, self.num_heads, 128, 128), dtype=torch.float32, device=self.device)
        if self.poison:
            summary.fill_(float("nan"))
        if self.summary_fn is not None:
            # o stands in for the summary build's o (never written there; the output launch writes all of it)
            self.summary_fn(*terms.tensors, o, summary, summary, *self.summary_launch)
        starts = self.merge.run(summary[self.slots:], summary[:self.slots], initial_state)
        self.fn(*terms.tensors, o, starts, dummy, *self.launch)
        return o, final


class OverlapRun:
    """The overlapped two-phase forward (fixed-length batches, one segment per sequence): phase 1
    (`PrepConfig(publish=True)`: persistent, one chunk per tile, chunk-major, on the SMs the state pass leaves) and
    the state pass (`StateConfig(consume=True)`) run at once, the state pass taking each chunk as phase 1 publishes
    it. Phase 1 runs on a side stream that waits for the caller's work; the caller's stream waits for it at the end.
    Terms: GDN's solved, KDA's folded.

    Flags: int32 per (sequence, chunk, head), 0 between calls (each of a head's V / 64 state CTAs takes one count
    back); each stream has its own set, a CUDA-graph capture its own zeroed one, so two streams never share flags.
    Deadlock freedom (docs/design.md) needs phase 1 to find SMs: the state grid stays within half of them
    (`overlap_fits`), phase 1 never waits on the state pass, and the op does not start an overlapped call while
    another may still run on a different stream.
    """

    poison = False   # tests: phase 1's outputs start as NaN

    def __init__(self, B, T, H, kda, io, beta_dtype, init, final, device, sms, group: int = 1,
                 gate: GateForm = GateForm()):
        if not overlap_fits(B, H, sms):
            raise ValueError(f"overlapped path: {2 * B * H} state CTAs need at most half of the {sms} SMs")
        self.shape, self.kda, self.device = (B, T, H), kda, device
        problem = problem_of(B, T, H, None)
        self.chunks_per_seq = problem.chunks[0]
        state = schedule_from_segmentation(problem_of(B, T, H, None, num_blocks=2),
                                           Segmentation([split_even(c, 1) for c in problem.chunks]), "state-pass")
        prep_seg = Segmentation([split_even(c, c) for c in problem.chunks])   # one chunk per tile
        tiles = schedule_from_segmentation(problem, prep_seg, "prep").tiles
        tiles = sorted(tiles, key=lambda t: (t.chunk_start, t.seq, t.head))   # chunk-major
        ctas = max(1, min(len(tiles), overlap_prep_ctas(sms, state.num_tiles)))
        prep = Schedule(tiles, (ctas, 1, 1), True, prep_seg, "prep-overlap")
        self.prep_config = PrepConfig(kda=kda, terms="folded" if kda else "solved", ctas_per_sm=1, publish=True,
                                      group=group, gate=gate)
        self.prep_fn = build_prep(self.prep_config, io, beta_dtype).fn
        self.state_fn = build_state_pass(StateConfig(kda, "forward", init, final, consume=True), io).fn
        self.prep_launch = (prep.table_on(device), prep.num_tiles, ctas)
        self.state_launch = (state.table_on(device), state.num_tiles, state.grid[0])
        self.dummy = None if final else torch.empty((1, 1, 128, 128), dtype=torch.float32, device=device)
        self.init = init
        self.prep_ctas, self.state_ctas = ctas, state.num_tiles
        self.flag_count = B * self.chunks_per_seq * H
        self.flags_by_stream: dict = {}

    def flags(self):
        """This call's flags: the stream's own set (zero between its calls), or under capture a zeroed set that
        belongs to the graph."""
        if torch.cuda.is_current_stream_capturing():
            return torch.zeros(self.flag_count, dtype=torch.int32, device=self.device)
        stream = torch.cuda.current_stream(self.device).cuda_stream
        hit = self.flags_by_stream.get(stream)
        if hit is None:
            hit = self.flags_by_stream[stream] = torch.zeros(self.flag_count, dtype=torch.int32, device=self.device)
        return hit

    def run(self, q, k, v, g32, beta, scale: float, initial_state, o, final, gate):
        """The call: fresh terms (the caching allocator keeps them alive past the side stream's use: the caller's
        stream waits for it before anything can reuse them), phase 1 on the side stream, the state pass here."""
        dummy = final if final is not None else self.dummy
        t = allocate_terms(*self.shape, self.kda, q.dtype, self.device, self.kda, q, k, v)
        if self.poison:
            for x in (t.key, t.intra, t.decay, t.query, t.update_key) + (() if self.kda else (t.value,)):
                x.fill_(float("nan"))
        flags = self.flags()
        main = torch.cuda.current_stream(self.device)
        side = side_stream(self.device)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            self.prep_fn(q, k, v, g32, beta, *gate, *t.tensors, *self.prep_launch, scale, flags, self.chunks_per_seq,
                         2)
        self.state_fn(*t.tensors, o, initial_state if self.init else dummy, dummy, *self.state_launch, flags,
                      self.chunks_per_seq)
        main.wait_stream(side)
        if not torch.cuda.is_current_stream_capturing():
            event = torch.cuda.Event()
            event.record(main)
            _last_overlap[str(self.device)] = (main.cuda_stream, event)
        return o, final


_side_streams: dict = {}
_last_overlap: dict = {}   # device -> (stream, event after its last overlapped call)


def overlap_free(device) -> bool:
    """Whether an overlapped call may start on the current stream: no overlapped call issued on another stream
    may still be running (two at once could fill every SM with spinning state CTAs and leave phase 1 none). Under
    CUDA-graph capture the graph's replays are the caller's to order (docs/design.md)."""
    if torch.cuda.is_current_stream_capturing():
        return True
    last = _last_overlap.get(str(device))
    return last is None or last[0] == torch.cuda.current_stream(device).cuda_stream or last[1].query()


def side_stream(device):
    """The overlapped path's phase-1 stream of `device` (one, made once)."""
    key = str(device)
    if key not in _side_streams:
        _side_streams[key] = torch.cuda.Stream(device)
    return _side_streams[key]


# ------------------------------------------------------------------ the phases on their own (kernel tests, tools)


def chunk_prep(q, k, v, g, beta, scale=None, *, kda: bool, chunks_per_tile: int | None = None, sms: int = 132,
               cu_seqlens=None) -> ChunkTerms:
    """Phase 1 on the GPU as the plain path runs it (the folded build, `plan.cost`'s tiles and CTAs per SM for a
    device of `sms` SMs, or `chunks_per_tile` chunks per tile): fresh terms. [B, T, H, 128] inputs, or packed
    sequences ([1, T, ...] with `cu_seqlens`)."""
    from ..plan.cost import prep_ctas_per_sm, prep_tile_counts

    B, T, H, K = k.shape
    if K != 128 or v.shape[-1] != 128 or q.shape != k.shape:
        raise ValueError(f"chunk_prep: q, k, v [B, T, H, 128], got q {tuple(q.shape)}, k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)}")
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        check_tensor(name, x, ndim=x.dim())   # contiguous: the kernels flatten [B, T] themselves
    device = check_cuda(q=q, k=k, v=v, g=g, beta=beta)
    cu = cu_tuple(cu_seqlens, B, T)
    problem = problem_of(B, T, H, cu)
    counts = prep_tile_counts(problem, kda, sms, chunks_per_tile)
    per_sm = prep_ctas_per_sm(kda, sum(counts) * H, sms)
    run = PrepRun(prep_config(kda, per_sm), B, T, H, cu, q.dtype, beta.dtype, device, counts)
    return run.run(q, k, v, g.float(), beta, K ** -0.5 if scale is None else float(scale), plain_gate(device))


def state_pass(terms: ChunkTerms, initial_state=None, output_final_state: bool = False, *, num_segments=1,
               merge: str = "regs", cu_seqlens=None, out=None):
    """Phase 2 on the GPU: (o [B, T, H, V] in the terms' dtype, final state [N, H, K, V] fp32 or None), one CTA
    per (sequence, head, 64 V columns, segment); `num_segments` > 1 splits each sequence along T (an int, or one
    per sequence): summary launch, the `merge` affine merge, segment outputs. `out=(o, final_state)` writes into
    given tensors."""
    B, T, H, K = terms.update_key.shape
    V = terms.value.shape[-1]
    if K != 128 or V != 128:
        raise ValueError(f"state_pass supports K = V = 128 (compiled shapes), got K={K}, V={V}")
    for name in ("query", "key", "value", "update_key", "intra", "decay"):
        check_tensor(name, getattr(terms, name), ndim=getattr(terms, name).dim())
    for name in ("query", "key", "update_key"):
        check_shape(name, getattr(terms, name), (B, T, H, K))
    check_shape("intra", terms.intra, (B, T, H, C))
    check_shape("decay", terms.decay, (B, T, H, 4) if terms.token_factors else (B, T, H, K) if terms.kda
                else (B, T, H))
    device = check_cuda(query=terms.query, key=terms.key, value=terms.value, update_key=terms.update_key,
                        intra=terms.intra, decay=terms.decay)
    cu = cu_tuple(cu_seqlens, B, T)
    N = B if cu is None else len(cu) - 1
    if initial_state is not None:
        check_tensor("initial_state", initial_state, dtypes=(torch.float32,), ndim=4)
        check_shape("initial_state", initial_state, (N, H, K, V))
    o, final = out if out is not None else (
        torch.empty_like(terms.value),
        torch.empty((N, H, K, V), dtype=torch.float32, device=device) if output_final_state else None)
    counts = tuple(num_segments) if isinstance(num_segments, (list, tuple)) else int(num_segments)
    run = StateRun(terms.kda, terms.token_factors, B, T, H, cu, terms.value.dtype, initial_state is not None,
                   final is not None, counts, merge, device)
    return run.run(terms, initial_state, o, final)


def cu_tuple(cu_seqlens, B, T):
    """cu_seqlens (list or int tensor, read to the host once) as a tuple, checked against [B, T]."""
    if cu_seqlens is None:
        return None
    cu = tuple(int(x) for x in (cu_seqlens.tolist() if hasattr(cu_seqlens, "tolist") else cu_seqlens))
    if B != 1 or len(cu) < 2 or cu[0] != 0 or cu[-1] != T or any(b < a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"cu_seqlens must go from 0 to T={T} without decreasing, with B = 1, got B={B}, "
                         f"cu_seqlens={list(cu[:8])}")
    return cu
