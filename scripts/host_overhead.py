"""Where the eager time of a small call goes (issue 5: eager wall time per call at T <= 256 under 40 us).

Times, per call, averaged over back-to-back calls with one synchronize at the end (host clock):
  op      the whole `cute_kernels.chunk_gated_delta_rule` / `chunk_kda` call
  checks  `validate_inputs` alone
  alloc   the output allocation (`torch.empty_like(v)` + the final state)
  launch  the compiled kernel called directly with prepared arguments (TVM-FFI + the CUDA launch)
  gpu     GPU time of one call (do_bench median) -- when op > gpu, the call is host-bound

`paths`: both paths of scheduler=None, eager / host / GPU time (CUDA-graph replay), then each step of the
two-phase path's host time (B=1 H=4 T=256).
"""

import sys
import time

import torch
import torch.nn.functional as F
import triton.testing as tt

import cute_kernels as ck
from time_two_phase import graph_us   # scripts/ is on sys.path when this runs as a script
from cute_kernels.ops import linear_attention as la

REPS = 2000


def per_call_us(fn, reps=REPS):
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / reps * 1e6


def inputs(B, T, H, kda, dev="cuda"):
    q = F.normalize(torch.randn(B, T, H, 128, device=dev), dim=-1).bfloat16()
    k = F.normalize(torch.randn(B, T, H, 128, device=dev), dim=-1).bfloat16()
    v = torch.randn(B, T, H, 128, device=dev).bfloat16()
    g = F.logsigmoid(torch.randn((B, T, H, 128) if kda else (B, T, H), device=dev)).clamp(min=-5.0)
    beta = torch.sigmoid(torch.randn(B, T, H, device=dev)).bfloat16()
    return q, k, v, g, beta


def main():
    for kda in (False, True):
        op = ck.chunk_kda if kda else ck.chunk_gated_delta_rule
        for B, H, T, final in [(1, 4, 64, False), (1, 4, 256, False), (1, 4, 256, True), (4, 16, 256, False)]:
            q, k, v, g, beta = inputs(B, T, H, kda)
            call = lambda: op(q, k, v, g, beta, output_final_state=final)  # noqa: E731
            t_op = per_call_us(call)
            t_chk = per_call_us(lambda: la.validate_inputs(q, k, v, g, beta, None, None, kda, None))
            t_alloc = per_call_us(lambda: (torch.empty_like(v),
                                           torch.empty((B, H, 128, 128), dtype=torch.float32, device="cuda")))
            schedule, _ = la._schedule_cache[next(key for key in la._schedule_cache if key[1:4] == (B, T, H))]
            compiled = la.compile_gdn_sm90(q.dtype, beta.dtype, False, final, schedule.persistent, kda)
            o = torch.empty_like(v)
            dummy = torch.empty((B, H, 128, 128), dtype=torch.float32, device="cuda")
            table = schedule.table_on(q.device)
            args = (q, k, v, g, beta, o, dummy, dummy, table, schedule.num_tiles, schedule.grid[0], 128 ** -0.5)
            t_launch = per_call_us(lambda: compiled.fn(*args))
            t_gpu = tt.do_bench(call, warmup=10, rep=50, return_mode="median") * 1e3
            print(f"{'kda' if kda else 'gdn'} B={B} H={H} T={T} final={final}: op {t_op:.1f} us | checks "
                  f"{t_chk:.1f} | alloc {t_alloc:.1f} | launch {t_launch:.1f} | gpu {t_gpu:.1f}", flush=True)
    return paths()


def host_issue_us(fn, calls=20):
    """Host time per call with an idle GPU queue: the calls return as soon as their launches are queued."""
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    t = (time.perf_counter() - t) / calls * 1e6
    torch.cuda.synchronize()
    return t


def ffi_args():
    """TVM-FFI's cost per torch tensor argument (a no-op FFI function; the C DLPack exchange makes it ~0.1 us)."""
    import tvm_ffi

    nop = tvm_ffi.get_global_func("testing.nop")
    ts = [torch.empty(4, 4, device="cuda") for _ in range(10)]
    t0, t10 = per_call_us(lambda: nop(), 5000), per_call_us(lambda: nop(*ts), 5000)
    print(f"tvm-ffi: C DLPack exchange {hasattr(torch.Tensor, '__dlpack_c_exchange_api__')}, call {t0:.2f} us, "
          f"{(t10 - t0) / 10:.2f} us per tensor argument", flush=True)


def two_phase_breakdown():
    """Host time of each step of the two-phase path's eager call (launches queued on an idle GPU, 50 calls each)."""
    from cute_kernels.ops import two_phase as tp

    for kda in (False, True):
        B, H, T = 1, 4, 256
        q, k, v, g, beta = inputs(B, T, H, kda)
        op = ck.chunk_kda if kda else ck.chunk_gated_delta_rule
        la.TWO_PHASE = "1"
        call = lambda: op(q, k, v, g, beta)  # noqa: E731
        call()
        dev = q.device
        n = la._last_choice[0].num_segments
        g32 = g.float()
        prep_plan = tp.prep_plan(B, T, H, None, kda, q.dtype, beta.dtype, dev)
        state_plan = tp.state_plan(B, T, H, None, kda, q.dtype, False, False, n, dev)
        prep = prep_plan.run(q, k, v, g32, beta, 0.1)
        o = torch.empty_like(v)
        parts = {
            "whole call": call,
            "validate_inputs": lambda: la.validate_inputs(q, k, v, g, beta, None, None, kda, None),
            "path choice": lambda: la._two_phase_segments(None, B, T, H, None, dev, kda, False),
            "is_capturing": lambda: torch.cuda.is_current_stream_capturing(),
            "o alloc": lambda: torch.empty_like(v),
            "plan lookups": lambda: (tp.prep_plan(B, T, H, None, kda, q.dtype, beta.dtype, dev),
                                     tp.state_plan(B, T, H, None, kda, q.dtype, False, False, n, dev)),
            "prep terms alloc": lambda: (torch.empty((4, B, T, H, 128), dtype=q.dtype, device=dev),
                                         torch.empty((B, T, H, 64), dtype=q.dtype, device=dev),
                                         torch.empty((B, T, H, 128) if kda else (B, T, H), dtype=torch.float32,
                                                     device=dev)),
            "prep run (alloc + launch)": lambda: prep_plan.run(q, k, v, g32, beta, 0.1),
            "state run (launch)": lambda: state_plan.run(prep, None, o, None),
        }
        line = [f"{name} {host_issue_us(fn, 50):.1f}" for name, fn in parts.items()]
        la.TWO_PHASE = "auto"
        print(f"{'kda' if kda else 'gdn'} B={B} H={H} T={T} two-phase host us: " + " | ".join(line), flush=True)


def paths():
    """The two paths of scheduler=None: eager (back-to-back calls, host clock), host time alone, and GPU time
    (do_bench); then the path "auto" takes for an eager call."""
    ffi_args()
    for kda in (False, True):
        op = ck.chunk_kda if kda else ck.chunk_gated_delta_rule
        for B, H, T in [(1, 4, 64), (1, 4, 128), (1, 4, 256), (1, 4, 1024), (1, 4, 4096)]:
            q, k, v, g, beta = inputs(B, T, H, kda)
            call = lambda: op(q, k, v, g, beta)  # noqa: E731
            line = []
            for mode in ("0", "1"):
                la.TWO_PHASE = mode
                call()
                line.append(f"{'two-phase' if mode == '1' else 'fused'} eager {per_call_us(call, 500):.1f} us, host "
                            f"{host_issue_us(call, 50):.1f}, gpu (graph) {graph_us(call):.1f} us")
            la.TWO_PHASE = "auto"
            call()
            _, ran = la._last_choice
            line.append(f"auto eager: {'two-phase' if ran else 'fused'} {per_call_us(call, 500):.1f} us")
            print(f"{'kda' if kda else 'gdn'} B={B} H={H} T={T}: " + " | ".join(line), flush=True)
    two_phase_breakdown()
    return 0


if __name__ == "__main__":
    sys.exit(paths() if sys.argv[1:] == ["paths"] else main())
