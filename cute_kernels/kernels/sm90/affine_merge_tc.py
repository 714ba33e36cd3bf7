"""SM90 affine merge with the chain on tensor cores (`AffineMerge`'s contract, K = 128, V a multiple of 64).

Each link S <- M S + h_ext is an RS wgmma, transposed (S^T in fp32 accumulators, M^T from smem), with both factors
split into bf16 hi + lo: S^T_hi M^T_hi + S^T_hi M^T_lo + S^T_lo M^T_hi, accumulated onto h_ext^T in fp32.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Float32
from cutlass.cute.nvgpu import warpgroup

from ..configs import MergeConfig
from . import wgmma_tiles as wt

K_DIM = 128
V_BLOCK = 64
NUM_STAGES = 2


class AffineMergeTcSm90:
    """Start state of every segment and the final state, from per-segment summaries (as `AffineMerge`).

    Per (sequence n, head h, 64 V columns): S = S0[n, h] (or 0); for each segment slot s of n in order:
    start[s] = S; S = M[s, h] @ S + h_ext[s, h] (without an initial state the first M is not applied). Then
    final[n, h] = S, or with `starts_only` the last slot's start instead (its summary is not read).

    Warp roles (256 threads, one CTA per (V block, head, sequence)):
    - warpgroup 1: producer. For each slot, M[s] (fp32, global) -> bf16 hi and lo tiles [128 x 128] (K-major B
      operand layout) and h_ext[s][:, block] (fp32 [128 x 64]) -> one stage of a 2-stage smem ring.
    - warpgroup 0: consumer. Holds S^T in accumulator registers; per slot: new = h^T (from smem) +
      S^T_hi M^T_hi + S^T_hi M^T_lo + S^T_lo M^T_hi (RS wgmma, one commit), the start state stored meanwhile.
    Pipeline: `PipelineAsync` (producer 128 threads, consumer 128 threads), 2 stages.
    `pdl` (config): launched early after the summary launch, griddepcontrol.wait before any read.
    """

    def __init__(self, config: MergeConfig, io_dtype):
        if config.impl != "tc":
            raise ValueError(f"AffineMergeTcSm90 is the 'tc' merge, got impl {config.impl!r}")
        self.config = config
        self.io_dtype = io_dtype
        self.pdl = config.pdl
        self.has_initial_state = config.initial_state
        self.starts_only = config.starts_only
        self.num_threads = 256

    @cute.jit
    def __call__(self, m: cute.Tensor, h_ext: cute.Tensor, seg_offsets: cute.Tensor, initial_state: cute.Tensor,
                 start_states: cute.Tensor, final_state: cute.Tensor, stream):
        io = self.io_dtype

        @cute.struct
        class SharedStorage:
            mbar: cute.struct.MemRange[cutlass.Int64, NUM_STAGES * 2]
            sMhi: cute.struct.Align[cute.struct.MemRange[io, K_DIM * K_DIM * NUM_STAGES], 1024]
            sMlo: cute.struct.Align[cute.struct.MemRange[io, K_DIM * K_DIM * NUM_STAGES], 1024]
            sH: cute.struct.Align[cute.struct.MemRange[Float32, K_DIM * V_BLOCK * NUM_STAGES], 16]

        self.shared_storage = SharedStorage
        self.smem_bytes = SharedStorage.size_in_bytes()
        assert self.smem_bytes <= 232448, f"shared storage {self.smem_bytes} B exceeds the 227 KB of an SM90 CTA"
        self.kernel(m, h_ext, seg_offsets, initial_state, start_states, final_state).launch(
            grid=[final_state.shape[3] // V_BLOCK, final_state.shape[1], final_state.shape[0]],
            block=[self.num_threads, 1, 1], stream=stream, use_pdl=self.pdl,
        )

    @cute.kernel
    def kernel(self, m: cute.Tensor, h_ext: cute.Tensor, seg_offsets: cute.Tensor, initial_state: cute.Tensor,
               start_states: cute.Tensor, final_state: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        if cutlass.const_expr(self.pdl):
            cute.arch.griddepcontrol_wait()
            cute.arch.griddepcontrol_launch_dependents()
        vb, head, seq = cute.arch.block_idx()
        wg = cute.arch.make_warp_uniform(tidx // 128)
        smem = cutlass.memory.SmemAllocator()
        st = smem.allocate(self.shared_storage)
        ring = pipeline.PipelineAsync.create(
            barrier_storage=st.mbar.data_ptr(),
            num_stages=NUM_STAGES,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 128),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 128),
        )
        sMhi = wt.smem_view(st.sMhi, self.io_dtype, K_DIM, K_DIM, NUM_STAGES)   # (k_out, k_in, stage): B (N, K)
        sMlo = wt.smem_view(st.sMlo, self.io_dtype, K_DIM, K_DIM, NUM_STAGES)
        sH = st.sH.get_tensor(cute.make_layout((K_DIM, V_BLOCK, NUM_STAGES),
                                               stride=(V_BLOCK, 1, K_DIM * V_BLOCK)))
        first = seg_offsets[seq]
        last = seg_offsets[seq + 1]
        end = last
        if cutlass.const_expr(self.starts_only):
            end = last - 1   # the last summary is never applied
        v0 = vb * V_BLOCK
        cute.arch.sync_threads()
        if wg == 1:
            self.producer(ring, m, h_ext, sMhi, sMlo, sH, head, v0, first, end, tidx - 128)
        else:
            self.consumer(ring, sMhi, sMlo, sH, initial_state, start_states, final_state, seq, head, v0, first,
                          last, end, tidx)

    @cute.jit
    def producer(self, ring, m, h_ext, sMhi, sMlo, sH, head, v0, first, end, ptid):
        io = self.io_dtype
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, NUM_STAGES)
        for slot in cutlass.range(first, end, unroll=1):
            ring.producer_acquire(state)
            stage = state.index
            # M: 128 x 128 fp32 in runs of 8 (two 16-byte loads) -> 8 hi + 8 lo bf16 (16 bytes each)
            wt.split_hi_lo(io, m[slot, head, None, None], sMhi[None, None, stage], sMlo[None, None, stage], ptid, 128)
            # h_ext[:, v0 : v0 + 64]: 128 x 64 fp32 in runs of 4
            for i in cutlass.range_constexpr(K_DIM * V_BLOCK // 4 // 128):
                f = ptid + 128 * i
                r = f // (V_BLOCK // 4)
                c4 = f % (V_BLOCK // 4)
                hv = cute.make_rmem_tensor((4,), Float32)
                cute.autovec_copy(cute.local_tile(m_row(h_ext, slot, head, r, v0), (4,), (c4,)), hv)
                cute.autovec_copy(hv, cute.local_tile(sH[r, None, stage], (4,), (c4,)))
            cute.arch.fence_proxy("async.shared", space="cta")   # generic writes -> the wgmma's async reads
            ring.producer_commit(state)
            state.advance()
        ring.producer_tail(state)

    @cute.jit
    def consumer(self, ring, sMhi, sMlo, sH, initial_state, start_states, final_state, seq, head, v0, first, last,
                 end, wtid):
        io = self.io_dtype
        thr = wt.make_mma_rs(io, False, K_DIM).get_slice(wtid)
        cc = thr.partition_C(cute.make_identity_tensor((V_BLOCK, K_DIM)))     # (v, k) of S^T
        acc = cute.make_rmem_tensor(thr.partition_shape_C((V_BLOCK, K_DIM)), Float32)
        nxt = cute.make_rmem_tensor(thr.partition_shape_C((V_BLOCK, K_DIM)), Float32)
        for i in cutlass.range_constexpr(cute.size(acc)):
            vv, kk = cc[i]
            if cutlass.const_expr(self.has_initial_state):
                acc[i] = initial_state[seq, head, kk, v0 + vv]
            else:
                acc[i] = Float32(0.0)
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, NUM_STAGES)
        for slot in cutlass.range(first, end, unroll=1):
            ring.consumer_wait(state)
            stage = state.index
            for i in cutlass.range_constexpr(cute.size(nxt)):
                vv, kk = cc[i]
                nxt[i] = sH[kk, vv, stage]
            apply = slot != first
            if cutlass.const_expr(self.has_initial_state):
                apply = True
            if apply:
                # S^T = hi + lo, both 16-bit A operands; three products onto h^T, one commit
                s_hi = cute.make_rmem_tensor_like(acc, Float32)
                s_hi.store(acc.load().to(io).to(Float32))
                s_lo = cute.make_rmem_tensor_like(acc, Float32)
                for i in cutlass.range_constexpr(cute.size(acc)):
                    s_lo[i] = acc[i] - s_hi[i]
                a_hi = wt.acc_to_a(io, s_hi)
                a_lo = wt.acc_to_a(io, s_lo)
                wt.gemm_rs(io, wtid, nxt, a_hi, sMhi[None, None, stage], False, True, K_DIM, wait=False)
                wt.gemm_rs(io, wtid, nxt, a_hi, sMlo[None, None, stage], False, True, K_DIM, wait=False)
                wt.gemm_rs(io, wtid, nxt, a_lo, sMhi[None, None, stage], False, True, K_DIM, wait=False)
            for i in cutlass.range_constexpr(cute.size(acc)):   # this slot's start, while the products run
                vv, kk = cc[i]
                start_states[slot, head, kk, v0 + vv] = acc[i]
            warpgroup.wait_group(0)
            ring.consumer_release(state)
            state.advance()
            for i in cutlass.range_constexpr(cute.size(acc)):
                acc[i] = nxt[i]
        if cutlass.const_expr(self.starts_only):
            if first < last:
                for i in cutlass.range_constexpr(cute.size(acc)):
                    vv, kk = cc[i]
                    start_states[last - 1, head, kk, v0 + vv] = acc[i]
        else:
            for i in cutlass.range_constexpr(cute.size(acc)):
                vv, kk = cc[i]
                final_state[seq, head, kk, v0 + vv] = acc[i]


def m_row(t: cute.Tensor, slot, head, r, c0):
    """Row r of t[slot, head] from column c0 on (a 1-D view)."""
    return cute.domain_offset((c0,), t[slot, head, r, None])
