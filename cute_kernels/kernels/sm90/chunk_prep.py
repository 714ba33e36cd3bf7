"""SM90 phase 1 of the two-phase chunked forward: every chunk's local terms (`chunk_local.ChunkLocalSm90`), in
parallel over (sequence, head, chunk range), stored for `ChunkStatePassSm90` (docs/design.md, "The two-phase path").
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import cpasync, warpgroup

from schedulers.device import TileScheduler

from ..configs import PrepConfig
from . import wgmma_tiles as wt
from ..chunk_math import AKK_STRIDE, SOLVE_Y, C
from .chunk_local import HALF, ChunkLocalSm90


class ChunkPrepSm90:
    """Phase 1: per chunk (rows r < L; all [tokens, H, D] outputs, tokens = B * T flattened), into the slots of
    `paths.two_phase.ChunkTerms` (query, key, value, update_key, intra, decay):

    - solved terms (GDN's overlapped build): qg = scale exp(G) q, w = X diag(beta) (exp(G) k), u = X diag(beta) v,
      kg = exp(G_last - G) k (16-bit), Aqk rows (16-bit, 64 columns), decay[t_last] = exp(G_last) (fp32; only each
      chunk's last row is written: the state pass reads only that row).
    - folded terms: no v is loaded, no w or u; W2 = X'^T k (consumer j: columns [64 j, 64 j + 64)) and A1 = Aqk Xv
      (consumer 0) go to the update_key and intra slots. GDN: X' = diag(2^(G_last - G)) X diag(beta), no gated q / k
      (the state pass reads q, k, v), decay [tokens, H, 4] fp32: row r < L holds (scale 2^G_r, 2^(G_last - G_r),
      2^G_last, 2^G_r). KDA: X' = Xv, k as step 1 gated it; qg and kE = k 2^G by the query and key slots.

    Warp roles: the compact build (GDN folded, `ctas_per_sm` 2 or 3): 288 threads, consumer warpgroups 0 and 1, TMA
    producer warp 8, no register reallocation, one q/k stage; w / W2 and u / A1 staged in the k and v tiles (each
    warpgroup overwrites only the columns its own product read); at 3 CTAs per SM Akk lies over q and the solve's
    scratch over Xk, with one more consumer barrier after step 1. Other builds: 384 threads, warp 0 the producer
    (q/k/v TMA ring), warpgroups 1, 2 the consumers. KDA: Akk / Aqk row-anchored (`reference/kda_intra.py`, form
    "rows"), or by the exact path past the anchor limit.

    `tma_store` (KDA, not publish): full fast-path chunks leave by TMA stores issued by consumer thread 0 (qg from
    the q tile, then kE, W2, A1 from staging); it waits only until the first has read the stage before releasing it,
    and for the staging stores before the next chunk's q/k wait. Partial and exact-path chunks: thread stores.
    `pdl`: every CTA starts with `griddepcontrol.launch_dependents` (the state pass still waits for the whole grid).
    `publish` (overlapped path; the state pass runs concurrently on the SMs left free): persistent grid (CTA b takes
    tiles b, b + grid, ...; tiles chunk-major). After a chunk's terms are stored and the consumers' barrier passed,
    consumer thread 0 publishes it: a gpu-scope release fence, then `flags[(seq * chunks_per_seq + chunk) * H +
    head] += consumers` (atomic release add; each of the `consumers` state-pass CTAs reading the chunk takes one back
    after its acquire, so every flag is 0 again at the end). This grid never waits, so the spinners cannot deadlock it.
    """

    def __init__(self, config: PrepConfig, io_dtype, beta_dtype):
        self.config = config
        self.io_dtype = io_dtype
        self.beta_dtype = beta_dtype
        self.kda = config.kda
        self.ctas_per_sm = config.ctas_per_sm
        self.compact = not config.kda and config.ctas_per_sm > 1   # GDN's folded build: 288 threads, one stage
        self.three_per_sm = config.ctas_per_sm == 3
        self.folded = config.terms == "folded"
        self.token_factors = self.folded and not config.kda
        self.tma_store = config.tma_store
        self.publish = config.publish
        self.pdl = config.pdl
        self.local = ChunkLocalSm90(io_dtype, config.kda, outputs=True, gate=config.gate)
        self.load_v = not self.folded
        self.tma_bytes = (2 if self.folded else 3) * C * 128 * io_dtype.width // 8
        # GDN's solved build: a 2-stage q/k/v ring; the others one stage (no shared memory left for a second)
        self.num_stages = 2 if not (self.kda or self.compact) else 1
        self.num_threads = 288 if self.compact else 384

    @cute.jit
    def __call__(
        self,
        q: cute.Tensor,      # [B, T, H, 128]
        k: cute.Tensor,
        v: cute.Tensor,      # [B, T, H, V]
        g: cute.Tensor,      # [B, T, H] fp32 (KDA: [B, T, H, 128])
        beta: cute.Tensor,   # [B, T, H]
        a_log: cute.Tensor,  # [H] fp32 (config.gate.a_log; else any fp32 tensor)
        dt_bias: cute.Tensor,  # [H] fp32, KDA [H * 128] (config.gate.dt_bias; else any fp32 tensor)
        lower_bound: Float32,  # the bounded gate's (else unused)
        qg: cute.Tensor,     # outputs (the `ChunkTerms` slots): query [B, T, H, 128]
        w: cute.Tensor,      # key
        u: cute.Tensor,      # value [B, T, H, V]
        kg: cute.Tensor,     # update_key [B, T, H, 128]
        aqk: cute.Tensor,    # intra [B, T, H, 64]
        eg: cute.Tensor,     # decay: [B, T, H] fp32 (KDA: [B, T, H, 128]; GDN folded: [B, T, H, 4])
        tiles: cute.Tensor,  # [num_tiles, NUM_TILE_FIELDS] int32
        num_tiles: Int32, grid_x: Int32, scale: Float32,
        flags: cute.Tensor,  # publish: int32 [(sequences x chunks per sequence) x H] (else any int32 tensor)
        chunks_per_seq: Int32, consumers: Int32, stream,
    ):
        flat = wt.flat
        q, k, v, g, beta = flat(q), flat(k), flat(v), flat(g), flat(beta)
        qg, w, u, kg, aqk, eg = flat(qg), flat(w), flat(u), flat(kg), flat(aqk), flat(eg)
        tma_q, tma_q_tensor, tma_k, tma_k_tensor, tma_v, tma_v_tensor = self.local.qkv_tma(q, k, v)
        # tma_store: store atoms for qg, kg, w, u's halves and aqk; otherwise the q atom stands in, unused
        outs = (tma_q, tma_q_tensor) * 5
        if cutlass.const_expr(self.tma_store):
            s2g = cpasync.CopyBulkTensorTileS2GOp()
            wide = wt.first_stage(wt.smem_layout(C, 128, self.io_dtype))
            narrow = wt.first_stage(wt.smem_layout(C, HALF, self.io_dtype))
            outs = ()
            for t, layout, cols in ((qg, wide, 128), (kg, wide, 128), (w, wide, 128), (u, narrow, HALF),
                                    (aqk, narrow, C)):
                atom, tensor = cpasync.make_tiled_tma_atom(s2g, wt.thd(t), layout, (C, cols))
                outs = outs + (atom, tensor)
        if cutlass.const_expr(self.compact):
            self.set_compact_shared_storage()
        elif cutlass.const_expr(self.kda):
            self.set_rows_shared_storage()
        else:
            self.set_solved_shared_storage()
        self.prep_kernel(
            tma_q, tma_q_tensor, tma_k, tma_k_tensor, tma_v, tma_v_tensor,
            g, beta, a_log, dt_bias, lower_bound, qg, w, u, kg, aqk, eg, tiles, num_tiles, scale, flags,
            chunks_per_seq, consumers, *outs,
        ).launch(grid=[grid_x, 1, 1], block=[self.num_threads, 1, 1], stream=stream,
                  min_blocks_per_mp=self.ctas_per_sm, use_pdl=False,
                  # a fixed carveout (all of the SM for shared memory): no device query when compiling
                  preferred_smem_carveout=100 if self.ctas_per_sm > 1 else None)

    @cute.jit
    def set_compact_shared_storage(self):
        """The compact build (GDN's folded terms, 2 or 3 CTAs per SM): one q/k/v stage; W2 and A1 staged in sK and
        sV; at 3 per SM sAkk lies over sQ and the 1 KB after it, sY over sXk."""
        io = self.io_dtype

        @cute.struct
        class CompactStorage:
            load_mbar: cute.struct.MemRange[cutlass.Int64, 2]
            sQ: cute.struct.Align[cute.struct.MemRange[io, C * 128], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[io, C * 128], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[io, C * 128], 1024]
            sXk: cute.struct.Align[cute.struct.MemRange[io, C * C], 1024]
            sXv: cute.struct.Align[cute.struct.MemRange[io, C * C], 1024]
            sAqk: cute.struct.Align[cute.struct.MemRange[io, C * C], 1024]
            sAkk: cute.struct.Align[cute.struct.MemRange[Float32, C * AKK_STRIDE], 16]
            sY: cute.struct.Align[cute.struct.MemRange[Float32, SOLVE_Y], 16]
            sG: cute.struct.MemRange[Float32, C]
            sEG: cute.struct.MemRange[Float32, C]
            sEGL: cute.struct.MemRange[Float32, C]
            sBeta: cute.struct.MemRange[Float32, C]

        @cute.struct
        class ThreePerSmStorage:
            sQ: cute.struct.Align[cute.struct.MemRange[io, C * 128], 1024]
            sAkkTail: cute.struct.MemRange[Float32, C * AKK_STRIDE - C * 64]
            sK: cute.struct.Align[cute.struct.MemRange[io, C * 128], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[io, C * 128], 1024]
            sXk: cute.struct.Align[cute.struct.MemRange[io, C * C], 1024]
            sXv: cute.struct.Align[cute.struct.MemRange[io, C * C], 1024]
            sAqk: cute.struct.Align[cute.struct.MemRange[io, C * C], 1024]
            load_mbar: cute.struct.MemRange[cutlass.Int64, 2]
            sG: cute.struct.MemRange[Float32, C]
            sEG: cute.struct.MemRange[Float32, C]
            sEGL: cute.struct.MemRange[Float32, C]
            sBeta: cute.struct.MemRange[Float32, C]

        self.shared_storage = ThreePerSmStorage if self.three_per_sm else CompactStorage
        self.smem_bytes = self.shared_storage.size_in_bytes()
        per_sm = self.ctas_per_sm   # 228 KB per SM, 1 KB of it reserved per CTA
        assert (self.smem_bytes + 1024) * per_sm <= 233472, \
            f"shared storage {self.smem_bytes} B: {per_sm} CTAs per SM do not fit"

    @cute.jit
    def set_rows_shared_storage(self):
        """KDA (row-anchored): the fields KDA's phase 1 reads, plus L_q, the right factors of bands 1-3 (band 0 in
        sVnew, u's staging later) and sC [10, 128] (see `kda_gates`)."""
        io = self.io_dtype

        @cute.struct
        class RowsStorage:
            load_mbar: cute.struct.MemRange[cutlass.Int64, 2]
            sQ: cute.struct.Align[cute.struct.MemRange[io, C * 128], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[io, C * 128], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[io, C * 128], 1024]
            sKb: cute.struct.Align[cute.struct.MemRange[io, C * 128], 1024]     # k 2^G
            sNegW: cute.struct.Align[cute.struct.MemRange[io, C * 128], 1024]   # L_k, then w
            sXv: cute.struct.Align[cute.struct.MemRange[io, C * C], 1024]
            sAqk: cute.struct.Align[cute.struct.MemRange[io, C * C], 1024]
            sVnew: cute.struct.Align[cute.struct.MemRange[io, C * 128], 1024]   # band-0 right factor, then u
            sLq: cute.struct.Align[cute.struct.MemRange[io, C * 128], 1024]
            sR1: cute.struct.Align[cute.struct.MemRange[io, 48 * 128], 1024]
            sR2: cute.struct.Align[cute.struct.MemRange[io, 32 * 128], 1024]
            sR3: cute.struct.Align[cute.struct.MemRange[io, 16 * 128], 1024]
            sAkk: cute.struct.Align[cute.struct.MemRange[Float32, C * AKK_STRIDE], 16]
            sY: cute.struct.Align[cute.struct.MemRange[Float32, SOLVE_Y], 16]
            sG: cute.struct.MemRange[Float32, C]
            sEG: cute.struct.MemRange[Float32, C]
            sEGL: cute.struct.MemRange[Float32, C]
            sBeta: cute.struct.MemRange[Float32, C]
            sFlag: cute.struct.MemRange[Int32, 4]
            sGk: cute.struct.Align[cute.struct.MemRange[Float32, C * 128], 16]
            sGL: cute.struct.MemRange[Float32, 128]
            sC: cute.struct.Align[cute.struct.MemRange[Float32, 10 * 128], 16]

        self.shared_storage = RowsStorage
        self.smem_bytes = RowsStorage.size_in_bytes()
        assert self.smem_bytes <= 232448, f"row-anchored shared storage {self.smem_bytes} B exceeds 227 KB"

    @cute.jit
    def set_solved_shared_storage(self):
        """GDN's solved build: the fused kernel's fields (2 q/k/v stages; w in sNegW, u in sVnew)."""
        io, stages = self.io_dtype, self.num_stages

        @cute.struct
        class SolvedStorage:
            load_mbar: cute.struct.MemRange[cutlass.Int64, stages * 2]
            sQ: cute.struct.Align[cute.struct.MemRange[io, C * 128 * stages], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[io, C * 128 * stages], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[io, C * 128 * stages], 1024]
            sKb: cute.struct.Align[cute.struct.MemRange[io, 64], 1024]
            sNegW: cute.struct.Align[cute.struct.MemRange[io, C * 128], 1024]
            sXk: cute.struct.Align[cute.struct.MemRange[io, C * C], 1024]
            sXv: cute.struct.Align[cute.struct.MemRange[io, C * C], 1024]
            sAqk: cute.struct.Align[cute.struct.MemRange[io, C * C], 1024]
            sVnew: cute.struct.Align[cute.struct.MemRange[io, 2 * C * HALF], 1024]
            sVnewD: cute.struct.Align[cute.struct.MemRange[io, 2 * C * HALF], 1024]
            sS: cute.struct.Align[cute.struct.MemRange[io, 2 * 128 * HALF], 1024]
            sAkk: cute.struct.Align[cute.struct.MemRange[Float32, C * AKK_STRIDE], 16]
            sY: cute.struct.Align[cute.struct.MemRange[Float32, SOLVE_Y], 16]
            sG: cute.struct.MemRange[Float32, C]
            sEG: cute.struct.MemRange[Float32, C]
            sEGL: cute.struct.MemRange[Float32, C]
            sBeta: cute.struct.MemRange[Float32, C]
            sFlag: cute.struct.MemRange[Int32, 4]
            sGk: cute.struct.Align[cute.struct.MemRange[Float32, 4], 16]
            sGL: cute.struct.MemRange[Float32, 4]

        self.shared_storage = SolvedStorage
        self.smem_bytes = SolvedStorage.size_in_bytes()
        assert self.smem_bytes <= 232448, f"shared storage {self.smem_bytes} B exceeds the 227 KB an SM90 CTA can have"

    @cute.kernel
    def prep_kernel(
        self, tma_q: cute.CopyAtom, mQ: cute.Tensor, tma_k: cute.CopyAtom, mK: cute.Tensor, tma_v: cute.CopyAtom,
        mV: cute.Tensor, mG: cute.Tensor, mBeta: cute.Tensor, mALog: cute.Tensor, mDtBias: cute.Tensor,
        lower_bound: Float32, mQg: cute.Tensor, mW: cute.Tensor, mU: cute.Tensor, mKg: cute.Tensor, mA: cute.Tensor,
        mEg: cute.Tensor,
        mTiles: cute.Tensor, num_tiles: Int32, scale: Float32, mFlags: cute.Tensor, chunks_per_seq: Int32,
        consumers: Int32, tma_qg: cute.CopyAtom, mQgT: cute.Tensor, tma_kg: cute.CopyAtom, mKgT: cute.Tensor,
        tma_w: cute.CopyAtom, mWT: cute.Tensor, tma_u: cute.CopyAtom, mUT: cute.Tensor, tma_a: cute.CopyAtom,
        mAT: cute.Tensor,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        if cutlass.const_expr(self.pdl):
            # the PDL-launched state pass may start its prologue; its griddepcontrol.wait still waits for this grid
            cute.arch.griddepcontrol_launch_dependents()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        wg = cute.arch.make_warp_uniform(tidx // 128)
        smem = cutlass.memory.SmemAllocator()
        st = smem.allocate(self.shared_storage)
        load = pipeline.PipelineTmaAsync.create(
            barrier_storage=st.load_mbar.data_ptr(),
            num_stages=self.num_stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 1),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 8),
            tx_count=self.tma_bytes,
        )
        sched = TileScheduler.create(mTiles, num_tiles, self.publish)
        if warp_idx == 0:
            cpasync.prefetch_descriptor(tma_q)
            cpasync.prefetch_descriptor(tma_k)
            cpasync.prefetch_descriptor(tma_v)
            if cutlass.const_expr(self.tma_store):
                for atom in (tma_qg, tma_kg, tma_w, tma_u, tma_a):
                    cpasync.prefetch_descriptor(atom)
        ns = self.num_stages
        view = self.local.view   # (a host-side helper: builds layouts while tracing)
        if cutlass.const_expr(self.compact):
            if warp_idx == 8:
                self.local.producer(sched, load, tma_q, mQ, tma_k, mK, tma_v, mV, view(st.sQ, C, 128, ns),
                                    view(st.sK, C, 128, ns), view(st.sV, C, 128, ns), ns, self.load_v,
                                    self.config.group)
            else:
                self.prep_consumer(sched, load, wg, tidx, mG, mBeta, (mALog, mDtBias, lower_bound), mQg, mW, mU,
                                   mKg, mA, mEg, scale, st, mFlags, chunks_per_seq, consumers, None)
        else:
            if wg == 0:
                cute.arch.setmaxregister_decrease(40)
                if warp_idx == 0:
                    self.local.producer(sched, load, tma_q, mQ, tma_k, mK, tma_v, mV, view(st.sQ, C, 128, ns),
                                        view(st.sK, C, 128, ns), view(st.sV, C, 128, ns), ns, self.load_v,
                                        self.config.group)
            else:
                cute.arch.setmaxregister_increase(232)
                self.prep_consumer(sched, load, wg - 1, tidx - 128, mG, mBeta, (mALog, mDtBias, lower_bound), mQg,
                                   mW, mU, mKg, mA, mEg, scale, st, mFlags, chunks_per_seq, consumers,
                                   ((tma_qg, mQgT), (tma_kg, mKgT), (tma_w, mWT), (tma_u, mUT), (tma_a, mAT)))

    @cute.jit
    def prep_consumer(self, sched, load, j, ctid, mG, mBeta, gate_args, mQg, mW, mU, mKg, mA, mEg, scale, st,
                      mFlags, chunks_per_seq, consumers, tma_outs):
        kda = self.kda
        local = self.local
        wtid = ctid % 128
        v0 = j * HALF
        ns = self.num_stages
        sQ = local.view(st.sQ, C, 128, ns)
        sK = local.view(st.sK, C, 128, ns)
        sK_mn = local.view(st.sK, C, 128, ns, True)
        sV_mn = local.view(st.sV, C, 128, ns, True) if self.load_v else sK_mn   # (unread without a v load)
        if cutlass.const_expr(self.compact):
            # w and u replace the k and v columns this consumer's products read (stage 0: one stage)
            sW_j = cute.local_tile(sK[None, None, 0], (C, HALF), (0, j))
            sU_j = cute.local_tile(local.view(st.sV, C, 128, ns)[None, None, 0], (C, HALF), (0, j))
            sW = sFlag = None   # KDA only
        else:
            sW = local.view(st.sNegW, C, 128)[None, None, 0]      # w (not negated here), then stored
            sW_j = cute.local_tile(sW, (C, HALF), (0, j))
            sU_j = local.view(st.sVnew, C, HALF, 2)[None, None, j]   # u staging, one half per consumer
            sFlag = st.sFlag.get_tensor(cute.make_layout(4))
        sXv = local.view(st.sXv, C, C)[None, None, 0]
        sAqk = local.view(st.sAqk, C, C)[None, None, 0]
        if cutlass.const_expr(self.three_per_sm):
            # q is dead once step 1's products have read it (the folded build writes no qg); X is dead after step 3
            sAkk = cute.make_tensor(cute.recast_ptr(st.sQ.data_ptr(), dtype=Float32),
                                    cute.make_layout((C, C), stride=(AKK_STRIDE, 1)))
            sY = cute.make_tensor(cute.recast_ptr(st.sXk.data_ptr(), dtype=Float32), cute.make_layout(SOLVE_Y))
        else:
            sAkk = st.sAkk.get_tensor(cute.make_layout((C, C), stride=(AKK_STRIDE, 1)))
            sY = st.sY.get_tensor(cute.make_layout(SOLVE_Y))
        sG = st.sG.get_tensor(cute.make_layout(C))
        sEG = st.sEG.get_tensor(cute.make_layout(C))
        sEGL = st.sEGL.get_tensor(cute.make_layout(C))
        sBeta = st.sBeta.get_tensor(cute.make_layout(C))
        sXk = sXv
        sGk = sG
        sGL = sG
        sC = sLq = sR = None   # row_anchors only
        if cutlass.const_expr(self.kda):
            sC = st.sC.get_tensor(cute.make_layout((10, 128), stride=(128, 1)))
            sLq = local.view(st.sLq, C, 128)[None, None, 0]
            sR = (local.view(st.sVnew, C, 128)[None, None, 0], local.view(st.sR1, 48, 128)[None, None, 0],
                  local.view(st.sR2, 32, 128)[None, None, 0], local.view(st.sR3, 16, 128)[None, None, 0])
        if cutlass.const_expr(kda):
            sGk = st.sGk.get_tensor(cute.make_layout((C, 128), stride=(128, 1)))
            sGL = st.sGL.get_tensor(cute.make_layout(128))
        else:
            sXk = local.view(st.sXk, C, C)[None, None, 0]

        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.num_stages)
        mma64 = local.make_mma(False, True)
        thr_kk = local.make_mma(False, False).get_slice(wtid)
        acc = cute.make_rmem_tensor(mma64.get_slice(wtid).partition_shape_C((C, HALF)), Float32)
        tAkk = thr_kk.partition_C(sAkk)

        work = sched.initial_work()
        while work.is_valid:
            head = work.head
            tok0 = work.tok_start
            tok_end = work.tok_end
            mALog, mDtBias, lower_bound = gate_args
            gp = local.math.gate_params(mALog, mDtBias, head, ctid)   # FLA's gate arguments, applied as read
            gv, gw, bv = local.math.gate_rows(ctid, tok0, tok_end, head, mG, mBeta)   # raw: converted at use
            if cutlass.const_expr(kda):
                local.math.kda_g_prefetch_vec(ctid, tok0, local.math.rows_in(tok_end - tok0), head, mG, sGk)

            for c in cutlass.range(work.chunk_end - work.chunk_start, unroll=1):
                t0 = tok0 + c * C
                L = local.math.rows_in(tok_end - t0)
                # -- 0. gates (as the fused kernel: loaded one chunk ahead)
                g_own, g_other, beta = local.math.gate_values(ctid, t0, tok_end, gv, gw, bv, gp, lower_bound)
                if cutlass.const_expr(kda):
                    local.math.kda_gates(ctid, t0, L, head, mG, mBeta, sGk, sGL, sBeta, sFlag, beta, gp, lower_bound,
                                         sC=sC, g_vec=True)
                else:
                    local.math.gdn_gates(ctid, L, g_own, g_other, beta, sG, sEG, sEGL, sBeta)
                gv, gw, bv = local.math.gate_rows(ctid, t0 + C, tok_end, head, mG, mBeta)
                if cutlass.const_expr(self.tma_store):
                    if ctid == 0:
                        # the last chunk's TMA stores have read their staging tiles (the barrier below tells all)
                        cute.arch.cp_async_bulk_wait_group(0, read=True)
                load.consumer_wait(state)
                cute.arch.barrier(barrier_id=1, number_of_threads=256)
                stage = state.index

                # -- 1. Akk (fp32) and Aqk (16-bit); KDA: then the in-place gating of q and k, kb = k 2^G
                if cutlass.const_expr(self.kda):
                    more = c + 1 < work.chunk_end - work.chunk_start   # the next chunk's g to prefetch
                    L1 = local.math.rows_in(tok_end - t0 - C)
                    if sFlag[0] != 0:   # past the anchor limit: the exact path, then the gating pass
                        local.kda_intra(j, ctid, wtid, L, scale, stage, sQ, sK, sAkk, sAqk, sW, sGk, sBeta, sFlag,
                                        st)
                        local.kda_gating_vec(ctid, L, stage, sQ, sK, local.view(st.sKb, C, 128)[None, None, 0], sGk,
                                             sGL)
                        cute.arch.fence_proxy("async.shared", space="cta")
                        cute.arch.barrier(barrier_id=1, number_of_threads=256)
                        if more:
                            local.math.kda_g_prefetch_vec(ctid, t0 + C, L1, head, mG, sGk)
                    else:
                        q_scale = Float32(1.0)
                        if cutlass.const_expr(self.tma_store):
                            q_scale = scale   # qg leaves as the smem q tile (TMA) or by threads, unscaled there
                        local.kda_row_factors(ctid, L, stage, sQ, sK, local.view(st.sKb, C, 128)[None, None, 0], sW,
                                              sLq, sR, sC, sGk, sGL, q_scale)
                        cute.arch.fence_proxy("async.shared", space="cta")
                        cute.arch.barrier(barrier_id=1, number_of_threads=256)
                        # the band products run while the next chunk's g loads (G is not read after the pass)
                        thr_b, acc_b = local.kda_row_accumulators(wtid)
                        if j == 0:
                            local.kda_row_issue(wtid, acc_b, sW, sR)
                        else:
                            local.kda_row_issue(wtid, acc_b, sLq, sR)
                        if more:
                            local.math.kda_g_prefetch_vec(ctid, t0 + C, L1, head, mG, sGk)
                        warpgroup.wait_group(0)
                        if j == 0:
                            local.kda_row_finish(wtid, L, scale, thr_b, acc_b, tAkk, sAqk, sBeta, True)
                        else:
                            local.kda_row_finish(wtid, L, scale, thr_b, acc_b, tAkk, sAqk, sBeta, False)
                        cute.arch.fence_proxy("async.shared", space="cta")
                        cute.arch.barrier(barrier_id=1, number_of_threads=256)
                else:
                    acc_kk = cute.make_rmem_tensor(thr_kk.partition_shape_C((C, C)), Float32)
                    cc_kk = thr_kk.partition_C(cute.make_identity_tensor((C, C)))
                    local.gdn_intra_issue(j, wtid, acc_kk, stage, sQ, sK, True)
                    warpgroup.wait_group(0)
                    if cutlass.const_expr(self.three_per_sm):
                        # consumer 0 writes Akk over q: consumer 1's q k^T product must have read q
                        cute.arch.barrier(barrier_id=1, number_of_threads=256)
                    local.gdn_intra_finish(j, wtid, acc_kk, cc_kk, L, scale, sG, sBeta, tAkk, sAqk, True)
                    cute.arch.fence_proxy("async.shared", space="cta")
                    cute.arch.barrier(barrier_id=1, number_of_threads=256)

                # -- 2. X = (I + Akk)^-1 -> Xv = X diag(beta), GDN: Xk = X diag(beta 2^G)
                local.math.solve_blocked(ctid, sAkk, sY, sXv, sXk, sBeta, sEG, sEGL if self.folded and not kda else None)
                cute.arch.fence_proxy("async.shared", space="cta")
                cute.arch.barrier(barrier_id=1, number_of_threads=256)

                # -- 3. w and u, V columns [v0, v0 + 64) of this consumer -> smem (fold: W2's columns, and A1)
                if cutlass.const_expr(self.folded and kda):
                    # W2 = Xv^T kg (kg: the k tile as step 1 gated it) into w's staging, A1 = Aqk Xv into u's
                    sXv_t = local.view(st.sXv, C, C, 1, True)[None, None, 0]   # (i, r): Xv^T
                    local.gemm(wtid, acc, sXv_t, cute.local_tile(sK_mn[None, None, stage], (HALF, C), (j, 0)),
                               True, True, False)
                    local.store_acc(wtid, mma64, acc, sW_j)
                    if j == 0:
                        local.gemm(wtid, acc, sAqk, sXv_t, False, True, False)
                        local.store_acc(wtid, mma64, acc, sU_j)
                    if cutlass.const_expr(self.tma_store):
                        cute.arch.fence_proxy("async.shared", space="cta")   # W2, A1 -> the TMA stores' reads
                    cute.arch.barrier(barrier_id=1, number_of_threads=256)
                elif cutlass.const_expr(self.folded):
                    sXf_t = local.view(st.sXk, C, C, 1, True)[None, None, 0]   # (i, r): Xf^T
                    local.gemm(wtid, acc, sXf_t, cute.local_tile(sK_mn[None, None, stage], (HALF, C), (j, 0)),
                               True, True, False)
                    local.store_acc(wtid, mma64, acc, sW_j)
                    if j == 0:
                        local.gemm(wtid, acc, sAqk, local.view(st.sXv, C, C, 1, True)[None, None, 0], False, True,
                                   False)
                        local.store_acc(wtid, mma64, acc, sU_j)
                    cute.arch.barrier(barrier_id=1, number_of_threads=256)
                else:   # GDN's solved terms
                    local.gemm(wtid, acc, sXk, cute.local_tile(sK_mn[None, None, stage], (HALF, C), (j, 0)),
                               False, True, False)
                    local.store_acc(wtid, mma64, acc, sW_j)
                    local.gemm(wtid, acc, sXv, cute.local_tile(sV_mn[None, None, stage], (HALF, C), (j, 0)),
                               False, True, False)
                    local.store_acc(wtid, mma64, acc, sU_j)
                    cute.arch.barrier(barrier_id=1, number_of_threads=256)

                # -- 4. the terms -> global (rows < L)
                if cutlass.const_expr(self.tma_store):
                    fast = sFlag[0] == 0
                    if fast and L == C:
                        if ctid == 0:
                            self.store_terms_tma(tma_outs, stage, st, t0, head)
                    else:
                        q_store_scale = scale
                        if fast:
                            q_store_scale = Float32(1.0)   # the factor pass scaled q
                        self.store_fold_terms(j, ctid, wtid, L, stage, sQ, sW_j, sU_j, st, mQg, mW, mKg, mA, t0,
                                              head, v0, q_store_scale)
                elif cutlass.const_expr(self.folded and kda):   # (without tma_out the factor pass leaves q unscaled)
                    self.store_fold_terms(j, ctid, wtid, L, stage, sQ, sW_j, sU_j, st, mQg, mW, mKg, mA, t0, head,
                                          v0, scale)
                elif cutlass.const_expr(self.folded):   # GDN: W2 by the update_key output, A1 by intra
                    local.store_rows(wtid, sW_j, mKg, t0, head, v0, L)
                    if j == 0:
                        local.store_rows(wtid, sU_j, mA, t0, head, 0, L)
                else:
                    self.store_terms(j, ctid, wtid, L, stage, sQ, sK, sW_j, sU_j, sAqk, sEG, sEGL, mQg, mW, mU, mKg,
                                     mA, t0, head, v0, scale, scale)
                if cutlass.const_expr(kda):
                    if ctid < 128:
                        mEg[t0 + L - 1, head, ctid] = cute.math.exp2(sGL[ctid], fastmath=True)
                elif cutlass.const_expr(self.token_factors):
                    if ctid < L:   # row ctid's factors for the state pass, one 16-byte store
                        f4 = cute.make_rmem_tensor((4,), Float32)
                        f4[0] = scale * sEG[ctid]
                        f4[1] = sEGL[ctid]
                        f4[2] = sEG[L - 1]
                        f4[3] = sEG[ctid]
                        cute.autovec_copy(f4, mEg[t0 + ctid, head, None])
                else:
                    if ctid == 0:
                        mEg[t0 + L - 1, head] = sEG[L - 1]
                if cutlass.const_expr(self.compact):
                    # generic-proxy writes (w, u) to the stage before the next TMA writes it
                    cute.arch.fence_proxy("async.shared", space="cta")
                if cutlass.const_expr(self.tma_store):
                    # thread 0 has waited for the TMA stores' reads: only then may stage and staging be rewritten
                    cute.arch.barrier(barrier_id=1, number_of_threads=256)
                load.consumer_release(state)
                state.advance()
                # Protects smem from the next chunk's writers; orders all threads' stores before thread 0's release.
                cute.arch.barrier(barrier_id=1, number_of_threads=256)
                if cutlass.const_expr(self.publish):
                    if ctid == 0:
                        num_heads = mBeta.shape[1]
                        idx = (work.seq * chunks_per_seq + work.chunk_start + c) * num_heads + head
                        cute.arch.fence_acq_rel_gpu()
                        cute.arch.atomic_add(mFlags.iterator + idx, consumers, sem="release", scope="gpu")
            work = sched.advance(work)
        if cutlass.const_expr(self.tma_store):
            if ctid == 0:
                cute.arch.cp_async_bulk_wait_group(0)   # every TMA store complete before the CTA ends

    @cute.jit
    def store_terms(self, j, ctid, wtid, L, stage, sQ, sK, sW_j, sU_j, sAqk, sEG, sEGL, mQg, mW, mU, mKg, mA, t0,
                    head, v0, q_scale, scale):
        """The solved terms, step 4 by the consumer threads (16-byte vectors, rows < L): w and u (this consumer's
        64 columns), Aqk (consumer 0), qg = q_scale 2^G x the q tile's rows and kg = 2^(G_L - G) x the k tile's."""
        self.local.store_rows(wtid, sW_j, mW, t0, head, v0, L)
        self.local.store_rows(wtid, sU_j, mU, t0, head, v0, L)
        if j == 0:
            self.local.store_rows(wtid, sAqk, mA, t0, head, 0, L)
        self.store_scaled_rows(ctid, L, sQ[None, None, stage], mQg, t0, head, q_scale, sEG, True)
        self.store_scaled_rows(ctid, L, sK[None, None, stage], mKg, t0, head, scale, sEGL, False)

    @cute.jit
    def store_fold_terms(self, j, ctid, wtid, L, stage, sQ, sW_j, sU_j, st, mQg, mW, mKg, mA, t0, head, v0,
                         q_scale):
        """KDA's folded terms, step 4 by the consumer threads (rows < L): qg (q_scale x the q tile) -> query, kE (kb
        tile) -> key, W2 (this consumer's 64 columns, staged as w) -> update_key, A1 (consumer 0, as u) -> intra."""
        self.local.store_rows(wtid, sW_j, mKg, t0, head, v0, L)
        if j == 0:
            self.local.store_rows(wtid, sU_j, mA, t0, head, 0, L)
        self.store_scaled_rows(ctid, L, sQ[None, None, stage], mQg, t0, head, q_scale, None, True)
        self.store_scaled_rows(ctid, L, self.local.view(st.sKb, C, 128)[None, None, 0], mW, t0, head, Float32(1.0),
                               None, False)

    @cute.jit
    def store_terms_tma(self, tma_outs, stage, st, t0, head):
        """`tma_store` (KDA's folded terms), consumer thread 0: TMA stores of qg (the stage's q tile: one bulk group),
        then kE, W2 and A1 from staging (a second group). Returns once the first group has read shared memory (the
        stage may then be released); the second is waited for before the next chunk's q/k wait."""
        (tma_qg, mQgT), (tma_kg, mKgT), (tma_w, mWT), (tma_u, mUT), (tma_a, mAT) = tma_outs
        view = self.local.view
        stage_jobs = ((tma_qg, mQgT, view(st.sQ, C, 128, self.num_stages), stage, 128, 0),)
        staging_jobs = ((tma_w, mWT, view(st.sKb, C, 128), 0, 128, 0),
                        (tma_kg, mKgT, view(st.sNegW, C, 128), 0, 128, 0),
                        (tma_a, mAT, view(st.sVnew, C, HALF, 2), 0, C, 0))
        for jobs in (stage_jobs, staging_jobs):
            for atom, mT, sT, idx, cols, col_tile in jobs:
                g_tile = cute.local_tile(cute.domain_offset((t0, 0), mT[None, None, head]), (C, cols),
                                         (0, col_tile))
                s_part, g_part = cpasync.tma_partition(
                    atom, 0, cute.make_layout(1), cute.group_modes(sT, 0, 2), cute.group_modes(g_tile, 0, 2),
                )
                cute.copy(atom, s_part[(None, idx)], g_part)
            cute.arch.cp_async_bulk_commit_group()
        cute.arch.cp_async_bulk_wait_group(1, read=True)

    @cute.jit
    def store_scaled_rows(self, ctid, L, src, mDst, t0, head, scale, sRow, is_q: bool):
        """A [64 x 128] 16-bit smem tile -> mDst[t0 + r, head, :] for rows r < L, in 16-byte vectors (256 threads),
        times a row factor: qg (`is_q`): scale (KDA: q is already gated) or scale 2^G_r (GDN, sRow = 2^G);
        kg: 1 (KDA: k is already gated) or 2^(G_L - G_r) (GDN, sRow = 2^(G_L - G))."""
        io = self.io_dtype
        tiled = self.local.vec_copy()
        thr = tiled.get_slice(ctid)
        tS = thr.partition_S(src)
        crd = thr.partition_S(cute.make_identity_tensor((C, 128)))
        for m in cutlass.range(cute.size(tS, mode=[1]), unroll=1):
            r, d0 = crd[0, m, 0]
            if r < L:
                x8 = cute.make_rmem_tensor_like(tS[None, m, None])
                cute.copy(tiled, tS[None, m, None], x8)
                f = Float32(1.0)
                if cutlass.const_expr(is_q):
                    f = scale
                if cutlass.const_expr(not self.kda):
                    f = f * sRow[r]
                y8 = cute.make_rmem_tensor((8,), io)
                for e in cutlass.range_constexpr(8):
                    y8[e] = io(Float32(x8[e]) * f)
                cute.autovec_copy(y8, cute.local_tile(mDst[t0 + r, head, None], (8,), (cute.assume(d0, divby=8) // 8,)))
