"""SM90 (Hopper) state pass of a two-phase chunked gated delta rule (GDN or KDA): phase 2 of the design in
NOTES.md ("Issue 5: a parallel chunk-prep phase").

Phase 1 (parallel over every chunk of every sequence and head) leaves the chunk-local terms of the chunked form
(`cute_kernels.reference.chunk_gated_delta_rule_ref`) in global memory; this kernel runs only what depends on the
state, chunk after chunk, for one V block of one (sequence, head, segment) per work tile.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import cpasync, warpgroup

from schedulers.device import TicketScheduler, TileScheduler, take_ticket

from ..spin import count_spin, wait_at_least, wait_nonzero
from . import wgmma_tiles as wt

C = 64          # chunk length (tokens)
V_BLOCK = 64    # V columns of the state per work tile (the tile's `block` picks which)
K_DIM = 128
NUM_STAGES = 2
CONSUMER_REGS = 232         # the consumer warpgroup's registers (setmaxnreg; the producer's go down to 40)
CONSUMER_REGS_SHARE = 216   # `share`: 40 + 216 = 2 x 128, the launch's 128 per thread (two CTAs per SM)


class ChunkStatePassSm90:
    """Phase 2: per work tile (sequence, head, segment = chunk range, block = 64 V columns), for each chunk

        v_new = u - w S                    (rows past the chunk end -> 0)
        o     = qg S + Aqk v_new           (rows < L stored)
        S     = diag(exp(G_last)) S + kg^T v_new

    with S the [128 x 64] fp32 state block, from phase 1's terms (all [tokens, H, D], tokens = B * T flattened):
    qg = scale exp(G) q, w, kg = exp(G_last - G) k ([.., 128], 16-bit), u ([.., V], 16-bit), aqk ([.., 64],
    16-bit: row r of a chunk holds Aqk[r, :], zero above the diagonal) and eg ([tokens, H] GDN, [tokens, H, 128]
    KDA, fp32: exp(G_r) inside the chunk; only each chunk's last row is read).

    Warp roles (256 threads, 2 warpgroups):
    - warpgroup 0, warp 0: producer. TMA (`cp.async.bulk.tensor`) of the qg, w, kg tiles [64 x 128] and the u,
      aqk tiles [64 x 64] of one chunk into a `num_stages`-deep ring (64 KB per stage). Registers lowered to 40.
    - warpgroup 1: consumer (registers raised to 232). Holds S in wgmma accumulator registers for the whole tile,
      a bf16 copy of it in smem as the B operand; issues w S and qg S together, then Aqk v_new and the state
      update together (one commit each).
    Pipelines: `PipelineTmaAsync` ring of `num_stages` stages (2; rs: up to 3, its smem holds only the ring, but
    3 measured no faster on the H200) (producer = 1 thread, consumer = 4 warps); named barrier 1 for the
    consumer warpgroup between its phases.

    `rs` (compile time): the consumer holds S^T [64 x 128] instead and feeds it to the tensor cores from registers
    (RS wgmma), so nothing of the state chain goes through shared memory: v_new^T = u^T - S^T w^T and o^T = S^T qg^T
    (A = S^T in 16-bit registers), then o^T += v_new^T Aqk^T and S^T <- S^T diag(exp(G_last)) + v_new^T kg (A =
    v_new^T in registers); two dependent wgmma groups and no named barrier per chunk (KDA: one, for its decays).

    `ring_decay` (rs): each chunk's exp(G_last) rides the ring: the producer warp loads it (KDA: eg's row of 128
    floats, 4 per lane; GDN: one float) before it waits for the stage to be free, stores it into the stage's slot
    and only then arrives (arrive + expect_tx, a release) -- so the consumer, whose wait on the stage acquires,
    never waits on a global load for it (and KDA needs no named barrier per chunk).

    `tma_o` (rs, outputs): o^T of a full chunk goes through a double-buffered smem tile [64 x 64] and leaves by
    one TMA store (`cp.async.bulk.tensor` shared -> global) issued by consumer thread 0 after a named barrier,
    instead of 32 scattered 2-byte global stores per thread; a tile's partial last chunk keeps the direct stores
    (a TMA box would write the next sequence's rows).

    `u_fast` (rs): v_new = u - S w reads u through four per-thread base offsets into the (unswizzled) u tile
    and 8 constant row-block steps (`u_tile_offset`) -- one LDS with an immediate offset per element instead of
    the swizzle arithmetic on every address -- and masks rows only in a partial chunk.

    `pair` (rs with ring_decay): 384 threads, two consumer warpgroups on one ring. A work tile's block then
    covers 128 columns (two 64-column blocks); consumer warpgroup j (1 + j in the CTA) runs block 2 b + j with
    its own S^T in registers, so the two chains of a (sequence, head) share every stage's qg, w, kg and Aqk
    tiles (one load instead of two) and the stage's u tile is [64 x 128] (both blocks' columns). 72 KB per
    stage; the consumer arrive count is 8 warps. Summary mode: block 0 = h_ext's 128 columns, block 1 = M's.
    Measured (H200): one chain per CTA 1.2-1.28 us per chunk, two per CTA 1.96-2.1 (each); a profile build
    shows the second chain doubling the first one's ALU phases (v_new 376 -> 790-850 cycles per chunk) even when
    the two take turns at the tensor cores (named-barrier ping-pong, tried and removed): two chains per SM give
    ~1.3x the chunks per SM per us at ~1.6x the latency per chain: a gain only where the one-block tiles take
    more than one wave (`STATE_PAIR` "auto"). With `raw_qk` / `fold` both consumers take the same stage factors.

    `raw_qk` (GDN, rs with ring_decay; with `pair` both consumers read the same stage's factors): the qg and kg
    arguments are the caller's q and k themselves (phase 1 built with `raw_qk` does not write gated copies) and
    eg is [tokens, H, 4] fp32, row r of a chunk holding (scale 2^G_r, 2^(G_last - G_r), 2^G_last, 0). The
    producer warp puts a chunk's 64 + 64 row factors and its decay into the stage's eg slot; the consumer scales
    o^T's column n (token n) by the first factor after S^T q^T, and the state update uses a second 16-bit copy of
    v_new^T whose column n is scaled by the second: S^T <- S^T 2^G_last + (v_new^T diag(2^(G_last - G))) k.

    `fold` (with raw_qk, GDN_FOLD): phase 1 folded each chunk's T = (I + Akk)^-1 diag(beta) into the two
    products that read v_new = T R, R = v - diag(2^G) k S: the w argument is then the caller's k, u the caller's
    v, kg holds W2 = T^T diag(2^(G_last - G)) k and aqk holds A1 = Aqk T; eg's fourth factor is 2^G_r. The chain
    keeps its shape: P^T = S^T k^T (in w's place), R^T = v^T - P^T diag(2^G) (the fourth factors from the ring
    stage), then o^T += R^T A1^T and S^T <- S^T 2^G_last + R^T W2 (no per-token factor on the update's operand).
    Phase 1 then loads no v and writes no u (per chunk and head 16 KB read and 16 KB written fewer).

    `pdl`: launched with programmatic dependent launch: every thread runs `griddepcontrol.wait` after the
    barrier setup, before any global read (phase 1's terms, the merge's start states), then
    `griddepcontrol.launch_dependents` so the next launch can start its own prologue.

    `consume` (forward mode, the overlapped path: phase 1 runs at the same time with `publish`): before loading
    chunk c of a tile, unless an earlier look already saw it published, the producer warp looks at the flags
    `flags[(seq * chunks_per_seq + chunk) * H + head]` of chunks c .. c + 31 at once (lane i: chunk c + i, a
    gpu-scope acquire load), spinning until chunk c's is set; every lane of the run of published chunks from c
    takes one count back (so the flags end the call at 0), and the warp syncs and fences the generic proxy
    against the async one before its TMA loads and eg reads. One flag round trip then serves every chunk phase 1
    has already published (it runs ahead of the chain) instead of one per chunk on the producer's path. Phase 1
    never waits on this grid before its end, so the spin cannot deadlock as long as phase 1 has SMs: the op keeps
    this grid within half the SM count.

    `share` (forward mode, rs, at most 2 ring stages, not pair): the build that leaves room on its SM for one of
    phase 1's three-per-SM CTAs (`ChunkPrepSm90(trio=True)`, 288 threads x 72 registers, ~76 KB): compiled for
    two CTAs per SM (128 registers per thread at launch, 32 K of the SM's 64 K) and the consumer warpgroup raised
    to 216 only (the producer's 128 - 40 cover its 216 - 128), two stages (~134 KB of shared memory). The
    overlapped path's raw build (`OverlapPlan`, OVERLAP_SHARE, off) then runs phase 1 on every SM: one CTA
    beside each state CTA and three on the SMs the state pass leaves -- by the count of registers and shared
    memory; measured slower than the raw build (session 28), and whether the CTAs co-reside is open.

    `profile` (rs, diagnostics only): the consumer sums clock64 cycles per phase of every chunk -- (0) exp(G_last)
    load and ring wait, (1) first products and their wait, (2) subtraction and conversion of v_new, (4) second
    products issued, o's wait and o^T stored, (3) the state update's wait and the release -- and thread 0 of the
    consumer writes [p0, p1, p2, p3, chunks, p4] (fp32) of CTA b to final_state's flat elements [8 b, 8 b + 6)
    (final_state is then a scratch buffer of at least 8 x grid floats, not a state).

    Modes (compile time): `forward` (start from initial_state[seq] or 0; final_state[seq] after the last segment
    if `store_final_state`); `segment_outputs` (start from start_states[seg_slot], same outputs); `summary` (the
    segment's affine map S_end = M S_start + h_ext, no o: tile block b < V / 64 runs h_ext's columns [64 b, 64 b +
    64) from 0 with the real u; block b >= V / 64 runs M's columns [64 (b - V / 64), ..) from the identity with
    u = 0; the end block goes to summary[slot] (h_ext) or summary[slots + slot] (M), both [.., 128, 128] --
    `affine_merge`'s layout). The summary mode loads only w, kg and u (no qg, no Aqk).

    `summary_o` (summary mode, rs with ring_decay, one block per tile): the summary tiles also store their chain's
    outputs -- the one-pass segmented forward (`SegmentCorrectionSm90`). The forward is affine in a segment's
    start state S_0: o_t = o0_t + qm_t S_0, with o0 the outputs of the chain from 0 (an h_ext block's, stored
    into o) and qm = [qg - Aqk w] times the chain from the identity with u = 0 (an M block's own "outputs",
    [tokens, H, 128], stored into `lb_m`'s place). A correction launch adds qm S_0 once the merge has the start
    states: each segment's chain runs once instead of twice (summary, then outputs).

    `lookback` mode (rs with ring_decay, one block per tile; not pair / tma_o / u_fast / consume / profile): the
    segmented forward in one launch -- summaries, the chain of start states and the outputs. The table is a
    `schedulers.lookback_schedule` (summary tiles, block >= V / 64, then output tiles ordered by segment) and a
    CTA's tile is the ticket it draws (`TicketScheduler`): every tile it waits on then holds an SM or is done, so
    the waits cannot deadlock whatever the grid. Workspace: `lb_m` (16-bit [2 slots, H, 128, 128]: M^T of slot s
    split as hi = bf16(M^T) at [s], lo = bf16(M^T - hi) at [slots + s]; an M block's values are column pairs of
    M^T's rows, and the link reads M^T's tile as an MN-major B); `lb_ws` (fp32: per (slot, head, V block) the
    consumer's 64 x 128 accumulator fragment of h_ext^T, then of the end state, in thread order -- 256 contiguous
    bytes per thread); `flags` (int32: [0] the ticket counter, then per (slot, head, V block) a summary count
    and an end flag; all back at 0 when the launch ends).
    - Summary tile: as `summary` mode (it loads every tile of the ring, unused ones included, so the stage's byte
      count is one constant), then stores h_ext^T's fragment (an h block) or M's hi / lo (an M block), and
      consumer thread 0 publishes (gpu-scope release fence, then an atomic add of 1 on the summary count of its
      V block (h) or of every V block (M)).
    - Output tile (sequence n, segment s, V block j): its start state is initial_state[n] (or 0) for s = 0, else
      the end state of segment s - 1 (thread 0 spins on that end flag with gpu-scope acquire loads and clears
      it; then each thread loads its fragment). Unless s is the last segment, it then makes its own end state
      end = M_s start + h_ext_s -- the link, as `AffineMergeTcSm90`'s: start^T hi / lo times M^T hi / lo (the
      producer warp has waited for the summary count and loaded M's hi and lo by TMA into their own 64 KB of
      shared memory), three RS wgmma products onto h_ext^T's fragment -- stores it and sets its end flag
      (release), and only then runs the segment's chunks from `start` like `segment_outputs`. The last
      segment stores the final state from the chain's registers at its end.
    Every value is computed by exactly one CTA in a fixed order; the flags only order the work, never select it,
    so the results do not depend on timing.
    """

    def __init__(self, io_dtype, kda: bool, has_initial_state: bool, store_final_state: bool,
                 mode: str = "forward", num_stages: int = NUM_STAGES, rs: bool = False, profile: bool = False,
                 ring_decay: bool = False, tma_o: bool = False, u_fast: bool = False, pair: bool = False,
                 pdl: bool = False, consume: bool = False, raw_qk: bool = False, fold: bool = False,
                 summary_o: bool = False, share: bool = False):
        if mode not in ("forward", "segment_outputs", "summary", "lookback"):
            raise ValueError(f"mode must be 'forward', 'segment_outputs', 'summary' or 'lookback', got {mode!r}")
        if mode == "lookback" and (not (rs and ring_decay) or pair or tma_o or u_fast or consume or profile):
            raise ValueError("lookback mode needs rs=True and ring_decay=True, without pair, tma_o, u_fast, "
                             "consume and profile")
        if num_stages < 1:
            raise ValueError(f"num_stages must be >= 1, got {num_stages}")
        self.io_dtype = io_dtype
        self.kda = kda
        self.has_initial_state = has_initial_state
        self.store_final_state = store_final_state
        self.mode = mode
        self.num_stages = num_stages
        self.rs = rs
        if not rs and num_stages > 2:
            raise ValueError(f"the smem-operand consumer fits at most 2 stages, got {num_stages}")
        if profile and (not rs or store_final_state):
            raise ValueError("profile mode needs rs=True and store_final_state=False (final_state holds the stamps)")
        self.profile = profile
        if (ring_decay or tma_o or u_fast) and not rs:
            raise ValueError("ring_decay / tma_o / u_fast are rs-consumer options (rs=True)")
        if pair and (not (rs and ring_decay) or tma_o or u_fast):
            raise ValueError("pair needs rs=True and ring_decay=True, without tma_o / u_fast")
        self.u_fast = u_fast
        self.ring_decay = ring_decay
        self.tma_o = tma_o and mode != "summary"
        self.pair = pair
        self.pdl = pdl
        if consume and mode != "forward":
            raise ValueError("consume (the overlapped path) is a forward-mode option")
        self.consume = consume
        if raw_qk and (kda or not (rs and ring_decay)):
            raise ValueError("raw_qk is GDN's, with rs=True and ring_decay=True")
        self.raw_qk = raw_qk
        if fold and not raw_qk:
            raise ValueError("fold is the raw_qk build's option")
        self.fold = fold
        self.num_consumers = 2 if pair else 1
        self.num_threads = 128 * (1 + self.num_consumers)
        self.u_cols = V_BLOCK * self.num_consumers   # u columns per ring stage (pair: both V blocks)
        if summary_o and (mode != "summary" or not (rs and ring_decay) or pair or tma_o or u_fast or profile):
            raise ValueError("summary_o is the summary mode's option, with rs=True and ring_decay=True, without "
                             "pair, tma_o, u_fast and profile")
        self.summary_o = summary_o
        if share and (mode != "forward" or not rs or num_stages > 2 or pair):
            raise ValueError("share is a forward-mode option of the rs build with at most 2 stages, without pair")
        self.share = share
        # share: 40 (producer) + CONSUMER_REGS_SHARE (consumer) <= 2 x 128, the registers two CTAs per SM launch with
        self.consumer_regs = CONSUMER_REGS_SHARE if share else CONSUMER_REGS
        self.outputs = mode != "summary" or summary_o
        self.lookback = mode == "lookback"
        wide_tiles = 3 if self.outputs else 2   # qg, w, kg (summary: w, kg)
        narrow_tiles = 1 if self.outputs else 0   # aqk
        self.tma_bytes = ((wide_tiles * C * K_DIM + narrow_tiles * C * C + C * self.u_cols)
                          * io_dtype.width // 8)

    @cute.jit
    def __call__(
        self,
        qg: cute.Tensor,             # [B, T, H, 128]
        w: cute.Tensor,              # [B, T, H, 128]
        u: cute.Tensor,              # [B, T, H, V]
        kg: cute.Tensor,             # [B, T, H, 128]
        aqk: cute.Tensor,            # [B, T, H, 64]
        eg: cute.Tensor,             # [B, T, H] fp32 (KDA: [B, T, H, 128]; raw_qk: [B, T, H, 4])
        o: cute.Tensor,              # [B, T, H, V]
        initial_state: cute.Tensor,  # [N, H, 128, V] fp32 (forward, if has_initial_state); segment_outputs: [slots, ..]
        final_state: cute.Tensor,    # [N, H, 128, V] fp32 (if store_final_state); summary: [2 * slots, H, 128, 128]
        tiles: cute.Tensor,          # [num_tiles, NUM_TILE_FIELDS] int32
        num_tiles: Int32,
        grid_x: Int32,
        flags: cute.Tensor,          # consume: int32 [(sequences x chunks per sequence) x H] (else any int32)
        chunks_per_seq: Int32,
        lb_m: cute.Tensor,           # lookback: 16-bit [2 slots, H, 128, 128]; summary_o: qm [B, T, H, 128]
        lb_ws: cute.Tensor,          # lookback: fp32 [2 x slots x H x V / 64 x 8192] (else any fp32 vector)
        stream,
    ):
        io = self.io_dtype

        def flat(t):   # [B, T, ...] -> [B * T, ...] (contiguous inputs: B's stride is T times T's)
            return cute.make_tensor(
                t.iterator,
                cute.make_layout((t.shape[0] * t.shape[1],) + tuple(t.shape[2:]),
                                 stride=(t.stride[1],) + tuple(t.stride[2:])),
            )

        def thd(t):    # (tokens, D, H) view for TMA
            return cute.make_tensor(
                t.iterator,
                cute.make_layout((t.shape[0], t.shape[2], t.shape[1]), stride=(t.stride[0], t.stride[2], t.stride[1])),
            )

        qg, w, u, kg, aqk, eg, o = flat(qg), flat(w), flat(u), flat(kg), flat(aqk), flat(eg), flat(o)
        lb_m_k = lb_m   # the kernel's view of lb_m: summary_o's qm is [tokens, H, 128] like o
        if cutlass.const_expr(self.summary_o):
            lb_m_k = flat(lb_m)
        op = cpasync.CopyBulkTensorTileG2SOp()
        wide = wt.first_stage(wt.smem_layout(C, K_DIM, io))
        narrow = wt.first_stage(wt.smem_layout(C, V_BLOCK, io))
        tma_qg, tma_qg_t = cpasync.make_tiled_tma_atom(op, thd(qg), wide, (C, K_DIM))
        tma_w, tma_w_t = cpasync.make_tiled_tma_atom(op, thd(w), wide, (C, K_DIM))
        tma_kg, tma_kg_t = cpasync.make_tiled_tma_atom(op, thd(kg), wide, (C, K_DIM))
        u_layout = wt.first_stage(wt.smem_layout(C, self.u_cols, io))
        tma_u, tma_u_t = cpasync.make_tiled_tma_atom(op, thd(u), u_layout, (C, self.u_cols))
        tma_a, tma_a_t = cpasync.make_tiled_tma_atom(op, thd(aqk), narrow, (C, V_BLOCK))
        # tma_o: o tiles [64 tokens x 64 V columns] leave from smem (the same swizzled layout as the u tile);
        # without it the u atom stands in, unused (no descriptor encoded per call for nothing)
        tma_os, tma_os_t = tma_u, tma_u_t
        if cutlass.const_expr(self.tma_o):
            tma_os, tma_os_t = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileS2GOp(), thd(o), narrow,
                                                           (C, V_BLOCK))
        # lookback: M^T's hi / lo tiles [128 x 128] (rows (part, slot, head, k_in), columns k_out) load by TMA
        tma_m, tma_m_t = tma_u, tma_u_t
        if cutlass.const_expr(self.lookback):
            rows = lb_m.shape[0] * lb_m.shape[1] * lb_m.shape[2]
            m2d = cute.make_tensor(lb_m.iterator, cute.make_layout((rows, K_DIM), stride=(lb_m.stride[2], 1)))
            tma_m, tma_m_t = cpasync.make_tiled_tma_atom(op, m2d, wt.first_stage(wt.smem_layout(K_DIM, K_DIM, io)),
                                                         (K_DIM, K_DIM))

        stages = self.num_stages

        # rs: S, v_new and o never pass through shared memory (their fields shrink to a placeholder; room for a
        # third ring stage)
        s_elems = 8 if self.rs else K_DIM * V_BLOCK
        t_elems = 8 if self.rs else C * V_BLOCK
        o_elems = 2 * C * V_BLOCK if self.tma_o else t_elems   # tma_o: two o tiles (chunk parity)
        eg_elems = self.eg_slot() * stages if self.ring_decay else 8
        m_elems = K_DIM * K_DIM if self.lookback else 8   # lookback: M hi and lo, 32 KB each
        m_align = 1024 if self.lookback else 16            # (other builds: no swizzle-aligned padding)

        @cute.struct
        class SharedStorage:
            load_mbar: cute.struct.MemRange[cutlass.Int64, stages * 2]
            sQg: cute.struct.Align[cute.struct.MemRange[io, C * K_DIM * stages], 1024]
            sW: cute.struct.Align[cute.struct.MemRange[io, C * K_DIM * stages], 1024]
            sKg: cute.struct.Align[cute.struct.MemRange[io, C * K_DIM * stages], 1024]
            sU: cute.struct.Align[cute.struct.MemRange[io, C * self.u_cols * stages], 1024]
            sAqk: cute.struct.Align[cute.struct.MemRange[io, C * C * stages], 1024]
            sS: cute.struct.Align[cute.struct.MemRange[io, s_elems], 1024]      # bf16 copy of S (k, v)
            sVnew: cute.struct.Align[cute.struct.MemRange[io, t_elems], 1024]
            sO: cute.struct.Align[cute.struct.MemRange[io, o_elems], 1024]
            sDecay: cute.struct.MemRange[Float32, 2 * K_DIM]   # exp(G_last) per row of S (rs, KDA: 2 buffers)
            sEg: cute.struct.Align[cute.struct.MemRange[Float32, eg_elems], 128]   # ring_decay: per ring stage
            sMhi: cute.struct.Align[cute.struct.MemRange[io, m_elems], m_align]   # lookback: the link's B operands
            sMlo: cute.struct.Align[cute.struct.MemRange[io, m_elems], m_align]
            link_mbar: cute.struct.MemRange[cutlass.Int64, 1]                  # lookback: M's TMA landed
            ticket: cute.struct.MemRange[Int32, 1]                             # lookback: this CTA's tile

        self.shared_storage = SharedStorage
        self.smem_bytes = self.shared_storage.size_in_bytes()
        assert self.smem_bytes <= 232448, f"shared storage {self.smem_bytes} B exceeds the 227 KB of an SM90 CTA"
        self.kernel(tma_qg, tma_qg_t, tma_w, tma_w_t, tma_kg, tma_kg_t, tma_u, tma_u_t, tma_a, tma_a_t,
                    tma_os, tma_os_t, tma_m, tma_m_t, eg, o, initial_state, final_state, tiles, num_tiles,
                    flags, chunks_per_seq, lb_ws, lb_m_k).launch(
            grid=[grid_x, 1, 1], block=[self.num_threads, 1, 1], stream=stream,
            min_blocks_per_mp=2 if self.share else 1, use_pdl=self.pdl,
            # share: a fixed carveout (all of the SM for shared memory), so compiling needs no device query
            preferred_smem_carveout=100 if self.share else None,
        )

    @cute.kernel
    def kernel(
        self,
        tma_qg: cute.CopyAtom, mQg: cute.Tensor,
        tma_w: cute.CopyAtom, mW: cute.Tensor,
        tma_kg: cute.CopyAtom, mKg: cute.Tensor,
        tma_u: cute.CopyAtom, mU: cute.Tensor,
        tma_a: cute.CopyAtom, mA: cute.Tensor,
        tma_os: cute.CopyAtom, mOT: cute.Tensor,
        tma_m: cute.CopyAtom, mM: cute.Tensor,
        mEg: cute.Tensor, mO: cute.Tensor, mS0: cute.Tensor, mSN: cute.Tensor,
        mTiles: cute.Tensor, num_tiles: Int32, mFlags: cute.Tensor, chunks_per_seq: Int32, mWs: cute.Tensor,
        mMg: cute.Tensor,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        wg = cute.arch.make_warp_uniform(tidx // 128)
        smem = cutlass.memory.SmemAllocator()
        st = smem.allocate(self.shared_storage)
        io, ns = self.io_dtype, self.num_stages

        load = pipeline.PipelineTmaAsync.create(
            barrier_storage=st.load_mbar.data_ptr(),
            num_stages=ns,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 1),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 4 * self.num_consumers),
            tx_count=self.tma_bytes,
        )
        if cutlass.const_expr(self.pdl):
            # launched early (PDL): barriers are set up above; wait here for the previous grid (phase 1, or the
            # merge) to finish before reading anything it wrote, and let the next launch start its own prologue
            cute.arch.griddepcontrol_wait()
            cute.arch.griddepcontrol_launch_dependents()
        sched = TileScheduler.create(mTiles, num_tiles, False)
        if cutlass.const_expr(self.lookback):
            ticket = st.ticket.get_tensor(cute.make_layout(1))
            if tidx == 0:
                cute.arch.mbarrier_init(st.link_mbar.data_ptr(), 1)
                take_ticket(mFlags.iterator, num_tiles, ticket)
            cute.arch.mbarrier_init_fence()
            cute.arch.sync_threads()
            sched = TicketScheduler.create(mTiles, num_tiles, ticket)
        sQg = wt.smem_view(st.sQg, io, C, K_DIM, ns)                 # (token, channel, stage)
        sW = wt.smem_view(st.sW, io, C, K_DIM, ns)
        sKg_mn = wt.smem_view(st.sKg, io, C, K_DIM, ns, True)        # (channel, token, stage)
        sU = wt.smem_view(st.sU, io, C, self.u_cols, ns)             # (token, v, stage)
        sA = wt.smem_view(st.sAqk, io, C, C, ns)                     # (token r, token i, stage)

        if warp_idx == 0:
            for atom in (tma_qg, tma_w, tma_kg, tma_u, tma_a):
                cpasync.prefetch_descriptor(atom)
            if cutlass.const_expr(self.tma_o):
                cpasync.prefetch_descriptor(tma_os)
            if cutlass.const_expr(self.lookback):
                cpasync.prefetch_descriptor(tma_m)

        if wg == 0:
            cute.arch.setmaxregister_decrease(40)
            if warp_idx == 0:
                loads = ((tma_w, mW, sW, K_DIM, False),
                         (tma_kg, mKg, wt.smem_view(st.sKg, io, C, K_DIM, ns), K_DIM, False),
                         (tma_u, mU, sU, self.u_cols, True))
                if cutlass.const_expr(self.outputs):
                    loads = loads + ((tma_qg, mQg, sQg, K_DIM, False), (tma_a, mA, sA, C, False))
                sEg = st.sEg.get_tensor(cute.make_layout((self.eg_slot(), ns), stride=(1, self.eg_slot())))
                link = (tma_m, mM, st)
                self.producer(sched, load, loads, mU.shape[1] // self.u_cols, mEg, sEg, tidx % 32, mFlags,
                              chunks_per_seq, link)
        else:
            cute.arch.setmaxregister_increase(self.consumer_regs)
            if cutlass.const_expr(self.rs):
                # j (which V block of a pair) is a compile-time constant: a runtime one in the u and o addresses
                # doubled the chain's time per chunk (H200: 1.06 -> 2.29 us)
                if wg == 1:
                    self.consumer_rs(sched, load, tidx - 128, 0, sQg, sW, sKg_mn, sU, sA, mEg, mO, mS0, mSN, st,
                                     tma_os, mOT, mFlags, mWs, mMg)
                if cutlass.const_expr(self.pair):
                    if wg == 2:
                        self.consumer_rs(sched, load, tidx - 256, 1, sQg, sW, sKg_mn, sU, sA, mEg, mO, mS0, mSN,
                                         st, tma_os, mOT, mFlags, mWs, mMg)
            else:
                self.consumer(sched, load, tidx - 128, sQg, sW, sKg_mn, sU, sA, mEg, mO, mS0, mSN, st)

    @cute.jit
    def producer(self, sched, load, loads, n_vb, mEg, sEg, lane, mFlags, chunks_per_seq, link):
        """One chunk per ring stage: the five tiles of `loads` ((atom, tensor, smem, columns, by_block): the column
        tile is the work tile's block where `by_block` (u), else 0; `n_vb`: the number of u column tiles), and with
        `ring_decay` the chunk's exp(G_last) (from `mEg` into the stage's column of `sEg`, by the warp's lanes).
        `lookback`: an output tile with a link first loads M's hi / lo (`load_link`; `link` = (atom, tensor, smem
        storage)); a summary tile's u columns are those of its summary block."""
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.num_stages)
        work = sched.initial_work()
        while work.is_valid:
            head = work.head
            tok0 = work.tok_start
            blk = work.block
            if cutlass.const_expr(self.mode == "summary"):
                if blk >= n_vb:
                    blk = Int32(0)   # M columns: u is not used (any in-bounds tile keeps the byte count)
            if cutlass.const_expr(self.lookback):
                if blk >= n_vb:   # a summary tile: block n_vb + summary block
                    blk = blk - n_vb
                    if blk >= n_vb:
                        blk = Int32(0)
                else:
                    self.load_link(work, blk, n_vb, link, lane, mFlags, mEg.shape[1])
            n_chunks = work.chunk_end - work.chunk_start
            ready = Int32(0)   # consume: chunks [0, ready) of the tile are known published
            for c in cutlass.range(n_chunks, unroll=1):
                if cutlass.const_expr(self.consume):
                    if c >= ready:
                        num_heads = mEg.shape[1]
                        ready = c + self.wait_published(
                            mFlags, (work.seq * chunks_per_seq + work.chunk_start + c) * num_heads + head,
                            num_heads, n_chunks - c, lane)
                if cutlass.const_expr(self.ring_decay):
                    # exp(G_last) into registers first (its latency under the wait for a free stage), into the
                    # stage once it is free, then the arrive that publishes it with the TMA bytes
                    t0, L = chunk_rows(tok0, work.tok_end, c)
                    if cutlass.const_expr(self.raw_qk):
                        # rows lane and lane + 32: (o factor, kg factor); every lane also reads the decay
                        f = cute.make_rmem_tensor((4, 2), Float32)   # (factor, row j)
                        f.fill(0.0)
                        for j in cutlass.range_constexpr(2):
                            if lane + 32 * j < L:
                                cute.autovec_copy(mEg[t0 + lane + 32 * j, head, None], f[None, j])
                        dl = Float32(mEg[t0 + L - 1, head, 2])
                        load.sync_object_empty.wait(state.index, state.phase)
                        for j in cutlass.range_constexpr(2):
                            sEg[lane + 32 * j, state.index] = f[0, j]
                            if cutlass.const_expr(self.fold):   # R = v - diag(2^G) k S: 2^G instead
                                sEg[C + lane + 32 * j, state.index] = f[3, j]
                            else:
                                sEg[C + lane + 32 * j, state.index] = f[1, j]
                        if lane == 0:
                            sEg[2 * C, state.index] = dl
                    else:
                        per_lane = K_DIM // 32 if self.kda else 1   # GDN: one float, read from slot 0
                        d = cute.make_rmem_tensor(cute.make_layout(per_lane), Float32)
                        for j in cutlass.range_constexpr(per_lane):
                            if cutlass.const_expr(self.kda):
                                d[j] = mEg[t0 + L - 1, head, lane + 32 * j]
                            else:
                                d[j] = mEg[t0 + L - 1, head]
                        load.sync_object_empty.wait(state.index, state.phase)
                        for j in cutlass.range_constexpr(per_lane):
                            sEg[lane + 32 * j, state.index] = d[j]
                    cute.arch.sync_warp()
                    load.sync_object_full.arrive(state.index, load.producer_mask)
                else:
                    load.producer_acquire(state)
                bar = load.producer_get_barrier(state)
                for tma, m, s, cols, by_block in loads:
                    col_tile = blk if by_block else 0
                    g_head = cute.domain_offset((tok0 + c * C, 0), m[None, None, head])
                    g_tile = cute.local_tile(g_head, (C, cols), (0, col_tile))
                    s_part, g_part = cpasync.tma_partition(
                        tma, 0, cute.make_layout(1), cute.group_modes(s, 0, 2), cute.group_modes(g_tile, 0, 2),
                    )
                    cute.copy(tma, g_part, s_part[(None, state.index)], tma_bar_ptr=bar)
                state.advance()
            work = sched.advance(work)
        load.producer_tail(state)

    @cute.jit
    def load_link(self, work, blk, n_vb, link, lane, mFlags, num_heads):
        """`lookback`, producer warp, output tile in V block `blk` that makes a link (its segment is not its
        sequence's last): spin (lane 0, gpu-scope acquire loads, bounded: `spin.wait_at_least`) until the
        segment's summary has published -- its h_ext block, and every M block unless the segment is the first
        without an initial state (end = h_ext, no M) --, then, with M, order the TMA after that (proxy fence) and
        load M's hi and lo tiles into sMhi / sMlo, landing on `link_mbar`; without M just arrive on `link_mbar`.
        The consumer waits on that barrier before its own (then immediate) look at the count, which it clears."""
        tma_m, mM, st = link
        needs_m = work.segment > 0
        if cutlass.const_expr(self.has_initial_state):
            needs_m = True
        if not work.is_last_segment:
            slot = work.seg_slot
            head = work.head
            slots = mM.shape[0] // (2 * num_heads * K_DIM)
            need = Int32(1)
            if needs_m:
                need = Int32(1 + K_DIM // V_BLOCK)
            if lane == 0:
                wait_at_least(mFlags.iterator + lb_flag(slot, head, blk, num_heads, n_vb, slots, False), need)
            cute.arch.sync_warp()
            bar = st.link_mbar.data_ptr()
            if needs_m:
                cute.arch.fence_proxy("async.global")
                if lane == 0:
                    cute.arch.mbarrier_arrive_and_expect_tx(bar, 2 * K_DIM * K_DIM * self.io_dtype.width // 8)
                for part, field in ((0, st.sMhi), (1, st.sMlo)):
                    s_m = wt.smem_view(field, self.io_dtype, K_DIM, K_DIM)
                    g_tile = cute.local_tile(mM, (K_DIM, K_DIM), ((part * slots + slot) * num_heads + head, 0))
                    s_part, g_part = cpasync.tma_partition(
                        tma_m, 0, cute.make_layout(1), cute.group_modes(s_m, 0, 2), cute.group_modes(g_tile, 0, 2),
                    )
                    cute.copy(tma_m, g_part, s_part[(None, 0)], tma_bar_ptr=bar)
            else:
                if lane == 0:
                    cute.arch.mbarrier_arrive(bar)

    @cute.jit
    def wait_published(self, mFlags, idx, stride, left, lane) -> Int32:
        """`consume`: the number of consecutive chunks from this one that phase 1 has published (>= 1: spins until
        this one is), from one look at up to 32 flags (lane i: flag `idx + i stride`, i < `left`, gpu-scope
        acquire loads); each of those lanes takes one count back. Then the warp's later generic reads (eg) and
        async-proxy reads (TMA) are ordered after the acquires (bar.warp.sync orders memory among the lanes)."""
        ptr = mFlags.iterator + idx + lane * stride
        run = Int32(0)
        spins = Int32(0)
        while run == 0:
            spins = count_spin(spins)   # traps if phase 1 never publishes (`spin.py`)
            seen = Int32(0)
            if lane < left:
                seen = cute.arch.load(ptr, Int32, sem="acquire", scope="gpu")
            mask = cute.arch.vote_ballot_sync(seen > 0)
            run = cute.arch.popc(mask & ~(mask + 1))   # trailing ones: published from lane 0 on
        if lane < run:
            cute.arch.atomic_add(ptr, Int32(-1), sem="relaxed", scope="gpu")
        cute.arch.sync_warp()
        cute.arch.fence_proxy("async.global")
        return run

    @cute.jit
    def consumer(self, sched, load, wtid, sQg, sW, sKg_mn, sU, sA, mEg, mO, mS0, mSN, st):
        io = self.io_dtype
        sS = wt.smem_view(st.sS, io, K_DIM, V_BLOCK)[None, None, 0]          # (k, v)
        sS_mn = wt.smem_view(st.sS, io, K_DIM, V_BLOCK, 1, True)[None, None, 0]  # (v, k): B of x S
        sVnew = wt.smem_view(st.sVnew, io, C, V_BLOCK)[None, None, 0]      # (token, v)
        sVnew_mn = wt.smem_view(st.sVnew, io, C, V_BLOCK, 1, True)[None, None, 0]  # (v, token)
        sO = wt.smem_view(st.sO, io, C, V_BLOCK)[None, None, 0]
        sDecay = st.sDecay.get_tensor(cute.make_layout(K_DIM))

        mma64 = wt.make_mma(io, False, True)
        mma_s = wt.make_mma(io, True, True)
        thr_ab = mma64.get_slice(wtid)
        thr_s = mma_s.get_slice(wtid)
        cc_ab = thr_ab.partition_C(cute.make_identity_tensor((C, V_BLOCK)))
        cc_s = thr_s.partition_C(cute.make_identity_tensor((K_DIM, V_BLOCK)))
        acc_s = cute.make_rmem_tensor(thr_s.partition_shape_C((K_DIM, V_BLOCK)), Float32)
        acc = cute.make_rmem_tensor(thr_ab.partition_shape_C((C, V_BLOCK)), Float32)
        acc_o = cute.make_rmem_tensor(thr_ab.partition_shape_C((C, V_BLOCK)), Float32)
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.num_stages)

        n_vb = mO.shape[2] // V_BLOCK   # V blocks (summary: blocks past them are M's columns)
        work = sched.initial_work()
        while work.is_valid:
            head = work.head
            v0, is_m = self.tile_columns(work, n_vb, 0)
            tok0 = work.tok_start
            tok_end = work.tok_end
            self.load_start_state(work, head, v0, is_m, acc_s, cc_s, mS0, False)
            wt.store_acc(io, wtid, mma_s, acc_s, sS)
            cute.arch.fence_proxy("async.shared", space="cta")
            cute.arch.barrier(barrier_id=1, number_of_threads=128)

            for c in cutlass.range(work.chunk_end - work.chunk_start, unroll=1):
                t0, L = chunk_rows(tok0, tok_end, c)
                # exp(G_last) of this chunk for state row wtid (read once the previous chunk's rows are used).
                if cutlass.const_expr(self.kda):
                    sDecay[wtid] = mEg[t0 + L - 1, head, wtid]
                else:
                    sDecay[wtid] = mEg[t0 + L - 1, head]
                load.consumer_wait(state)
                stage = state.index
                # w S (-> v_new) and qg S (o's inter-chunk part), one commit.
                wt.gemm(io, wtid, acc, sW[None, None, stage], sS_mn, False, True, False, wait=False)
                if cutlass.const_expr(self.outputs):
                    wt.gemm(io, wtid, acc_o, sQg[None, None, stage], sS_mn, False, True, False, wait=False)
                warpgroup.wait_group(0)
                self.sub_u(acc, cc_ab, sU, 0, stage, is_m, L, False)
                wt.store_acc(io, wtid, mma64, acc, sVnew)
                cute.arch.fence_proxy("async.shared", space="cta")
                cute.arch.barrier(barrier_id=1, number_of_threads=128)
                # o += Aqk v_new and S <- diag(exp(G_last)) S + kg^T v_new, one commit.
                if cutlass.const_expr(self.outputs):
                    wt.gemm(io, wtid, acc_o, sA[None, None, stage], sVnew_mn, False, True, True, wait=False)
                for i in cutlass.range_constexpr(cute.size(acc_s)):
                    r, cidx = cc_s[i]
                    acc_s[i] = acc_s[i] * sDecay[r]
                wt.gemm(io, wtid, acc_s, sKg_mn[None, None, stage], sVnew_mn, True, True, True, wait=False)
                warpgroup.wait_group(0)
                load.consumer_release(state)
                state.advance()
                cute.arch.barrier(barrier_id=1, number_of_threads=128)   # every product has read sS and sVnew
                if cutlass.const_expr(self.outputs):
                    wt.store_acc(io, wtid, mma64, acc_o, sO)
                wt.store_acc(io, wtid, mma_s, acc_s, sS)
                cute.arch.fence_proxy("async.shared", space="cta")
                cute.arch.barrier(barrier_id=1, number_of_threads=128)
                if cutlass.const_expr(self.outputs):
                    wt.store_rows(io, wtid, sO, mO, t0, head, v0, L)

            self.store_end_state(work, head, v0, is_m, acc_s, cc_s, mSN, False)
            work = sched.advance(work)

    def eg_slot(self) -> int:
        """ring_decay: floats per ring stage of sEg -- 128 (KDA: the 128 decays; GDN: its one decay in slot 0), or
        with raw_qk 132 (64 o factors, 64 kg factors -- fold: 64 factors 2^G --, the decay, padding)."""
        return 2 * C + 4 if self.raw_qk else K_DIM

    @cute.jit
    def tile_columns(self, work, n_vb, j):
        """(v0, is_m): the first state column of consumer j's 64-column block and, in summary mode, whether the
        block is one of M's (blocks past the n_vb V blocks), whose columns then restart at 0. `pair`: the work
        tile's block b holds the 64-column blocks 2 b (consumer 0) and 2 b + 1 (consumer 1)."""
        blk = work.block * self.num_consumers + j
        if cutlass.const_expr(self.lookback):
            return self.lookback_columns(blk, n_vb)
        v0 = blk * V_BLOCK
        is_m = blk >= n_vb
        if cutlass.const_expr(self.mode == "summary"):
            if is_m:
                v0 = (blk - n_vb) * V_BLOCK
        return v0, is_m

    @cute.jit
    def lookback_columns(self, blk, n_vb):
        """`lookback`'s (v0, is_m) of table block `blk`: an output tile's V columns (blk < n_vb), or a summary
        tile's (block n_vb + b: h_ext's columns 64 b for b < n_vb, else M's columns 64 (b - n_vb))."""
        v0 = blk * V_BLOCK
        is_m = blk < 0
        if blk >= n_vb:
            sb = blk - n_vb
            is_m = sb >= n_vb
            v0 = sb * V_BLOCK
            if is_m:
                v0 = (sb - n_vb) * V_BLOCK
        return v0, is_m

    @cute.jit
    def lookback_start(self, work, head, v0, is_m, has_o, acc_s, cc_s, mS0, st, wtid, mFlags, mWs, num_heads,
                       n_vb):
        """`lookback`: the tile's start state S^T into acc_s ((v, k) coordinates cc_s). Summary tiles: 0 (h_ext)
        or the identity (M). Output tiles: initial_state[seq] (or 0) in the first segment, else the end state of
        the previous segment once its end flag is set (thread 0 spins, acquire, and clears it; each thread then
        loads its own 64 floats). Unless the segment is its sequence's last, the tile also makes and publishes
        its own end state (the link): everything the link needs but the start state -- the summary count, h_ext's
        fragment, M's tiles -- is waited for and loaded first, so the chain's critical path per segment is the
        flag, one fragment load, the three products and the publication."""
        if has_o:
            blk = v0 // V_BLOCK
            slot = work.seg_slot
            slots = mWs.shape[0] // (2 * num_heads * n_vb * 128 * 64)
            link = not work.is_last_segment
            needs_m = work.segment > 0
            if cutlass.const_expr(self.has_initial_state):
                needs_m = True
            nxt = cute.make_rmem_tensor_like(acc_s, Float32)   # the end state, from h_ext^T
            if link:
                # the producer warp has seen the summary count (its bounded wait) and, with M, M^T's hi / lo tiles
                # have landed: only now may thread 0 clear the count the producer spins on
                cute.arch.mbarrier_wait(st.link_mbar.data_ptr(), 0)
                if wtid == 0:
                    need = Int32(1)
                    if needs_m:
                        need = Int32(1 + K_DIM // V_BLOCK)
                    ptr = mFlags.iterator + lb_flag(slot, head, blk, num_heads, n_vb, slots, False)
                    seen = Int32(0)
                    while seen < need:   # unbounded (a bound here spilled), but the producer's bounded wait saw it
                        seen = cute.arch.load(ptr, Int32, sem="acquire", scope="gpu")
                    cute.arch.store(ptr, Int32(0), sem="relaxed", scope="gpu")   # back to 0 for the next launch
                cute.arch.barrier(barrier_id=1, number_of_threads=128)
                self.load_fragment(nxt, mWs, lb_fragment(0, slot, head, blk, num_heads, n_vb, slots, wtid))
            if work.segment == 0:
                self.load_start_state(work, head, v0, is_m, acc_s, cc_s, mS0, True)   # forward's: init or 0
            else:
                if wtid == 0:
                    ptr = mFlags.iterator + lb_flag(slot - 1, head, blk, num_heads, n_vb, slots, True)
                    wait_nonzero(ptr)
                    cute.arch.store(ptr, Int32(0), sem="relaxed", scope="gpu")
                cute.arch.barrier(barrier_id=1, number_of_threads=128)
                self.load_fragment(acc_s, mWs, lb_fragment(1, slot - 1, head, blk, num_heads, n_vb, slots, wtid))
            if link:
                self.lookback_link(slot, head, blk, slots, needs_m, acc_s, nxt, st, wtid, mFlags, mWs, num_heads,
                                   n_vb)
        else:
            for i in cutlass.range_constexpr(cute.size(acc_s)):
                vv, kk = cc_s[i]
                acc_s[i] = cutlass.select_(is_m and kk == v0 + vv, Float32(1.0), Float32(0.0))

    @cute.jit
    def lookback_link(self, slot, head, blk, slots, needs_m, acc_s, nxt, st, wtid, mFlags, mWs, num_heads, n_vb):
        """`lookback`, output tile: end^T = start^T M^T + h_ext^T for this V block (start^T in acc_s, kept; nxt
        holds h_ext^T), as `AffineMergeTcSm90`'s link: start^T = hi + lo (16-bit A operands), three products onto
        h_ext^T (lo x lo, ~2^-16 relative, dropped), one commit -- without M (the first segment and no initial
        state) end = h_ext. Then the end state is stored and its flag set (gpu-scope fence, release store)."""
        io = self.io_dtype
        if needs_m:
            a_hi = wt.acc_to_a(io, acc_s)
            a_lo = wt.acc_to_a_lo(io, acc_s)
            # M^T landed row-major (k_in, k_out); viewed (k_out, k_in) it is an MN-major B (N, K)
            sMhi = wt.smem_view(st.sMhi, io, K_DIM, K_DIM, 1, True)[None, None, 0]
            sMlo = wt.smem_view(st.sMlo, io, K_DIM, K_DIM, 1, True)[None, None, 0]
            wt.gemm_rs(io, wtid, nxt, a_hi, sMhi, True, True, K_DIM, wait=False)
            wt.gemm_rs(io, wtid, nxt, a_hi, sMlo, True, True, K_DIM, wait=False)
            wt.gemm_rs(io, wtid, nxt, a_lo, sMhi, True, True, K_DIM, wait=False)
            warpgroup.wait_group(0)
        self.store_fragment(nxt, mWs, lb_fragment(1, slot, head, blk, num_heads, n_vb, slots, wtid))
        cute.arch.barrier(barrier_id=1, number_of_threads=128)   # every thread's stores before the release
        if wtid == 0:
            cute.arch.fence_acq_rel_gpu()
            cute.arch.store(mFlags.iterator + lb_flag(slot, head, blk, num_heads, n_vb, slots, True), Int32(1),
                            sem="release", scope="gpu")

    @cute.jit
    def lookback_publish_summary(self, work, head, v0, is_m, acc_s, cc_s, wtid, mFlags, mWs, mMg, num_heads,
                                 n_vb):
        """`lookback`, summary tile: h_ext^T's fragment -> lb_ws (part 0), or M's columns [v0, v0 + 64) (M^T's
        rows) as hi / lo -> lb_m; then thread 0 adds 1 (release, after a gpu-scope fence) to the summary count of
        h_ext's V block, or of every V block (an M block: every output block's link reads all of M)."""
        io = self.io_dtype
        slot = work.seg_slot
        slots = mWs.shape[0] // (2 * num_heads * n_vb * 128 * 64)
        if is_m:
            # M^T's rows [v0, v0 + 64): row k_in of M^T holds M[:, k_in], so this thread's values (M^T's row
            # v0 + vv, columns kk) are column pairs of its rows
            g_hi = cute.domain_offset((v0, 0), mMg[slot, head, None, None])
            g_lo = cute.domain_offset((v0, 0), mMg[slots + slot, head, None, None])
            for i in cutlass.range_constexpr(cute.size(acc_s)):
                vv, kk = cc_s[i]
                hi = io(acc_s[i])
                g_hi[vv, kk] = hi
                g_lo[vv, kk] = io(acc_s[i] - Float32(hi))
            cute.arch.fence_proxy("async.global")   # (the reader fences too) M^T is read by TMA
        else:
            self.store_fragment(acc_s, mWs, lb_fragment(0, slot, head, v0 // V_BLOCK, num_heads, n_vb, slots,
                                                        wtid))
        cute.arch.barrier(barrier_id=1, number_of_threads=128)
        if wtid == 0:
            cute.arch.fence_acq_rel_gpu()
            if is_m:
                for jj in cutlass.range(n_vb, unroll=1):
                    cute.arch.atomic_add(mFlags.iterator + lb_flag(slot, head, jj, num_heads, n_vb, slots, False),
                                         Int32(1), sem="release", scope="gpu")
            else:
                cute.arch.atomic_add(mFlags.iterator + lb_flag(slot, head, v0 // V_BLOCK, num_heads, n_vb, slots,
                                                               False), Int32(1), sem="release", scope="gpu")

    @cute.jit
    def load_fragment(self, acc, mWs, offset):
        """acc (64 fp32 of one consumer thread) <- mWs[offset, offset + 64) (16-byte vectors)."""
        src = cute.make_tensor(mWs.iterator + cute.assume(offset, divby=64), cute.make_layout(cute.size(acc)))
        cute.autovec_copy(src, cute.make_tensor(acc.iterator, cute.make_layout(cute.size(acc))))

    @cute.jit
    def store_fragment(self, acc, mWs, offset):
        """mWs[offset, offset + 64) <- acc (64 fp32 of one consumer thread)."""
        dst = cute.make_tensor(mWs.iterator + cute.assume(offset, divby=64), cute.make_layout(cute.size(acc)))
        cute.autovec_copy(cute.make_tensor(acc.iterator, cute.make_layout(cute.size(acc))), dst)

    @cute.jit
    def load_start_state(self, work, head, v0, is_m, acc_s, cc_s, mS0, transposed: bool):
        """The tile's start state into acc_s (coordinates cc_s: (k, v), or (v, k) when `transposed`): summary h
        blocks from 0, M blocks from the identity; segment outputs from start_states[seg_slot]; forward (and
        lookback's first segments) from initial_state[seq] or 0."""
        src = work.seq   # work fields are loads from the tile table: read each once
        if cutlass.const_expr(self.mode == "segment_outputs"):
            src = work.seg_slot
        for i in cutlass.range_constexpr(cute.size(acc_s)):
            a, b = cc_s[i]
            kk, vv = (b, a) if transposed else (a, b)
            if cutlass.const_expr(self.mode == "summary"):
                acc_s[i] = cutlass.select_(is_m and kk == v0 + vv, Float32(1.0), Float32(0.0))
            elif cutlass.const_expr(self.mode == "segment_outputs" or self.has_initial_state):
                acc_s[i] = mS0[src, head, kk, v0 + vv]
            else:
                acc_s[i] = Float32(0.0)

    @cute.jit
    def store_end_state(self, work, head, v0, is_m, acc_s, cc_s, mSN, transposed: bool):
        """Summary: h_ext -> summary[slot], M -> summary[slots + slot] (affine_merge's halves); else the final
        state of the sequence's last segment, if stored."""
        if cutlass.const_expr(self.mode == "summary"):
            dst = work.seg_slot
            if is_m:
                dst = dst + mSN.shape[0] // 2
            for i in cutlass.range_constexpr(cute.size(acc_s)):
                a, b = cc_s[i]
                kk, vv = (b, a) if transposed else (a, b)
                mSN[dst, head, kk, v0 + vv] = acc_s[i]
        elif cutlass.const_expr(self.store_final_state):
            if work.is_last_segment:
                seq = work.seq
                for i in cutlass.range_constexpr(cute.size(acc_s)):
                    a, b = cc_s[i]
                    kk, vv = (b, a) if transposed else (a, b)
                    mSN[seq, head, kk, v0 + vv] = acc_s[i]

    @cute.jit
    def rs_fragments(self, wtid, st):
        """The rs consumers' views: KDA's decay buffers (by chunk parity), the (v, n) coordinates of the S^T and
        of the [64 x 64] accumulators, and the accumulators S^T [64 x 128], v_new^T and o^T [64 x 64] (fp32)."""
        io = self.io_dtype
        sDecay = st.sDecay.get_tensor(cute.make_layout((K_DIM, 2), stride=(1, K_DIM)))
        thr_s = wt.make_mma_rs(io, True, K_DIM).get_slice(wtid)    # S^T += v_new^T kg   (64 x 128, K = tokens)
        thr_t = wt.make_mma_rs(io, False, C).get_slice(wtid)       # x^T = A y^T          (64 x 64)
        cc_s = thr_s.partition_C(cute.make_identity_tensor((V_BLOCK, K_DIM)))
        cc_t = thr_t.partition_C(cute.make_identity_tensor((V_BLOCK, C)))
        acc_s = cute.make_rmem_tensor(thr_s.partition_shape_C((V_BLOCK, K_DIM)), Float32)
        acc_v = cute.make_rmem_tensor(thr_t.partition_shape_C((V_BLOCK, C)), Float32)
        acc_o = cute.make_rmem_tensor(thr_t.partition_shape_C((V_BLOCK, C)), Float32)
        return sDecay, cc_s, cc_t, acc_s, acc_v, acc_o

    @cute.jit
    def consumer_rs(self, sched, load, wtid, j, sQg, sW, sKg_mn, sU, sA, mEg, mO, mS0, mSN, st, tma_os, mOT,
                    mFlags, mWs, mMg):
        """`rs`: the state chain in registers (see the class docstring) of consumer warpgroup j (`pair`: 0 or 1,
        the work tile's two V blocks; else 0). Accumulators are indexed (v, n): v the row of S^T (a V column of the
        block), n a channel (S^T) or a token (v_new^T, o^T)."""
        io = self.io_dtype
        sDecay, cc_s, cc_t, acc_s, acc_v, acc_o = self.rs_fragments(wtid, st)
        sEg = st.sEg.get_tensor(cute.make_layout((self.eg_slot(), self.num_stages), stride=(1, self.eg_slot())))
        sO = wt.smem_view(st.sO, io, C, V_BLOCK, 2)   # tma_o: (token, v, buffer), the TMA store's source
        o_tiles = Int32(0)   # tma_o: o tiles stored through smem so far (their parity picks the buffer)
        uflat = cute.make_tensor(st.sU.data_ptr(), cute.make_layout(C * V_BLOCK * self.num_stages))   # u_fast
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.num_stages)

        n_vb = mO.shape[2] // V_BLOCK
        chunks_done = Int32(0)   # KDA's decay buffer alternates with every chunk, across tiles too
        p0 = cutlass.Int64(0)    # profile: cycles per phase, summed over chunks
        p1 = cutlass.Int64(0)
        p2 = cutlass.Int64(0)
        p3 = cutlass.Int64(0)
        p4 = cutlass.Int64(0)
        work = sched.initial_work()
        views = (sDecay, cc_s, cc_t, acc_s, acc_v, acc_o, sEg, sO, uflat, n_vb)
        if cutlass.const_expr(self.lookback):
            # one tile per CTA (its ticket): the chain is compiled twice, for output and for summary tiles, so
            # neither has a runtime branch around its wgmma groups (one made ptxas serialize every wgmma, C7514)
            if work.block < n_vb:
                self.tile_rs(work, True, load, state, wtid, j, views, sQg, sW, sKg_mn, sU, sA, mEg, mO, mS0, mSN,
                             st, tma_os, mOT, mFlags, mWs, mMg, chunks_done, o_tiles, p0, p1, p2, p3, p4)
            else:
                self.tile_rs(work, False, load, state, wtid, j, views, sQg, sW, sKg_mn, sU, sA, mEg, mO, mS0, mSN,
                             st, tma_os, mOT, mFlags, mWs, mMg, chunks_done, o_tiles, p0, p1, p2, p3, p4)
        else:
            while work.is_valid:
                state, chunks_done, o_tiles, p0, p1, p2, p3, p4 = self.tile_rs(
                    work, self.outputs, load, state, wtid, j, views, sQg, sW, sKg_mn, sU, sA, mEg, mO, mS0, mSN,
                    st, tma_os, mOT, mFlags, mWs, mMg, chunks_done, o_tiles, p0, p1, p2, p3, p4)
                work = sched.advance(work)

        if cutlass.const_expr(self.tma_o):
            if wtid == 0:
                cute.arch.cp_async_bulk_wait_group(0)   # every o tile written before the CTA (and its smem) ends
        if cutlass.const_expr(self.profile):
            if wtid == 0 and j == 0:
                bid, _, _ = cute.arch.block_idx()
                flat = cute.make_tensor(mSN.iterator, cute.make_layout(cute.size(mSN)))
                for k, val in enumerate((p0, p1, p2, p3)):
                    flat[8 * bid + k] = Float32(val)
                flat[8 * bid + 4] = Float32(chunks_done)
                flat[8 * bid + 5] = Float32(p4)

    @cute.jit
    def tile_rs(self, work, has_o: bool, load, state, wtid, j, views, sQg, sW, sKg_mn, sU, sA, mEg, mO, mS0, mSN,
                st, tma_os, mOT, mFlags, mWs, mMg, chunks_done, o_tiles, p0, p1, p2, p3, p4):
        """One work tile of `consumer_rs`: start state, the chain over its chunks, end state. `has_o` (compile
        time): whether it stores o (every mode but summary; lookback: output tiles). Returns the values carried
        from tile to tile (pipeline state, chunk count, o tiles stored, profile cycles)."""
        io = self.io_dtype
        sDecay, cc_s, cc_t, acc_s, acc_v, acc_o, sEg, sO, uflat, n_vb = views
        head = work.head
        v0, is_m = self.tile_columns(work, n_vb, j)
        tok0 = work.tok_start
        tok_end = work.tok_end
        if cutlass.const_expr(self.lookback):
            self.lookback_start(work, head, v0, is_m, has_o, acc_s, cc_s, mS0, st, wtid, mFlags, mWs,
                                mEg.shape[1], n_vb)
        else:
            self.load_start_state(work, head, v0, is_m, acc_s, cc_s, mS0, True)

        for c in cutlass.range(work.chunk_end - work.chunk_start, unroll=1):
            ta = cutlass.Int64(0)
            if cutlass.const_expr(self.profile):
                ta = cute.arch.clock64()
            t0, L = chunk_rows(tok0, tok_end, c)
            buf = chunks_done % 2
            chunks_done = chunks_done + 1
            dg = Float32(1.0)
            if cutlass.const_expr(not self.ring_decay):
                if cutlass.const_expr(self.kda):
                    # this buffer was last read two chunks ago, before the previous chunk's barrier
                    sDecay[wtid, buf] = mEg[t0 + L - 1, head, wtid]
                    cute.arch.barrier(barrier_id=1, number_of_threads=128)
                else:
                    dg = Float32(mEg[t0 + L - 1, head])
            load.consumer_wait(state)
            stage = state.index
            if cutlass.const_expr(self.raw_qk):
                dg = sEg[2 * C, stage]
            elif cutlass.const_expr(self.ring_decay and not self.kda):
                dg = sEg[0, stage]
            tb = cutlass.Int64(0)
            if cutlass.const_expr(self.profile):
                tb = cute.arch.clock64()
            # v_new^T = u^T - S^T w^T and o^T = S^T qg^T, one commit (A = S^T from registers)
            rS = wt.acc_to_a(io, acc_s)
            wt.gemm_rs(io, wtid, acc_v, rS, sW[None, None, stage], False, False, C, wait=False)
            if has_o:
                wt.gemm_rs(io, wtid, acc_o, rS, sQg[None, None, stage], False, False, C, wait=False)
            warpgroup.wait_group(0)
            tc = cutlass.Int64(0)
            if cutlass.const_expr(self.profile):
                tc = cute.arch.clock64()
            if cutlass.const_expr(self.raw_qk):
                if has_o:
                    for i in cutlass.range_constexpr(cute.size(acc_o)):   # o^T's column n: times 2^G_n scale
                        _, n = cc_t[i]
                        acc_o[i] = acc_o[i] * sEg[n, stage]
            if cutlass.const_expr(self.fold):   # R^T = v^T - P^T diag(2^G)
                for i in cutlass.range_constexpr(cute.size(acc_v)):
                    _, n = cc_t[i]
                    acc_v[i] = acc_v[i] * sEg[C + n, stage]
            if cutlass.const_expr(self.u_fast):
                self.sub_u_fast(acc_v, cc_t, uflat, stage, wtid, is_m, L)
            else:
                self.sub_u(acc_v, cc_t, sU, V_BLOCK * j, stage, is_m, L, True)
            rV = wt.acc_to_a(io, acc_v)
            rVk = rV   # the state update's A operand
            if cutlass.const_expr(self.raw_qk and not self.fold):
                for i in cutlass.range_constexpr(cute.size(acc_v)):   # column n: times 2^(G_last - G_n)
                    _, n = cc_t[i]
                    acc_v[i] = acc_v[i] * sEg[C + n, stage]
                rVk = wt.acc_to_a(io, acc_v)
            tc2 = cutlass.Int64(0)
            if cutlass.const_expr(self.profile):
                tc2 = cute.arch.clock64()
            # o^T += v_new^T Aqk^T and S^T <- S^T diag(exp(G_last)) + v_new^T kg, one commit (A = v_new^T)
            if has_o:
                wt.gemm_rs(io, wtid, acc_o, rV, sA[None, None, stage], False, True, C, wait=False)
            for i in cutlass.range_constexpr(cute.size(acc_s)):
                if cutlass.const_expr(self.kda and self.ring_decay):
                    _, kk = cc_s[i]
                    acc_s[i] = acc_s[i] * sEg[kk, stage]
                elif cutlass.const_expr(self.kda):
                    _, kk = cc_s[i]
                    acc_s[i] = acc_s[i] * sDecay[kk, buf]
                else:
                    acc_s[i] = acc_s[i] * dg
            wt.gemm_rs(io, wtid, acc_s, rVk, sKg_mn[None, None, stage], True, True, K_DIM, wait=False)
            if has_o:
                # o^T is done one group before the state update: store it while the update runs
                warpgroup.wait_group(1)
                if cutlass.const_expr(self.tma_o):
                    if L == C:
                        ob = o_tiles % 2
                        o_tiles = o_tiles + 1
                        self.store_o_t_tma(acc_o, cc_t, sO, ob, wtid, tma_os, mOT, head, t0, v0)
                    else:
                        self.store_o_t(acc_o, cc_t, mO, head, t0, v0, L)
                elif cutlass.const_expr(self.summary_o):   # h_ext blocks: o from zero; M blocks: qm
                    if is_m:
                        self.store_o_t(acc_o, cc_t, mMg, head, t0, v0, L)
                    else:
                        self.store_o_t(acc_o, cc_t, mO, head, t0, v0, L)
                else:
                    self.store_o_t(acc_o, cc_t, mO, head, t0, v0, L)
            td = cutlass.Int64(0)
            if cutlass.const_expr(self.profile):
                td = cute.arch.clock64()
            warpgroup.wait_group(0)
            load.consumer_release(state)
            state.advance()
            if cutlass.const_expr(self.profile):
                te = cute.arch.clock64()
                p0 = p0 + (tb - ta)
                p1 = p1 + (tc - tb)
                p2 = p2 + (tc2 - tc)
                p3 = p3 + (te - td)
                p4 = p4 + (td - tc2)

        if cutlass.const_expr(self.lookback):
            if has_o:
                self.store_end_state(work, head, v0, is_m, acc_s, cc_s, mSN, True)
            else:
                self.lookback_publish_summary(work, head, v0, is_m, acc_s, cc_s, wtid, mFlags, mWs, mMg,
                                              mEg.shape[1], n_vb)
        elif cutlass.const_expr(not self.profile):
            self.store_end_state(work, head, v0, is_m, acc_s, cc_s, mSN, True)
        return state, chunks_done, o_tiles, p0, p1, p2, p3, p4

    @cute.jit
    def sub_u(self, acc, coords, sU, u0, stage, is_m, L, transposed: bool):
        """v_new = u - (w S): acc <- u - acc (u: the stage's columns from u0), rows past the chunk end (token >=
        L) 0; summary mode's M blocks use u = 0. `coords` are the accumulator's (token, v), or (v, token) when
        `transposed` (rs)."""
        for i in cutlass.range_constexpr(cute.size(acc)):
            a, b = coords[i]
            n, vv = (b, a) if transposed else (a, b)
            uval = Float32(sU[n, u0 + vv, stage])
            if cutlass.const_expr(self.mode in ("summary", "lookback")):
                uval = cutlass.select_(is_m, Float32(0.0), uval)
            acc[i] = cutlass.select_(n < L, uval - acc[i], Float32(0.0))

    @cute.jit
    def sub_u_fast(self, acc_v, cc_t, uflat, stage, wtid, is_m, L):
        """u_fast: acc_v <- u^T - acc_v (rows >= L of a partial chunk: 0). Accumulator value i of a 64 x 64 wgmma
        is (v, n) = (v_t + 8 r2, n_t + c2 + 8 j) for i = c2 + 2 r2 + 4 j (v_t = 16 warp + lane / 4, n_t =
        2 (lane % 4)); tests/test_two_phase.py checks this and `u_tile_offset` against CuTe's layouts."""
        lane = wtid % 32
        v_t = 16 * (wtid // 32) + lane // 4
        n_t = 2 * (lane % 4)
        for i in cutlass.range_constexpr(cute.size(acc_v)):
            c2, r2, j = i % 2, (i // 2) % 2, i // 4
            uval = Float32(uflat[u_tile_offset(stage, v_t + 8 * r2, n_t + c2, j)])
            if cutlass.const_expr(self.mode == "summary"):
                uval = cutlass.select_(is_m, Float32(0.0), uval)
            acc_v[i] = uval - acc_v[i]
        if L < C:   # warp-uniform: only a tile's last chunk can be partial
            for i in cutlass.range_constexpr(cute.size(acc_v)):
                _, n = cc_t[i]
                acc_v[i] = cutlass.select_(n < L, acc_v[i], Float32(0.0))

    @cute.jit
    def store_o_t_tma(self, acc_o, cc_t, sO, ob, wtid, tma_os, mOT, head, t0, v0):
        """tma_o: o^T of a full chunk -> smem buffer `ob` (as o's (token, v) tile) -> one TMA store by thread 0.
        Buffer reuse: thread 0 waits, before the barrier, until every earlier TMA store has read its smem, so the
        store that last used the other buffer is done before anyone passes this barrier and writes it."""
        for i in cutlass.range_constexpr(cute.size(acc_o)):
            vv, n = cc_t[i]
            sO[n, vv, ob] = self.io_dtype(acc_o[i])
        cute.arch.fence_proxy("async.shared", space="cta")
        if wtid == 0:
            cute.arch.cp_async_bulk_wait_group(0, read=True)
        cute.arch.barrier(barrier_id=2, number_of_threads=128)
        if wtid == 0:
            g_tile = cute.local_tile(cute.domain_offset((t0, 0), mOT[None, None, head]), (C, V_BLOCK),
                                     (0, v0 // V_BLOCK))
            s_part, g_part = cpasync.tma_partition(
                tma_os, 0, cute.make_layout(1), cute.group_modes(sO, 0, 2), cute.group_modes(g_tile, 0, 2),
            )
            cute.copy(tma_os, s_part[(None, ob)], g_part)
            cute.arch.cp_async_bulk_commit_group()

    @cute.jit
    def store_o_t(self, acc_o, cc_t, mO, head, t0, v0, L):
        """o^T (accumulator indexed (v, token)) of the chunk at t0 -> o[t0 + n, head, v0 + v] for rows n < L."""
        gO = cute.domain_offset((t0, v0), mO[None, head, None])
        for i in cutlass.range_constexpr(cute.size(acc_o)):
            vv, n = cc_t[i]
            if n < L:
                gO[n, vv] = self.io_dtype(acc_o[i])


@cute.jit
def chunk_rows(tok0, tok_end, c):
    """(t0, L): the first token of chunk c of a tile starting at tok0, and its rows (< C only at the tile's end)."""
    t0 = tok0 + c * C
    L = tok_end - t0
    if L > C:
        L = Int32(C)
    return t0, L


def u_tile_offset(stage, v, n0, j):
    """Element offset of u[8 j + n0, v] in stage `stage` of the state pass's u ring (64 x 64 16-bit tiles, K-major,
    128-byte swizzle: the 16-byte column group of row n is XORed with n % 8), for n0 < 8. The 8-row blocks are
    512 elements apart and the swizzle only involves n0, so j only adds a constant."""
    return stage * (C * V_BLOCK) + n0 * V_BLOCK + (v ^ (n0 << 3)) + 8 * V_BLOCK * j


def lb_flag(slot, head, blk, num_heads, n_vb, slots, end: bool):
    """`lookback`: the index in `flags` of the summary count (`end` False) or the end flag (True) of (slot, head,
    V block); index 0 is the ticket counter."""
    i = 1 + (slot * num_heads + head) * n_vb + blk
    if end:
        i = i + slots * num_heads * n_vb
    return i


def lb_fragment(part, slot, head, blk, num_heads, n_vb, slots, wtid):
    """`lookback`: the offset in `lb_ws` of consumer thread wtid's 64 floats of h_ext^T (part 0) or of the end
    state (part 1) of (slot, head, V block)."""
    return ((((part * slots + slot) * num_heads + head) * n_vb + blk) * 128 + wtid) * 64
