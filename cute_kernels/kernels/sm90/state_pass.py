"""SM90 state pass (phase 2) of the two-phase chunked forward (GDN or KDA): from phase 1's chunk-local terms
(`cute_kernels.reference.chunk_gated_delta_rule_ref`), the state-dependent work, chunk after chunk, for one 64-column V
block of one (sequence, head, segment) per work tile (docs/design.md, "The two-phase path").
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import cpasync, warpgroup

from schedulers.device import TileScheduler

from ..configs import StateConfig
from ..spin import count_spin
from . import wgmma_tiles as wt

C = 64          # chunk length (tokens)
V_BLOCK = 64    # V columns of the state per work tile (the tile's `block` picks which)
K_DIM = 128
NUM_STAGES = 2
CONSUMER_REGS = 232         # the consumer warpgroup's registers (setmaxnreg; the producer's go down to 40)


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
    - warpgroup 0, warp 0: producer (registers lowered). TMA of the qg, w, kg, u, aqk tiles of one chunk into a
      2-stage ring, and the chunk's exp(G_last) into the stage's eg slot: loaded before waiting for a free stage,
      stored, and only then the arrive (a release), so the consumer's acquiring wait covers it. Every lane
      arrives (full barrier count 32, lane 0 also sets the TMA byte count), so each lane's own stores are released
      by its own arrive; likewise every consumer thread arrives on the empty barrier (count 128) after its reads.
    - warpgroup 1: consumer (registers raised). Holds S^T [64 x 128] in wgmma accumulators for the whole tile (RS
      wgmma, nothing of the chain in shared memory): v_new^T = u^T - S^T w^T and o^T = S^T qg^T (one commit), then
      o^T += v_new^T Aqk^T and S^T <- S^T diag(exp(G_last)) + v_new^T kg (one commit); o^T is stored meanwhile.
    Pipeline: `PipelineTmaAsync` ring of 2 stages (producer = the 32 lanes of warp 0, consumer = 128 threads).

    Config (`StateConfig`):
    - mode: `forward` (start from initial_state[seq] or 0; final_state[seq] after the last segment if
      `final_state`); `segment_outputs` (start from start_states[seg_slot], same outputs); `summary` (the
      segment's affine map S_end = M S_start + h_ext, no o, loads only w, kg, u: block b < V / 64 runs h_ext's
      columns [64 b, 64 b + 64) from 0 with the real u; block b >= V / 64 runs M's columns [64 (b - V / 64), ..)
      from the identity with u = 0; the end block goes to summary[slot] (h_ext) or summary[slots + slot] (M), both
      [.., 128, 128] -- `affine_merge`'s layout).
    - token_factors (GDN's folded terms): qg, w, u are the call's q, k, v; kg holds W2 = T^T diag(2^(G_last - G)) k,
      aqk A1 = Aqk T (T = (I + Akk)^-1 diag(beta)), eg [tokens, H, 4] fp32 (row r: scale 2^G_r, 2^(G_last - G_r),
      2^G_last, 2^G_r). Chain: P^T = S^T k^T, R^T = v^T - P^T diag(2^G), o^T = (S^T q^T) diag(scale 2^G)
      + R^T A1^T and S^T <- S^T 2^G_last + R^T W2.
    - consume (forward, overlapped with phase 1): before loading a chunk not yet seen published, the producer warp
      spins on the flags `flags[(seq * chunks_per_seq + chunk) * H + head]` (`wait_published`), takes one count back
      per published chunk (the flags end the call at 0) and fences the generic proxy against the async one before
      its TMA loads and eg reads. Phase 1 never waits on this grid, so the spin ends as long as phase 1 has SMs.
    - pdl: every thread runs `griddepcontrol.wait` after the barrier setup, before any global read (phase 1's
      terms, the merge's start states), then `griddepcontrol.launch_dependents`.
    """

    def __init__(self, config: StateConfig, io_dtype):
        self.config = config
        self.io_dtype = io_dtype
        self.kda = config.kda
        self.has_initial_state = config.initial_state
        self.store_final_state = config.final_state
        self.mode = config.mode
        self.num_stages = NUM_STAGES
        self.pdl = config.pdl
        self.consume = config.consume
        self.token_factors = config.token_factors
        self.num_threads = 256
        self.outputs = config.mode != "summary"
        wide_tiles = 3 if self.outputs else 2   # qg, w, kg (summary: w, kg)
        narrow_tiles = 1 if self.outputs else 0   # aqk
        self.tma_bytes = (wide_tiles * C * K_DIM + narrow_tiles * C * C + C * V_BLOCK) * io_dtype.width // 8

    @cute.jit
    def __call__(
        self,
        qg: cute.Tensor,             # [B, T, H, 128]
        w: cute.Tensor,              # [B, T, H, 128]
        u: cute.Tensor,              # [B, T, H, V]
        kg: cute.Tensor,             # [B, T, H, 128]
        aqk: cute.Tensor,            # [B, T, H, 64]
        eg: cute.Tensor,             # [B, T, H] fp32 (KDA: [B, T, H, 128]; token_factors: [B, T, H, 4])
        o: cute.Tensor,              # [B, T, H, V]
        initial_state: cute.Tensor,  # [N, H, 128, V] fp32 (forward, if initial_state); segment_outputs: [slots, ..]
        final_state: cute.Tensor,    # [N, H, 128, V] fp32 (if final_state); summary: [2 * slots, H, 128, 128]
        tiles: cute.Tensor,          # [num_tiles, NUM_TILE_FIELDS] int32
        num_tiles: Int32, grid_x: Int32,
        flags: cute.Tensor,          # consume: int32 [(sequences x chunks per sequence) x H] (else any int32)
        chunks_per_seq: Int32, stream,
    ):
        io = self.io_dtype
        flat = wt.flat
        qg, w, u, kg, aqk, eg, o = flat(qg), flat(w), flat(u), flat(kg), flat(aqk), flat(eg), flat(o)
        op = cpasync.CopyBulkTensorTileG2SOp()
        wide = wt.first_stage(wt.smem_layout(C, K_DIM, io))
        narrow = wt.first_stage(wt.smem_layout(C, V_BLOCK, io))
        tma_qg, tma_qg_t = cpasync.make_tiled_tma_atom(op, wt.thd(qg), wide, (C, K_DIM))
        tma_w, tma_w_t = cpasync.make_tiled_tma_atom(op, wt.thd(w), wide, (C, K_DIM))
        tma_kg, tma_kg_t = cpasync.make_tiled_tma_atom(op, wt.thd(kg), wide, (C, K_DIM))
        tma_u, tma_u_t = cpasync.make_tiled_tma_atom(op, wt.thd(u), narrow, (C, V_BLOCK))
        tma_a, tma_a_t = cpasync.make_tiled_tma_atom(op, wt.thd(aqk), narrow, (C, V_BLOCK))
        stages = self.num_stages
        eg_elems = self.eg_slot() * stages

        @cute.struct
        class SharedStorage:
            load_mbar: cute.struct.MemRange[cutlass.Int64, stages * 2]
            sQg: cute.struct.Align[cute.struct.MemRange[io, C * K_DIM * stages], 1024]
            sW: cute.struct.Align[cute.struct.MemRange[io, C * K_DIM * stages], 1024]
            sKg: cute.struct.Align[cute.struct.MemRange[io, C * K_DIM * stages], 1024]
            sU: cute.struct.Align[cute.struct.MemRange[io, C * V_BLOCK * stages], 1024]
            sAqk: cute.struct.Align[cute.struct.MemRange[io, C * C * stages], 1024]
            sEg: cute.struct.Align[cute.struct.MemRange[Float32, eg_elems], 128]   # per ring stage

        self.shared_storage = SharedStorage
        self.smem_bytes = self.shared_storage.size_in_bytes()
        assert self.smem_bytes <= 232448, f"shared storage {self.smem_bytes} B exceeds the 227 KB of an SM90 CTA"
        self.kernel(tma_qg, tma_qg_t, tma_w, tma_w_t, tma_kg, tma_kg_t, tma_u, tma_u_t, tma_a, tma_a_t,
                    eg, o, initial_state, final_state, tiles, num_tiles, flags, chunks_per_seq).launch(
            grid=[grid_x, 1, 1], block=[self.num_threads, 1, 1], stream=stream, min_blocks_per_mp=1,
            use_pdl=self.pdl,
        )

    @cute.kernel
    def kernel(
        self, tma_qg: cute.CopyAtom, mQg: cute.Tensor, tma_w: cute.CopyAtom, mW: cute.Tensor, tma_kg: cute.CopyAtom,
        mKg: cute.Tensor, tma_u: cute.CopyAtom, mU: cute.Tensor, tma_a: cute.CopyAtom, mA: cute.Tensor,
        mEg: cute.Tensor, mO: cute.Tensor, mS0: cute.Tensor, mSN: cute.Tensor,
        mTiles: cute.Tensor, num_tiles: Int32, mFlags: cute.Tensor, chunks_per_seq: Int32,
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
            # every producer lane and every consumer thread arrives: each releases its own eg stores / reads
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 32),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 128),
            tx_count=self.tma_bytes,
        )
        if cutlass.const_expr(self.pdl):
            # PDL: after barrier setup, wait for the previous grid (phase 1 or the merge) before reading its output
            cute.arch.griddepcontrol_wait()
            cute.arch.griddepcontrol_launch_dependents()
        sched = TileScheduler.create(mTiles, num_tiles, False)
        sQg = wt.smem_view(st.sQg, io, C, K_DIM, ns)                 # (token, channel, stage)
        sW = wt.smem_view(st.sW, io, C, K_DIM, ns)
        sKg_mn = wt.smem_view(st.sKg, io, C, K_DIM, ns, True)        # (channel, token, stage)
        sU = wt.smem_view(st.sU, io, C, V_BLOCK, ns)                 # (token, v, stage)
        sA = wt.smem_view(st.sAqk, io, C, C, ns)                     # (token r, token i, stage)
        sEg = st.sEg.get_tensor(cute.make_layout((self.eg_slot(), ns), stride=(1, self.eg_slot())))

        if warp_idx == 0:
            for atom in (tma_qg, tma_w, tma_kg, tma_u, tma_a):
                cpasync.prefetch_descriptor(atom)

        if wg == 0:
            cute.arch.setmaxregister_decrease(40)
            if warp_idx == 0:
                qk = self.config.group   # token_factors under GVA: w and qg are the call's k and q
                loads = ((tma_w, mW, sW, K_DIM, False, qk),
                         (tma_kg, mKg, wt.smem_view(st.sKg, io, C, K_DIM, ns), K_DIM, False, 1),
                         (tma_u, mU, sU, V_BLOCK, True, 1))
                if cutlass.const_expr(self.outputs):
                    loads = loads + ((tma_qg, mQg, sQg, K_DIM, False, qk), (tma_a, mA, sA, C, False, 1))
                self.producer(sched, load, loads, mU.shape[1] // V_BLOCK, mEg, sEg, tidx % 32, mFlags,
                              chunks_per_seq)
        else:
            cute.arch.setmaxregister_increase(CONSUMER_REGS)
            if wg == 1:
                self.consumer(sched, load, tidx - 128, sQg, sW, sKg_mn, sU, sA, sEg, mO, mS0, mSN)

    @cute.jit
    def producer(self, sched, load, loads, n_vb, mEg, sEg, lane, mFlags, chunks_per_seq):
        """One chunk per ring stage: the tiles of `loads` ((atom, tensor, smem, columns, by_block, group): column tile
        = the work tile's block if `by_block` (u), else 0; head = the work tile's // group (GVA); `n_vb`: u's column
        tiles) and the chunk's exp(G_last)
        (token_factors: its 64 + 64 row factors and decay) from `mEg` into the stage's column of `sEg`."""
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.num_stages)
        work = sched.initial_work()
        while work.is_valid:
            head = work.head
            tok0 = work.tok_start
            blk = work.block
            if cutlass.const_expr(self.mode == "summary"):
                if blk >= n_vb:
                    blk = Int32(0)   # M columns: u is not used (any in-bounds tile keeps the byte count)
            n_chunks = work.chunk_end - work.chunk_start
            ready = Int32(0)   # consume: chunks [0, ready) of the tile are known published
            for c in cutlass.range(n_chunks, unroll=1):
                if cutlass.const_expr(self.consume):
                    if c >= ready:
                        num_heads = mEg.shape[1]
                        ready = c + self.wait_published(
                            mFlags, (work.seq * chunks_per_seq + work.chunk_start + c) * num_heads + head,
                            num_heads, n_chunks - c, lane)
                # exp(G_last) into registers, into the stage once free, then the arrive that publishes it
                t0, L = chunk_rows(tok0, work.tok_end, c)
                if cutlass.const_expr(self.token_factors):
                    # rows lane and lane + 32: (o factor, 2^G factor); every lane also reads the decay
                    f = cute.make_rmem_tensor((4, 2), Float32)   # (factor, row j)
                    f.fill(0.0)
                    for j in cutlass.range_constexpr(2):
                        if lane + 32 * j < L:
                            cute.autovec_copy(mEg[t0 + lane + 32 * j, head, None], f[None, j])
                    dl = Float32(mEg[t0 + L - 1, head, 2])
                    load.sync_object_empty.wait(state.index, state.phase)
                    for j in cutlass.range_constexpr(2):
                        sEg[lane + 32 * j, state.index] = f[0, j]
                        sEg[C + lane + 32 * j, state.index] = f[3, j]   # R = v - diag(2^G) k S
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
                bar = load.producer_get_barrier(state)
                if lane == 0:
                    cute.arch.mbarrier_expect_tx(bar, self.tma_bytes)
                cute.arch.mbarrier_arrive(bar)   # all 32 lanes (the barrier's count), each after its own stores
                for tma, m, s, cols, by_block, group in loads:
                    col_tile = blk if by_block else 0
                    h = head if group == 1 else head // group
                    g_head = cute.domain_offset((tok0 + c * C, 0), m[None, None, h])
                    g_tile = cute.local_tile(g_head, (C, cols), (0, col_tile))
                    s_part, g_part = cpasync.tma_partition(
                        tma, 0, cute.make_layout(1), cute.group_modes(s, 0, 2), cute.group_modes(g_tile, 0, 2),
                    )
                    cute.copy(tma, g_part, s_part[(None, state.index)], tma_bar_ptr=bar)
                state.advance()
            work = sched.advance(work)
        load.producer_tail(state)

    @cute.jit
    def wait_published(self, mFlags, idx, stride, left, lane) -> Int32:
        """`consume`: how many consecutive chunks from this one phase 1 has published (>= 1: spins until this one is),
        from up to 32 flags (lane i: flag `idx + i stride`, i < `left`, gpu-scope acquire), each taking one count
        back. The warp's later generic (eg) and async-proxy (TMA) reads are ordered after the acquires."""
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

    def eg_slot(self) -> int:
        """Floats per ring stage of sEg: 128 (KDA: the 128 decays; GDN: its one decay in slot 0), or with
        token_factors 132 (64 o factors, 64 factors 2^G, the decay, padding)."""
        return 2 * C + 4 if self.token_factors else K_DIM

    @cute.jit
    def tile_columns(self, work, n_vb):
        """(v0, is_m): the tile's first state column and (summary) whether it is an M block (past n_vb; from 0)."""
        blk = work.block
        v0 = blk * V_BLOCK
        is_m = blk >= n_vb
        if cutlass.const_expr(self.mode == "summary"):
            if is_m:
                v0 = (blk - n_vb) * V_BLOCK
        return v0, is_m

    @cute.jit
    def load_start_state(self, work, head, v0, is_m, acc_s, cc_s, mS0):
        """The tile's start state S^T into acc_s (coordinates cc_s: (v, k)): summary h blocks from 0, M blocks
        from the identity; segment outputs from start_states[seg_slot]; forward from initial_state[seq] or 0."""
        src = work.seq   # work fields are loads from the tile table: read each once
        if cutlass.const_expr(self.mode == "segment_outputs"):
            src = work.seg_slot
        for i in cutlass.range_constexpr(cute.size(acc_s)):
            vv, kk = cc_s[i]
            if cutlass.const_expr(self.mode == "summary"):
                acc_s[i] = cutlass.select_(is_m and kk == v0 + vv, Float32(1.0), Float32(0.0))
            elif cutlass.const_expr(self.mode == "segment_outputs" or self.has_initial_state):
                acc_s[i] = mS0[src, head, kk, v0 + vv]
            else:
                acc_s[i] = Float32(0.0)

    @cute.jit
    def store_end_state(self, work, head, v0, is_m, acc_s, cc_s, mSN):
        """Summary: h_ext -> summary[slot], M -> summary[slots + slot]; else the final state (last segment, if kept)."""
        if cutlass.const_expr(self.mode == "summary"):
            dst = work.seg_slot
            if is_m:
                dst = dst + mSN.shape[0] // 2
            for i in cutlass.range_constexpr(cute.size(acc_s)):
                vv, kk = cc_s[i]
                mSN[dst, head, kk, v0 + vv] = acc_s[i]
        elif cutlass.const_expr(self.store_final_state):
            if work.is_last_segment:
                seq = work.seq
                for i in cutlass.range_constexpr(cute.size(acc_s)):
                    vv, kk = cc_s[i]
                    mSN[seq, head, kk, v0 + vv] = acc_s[i]

    @cute.jit
    def consumer(self, sched, load, wtid, sQg, sW, sKg_mn, sU, sA, sEg, mO, mS0, mSN):
        """The state chain in registers (see the class docstring). Accumulators are indexed (v, n): v the row of
        S^T (a V column of the block), n a channel (S^T) or a token (v_new^T, o^T)."""
        io = self.io_dtype
        thr_s = wt.make_mma_rs(io, True, K_DIM).get_slice(wtid)    # S^T += v_new^T kg   (64 x 128, K = tokens)
        thr_t = wt.make_mma_rs(io, False, C).get_slice(wtid)       # x^T = A y^T          (64 x 64)
        cc_s = thr_s.partition_C(cute.make_identity_tensor((V_BLOCK, K_DIM)))
        cc_t = thr_t.partition_C(cute.make_identity_tensor((V_BLOCK, C)))
        acc_s = cute.make_rmem_tensor(thr_s.partition_shape_C((V_BLOCK, K_DIM)), Float32)
        acc_v = cute.make_rmem_tensor(thr_t.partition_shape_C((V_BLOCK, C)), Float32)
        acc_o = cute.make_rmem_tensor(thr_t.partition_shape_C((V_BLOCK, C)), Float32)
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.num_stages)

        n_vb = mO.shape[2] // V_BLOCK   # V blocks (summary: blocks past them are M's columns)
        has_o = self.outputs
        work = sched.initial_work()
        while work.is_valid:
            head = work.head
            v0, is_m = self.tile_columns(work, n_vb)
            tok0 = work.tok_start
            tok_end = work.tok_end
            self.load_start_state(work, head, v0, is_m, acc_s, cc_s, mS0)

            for c in cutlass.range(work.chunk_end - work.chunk_start, unroll=1):
                t0, L = chunk_rows(tok0, tok_end, c)
                load.consumer_wait(state)
                stage = state.index
                dg = Float32(1.0)
                if cutlass.const_expr(self.token_factors):
                    dg = sEg[2 * C, stage]
                elif cutlass.const_expr(not self.kda):
                    dg = sEg[0, stage]
                # v_new^T = u^T - S^T w^T and o^T = S^T qg^T, one commit (A = S^T from registers)
                rS = wt.acc_to_a(io, acc_s)
                wt.gemm_rs(io, wtid, acc_v, rS, sW[None, None, stage], False, False, C, wait=False)
                if has_o:
                    wt.gemm_rs(io, wtid, acc_o, rS, sQg[None, None, stage], False, False, C, wait=False)
                warpgroup.wait_group(0)
                if cutlass.const_expr(self.token_factors):
                    if has_o:
                        for i in cutlass.range_constexpr(cute.size(acc_o)):   # o^T's column n: times scale 2^G_n
                            _, n = cc_t[i]
                            acc_o[i] = acc_o[i] * sEg[n, stage]
                    for i in cutlass.range_constexpr(cute.size(acc_v)):      # R^T = v^T - P^T diag(2^G)
                        _, n = cc_t[i]
                        acc_v[i] = acc_v[i] * sEg[C + n, stage]
                self.sub_u(acc_v, cc_t, sU, stage, is_m, L)
                rV = wt.acc_to_a(io, acc_v)
                # o^T += v_new^T Aqk^T and S^T <- S^T diag(exp(G_last)) + v_new^T kg, one commit (A = v_new^T)
                if has_o:
                    wt.gemm_rs(io, wtid, acc_o, rV, sA[None, None, stage], False, True, C, wait=False)
                for i in cutlass.range_constexpr(cute.size(acc_s)):
                    if cutlass.const_expr(self.kda):
                        _, kk = cc_s[i]
                        acc_s[i] = acc_s[i] * sEg[kk, stage]
                    else:
                        acc_s[i] = acc_s[i] * dg
                wt.gemm_rs(io, wtid, acc_s, rV, sKg_mn[None, None, stage], True, True, K_DIM, wait=False)
                if has_o:
                    # o^T is done one group before the state update: store it while the update runs
                    warpgroup.wait_group(1)
                    self.store_o_t(acc_o, cc_t, mO, head, t0, v0, L)
                warpgroup.wait_group(0)
                load.sync_object_empty.arrive(state.index, None)   # every thread, after its own sEg / sU reads
                state.advance()
            self.store_end_state(work, head, v0, is_m, acc_s, cc_s, mSN)
            work = sched.advance(work)

    @cute.jit
    def sub_u(self, acc, coords, sU, stage, is_m, L):
        """v_new^T = u^T - (w S)^T: acc <- u - acc (accumulator coordinates (v, token)), rows past the chunk end
        (token >= L) 0; summary mode's M blocks use u = 0."""
        for i in cutlass.range_constexpr(cute.size(acc)):
            vv, n = coords[i]
            uval = Float32(sU[n, vv, stage])
            if cutlass.const_expr(self.mode == "summary"):
                uval = cutlass.select_(is_m, Float32(0.0), uval)
            acc[i] = cutlass.select_(n < L, uval - acc[i], Float32(0.0))

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
