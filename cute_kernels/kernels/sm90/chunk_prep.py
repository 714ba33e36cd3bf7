"""SM90 phase 1 of the two-phase chunked forward (design: NOTES.md "Issue 5: a parallel chunk-prep phase"): every
chunk's local terms, in parallel over (sequence, head, chunk range), for `ChunkStatePassSm90` to consume.

It is the fused kernel's chunk-local half (`ChunkGatedDeltaRuleFwdSm90` steps 0-3: gates, intra-chunk products,
solve, w and u) with the state half replaced by stores of the terms to global memory.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import cpasync, warpgroup

from schedulers.device import TileScheduler

from . import wgmma_tiles as wt
from .gdn_fwd import AKK_STRIDE, HALF, SOLVE_Y, SOLVE_Y_MMA, ChunkGatedDeltaRuleFwdSm90, C, flat, thd


class ChunkPrepSm90(ChunkGatedDeltaRuleFwdSm90):
    """Phase 1: per chunk (rows r < L of it; all [tokens, H, D] outputs, tokens = B * T flattened)

        qg = scale exp(G) q,  w = X diag(beta) (exp(G) k),  u = X diag(beta) v,  kg = exp(G_last - G) k  (16-bit)
        aqk[r, :] = Aqk[r, :] (16-bit, 64 columns),  eg[t_last] = exp(G_last) (fp32; only each chunk's last row is
        written: the state pass reads only that row)

    Warp roles, pipeline and shared memory as `ChunkGatedDeltaRuleFwdSm90` (producer warp: q/k/v TMA ring;
    consumer warpgroups 1 and 2: gates, Akk/Aqk, solve; consumer j computes w and u for V columns
    [64 j, 64 j + 64)); the consumers then store the terms: w, u and Aqk through smem in 16-byte rows, qg and kg
    from the (gated) q/k tiles in 16-byte vectors, before releasing the q/k/v stage.
    Work tiles: any chunk ranges (the op uses a few chunks per tile, so every SM has work at small B x H).

    `slim` (GDN only): two CTAs per SM, so one CTA's lock-step phases and loads overlap the other's. 288 threads
    (consumer warpgroups 0 and 1, the TMA producer is warp 8; no register reallocation: 112 registers each), one
    q/k/v stage, and a shared-memory struct of its own (~95 KB): qg and kg leave right after step 1, so w is
    staged in the k tile and u in the v tile it replaces (each warpgroup overwrites only the 64 columns its own
    product read).

    `raw_qk` (with `slim`): qg and kg are not written -- the state pass reads q and k themselves (`ChunkStatePassSm90
    (raw_qk=True)`) and applies the per-token factors -- and eg is [tokens, H, 4] fp32, every row r < L of a chunk
    holding (scale 2^G_r, 2^(G_last - G_r), 2^G_last, 0) in one 16-byte store. 32 of the ~120 KB a chunk and head
    moves through global memory (qg and kg) are then never written.

    `trio` (with `raw_qk`): three CTAs per SM. The raw build reads q only in step 1's q k^T product, so the fp32 Akk
    buffer (rows padded to 68 floats) lies over the q tile and the 1 KB after it, and the solve's scratch over the
    Xk tile (written only after the solve's last use of it); one more consumer barrier after step 1's products
    (consumer 0 writes Akk once consumer 1's product has read q). 75.8 KB of shared memory, at most 72 registers.

    `fold` (with `raw_qk`): v is not loaded and neither w nor u is formed. The solve's second output is Xf =
    diag(2^(G_last - G)) X diag(beta) (rows scaled, instead of Xk's columns), and step 3 forms W2 = Xf^T k (consumer
    j: columns [64 j, 64 j + 64), into the w output) and A1 = Aqk Xv (consumer 0, into the aqk output, instead of
    Aqk); eg's fourth factor is 2^G_r. `ChunkStatePassSm90(fold=True)` reads them with q, k and v. Per chunk and
    head, 16 KB read (v) and 16 KB written (u) fewer.
    KDA's `fold` (with `row_anchors`): v is not loaded and u not formed; step 3 forms W2 = Xv^T kg (T = Xv = X
    diag(beta); kg: the k tile as step 1 gated it, consumer j's columns) and A1 = Aqk Xv (consumer 0), and the
    outputs are qg, kE = k 2^G (the kb tile, per channel: no row factor can stand in for it) by the w output, W2 by
    the kg output and A1 by the aqk output; eg as before. The plain KDA state pass reads them unchanged, with the
    call's v as u: R = v - kE S stands in for v_new, o += A1 R, S += W2^T R. Per chunk and head 16 KB read and
    16 KB written fewer, and half a product (A1's 64 x 64 x 64 instead of u's 64 x 64 x 128). KDA's fold also
    runs with `publish` (the overlapped path; its terms then leave by the threads' stores).

    `stages` (2: KDA's `fold` only): a two-stage q/k ring. KDA's phase 1 otherwise has one stage (its G tile
    takes the room), so the next chunk's q / k load starts only at this chunk's release. The fold loads no v, so
    its 16 KB and the solve's scratch (sY, laid over the band factors R1..R3, which are dead once the band
    products have been read: step 2's last barrier comes before the solve) pay for the second q / k stage
    (219136 -> 231424 bytes). Same arithmetic: the terms are bitwise those of the one-stage build. Built for the
    step-1 wait (~1.9k of ~25k cycles per chunk, H200 profile, session 14); measured (H200, session 29) phase 1
    -2% at B=16 H=64 T=4096 and +0..2% at B*H <= 32 -- that stamp also covers thread 0's wait for the previous
    chunk's TMA stores to read their staging tiles, which no second q / k stage hides. Off (KDA_PREP_STAGES).

    `pdl`: every CTA starts with `griddepcontrol.launch_dependents`, so a state pass launched with PDL starts its
    prologue once this grid's last wave has begun (it waits for the whole grid before reading the terms).

    `publish` (the overlapped path: the state pass runs at the same time, on SMs this grid leaves free): the grid
    is persistent (CTA b takes tiles b, b + grid, ...; the op orders tiles chunk-major, so the earliest chunks of
    every (sequence, head) come first), and after each chunk's terms are stored and the consumers' barrier has
    passed, consumer thread 0 publishes the chunk: a gpu-scope release fence, then `flags[(seq * chunks_per_seq +
    chunk) * H + head] += consumers` (an atomic release add; `consumers`: the state-pass CTAs that read the
    chunk, each of which takes one back after its acquire -- so every flag is 0 again when the call ends).
    This grid never waits on anything, so the state pass spinning on the flags cannot deadlock it.

    `secondary` (with `publish`; GDN's raw overlapped path): launched on the state pass's stream right after it,
    as its programmatic dependent (`use_pdl`): the grid starts once every state CTA has passed its
    `griddepcontrol.wait` (so the stream's earlier kernels are complete) and signalled
    `griddepcontrol.launch_dependents` (so the state CTAs hold their SMs first, and this grid fills the others).
    It does not wait at its start (the state pass waits for it, through the flags); CTA 0 runs
    `griddepcontrol.wait` at its end instead, so this grid completes only after the state pass: the stream's
    later kernels then find both complete. The other CTAs exit when their tiles are done, so a CTA that found no
    room at launch still runs once one ends: no deadlock whatever the residency.

    `row_anchors` (KDA, with `vec_elementwise`): the fast path's Akk / Aqk in the row-anchored form
    (`cute_kernels/reference/kda_intra.py`, form "rows"): one 16-byte-vector pass over the chunk forms the left
    factors of k and q (anchored at each row's own 16-row block), the right factors of the four block bands
    (R0 = k 2^(G_a - G) in fp32, times the band's channel factors from `kda_gates`), and the gated q, k and kb of
    step 1 -- then each consumer warpgroup issues four 64 x {64, 48, 32, 16} x 128 wgmma products (k rows:
    Akk, q rows: Aqk) and keeps band delta of product delta. Two CTA barriers instead of the column form's ten;
    chunks past the anchor limit take the exact path (`kda_intra`, then `kda_gating_vec`) as before. Its own
    shared-memory struct (no state tile; L_q, the band factors and the channel factors added).

    `tma_out` (with `row_anchors`, not `publish`): a full chunk on the fast path leaves by six TMA stores
    (`cp.async.bulk.tensor` shared -> global: qg, kg from the gated q / k tiles -- the factor pass then folds
    `scale` into q -- then w, u's two halves and Aqk from their staging tiles), issued by consumer thread 0, which
    waits only until the first two have read the stage before it is released; the staging tiles' stores run on
    under the next chunk's gates step (waited for before its q/k/v wait). The threads' 16-byte stores stay for
    partial chunks (a TMA box would write the next sequence's rows) and exact-path chunks.

    `profile` (diagnostics only; its eg output is not written): consumer thread 0 sums clock64 cycles per step of
    every chunk -- (0) gates, (1) the q/k/v wait, (2) Akk/Aqk, (3) qg/kg stores (slim), (4) solve, (5) w/u
    products, (6) global stores + release -- and writes them, its chunk count (7), the CTA's whole time (8) and,
    `row_anchors`, the parts of step 2 on fast chunks (9: the factor pass, 10: the band products; step 2 keeps
    the rest: the exact chunks and the next chunk's g prefetch), and the solve's parts (11: level 0, 12: level 16,
    13: level 32, 14: the 16-bit stores; step 4 keeps the final fence and barrier) as floats to eg's first
    elements, 16 per CTA (`PROFILE_FIELDS`).
    """

    PROFILE_FIELDS = 16

    def __init__(self, io_dtype, beta_dtype, kda: bool = False, vec_elementwise: bool = False,
                 prefetch_gates: bool = False, slim: bool = False, profile: bool = False, pdl: bool = False,
                 publish: bool = False, row_anchors: bool = False, tma_out: bool = False, raw_qk: bool = False,
                 trio: bool = False, solve_mma: bool = False, secondary: bool = False, fold: bool = False,
                 stages: int = 1):
        super().__init__(io_dtype, beta_dtype, False, False, False, kda=kda, mode="forward",
                         vec_elementwise=vec_elementwise, prefetch_gates=prefetch_gates)
        if slim and kda:
            raise ValueError("ChunkPrepSm90: slim (two CTAs per SM) is GDN only (KDA's G tile needs 32 KB more)")
        if row_anchors and not (kda and vec_elementwise):
            raise ValueError("ChunkPrepSm90: row_anchors is KDA's, with vec_elementwise")
        self.row_anchors = row_anchors
        if tma_out and (not row_anchors or publish):
            raise ValueError("ChunkPrepSm90: tma_out is the row-anchored (KDA) build's, without publish")
        self.tma_out = tma_out
        if raw_qk and not slim:
            raise ValueError("ChunkPrepSm90: raw_qk is the slim (GDN) build's")
        self.raw_qk = raw_qk
        if trio and not raw_qk:
            raise ValueError("ChunkPrepSm90: trio (three CTAs per SM) is the raw_qk build's")
        self.trio = trio
        if fold and (not (raw_qk or row_anchors) or (publish and not row_anchors)):
            raise ValueError("ChunkPrepSm90: fold is the raw_qk (GDN) or row-anchored (KDA) build's; with publish "
                             "only KDA's")
        self.fold = fold
        if fold:
            self.load_v = False
            self.tma_bytes = 2 * C * 128 * io_dtype.width // 8
        if stages not in (1, 2) or (stages == 2 and not (kda and fold and row_anchors)):
            raise ValueError(f"ChunkPrepSm90: stages={stages}; 2 is KDA's fold build's (row_anchors) option")
        if stages == 2:
            self.num_stages = 2
        if solve_mma and not (slim or row_anchors):
            raise ValueError("ChunkPrepSm90: solve_mma is the slim (GDN) and row-anchored (KDA) builds' option")
        self.solve_mma = solve_mma
        self.slim = slim
        if slim:
            self.num_stages = 1
            self.num_threads = 288
        self.ctas_per_sm = 3 if trio else 2 if slim else 1
        self.profile = profile
        self.pdl = pdl
        self.publish = publish
        if secondary and not publish:
            raise ValueError("ChunkPrepSm90: secondary is the overlapped path's (publish) option")
        self.secondary = secondary

    @cute.jit
    def __call__(
        self,
        q: cute.Tensor,      # [B, T, H, 128]
        k: cute.Tensor,
        v: cute.Tensor,      # [B, T, H, V]
        g: cute.Tensor,      # [B, T, H] fp32 (KDA: [B, T, H, 128])
        beta: cute.Tensor,   # [B, T, H]
        qg: cute.Tensor,     # outputs: [B, T, H, 128]
        w: cute.Tensor,
        u: cute.Tensor,      # [B, T, H, V]
        kg: cute.Tensor,     # [B, T, H, 128]
        aqk: cute.Tensor,    # [B, T, H, 64]
        eg: cute.Tensor,     # [B, T, H] fp32 (KDA: [B, T, H, 128]; raw_qk: [B, T, H, 4])
        tiles: cute.Tensor,  # [num_tiles, NUM_TILE_FIELDS] int32
        num_tiles: Int32,
        grid_x: Int32,
        scale: Float32,
        flags: cute.Tensor,  # publish: int32 [(sequences x chunks per sequence) x H] (else any int32 tensor)
        chunks_per_seq: Int32,
        consumers: Int32,
        stream,
    ):
        q, k, v, g, beta = flat(q), flat(k), flat(v), flat(g), flat(beta)
        qg, w, u, kg, aqk, eg = flat(qg), flat(w), flat(u), flat(kg), flat(aqk), flat(eg)
        tma_q, tma_q_tensor, tma_k, tma_k_tensor, tma_v, tma_v_tensor = self.qkv_tma(q, k, v)
        # tma_out: store atoms for qg, kg, w ([64 x 128] tiles), u's halves and aqk ([64 x 64]); otherwise the
        # q atom stands in, unused (no descriptors encoded per call for nothing)
        outs = (tma_q, tma_q_tensor) * 5
        if cutlass.const_expr(self.tma_out):
            s2g = cpasync.CopyBulkTensorTileS2GOp()
            wide = wt.first_stage(wt.smem_layout(C, 128, self.io_dtype))
            narrow = wt.first_stage(wt.smem_layout(C, HALF, self.io_dtype))
            outs = ()
            for t, layout, cols in ((qg, wide, 128), (kg, wide, 128), (w, wide, 128), (u, narrow, HALF),
                                    (aqk, narrow, C)):
                atom, tensor = cpasync.make_tiled_tma_atom(s2g, thd(t), layout, (C, cols))
                outs = outs + (atom, tensor)
        if cutlass.const_expr(self.slim):
            self.set_slim_shared_storage()
        elif cutlass.const_expr(self.row_anchors):
            self.set_rows_shared_storage()
        else:
            self.set_shared_storage()
        self.prep_kernel(
            tma_q, tma_q_tensor, tma_k, tma_k_tensor, tma_v, tma_v_tensor,
            g, beta, qg, w, u, kg, aqk, eg, tiles, num_tiles, scale, flags, chunks_per_seq, consumers, *outs,
        ).launch(grid=[grid_x, 1, 1], block=[self.num_threads, 1, 1], stream=stream,
                  min_blocks_per_mp=self.ctas_per_sm, use_pdl=self.secondary,
                  # a fixed carveout (all of the SM for shared memory): no device query when compiling
                  preferred_smem_carveout=100 if self.ctas_per_sm > 1 else None)

    @cute.jit
    def set_slim_shared_storage(self):
        """`slim`: the fields GDN's prep reads, one q/k/v stage (w and u are staged in sK and sV)."""
        io = self.io_dtype
        n_y = SOLVE_Y_MMA if self.solve_mma else SOLVE_Y

        @cute.struct
        class SlimStorage:
            load_mbar: cute.struct.MemRange[cutlass.Int64, 2]
            sQ: cute.struct.Align[cute.struct.MemRange[io, C * 128], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[io, C * 128], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[io, C * 128], 1024]
            sXk: cute.struct.Align[cute.struct.MemRange[io, C * C], 1024]
            sXv: cute.struct.Align[cute.struct.MemRange[io, C * C], 1024]
            sAqk: cute.struct.Align[cute.struct.MemRange[io, C * C], 1024]
            sAkk: cute.struct.Align[cute.struct.MemRange[Float32, C * AKK_STRIDE], 16]
            sY: cute.struct.Align[cute.struct.MemRange[Float32, n_y], 16]
            sG: cute.struct.MemRange[Float32, C]
            sEG: cute.struct.MemRange[Float32, C]
            sEGL: cute.struct.MemRange[Float32, C]
            sBeta: cute.struct.MemRange[Float32, C]
            sScan: cute.struct.MemRange[Float32, 4]

        @cute.struct
        class TrioStorage:
            # sAkk (fp32, rows padded to 68 floats: 17 KB) lies over sQ and the 1 KB after it; sY over sXk
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
            sScan: cute.struct.MemRange[Float32, 4]

        self.shared_storage = TrioStorage if self.trio else SlimStorage
        self.smem_bytes = self.shared_storage.size_in_bytes()
        per_sm = self.ctas_per_sm   # 228 KB per SM, 1 KB of it reserved per CTA
        assert (self.smem_bytes + 1024) * per_sm <= 233472, \
            f"shared storage {self.smem_bytes} B: {per_sm} CTAs per SM do not fit"

    @cute.jit
    def set_rows_shared_storage(self):
        """`row_anchors` (KDA): the fields KDA's prep reads (no state tile), plus the row-anchored products'
        operands: L_q, the right factors of bands 1-3 (48, 32, 16 rows; band 0 lives in sVnew, u's staging
        later), the channel factors and the anchors' 2^G (sC [10, 128], see `kda_gates`)."""
        io = self.io_dtype
        n_y = SOLVE_Y_MMA if self.solve_mma else SOLVE_Y
        ns = self.num_stages
        # two stages (KDA's fold): no v tile (a 16-byte stub: the field stays, nothing reads it) and sY lives in
        # the band factors' bytes (`prep_consumer`), so a second q / k stage fits
        v_elems = C * 128 if ns == 1 else 8
        y_elems = n_y if ns == 1 else 4

        @cute.struct
        class RowsStorage:
            load_mbar: cute.struct.MemRange[cutlass.Int64, 2 * ns]
            sQ: cute.struct.Align[cute.struct.MemRange[io, C * 128 * ns], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[io, C * 128 * ns], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[io, v_elems], 1024]
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
            sY: cute.struct.Align[cute.struct.MemRange[Float32, y_elems], 16]
            sG: cute.struct.MemRange[Float32, C]
            sEG: cute.struct.MemRange[Float32, C]
            sEGL: cute.struct.MemRange[Float32, C]
            sBeta: cute.struct.MemRange[Float32, C]
            sScan: cute.struct.MemRange[Float32, 4]
            sFlag: cute.struct.MemRange[Int32, 4]
            sGk: cute.struct.Align[cute.struct.MemRange[Float32, C * 128], 16]
            sGL: cute.struct.MemRange[Float32, 128]
            sC: cute.struct.Align[cute.struct.MemRange[Float32, 10 * 128], 16]

        self.shared_storage = RowsStorage
        self.smem_bytes = RowsStorage.size_in_bytes()
        assert self.smem_bytes <= 232448, f"row-anchored shared storage {self.smem_bytes} B exceeds 227 KB"

    @cute.kernel
    def prep_kernel(
        self,
        tma_q: cute.CopyAtom, mQ: cute.Tensor,
        tma_k: cute.CopyAtom, mK: cute.Tensor,
        tma_v: cute.CopyAtom, mV: cute.Tensor,
        mG: cute.Tensor, mBeta: cute.Tensor,
        mQg: cute.Tensor, mW: cute.Tensor, mU: cute.Tensor, mKg: cute.Tensor, mA: cute.Tensor, mEg: cute.Tensor,
        mTiles: cute.Tensor, num_tiles: Int32, scale: Float32,
        mFlags: cute.Tensor, chunks_per_seq: Int32, consumers: Int32,
        tma_qg: cute.CopyAtom, mQgT: cute.Tensor, tma_kg: cute.CopyAtom, mKgT: cute.Tensor,
        tma_w: cute.CopyAtom, mWT: cute.Tensor, tma_u: cute.CopyAtom, mUT: cute.Tensor,
        tma_a: cute.CopyAtom, mAT: cute.Tensor,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        if cutlass.const_expr(self.pdl):
            # the state pass (launched with PDL) may start its prologue once every CTA of this grid has begun;
            # its griddepcontrol.wait still waits for this whole grid to finish and flush
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
            if cutlass.const_expr(self.tma_out):
                for atom in (tma_qg, tma_kg, tma_w, tma_u, tma_a):
                    cpasync.prefetch_descriptor(atom)
        ns = self.num_stages
        if cutlass.const_expr(self.slim):
            if warp_idx == 8:
                self.producer(sched, load, tma_q, mQ, tma_k, mK, tma_v, mV,
                              self.view(st.sQ, C, 128, ns), self.view(st.sK, C, 128, ns),
                              self.view(st.sV, C, 128, ns))
            else:
                self.prep_consumer(sched, load, wg, tidx, mG, mBeta, mQg, mW, mU, mKg, mA, mEg, scale, st,
                                   mFlags, chunks_per_seq, consumers, None)
        else:
            if wg == 0:
                cute.arch.setmaxregister_decrease(40)
                if warp_idx == 0:
                    # (no v load: the producer never touches its third tile; the two-stage build has no v field)
                    sV_in = self.view(st.sV, C, 128, ns) if self.load_v else self.view(st.sK, C, 128, ns)
                    self.producer(sched, load, tma_q, mQ, tma_k, mK, tma_v, mV,
                                  self.view(st.sQ, C, 128, ns), self.view(st.sK, C, 128, ns), sV_in)
            else:
                cute.arch.setmaxregister_increase(232)
                self.prep_consumer(sched, load, wg - 1, tidx - 128, mG, mBeta, mQg, mW, mU, mKg, mA, mEg, scale,
                                   st, mFlags, chunks_per_seq, consumers,
                                   ((tma_qg, mQgT), (tma_kg, mKgT), (tma_w, mWT), (tma_u, mUT), (tma_a, mAT)))
        if cutlass.const_expr(self.secondary):
            # this grid ends only after the state pass it was launched beside: the stream's next kernels may then
            # rely on both being complete. One CTA waiting is enough for that; the others exit at once, so a CTA of
            # this grid that found no room at launch gets one as soon as another ends (were every CTA to wait
            # here, one left out would deadlock the state CTAs that wait on its chunks).
            bid, _, _ = cute.arch.block_idx()
            if bid == 0:
                cute.arch.griddepcontrol_wait()

    @cute.jit
    def prep_consumer(self, sched, load, j, ctid, mG, mBeta, mQg, mW, mU, mKg, mA, mEg, scale, st, mFlags,
                      chunks_per_seq, consumers, tma_outs):
        kda = self.kda
        wtid = ctid % 128
        v0 = j * HALF
        ns = self.num_stages
        sQ = self.view(st.sQ, C, 128, ns)
        sK = self.view(st.sK, C, 128, ns)
        sK_mn = self.view(st.sK, C, 128, ns, True)
        sV_mn = self.view(st.sV, C, 128, ns, True) if self.load_v else sK_mn   # (unread without a v load)
        if cutlass.const_expr(self.slim):
            # w and u replace the k and v columns this consumer's products read (stage 0: one stage)
            sW_j = cute.local_tile(sK[None, None, 0], (C, HALF), (0, j))
            sU_j = cute.local_tile(self.view(st.sV, C, 128, ns)[None, None, 0], (C, HALF), (0, j))
            sW = sFlag = None   # KDA only
        else:
            sW = self.view(st.sNegW, C, 128)[None, None, 0]      # w (not negated here), then stored
            sW_j = cute.local_tile(sW, (C, HALF), (0, j))
            sU_j = self.view(st.sVnew, C, HALF, 2)[None, None, j]   # u staging, one half per consumer
            sFlag = st.sFlag.get_tensor(cute.make_layout(4))
        sXv = self.view(st.sXv, C, C)[None, None, 0]
        sAqk = self.view(st.sAqk, C, C)[None, None, 0]
        n_y = SOLVE_Y_MMA if self.solve_mma else SOLVE_Y
        if cutlass.const_expr(self.trio):
            # q is dead once step 1's products have read it (the raw build writes no qg); X is dead after step 3
            sAkk = cute.make_tensor(cute.recast_ptr(st.sQ.data_ptr(), dtype=Float32),
                                    cute.make_layout((C, C), stride=(AKK_STRIDE, 1)))
            sY = cute.make_tensor(cute.recast_ptr(st.sXk.data_ptr(), dtype=Float32), cute.make_layout(n_y))
        elif cutlass.const_expr(self.row_anchors and ns == 2):
            # the solve's scratch over the band factors R1..R3 (24 KB, written by step 2's factor pass, last read
            # by its band products, which both consumers have waited for before step 2's last barrier)
            sAkk = st.sAkk.get_tensor(cute.make_layout((C, C), stride=(AKK_STRIDE, 1)))
            sY = cute.make_tensor(cute.recast_ptr(st.sR1.data_ptr(), dtype=Float32), cute.make_layout(n_y))
        else:
            sAkk = st.sAkk.get_tensor(cute.make_layout((C, C), stride=(AKK_STRIDE, 1)))
            sY = st.sY.get_tensor(cute.make_layout(n_y))
        sG = st.sG.get_tensor(cute.make_layout(C))
        sEG = st.sEG.get_tensor(cute.make_layout(C))
        sEGL = st.sEGL.get_tensor(cute.make_layout(C))
        sBeta = st.sBeta.get_tensor(cute.make_layout(C))
        sScan = st.sScan.get_tensor(cute.make_layout(4))
        sXk = sXv
        sKb_mn = sK_mn[None, None, 0]
        sGk = sG
        sGL = sG
        sC = sLq = sR = None   # row_anchors only
        if cutlass.const_expr(self.row_anchors):
            sC = st.sC.get_tensor(cute.make_layout((10, 128), stride=(128, 1)))
            sLq = self.view(st.sLq, C, 128)[None, None, 0]
            sR = (self.view(st.sVnew, C, 128)[None, None, 0], self.view(st.sR1, 48, 128)[None, None, 0],
                  self.view(st.sR2, 32, 128)[None, None, 0], self.view(st.sR3, 16, 128)[None, None, 0])
        if cutlass.const_expr(kda):
            sKb_mn = self.view(st.sKb, C, 128, 1, True)[None, None, 0]
            sGk = st.sGk.get_tensor(cute.make_layout((C, 128), stride=(128, 1)))
            sGL = st.sGL.get_tensor(cute.make_layout(128))
        else:
            sXk = self.view(st.sXk, C, C)[None, None, 0]

        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.num_stages)
        mma64 = self.make_mma(False, True)
        thr_kk = self.make_mma(False, False).get_slice(wtid)
        acc = cute.make_rmem_tensor(mma64.get_slice(wtid).partition_shape_C((C, HALF)), Float32)
        tAkk = thr_kk.partition_C(sAkk)

        prof = cute.make_rmem_tensor((14,), cutlass.Int64)   # profile: cycles per step, summed over chunks
        prof.fill(0)
        n_chunks = Int32(0)
        t_begin = cutlass.Int64(0)
        if cutlass.const_expr(self.profile):
            t_begin = cute.arch.clock64()
        work = sched.initial_work()
        while work.is_valid:
            head = work.head
            tok0 = work.tok_start
            tok_end = work.tok_end
            gv = Float32(0.0)
            bv = Float32(0.0)
            if cutlass.const_expr(not kda):
                if ctid < C:
                    if tok0 + ctid < tok_end:
                        gv = Float32(mG[tok0 + ctid, head])
                        bv = Float32(mBeta[tok0 + ctid, head])
            if cutlass.const_expr(kda and self.prefetch_gates):
                if ctid < C:
                    if tok0 + ctid < tok_end:
                        bv = Float32(mBeta[tok0 + ctid, head])
                L0 = tok_end - tok0
                if L0 > C:
                    L0 = Int32(C)
                if cutlass.const_expr(self.row_anchors):
                    self.kda_g_prefetch_vec(ctid, tok0, L0, head, mG, sGk)
                else:
                    self.kda_g_prefetch(ctid, tok0, L0, head, mG, sGk)

            for c in cutlass.range(work.chunk_end - work.chunk_start, unroll=1):
                t0 = tok0 + c * C
                L = tok_end - t0
                if L > C:
                    L = Int32(C)
                self.stamp(prof, -1)
                # -- 0. gates (as the fused kernel: GDN's loaded one chunk ahead)
                if cutlass.const_expr(kda):
                    self.kda_gates(ctid, t0, L, head, mG, mBeta, sGk, sGL, sBeta, sFlag, bv, sC=sC,
                                   g_vec=self.row_anchors)
                    if cutlass.const_expr(self.prefetch_gates):
                        bv = Float32(0.0)
                        if ctid < C:
                            if t0 + C + ctid < tok_end:
                                bv = Float32(mBeta[t0 + C + ctid, head])
                else:
                    self.gdn_gates(ctid, L, gv, bv, sG, sEG, sEGL, sBeta, sScan)
                    gv = Float32(0.0)
                    bv = Float32(0.0)
                    if ctid < C:
                        if t0 + C + ctid < tok_end:
                            gv = Float32(mG[t0 + C + ctid, head])
                            bv = Float32(mBeta[t0 + C + ctid, head])
                self.stamp(prof, 0)
                if cutlass.const_expr(self.tma_out):
                    if ctid == 0:
                        # the last chunk's w / u / Aqk stores have read their staging tiles (the barrier below
                        # publishes that to every consumer thread before the tiles are written again)
                        cute.arch.cp_async_bulk_wait_group(0, read=True)
                load.consumer_wait(state)
                cute.arch.barrier(barrier_id=1, number_of_threads=256)
                stage = state.index
                self.stamp(prof, 1)

                # -- 1. Akk (fp32) and Aqk (16-bit); KDA: then the in-place gating of q and k, kb = k 2^G
                if cutlass.const_expr(self.row_anchors):
                    more = c + 1 < work.chunk_end - work.chunk_start   # the next chunk's g to prefetch
                    L1 = tok_end - t0 - C
                    if L1 > C:
                        L1 = Int32(C)
                    if sFlag[0] != 0:   # past the anchor limit: the exact path, then the gating pass
                        self.kda_intra(j, ctid, wtid, L, scale, stage, sQ, sK, sAkk, sAqk, sW, sGk, sBeta, sFlag,
                                       st)
                        self.kda_gating_vec(ctid, L, stage, sQ, sK, self.view(st.sKb, C, 128)[None, None, 0], sGk,
                                            sGL)
                        cute.arch.fence_proxy("async.shared", space="cta")
                        cute.arch.barrier(barrier_id=1, number_of_threads=256)
                        if cutlass.const_expr(self.prefetch_gates):
                            if more:
                                self.kda_g_prefetch_vec(ctid, t0 + C, L1, head, mG, sGk)
                        self.stamp(prof, 2)
                    else:
                        q_scale = Float32(1.0)
                        if cutlass.const_expr(self.tma_out):
                            q_scale = scale   # qg leaves as the smem q tile (TMA) or by threads, unscaled there
                        self.kda_row_factors(ctid, L, stage, sQ, sK, self.view(st.sKb, C, 128)[None, None, 0], sW,
                                             sLq, sR, sC, sGk, sGL, q_scale)
                        cute.arch.fence_proxy("async.shared", space="cta")
                        cute.arch.barrier(barrier_id=1, number_of_threads=256)
                        self.stamp(prof, 8)
                        # the band products run while the next chunk's g loads (G is not read after the pass)
                        thr_b, acc_b = self.kda_row_accumulators(wtid)
                        if j == 0:
                            self.kda_row_issue(wtid, acc_b, sW, sR)
                        else:
                            self.kda_row_issue(wtid, acc_b, sLq, sR)
                        if cutlass.const_expr(self.prefetch_gates):
                            if more:
                                self.kda_g_prefetch_vec(ctid, t0 + C, L1, head, mG, sGk)
                        warpgroup.wait_group(0)
                        if j == 0:
                            self.kda_row_finish(wtid, L, scale, thr_b, acc_b, tAkk, sAqk, sBeta, True)
                        else:
                            self.kda_row_finish(wtid, L, scale, thr_b, acc_b, tAkk, sAqk, sBeta, False)
                        cute.arch.fence_proxy("async.shared", space="cta")
                        cute.arch.barrier(barrier_id=1, number_of_threads=256)
                        self.stamp(prof, 9)
                elif cutlass.const_expr(kda):
                    self.kda_intra(j, ctid, wtid, L, scale, stage, sQ, sK, sAkk, sAqk, sW, sGk, sBeta, sFlag, st)
                    if cutlass.const_expr(self.vec_elementwise):
                        self.kda_gating_vec(ctid, L, stage, sQ, sK, self.view(st.sKb, C, 128)[None, None, 0], sGk,
                                            sGL)
                    else:
                        self.kda_gating(ctid, L, stage, sQ, sK, sKb_mn, sGk, sGL)
                    cute.arch.fence_proxy("async.shared", space="cta")
                    cute.arch.barrier(barrier_id=1, number_of_threads=256)
                    if cutlass.const_expr(self.prefetch_gates):
                        if c + 1 < work.chunk_end - work.chunk_start:
                            L1 = tok_end - t0 - C
                            if L1 > C:
                                L1 = Int32(C)
                            self.kda_g_prefetch(ctid, t0 + C, L1, head, mG, sGk)
                else:
                    acc_kk = cute.make_rmem_tensor(thr_kk.partition_shape_C((C, C)), Float32)
                    cc_kk = thr_kk.partition_C(cute.make_identity_tensor((C, C)))
                    self.gdn_intra_issue(j, wtid, acc_kk, stage, sQ, sK, True)
                    warpgroup.wait_group(0)
                    if cutlass.const_expr(self.trio):
                        # consumer 0 writes Akk over q: consumer 1's q k^T product must have read q
                        cute.arch.barrier(barrier_id=1, number_of_threads=256)
                    self.gdn_intra_finish(j, wtid, acc_kk, cc_kk, L, scale, sG, sBeta, tAkk, sAqk, True)
                    cute.arch.fence_proxy("async.shared", space="cta")
                    cute.arch.barrier(barrier_id=1, number_of_threads=256)

                self.stamp(prof, 2)
                if cutlass.const_expr(self.slim and not self.raw_qk):
                    # qg and kg leave now: step 3 overwrites the k tile with w
                    self.store_scaled_rows(ctid, L, sQ[None, None, stage], mQg, t0, head, scale, sEG, True)
                    self.store_scaled_rows(ctid, L, sK[None, None, stage], mKg, t0, head, scale, sEGL, False)
                self.stamp(prof, 3)

                # -- 2. X = (I + Akk)^-1 -> Xv = X diag(beta), GDN: Xk = X diag(beta 2^G)
                # the profile build stamps the solve's levels (`solve_stamp` is a no-op without `prof`)
                self.solve_blocked(ctid, sAkk, sY, sXv, sXk, sBeta, sEG, prof if self.profile else None,
                                   sEGL if self.fold and not kda else None)
                cute.arch.fence_proxy("async.shared", space="cta")
                cute.arch.barrier(barrier_id=1, number_of_threads=256)
                self.stamp(prof, 4)

                # -- 3. w and u, V columns [v0, v0 + 64) of this consumer -> smem (fold: W2's columns, and A1)
                if cutlass.const_expr(self.fold and kda):
                    # W2 = Xv^T kg (kg: the k tile as step 1 gated it) into w's staging, A1 = Aqk Xv into u's
                    sXv_t = self.view(st.sXv, C, C, 1, True)[None, None, 0]   # (i, r): Xv^T
                    self.gemm(wtid, acc, sXv_t, cute.local_tile(sK_mn[None, None, stage], (HALF, C), (j, 0)),
                              True, True, False)
                    self.store_acc(wtid, mma64, acc, sW_j)
                    if j == 0:
                        self.gemm(wtid, acc, sAqk, sXv_t, False, True, False)
                        self.store_acc(wtid, mma64, acc, sU_j)
                    if cutlass.const_expr(self.tma_out):
                        cute.arch.fence_proxy("async.shared", space="cta")   # W2, A1 -> the TMA stores' reads
                    cute.arch.barrier(barrier_id=1, number_of_threads=256)
                elif cutlass.const_expr(self.fold):
                    sXf_t = self.view(st.sXk, C, C, 1, True)[None, None, 0]   # (i, r): Xf^T
                    self.gemm(wtid, acc, sXf_t, cute.local_tile(sK_mn[None, None, stage], (HALF, C), (j, 0)),
                              True, True, False)
                    self.store_acc(wtid, mma64, acc, sW_j)
                    if j == 0:
                        self.gemm(wtid, acc, sAqk, self.view(st.sXv, C, C, 1, True)[None, None, 0], False, True,
                                  False)
                        self.store_acc(wtid, mma64, acc, sU_j)
                    cute.arch.barrier(barrier_id=1, number_of_threads=256)
                else:
                    if cutlass.const_expr(kda):
                        self.gemm(wtid, acc, sXv, cute.local_tile(sKb_mn, (HALF, C), (j, 0)), False, True, False)
                    else:
                        self.gemm(wtid, acc, sXk, cute.local_tile(sK_mn[None, None, stage], (HALF, C), (j, 0)),
                                  False, True, False)
                    self.store_acc(wtid, mma64, acc, sW_j)
                    self.gemm(wtid, acc, sXv, cute.local_tile(sV_mn[None, None, stage], (HALF, C), (j, 0)),
                              False, True, False)
                    self.store_acc(wtid, mma64, acc, sU_j)
                    if cutlass.const_expr(self.tma_out):
                        cute.arch.fence_proxy("async.shared", space="cta")   # w, u -> the TMA stores' reads
                    cute.arch.barrier(barrier_id=1, number_of_threads=256)
                self.stamp(prof, 5)

                # -- 4. the terms -> global (rows < L)
                if cutlass.const_expr(self.tma_out):
                    fast = sFlag[0] == 0
                    if fast and L == C:
                        if ctid == 0:
                            self.store_terms_tma(tma_outs, stage, st, t0, head)
                    else:
                        q_store_scale = scale
                        if fast:
                            q_store_scale = Float32(1.0)   # the factor pass scaled q
                        if cutlass.const_expr(self.fold):
                            self.store_fold_terms(j, ctid, wtid, L, stage, sQ, sW_j, sU_j, st, mQg, mW, mKg, mA, t0,
                                                  head, v0, q_store_scale)
                        else:
                            self.store_terms(j, ctid, wtid, L, stage, sQ, sK, sW_j, sU_j, sAqk, sEG, sEGL, mQg, mW,
                                             mU, mKg, mA, t0, head, v0, q_store_scale, scale)
                elif cutlass.const_expr(self.fold and kda):   # (without tma_out the factor pass leaves q unscaled)
                    self.store_fold_terms(j, ctid, wtid, L, stage, sQ, sW_j, sU_j, st, mQg, mW, mKg, mA, t0, head,
                                          v0, scale)
                elif cutlass.const_expr(self.fold):
                    self.store_rows(wtid, sW_j, mW, t0, head, v0, L)
                    if j == 0:
                        self.store_rows(wtid, sU_j, mA, t0, head, 0, L)
                else:
                    self.store_terms(j, ctid, wtid, L, stage, sQ, sK, sW_j, sU_j, sAqk, sEG, sEGL, mQg, mW, mU, mKg,
                                     mA, t0, head, v0, scale, scale)
                if cutlass.const_expr(self.profile):
                    n_chunks = n_chunks + 1
                elif cutlass.const_expr(kda):
                    if ctid < 128:
                        mEg[t0 + L - 1, head, ctid] = cute.math.exp2(sGL[ctid], fastmath=True)
                elif cutlass.const_expr(self.raw_qk):
                    if ctid < L:   # row ctid's factors for the state pass, one 16-byte store
                        f4 = cute.make_rmem_tensor((4,), Float32)
                        f4[0] = scale * sEG[ctid]
                        f4[1] = sEGL[ctid]
                        f4[2] = sEG[L - 1]
                        f4[3] = Float32(0.0)
                        if cutlass.const_expr(self.fold):
                            f4[3] = sEG[ctid]
                        cute.autovec_copy(f4, mEg[t0 + ctid, head, None])
                else:
                    if ctid == 0:
                        mEg[t0 + L - 1, head] = sEG[L - 1]
                if cutlass.const_expr(self.slim):
                    # generic-proxy writes (w, u) to the stage before the next TMA writes it
                    cute.arch.fence_proxy("async.shared", space="cta")
                if cutlass.const_expr(self.tma_out):
                    # thread 0 has waited until any TMA stores read their tiles: only then may the stage (q, k)
                    # and the staging tiles be written again
                    cute.arch.barrier(barrier_id=1, number_of_threads=256)
                load.consumer_release(state)
                state.advance()
                # Protects every smem buffer from the next chunk's writers (and orders every consumer thread's
                # stores of this chunk before thread 0's release below).
                cute.arch.barrier(barrier_id=1, number_of_threads=256)
                if cutlass.const_expr(self.publish):
                    if ctid == 0:
                        num_heads = mBeta.shape[1]
                        idx = (work.seq * chunks_per_seq + work.chunk_start + c) * num_heads + head
                        cute.arch.fence_acq_rel_gpu()
                        cute.arch.atomic_add(mFlags.iterator + idx, consumers, sem="release", scope="gpu")
                self.stamp(prof, 6)
            work = sched.advance(work)
        if cutlass.const_expr(self.tma_out):
            if ctid == 0:
                cute.arch.cp_async_bulk_wait_group(0)   # every TMA store complete before the CTA ends
        if cutlass.const_expr(self.profile):
            t_end = cute.arch.clock64()
            if ctid == 0:
                bid, _, _ = cute.arch.block_idx()
                flat = cute.make_tensor(mEg.iterator, cute.make_layout(cute.size(mEg)))
                n = self.PROFILE_FIELDS
                for i in cutlass.range_constexpr(7):
                    flat[n * bid + i] = Float32(prof[i])
                flat[n * bid + 7] = Float32(n_chunks)
                flat[n * bid + 8] = Float32(t_end - t_begin)
                flat[n * bid + 9] = Float32(prof[8])
                flat[n * bid + 10] = Float32(prof[9])
                for i in cutlass.range_constexpr(4):
                    flat[n * bid + 11 + i] = Float32(prof[10 + i])

    @cute.jit
    def store_terms(self, j, ctid, wtid, L, stage, sQ, sK, sW_j, sU_j, sAqk, sEG, sEGL, mQg, mW, mU, mKg, mA, t0,
                    head, v0, q_scale, scale):
        """Step 4 by the consumer threads (16-byte vectors, rows < L): w and u (this consumer's 64 columns), Aqk
        (consumer 0), and (not `slim`: there they left after step 1) qg = q_scale x the q tile's rows (GDN also
        times 2^G) and kg."""
        self.store_rows(wtid, sW_j, mW, t0, head, v0, L)
        self.store_rows(wtid, sU_j, mU, t0, head, v0, L)
        if j == 0:
            self.store_rows(wtid, sAqk, mA, t0, head, 0, L)
        if cutlass.const_expr(not self.slim):
            self.store_scaled_rows(ctid, L, sQ[None, None, stage], mQg, t0, head, q_scale, sEG, True)
            self.store_scaled_rows(ctid, L, sK[None, None, stage], mKg, t0, head, scale, sEGL, False)

    @cute.jit
    def store_fold_terms(self, j, ctid, wtid, L, stage, sQ, sW_j, sU_j, st, mQg, mW, mKg, mA, t0, head, v0,
                         q_scale):
        """KDA's `fold`, step 4 by the consumer threads (rows < L): qg (q_scale x the q tile), kE (the kb tile)
        by the w output, W2 (this consumer's 64 columns, staged in w's place) by the kg output, A1 (consumer 0,
        staged in u's place) by the aqk output."""
        self.store_rows(wtid, sW_j, mKg, t0, head, v0, L)
        if j == 0:
            self.store_rows(wtid, sU_j, mA, t0, head, 0, L)
        self.store_scaled_rows(ctid, L, sQ[None, None, stage], mQg, t0, head, q_scale, None, True)
        self.store_scaled_rows(ctid, L, self.view(st.sKb, C, 128)[None, None, 0], mW, t0, head, Float32(1.0), None,
                               False)

    @cute.jit
    def store_terms_tma(self, tma_outs, stage, st, t0, head):
        """`tma_out`, consumer thread 0: the full chunk's qg and kg (the stage's q / k tiles: one bulk group), then
        w, u (two halves) and Aqk (a second group) by TMA stores; returns once the first group has read shared
        memory (the stage may then be released). The second group is waited for before the next chunk's q/k/v
        wait, after its gates step."""
        (tma_qg, mQgT), (tma_kg, mKgT), (tma_w, mWT), (tma_u, mUT), (tma_a, mAT) = tma_outs
        ns = self.num_stages
        stage_jobs = ((tma_qg, mQgT, self.view(st.sQ, C, 128, ns), stage, 128, 0),
                      (tma_kg, mKgT, self.view(st.sK, C, 128, ns), stage, 128, 0))
        staging_jobs = ((tma_w, mWT, self.view(st.sNegW, C, 128), 0, 128, 0),
                        (tma_u, mUT, self.view(st.sVnew, C, HALF, 2), 0, HALF, 0),
                        (tma_u, mUT, self.view(st.sVnew, C, HALF, 2), 1, HALF, 1),
                        (tma_a, mAT, self.view(st.sAqk, C, C), 0, C, 0))
        if cutlass.const_expr(self.fold):
            # KDA's fold: qg from the stage; kE (the kb tile) by the w output, W2 (staged in w's place) by the kg
            # output, A1 (staged in u's first half) by the aqk output
            stage_jobs = ((tma_qg, mQgT, self.view(st.sQ, C, 128, ns), stage, 128, 0),)
            staging_jobs = ((tma_w, mWT, self.view(st.sKb, C, 128), 0, 128, 0),
                            (tma_kg, mKgT, self.view(st.sNegW, C, 128), 0, 128, 0),
                            (tma_a, mAT, self.view(st.sVnew, C, HALF, 2), 0, C, 0))
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
    def kda_row_factors(self, ctid, L, stage, sQ, sK, sKb, sL, sLq, sR, sC, sGk, sGL, q_scale):
        """`row_anchors`, one pass in 16-byte vectors (thread ctid: channels 8 (ctid % 16) + [0, 8) of row
        ctid // 16 + 16 m of row block m, m = 0..3), a = 16 m the row's anchor, f = 2^(G_r - G_a) <= 1:
        sL[r] = k f, sLq[r] = q f; right factors R0 = k / f (fp32, <= 2^KDA_ANCHOR_LIMIT) -> band 0 row r, and
        R0 c_(m + delta, m) -> band delta (delta = 1 .. 3 - m, row r); then step 1's gating in place: q <- q 2^G,
        k <- k 2^(G_L - G) (0 past the end), kb = k 2^G, with 2^G = 2^G_a f (2^G_a: sC row 6 + m; where it
        underflows so does 2^G, to below bf16's smallest normal). Three exp2 per element. `q_scale` (`tma_out`:
        the attention scale) multiplies the gated q, so its tile is qg."""
        io = self.io_dtype
        tiled = self.vec_copy()
        thr = tiled.get_slice(ctid)
        tQ = thr.partition_S(sQ[None, None, stage])
        tK = thr.partition_S(sK[None, None, stage])
        tKb = thr.partition_D(sKb)
        tL = thr.partition_D(sL)
        tLq = thr.partition_D(sLq)
        tR = [thr.partition_D(sR[delta]) for delta in range(4)]
        crd = thr.partition_S(cute.make_identity_tensor((C, 128)))
        gl8 = cute.make_rmem_tensor((8,), Float32)   # G_L of this thread's channels (the same for its 4 rows)
        cute.autovec_copy(cute.local_tile(sGL, (8,), (cute.assume(crd[0, 0, 0][1], divby=8) // 8,)), gl8)
        for m in cutlass.range_constexpr(4):
            r, d0 = crd[0, m, 0]
            g8 = cute.make_rmem_tensor((8,), Float32)
            ga8 = cute.make_rmem_tensor((8,), Float32)
            self.load_g8(sGk, r, d0, g8)
            self.load_g8(sGk, 16 * m, d0, ga8)
            ega8 = cute.make_rmem_tensor((8,), Float32)
            cute.autovec_copy(cute.local_tile(sC[6 + m, None], (8,), (cute.assume(d0, divby=8) // 8,)), ega8)
            q8 = cute.make_rmem_tensor_like(tQ[None, m, None])
            k8 = cute.make_rmem_tensor_like(tK[None, m, None])
            cute.copy(tiled, tQ[None, m, None], q8)
            cute.copy(tiled, tK[None, m, None], k8)
            lk8 = cute.make_rmem_tensor_like(k8)
            lq8 = cute.make_rmem_tensor_like(k8)
            r08 = cute.make_rmem_tensor_like(k8)
            kb8 = cute.make_rmem_tensor_like(k8)
            r0 = cute.make_rmem_tensor((8,), Float32)
            for e in cutlass.range_constexpr(8):
                x = g8[e] - ga8[e]
                f = cute.math.exp2(x, fastmath=True)
                kv = Float32(k8[e])
                qv = Float32(q8[e])
                lk8[e] = io(kv * f)
                lq8[e] = io(qv * f)
                r0[e] = kv * cute.math.exp2(-x, fastmath=True)
                r08[e] = io(r0[e])
                eg = ega8[e] * f
                egl = cutlass.select_(r < L, cute.math.exp2(gl8[e] - g8[e], fastmath=True), Float32(0.0))
                kb8[e] = io(kv * eg)
                k8[e] = io(kv * egl)
                q8[e] = io(qv * (eg * q_scale))
            cute.copy(tiled, lk8, tL[None, m, None])
            cute.copy(tiled, lq8, tLq[None, m, None])
            cute.copy(tiled, r08, tR[0][None, m, None])
            cute.copy(tiled, kb8, tKb[None, m, None])
            cute.copy(tiled, k8, tK[None, m, None])
            cute.copy(tiled, q8, tQ[None, m, None])
            for delta in cutlass.range_constexpr(1, 4 - m):
                pair = m if delta == 1 else (3 + m if delta == 2 else 5)   # sC row of (m + delta, m)
                c8 = cute.make_rmem_tensor((8,), Float32)
                cute.autovec_copy(cute.local_tile(sC[pair, None], (8,), (cute.assume(d0, divby=8) // 8,)), c8)
                rd8 = cute.make_rmem_tensor_like(k8)
                for e in cutlass.range_constexpr(8):
                    rd8[e] = io(r0[e] * c8[e])
                cute.copy(tiled, rd8, tR[delta][None, m, None])

    def kda_row_accumulators(self, wtid):
        """`row_anchors`: this thread's slices of the four band products (64 x {64, 48, 32, 16} wgmma tiles) and
        their fp32 accumulators."""
        thr = [self.make_mma(False, False, 64 - 16 * delta).get_slice(wtid) for delta in range(4)]
        acc = [cute.make_rmem_tensor(thr[delta].partition_shape_C((C, 64 - 16 * delta)), Float32)
               for delta in range(4)]
        return thr, acc

    @cute.jit
    def kda_row_issue(self, wtid, acc, sA, sR):
        """`row_anchors`, one consumer warpgroup, issued (not waited): product delta = sA (L_k or L_q, 64 x 128)
        times the band-delta right factors (64 - 16 delta rows)."""
        for delta in cutlass.range_constexpr(4):
            self.gemm(wtid, acc[delta], sA, sR[delta], False, False, False, 64 - 16 * delta, wait=False)

    @cute.jit
    def kda_row_finish(self, wtid, L, scale, thr, acc, tAkk, sAqk, sBeta, kk: bool):
        """`row_anchors`, after the wait: element (r, i) of the chunk's matrix comes from product r // 16 - i // 16
        (0 above the diagonal blocks): every product's accumulator holds the first 64 - 16 delta columns in the
        same per-thread order, so the bands merge in registers by selects. kk: Akk[r, i] = beta_r A (i < r < L)
        -> fp32 (tAkk: this thread's part of it), else Aqk[r, i] = scale A (i <= r) -> 16-bit, stmatrix."""
        cc = thr[0].partition_C(cute.make_identity_tensor((C, C)))
        a = acc[0]
        for i in cutlass.range_constexpr(cute.size(a)):
            r, col = cc[i]
            band = r // 16 - col // 16
            x = a[i]
            for delta in cutlass.range_constexpr(1, 4):
                if cutlass.const_expr(i < cute.size(acc[delta])):
                    x = cutlass.select_(band == delta, acc[delta][i], x)
            if cutlass.const_expr(kk):
                a[i] = cutlass.select_(col < r and r < L, x * sBeta[r], Float32(0.0))
            else:
                a[i] = cutlass.select_(col <= r, x * scale, Float32(0.0))
        if cutlass.const_expr(kk):
            for i in cutlass.range_constexpr(cute.size(a)):   # stores after all loads
                tAkk[i] = a[i]
        else:
            self.store_acc(wtid, self.make_mma(False, False), a, sAqk)

    @cute.jit
    def kda_g_prefetch_vec(self, ctid, t0, L, head, mG, sGk):
        """`row_anchors`: `kda_g_prefetch` in 16-byte cp.async (thread ctid: channels 4 (ctid % 32) + [0, 4) of
        rows ctid // 32 + 8 i, i = 0..7: a warp copies one 512-byte row per instruction); rows >= L get 0. One
        commit group; `kda_gates(g_vec=True)` waits for it and syncs the consumers before reading."""
        c4 = ctid % 32
        atom = cute.make_copy_atom(cpasync.CopyG2SOp(), Float32, num_bits_per_copy=128)
        for i in cutlass.range_constexpr(8):
            r = ctid // 32 + 8 * i
            if r < L:
                cute.copy(atom, cute.local_tile(mG[t0 + r, head, None], (4,), (c4,)),
                          cute.local_tile(sGk[r, None], (4,), (c4,)))
            else:
                for e in cutlass.range_constexpr(4):
                    sGk[r, 4 * c4 + e] = Float32(0.0)
        cute.arch.cp_async_commit_group()

    @cute.jit
    def stamp(self, prof, step: int):
        """profile: step `step` ended now (its cycles since the last stamp are added; prof[7] holds that stamp)."""
        if cutlass.const_expr(self.profile):
            now = cute.arch.clock64()
            if cutlass.const_expr(step >= 0):
                prof[step] = prof[step] + (now - prof[7])
            prof[7] = now

    @cute.jit
    def store_scaled_rows(self, ctid, L, src, mDst, t0, head, scale, sRow, is_q: bool):
        """A [64 x 128] 16-bit smem tile -> mDst[t0 + r, head, :] for rows r < L, in 16-byte vectors (256 threads),
        times a row factor: qg (`is_q`): scale (KDA: q is already gated) or scale 2^G_r (GDN, sRow = 2^G);
        kg: 1 (KDA: k is already gated) or 2^(G_L - G_r) (GDN, sRow = 2^(G_L - G))."""
        io = self.io_dtype
        tiled = self.vec_copy()
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
