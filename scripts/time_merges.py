"""Time the merge kernels on the GPU against their byte floors; prints one line each. Affine merges: GPU time from
CUDA-graph replay (time_two_phase.graph_us: a short merge would otherwise time the host checks); LSE merges:
do_bench medians.

    python3 scripts/time_merges.py            # every variant in MERGE_IMPLS, then the LSE merges
    python3 scripts/time_merges.py profile    # the regs merge's cycles per link by phase (its profile build)
"""

import os
import sys

import torch
import triton.testing as tt

import cute_kernels as ck
from time_two_phase import graph_us
import cute_kernels.ops.merge as merge_ops

BW = 4.2e12
dev = "cuda"
IMPLS = os.environ.get("MERGE_IMPLS", "simt,staged,prefetch,ring,regs,tc").split(",")



def profile_regs():
    """The regs merge's profile build (thread 0 of each CTA, clock64 per phase of every link), mean over CTAs, next to
    the plain build's GPU time per link."""
    from cute_kernels.ops.merge import compile_affine_merge

    fn = compile_affine_merge(128, 128, False, "regs", profile=True).fn
    names = ("M/h copy (load wait)", "next loads + start store", "products", "butterfly + tile store", "barrier")
    for N, S, H in [(1, 32, 4), (1, 16, 4), (1, 8, 8)]:
        M = torch.randn(N * S, H, 128, 128, device=dev) * 0.05
        h = torch.randn(N * S, H, 128, 128, device=dev)
        offs = torch.arange(0, N * S + 1, S, device=dev, dtype=torch.int32)
        starts = torch.empty_like(h)
        final = torch.zeros(N, H, 128, 128, device=dev)
        fn(M, h, offs, final, starts, final, offs)
        torch.cuda.synchronize()
        stamps = final[:, :, :6, ::8].double()          # [N, H, 6, V / 8]
        links = stamps[:, :, 5].mean().item()
        cyc = [stamps[:, :, p].mean().item() / links for p in range(5)]
        merge_ops.AFFINE_MERGE_IMPL = "regs"
        t = graph_us(lambda: ck.affine_merge(M, h, offs))
        print(f"regs profile N={N} segs={S} H={H}: plain build {t / S:.2f} us per link | cycles per link: "
              + ", ".join(f"{n} {c:.0f}" for n, c in zip(names, cyc)) + f" (sum {sum(cyc):.0f})", flush=True)


if len(sys.argv) == 2 and sys.argv[1] == "profile":
    profile_regs()
    sys.exit(0)

for impl, N, S, H in [(i, n, s, h) for i in IMPLS for n, s, h in [(1, 32, 4), (4, 8, 16), (1, 16, 4), (1, 8, 8)]]:
    merge_ops.AFFINE_MERGE_IMPL = impl
    M = torch.randn(N * S, H, 128, 128, device=dev) * 0.05
    h = torch.randn(N * S, H, 128, 128, device=dev)
    offs = torch.arange(0, N * S + 1, S, device=dev, dtype=torch.int32)
    ck.affine_merge(M, h, offs)
    t = graph_us(lambda: ck.affine_merge(M, h, offs))
    bytes_ = (M.numel() + 2 * h.numel()) * 4
    print(f"affine_merge[{impl}] N={N} segs={S} H={H}: {t:.1f} us ({t / S:.2f} per segment), floor {bytes_ / BW * 1e6:.1f} us (bytes), "
          f"{N * S * H * 2 * 128**3 / t / 1e6:.2f} TFLOP/s fp32")
for S, R in [(16, 4 * 32), (8, 64 * 32)]:
    o = torch.randn(S, R, 128, device=dev)
    lse = torch.randn(S, R, device=dev)
    ck.lse_merge(o, lse)
    t = tt.do_bench(lambda: ck.lse_merge(o, lse), warmup=25, rep=100, return_mode="median") * 1e3
    bytes_ = o.numel() * 4 + lse.numel() * 4 + R * 128 * 2
    print(f"lse_merge splits={S} rows={R}: {t:.1f} us, floor {bytes_ / BW * 1e6:.2f} us")
