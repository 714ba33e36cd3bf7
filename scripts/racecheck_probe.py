"""Which of our kernels' synchronization patterns compute-sanitizer's racecheck models, on kernels small enough to
be obviously right or wrong. Run on the GPU machine:

    compute-sanitizer --tool racecheck python3 scripts/racecheck_probe.py [PATTERN ...]

Each pattern hands a shared-memory tile from some threads to others and checks the values that arrive; the
racecheck report then says which hand-offs it sees as synchronized. Patterns:
  named_barrier      384 threads, warpgroup 0 exits, warpgroups 1 and 2 trade tiles through `bar.sync 1, 256`
                     (the fused and prep kernels' consumer barrier), both ways, over several rounds
  named_barrier_regs the same with `setmaxnreg` (down 40 in warpgroup 0, up 232 in the consumers)
  named_barrier_sub  named_barrier, each round opened by warps 4 and 5 joining through `bar.sync 4, 64` (how the
                     GDN gate scan joined its two warps until it moved to shuffles: racecheck then reported the
                     consumers' `bar.sync 1, 256` hand-offs as races)
  elected_arrive     a producer warp's 32 lanes store, `__syncwarp`, one elected lane arrives on a `full` mbarrier
                     (count 1); a consumer warpgroup waits, reads, and one lane per warp arrives on `empty`
                     (count 4); the producer waits on it and stores again (a TMA ring's slot written by threads)
  every_lane_arrive  the same with every thread arriving (`full` count 32, `empty` count 128)
"""

import os
import sys

ROUNDS = 4
N = 128   # floats per tile: one per consumer thread


def build(pattern: str):
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32

    threads = 256 if pattern in ("elected_arrive", "every_lane_arrive") else 384

    @cute.kernel
    def kernel(out: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        wg = cute.arch.make_warp_uniform(tidx // 128)
        smem = cutlass.memory.SmemAllocator()
        buf = smem.allocate_tensor(Float32, cute.make_layout(N), 16)
        scan = smem.allocate_tensor(Float32, cute.make_layout(2), 16)
        full = smem.allocate_array(cutlass.Int64, 1)
        empty = smem.allocate_array(cutlass.Int64, 1)
        if tidx == 0:
            elected = cutlass.const_expr(pattern == "elected_arrive")
            cute.arch.mbarrier_init(full, 1 if elected else 32)
            cute.arch.mbarrier_init(empty, 4 if elected else 128)
        cute.arch.mbarrier_init_fence()
        cute.arch.barrier()
        if cutlass.const_expr(pattern.startswith("named_barrier")):
            if wg == 0:
                if cutlass.const_expr(pattern == "named_barrier_regs"):
                    cute.arch.setmaxregister_decrease(40)
            else:
                if cutlass.const_expr(pattern == "named_barrier_regs"):
                    cute.arch.setmaxregister_increase(232)
                i = tidx % 128
                for r in cutlass.range(ROUNDS, unroll=1):
                    if cutlass.const_expr(pattern == "named_barrier_sub"):
                        # warps 4 and 5 first join through a 64-thread barrier of their own (the old GDN gate scan)
                        if tidx < 192:
                            if tidx % 32 == 31:
                                scan[tidx // 32 - 4] = Float32(r)
                            cute.arch.barrier(barrier_id=4, number_of_threads=64)
                            out[ROUNDS, tidx - 128] = scan[0] + scan[1]
                    writer = 1 + r % 2   # the warpgroups take turns writing
                    if wg == writer:
                        buf[(i + 37 * r) % N] = Float32(r * 1000) + Float32(i)
                    cute.arch.barrier(barrier_id=1, number_of_threads=256)
                    if wg != writer:
                        j = (i + 37 * r) % N
                        out[r, j] = buf[j]
                    cute.arch.barrier(barrier_id=1, number_of_threads=256)
        else:
            # round 0: warp 0 stores, arrives on `full`; warpgroup 1 waits, reads, arrives on `empty`; round 1:
            # warp 0 waits on `empty` and overwrites the tile (the write after read a release must order)
            lane = tidx % 32
            elected = cutlass.const_expr(pattern == "elected_arrive")
            if tidx < 32:
                for r in cutlass.range_constexpr(2):
                    if cutlass.const_expr(r == 1):
                        cute.arch.mbarrier_wait(empty, 0)
                    buf[lane] = Float32(100 * r + lane)
                    if cutlass.const_expr(r == 0):
                        if cutlass.const_expr(elected):
                            cute.arch.sync_warp()
                            with cute.arch.elect_one():
                                cute.arch.mbarrier_arrive(full)
                        else:
                            cute.arch.mbarrier_arrive(full)
            if wg == 1:
                cute.arch.mbarrier_wait(full, 0)
                i = tidx % 128
                out[0, i] = buf[i % 32]
                if cutlass.const_expr(elected):
                    cute.arch.sync_warp()
                    if lane == 0:
                        cute.arch.mbarrier_arrive(empty)
                else:
                    cute.arch.mbarrier_arrive(empty)

    @cute.jit
    def launch(out: cute.Tensor):
        kernel(out).launch(grid=[1, 1, 1], block=[threads, 1, 1])

    return launch


def expected(pattern: str):
    import torch

    want = torch.zeros(ROUNDS, N)
    if pattern.startswith("named_barrier"):
        for r in range(ROUNDS):
            for i in range(N):
                want[r, (i + 37 * r) % N] = r * 1000 + i
    else:
        want[0] = torch.arange(N) % 32
    return want


PATTERNS = ("named_barrier", "named_barrier_regs", "named_barrier_sub", "elected_arrive", "every_lane_arrive")


def main(argv) -> int:
    import torch

    if torch.cuda.is_available():
        import cutlass.cute as cute
        from cutlass.cute.runtime import from_dlpack
    else:   # compile only (CPU): CUTE_DSL_ARCH must be set before cutlass is imported
        os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
        import cutlass.cute as cute
    bad = 0
    for pattern in argv or PATTERNS:
        launch = build(pattern)
        if not torch.cuda.is_available():
            import cutlass
            from cutlass.cute.runtime import make_fake_tensor

            cute.compile(launch, make_fake_tensor(cutlass.Float32, (ROUNDS + 1, N), stride=(N, 1)))
            print(f"{pattern:20s} compiled")
            continue
        out = torch.full((ROUNDS + 1, N), float("nan"), device="cuda")
        compiled = cute.compile(launch, from_dlpack(out))
        compiled(from_dlpack(out))
        torch.cuda.synchronize()
        got = out.cpu()
        ok = torch.equal(got[:ROUNDS], expected(pattern)) if pattern.startswith("named") else \
            torch.equal(got[0], expected(pattern)[0])
        if pattern == "named_barrier_sub":   # the last round's scan join: 2 * (ROUNDS - 1) in 64 columns
            ok = ok and bool((got[ROUNDS, :64] == 2 * (ROUNDS - 1)).all())
        bad += not ok
        print(f"{pattern:20s} {'ok' if ok else 'WRONG VALUES'}", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
