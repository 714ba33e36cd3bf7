"""SM100 (Blackwell) affine merge with the chain on tensor cores (`AffineMerge`'s contract, K = 128, V a multiple of
64): tcgen05 MMAs into tensor memory. Compiled and checked on the CPU; not yet run on hardware.

Each link S <- M S + h_ext is D = M S (A = M from shared memory, B = S from shared memory, D in TMEM), with both
factors split into bf16 hi + lo: M_hi S_hi + M_lo S_hi + M_hi S_lo, then S = D + h_ext in registers (fp32).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.utils as utils
import cutlass.utils.blackwell_helpers as sm100_utils
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import tcgen05

from ..configs import MergeConfig
from .budgets import check_smem, tmem_plan

K_DIM = 128
V_BLOCK = 64
THREADS = 128                         # thread t owns TMEM lane t: row t of S (and of D)
MMA_TILER = (K_DIM, V_BLOCK, K_DIM)   # (M = k_out, N = v, K = k_in)
MMA_INST = (K_DIM, V_BLOCK, 16)       # one tcgen05.mma (bf16: K = 16)
TMEM = tmem_plan({"d": V_BLOCK}, ctas_per_sm=1)   # the fp32 accumulator D [128 lanes x 64 columns]


class AffineMergeTcSm100:
    """Start state of every segment and the final state, from per-segment summaries (as `AffineMerge`).

    Per (sequence n, head h, 64 V columns): S = S0[n, h] (or 0); for each segment slot s of n in order:
    start[s] = S; S = M[s, h] @ S + h_ext[s, h] (without an initial state the first M is not applied). Then
    final[n, h] = S, or with `starts_only` the last slot's start instead.

    Warp roles (128 threads, one CTA per (V block, head, sequence)): every thread keeps row t of S in registers,
    writes its hi / lo halves into the B operand tiles and row t of M[s]'s hi / lo into the A tiles; warp 0 issues
    the three tcgen05 MMAs (one elected lane) and commits them to an mbarrier; every thread then reads row t of D
    from TMEM (tcgen05.ld 32x32b) and adds h_ext. No pipeline across slots (the chain is serial); TMEM: 64 columns.
    `pdl` (config): griddepcontrol.wait before any read.
    """

    def __init__(self, config: MergeConfig, io_dtype):
        if config.impl != "tc":
            raise ValueError(f"AffineMergeTcSm100 is the 'tc' merge, got impl {config.impl!r}")
        self.config = config
        self.io_dtype = io_dtype
        self.pdl = config.pdl
        self.has_initial_state = config.initial_state
        self.starts_only = config.starts_only

    @cute.jit
    def __call__(self, m: cute.Tensor, h_ext: cute.Tensor, seg_offsets: cute.Tensor, initial_state: cute.Tensor,
                 start_states: cute.Tensor, final_state: cute.Tensor, stream):
        io = self.io_dtype
        op = tcgen05.MmaF16BF16Op(io, Float32, MMA_INST, tcgen05.CtaGroup.ONE, tcgen05.OperandSource.SMEM,
                                  tcgen05.OperandMajorMode.K, tcgen05.OperandMajorMode.MN)
        tiled_mma = cute.make_tiled_mma(op)
        a_layout = sm100_utils.make_smem_layout_a(tiled_mma, MMA_TILER, io, 1)
        b_layout = sm100_utils.make_smem_layout_b(tiled_mma, MMA_TILER, io, 1)
        a_bytes = cute.size_in_bytes(io, a_layout)
        b_bytes = cute.size_in_bytes(io, b_layout)

        @cute.struct
        class SharedStorage:
            mma_mbar: cute.struct.MemRange[cutlass.Int64, 1]
            tmem_holding: Int32

        self.shared_storage = SharedStorage
        self.smem_bytes = SharedStorage.size_in_bytes() + 2 * a_bytes + 2 * b_bytes + 4 * 1024
        check_smem(self.smem_bytes, 1, "AffineMergeTcSm100")
        self.kernel(tiled_mma, a_layout, b_layout, m, h_ext, seg_offsets, initial_state, start_states,
                    final_state).launch(
            grid=[final_state.shape[3] // V_BLOCK, final_state.shape[1], final_state.shape[0]],
            block=[THREADS, 1, 1], stream=stream, use_pdl=self.pdl,
        )

    @cute.kernel
    def kernel(self, tiled_mma: cute.TiledMma, a_layout: cute.ComposedLayout, b_layout: cute.ComposedLayout,
               m: cute.Tensor, h_ext: cute.Tensor, seg_offsets: cute.Tensor, initial_state: cute.Tensor,
               start_states: cute.Tensor, final_state: cute.Tensor):
        io = self.io_dtype
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if cutlass.const_expr(self.pdl):
            cute.arch.griddepcontrol_wait()
            cute.arch.griddepcontrol_launch_dependents()
        vb, head, seq = cute.arch.block_idx()
        v0 = vb * V_BLOCK

        smem = utils.SmemAllocator()
        st = smem.allocate(self.shared_storage)
        tiles = []
        for layout in (a_layout, a_layout, b_layout, b_layout):   # M hi, M lo, S hi, S lo
            tiles.append(smem.allocate_tensor(element_type=io, layout=layout.outer, byte_alignment=1024,
                                              swizzle=layout.inner))
        sA_hi, sA_lo, sB_hi, sB_lo = tiles
        mbar = st.mma_mbar.data_ptr()
        if warp_idx == 0:
            cute.arch.mbarrier_init(mbar, 1)
        cute.arch.mbarrier_init_fence()

        tmem = utils.TmemAllocator(st.tmem_holding, barrier_for_retrieve=cutlass.pipeline.NamedBarrier(
            barrier_id=1, num_threads=THREADS))
        tmem.allocate(TMEM.alloc)
        tmem.wait_for_alloc()
        acc_shape = tiled_mma.partition_shape_C(MMA_TILER[:2])
        tAcc = cute.make_tensor(tmem.retrieve_ptr(Float32), tiled_mma.make_fragment_C(acc_shape).layout)
        frags = (tiled_mma.make_fragment_A(sA_hi), tiled_mma.make_fragment_A(sA_lo),
                 tiled_mma.make_fragment_B(sB_hi), tiled_mma.make_fragment_B(sB_lo))
        load = tcgen05.make_tmem_copy(cute.make_copy_atom(tcgen05.Ld32x32bOp(tcgen05.Repetition.x64), Float32),
                                      tAcc[(None, None), 0, 0])
        thr_load = load.get_slice(tidx)
        tDtAcc = thr_load.partition_S(tAcc[(None, None), 0, 0])
        tDrAcc = cute.make_rmem_tensor(thr_load.partition_D(tAcc[(None, None), 0, 0]).shape, Float32)

        s_row = cute.make_rmem_tensor((V_BLOCK,), Float32)   # row tidx of S
        h_row = cute.make_rmem_tensor((V_BLOCK,), Float32)
        for j in cutlass.range_constexpr(V_BLOCK):
            if cutlass.const_expr(self.has_initial_state):
                s_row[j] = initial_state[seq, head, tidx, v0 + j]
            else:
                s_row[j] = Float32(0.0)
        first = seg_offsets[seq]
        last = seg_offsets[seq + 1]
        end = last
        if cutlass.const_expr(self.starts_only):
            end = last - 1
        phase = Int32(0)
        for slot in cutlass.range(first, end, unroll=1):
            for j in cutlass.range_constexpr(V_BLOCK):
                start_states[slot, head, tidx, v0 + j] = s_row[j]
                h_row[j] = h_ext[slot, head, tidx, v0 + j]
            apply = slot != first
            if cutlass.const_expr(self.has_initial_state):
                apply = True
            if apply:
                # operands: row tidx of M[slot] (k_out = tidx, all k_in) and row tidx of S (k_in = tidx, all v)
                for kk in cutlass.range_constexpr(K_DIM):
                    x = m[slot, head, tidx, kk]
                    hi = x.to(io)
                    sA_hi[(tidx, kk % 16), 0, kk // 16, 0] = hi
                    sA_lo[(tidx, kk % 16), 0, kk // 16, 0] = (x - hi.to(Float32)).to(io)
                for j in cutlass.range_constexpr(V_BLOCK):
                    hi = s_row[j].to(io)
                    sB_hi[(j, tidx % 16), 0, tidx // 16, 0] = hi
                    sB_lo[(j, tidx % 16), 0, tidx // 16, 0] = (s_row[j] - hi.to(Float32)).to(io)
                cute.arch.fence_proxy("async.shared", space="cta")   # generic stores -> the MMA's reads
                cute.arch.sync_threads()
                if warp_idx == 0:   # whole warp: each MMA elects its issuing lane (elect.sync over all 32)
                    a_hi, a_lo, b_hi, b_lo = frags
                    tiled_mma.set(tcgen05.Field.ACCUMULATE, False)
                    for a, b in ((a_hi, b_hi), (a_lo, b_hi), (a_hi, b_lo)):
                        for kb in cutlass.range_constexpr(cute.size(a_hi, mode=[2])):
                            cute.gemm(tiled_mma, tAcc, a[None, None, kb, 0], b[None, None, kb, 0], tAcc)
                            tiled_mma.set(tcgen05.Field.ACCUMULATE, True)
                    with cute.arch.elect_one():
                        tcgen05.commit(mbar)
                cute.arch.mbarrier_wait(mbar, phase)
                phase = phase ^ 1
                cute.copy(load, tDtAcc, tDrAcc)
                cute.arch.fence_view_async_tmem_load()   # tcgen05.wait::ld: the row is in registers
                for j in cutlass.range_constexpr(V_BLOCK):
                    s_row[j] = tDrAcc[j] + h_row[j]
                cute.arch.sync_threads()   # every row read from TMEM and the tiles, before the next link writes them
            else:
                for j in cutlass.range_constexpr(V_BLOCK):
                    s_row[j] = h_row[j]
        if cutlass.const_expr(self.starts_only):
            if first < last:
                for j in cutlass.range_constexpr(V_BLOCK):
                    start_states[last - 1, head, tidx, v0 + j] = s_row[j]
        else:
            for j in cutlass.range_constexpr(V_BLOCK):
                final_state[seq, head, tidx, v0 + j] = s_row[j]
        tmem.relinquish_alloc_permit()
        cute.arch.sync_threads()
        tmem.free(tmem.retrieve_ptr(Float32))
