"""SM100 (Blackwell) fused chunked forward of the gated delta rule: GDN (a scalar decay per head and token) and, with
`kda`, KDA (a decay per key channel). `ChunkedForwardSm90`'s contract, modes and work tiles, with tcgen05 MMAs into
tensor memory and the state S in TMEM for the whole tile. Compiled and checked on the CPU; not yet run on hardware.
Float64 spec: `cute_kernels.reference.chunk_gated_delta_rule_ref`; the steps: `tests/test_sm100_fused_model.py`.

Every product has M = 128 rows, one TMEM lane per row, so thread t of a compute warpgroup owns lane t of every
accumulator. The chunk's 64-row products become 128-row ones two ways: the intra-chunk products stack k over q
([k; q] k^T gives k k^T in lanes 0-63 and q k^T in lanes 64-127), and the rest are computed transposed (lanes are
value or key channels, columns are tokens).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils as utils
import cutlass.utils.blackwell_helpers as sm100_utils
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import cpasync, tcgen05

from schedulers.device import TileScheduler

from ..chunk_math import AKK_STRIDE, KDA_ANCHOR_LIMIT, LOG2E, SOLVE_Y_MMA, C, ChunkMath
from ..configs import FusedConfig
from ..views import flat, thd
from .budgets import KDA_BAND_COLS, KDA_BAND_ROWS, KDA_BANDS, check_smem, fused_kda_tmem_plan, fused_tmem_plan
from .tmem_copy import column_copies

D = 128                    # key and value head dimension
HALF_D = 64                # one 128-byte swizzle atom of a 16-bit row
NUM_STAGES = 2             # q/k/v ring depth (KDA: 1, its gated tiles take the room)
COMPUTE_THREADS = 256      # two warpgroups (`ChunkMath` runs on 256 threads); both cover all 128 lanes
MMA_WARP, LOAD_WARP = 8, 9
THREADS = 32 * 10
COLS = 32                  # TMEM columns per tcgen05.ld / st
BANDS_ROWS = sum(KDA_BANDS)   # KDA: rows of the right factors' tile (160)


class ChunkedForwardSm100:
    """Fused GDN / KDA forward on Blackwell: one CTA per work tile (sequence, head, chunk range), S in TMEM.

    Warp roles (320 threads, 1 CTA per SM):
    - warps 0-7, compute (two warpgroups, `ChunkMath`'s 256 threads; thread t owns TMEM lane t % 128, warpgroup j
      columns [32 j, 32 j + 32) of a 64-column region, [64 j, 64 j + 64) of S): the gates, Akk and Aqk from the
      intra products, the solve, U (transposed, to smem), v_new^T out of TMEM (to smem), S's decay in TMEM,
      o^T = O + (q S)^T (gated) to global, S to bf16 smem for the next chunk's products (and the tile's start /
      final state). KDA: also the per-channel gate scan (thread t: key channel t % 128, rows [32 j, 32 j + 32))
      and the gated 16-bit tiles the products read.
    - warp 8, MMA (one elected lane issues, `tcgen05.mma` cta_group 1, M = 128): per chunk the intra products
      (GDN: A = [k; q] k^T; KDA: four bands A_delta = [kl; ql] right_delta^T) and KQS = S^T [k; q]^T (KDA:
      [kg; qg]); VN = U^T Xv^T; then O = VN^T Aqk^T and S += k^T (2^(G_L - G) v_new) (KDA: kb^T v_new).
    - warp 9, load: TMA of k and q (two 64-column boxes each, into the stacked [k; q] tile) and v (one plain box).
    Pipelines: `load` (TMA -> MMA, `num_stages` stages: GDN 2, released by the MMA's commit after the state
    update; KDA 1, released after the VN product, the compute warps being done with k, q and v; the compute
    warps wait on it too), and one-stage handoffs: `kqs` (MMA -> compute: A and KQS in TMEM; released once q S
    is read, at the chunk's end), `u_ready` (compute -> MMA: U and Xv written), `vn_full` (MMA -> compute: VN in
    TMEM), `vn_written` (compute -> MMA: v_new written, S decayed), `upd_full` (MMA -> compute: O and the new S
    in TMEM), `state_ready` (compute -> MMA: S in bf16 smem, and KDA's gated tiles; released when the intra and
    KQS products have read them). Named barrier 1: the compute threads (also `ChunkMath`'s); 2: TMEM allocation.
    TMEM: GDN `fused_tmem_plan` (448 columns used), KDA `fused_kda_tmem_plan` (432); 512 allocated. Shared
    memory ~200 KB (GDN), ~222 KB (KDA).

    GDN, per chunk (rows r < L; lanes d are value channels unless said):
      0. gates (`ChunkMath.gdn_gates`): G_r (log2), 2^G_r, 2^(G_L - G_r), beta_r.
      1. Akk[r, c] = beta_r 2^(G_r - G_c) k_r.k_c (c < r < L) -> fp32 smem; Aqk[r, c] = scale 2^(G_r - G_c)
         q_r.k_c (c <= r) -> bf16; U^T[d, c] = v[c, d] - 2^G_c (k S)[c, d] -> bf16 (summary block 1: v = 0).
      2. X = (I + Akk)^-1 (`ChunkMath.solve_blocked`) -> Xv = X diag(beta); MMA: v_new^T = U^T Xv^T.
      3. v_new^T -> bf16, and 2^(G_L - G_r) v_new^T; S *= 2^G_L in TMEM. MMA: O = v_new^T Aqk^T, S += k^T v_new~.
      4. o[r, d] = O[d, r] + scale 2^G_r (q S)[r, d] (rows < L); S -> bf16 smem (or, at the tile's end, out).
    KDA (G[r, d] per key channel; docs/design.md "The SM100 KDA plan", model: tests/test_sm100_fused_model.py):
      0. the scan G[r, d] (`kda_gate_scan`), then the tiles (`kda_tiles`): left [k; q] 2^(G - G_a(r)) (a(r): the
         first row of r's 16-row block), right_delta[i] = k_i 2^(G_(a(i) + 16 delta) - G_i), [kg; qg] = [k; q] 2^G,
         kb = k 2^(G_L - G).
      1. Akk / Aqk from band r // 16 - c // 16 of the intra products; a chunk where some 16-row block decays by more
         than `KDA_ANCHOR_LIMIT` in some channel takes its diagonal blocks from exact sums instead
         (`kda_exact_diagonal`); U^T = v^T - (kg S)^T.
      2. as GDN.  3. v_new^T -> bf16; S[d, :] *= 2^G_L[d] (per lane).  4. o = O^T + scale (qg S).
    Modes as `ChunkedForwardSm90` (`FusedConfig.mode`): forward, summary (block 0 h_ext from 0, block 1 M from I
    with zero v), segment_outputs.
    """

    def __init__(self, config: FusedConfig, io_dtype, beta_dtype):
        self.config = config
        self.kda = config.kda
        self.io_dtype = io_dtype
        self.beta_dtype = beta_dtype
        self.mode = config.mode
        self.outputs = config.mode != "summary"
        self.has_initial_state = config.initial_state
        self.store_final_state = config.final_state
        self.math = ChunkMath(io_dtype, config.kda, "tf32", gate=config.gate)
        self.num_stages = 1 if config.kda else NUM_STAGES
        self.tmem = fused_kda_tmem_plan() if config.kda else fused_tmem_plan()
        self.tma_bytes = 3 * C * D * io_dtype.width // 8

    # ------------------------------------------------------------------ host side

    def _mma(self, n: int, a_mn_major: bool):
        """A 1-CTA tcgen05 MMA of 128 x n x 16, both operands from shared memory, B K-major."""
        major = lambda mn: tcgen05.OperandMajorMode.MN if mn else tcgen05.OperandMajorMode.K   # noqa: E731
        op = tcgen05.MmaF16BF16Op(self.io_dtype, Float32, (128, n, 16), tcgen05.CtaGroup.ONE,
                                  tcgen05.OperandSource.SMEM, major(a_mn_major), major(False))
        return cute.make_tiled_mma(op)

    def _mmas(self):
        """(intra: [k; q] k^T, or KDA's four bands [kl; ql] right_delta^T; kqs: S^T [k; q]^T; tok: 128 x 64 x 64
        products over tokens (VN, O); update: k^T v_new~ or kb^T v_new)."""
        intra = tuple(self._mma(n, False) for n in KDA_BANDS) if self.kda else self._mma(C, False)
        return intra, self._mma(2 * C, True), self._mma(C, False), self._mma(D, True)

    @cute.jit
    def __call__(
        self,
        q: cute.Tensor,            # [B, T, H, 128] (flattened here; tiles carry token offsets)
        k: cute.Tensor,
        v: cute.Tensor,            # [B, T, HV, 128]
        g: cute.Tensor,            # [B, T, HV] fp32 (KDA: [B, T, HV, 128])
        beta: cute.Tensor,         # [B, T, HV]
        a_log: cute.Tensor,        # [HV] fp32 (config.gate.a_log; else any fp32 tensor)
        dt_bias: cute.Tensor,      # [HV] fp32, KDA [HV * 128] (config.gate.dt_bias; else any fp32 tensor)
        lower_bound: Float32,
        o: cute.Tensor,            # [B, T, HV, 128]
        initial_state: cute.Tensor,  # [N, HV, 128, 128] fp32; segment_outputs: [slots, HV, 128, 128]
        final_state: cute.Tensor,    # [N, HV, 128, 128] fp32; summary: [2 * slots, HV, 128, 128]
        tiles: cute.Tensor,        # [num_tiles, NUM_TILE_FIELDS] int32
        num_tiles: Int32, grid_x: Int32, scale: Float32, stream,
    ):
        io = self.io_dtype
        stages = self.num_stages
        q, k, v, g, beta, o = flat(q), flat(k), flat(v), flat(g), flat(beta), flat(o)
        # a 64 x 64 box of q or k (one swizzle atom wide) and a plain 64 x 128 box of v
        box_layout = self.swizzled(None, (C, HALF_D), (HALF_D, 1))
        op = cpasync.CopyBulkTensorTileG2SOp()
        tma_q, tma_q_t = cpasync.make_tiled_tma_atom(op, thd(q), box_layout, (C, HALF_D))
        tma_k, tma_k_t = cpasync.make_tiled_tma_atom(op, thd(k), box_layout, (C, HALF_D))
        tma_v, tma_v_t = cpasync.make_tiled_tma_atom(op, thd(v), cute.make_layout((C, D), stride=(D, 1)), (C, D))
        gdn = lambda n: 8 if self.kda else n        # noqa: E731   fields only one of the two uses
        kda = lambda n: n if self.kda else 8        # noqa: E731
        big = lambda n: 1024 if n > 8 else 16       # noqa: E731   (swizzled tiles start on 1 KB)

        @cute.struct
        class SharedStorage:
            load_mbar: cute.struct.MemRange[cutlass.Int64, stages * 2]
            handoff_mbar: cute.struct.MemRange[cutlass.Int64, 12]   # six one-stage pipelines
            tmem_holding: Int32
            sKQ: cute.struct.Align[cute.struct.MemRange[io, 2 * C * D * stages], 1024]   # [k; q] per stage
            sV: cute.struct.Align[cute.struct.MemRange[io, C * D * stages], 1024]
            sS: cute.struct.Align[cute.struct.MemRange[io, D * D], 1024]          # S [dk, dv], bf16
            sU: cute.struct.Align[cute.struct.MemRange[io, D * C], 1024]          # U^T, then v_new^T [dv, token]
            # GDN
            sVnD: cute.struct.Align[cute.struct.MemRange[io, gdn(D * C)], big(gdn(D * C))]   # (2^(G_L-G) v_new)^T
            sXv: cute.struct.Align[cute.struct.MemRange[io, gdn(C * C)], big(gdn(C * C))]
            sAqk: cute.struct.Align[cute.struct.MemRange[io, gdn(C * C)], big(gdn(C * C))]
            sAkk: cute.struct.Align[cute.struct.MemRange[Float32, gdn(C * AKK_STRIDE)], 16]   # A, then X^T above
            sY: cute.struct.Align[cute.struct.MemRange[Float32, gdn(SOLVE_Y_MMA)], 16]
            sG: cute.struct.MemRange[Float32, gdn(C)]
            sEG: cute.struct.MemRange[Float32, gdn(C)]
            sEGL: cute.struct.MemRange[Float32, gdn(C)]
            # KDA
            sLeft: cute.struct.Align[cute.struct.MemRange[io, kda(2 * C * D)], big(kda(2 * C * D))]   # then G fp32
            sKG: cute.struct.Align[cute.struct.MemRange[io, kda(2 * C * D)], big(kda(2 * C * D))]     # [kg; qg]
            sKb: cute.struct.Align[cute.struct.MemRange[io, kda(C * D)], big(kda(C * D))]
            sBands: cute.struct.Align[cute.struct.MemRange[io, kda(BANDS_ROWS * D)], big(kda(BANDS_ROWS * D))]
            sAnchor: cute.struct.MemRange[Float32, kda(4 * D)]    # G[16 m, d], m = 0..3
            sHalf: cute.struct.MemRange[Float32, kda(D)]          # G[31, d]: rows 0-31's total, for rows 32-63
            sGL: cute.struct.MemRange[Float32, kda(D)]            # G[L - 1, d]
            sFlag: cute.struct.MemRange[Int32, 2]                 # KDA: exact diagonals this chunk (2 slots)
            sBeta: cute.struct.MemRange[Float32, C]

        self.shared_storage = SharedStorage
        self.smem_bytes = SharedStorage.size_in_bytes()
        check_smem(self.smem_bytes, 1, "ChunkedForwardSm100")
        self.kernel(self._mmas(), tma_q, tma_q_t, tma_k, tma_k_t, tma_v, tma_v_t, g, beta, a_log, dt_bias,
                    lower_bound, o, initial_state, final_state, tiles, num_tiles, scale).launch(
            grid=[grid_x, 1, 1], block=[THREADS, 1, 1], stream=stream, min_blocks_per_mp=1)

    def swizzled(self, field, shape, stride, offset: int = 0):
        """A 128-byte-swizzled 16-bit tile of (shape, stride) in elements, `offset` elements into a struct field (or,
        field None, the composed layout). Every tile here is built from whole 8-row x 64-column swizzle atoms at
        1 KB-aligned offsets, so one swizzle serves any arrangement of the atoms (what the MMA descriptors and the
        TMA boxes read)."""
        swizzle = sm100_utils.make_smem_layout_a(self._mma(C, False), (128, C, HALF_D), self.io_dtype, 1).inner
        layout = cute.make_layout(shape, stride=stride)
        if field is None:
            return cute.make_composed_layout(swizzle, 0, layout)
        ptr = field.get_tensor(cute.make_layout(1)).iterator + offset
        return cute.make_tensor(cute.recast_ptr(ptr, swizzle, self.io_dtype), layout)

    def fp32_view(self, field, layout, offset: int = 0):
        """An fp32 view of a 16-bit struct field, `offset` 16-bit elements in (KDA's Akk, Y and G reuse tiles)."""
        ptr = field.get_tensor(cute.make_layout(1)).iterator + offset
        return cute.make_tensor(cute.recast_ptr(ptr, dtype=Float32), layout)

    # Stacked [k; q] tiles: rows 0-63 k, 64-127 q, two 64-column halves 128 rows apart, so that every 8-row group
    # of all 128 rows is 1 KB from the next (one MMA descriptor over both) and each 64 x 64 box is one TMA.
    KQ_HALF = 2 * C * HALF_D       # elements between the column halves
    KQ_STAGE = 2 * C * D           # elements between stages
    BANDS_HALF = BANDS_ROWS * HALF_D

    def kq_rows(self, field, rows: int, first_row: int):
        """(row, channel, stage) view of `rows` rows of the stacked stage tile from `first_row` (k: 0, q: 64)."""
        return self.swizzled(field, (rows, (HALF_D, 2), self.num_stages),
                             (HALF_D, (1, self.KQ_HALF), self.KQ_STAGE), first_row * HALF_D)

    def stacked(self, field):
        """(row, channel) view of a one-stage stacked [k; q]-shaped tile (KDA's left factors and [kg; qg])."""
        return self.swizzled(field, (2 * C, (HALF_D, 2)), (HALF_D, (1, self.KQ_HALF)))

    def band_rows(self, st, delta: int):
        """(token, channel) view of KDA's right factor band `delta` (rows from `KDA_BAND_ROWS[delta]`)."""
        return self.swizzled(st.sBands, (KDA_BANDS[delta], (HALF_D, 2)), (HALF_D, (1, self.BANDS_HALF)),
                             KDA_BAND_ROWS[delta] * HALF_D)

    def solve_tiles(self, st):
        """(Akk fp32, Y fp32, Xv, Aqk): GDN's own fields; KDA's lie over the bands, read by then (Aqk at byte 0,
        Xv at 8 KB, Akk at 16 KB, Y at 33 KB of 40)."""
        akk = cute.make_layout((C, C), stride=(AKK_STRIDE, 1))
        tok_tile = lambda f, off: self.swizzled(f, (C, C), (HALF_D, 1), off)   # noqa: E731
        if cutlass.const_expr(self.kda):
            y_off = 8192 + 2 * C * AKK_STRIDE
            assert 2 * y_off + 4 * SOLVE_Y_MMA <= 2 * BANDS_ROWS * D
            return (self.fp32_view(st.sBands, akk, 8192), self.fp32_view(st.sBands, cute.make_layout(SOLVE_Y_MMA),
                                                                         y_off),
                    tok_tile(st.sBands, C * C), tok_tile(st.sBands, 0))
        return (st.sAkk.get_tensor(akk), st.sY.get_tensor(cute.make_layout(SOLVE_Y_MMA)), tok_tile(st.sXv, 0),
                tok_tile(st.sAqk, 0))

    # ------------------------------------------------------------------ device side

    @cute.kernel
    def kernel(self, mmas, tma_q: cute.CopyAtom, mQ: cute.Tensor, tma_k: cute.CopyAtom, mK: cute.Tensor,
               tma_v: cute.CopyAtom, mV: cute.Tensor, mG: cute.Tensor, mBeta: cute.Tensor, mALog: cute.Tensor,
               mDtBias: cute.Tensor, lower_bound: Float32, mO: cute.Tensor, mS0: cute.Tensor, mSN: cute.Tensor,
               mTiles: cute.Tensor, num_tiles: Int32, scale: Float32):
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        smem = utils.SmemAllocator()
        st = smem.allocate(self.shared_storage)

        thread = lambda n: pipeline.CooperativeGroup(pipeline.Agent.Thread, n)   # noqa: E731
        load = pipeline.PipelineTmaUmma.create(barrier_storage=st.load_mbar.data_ptr(), num_stages=self.num_stages,
                                               producer_group=thread(1), consumer_group=thread(1),
                                               tx_count=self.tma_bytes, defer_sync=True)
        mbar = st.handoff_mbar.data_ptr()
        to_mma = lambda i: pipeline.PipelineAsyncUmma.create(   # noqa: E731
            barrier_storage=mbar + 2 * i, num_stages=1, producer_group=thread(COMPUTE_THREADS),
            consumer_group=thread(1), defer_sync=True)
        from_mma = lambda i: pipeline.PipelineUmmaAsync.create(   # noqa: E731
            barrier_storage=mbar + 2 * i, num_stages=1, producer_group=thread(1),
            consumer_group=thread(COMPUTE_THREADS), defer_sync=True)
        pipes = (from_mma(0), to_mma(1), from_mma(2), to_mma(3), from_mma(4), to_mma(5))
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        sched = TileScheduler.create(mTiles, num_tiles, self.config.persistent)
        if warp_idx == LOAD_WARP:
            cpasync.prefetch_descriptor(tma_q)
            cpasync.prefetch_descriptor(tma_k)
            cpasync.prefetch_descriptor(tma_v)
            self.producer(sched, load, tma_q, mQ, tma_k, mK, tma_v, mV, st)
        else:
            alloc_bar = pipeline.NamedBarrier(barrier_id=2, num_threads=COMPUTE_THREADS + 32)
            tmem = utils.TmemAllocator(st.tmem_holding, barrier_for_retrieve=alloc_bar, allocator_warp_id=MMA_WARP)
            tmem.allocate(self.tmem.alloc)
            tmem.wait_for_alloc()
            base = tmem.retrieve_ptr(Float32)
            intra, kqs, tok, update = mmas
            acc = lambda mma, col, n: cute.make_tensor(   # noqa: E731
                base + col, mma.make_fragment_C(mma.partition_shape_C((128, n))).layout)
            a = self.tmem.col("a")
            if cutlass.const_expr(self.kda):
                t_intra = tuple(acc(intra[i], a + KDA_BAND_COLS[i], KDA_BANDS[i]) for i in range(4))
                t_vn, t_o = acc(tok, a, C), acc(tok, a + C, C)
            else:
                t_intra, t_vn, t_o = acc(intra, a, C), acc(tok, self.tmem.col("vn"), C), acc(tok, self.tmem.col("o"), C)
            tmem_regions = (t_intra, acc(kqs, self.tmem.col("kqs"), 2 * C), t_vn, t_o,
                            acc(update, self.tmem.col("s"), D))
            if warp_idx == MMA_WARP:
                self.mma(sched, load, pipes, mmas, tmem_regions, st)
            else:
                self.compute(sched, load, pipes, tmem_regions, tidx, mG, mBeta, (mALog, mDtBias, lower_bound), mO,
                             mS0, mSN, scale, st)
            # every MMA and TMEM read done (the compute warps read the tile's last state) before the free
            tmem.relinquish_alloc_permit()
            alloc_bar.arrive_and_wait()
            if warp_idx == MMA_WARP:
                tmem.free(base)

    @cute.jit
    def producer(self, sched, load, tma_q, mQ, tma_k, mK, tma_v, mV, st):
        """The load warp: per chunk its k, q (two 64 x 64 boxes each, at the head the tile's value head reads:
        hv // group) and v tiles."""
        group = self.config.group
        sK = self.kq_rows(st.sKQ, C, 0)
        sQ = self.kq_rows(st.sKQ, C, C)
        sV = st.sV.get_tensor(cute.make_layout((C, D, self.num_stages), stride=(D, 1, C * D)))
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.num_stages)
        work = sched.initial_work()
        while work.is_valid:
            head = work.head
            for c in cutlass.range(work.chunk_end - work.chunk_start, unroll=1):
                t0 = work.tok_start + c * C
                load.producer_acquire(state)
                bar = load.producer_get_barrier(state)
                for tma, m, s in ((tma_k, mK, sK), (tma_q, mQ, sQ)):
                    for half in cutlass.range_constexpr(2):
                        g_tile = cute.local_tile(cute.domain_offset((t0, 0), m[None, None, head // group]),
                                                 (C, HALF_D), (0, half))
                        s_tile = s[None, (None, half), state.index]
                        s_part, g_part = cpasync.tma_partition(tma, 0, cute.make_layout(1),
                                                               cute.group_modes(s_tile, 0, 2),
                                                               cute.group_modes(g_tile, 0, 2))
                        cute.copy(tma, g_part, s_part, tma_bar_ptr=bar)
                g_tile = cute.local_tile(cute.domain_offset((t0, 0), mV[None, None, head]), (C, D), (0, 0))
                s_part, g_part = cpasync.tma_partition(tma_v, 0, cute.make_layout(1),
                                                       cute.group_modes(sV[None, None, state.index], 0, 2),
                                                       cute.group_modes(g_tile, 0, 2))
                cute.copy(tma_v, g_part, s_part, tma_bar_ptr=bar)
                state.advance()
            work = sched.advance(work)
        load.producer_tail(state)

    @cute.jit
    def operands(self, st):
        """The MMA operand views, as (M or N, K, ...) smem tensors: the intra product's A and B (GDN: the stacked
        [k; q] stage tile and k alone, K-major; KDA: the left factors and the four bands), KQS's B ([k; q] per
        stage, or [kg; qg]), the update's A (k^T per stage, or kb^T: MN-major, key channels by tokens) and B
        ((2^(G_L - G) v_new)^T, or v_new^T), S [dk, dv] as S^T (MN-major A), U^T / v_new^T (K-major, [dv,
        token])."""
        sT = self.swizzled(st.sS, ((HALF_D, 2), D), ((1, D * HALF_D), HALF_D))
        sU = self.swizzled(st.sU, (D, C), (HALF_D, 1))
        if cutlass.const_expr(self.kda):
            intra_a = self.stacked(st.sLeft)
            intra_b = tuple(self.band_rows(st, i) for i in range(4))
            kqs_b = self.stacked(st.sKG)
            upd_a = self.swizzled(st.sKb, ((HALF_D, 2), C), ((1, C * HALF_D), HALF_D))
            upd_b = sU
        else:
            intra_a = self.kq_rows(st.sKQ, 2 * C, 0)
            intra_b = self.kq_rows(st.sKQ, C, 0)
            kqs_b = intra_a
            upd_a = self.swizzled(st.sKQ, ((HALF_D, 2), C, self.num_stages),
                                  ((1, self.KQ_HALF), HALF_D, self.KQ_STAGE))
            upd_b = self.swizzled(st.sVnD, (D, C), (HALF_D, 1))
        return intra_a, intra_b, kqs_b, upd_a, upd_b, sT, sU

    @cute.jit
    def mma(self, sched, load, pipes, mmas, tmem_regions, st):
        """The MMA warp: per chunk the intra and KQS products, then VN, then O and the state update."""
        kqs_pipe, u_ready, vn_full, vn_written, upd_full, state_ready = pipes
        intra, kqs, tok, update = mmas
        tA, tKQS, tVN, tO, tS = tmem_regions
        intra_a, intra_b, kqs_b, upd_a, upd_b, sT, sU = self.operands(st)
        _, _, sXv, sAqk = self.solve_tiles(st)
        frag = lambda mma, s, a: (mma.make_fragment_A if a else mma.make_fragment_B)(   # noqa: E731
            (mma.get_slice(0).partition_A if a else mma.get_slice(0).partition_B)(s))
        staged = lambda r, i: r if cutlass.const_expr(self.kda) else r[None, None, None, i]   # noqa: E731
        if cutlass.const_expr(self.kda):
            rIntra = tuple((frag(intra[i], intra_a, True), frag(intra[i], intra_b[i], False)) for i in range(4))
        else:
            rIntra = (frag(intra, intra_a, True), frag(intra, intra_b, False))
        rS_a, rKQ_b = frag(kqs, sT, True), frag(kqs, kqs_b, False)
        rU_a, rXv_b, rAqk_b = frag(tok, sU, True), frag(tok, sXv, False), frag(tok, sAqk, False)
        rUpd_a, rUpd_b = frag(update, upd_a, True), frag(update, upd_b, False)

        l_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.num_stages)
        producer = lambda: pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)   # noqa: E731
        consumer = lambda: pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)   # noqa: E731
        kqs_s, u_s, vn_s, vw_s, upd_s, sr_s = producer(), consumer(), producer(), consumer(), producer(), consumer()
        work = sched.initial_work()
        while work.is_valid:
            for c in cutlass.range(work.chunk_end - work.chunk_start, unroll=1):
                stage = l_state.index
                load.consumer_wait(l_state)
                kqs_pipe.producer_acquire(kqs_s)     # the previous chunk's A and KQS read
                state_ready.consumer_wait(sr_s)      # S (bf16; KDA: and the gated tiles) for this chunk
                if cutlass.const_expr(self.kda):
                    for i in cutlass.range_constexpr(4):
                        self.gemm(intra[i], tA[i], rIntra[i][0], rIntra[i][1], False)
                else:
                    self.gemm(intra, tA, staged(rIntra[0], stage), staged(rIntra[1], stage), False)
                self.gemm(kqs, tKQS, rS_a, staged(rKQ_b, stage), False)
                kqs_pipe.producer_commit(kqs_s)
                kqs_s.advance()
                state_ready.consumer_release(sr_s)   # sS free once the KQS product has read it
                sr_s.advance()

                u_ready.consumer_wait(u_s)
                vn_full.producer_acquire(vn_s)
                self.gemm(tok, tVN, rU_a, rXv_b, False)
                vn_full.producer_commit(vn_s)
                vn_s.advance()
                u_ready.consumer_release(u_s)
                u_s.advance()
                if cutlass.const_expr(self.kda):
                    load.consumer_release(l_state)   # the compute warps read k, q and v before U was ready
                    l_state.advance()

                vn_written.consumer_wait(vw_s)
                upd_full.producer_acquire(upd_s)
                self.gemm(tok, tO, rU_a, rAqk_b, False)                                # sU holds v_new^T now
                self.gemm(update, tS, staged(rUpd_a, stage), rUpd_b, True)
                if cutlass.const_expr(not self.kda):
                    load.consumer_release(l_state)   # the stage's last reader was the update
                    l_state.advance()
                upd_full.producer_commit(upd_s)
                upd_s.advance()
                vn_written.consumer_release(vw_s)
                vw_s.advance()
            work = sched.advance(work)

    @cute.jit
    def gemm(self, mma, acc, rA, rB, accumulate: bool):
        """acc (+)= A B^T over every 16-wide K block (fragments (mode, 1, k_blocks))."""
        for kb in cutlass.range_constexpr(cute.size(rA, mode=[2])):
            mma.set(tcgen05.Field.ACCUMULATE, accumulate or kb != 0)
            cute.gemm(mma, acc, rA[None, None, kb], rB[None, None, kb], acc)

    @cute.jit
    def put(self, src, dst):
        """32 fp32 values -> 16-bit `dst` (a 32-element smem row segment) in 16-byte vectors (a swizzle moves whole
        16-byte chunks, so each run of 8 stays contiguous)."""
        half = cute.make_rmem_tensor((COLS,), self.io_dtype)
        half.store(src.load().to(self.io_dtype))
        for v in cutlass.range_constexpr(COLS // 8):
            cute.autovec_copy(cute.local_tile(half, (8,), (v,)), cute.local_tile(dst, (8,), (v,)))

    @cute.jit
    def kda_scan_rows(self, tidx, t0, L, head, mG, gp, lower_bound, gl):
        """KDA: into `gl`, the inclusive sums of g (log2 units, 0 past the end) of channel tidx % 128 over rows
        [32 j, 32 j + 32), j = tidx // 128, from the start of those rows (rows 32-63 lack rows 0-31's total)."""
        d = tidx % 128
        j = tidx // 128
        for rr in cutlass.range_constexpr(32):
            x = Float32(0.0)
            if 32 * j + rr < L:
                x = self.math.gate_value(Float32(mG[t0 + 32 * j + rr, head, d]), gp, lower_bound)
            gl[rr] = x * LOG2E
        for rr in cutlass.range_constexpr(1, 32):
            gl[rr] = gl[rr] + gl[rr - 1]

    @cute.jit
    def kda_gate_scan(self, tidx, t0, L, head, mG, gp, lower_bound, gl, st, slot):
        """KDA: G[r, d] = the inclusive sum of g over rows <= r, log2 units (g = 0 past the end), into `gl` for this
        thread's channel d = tidx % 128 and rows [32 j, 32 j + 32), j = tidx // 128. Shares rows 0-31's total
        (sHalf), the block anchors G[16 m, d] and G[L - 1, d], and raises sFlag[slot] if a 16-row block decays by
        more than `KDA_ANCHOR_LIMIT` in this channel. Two compute barriers."""
        d = tidx % 128
        j = tidx // 128
        sAnchor = st.sAnchor.get_tensor(cute.make_layout((4, D), stride=(D, 1)))
        sHalf = st.sHalf.get_tensor(cute.make_layout(D))
        sGL = st.sGL.get_tensor(cute.make_layout(D))
        sFlag = st.sFlag.get_tensor(cute.make_layout(2))
        self.kda_scan_rows(tidx, t0, L, head, mG, gp, lower_bound, gl)
        worst = cutlass.max(gl[0] - gl[15], gl[16] - gl[31])   # a block's largest right factor (offsets cancel)
        if j == 0:
            sHalf[d] = gl[31]
            sAnchor[0, d] = gl[0]
            sAnchor[1, d] = gl[16]
        self.compute_barrier()
        if worst > KDA_ANCHOR_LIMIT:
            sFlag[slot] = Int32(1)
        if j == 1:
            off = sHalf[d]
            for rr in cutlass.range_constexpr(32):
                gl[rr] = gl[rr] + off
            sAnchor[2, d] = gl[0]
            sAnchor[3, d] = gl[16]
            sGL[d] = gl[31]
        self.compute_barrier()

    @cute.jit
    def kda_tiles(self, tidx, gl, gl_last, stage, st):
        """KDA: the 16-bit tiles the products read, for this thread's channel d and rows [32 j, 32 j + 32): left
        [k; q] 2^(G - G_a(r)) (<= 1), [kg; qg] = [k; q] 2^G, kb = k 2^(G_L - G) and the bands right_delta[r] =
        k_r 2^(G_(a(r) + 16 delta) - G_r) (<= 1 for delta >= 1). A warp's stores cover 32 channels of one row."""
        io = self.io_dtype
        d = tidx % 128
        j = tidx // 128
        raw = self.kq_rows(st.sKQ, 2 * C, 0)
        left, kgqg = self.stacked(st.sLeft), self.stacked(st.sKG)
        kb = self.swizzled(st.sKb, (C, (HALF_D, 2)), (HALF_D, (1, C * HALF_D)))
        bands = tuple(self.band_rows(st, i) for i in range(4))
        sAnchor = st.sAnchor.get_tensor(cute.make_layout((4, D), stride=(D, 1)))
        anchor = cute.make_rmem_tensor((4,), Float32)
        for m in cutlass.range_constexpr(4):
            anchor[m] = sAnchor[m, d]
        for rr in cutlass.range_constexpr(32):
            r = 32 * j + rr
            kr = Float32(raw[r, d, stage])
            qr = Float32(raw[C + r, d, stage])
            g_r = gl[rr]
            e = cute.math.exp2(g_r - gl[16 * (rr // 16)], fastmath=True)
            left[r, d] = io(kr * e)
            left[C + r, d] = io(qr * e)
            e = cute.math.exp2(g_r, fastmath=True)
            kgqg[r, d] = io(kr * e)
            kgqg[C + r, d] = io(qr * e)
            kb[r, d] = io(kr * cute.math.exp2(gl_last - g_r, fastmath=True))
            for delta in cutlass.range_constexpr(4):
                m0 = rr // 16 + delta        # the anchor block of rows 32 j + rr: m0 + 2 j
                if cutlass.const_expr(m0 + 2 <= 3):
                    a_m = cutlass.select_(j == 0, anchor[m0], anchor[m0 + 2])
                    bands[delta][r, d] = io(kr * cute.math.exp2(a_m - g_r, fastmath=True))
                elif cutlass.const_expr(m0 <= 3):
                    if j == 0:
                        bands[delta][r, d] = io(kr * cute.math.exp2(anchor[m0] - g_r, fastmath=True))

    @cute.jit
    def kda_exact_diagonal(self, tidx, gate, L, scale, stage, st, sAkk, sAqk):
        """KDA, a chunk past the anchor limit: the 16 x 16 diagonal blocks of Akk and Aqk from their definition,
        sum_d x_rd k_id 2^(G_rd - G_id) (every factor <= 1), over Akk / Aqk as step 1 wrote them. G is scanned
        again (`gate`: `kda_scan_rows`' arguments; registers are short here) into fp32 smem over the left factors
        (read by the intra product by now). Thread (r % 16, i % 16) sums its pair in the four blocks, for k and q
        rows; channels start at a per-thread offset to spread the banks."""
        d = tidx % 128
        j = tidx // 128
        sGx = self.fp32_view(st.sLeft, cute.make_layout((C, D), stride=(D, 1)))
        sHalf = st.sHalf.get_tensor(cute.make_layout(D))
        sBeta = st.sBeta.get_tensor(cute.make_layout(C))
        raw = self.kq_rows(st.sKQ, 2 * C, 0)
        t0, head, mG, gp, lower_bound = gate
        gl = cute.make_rmem_tensor((32,), Float32)
        self.kda_scan_rows(tidx, t0, L, head, mG, gp, lower_bound, gl)
        off = cutlass.select_(j == 0, Float32(0.0), sHalf[d])
        for rr in cutlass.range_constexpr(32):
            sGx[32 * j + rr, d] = gl[rr] + off
        self.compute_barrier()
        rl = tidx // 16
        il = tidx % 16
        if il <= rl:
            for n in cutlass.range_constexpr(8):
                r = 16 * (n % 4) + rl
                i = 16 * (n % 4) + il
                x_row = C * (n // 4) + r          # k rows, then q rows of the stacked tile
                total = Float32(0.0)
                for dd in cutlass.range(D, unroll=4):
                    c = (dd + tidx) % D
                    f = cute.math.exp2(sGx[r, c] - sGx[i, c], fastmath=True)
                    total = total + Float32(raw[x_row, c, stage]) * Float32(raw[i, c, stage]) * f
                if cutlass.const_expr(n // 4 == 0):
                    if il < rl and r < L:
                        sAkk[r, i] = total * sBeta[r]
                else:
                    sAqk[r, i] = self.io_dtype(total * scale)

    @cute.jit
    def compute_barrier(self):
        cute.arch.barrier(barrier_id=1, number_of_threads=COMPUTE_THREADS)

    @cute.jit
    def compute(self, sched, load, pipes, tmem_regions, tidx, mG, mBeta, gate_args, mO, mS0, mSN, scale, st):
        """Warps 0-7: the gates, the elementwise work between the products, the solve, o and the state."""
        kqs_pipe, u_ready, vn_full, vn_written, upd_full, state_ready = pipes
        tA, tKQS, tVN, tO, tS = tmem_regions
        math = self.math
        io = self.io_dtype
        kda = self.kda
        lane = tidx % 128          # the TMEM lane (accumulator row) this thread owns; KDA: its key channel
        j = tidx // 128            # this warpgroup's column block
        _, _, _, _, sVnD, sT, sU = self.operands(st)
        sAkk, sY, sXv, sAqk = self.solve_tiles(st)
        sV = st.sV.get_tensor(cute.make_layout((C, D, self.num_stages), stride=(D, 1, C * D)))
        sBeta = st.sBeta.get_tensor(cute.make_layout(C))
        sG = st.sG.get_tensor(cute.make_layout(C))
        sEG = st.sEG.get_tensor(cute.make_layout(C))
        sEGL = st.sEGL.get_tensor(cute.make_layout(C))
        sGL = st.sGL.get_tensor(cute.make_layout(D))
        sFlag = st.sFlag.get_tensor(cute.make_layout(2))

        # tcgen05.ld / st of 32 columns: this thread's lane, columns [32 b, 32 b + 32) of a region
        cols = lambda t, n=COLS: cute.flat_divide(t[(None, None), 0, 0], (128, n))   # noqa: E731  (128, n, 1, N / n)
        rKQS, rVN, rO, rS = cols(tKQS), cols(tVN), cols(tO), cols(tS)
        ld, st_op, thr_ld, thr_st = column_copies(rS[None, None, 0, 0], lane)
        vals = cute.make_rmem_tensor(thr_ld.partition_D(rS[None, None, 0, 0]).shape, Float32)
        vals2 = cute.make_rmem_tensor(thr_ld.partition_D(rS[None, None, 0, 0]).shape, Float32)
        load_cols = lambda region, b, dst: cute.copy(ld, thr_ld.partition_S(region[None, None, 0, b]), dst)  # noqa
        store_cols = lambda src, region, b: cute.copy(st_op, src, thr_st.partition_D(region[None, None, 0, b]))  # noqa
        if cutlass.const_expr(kda):
            rBands = tuple(cols(tA[i], 16) for i in range(4))   # (128, 16, 1, KDA_BANDS[i] / 16)
            ld16, _, thr_ld16, _ = column_copies(rBands[0][None, None, 0, 0], lane, 16)
            vals16 = cute.make_rmem_tensor(thr_ld16.partition_D(rBands[0][None, None, 0, 0]).shape, Float32)
            gl = cute.make_rmem_tensor((32,), Float32)
        else:
            rA = cols(tA)

        # row `lane` of S, columns [64 j + 32 b, + 32), in the bf16 S^T operand (contiguous along dv)
        s_row = lambda j, b: cute.local_tile(sT[(None, j), lane], (COLS,), (b,))   # noqa: E731
        l_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.num_stages)
        producer = lambda: pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)   # noqa: E731
        consumer = lambda: pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)   # noqa: E731
        kqs_s, u_s, vn_s, vw_s, upd_s, sr_s = consumer(), producer(), consumer(), producer(), consumer(), producer()
        bar = self.compute_barrier
        to_smem = lambda: cute.arch.fence_proxy("async.shared", space="cta")   # noqa: E731  (generic -> MMA reads)
        slot = Int32(0)            # KDA: this chunk's flag slot (the other one is cleared for the next chunk)
        if tidx == 0:
            sFlag[0] = Int32(0)
            sFlag[1] = Int32(0)

        work = sched.initial_work()
        while work.is_valid:
            seq, head, tok0, tok_end = work.seq, work.head, work.tok_start, work.tok_end
            blk, slot_seg = work.block, work.seg_slot
            n_chunks = work.chunk_end - work.chunk_start

            # S <- its start value: row `lane`, columns [64 j, 64 j + 64), into TMEM and (bf16) sS
            if n_chunks > 0:
                state_ready.producer_acquire(sr_s)
            for b in cutlass.range_constexpr(2):
                col0 = 64 * j + COLS * b
                for e in cutlass.range_constexpr(COLS):
                    x = Float32(0.0)
                    if cutlass.const_expr(self.mode == "summary"):
                        if blk == 1 and lane == col0 + e:
                            x = Float32(1.0)
                    elif cutlass.const_expr(self.mode == "segment_outputs"):
                        x = Float32(mS0[slot_seg, head, lane, col0 + e])
                    elif cutlass.const_expr(self.has_initial_state):
                        x = Float32(mS0[seq, head, lane, col0 + e])
                    vals[e] = x
                self.put(vals, s_row(j, b))
                store_cols(vals, rS, 2 * j + b)
            cute.arch.fence_view_async_tmem_store()
            to_smem()
            if cutlass.const_expr(not kda):
                if n_chunks > 0:
                    state_ready.producer_commit(sr_s)
                    sr_s.advance()

            mALog, mDtBias, lower_bound = gate_args
            gp = math.gate_params(mALog, mDtBias, head, tidx)
            gv, gw, bv = math.gate_rows(tidx, tok0, tok_end, head, mG, mBeta)   # raw: converted at use
            for c in cutlass.range(n_chunks, unroll=1):
                t0 = tok0 + c * C
                L = math.rows_in(tok_end - t0)
                g_own, g_other, beta = math.gate_values(tidx, t0, tok_end, gv, gw, bv, gp, lower_bound)
                if cutlass.const_expr(kda):
                    if tidx == 0:
                        sFlag[slot ^ 1] = Int32(0)
                    if tidx < C:
                        sBeta[tidx] = beta
                    self.kda_gate_scan(tidx, t0, L, head, mG, gp, lower_bound, gl, st, slot)
                else:
                    math.gdn_gates(tidx, L, g_own, g_other, beta, sG, sEG, sEGL, sBeta)
                gv, gw, bv = math.gate_rows(tidx, t0 + C, tok_end, head, mG, mBeta)
                if cutlass.const_expr(not kda):
                    bar()                                   # the gates visible to every compute thread
                load.consumer_wait(l_state)                 # k, q, v in smem (the MMA warp releases the stage)
                gl_last = Float32(0.0)
                if cutlass.const_expr(kda):
                    gl_last = sGL[lane]
                    self.kda_tiles(tidx, gl, gl_last, l_state.index, st)
                    to_smem()
                    state_ready.producer_commit(sr_s)       # S and the gated tiles
                    sr_s.advance()
                kqs_pipe.consumer_wait(kqs_s)

                # -- 1. Akk (lanes 0-63) or Aqk (lanes 64-127) from A; U^T from K S
                if cutlass.const_expr(kda):
                    self.kda_band_cols(lane, j, rBands, ld16, thr_ld16, vals16, vals)
                else:
                    load_cols(rA, j, vals)
                load_cols(rKQS, j, vals2)
                cute.arch.fence_view_async_tmem_load()
                u_ready.producer_acquire(u_s)
                r = lane % C
                is_kk = lane < C
                row_factor = cutlass.select_(is_kk, sBeta[r], scale)
                g_r = Float32(0.0)
                if cutlass.const_expr(not kda):
                    g_r = sG[r]
                for e in cutlass.range_constexpr(COLS):
                    col = COLS * j + e
                    keep = cutlass.select_(is_kk, col < r and r < L, col <= r)
                    gated = vals[e] * row_factor
                    if cutlass.const_expr(not kda):
                        # 2^(G_r - G_c) may overflow above the diagonal: selected away
                        gated = gated * cute.math.exp2(g_r - sG[col], fastmath=True)
                    vals[e] = cutlass.select_(keep, gated, Float32(0.0))
                    vc = Float32(0.0)
                    if cutlass.const_expr(self.mode != "summary"):
                        vc = Float32(sV[col, lane, l_state.index])
                    else:
                        if blk == 0:
                            vc = Float32(sV[col, lane, l_state.index])
                    if cutlass.const_expr(kda):
                        vals2[e] = vc - vals2[e]
                    else:
                        vals2[e] = vc - sEG[col] * vals2[e]
                if is_kk:
                    cute.autovec_copy(vals, cute.local_tile(sAkk[r, None], (COLS,), (j,)))
                else:
                    self.put(vals, cute.local_tile(sAqk[r, None], (COLS,), (j,)))
                self.put(vals2, cute.local_tile(sU[lane, None], (COLS,), (j,)))
                if cutlass.const_expr(kda):
                    bar()                                   # Akk and Aqk written; every thread past the KQS wait
                    if sFlag[slot] != 0:
                        self.kda_exact_diagonal(tidx, (t0, head, mG, gp, lower_bound), L, scale, l_state.index, st,
                                                sAkk, sAqk)
                bar()                                       # Akk whole before the solve
                math.solve_blocked(tidx, sAkk, sY, sXv, None, sBeta, sEG)
                to_smem()
                u_ready.producer_commit(u_s)
                u_s.advance()

                # -- 3. v_new^T to smem (GDN: also decayed); S *= 2^G_L in TMEM (KDA: 2^G_L[d] on lane d)
                vn_full.consumer_wait(vn_s)
                vn_written.producer_acquire(vw_s)
                load_cols(rVN, j, vals)
                cute.arch.fence_view_async_tmem_load()
                self.put(vals, cute.local_tile(sU[lane, None], (COLS,), (j,)))
                if cutlass.const_expr(not kda):
                    for e in cutlass.range_constexpr(COLS):
                        vals[e] = vals[e] * sEGL[COLS * j + e]
                    self.put(vals, cute.local_tile(sVnD[lane, None], (COLS,), (j,)))
                decay_last = Float32(0.0)
                if cutlass.const_expr(kda):
                    decay_last = cute.math.exp2(gl_last, fastmath=True)
                else:
                    decay_last = sEG[L - 1]
                for b in cutlass.range_constexpr(2):
                    load_cols(rS, 2 * j + b, vals)
                    cute.arch.fence_view_async_tmem_load()
                    for e in cutlass.range_constexpr(COLS):
                        vals[e] = vals[e] * decay_last
                    store_cols(vals, rS, 2 * j + b)
                cute.arch.fence_view_async_tmem_store()
                to_smem()
                vn_full.consumer_release(vn_s)
                vn_s.advance()
                vn_written.producer_commit(vw_s)
                vw_s.advance()

                # -- 4. o = O^T + scale (2^G q S) (KDA: qg S); the new S to bf16 smem for the next chunk
                upd_full.consumer_wait(upd_s)
                if cutlass.const_expr(self.outputs):
                    load_cols(rO, j, vals)
                    load_cols(rKQS, 2 + j, vals2)
                    cute.arch.fence_view_async_tmem_load()
                    for e in cutlass.range_constexpr(COLS):
                        row = COLS * j + e
                        if row < L:
                            qs = scale
                            if cutlass.const_expr(not kda):
                                qs = sEG[row] * scale
                            mO[t0 + row, head, lane] = io(vals[e] + vals2[e] * qs)
                l_state.advance()
                if c + 1 < n_chunks:
                    state_ready.producer_acquire(sr_s)
                    for b in cutlass.range_constexpr(2):
                        load_cols(rS, 2 * j + b, vals)
                        cute.arch.fence_view_async_tmem_load()
                        self.put(vals, s_row(j, b))
                    to_smem()
                    if cutlass.const_expr(not kda):
                        state_ready.producer_commit(sr_s)
                        sr_s.advance()
                kqs_pipe.consumer_release(kqs_s)
                kqs_s.advance()
                upd_full.consumer_release(upd_s)
                upd_s.advance()
                slot = slot ^ 1
                bar()                                       # the gates and Aqk free for the next chunk's writers

            # the tile's end state: summary[block * slots + seg_slot] (h_ext, M), or the sequence's final state
            for b in cutlass.range_constexpr(2):
                load_cols(rS, 2 * j + b, vals)
                cute.arch.fence_view_async_tmem_load()
                col0 = 64 * j + COLS * b
                if cutlass.const_expr(self.mode == "summary"):
                    nslots = mSN.shape[0] // 2
                    for e in cutlass.range_constexpr(COLS):
                        mSN[blk * nslots + slot_seg, head, lane, col0 + e] = vals[e]
                elif cutlass.const_expr(self.store_final_state):
                    if work.is_last_segment:
                        for e in cutlass.range_constexpr(COLS):
                            mSN[seq, head, lane, col0 + e] = vals[e]
            work = sched.advance(work)

    @cute.jit
    def kda_band_cols(self, lane, j, rBands, ld16, thr_ld16, vals16, vals):
        """KDA: row `lane` of the stacked intra product A, columns [32 j, 32 j + 32), into `vals`: column block qb
        of row block pb comes from band pb - qb (0 above the diagonal blocks). A warp's lanes span two row blocks,
        so each 16-column block reads every band that has it and keeps its own."""
        pb = (lane % C) // 16
        for b in cutlass.range_constexpr(2):
            qb = 2 * j + b
            for e in cutlass.range_constexpr(16):
                vals[16 * b + e] = Float32(0.0)
            for delta in cutlass.range_constexpr(4):
                if qb + delta <= 3:
                    cute.copy(ld16, thr_ld16.partition_S(rBands[delta][None, None, 0, qb]), vals16)
                    cute.arch.fence_view_async_tmem_load()
                    for e in cutlass.range_constexpr(16):
                        vals[16 * b + e] = cutlass.select_(pb == qb + delta, vals16[e], vals[16 * b + e])
