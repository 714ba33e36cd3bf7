"""Time the chunked forward's paths, phases and merges on the GPU (GPU time from CUDA-graph replay, eager time
beside it); prints one line each, as it goes.

    python3 scripts/time_paths.py paths    [B,H,T;...]   # each path pinned (fused, two-phase, overlapped) and the
                                                        # planner's choice, GDN and KDA
    python3 scripts/time_paths.py phases   [B,H,T;...]   # phase 1 and the state pass alone
    python3 scripts/time_paths.py merges                 # every affine-merge impl, and lse_merge
    python3 scripts/time_paths.py host                   # an eager call's wall time at small T (host-bound)
    python3 scripts/time_paths.py decode   [B,Hq,Hkv,L[,r];...] # split-KV decode (r: ragged lengths): the
                                                        # default plan, each split count forced, 2-8 waves,
                                                        # 3 / 4 ring stages, stream-K, torch SDPA and a
                                                        # torch reduction over the K / V bytes (one plain
                                                        # read) beside (decode and steps: input sets rotated
                                                        # past the L2, many calls a graph, as the sweeps)
    python3 scripts/time_paths.py steps    [B,HV,Sq;...]    # GDN decode step (engine form: pool, gates and
                                                        # l2norm in the kernel, GVA 2) on tensor cores and
                                                        # token by token, whatever the planner's rule

Cells default to a few seed cells; TIME_OPS=gdn,kda picks the ops, TIME_PATHS=fused,auto the paths of `paths`.
"""

from __future__ import annotations

import os
import sys
import time

import torch

from benchmarks.sweep import graph_replay_us, input_set_count, l2_size, rotating

CELLS = "1,4,1024;1,4,16384;1,16,4096;2,16,8192;16,64,4096"


def graph_us(fn) -> float:
    """Median GPU time of one call of `fn`, from 20 replays of a CUDA graph of it (no host launch gaps)."""
    return graph_replay_us(fn, calls=1, replays=20, warmup=3)


def rotated_graph_us(call, sets: list) -> float:
    """GPU time per call of `call(x)` over the input sets in turn, many calls captured in one CUDA graph (the
    decode sweep's method: no call finds its inputs left in L2 by the one before, no launch gap between calls)."""
    return graph_replay_us(rotating(call, sets), calls=max(20, 2 * len(sets)), replays=7, warmup=len(sets) + 1)


def eager_us(fn, reps: int = 20) -> float:
    """Median wall time of an eager call, synchronized (host and GPU together)."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e6)
    return sorted(times)[len(times) // 2]


def inputs(B, T, H, kda, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(B, T, H, 128, generator=gen), dim=-1).bfloat16().cuda()
    k = torch.nn.functional.normalize(torch.randn(B, T, H, 128, generator=gen), dim=-1).bfloat16().cuda()
    v = torch.randn(B, T, H, 128, generator=gen).bfloat16().cuda()
    g = torch.nn.functional.logsigmoid(torch.randn((B, T, H, 128) if kda else (B, T, H), generator=gen)).cuda()
    beta = torch.sigmoid(torch.randn(B, T, H, generator=gen)).bfloat16().cuda()
    return q, k, v, g, beta


def cells(arg: str | None):
    return [tuple(int(x) for x in c.split(",")) for c in (arg or CELLS).split(";")]


def ops():
    return [op == "kda" for op in os.environ.get("TIME_OPS", "gdn,kda").split(",")]


def paths(arg):
    import cute_kernels.ops.linear_attention as la
    from cute_kernels.plan import PlanOptions

    options = {"fused": PlanOptions("fused"), "two_phase": PlanOptions("two_phase", overlap="never"),
               "overlap": PlanOptions("two_phase", overlap="always"), "auto": PlanOptions("auto")}
    for kda in ops():
        for B, H, T in cells(arg):
            x = inputs(B, T, H, kda)
            line = []
            for name, opt in options.items():
                if name not in os.environ.get("TIME_PATHS", "fused,two_phase,overlap,auto").split(","):
                    continue
                call = lambda opt=opt: la.forward(*x, None, None, False, None, False, None, None,  # noqa: E731
                                                  kda=kda, options=opt)
                call()
                ran = la._last[1]
                if name == "overlap" and ran != "overlap":
                    continue
                line.append(f"{name} {graph_us(call):.1f} us (eager {eager_us(call):.1f})"
                            + (f" [ran {ran}, N={la._last[0].segments}]" if name == "auto" else ""))
            print(f"{'kda' if kda else 'gdn'} B={B} H={H} T={T}: " + " | ".join(line), flush=True)


def phases(arg):
    from cute_kernels.paths import two_phase

    for kda in ops():
        for B, H, T in cells(arg):
            q, k, v, g, beta = inputs(B, T, H, kda)
            terms = two_phase.chunk_prep(q, k, v, g, beta, kda=kda)
            t1 = graph_us(lambda: two_phase.chunk_prep(q, k, v, g, beta, kda=kda))
            t2 = graph_us(lambda: two_phase.state_pass(terms, output_final_state=True))
            chunks = B * H * -(-T // 64)
            print(f"{'kda' if kda else 'gdn'} B={B} H={H} T={T}: phase 1 {t1:.1f} us, state pass (unsplit) "
                  f"{t2:.1f} us ({t2 / -(-T // 64):.2f} us per chunk of the chain; {chunks} chunks)", flush=True)


def merges():
    import cute_kernels as ck

    for impl in ("staged", "prefetch", "regs", "tc"):
        for N, S, H in [(1, 32, 4), (4, 8, 16), (1, 8, 8)]:
            M = torch.randn(N * S, H, 128, 128, device="cuda") * 0.05
            h = torch.randn(N * S, H, 128, 128, device="cuda")
            offs = torch.arange(0, N * S + 1, S, device="cuda", dtype=torch.int32)
            t = graph_us(lambda: ck.affine_merge(M, h, offs, impl=impl))
            print(f"affine_merge[{impl}] N={N} segments={S} H={H}: {t:.1f} us ({t / S:.2f} per segment)", flush=True)
    for S, R in [(16, 4 * 32), (8, 64 * 32)]:
        o = torch.randn(S, R, 128, device="cuda")
        lse = torch.randn(S, R, device="cuda")
        print(f"lse_merge splits={S} rows={R}: {graph_us(lambda: ck.lse_merge(o, lse)):.1f} us", flush=True)


def host():
    import cute_kernels as ck

    for kda in ops():
        op = ck.chunk_kda if kda else ck.chunk_gated_delta_rule
        for T in (64, 128, 256):
            x = inputs(1, T, 4, kda)
            print(f"{'kda' if kda else 'gdn'} B=1 H=4 T={T}: eager {eager_us(lambda: op(*x)):.1f} us, graph "
                  f"{graph_us(lambda: op(*x)):.1f} us ({ck.last_plan().splitlines()[-1]})", flush=True)


DECODE_CELLS = ("1,32,8,512;1,32,8,1024;1,32,8,4096;1,32,8,16384;2,32,8,1024;2,32,8,4096;4,32,8,4096;8,32,8,4096;"
                "1,32,4,4096;16,32,4,512;8,32,8,512;2,32,32,1024;16,32,8,1024")
SPLITS = (1, 2, 4, 8, 16, 32, 64)
WAVES = (2, 4, 8)


def decode(arg):
    import torch.nn.functional as F

    import cute_kernels as ck
    from cute_kernels.ops import decode as dec
    from schedulers.splitkv import SplitKVScheduler, StreamKScheduler

    for cell in (arg or DECODE_CELLS).split(";"):
        fields = cell.split(",")
        B, Hq, Hkv, L = (int(x) for x in fields[:4])
        ragged = fields[4:] == ["r"]   # lengths uniform in [1, L], the first row at L (as the sweep's ragged cells)
        gen = torch.Generator().manual_seed(0)
        n_sets = input_set_count(2 * B * L * Hkv * 128 * 2, l2_size())
        sets = []
        for _ in range(n_sets):   # K and V as the halves of one buffer, so one reduction reads them both
            kv = torch.randn(2, B, L, Hkv, 128, generator=gen).bfloat16().cuda()
            sets.append({"q": torch.randn(B, Hq, 128, generator=gen).bfloat16().cuda(), "kv": kv, "k": kv[0],
                         "v": kv[1]})
        lens = torch.full((B,), L, dtype=torch.int32)
        if ragged:
            lens = torch.randint(1, L + 1, (B,), generator=gen, dtype=torch.int32)
            lens[0] = L
        lens = lens.cuda()
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        schedulers = [("default", None)] + [(f"{n} splits", SplitKVScheduler(num_splits=n)) for n in SPLITS
                                           if L // n >= 64 and n * B * Hkv <= 4 * sms]
        schedulers += [(f"{w} waves", SplitKVScheduler(waves=w)) for w in WAVES]
        schedulers.append(("stream-k", StreamKScheduler()))
        line = []
        for name, sched in schedulers:
            call = lambda x, s=sched: ck.decode_attention(x["q"], x["k"], x["v"], lens, scheduler=s,  # noqa: E731
                                                          max_seqlen=L)
            call(sets[0])
            splits = ck.last_plan().splitlines()[1].split("; ")[-1] if name in ("default", "stream-k") or \
                "waves" in name else ""
            line.append(f"{name} {rotated_graph_us(call, sets):.1f}" + (f" ({splits})" if splits else ""))
        # the default plan with its K / V ring forced to 2, 3 and 4 stages (`DecodeConfig.stages`; the planner's
        # `ring_stages`): more bytes in flight per CTA where DRAM's latency, not the L2's, sets how fast a CTA's
        # blocks arrive (and one unsplit CTA per unit with the deepest ring: no merge, the same bytes in flight)
        planned_stages = dec.ring_stages
        for stages, tag, sched in ((2, "", None), (3, "", None), (4, "", None),
                                   (4, "1 split, ", SplitKVScheduler(num_splits=1))):
            dec.ring_stages = lambda *_, n=stages: n
            dec._plans.clear()
            try:
                call = lambda x, s=sched: ck.decode_attention(x["q"], x["k"], x["v"], lens, max_seqlen=L,  # noqa: E731
                                                              scheduler=s)
                call(sets[0])
                line.append(f"{tag}{stages} stages {rotated_graph_us(call, sets):.1f}")
            finally:
                dec.ring_stages = planned_stages
                dec._plans.clear()
        mask = None
        if ragged:
            mask = (torch.arange(L, device="cuda")[None, :] < lens[:, None])[:, None, None, :]
        sdpa = lambda x: F.scaled_dot_product_attention(x["q"][:, :, None], x["k"].transpose(1, 2),  # noqa: E731
                                                       x["v"].transpose(1, 2), attn_mask=mask, enable_gqa=True)
        line.append(f"sdpa {rotated_graph_us(sdpa, sets):.1f}")
        # the same K / V bytes read by one torch reduction (one launch): what a plain read of them costs here
        line.append(f"read {rotated_graph_us(lambda x: x['kv'].sum(dtype=torch.float32), sets):.1f}")
        print(f"decode B={B} Hq={Hq} Hkv={Hkv} L={L}{' ragged' if ragged else ''} ({n_sets} input sets; us): "
              + " | ".join(line), flush=True)


STEP_CELLS = "256,32,1;256,32,2;256,32,4;256,32,8;32,32,8;32,8,8;8,8,8;1,8,8"


def steps(arg):
    """The GDN decode step in the benchmark's engine form, with the tensor-core rule forced each way."""
    import cute_kernels as ck
    from benchmarks.recurrent_decode import StepCell, make_inputs, ours
    from cute_kernels.ops import recurrent as rec

    planned = rec.use_tensor_cores
    for B, HV, Sq in cells(arg or STEP_CELLS):
        cell = StepCell(B=B, H=HV, Sq=Sq)
        n_sets = input_set_count(cell.state_bytes() // 2, l2_size())
        calls = [ours(False)(make_inputs(cell, False, "cuda", seed=i), cell) for i in range(n_sets)]
        line = []
        forced = lambda kda, varlen, spec, T, items: not (kda or varlen or spec) and 2 <= T <= 8  # noqa: E731
        for name, rule in (("planned", planned), ("tensor cores", forced), ("token by token", lambda *a: False)):
            rec.use_tensor_cores = rule
            try:
                calls[0]()
                us = rotated_graph_us(lambda call: call(), calls)
                line.append(f"{name} {us:.1f} us ({cell.state_bytes() / us / 1e6:.2f} TB/s)")
            finally:
                rec.use_tensor_cores = planned
        print(f"gdn step B={B} HV={HV} Sq={Sq} ({n_sets} input sets): " + " | ".join(line), flush=True)


if __name__ == "__main__":
    mode, arg = (sys.argv + [None, None])[1:3]
    {"paths": paths, "phases": phases, "merges": lambda _: merges(), "host": lambda _: host(),
     "decode": decode, "steps": steps}[mode or "paths"](arg)
