"""Small calls of every default path, for compute-sanitizer (memcheck, racecheck, synccheck):

    compute-sanitizer --tool memcheck python3 scripts/sanitize_cases.py [gdn|kda|decode|gdn-fused|kda-fused ...]

Cases (GDN and KDA, weak gates, bf16): fused; fused with segments (summary launch, affine merge, outputs); two-phase;
two-phase with a segmented state pass and its merge; the overlapped path with its flags; varlen on both paths. Each
output is checked against the float64 reference (loose: the point is the sanitizer's report), so a case that
runs but computes garbage fails too. `decode`: split-KV decode attention with its in-kernel fixup (the cross-CTA
counters), contiguous and paged, both schedulers. `gdn-fused` / `kda-fused` (SM100): the fused cases only. Exits
1 if any case fails.
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from inputs import initial_state, make_inputs

from cute_kernels.ops import linear_attention as la
from cute_kernels.plan import PlanOptions
from cute_kernels.reference import chunk_gated_delta_rule_ref
from schedulers import SegmentScheduler
from schedulers.splitkv import SplitKVScheduler, StreamKScheduler

DEVICE = "cuda"
FUSED = PlanOptions("fused")
TWO_PHASE = PlanOptions("two_phase", overlap="never")
OVERLAP = PlanOptions("two_phase", overlap="always")
# name: (options, scheduler, B, T, H, cu_seqlens, the path the plan must take)
CASES = {
    "fused": (FUSED, None, 1, 256, 2, None, "fused"),
    "fused-segments": (FUSED, SegmentScheduler(num_segments=3), 1, 512, 2, None, "fused"),
    "two-phase": (TWO_PHASE, None, 1, 256, 2, None, "two_phase"),
    "two-phase-segments": (TWO_PHASE, SegmentScheduler(num_segments=3), 1, 512, 2, None, "two_phase"),
    "overlap": (OVERLAP, None, 1, 512, 2, None, "overlap"),
    "varlen-fused": (FUSED, None, 1, 300, 2, (0, 100, 300), "fused"),
    "varlen-two-phase": (TWO_PHASE, None, 1, 300, 2, (0, 100, 300), "two_phase"),
}


def run(op: str, name: str) -> bool:
    options, scheduler, B, T, H, cu, want_path = CASES[name]
    kda = op == "kda"
    gen = torch.Generator().manual_seed(0)
    q, k, v, g, beta = make_inputs(B, T, H, gen, DEVICE, kda=kda, regime="weak")
    N = B if cu is None else len(cu) - 1
    s0 = initial_state(N, H, gen, DEVICE)
    cu_t = None if cu is None else torch.tensor(cu, dtype=torch.int32, device=DEVICE)
    o, s = la.forward(q, k, v, g, beta, None, s0, True, cu_t, False, scheduler, None, kda=kda, options=options)
    torch.cuda.synchronize()
    ran = la._last[1]
    ref_o, ref_s = chunk_gated_delta_rule_ref(q, k, v, g, beta, initial_state=s0, output_final_state=True,
                                              cu_seqlens=cu_t)
    err_o = ((o.double() - ref_o).abs().max() / ref_o.abs().max()).item()
    err_s = ((s.double() - ref_s).abs().max() / ref_s.abs().max()).item()
    ok = ran == want_path and err_o < 2e-2 and err_s < 2e-2   # NaN fails both comparisons
    print(f"{op} {name:20s} path {ran:9s} rel err o {err_o:.2e} state {err_s:.2e} {'ok' if ok else 'FAIL'}",
          flush=True)
    return ok


# name: (scheduler, page_size or None, kv lengths): several splits per unit, ragged lengths with 0 and 1
DECODE_CASES = {
    "split-kv": (SplitKVScheduler(num_splits=3), None, [0, 1, 700, 1500]),
    "stream-k": (StreamKScheduler(ctas=5), None, [0, 1, 700, 1500]),
    "paged-split-kv": (SplitKVScheduler(num_splits=3), 16, [0, 1, 700, 1500]),
    "paged-stream-k": (StreamKScheduler(ctas=7), 64, [0, 1, 700, 1500]),
}


def run_decode(name: str) -> bool:
    from cute_kernels import decode_attention
    from cute_kernels.reference import decode_attention_ref

    scheduler, page_size, lens = DECODE_CASES[name]
    gen = torch.Generator().manual_seed(0)
    B, Hq, Hkv, D, Tmax = len(lens), 8, 2, 128, max(lens)
    q = torch.randn(B, Hq, D, generator=gen).bfloat16()
    table = None
    if page_size is None:
        k, v = (torch.randn(B, Tmax, Hkv, D, generator=gen).bfloat16() for _ in range(2))
    else:
        pages = -(-Tmax // page_size)
        table = torch.randperm(2 * B * pages, generator=gen)[: B * pages].view(B, pages).int()
        k, v = (torch.randn(2 * B * pages, page_size, Hkv, D, generator=gen).bfloat16() for _ in range(2))
    seqlens = torch.tensor(lens, dtype=torch.int32)
    ref_o, _ = decode_attention_ref(q, k, v, seqlens, table)
    o = decode_attention(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), seqlens.to(DEVICE),
                         page_table=None if table is None else table.to(DEVICE), scheduler=scheduler)
    torch.cuda.synchronize()
    err = ((o.cpu().double() - ref_o).norm() / ref_o.norm()).item()
    ok = err < 2e-2
    print(f"decode {name:17s} rel err o {err:.2e} {'ok' if ok else 'FAIL'}", flush=True)
    return ok


def main(argv) -> int:
    ops = argv or ["gdn", "kda", "decode"]
    results = [run(op, name) for op in ops if op in ("gdn", "kda") for name in CASES]
    for op in ("gdn", "kda"):   # SM100: the fused path's cases only (it has no two-phase path)
        if f"{op}-fused" in ops:
            results += [run(op, name) for name in CASES if CASES[name][-1] == "fused"]
    if "decode" in ops:
        results += [run_decode(name) for name in DECODE_CASES]
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
